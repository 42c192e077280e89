"""The machine's own limits, measured by the suite so ratios can be read against them, and
the shuffle floor computed from them.

Every measurement returns a ``Limit``: bytes moved, the seconds they took and a note, so
a report shows how long a measurement ran (a 0.00 s "limit" is no measurement). Rates
are in MB/s (10^6 bytes) of the bytes named in each function: for the per-row steps
(hash, take, concat) the bytes of the gensort table they process, so the steps add up
into CPU-seconds per GiB of shuffled data (``shuffle_floor``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

MB = 1_000_000
GiB = 1024**3


@dataclasses.dataclass
class Limit:
    nbytes: int
    seconds: float
    note: str = ""
    rounds: list[float] | None = None  # MB/s of every repeat, first one first

    @property
    def mb_s(self) -> float:
        return self.nbytes / MB / self.seconds


def _best_of(repeats: int, nbytes: int, once: Callable[[], float], note: str) -> Limit:
    """Run ``once`` (returns its own seconds) ``repeats`` times; the fastest counts, every
    repeat's rate is kept (the first is the cold one)."""
    seconds = [once() for _ in range(repeats)]
    return Limit(nbytes, min(seconds), note, [nbytes / MB / s for s in seconds])


# ---- disk -------------------------------------------------------------------------------------
def disk_write(directory: str | None = None, nbytes: int = GiB,
               chunk: int = 8 * 1024 * 1024, repeats: int = 2) -> Limit:
    """Sequential write to ``directory``: ``chunk``-byte writes, each fdatasync'd before the
    next, so every byte reached the device inside the timed loop (a single fsync at the
    end of a write that fits the page cache measured the page cache: 1315 MB/s in 0.00 s).
    The chunks differ (a counter in their first bytes): no dedup or compression below the
    file system can skip them. Each repeat writes a new file (the first also allocates
    the file system's blocks cold)."""
    block = bytearray(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8)
                      .tobytes())
    count = max(1, nbytes // chunk)

    def once() -> float:
        fd, path = tempfile.mkstemp(prefix="hr-bench-disk-", dir=directory)
        try:
            start = time.perf_counter()
            for i in range(count):
                block[:8] = i.to_bytes(8, "little")
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
                os.fdatasync(fd)
            return time.perf_counter() - start
        finally:
            os.close(fd)
            os.unlink(path)
    return _best_of(repeats, count * chunk, once,
                    f"{count} x {chunk >> 20} MiB writes, fdatasync after each")


# ---- memory -----------------------------------------------------------------------------------
def memcpy_warm(nbytes: int = 512 * 1024 * 1024, repeats: int = 3) -> Limit:
    """Single-threaded copy into a destination whose pages are already mapped (touched by
    the copy before): the copy alone."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)  # zeros_like writes every page: no first touch in the timing

    def once() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start
    return _best_of(repeats, nbytes, once, "single thread, destination pages touched")


def memcpy_fresh(nbytes: int = 512 * 1024 * 1024, repeats: int = 3) -> Limit:
    """Single-threaded copy into freshly allocated memory: every destination page faults in
    (and is zeroed by the kernel) during the copy, as a new buffer of a shuffle's output
    does."""
    src = np.ones(nbytes, dtype=np.uint8)

    def once() -> float:
        start = time.perf_counter()
        dst = np.empty_like(src)  # large: mmap'd, no page mapped yet
        np.copyto(dst, src)
        seconds = time.perf_counter() - start
        del dst  # unmapped: the next repeat faults its pages in again
        return seconds
    return _best_of(repeats, nbytes, once, "single thread, fresh pages (faulted in)")


# ---- the shuffle's steps, on one gensort block ------------------------------------------------
def _gensort_block(nbytes: int):
    from benchmarks.workloads import generate

    blocks = generate("gensort", nbytes, seed=12345)
    import pyarrow as pa

    return pa.concat_tables(blocks).combine_chunks()


def hash_key(nbytes: int = 64 * 1024 * 1024, repeats: int = 3) -> Limit:
    """hybrid_ray's key hash (``hash_column``: 8-byte words of the 10-byte key, mixed) and
    the partition of each row, over a gensort block; rate in table bytes."""
    from hybrid_ray.partitioning import _to_partitions, hash_column

    table = _gensort_block(nbytes)
    key = table.column("key")

    def once() -> float:
        start = time.perf_counter()
        _to_partitions(hash_column(key), 16)
        return time.perf_counter() - start
    return _best_of(repeats, table.nbytes, once, "hash_column(key) + partition of 16, "
                    "single thread, MB of 100-byte rows")


def take_gather(nbytes: int = 64 * 1024 * 1024, repeats: int = 3) -> Limit:
    """The map side's grouping of rows by partition (``split_by_partition``): a stable
    argsort of the partition ids and one ``take`` gathering every row; rate in table
    bytes."""
    import pyarrow as pa

    table = _gensort_block(nbytes)
    parts = np.random.default_rng(1).integers(0, 16, table.num_rows).astype(np.uint8)

    def once() -> float:
        start = time.perf_counter()
        table.take(pa.array(np.argsort(parts, kind="stable")))
        return time.perf_counter() - start
    return _best_of(repeats, table.nbytes, once, "argsort by partition + take, single thread")


def reducer_concat(nbytes: int = 64 * 1024 * 1024, pieces: int = 32,
                   repeats: int = 3) -> Limit:
    """A reducer's assembly of its partition: ``pieces`` slices (one per map) concatenated
    into one contiguous table (one copy of every byte); rate in table bytes."""
    import pyarrow as pa

    table = _gensort_block(nbytes)
    step = -(-table.num_rows // pieces)
    parts = [table.slice(i, step) for i in range(0, table.num_rows, step)]

    def once() -> float:
        start = time.perf_counter()
        pa.concat_tables(parts).combine_chunks()
        return time.perf_counter() - start
    return _best_of(repeats, table.nbytes, once,
                    f"concat of {len(parts)} pieces + combine_chunks, single thread")


def ray_put(sizes: Sequence[int] = (4 << 20, 8 << 20, 16 << 20),
            total: int = 512 * 1024 * 1024) -> dict[int, Limit]:
    """``ray.put`` of numpy buffers of each size into the object store of the running Ray
    (the caller's ``ray.init``), ``total`` bytes per size: once to warm the store's pages
    (untimed), then timed into the warm store. Returns {buffer size: Limit}."""
    import ray

    out = {}
    for size in sizes:
        buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        count = max(1, total // size)

        def once() -> float:
            start = time.perf_counter()
            refs = [ray.put(buf) for _ in range(count)]
            seconds = time.perf_counter() - start
            del refs
            return seconds
        once()  # warm: the store's pages for these objects are touched once, untimed
        time.sleep(0.2)  # let the freed objects go before the timed puts
        out[size] = _best_of(3, count * size, once,
                             f"{count} x {size >> 20} MiB into a warm object store")
    return out


def ray_cross_node(source_node: str, target_node: str, total: int = 512 * 1024 * 1024,
                   object_bytes: int = 4 << 20, repeats: int = 3) -> Limit:
    """Objects moved between two nodes of the running Ray (the caller's ``ray.init`` into
    a cluster with both): an actor on ``source_node`` puts ``total`` bytes as objects of
    ``object_bytes`` (untimed), a task on ``target_node`` gets each of them (Ray's object
    manager pulls it: chunks over gRPC, a copy into the target's store).

    On simulated nodes sharing one machine's cores this is the CPU a multi-node shuffle
    spends on every byte it moves between nodes and a one-node shuffle never spends, so
    the rate is per CPU-second, like the floor's steps: bytes over the CPU-seconds the
    transfer's processes used (every raylet, the receiving worker, the owner answering
    where its objects are); ``seconds`` are those CPU-seconds, the note gives the
    wall-clock rate. Every repeat moves new objects (a pulled object stays on the target
    until freed)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from benchmarks.cpu_by_process import cpu_between, cpu_snapshot

    if source_node == target_node:
        raise ValueError("the source and target nodes must differ")
    count = max(1, total // object_bytes)

    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        source_node, soft=False))
    class Source:
        def pid(self) -> int:
            return os.getpid()

        def put(self, seed: int) -> list:
            return [[ray.put(np.full(object_bytes, (seed + i) % 251, dtype=np.uint8))]
                    for i in range(count)]

    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        target_node, soft=False))
    def pull(wrapped: list) -> tuple[int, int]:
        # Wrapped in lists, so Ray passes the refs instead of resolving them as arguments.
        return sum(int(ray.get(w[0])[0]) for w in wrapped), os.getpid()

    source = Source.remote()
    cpu_s, walls = [], []
    try:
        owner = ray.get(source.pid.remote(), timeout=300)
        for repeat in range(repeats):
            wrapped = ray.get(source.put.remote(repeat * count), timeout=300)
            expected = sum((repeat * count + i) % 251 for i in range(count))
            before, start = cpu_snapshot(), time.perf_counter()
            got, receiver = ray.get(pull.remote(wrapped), timeout=300)
            wall = time.perf_counter() - start
            used = sum(t for t, pid, cmd in cpu_between(before, cpu_snapshot())
                       if pid in (owner, receiver) or "/raylet " in cmd)
            if got != expected:
                raise RuntimeError(f"cross-node get read {got}, expected {expected}")
            cpu_s.append(max(used, 1e-6))
            walls.append(wall)
            del wrapped
    finally:
        ray.kill(source)
    nbytes = count * object_bytes
    best = min(range(repeats), key=lambda i: cpu_s[i])
    return Limit(nbytes, cpu_s[best],
                 f"{count} x {object_bytes >> 20} MiB pulled between 2 Ray nodes on this "
                 f"machine: {cpu_s[best] / (nbytes / GiB):.2f} CPU-s per GiB (raylets, "
                 f"owner, receiving worker), wall {nbytes / MB / walls[best]:.0f} MB/s",
                 [nbytes / MB / s for s in cpu_s])


