"""Fault injection on real components: a shuffle under storage and process faults ends with
the exact rows or a clear error within a bound, and leaves nothing behind.

Faults are injected at deterministic points: a map waits (bounded) for a flag file that the
test writes once the fault is in place, after the state the fault needs exists (a first
remote object, a first disk segment). Each scenario then checks that nothing is left: spill
files, remote objects, tier-manager books (``used_bytes``) and the master's books
(``shuffles``, ``pending_deletions``). Outcomes and timings go to ``HYBRID_RAY_FAULT_LOG``
(see ``conftest.record_fault_outcome``) for the README's reliability table.

Already covered elsewhere, not repeated here: swapped and crafted segments
(``test_segment_identity``), deletions retried after a storage outage at release
(``test_actors``), node loss (``test_node_loss``).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
import ray

import hybrid_ray.shuffle
from conftest import (
    S3_KEY, S3_SECRET, TcpProxy, ThrottlingS3Proxy, assert_no_leftovers, base_config,
    files_under, record_fault_outcome, row_fingerprint,
)
from hybrid_ray import (
    CorruptSegmentError, HashPartitioner, MiB, OutOfSpaceError, RemoteTierError,
    ShuffleFailedError,
)
from hybrid_ray.actors import (
    get_master, get_reader_slots, get_tier_manager, get_writers,
)
from hybrid_ray.segment import HEADER_BYTES
from hybrid_ray.shuffle import HEARTBEAT_S, run_shuffle

# One namespace for the module: its master, tier manager and worker processes are started
# once (every namespace has its own), and its books start empty.
NS = f"faults-{uuid.uuid4().hex[:6]}"
# Bound on a failure's time to error (from the fault) and on cleanup after recovery.
FAIL_BOUND_S = 60.0
CLEAN_BOUND_S = 60.0
# S3 options that make an unreachable endpoint fail fast: 2 s timeouts, no botocore retry.
BOUNDED_S3 = {"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 1}}


@pytest.fixture(scope="module")
def warm_namespace():
    """Start the namespace's master and worker processes once, before any timing: the
    times to outcome measure the fault's handling, not process start-up."""
    from conftest import start_local_ray

    start_local_ray()
    get_master(NS)
    ray.get([w.run.remote(len, ()) for _, w in get_writers(NS)]
            + [r.run.remote(len, ()) for _, r in get_reader_slots(NS, 2)])


def make_table(n: int, start: int = 0) -> pa.Table:
    """Rows whose every value is a function of the row's id: a lost, duplicated or
    invented row changes the multiset."""
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table({"key": ids, "v": ids * 7 + 3, "w": ids ^ 0x5A5A})


