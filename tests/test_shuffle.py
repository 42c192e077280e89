"""The distributed shuffle on a real local Ray: exact rows, tiers, modes, faults, cleanup."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
from conftest import assert_no_leftovers, base_config, row_fingerprint
from hybrid_ray import (
    ConfigError, MiB, Partitioner, RemoteTierError, ShuffleFailedError,
)
from hybrid_ray.actors import get_master


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"key": rng.integers(0, rows // 4 + 1, rows),
                     "payload": rng.integers(0, 1 << 62, rows), "value": rng.random(rows)})


@pytest.fixture
def dataset(ray_local):
    table = make_table(400_000)
    return ray_local.data.from_arrow(table).repartition(8).materialize(), table


def outputs(ds) -> list[pa.Table]:
    import ray

    return ray.get(ds.to_arrow_refs())


@pytest.mark.parametrize("mode", ["hybrid", "blocking"])
def test_repartition_exact_through_three_tiers(dataset, tmp_path, mode, ray_local):
    ds, table = dataset
    cfg = base_config(tmp_path, mode=mode, memory_capacity_bytes=2 * MiB,
                      disk_capacity_bytes=3 * MiB, remote_path=f"file://{tmp_path}/remote")
    out = hybrid_ray.repartition(ds, 6, keys=["key"], config=cfg)
    parts = outputs(out)
    assert len(parts) == 6
    assert row_fingerprint(parts) == row_fingerprint([table])
    seen = {}
    for i, p in enumerate(parts):  # every key in exactly one partition
        for k in np.unique(p["key"].to_numpy()):
            assert seen.setdefault(int(k), i) == i
    report = hybrid_ray.last_report()
    per_tier = report.bytes_per_tier()
    assert 0 < per_tier["memory"] <= 2 * MiB, per_tier  # budget honoured
    assert 0 < per_tier["disk"] <= 3 * MiB, per_tier
    assert per_tier["remote"] > 0
    assert report.rows == table.num_rows and report.spill_events > 0
    if mode == "blocking":  # hybrid overlap is forced and checked in its own test
        assert not report.hybrid_overlap
    assert "memory" in report.table() and report.throughput_mb_s > 0
    # The output Dataset's block metadata (reported by the reducers) is exact.
    assert out.count() == table.num_rows
    assert out.schema().names == table.schema.names
    assert out.size_bytes() == sum(p.nbytes for p in parts)
    assert_no_leftovers(cfg, ray_local)


class LastMapSlowPartitioner(hybrid_ray.HashPartitioner):
    """Hash partitioning whose last map goes on only once a reader was delivered segments
    (of the other maps), or after ``bound_s``: whether reducers consume while a map still
    runs then depends on the mode, not on how fast the machine is. (A fixed two-second sleep
    was outlasted by a reducer slow to start, and hybrid mode showed no overlap.)"""

    def __init__(self, keys, last_map: int, namespace: str, bound_s: float) -> None:
        super().__init__(keys)
        self.last_map, self.namespace, self.bound_s = last_map, namespace, bound_s

    def assign(self, table, map_index, num_partitions):
        if map_index == self.last_map:
            from conftest import wait_for_a_delivery

            wait_for_a_delivery(self.namespace, self.bound_s)
        return super().assign(table, map_index, num_partitions)


@pytest.mark.parametrize("mode", ["hybrid", "blocking"])
def test_hybrid_readers_consume_while_a_map_still_runs(dataset, tmp_path, mode, ray_local):
    ds, table = dataset
    cfg = base_config(tmp_path, mode=mode, memory_capacity_bytes=2 * MiB)
    refs = ds.to_arrow_refs()
    # hybrid: the last map waits (up to 120 s) for a reader to get segments; blocking: no
    # reader runs before every map finished, so it waits out its 2 s.
    partitioner = LastMapSlowPartitioner(["key"], len(refs) - 1, cfg.namespace,
                                         120.0 if mode == "hybrid" else 2.0)
    res = hybrid_ray.run_shuffle(refs, 4, partitioner, table.schema, cfg)
    assert row_fingerprint(ray_local.get(res.refs)) == row_fingerprint([table])
    # hybrid: segments of the other maps reach a reducer during the last map's sleep;
    # blocking: nothing is delivered before every map has finished.
    assert res.report.hybrid_overlap == (mode == "hybrid"), res.report.table()
    assert_no_leftovers(cfg, ray_local)


def test_reducers_run_in_reader_processes_kept_across_shuffles(dataset, tmp_path, ray_local):
    from hybrid_ray.actors import get_readers

    ds, table = dataset
    cfg = base_config(tmp_path, max_concurrent_reducers=2)

    def reader_pids():
        return sorted(ray_local.get([r.run.remote(os.getpid) for r in
                                     get_readers(cfg.namespace, 2)]))

    hybrid_ray.repartition(ds, 4, keys=["key"], config=cfg)
    before = reader_pids()
    for _ in range(2):
        out = hybrid_ray.repartition(ds, 4, keys=["key"], config=cfg)
        assert row_fingerprint(outputs(out)) == row_fingerprint([table])
    assert reader_pids() == before and len(set(before)) == 2


def test_segments_of_a_finished_reducer_are_freed_before_the_shuffle_ends(dataset, tmp_path,
                                                                          ray_local):
    """A finished reducer's block is stored, so its segments go at once: with one reader,
    partition 0's spill files are gone while the last partition is still being read."""
    ds, table = dataset
    cfg = base_config(tmp_path, memory_fraction=0.0, max_concurrent_reducers=1,
                      mode="blocking")

    class WatchingPartitioner(hybrid_ray.HashPartitioner):
        def finalize(self, t, subpartition):
            if subpartition == 2:  # the last reducer: runs after reducers 0 and 1 finished
                import glob

                def files(sub):
                    return glob.glob(os.path.join(cfg.spill_dirs[0], "**", f"sub-{sub:05d}",
                                                  "*.seg"), recursive=True)
                deadline = time.time() + 20  # the deletion is asynchronous
                while files(0) and time.time() < deadline:
                    time.sleep(0.05)
                t = t.append_column("freed0", pa.array([not files(0)] * t.num_rows))
                t = t.append_column("kept2", pa.array([bool(files(2))] * t.num_rows))
            return t

    res = hybrid_ray.run_shuffle(ds.to_arrow_refs(), 3, WatchingPartitioner(["key"]),
                                 ds.schema().base_schema, cfg)
    parts = ray_local.get(res.refs)
    last = parts[2]
    assert last.num_rows and all(last["freed0"].to_pylist()), "partition 0 not freed"
    assert all(last["kept2"].to_pylist()), "the partition being read must still be there"
    parts[2] = last.drop_columns(["freed0", "kept2"])
    assert row_fingerprint(parts) == row_fingerprint([table])
    assert hybrid_ray.last_report().bytes_per_tier()["disk"] > 0  # freed still reported
    assert_no_leftovers(cfg, ray_local)
    assert_no_leftovers(cfg, ray_local)