# ---- the floor -------------------------------------------------------------------------------
FLOOR_STEPS = ("hash", "take", "put", "concat")


def shuffle_floor(rates_mb_s: dict[str, float], cores: int, disk_fraction: float = 0.0,
                  durable: bool = False) -> dict[str, float]:
    """The least time a repartition by key can take on this machine, from measured
    single-core rates (MB/s of shuffled bytes) of its steps.

    Every byte is hashed (``hash``), gathered into its partition's order (``take``) and
    assembled by its reducer (``concat``); the bytes kept in memory are written to the
    object store (``put``), the ``disk_fraction`` spilled are written to the page cache
    (``memcpy_fresh``: a write into fresh page-cache pages) and read back (``memcpy_warm``).
    The CPU-seconds divide over ``cores`` (perfect parallelism: a floor). With ``durable``
    the spilled bytes must also reach the device at the fdatasync'd ``disk`` rate, which
    overlaps the CPU work: the wall time is the larger of the two.

    Returns cpu_s_per_gib, wall_s_per_gib, device_s_per_gib and mb_s (the floor's
    throughput, the most any shuffle can do here)."""
    if cores <= 0:
        raise ValueError("cores must be positive")
    if not 0.0 <= disk_fraction <= 1.0:
        raise ValueError("disk_fraction must be in [0, 1]")
    need = ["hash", "take", "concat"] + (["put"] if disk_fraction < 1 else []) + \
        (["memcpy_fresh", "memcpy_warm"] if disk_fraction > 0 else []) + \
        (["disk"] if durable and disk_fraction > 0 else [])
    missing = [k for k in need if not rates_mb_s.get(k)]
    if missing:
        raise KeyError(f"missing rates: {', '.join(missing)}")
    gib_mb = GiB / MB
    cpu = sum(gib_mb / rates_mb_s[k] for k in ("hash", "take", "concat"))
    if disk_fraction < 1:
        cpu += (1 - disk_fraction) * gib_mb / rates_mb_s["put"]
    if disk_fraction > 0:
        cpu += disk_fraction * gib_mb * (1 / rates_mb_s["memcpy_fresh"]
                                        + 1 / rates_mb_s["memcpy_warm"])
    device = disk_fraction * gib_mb / rates_mb_s["disk"] if durable and disk_fraction else 0.0
    wall = max(cpu / cores, device)
    return {"cpu_s_per_gib": cpu, "wall_s_per_gib": wall, "device_s_per_gib": device,
            "mb_s": gib_mb / wall}
