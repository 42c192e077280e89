"""Disk tier: segment files in the node's local spill directories.

Before granting a segment it checks the real filesystem (``statvfs``): free space after the
segment, minus what other writers were granted but have not written yet, must stay above
``min_reserve_fraction`` of the filesystem (FLIP-301's reserve), and the optional byte cap
must hold. Files are written under a temporary name and renamed when complete, so a reader
never sees half a segment. Directories are 0700 and files 0600: shuffle data is private.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
from collections.abc import Sequence

import pyarrow as pa

from hybrid_ray.config import TierName
from hybrid_ray.errors import OutOfSpaceError, SegmentNotFoundError
from hybrid_ray.segment import SegmentId, SegmentMeta, segment_num_rows
from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME, Grant, Tier, shuffle_marker

# All of hybrid_ray's files live under this subdirectory of a spill dir, so cleanup never
# touches anything else a user keeps there.
DATA_DIR_NAME = "hybrid_ray"


def shuffle_dir(spill_dir: str, shuffle_id: str) -> str:
    return os.path.join(spill_dir, DATA_DIR_NAME, shuffle_id)


def segment_path(spill_dir: str, segment: SegmentId) -> str:
    return os.path.join(shuffle_dir(spill_dir, segment.shuffle_id),
                        f"sub-{segment.subpartition:05d}", segment.file_name)


class DiskTier(Tier):
    """Local spill directories with a statvfs-checked reserve and an optional byte cap."""

    name = TierName.DISK

    def __init__(self, segment_bytes: int, spill_dirs: Sequence[str],
                 min_reserve_fraction: float = 0.05, capacity_bytes: int | None = None) -> None:
        super().__init__(segment_bytes)
        if not spill_dirs:
            raise ValueError("spill_dirs must name at least one directory")
        self.spill_dirs = tuple(spill_dirs)
        self.min_reserve_fraction = min_reserve_fraction
        self._capacity = capacity_bytes
        # Bytes granted but not yet written, per (directory, shuffle): statvfs cannot see
        # them yet. Per shuffle so a dead writer's grants are dropped with its shuffle.
        self._in_flight: dict[tuple[str, str], int] = {}
        self._next_dir = itertools.cycle(range(len(self.spill_dirs)))
        for d in self.spill_dirs:
            _make_private_dir(os.path.join(d, DATA_DIR_NAME))

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @staticmethod
    def _unusable(spill_dir: str) -> str | None:
        """Why ``spill_dir`` cannot take files, or None. A missing directory is recreated
        (0700): the tier lives as long as its node's tier manager, and a spill dir can be
        removed under it between shuffles (a tmp cleaner, a user's ``rm -rf``)."""
        data_dir = os.path.join(spill_dir, DATA_DIR_NAME)
        if os.path.isdir(data_dir):
            return None
        try:
            _make_private_dir(data_dir)
        except OSError as exc:
            return (f"spill dir {spill_dir} cannot be used: {exc.strerror or exc}; point "
                    "spill_dirs at a writable directory")
        return None

    def _free_after(self, spill_dir: str, nbytes: int) -> tuple[int, int, int]:
        st = os.statvfs(spill_dir)
        free = st.f_bavail * st.f_frsize
        total = st.f_blocks * st.f_frsize
        reserve = int(self.min_reserve_fraction * total)
        in_flight = sum(v for (d, _), v in self._in_flight.items() if d == spill_dir)
        return free - in_flight - nbytes, reserve, free

    def _room_for(self, shuffle_id: str, nbytes: int) -> str | None:
        if self._capacity is not None and self.used_bytes + nbytes > self._capacity:
            return None
        # Round-robin over the directories that can take the segment.
        start = next(self._next_dir)
        n = len(self.spill_dirs)
        for i in range(n):
            spill_dir = self.spill_dirs[(start + i) % n]
            if self._unusable(spill_dir) is not None:
                continue
            free_after, reserve, _ = self._free_after(spill_dir, nbytes)
            if free_after >= reserve:
                key = (spill_dir, shuffle_id)
                self._in_flight[key] = self._in_flight.get(key, 0) + nbytes
                return spill_dir
        return None

    def _on_settled(self, shuffle_id: str, grant: Grant, written_bytes: int | None) -> None:
        key = (grant.target, shuffle_id)
        left = self._in_flight.get(key, 0) - grant.nbytes
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    def describe_refusal(self, nbytes: int) -> str:
        if self._capacity is not None and self.used_bytes + nbytes > self._capacity:
            return (f"disk tier cap reached: {self.used_bytes} of disk_capacity_bytes="
                    f"{self._capacity} used, segment needs {nbytes} bytes")
        parts = []
        unusable = False
        for d in self.spill_dirs:
            problem = self._unusable(d)
            if problem is not None:
                parts.append(problem)
                unusable = True
                continue
            _, reserve, free = self._free_after(d, nbytes)
            parts.append(f"{d}: {free} bytes free, reserve {reserve} bytes "
                         f"(min_reserve_fraction={self.min_reserve_fraction})")
        what = "disk tier unavailable" if unusable else "disk tier full"
        return f"{what}: {'; '.join(parts)}; segment needs {nbytes} bytes"

    # ---- I/O ------------------------------------------------------------------------------
    def write(self, segment: SegmentId, payload: bytes, grant: Grant | None = None,
              node_id: str = "") -> SegmentMeta:
        spill_dir = grant.target if grant is not None and grant.target else self.spill_dirs[0]
        path = segment_path(spill_dir, segment)
        _make_private_dir(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.inprogress"
        try:
            write_shuffle_marker(shuffle_dir(spill_dir, segment.shuffle_id),
                                 segment.shuffle_id)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            unlink_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(
                    f"no space left in spill dir {spill_dir} while writing {segment} "
                    f"({len(payload)} bytes)") from exc
            raise
        return SegmentMeta(segment, self.name, len(payload), segment_num_rows(payload),
                           node_id=node_id, location=path)

    def read(self, meta: SegmentMeta) -> bytes:
        return read_segment_file(meta)

    def has(self, segment: SegmentId) -> bool:
        return any(os.path.exists(segment_path(d, segment)) for d in self.spill_dirs)

    def delete(self, meta: SegmentMeta) -> None:
        unlink_quietly(meta.location)

    def remove_shuffle_data(self, shuffle_id: str) -> None:
        for key in [k for k in self._in_flight if k[1] == shuffle_id]:
            del self._in_flight[key]
        for d in self.spill_dirs:
            shutil.rmtree(shuffle_dir(d, shuffle_id), ignore_errors=True)


def read_segment_file(meta: SegmentMeta) -> bytes:
    """Read a disk-tier segment file (any process on its node may do this)."""
    try:
        with open(meta.location, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise SegmentNotFoundError(
            f"{meta.id} is gone from the disk tier ({meta.location}): released or "
            "removed by cleanup") from exc


def map_segment_file(meta: SegmentMeta) -> pa.Buffer:
    """A disk-tier segment file of this node, memory-mapped: decoded without copying it
    out of the page cache. Safe to keep while the shuffle is released: segment files are
    only ever renamed into place whole and unlinked, never truncated, so the mapping stays
    valid until its last reader drops it."""
    try:
        with pa.memory_map(meta.location, "r") as mapped:
            return mapped.read_buffer()
    except FileNotFoundError as exc:
        raise SegmentNotFoundError(
            f"{meta.id} is gone from the disk tier ({meta.location}): released or "
            "removed by cleanup") from exc


def write_shuffle_marker(directory: str, shuffle_id: str) -> None:
    """Mark ``directory`` as a hybrid_ray shuffle directory (``SHUFFLE_MARKER_NAME``), once:
    cleanup removes only marked directories. A stat per segment checks it, so a directory
    removed and recreated under a late writer is marked again. Written whole and renamed."""
    marker = os.path.join(directory, SHUFFLE_MARKER_NAME)
    if os.path.exists(marker):
        return
    tmp = f"{marker}.{os.getpid()}.inprogress"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, shuffle_marker(shuffle_id))
        finally:
            os.close(fd)
        os.replace(tmp, marker)
    except OSError:
        unlink_quietly(tmp)
        raise


def _make_private_dir(path: str) -> None:
    """Create ``path`` and any missing parents as 0700 (``os.makedirs`` only sets the leaf)."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _make_private_dir(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