def test_full_spilling_uses_no_memory(dataset, tmp_path, ray_local):
    ds, table = dataset
    cfg = base_config(tmp_path, spilling="full")
    parts = outputs(hybrid_ray.repartition(ds, 4, keys=["key", "payload"], config=cfg))
    assert row_fingerprint(parts) == row_fingerprint([table])
    per_tier = hybrid_ray.last_report().bytes_per_tier()
    assert per_tier["memory"] == 0 and per_tier["disk"] > 0
    assert_no_leftovers(cfg, ray_local)


@pytest.mark.parametrize("descending", [False, True])
def test_sort_is_globally_ordered_and_exact(dataset, tmp_path, descending, ray_local):
    ds, table = dataset
    cfg = base_config(tmp_path, memory_capacity_bytes=MiB)
    parts = outputs(hybrid_ray.sort(ds, "payload", descending=descending, config=cfg))
    result = pa.concat_tables(parts)
    keys = result["payload"].to_numpy()
    expected = np.sort(table["payload"].to_numpy())
    assert np.array_equal(keys, expected[::-1] if descending else expected)
    assert row_fingerprint([result]) == row_fingerprint([table])
    assert_no_leftovers(cfg, ray_local)


def test_random_shuffle_exact_and_reproducible(dataset, tmp_path):
    ds, table = dataset
    cfg = base_config(tmp_path)
    a = pa.concat_tables(outputs(hybrid_ray.random_shuffle(ds, seed=7, config=cfg)))
    b = pa.concat_tables(outputs(hybrid_ray.random_shuffle(ds, seed=7, config=cfg)))
    assert row_fingerprint([a]) == row_fingerprint([table])
    assert a.equals(b)
    assert not np.array_equal(a["payload"].to_numpy(), table["payload"].to_numpy())


