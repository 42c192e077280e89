"""Warming a node's Ray object store: its shared-memory pages allocated before the first
shuffle needs them.

Ray's object store is one shared-memory file per node (``/dev/shm/plasma...``), mapped by
every worker. Its pages are allocated when first written, and that first write is what
made a cluster's first shuffle slow: a first 1 GiB repartition on a 2-core VM took 430,000
page faults in the writers and readers (3.4 CPU-s of kernel time against 0.8-1.0 in a warm
round), with Ray's parallel memcpy threads of several processes faulting on the same file
at once. Allocating the pages ahead, from one thread of one process, costs a fraction of
that (``madvise(MADV_POPULATE_WRITE)``: 2 GiB in 1.3 s of one core here, against about
5.5 us per page in a first round); the workers then only map pages that exist.

``hybrid_ray.init`` has each node's tier manager do it in the background
(``ObjectStoreWarmUp``), so it overlaps whatever the driver does next (loading its data).
Ray's own ``--preallocate-plasma`` does this for the whole store at start-up, before
``ray.init`` returns (10 s instead of 2.8 s on this VM for its default 7 GiB store: see
the README's start-up section); this warms only the part a shuffle is likely to use. The
pages warmed are memory of the object store that Ray has reserved anyway: it stays with
the store (a tmpfs file) until Ray stops, as pages a shuffle wrote would.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from typing import Any

# madvise(2) advice values (Linux uapi; MADV_POPULATE_WRITE since Linux 5.14).
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23
# Pages are populated this many bytes per call, so a stop request ends the warm-up soon.
WARM_UP_CHUNK_BYTES = 64 << 20
# Default amount per node: at most this much, and at most half the node's object store.
DEFAULT_WARM_UP_BYTES = 4 << 30


def default_warm_up_bytes(object_store_bytes: int) -> int:
    """How much of a node's object store ``hybrid_ray.init`` warms by default: half of it,
    at most ``DEFAULT_WARM_UP_BYTES`` (the memory-tier segments and the reducers' output
    of a shuffle of a few GiB per node)."""
    return max(0, min(DEFAULT_WARM_UP_BYTES, object_store_bytes // 2))


# Filesystems whose files are memory: warming a store file elsewhere would write it to disk.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs"})


def object_store_mapping(maps_path: str = "/proc/self/maps"
                         ) -> tuple[int, int, str] | None:
    """(start, end, file) of this process's mapping of its node's object store: the
    largest shared mapping of a file whose name starts with ``plasma`` (Ray names the
    store file so, in ``/dev/shm`` or its plasma directory), or None."""
    best: tuple[int, int, str] | None = None
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or "s" not in fields[1]:
                    continue
                path = fields[5].strip().removesuffix(" (deleted)")
                if not os.path.basename(path).startswith("plasma"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if best is None or end - start > best[1] - best[0]:
                    best = (start, end, path)
    except OSError:
        return None
    return best


def filesystem_type(path: str, mountinfo_path: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it in
    ``mountinfo_path``), or None if unknown."""
    found, fstype = "", None
    try:
        with open(mountinfo_path) as mounts:
            for line in mounts:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(found):
                    found, fstype = mount_point, right.split()[0]
    except OSError:
        return None
    return fstype


def populate(start: int, nbytes: int, stop: threading.Event | None = None,
             chunk_bytes: int = WARM_UP_CHUNK_BYTES) -> int:
    """Allocate the pages of ``nbytes`` of a shared mapping from address ``start``
    (``MADV_POPULATE_WRITE``: as if each page were written, without changing a byte of
    its content, so objects stored there stay intact), then drop them from this process's
    page tables (``MADV_DONTNEED`` on a shared mapping keeps the file's pages). Returns
    the bytes populated (less if ``stop`` was set). Raises ``OSError`` if the kernel
    refuses (before Linux 5.14: EINVAL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    done = 0
    while done < nbytes and not (stop is not None and stop.is_set()):
        length = min(chunk_bytes, nbytes - done)
        for advice in (MADV_POPULATE_WRITE, MADV_DONTNEED):
            if libc.madvise(start + done, length, advice) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"madvise({advice}) of the object store: "
                                     f"{os.strerror(errno)}")
        done += length
    return done


@dataclasses.dataclass
class ObjectStoreWarmUp:
    """One node's object-store warm-up, run once in a background thread of its tier
    manager (``start``); ``state`` says how far it got (the tier manager's
    ``object_store_warm_up``)."""

    requested_bytes: int = 0
    warmed_bytes: int = 0
    seconds: float = 0.0
    done: bool = False
    error: str = ""
    maps_path: str = dataclasses.field(default="/proc/self/maps", repr=False)
    mountinfo_path: str = dataclasses.field(default="/proc/self/mountinfo", repr=False)
    _thread: threading.Thread | None = dataclasses.field(default=None, repr=False)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def start(self, nbytes: int) -> bool:
        """Warm ``nbytes`` of this process's object-store mapping in the background;
        False if a warm-up was started before (one per process: the pages stay warm)."""
        if self._thread is not None:
            return False
        self.requested_bytes = nbytes
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hybrid-ray-object-store-warm-up")
        self._thread.start()
        return True

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            mapping = object_store_mapping(self.maps_path)
            if mapping is None:
                self.error = ("this process has no mapping of the object store (no shared "
                              "'plasma' file in /proc/self/maps); nothing warmed")
                return
            start, end, path = mapping
            fstype = filesystem_type(os.path.dirname(path), self.mountinfo_path)
            if fstype not in MEMORY_FILESYSTEMS:
                # Ray puts the store in a disk-backed file when /dev/shm is too small (a
                # container's 64 MB default): populating it would write it all to disk.
                self.error = (f"the object store is a file on {fstype or 'an unknown'} "
                              f"filesystem ({path}), not in shared memory: warming it would "
                              "write it to disk; nothing warmed")
                return
            self.warmed_bytes = populate(start, min(self.requested_bytes, end - start),
                                         self._stop)
        except Exception as exc:  # noqa: BLE001 - a warm-up is only a head start: reported
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.seconds = time.perf_counter() - began
            self.done = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop a warm-up still running (at its next chunk) and wait for it, bounded."""
        self._stop.set()
        self.wait(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Wait for the warm-up to end, at most ``timeout_s``; whether it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.done

    def state(self) -> dict[str, Any]:
        return {"requested_bytes": self.requested_bytes, "warmed_bytes": self.warmed_bytes,
                "seconds": round(self.seconds, 3), "done": self.done, "error": self.error}