def blocks_of(table: pa.Table, n: int) -> list:
    step = -(-table.num_rows // n)
    return [ray.put(table.slice(i * step, step)) for i in range(n)]


class WaitsForFlag(HashPartitioner):
    """Map ``held_map`` waits (at most ``timeout_s``) for ``flag`` before its first chunk:
    the test puts its fault in place while the other maps have written, then writes the
    flag, and the held map writes into the fault."""

    def __init__(self, keys, flag: str, held_map: int = 1, timeout_s: float = 120.0):
        super().__init__(keys)
        self.flag, self.held_map, self.timeout_s = flag, held_map, timeout_s

    def assign(self, table, map_index, num_partitions):
        if map_index == self.held_map:
            deadline = time.monotonic() + self.timeout_s
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().assign(table, map_index, num_partitions)


class Trigger:
    """Runs ``action`` in a thread as soon as ``ready()`` is true (polled), then writes
    ``flag``; ``fired_at`` is the monotonic time of the action."""

    def __init__(self, ready, action, flag: str, timeout_s: float = 120.0) -> None:
        self.fired_at: float | None = None
        self.error: BaseException | None = None

        def run():
            try:
                deadline = time.monotonic() + timeout_s
                while not ready() and time.monotonic() < deadline:
                    time.sleep(0.05)
                action()
                self.fired_at = time.monotonic()
            except BaseException as exc:  # reported by the test
                self.error = exc
            finally:
                open(flag, "w").close()  # never leave the held map waiting

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(30)
        assert self.error is None, self.error
        assert self.fired_at is not None, "the fault was never injected"


def s3_objects(fs, bucket: str) -> list[str]:
    fs.invalidate_cache()
    return fs.find(bucket)


def s3_segments(fs, bucket: str) -> list[str]:
    return [p for p in s3_objects(fs, bucket) if p.endswith(".seg")]


def segment_files(path: str) -> list[str]:
    return [f for f in files_under(path) if f.endswith(".seg")]


def leftover_bytes(cfg, fs=None, bucket: str | None = None) -> int:
    """Bytes the shuffle's storage still holds: spill files, remote objects and what this
    node's tier manager still counts."""
    total = sum(os.path.getsize(f) for d in cfg.spill_dirs for f in files_under(d))
    if cfg.remote_path and cfg.remote_path.startswith("file://"):
        total += sum(os.path.getsize(f)
                     for f in files_under(cfg.remote_path.removeprefix("file://")))
    if fs is not None:
        fs.invalidate_cache()
        total += sum(fs.du(bucket, total=False).values()) if fs.find(bucket) else 0
    tm = get_tier_manager(ray.get_runtime_context().get_node_id(), cfg.namespace)
    total += sum(t.used_bytes for t in ray.get(tm.usage.remote()).tiers)
    return total


def assert_clean(cfg, fs=None, bucket: str | None = None,
                 bound_s: float = CLEAN_BOUND_S) -> int:
    """Wait (bounded) until nothing of the namespace's shuffles is left, then assert it:
    no spill files, no remote objects, tier-manager books at 0 bytes, the master holding no
    shuffle and no pending deletion. Returns the bytes left (0)."""
    master = get_master(cfg.namespace)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        status = ray.get(master.status.remote())
        if (not status["shuffles"] and not ray.get(master.run_deletions.remote())
                and leftover_bytes(cfg, fs, bucket) == 0):
            break
        time.sleep(0.5)
    left = leftover_bytes(cfg, fs, bucket)
    assert_no_leftovers(cfg, ray)
    if fs is not None:
        assert s3_objects(fs, bucket) == [], "objects left in the bucket"
    status = ray.get(master.status.remote())
    assert status["shuffles"] == [], status["shuffles"]
    assert status["pending_deletions"] == [], status["pending_deletions"]
    assert left == 0
    return left


@pytest.fixture
def bucket(moto_endpoint):
    """A fresh moto bucket: (s3fs filesystem talking to moto directly, bucket name)."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=moto_endpoint, key=S3_KEY, secret=S3_SECRET)
    name = f"hr-{uuid.uuid4().hex[:10]}"
    fs.mkdir(name)
    yield fs, name
    try:
        fs.rm(name, recursive=True)
    except FileNotFoundError:
        pass


def _s3_config(tmp_path, bucket_name: str, endpoint: str, bounded: bool, **kw):
    options = {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET}
    if bounded:
        options["config_kwargs"] = BOUNDED_S3
    kw.setdefault("segment_bytes", {"memory": 256 * 1024, "disk": 256 * 1024,
                                    "remote": 256 * 1024})
    return base_config(tmp_path, memory_fraction=0.0, disk_capacity_bytes=0,
                       remote_path=f"s3://{bucket_name}/shuffle", storage_options=options,
                       namespace=NS, compression="none", **kw)


# ---- 1. the S3 store stops mid-shuffle ---------------------------------------------------------
def test_s3_stopped_mid_shuffle_fails_naming_the_remote_tier_then_leaves_nothing(
        ray_local, warm_namespace, moto_endpoint, bucket, tmp_path):
    fs, name = bucket
    proxy = TcpProxy(int(moto_endpoint.rsplit(":", 1)[1]))
    cfg = _s3_config(tmp_path, name, proxy.endpoint, bounded=True)
    flag = str(tmp_path / "store-down")
    table = make_table(200_000)
    # Map 0's segments reach S3 (not the pre-flight probe: a segment); then the store goes
    # away and map 1 starts writing.
    trigger = Trigger(lambda: s3_segments(fs, name), proxy.down, flag)
    try:
        with pytest.raises(ShuffleFailedError) as info:
            run_shuffle(blocks_of(table, 4), 4, WaitsForFlag(["key"], flag), table.schema,
                        cfg)
        failed_at = time.monotonic()
        trigger.join()
        to_error = failed_at - trigger.fired_at
        # The cause is the remote tier's error, not a raw botocore error of a deletion
        # that failed for the same reason (a failed map's abort once masked it).
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTierError), repr(cause)[:2000]
        msg = str(cause.cause if hasattr(cause, "cause") else cause)
        assert "remote tier" in msg and name in msg, msg
        assert to_error < FAIL_BOUND_S, to_error
        # Released while the store was down: its data is not forgotten, and goes once the
        # store is back.
        assert s3_objects(fs, name), "segments vanished while S3 was unreachable"
        proxy.up()
        recovered = time.monotonic()
        left = assert_clean(cfg, fs, name)
        record_fault_outcome("S3 stopped mid-shuffle", "ShuffleFailedError (RemoteTierError)",
                             to_error, left)
        record_fault_outcome("S3 back: queued deletions done", "bucket empty",
                             time.monotonic() - recovered, left)
    finally:
        proxy.close()


# ---- 2. the S3 store throttles (503 SlowDown) --------------------------------------------------
THROTTLED_REQUESTS = 8


def test_s3_throttling_mid_shuffle_is_retried_and_output_exact(ray_local, warm_namespace,
                                                               moto_endpoint, bucket, tmp_path):
    fs, name = bucket
    proxy = ThrottlingS3Proxy(int(moto_endpoint.rsplit(":", 1)[1]))
    cfg = _s3_config(tmp_path, name, proxy.endpoint, bounded=False)
    flag = str(tmp_path / "throttling")
    table = make_table(200_000)
    started = time.monotonic()
    # The next requests after map 0's first object (map 1's uploads among them) get 503.
    trigger = Trigger(lambda: s3_segments(fs, name),
                      lambda: proxy.throttle(THROTTLED_REQUESTS), flag)
    try:
        result = run_shuffle(blocks_of(table, 4), 4, WaitsForFlag(["key"], flag),
                             table.schema, cfg)
        elapsed = time.monotonic() - started
        trigger.join()
        assert proxy.throttled == THROTTLED_REQUESTS, (proxy.throttled, proxy.forwarded)
        assert row_fingerprint(ray.get(result.refs)) == row_fingerprint([table])
        assert result.report.bytes_per_tier()["remote"] > 0
        left = assert_clean(cfg, fs, name)
        record_fault_outcome(f"S3 throttled ({THROTTLED_REQUESTS} x 503 SlowDown)",
                             "exact rows (retried)", elapsed, left)
    finally:
        proxy.close()


# ---- 3. the spill disk fills up mid-shuffle ----------------------------------------------------
def fill_up(path: str) -> str:
    """Write a file into ``path`` until the filesystem is full; returns its path."""
    filler = os.path.join(path, "filler.bin")
    chunk = b"\xab" * MiB
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("remote", [True, False], ids=["with-remote", "no-remote"])
def test_spill_disk_filled_mid_shuffle(ray_local, warm_namespace, small_disk, tmp_path, remote):
    cfg = base_config(tmp_path, spill_dirs=[small_disk], memory_fraction=0.0,
                      compression="none", namespace=NS,
                      remote_path=f"file://{tmp_path}/remote" if remote else None)
    flag = str(tmp_path / "disk-full")
    fillers: list[str] = []
    table = make_table(400_000)
    started = time.monotonic()
    # Map 0 has a segment on the disk; then another process fills the disk.
    trigger = Trigger(lambda: segment_files(small_disk),
                      lambda: fillers.append(fill_up(small_disk)), flag)
    try:
        if remote:
            result = run_shuffle(blocks_of(table, 4), 4, WaitsForFlag(["key"], flag),
                                 table.schema, cfg)
            elapsed = time.monotonic() - started
            trigger.join()
            assert row_fingerprint(ray.get(result.refs)) == row_fingerprint([table])
            tiers = result.report.bytes_per_tier()
            assert tiers["disk"] > 0 and tiers["remote"] > 0, tiers
            outcome = "exact rows, overflow to the remote tier"
        else:
            with pytest.raises(ShuffleFailedError) as info:
                run_shuffle(blocks_of(table, 4), 4, WaitsForFlag(["key"], flag),
                            table.schema, cfg)
            trigger.join()
            elapsed = time.monotonic() - trigger.fired_at
            assert isinstance(info.value.__cause__, OutOfSpaceError), info.value.__cause__
            msg = str(info.value)
            assert "OutOfSpaceError" in msg and small_disk in msg, msg
            assert "bytes free" in msg and "remote_path" in msg, msg
            assert elapsed < FAIL_BOUND_S
            outcome = "ShuffleFailedError (OutOfSpaceError naming the dir, its free space)"
            # Nothing of the shuffle is left beside the filler.
            deadline = time.monotonic() + CLEAN_BOUND_S
            while files_under(small_disk) != fillers and time.monotonic() < deadline:
                time.sleep(0.2)
            assert files_under(small_disk) == fillers
    finally:
        for f in fillers:
            os.unlink(f)
    left = assert_clean(cfg)
    record_fault_outcome(f"spill tmpfs filled mid-shuffle, {'with' if remote else 'no'} "
                         "remote tier", outcome, elapsed, left)


class FillsTheDiskAfterGranting:
    """A node's tier manager whose disk fills up (another process) right after it granted
    the first segments: the writes of those grants meet a full disk (ENOSPC)."""

    def __init__(self, tm, path: str) -> None:
        self.tm, self.path, self.fillers = tm, path, []

    def reserve(self, shuffle_id, sizes, settled=()):
        placements = self.tm.reserve(shuffle_id, sizes, settled)
        if not self.fillers:
            self.fillers.append(fill_up(self.path))
        return placements

    def settle(self, shuffle_id, settled):
        self.tm.settle(shuffle_id, settled)

    def free_segments(self, shuffle_id, metas):
        self.tm.free_segments(shuffle_id, metas)


def test_disk_filled_between_grant_and_write_names_dir_and_free_space(small_disk, tmp_path):
    """The deterministic seam of the race above: the disk fills after the tier manager
    granted a segment and before the writer wrote it. With no remote tier the error must
    say as much as a refusal at reservation: the directory, its free space, the reserve
    and the remote_path option (the ENOSPC path named only the directory)."""
    from hybrid_ray import TierManager, WriteClient, build_io_tiers

    cfg = base_config(tmp_path, spill_dirs=[small_disk], memory_fraction=0.0,
                      compression="none")
    tm = TierManager("node-a", 0)
    shuffle = f"shf-{uuid.uuid4().hex[:6]}"
    tm.register_shuffle(shuffle, cfg)
    storage = FillsTheDiskAfterGranting(tm, small_disk)
    client = WriteClient(shuffle, 0, 2, cfg, storage, build_io_tiers(cfg, node_id="node-a"),
                         node_id="node-a")
    try:
        with pytest.raises(OutOfSpaceError) as info:
            client.write(0, make_table(200_000))
            client.close()
        client.abort()
        msg = str(info.value)
        assert f"no space left in spill dir {small_disk}" in msg, msg
        assert f"{small_disk}: " in msg and "bytes free, reserve" in msg, msg
        assert "remote_path" in msg, msg
        assert files_under(small_disk) == storage.fillers  # the failed write left nothing
    finally:
        for f in storage.fillers:
            os.unlink(f)
        tm.release_shuffle(shuffle)
    assert all(t.used_bytes == 0 for t in tm.usage().tiers)


# ---- 4. a segment corrupted before its reducer reads it ----------------------------------------
_real_reduce_partition = hybrid_ray.shuffle.reduce_partition


def corrupting_reduce_partition(shuffle_id, subpartition, schema, partitioner, config,
                                master):
    """``reduce_partition`` that first flips one byte in the body of segment (map 0,
    subpartition 0, index 0), wherever it is stored: a blocking shuffle's maps have all
    finished when reducers start, so the segment exists; reducer 0 then reads it."""
    if subpartition == 0:
        (meta,) = [m for m in ray.get(master.segments.remote(shuffle_id))
                   if (m.id.map_partition, m.id.subpartition, m.id.index) == (0, 0, 0)]
        with open(meta.location, "r+b") as f:
            f.seek(HEADER_BYTES + (meta.nbytes - HEADER_BYTES) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return _real_reduce_partition(shuffle_id, subpartition, schema, partitioner, config,
                                  master)


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_corrupted_segment_fails_naming_segment_and_tier(ray_local, warm_namespace, tmp_path,
                                                         monkeypatch, tier):
    kw = {"disk_capacity_bytes": 0, "remote_path": f"file://{tmp_path}/remote"} \
        if tier == "remote" else {}
    cfg = base_config(tmp_path, mode="blocking", memory_fraction=0.0, compression="none",
                      namespace=NS, **kw)
    table = make_table(200_000)
    # The driver hands this function to the reducers (workers import this module).
    monkeypatch.setattr(hybrid_ray.shuffle, "reduce_partition", corrupting_reduce_partition)
    started = time.monotonic()
    with pytest.raises(ShuffleFailedError) as info:
        result = run_shuffle(blocks_of(table, 4), 3, HashPartitioner(["key"]), table.schema,
                             cfg)
        ray.get(result.refs)  # never reached: no partial or wrong rows are handed out
    elapsed = time.monotonic() - started
    assert isinstance(info.value.__cause__, CorruptSegmentError), info.value.__cause__
    msg = str(info.value)
    assert "CorruptSegmentError" in msg and f"{tier} tier" in msg, msg
    assert "map=0, sub=0, index=0" in msg and "failed its checksum" in msg, msg
    assert elapsed < FAIL_BOUND_S
    left = assert_clean(cfg)
    record_fault_outcome(f"{tier} segment corrupted (1 byte) before its reducer",
                         "ShuffleFailedError (CorruptSegmentError naming segment, tier)",
                         elapsed, left)


# ---- 5. the driver is paused (kill -STOP) mid-shuffle ------------------------------------------
ORPHAN_TTL_S = 20.0

DRIVER = textwrap.dedent("""
    import os, sys, time
    import numpy as np, pyarrow as pa, ray

    gcs, namespace, spill, remote, go = sys.argv[1:]
    ray.init(address=gcs, log_to_driver=False, configure_logging=False)
    from hybrid_ray import HashPartitioner, MiB, ShuffleConfig
    from hybrid_ray.shuffle import run_shuffle

    class HeldMap(HashPartitioner):  # defined in __main__: shipped to the writers by value
        def __init__(self, keys, go):
            super().__init__(keys)
            self.go = go

        def assign(self, table, map_index, num_partitions):
            if map_index == 1:  # held until the test says go (bounded)
                deadline = time.monotonic() + 180
                while not os.path.exists(self.go) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return super().assign(table, map_index, num_partitions)

    ids = np.arange(200_000, dtype=np.int64)
    table = pa.table({"key": ids, "v": ids * 7 + 3})
    blocks = [ray.put(table.slice(i * 50_000, 50_000)) for i in range(4)]
    cfg = ShuffleConfig(spill_dirs=[spill], remote_path=remote, memory_fraction=0.0,
                        disk_capacity_bytes=1 * MiB, compression="none", namespace=namespace,
                        orphan_ttl_s=%(ttl)r, progress=False,
                        segment_bytes={"disk": 256 * 1024, "remote": 256 * 1024})
    print("running", flush=True)
    run_shuffle(blocks, 4, HeldMap(["key"], go), table.schema, cfg)
    print("finished", flush=True)  # never: the test stops this process first
""") % {"ttl": ORPHAN_TTL_S}


def test_driver_paused_mid_shuffle_is_expired_after_its_ttl(ray_local, warm_namespace, tmp_path):
    """A driver that stops heartbeating while Ray still counts its job alive (paused,
    hung) loses its shuffle after ``orphan_ttl_s``. (A killed driver's job ends, and its
    shuffle goes within seconds: test_actors.py's
    ``test_the_shuffle_of_a_driver_that_was_killed_is_released_without_waiting_its_ttl``.)"""
    spill, remote = tmp_path / "spill", tmp_path / "remote"
    cfg = base_config(tmp_path, spill_dirs=[str(spill)], namespace=NS,
                      remote_path=f"file://{remote}", orphan_ttl_s=ORPHAN_TTL_S)
    go = str(tmp_path / "go")
    # The namespace's long-lived processes are up before the driver starts (as on a
    # cluster where shuffles ran before; see warm_namespace): the driver only submits
    # work to them.
    master = get_master(NS)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), ray.get_runtime_context().gcs_address, NS,
         str(spill), f"file://{remote}", go],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Map 0 wrote segments to the disk and (past its 1 MiB cap) to the remote tier.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not (
                segment_files(str(spill)) and segment_files(str(remote))):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0]
        assert segment_files(str(spill)) and segment_files(str(remote)), "no segments"
        (shuffle_id,) = [s["shuffle_id"] for s in ray.get(master.status.remote())["shuffles"]]
        os.kill(proc.pid, signal.SIGSTOP)  # its job stays alive: only the TTL ends it
        paused = time.monotonic()
        # The master releases the silent shuffle soon after its TTL (it checks every
        # EXPIRY_CHECK_INTERVAL_S; at 30 s this took up to TTL + 30 s), and its data goes
        # with it.
        bound = ORPHAN_TTL_S + 15
        while time.monotonic() - paused < bound and (
                ray.get(master.live_shuffles.remote())
                or segment_files(str(spill)) or segment_files(str(remote))):
            time.sleep(0.5)
        to_clean = time.monotonic() - paused
        assert shuffle_id not in ray.get(master.live_shuffles.remote())
        assert to_clean < bound, to_clean
        # Its last heartbeat came at most HEARTBEAT_S before the pause.
        assert to_clean > ORPHAN_TTL_S - HEARTBEAT_S - 1, "released before its TTL"
        # The map held mid-shuffle now goes on: its writes find the shuffle released, and
        # whatever it wrote is deleted (the writer's abort, the master's refused commit).
        open(go, "w").close()
        ray.get([w.run.remote(len, ()) for _, w in get_writers(NS)], timeout=120)
        left = assert_clean(cfg)
        record_fault_outcome(f"driver paused (SIGSTOP) mid-shuffle, orphan_ttl_s="
                             f"{ORPHAN_TTL_S:.0f}", "expired by the master, data removed",
                             to_clean, left)
    finally:
        open(go, "w").close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