def test_bad_input_is_explained(dataset, tmp_path):
    ds, _ = dataset
    with pytest.raises(ConfigError, match="num_partitions must be a positive integer"):
        hybrid_ray.repartition(ds, 0, keys=["key"])
    with pytest.raises(ConfigError, match=r"unknown column\(s\) \['nope'\]"):
        hybrid_ray.repartition(ds, 2, keys=["nope"])
    with pytest.raises(ConfigError, match="sort key"):
        hybrid_ray.sort(ds, "nope")
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        hybrid_ray.repartition(pa.table({"a": [1]}), 2, keys=["a"])
    # A dict for config was taken for the defaults when empty and failed deep inside
    # otherwise; a string for descending sorted descending; a generator of keys was used
    # up by the column check and failed the maps.
    for call in (lambda: hybrid_ray.repartition(ds, 2, keys=["key"], config={}),
                 lambda: hybrid_ray.sort(ds, "key", config={"mode": "blocking"}),
                 lambda: hybrid_ray.random_shuffle(ds, config={})):
        with pytest.raises(ConfigError, match="config must be a hybrid_ray.ShuffleConfig, "
                                              "got dict"):
            call()
    with pytest.raises(ConfigError, match="descending must be True or False, got 'False'"):
        hybrid_ray.sort(ds, "key", descending="False")
    with pytest.raises(ConfigError, match="keys must be a column name or a list of column"):
        hybrid_ray.repartition(ds, 2, keys=(k for k in ["key"]))
    with pytest.raises(RemoteTierError, match="not writable"):
        hybrid_ray.repartition(ds, 2, keys=["key"], config=base_config(
            tmp_path, remote_path="s3://bucket/x", storage_options={
                "endpoint_url": "http://127.0.0.1:9", "key": "a", "secret": "b",
                "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}))


class ExplodingPartitioner(Partitioner):
    """Fails on map partition 3: a user bug in the middle of a shuffle."""

    def assign(self, table, map_index, num_partitions):
        if map_index == 3:
            raise ValueError("boom in map 3")
        return np.asarray(table["key"]) % num_partitions


def test_failed_shuffle_cleans_everything(dataset, tmp_path, ray_local):
    ds, _ = dataset
    cfg = base_config(tmp_path, memory_capacity_bytes=MiB, disk_capacity_bytes=2 * MiB,
                      remote_path=f"file://{tmp_path}/remote")
    refs = ds.to_arrow_refs()
    with pytest.raises(ShuffleFailedError, match="boom in map 3"):
        hybrid_ray.run_shuffle(refs, 4, ExplodingPartitioner(), ds.schema().base_schema, cfg)
    time.sleep(1.0)  # let cancelled tasks' last writes land before checking
    ray_local.get(get_master(cfg.namespace).expire.remote())
    # Tasks cancelled mid-write may finish one segment after the release; the master
    # releases their late commits (refused, deleted) and the tier manager its files.
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            assert_no_leftovers(cfg, ray_local)
            break
        except AssertionError:
            time.sleep(0.5)
    assert_no_leftovers(cfg, ray_local)


def _find_victim(master, ray_mod, role: str):
    status = ray_mod.get(master.status.remote())
    for s in status["shuffles"]:
        prog = ray_mod.get(master.progress.remote(s["shuffle_id"]))
        if role == "map":
            for m in prog["maps"]:
                if m["finished"] is None and m["segments"] > 0 and m["attempt"] == 0 and m["pid"]:
                    return m["pid"]
        elif role == "finished_map":  # the writer of a finished map, while others still run
            done = [m for m in prog["maps"] if m["finished"] is not None and m["pid"]]
            if done and any(m["finished"] is None for m in prog["maps"]):
                return done[0]["pid"]
        else:
            for r in prog["readers"].values():
                if r["delivered"] > 0 and not r["done"] and r["pid"]:
                    return r["pid"]
    return None


class SlowHashPartitioner(hybrid_ray.HashPartitioner):
    """Hash partitioning that takes its time, so the test can catch tasks mid-flight."""

    def assign(self, table, map_index, num_partitions):
        time.sleep(0.05)
        return super().assign(table, map_index, num_partitions)


def _shuffle_killing_one(ray_mod, ds, table, cfg, role: str) -> tuple[int | None, dict]:
    """Run a slow 4-partition shuffle of ``ds`` in a thread and SIGKILL the first process
    ``_find_victim`` names for ``role`` meanwhile. Returns (killed pid, result) where
    result holds "parts" and "report", or "error"."""
    master = get_master(cfg.namespace)
    result: dict = {}

    def run():
        try:
            res = hybrid_ray.run_shuffle(ds.to_arrow_refs(), 4, SlowHashPartitioner(["key"]),
                                         table.schema, cfg)
            result["parts"] = ray_mod.get(res.refs)
            result["report"] = res.report
        except BaseException as exc:  # reported to the test thread below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed = None
    deadline = time.time() + 60
    while killed is None and thread.is_alive() and time.time() < deadline:
        pid = _find_victim(master, ray_mod, role)
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.02)
    thread.join(300)
    return killed, result


@pytest.mark.parametrize("role", ["map", "reduce"])
def test_killed_worker_mid_shuffle_output_still_exact(ray_local, tmp_path, role):
    table = make_table(1_000_000, seed=3)
    ds = ray_local.data.from_arrow(table).repartition(12).materialize()
    cfg = base_config(tmp_path, memory_capacity_bytes=4 * MiB, map_chunk_bytes=256 * 1024,
                      max_concurrent_reducers=2)
    killed, result = _shuffle_killing_one(ray_local, ds, table, cfg, role)
    assert killed, f"never caught a {role} task mid-flight"
    assert "error" not in result, result.get("error")
    assert row_fingerprint(result["parts"]) == row_fingerprint([table])
    if role == "map":
        # The running map ran again (superseded), or, where it finished between the look
        # and the kill, the killed writer's finished maps did (their segments died with it).
        report = result["report"]
        assert report.superseded_attempts + report.lost_maps_rerun >= 1, report.table()
        # The restarted writer's later maps use their registered attempts: a shuffle
        # without faults reports no retried attempts (was: one per map it ran).
        again = hybrid_ray.run_shuffle(ds.to_arrow_refs(), 4, hybrid_ray.HashPartitioner(
            ["key"]), table.schema, cfg)
        assert row_fingerprint(ray_local.get(again.refs)) == row_fingerprint([table])
        assert again.report.superseded_attempts == 0, again.report.table()
    assert_no_leftovers(cfg, ray_local)


def test_killed_writer_loses_finished_maps_which_are_rerun_exactly(ray_local, tmp_path):
    """A writer actor owns the memory-tier segments of every map it finished; killing it
    loses them. Readers (blocking: they start after the maps) report the loss and the
    driver runs those maps again: the output is still exact and nothing is left over."""
    table = make_table(1_000_000, seed=5)
    ds = ray_local.data.from_arrow(table).repartition(12).materialize()
    cfg = base_config(tmp_path, mode="blocking", memory_capacity_bytes=512 * MiB,
                      map_chunk_bytes=256 * 1024)
    killed, result = _shuffle_killing_one(ray_local, ds, table, cfg, "finished_map")
    assert killed, "never caught a finished map while others were running"
    assert "error" not in result, result.get("error")
    assert row_fingerprint(result["parts"]) == row_fingerprint([table])
    report = result["report"]
    assert report.lost_maps_rerun >= 1 and report.bytes_per_tier()["disk"] == 0
    assert_no_leftovers(cfg, ray_local)


class RememberingPartitioner(hybrid_ray.Partitioner):
    """Not deterministic: it remembers the maps it partitioned, and a map's second run
    sends every row to subpartition 0 (the first spread them by id)."""

    def __init__(self):
        self.seen = set()

    def assign(self, table, map_index, num_partitions):
        if map_index in self.seen:
            return np.zeros(table.num_rows, dtype=np.int64)
        self.seen.add(map_index)
        return table["id"].to_numpy() % num_partitions


def _recoverable_shuffle(ray_local, tmp_path, name: str, num_maps: int):
    """(config, master, shuffle id) of a blocking, fully spilling shuffle of ``num_maps``
    maps into 2 subpartitions, registered as recoverable in a namespace of its own: for
    tests that write and re-run maps by hand (``write_map_partition``)."""
    import uuid

    config = base_config(tmp_path, spilling="full", mode="blocking",
                         namespace=f"hr-{name}-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray_local.get(master.register.remote(shuffle_id, num_maps, 2, config, True))
    return config, master, shuffle_id


def test_a_lost_map_rerun_by_a_partitioner_that_is_not_deterministic_fails_loudly(
        ray_local, tmp_path):
    """A finished reducer keeps the rows the first run of a map sent it; the re-run of
    that map after its output was lost must send the same. A partitioner that is not
    deterministic sent others, so rows were lost and duplicated without a word. The re-run now fails,
    naming the partitioner as the cause."""
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.shuffle import read_subpartition, write_map_partition

    config, master, shuffle_id = _recoverable_shuffle(ray_local, tmp_path, "nondet", 2)
    table = pa.table({"id": np.arange(10_000)})
    partitioner = RememberingPartitioner()  # the test's process runs every map here
    try:
        for m in range(2):
            write_map_partition(shuffle_id, m, [table], 2, partitioner, config, master)
        assert len(pa.concat_tables(read_subpartition(shuffle_id, 1, config, master))) > 0
        ray_local.get(master.free_subpartitions.remote(shuffle_id, [1]))  # its reducer is done
        assert ray_local.get(master.report_lost.remote(shuffle_id, 0, 0))
        with pytest.raises(ConfigError, match=r"map 0 .* was run again .*subpartition 1: "
                                              r"5000 rows then, 0 now.*not deterministic"):
            write_map_partition(shuffle_id, 0, [table], 2, partitioner, config, master)
    finally:
        ray_local.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray_local)


def test_writer_and_reader_processes_keep_freed_memory_warm(ray_local):
    """Writers and readers run with a mimalloc purge delay (see actors.WORKER_ENV): the
    variable must reach the processes, before pyarrow loads its allocator."""
    from hybrid_ray.actors import WORKER_ENV, get_readers, get_writers
    from hybrid_ray.config import DEFAULT_NAMESPACE

    def probe():
        import os

        import pyarrow as pa

        return os.environ.get("MIMALLOC_PURGE_DELAY"), pa.default_memory_pool().backend_name

    workers = [w for _, w in get_writers(DEFAULT_NAMESPACE)] + get_readers(DEFAULT_NAMESPACE, 1)
    for value, backend in ray_local.get([w.run.remote(probe) for w in workers]):
        assert value == WORKER_ENV["MIMALLOC_PURGE_DELAY"]
        assert backend == "mimalloc"


# ---- the reader pool's queue (no Ray: fake reader actors) ------------------------------------
class _FakeReader:
    """Stands in for a reader actor: an id, and a ``run`` that records the subpartitions
    handed to it in order."""

    class _Id:
        def __init__(self, key: str) -> None:
            self._key = key

        def hex(self) -> str:
            return self._key

    def __init__(self, key: str) -> None:
        self._actor_id = self._Id(key)
        self.subs: list[int] = []
        reader = self

        class _Run:
            def options(self, **_):
                return self

            def remote(self, packed, shuffle_id, sub):
                reader.subs.append(sub)
                return (f"table-{sub}", f"stats-{sub}", f"times-{sub}")

        self.run_packed = _Run()


def test_each_reader_has_its_next_subpartition_queued_behind_the_current_one(monkeypatch):
    """Two readers take four subpartitions at once, two each (one reducing, one queued in
    the actor, so it starts without a round trip through the driver). A reader that
    returns one gets the next; a reader dropped with its node takes its queue out of the
    pool's books (the driver re-runs those from the failed refs)."""
    from hybrid_ray import shuffle as shuffle_mod

    from hybrid_ray import actors as actors_mod

    node_1, node_2 = "1" * 56, "2" * 56  # node ids are 56 hex digits
    a, b, extra = _FakeReader("a"), _FakeReader("b"), _FakeReader("extra")

    class _ExtraReaders:  # the actor class a pool starts extra readers from
        def options(self, **_):
            return self

        def remote(self):
            return extra

    monkeypatch.setattr(actors_mod, "ShuffleWorkerActor", _ExtraReaders())
    monkeypatch.setattr(shuffle_mod, "get_reader_slots",
                        lambda ns, count: [(node_1, a), (node_2, b)][:count])
    monkeypatch.setattr(shuffle_mod, "cluster_cpus", lambda: 2)
    pool = shuffle_mod._ReaderPool("ns", 2)
    depth = shuffle_mod.READER_QUEUE_DEPTH
    assert depth == 2
    submitted = []
    while pool.has_free(depth):
        sub = len(submitted)
        assert pool.submit(sub, "packed", "shuffle", sub) == (f"table-{sub}", f"stats-{sub}", f"times-{sub}")
        submitted.append(sub)
    assert submitted == [0, 1, 2, 3]
    assert (a.subs, b.subs) == ([0, 2], [1, 3])
    assert pool.busy_subpartitions() == [0, 1, 2, 3]
    assert not pool.has_free(1)
    pool.done(1)  # b returned its first: it has one in hand, room for one more
    assert pool.has_free(depth) and pool.busy_subpartitions() == [0, 2, 3]
    pool.submit(4, "packed", "shuffle", 4)
    assert b.subs == [1, 3, 4] and pool.node_of(4) == node_2
    monkeypatch.setattr(shuffle_mod, "get_reader_slots",
                        lambda ns, count: [(node_2, b)][:count])
    # The last subpartitions (no more than there are readers) wait for an idle reader:
    # queued behind a slow one they would wait while another reader sits idle.
    pool.done(0)  # a has one in hand (2), b two (3, 4): both busy
    assert pool.can_take(3) and not pool.can_take(2) and not pool.can_take(0)
    pool.done(2)  # a is idle now
    assert pool.can_take(1)
    pool.submit(2, "packed", "shuffle", 2)
    pool.drop_nodes({node_1})  # a died with its node: 0 and 2 leave the books
    assert pool.busy_subpartitions() == [3, 4]
    pool.submit(5, "packed", "shuffle", 5)  # an extra reader on the alive node takes a's place
    assert extra.subs == [5] and pool.node_of(5) == node_2


class CrashingFinalize(hybrid_ray.HashPartitioner):
    """Hash partitioning whose reducer of subpartition s kills its own process the first
    ``crashes[s]`` times it finishes reading (counted in files under ``directory``)."""

    def __init__(self, keys, directory: str, crashes: dict[int, int]):
        super().__init__(keys)
        self.directory, self.crashes = directory, crashes

    def finalize(self, table, subpartition):
        count_file = os.path.join(self.directory, f"crashes-{subpartition}")
        done = os.path.getsize(count_file) if os.path.exists(count_file) else 0
        if done < self.crashes.get(subpartition, 0):
            with open(count_file, "ab") as f:
                f.write(b"x")
            os._exit(1)
        return super().finalize(table, subpartition)


def test_a_reducer_queued_behind_one_that_crashes_its_reader_gets_retries_of_its_own(
        ray_local, tmp_path, monkeypatch):
    """A reader runs one reducer with the next queued behind it. Each time the running one
    kills the process, Ray fails and retries the queued call too, spending its retries
    (WORKER_MAX_RETRIES): after three crashes of subpartition 0, one crash of subpartition
    1 failed the shuffle. The driver now submits such a reducer once more."""
    from hybrid_ray import nodes
    from hybrid_ray.actors import WORKER_MAX_RETRIES

    monkeypatch.setattr(nodes, "NODE_DEATH_WAIT_S", 1.0)
    table = make_table(20_000, seed=11)
    ds = ray_local.data.from_arrow(table).repartition(2).materialize()
    cfg = base_config(tmp_path, max_concurrent_reducers=1, mode="blocking")
    partitioner = CrashingFinalize(["key"], str(tmp_path),
                                   {0: WORKER_MAX_RETRIES, 1: 1})
    result = hybrid_ray.run_shuffle(ds.to_arrow_refs(), 3, partitioner, table.schema, cfg)
    assert row_fingerprint(ray_local.get(result.refs)) == row_fingerprint([table])
    assert os.path.getsize(tmp_path / "crashes-0") == WORKER_MAX_RETRIES
    assert os.path.getsize(tmp_path / "crashes-1") == 1
    assert_no_leftovers(cfg, ray_local)


def test_the_last_large_maps_are_cut_in_pieces_one_per_writer():
    """The map stage's tail (see TAIL_PIECES): the last large single-block maps, one per
    writer, are each cut into consecutive pieces; small, grouped and unknown-size maps
    never are, nor are the maps of a shuffle with no more maps than writers."""
    from hybrid_ray.shuffle import TAIL_PIECES, _split_tail

    assert TAIL_PIECES == 2
    sizes = [100, 100, None, 100, 100, 10, 10]
    groups = [[0], [1], [2], [3], [4], [5, 6]]
    assert _split_tail(groups, sizes, target_bytes=25, writers=2) == [
        ([0], 0, 1), ([1], 0, 1), ([2], 0, 1), ([3], 0, 2), ([3], 1, 2), ([4], 0, 2),
        ([4], 1, 2), ([5, 6], 0, 1)]
    # Below TAIL_SPLIT_MIN_FACTOR x the target a map stays whole.
    assert _split_tail(groups, sizes, target_bytes=26, writers=2) == \
        [(g, 0, 1) for g in groups]
    assert _split_tail(groups[:2], sizes, target_bytes=1, writers=2) == \
        [([0], 0, 1), ([1], 0, 1)]


def test_pieces_of_a_split_map_keep_every_row_once_in_input_order(ray_local, tmp_path):
    """Four 1,000-row blocks on three writers (the tests' two CPUs and a spare): the last
    three are cut in two maps each (seven maps), and every output partition still holds each
    of its rows once, in input order (consecutive pieces are consecutive maps; readers read
    in map order)."""
    from hybrid_ray.map_task import BlockPiece

    ids = np.arange(4_000, dtype=np.int64)
    table = pa.table({"id": ids, "key": ids % 7, "pad": pa.array([b"x" * 100] * len(ids))})
    refs = [ray_local.put(table.slice(i * 1_000, 1_000)) for i in range(4)]
    cfg = base_config(tmp_path, map_chunk_bytes=64 * 1024)
    res = hybrid_ray.run_shuffle(refs, 3, hybrid_ray.HashPartitioner(["key"]), table.schema,
                                 cfg)
    assert res.report.num_maps == 7
    parts = ray_local.get(res.refs)
    assert row_fingerprint(parts) == row_fingerprint([table])
    for part in parts:
        got = part["id"].to_numpy()
        assert (np.diff(got) > 0).all(), "rows out of input order"
    assert BlockPiece(refs[0], 1, 2).rows_of(table)["id"][0].as_py() == 2_000
    with pytest.raises(ValueError, match=r"piece 2 of 2: index must be in \[0, 2\)"):
        BlockPiece(refs[0], 2, 2)
    assert_no_leftovers(cfg, ray_local)


def test_outputs_on_a_node_that_died_unseen_by_the_driver_fail_the_shuffle(monkeypatch):
    """A node can die while nothing of the shuffle runs on it (its maps' lost segments
    run again elsewhere): the driver never saw it go, and handed out a Dataset whose
    blocks stored there were gone. Ray's node table is now asked before returning."""
    from hybrid_ray import shuffle as shuffle_mod

    class Pool:
        lost_nodes: set = set()

        def node_of(self, sub):
            return {0: "n1", 1: "n2"}[sub]

    monkeypatch.setattr(shuffle_mod.ray, "nodes", lambda: [
        {"NodeID": "n1", "Alive": True}, {"NodeID": "n2", "Alive": False}])
    with pytest.raises(ShuffleFailedError, match=r"node\(s\) n2 died after reducing "
                                                 r"partitions \[1\]"):
        shuffle_mod._check_outputs_survived(["ref-0", "ref-1"], Pool())
    monkeypatch.setattr(shuffle_mod.ray, "nodes", lambda: [
        {"NodeID": "n1", "Alive": True}, {"NodeID": "n2", "Alive": True}])
    shuffle_mod._check_outputs_survived(["ref-0", "ref-1"], Pool())


def test_a_node_table_that_cannot_be_read_does_not_fail_a_finished_shuffle(monkeypatch):
    """The end-of-shuffle check of output nodes asks Ray's node table; a GCS that cannot
    answer must not turn a shuffle whose outputs are stored into a failure."""
    from hybrid_ray import shuffle as shuffle_mod

    class Pool:
        lost_nodes: set = set()

        def node_of(self, sub):
            return "n1"

    def unavailable():
        raise RuntimeError("GCS unavailable")

    monkeypatch.setattr(shuffle_mod.ray, "nodes", unavailable)
    shuffle_mod._check_outputs_survived(["ref-0"], Pool())


class DealingPartitioner(hybrid_ray.Partitioner):
    """Not deterministic, yet balanced: every run sends each subpartition as many rows,
    but a map's second run swaps which rows (as an unseeded permutation dealt round-robin
    does)."""

    def __init__(self):
        self.seen = set()

    def assign(self, table, map_index, num_partitions):
        parts = table["id"].to_numpy() % num_partitions
        if map_index in self.seen:
            return (parts + 1) % num_partitions
        self.seen.add(map_index)
        return parts


def test_a_lost_map_rerun_that_moves_rows_but_keeps_counts_fails_loudly(ray_local, tmp_path):
    """Was: only the rows per subpartition were compared, so a re-run sending each
    subpartition as many but other rows was accepted: the finished reducer's rows came
    out twice (kept, and read again by the other reducer) and the moved ones never."""
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.shuffle import read_subpartition, write_map_partition

    config, master, shuffle_id = _recoverable_shuffle(ray_local, tmp_path, "deal", 1)
    table = pa.table({"id": np.arange(10_000)})
    partitioner = DealingPartitioner()  # the test's process runs every map here
    try:
        write_map_partition(shuffle_id, 0, [table], 2, partitioner, config, master)
        assert len(pa.concat_tables(read_subpartition(shuffle_id, 1, config, master))) > 0
        ray_local.get(master.free_subpartitions.remote(shuffle_id, [1]))  # its reducer is done
        assert ray_local.get(master.report_lost.remote(shuffle_id, 0, 0))
        with pytest.raises(ConfigError, match=r"subpartition 1: 5000 rows then, 5000 now "
                                              r"but other rows.*not deterministic"):
            write_map_partition(shuffle_id, 0, [table], 2, partitioner, config, master)
    finally:
        ray_local.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray_local)


def test_a_lost_map_rerun_over_a_changed_input_fails_loudly_with_a_random_partitioner(
        ray_local, tmp_path):
    """RandomPartitioner labels rows by position: a re-run whose input block was rebuilt
    with other rows (its task not deterministic) sent every subpartition as many rows at
    the same positions, so the row digests matched and the re-run was accepted; the
    finished reducer kept the first input's rows, the others read the second's: rows lost
    and duplicated without an error (found by a review). The rows' contents are in the
    digests of such partitioners now."""
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.shuffle import read_subpartition, write_map_partition

    config, master, shuffle_id = _recoverable_shuffle(ray_local, tmp_path, "changed", 1)
    first = pa.table({"id": np.arange(10_000)})
    rebuilt = pa.table({"id": np.arange(10_000, 20_000)})  # as many rows, other ones
    try:
        write_map_partition(shuffle_id, 0, [first], 2, hybrid_ray.RandomPartitioner(7),
                            config, master)
        kept = pa.concat_tables(read_subpartition(shuffle_id, 1, config, master))
        assert 0 < kept.num_rows < 10_000
        ray_local.get(master.free_subpartitions.remote(shuffle_id, [1]))  # reducer done
        assert ray_local.get(master.report_lost.remote(shuffle_id, 0, 0))
        with pytest.raises(ConfigError, match=rf"subpartition 1: {kept.num_rows} rows then, "
                                              rf"{kept.num_rows} now but other rows.*"
                                              r"input changed between the runs"):
            write_map_partition(shuffle_id, 0, [rebuilt], 2,
                                hybrid_ray.RandomPartitioner(7), config, master)
    finally:
        ray_local.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray_local)


class _SecondPerMapPartitioner(hybrid_ray.Partitioner):
    """Rows by key, each map taking a second: a long map stage of short maps."""

    def assign(self, table, map_index, num_partitions):
        time.sleep(1.0)
        return (table.column("key").to_numpy() % num_partitions).astype(np.int64)


def test_a_shuffle_queued_behind_another_on_its_readers_is_not_stalled(ray_local, tmp_path):
    """Shuffles of one driver share the readers, and a hybrid reducer holds its reader
    until its shuffle's last map finished. A shuffle whose reducers waited behind another
    shuffle's (whose maps all the while finished every second) counted only its own
    progress: past stall_timeout_s it failed with ShuffleStalledError ("reducers of
    subpartitions [0, 1] still running") and restarted the readers, killing the other
    shuffle's reducers, while nothing was stuck (found by a review)."""
    ns = "reader-queue"
    hybrid_ray.init(base_config(tmp_path, namespace=ns))
    results: dict = {}

    def run(name, rows, partitioner, cfg, delay):
        time.sleep(delay)
        table = pa.table({"key": np.arange(rows), "id": np.arange(rows)})
        refs = [ray_local.put(table.slice(i, 200)) for i in range(0, rows, 200)]
        try:
            res = hybrid_ray.run_shuffle(refs, 4, partitioner, table.schema, cfg)
            got = pa.concat_tables(ray_local.get(res.refs))
            results[name] = sorted(got.column("id").to_pylist()) == list(range(rows))
        except BaseException as exc:  # reported by the test thread below
            results[name] = exc

    # 24 one-block maps of a second each (map_chunk_bytes small: no grouping) on 3
    # writers: 8 s of maps, one finishing every third of a second.
    long_cfg = base_config(tmp_path, namespace=ns, map_chunk_bytes=4096)
    quick_cfg = base_config(tmp_path, namespace=ns, stall_timeout_s=3.0)
    threads = [threading.Thread(target=run, args=("long", 24 * 200,
                                                  _SecondPerMapPartitioner(), long_cfg, 0)),
               threading.Thread(target=run, args=("quick", 800, hybrid_ray.HashPartitioner(
                   ["key"]), quick_cfg, 0.5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert results == {"long": True, "quick": True}
    assert_no_leftovers(long_cfg, ray_local)


class _TierManagerDiesOnce(Partitioner):
    """Hash by ``key``; the first map to run raises what a map's call to its node's tier
    manager raises when that tier manager dies mid-call (a marker file: once per test)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def assign(self, table, map_index, num_partitions):
        import ray

        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return np.asarray(table["key"]) % num_partitions
        raise ray.exceptions.ActorDiedError()


def test_a_map_whose_tier_manager_died_mid_call_runs_again_without_a_node_death_wait(
        dataset, tmp_path, monkeypatch):
    """A map whose call to its node's tier manager failed because that tier manager died
    (killed mid-shuffle) fails with RayTaskError(ActorDiedError), which is also an
    ActorDiedError: the driver took it for its writer process lost and waited up to
    NODE_DEATH_WAIT_S (15 s) for the node table to call the node dead before running the
    map again (a harness killing a tier manager mid-shuffle: 16-46 s for a 2 s shuffle).
    The writer answered, so its node is alive: the map runs again at once, exact."""
    from hybrid_ray import lifecycle

    asked = []
    monkeypatch.setattr(lifecycle, "lost_with_node",
                        lambda node, exc, *args: asked.append(node) or False)
    ds, table = dataset
    out = hybrid_ray.run_shuffle(ds.to_arrow_refs(), 4,
                                 _TierManagerDiesOnce(str(tmp_path / "died")), table.schema,
                                 base_config(tmp_path))
    import ray

    result = pa.concat_tables(ray.get(r) for r in out.refs)
    assert row_fingerprint([result]) == row_fingerprint([table])
    assert os.path.exists(tmp_path / "died") and asked == []


class _KillsTheMaster(hybrid_ray.HashPartitioner):
    """Kills its shuffle's master as map 0 starts: a master lost before the outputs are
    complete."""

    def __init__(self, keys, namespace):
        super().__init__(keys)
        self.namespace = namespace

    def assign(self, table, map_index, num_partitions):
        import ray

        from hybrid_ray.actors import MASTER_NAME

        if map_index == 0:
            ray.kill(ray.get_actor(MASTER_NAME, namespace=self.namespace))
        return super().assign(table, map_index, num_partitions)


def test_the_note_of_a_shuffle_whose_master_died_at_release_names_no_secret(caplog):
    """The driver's own removal of a shuffle whose master died at its release (its output
    complete) puts what failed in the report's note and the log: a storage error quoting
    the remote tier's credentials was printed as is."""
    import logging
    import types

    from hybrid_ray.errors import ShuffleMasterLostError
    from hybrid_ray.shuffle import _remove_without_master

    secret = "sEcReT-0123456789"
    cfg = hybrid_ray.ShuffleConfig(remote_path="s3://bucket/shuffles",
                                   storage_options={"key": "AKIAEXAMPLE0123",
                                                    "secret": secret})
    shuffle = types.SimpleNamespace(
        config=cfg,
        release_without_master=lambda nodes: [f"its remote tree: denied with {secret}"])
    with caplog.at_level(logging.WARNING, logger="hybrid_ray"):
        why = _remove_without_master(shuffle, ["node-a"], ShuffleMasterLostError("gone"))
    assert "Removing the shuffle's data failed (its remote tree: denied with ***)" in why
    assert secret not in why and secret not in caplog.text
    assert "denied with ***" in caplog.text


def test_a_master_killed_at_the_release_of_a_finished_shuffle_fails_nothing(
        ray_local, tmp_path, monkeypatch):
    """Every reducer had returned its block (stored, owned by the driver) when the master
    died at the shuffle's release (killed, OOM): the call raised, and the complete, exact
    output was lost to the user. Now the output is returned; the report says the books
    went with the master and holds only what the driver measured; the shuffle's data on
    the node and in the remote tier is removed all the same. A master lost before the
    outputs are complete still fails the shuffle, named."""
    import uuid

    import ray

    from hybrid_ray import lifecycle
    from hybrid_ray.errors import ShuffleMasterLostError
    from hybrid_ray.shuffle import run_shuffle

    table = make_table(60_000, seed=3)
    blocks = [ray.put(table.slice(i * 20_000, 20_000)) for i in range(3)]
    cfg = base_config(tmp_path, namespace=f"hr-books-{uuid.uuid4().hex[:6]}",
                      memory_capacity_bytes=256 * 1024, disk_capacity_bytes=1 * MiB,
                      remote_path=f"file://{tmp_path}/remote")
    real = lifecycle.ShuffleLifecycle.summarize_and_release
    killed: list[str] = []

    def master_dies_first(shuffle):
        ray.kill(shuffle.master)
        killed.append(shuffle.shuffle_id)
        return real(shuffle)

    monkeypatch.setattr(lifecycle.ShuffleLifecycle, "summarize_and_release",
                        master_dies_first)
    result = run_shuffle(blocks, 4, hybrid_ray.HashPartitioner(["key"]), table.schema, cfg,
                         operation="books-lost")
    assert row_fingerprint(ray.get(result.refs)) == row_fingerprint([table])
    report = result.report
    assert hybrid_ray.last_report() is report and report.shuffle_id == killed[0]
    assert report.books_lost and report.rows == table.num_rows and report.num_maps == 3
    assert report.num_partitions == 4 and report.per_node_tier == {}
    assert report.phases is not None and report.wall_time_s > 0
    assert any("books" in note and "shuffle master" in note for note in report.notes)
    assert "not known" in report.table() and "tier switches 0" not in report.table()
    assert_no_leftovers(cfg, ray)

    monkeypatch.setattr(lifecycle.ShuffleLifecycle, "summarize_and_release", real)
    # A new master, started once (on a loaded machine, longer than a call's bound).
    ray.get(get_master(cfg.namespace).run_deletions.remote(), timeout=300)
    with pytest.raises(ShuffleMasterLostError, match="is gone"):
        run_shuffle(blocks, 4, _KillsTheMaster(["key"], cfg.namespace), table.schema, cfg)
