"""The actors on a real local Ray: the master's deletions survive a storage outage, tier
managers give back what a vanished master can no longer release."""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid

import pyarrow as pa
import pytest
import ray

from conftest import (
    S3_KEY, S3_SECRET, TcpProxy, base_config, files_under, redactor_failing_once,
)
from hybrid_ray import (
    HashPartitioner, RemoteTierError, ShuffleConfig, ShuffleFailedError, TierName,
)
from hybrid_ray.actors import existing_tier_manager, get_master, get_tier_manager


class FailsAfterTheStoreGoesDown(HashPartitioner):
    """Map 1 waits until the test has taken the S3 endpoint down, then fails: the shuffle
    is released while its remote segments cannot be deleted."""

    def __init__(self, keys, flag):
        super().__init__(keys)
        self.flag = flag

    def assign(self, table, map_index, num_partitions):
        if map_index == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("boom: the map's own failure")
        return super().assign(table, map_index, num_partitions)


def _objects(fs, bucket):
    fs.invalidate_cache()
    return [p for p in fs.find(bucket) if p.endswith(".seg")]


def test_release_while_the_store_is_down_keeps_the_cause_and_deletes_later(
        ray_local, moto_endpoint, tmp_path):
    import s3fs

    from hybrid_ray.shuffle import run_shuffle

    direct = s3fs.S3FileSystem(endpoint_url=moto_endpoint, key=S3_KEY, secret=S3_SECRET)
    bucket = f"hr-{uuid.uuid4().hex[:10]}"
    direct.mkdir(bucket)
    proxy = TcpProxy(int(moto_endpoint.rsplit(":", 1)[1]))
    namespace = f"outage-{uuid.uuid4().hex[:6]}"
    cfg = base_config(tmp_path, memory_fraction=0.0, disk_capacity_bytes=0,
                      remote_path=f"s3://{bucket}/shuffle", namespace=namespace,
                      storage_options={"endpoint_url": proxy.endpoint, "key": S3_KEY,
                                       "secret": S3_SECRET,
                                       "config_kwargs": {"connect_timeout": 2,
                                                         "read_timeout": 2,
                                                         "retries": {"max_attempts": 1}}})
    flag = str(tmp_path / "store-is-down")
    table = pa.table({"key": list(range(20_000)), "v": list(range(20_000))})

    def take_the_store_down():
        deadline = time.monotonic() + 60
        while not _objects(direct, bucket) and time.monotonic() < deadline:
            time.sleep(0.1)  # map 0's segments are in S3
        proxy.down()
        open(flag, "w").close()

    downer = threading.Thread(target=take_the_store_down, daemon=True)
    downer.start()
    try:
        with pytest.raises(ShuffleFailedError, match="boom: the map's own failure"):
            run_shuffle([ray.put(table), ray.put(table)], 2,
                        FailsAfterTheStoreGoesDown(["key"], flag), table.schema, cfg)
        downer.join(timeout=10)
        master = get_master(namespace)
        status = ray.get(master.status.remote())
        assert status["shuffles"] == []  # forgotten by the books...
        pending = status["pending_deletions"]  # ...but not its data
        assert len(pending) == 1 and pending[0]["attempts"] >= 1, pending
        assert pending[0]["last_error"]
        assert _objects(direct, bucket), "segments vanished although S3 was down"
        proxy.up()
        deadline = time.monotonic() + 30
        while ray.get(master.run_deletions.remote()) and time.monotonic() < deadline:
            time.sleep(0.5)  # retried with backoff (1 s, 2 s, ...)
        assert ray.get(master.run_deletions.remote()) == []
        assert _objects(direct, bucket) == []
    finally:
        proxy.close()
        direct.rm(bucket, recursive=True)


def test_tier_manager_releases_shuffles_its_master_no_longer_holds(ray_local, tmp_path):
    namespace = f"sweep-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    node = ray.get_runtime_context().get_node_id()
    tm = get_tier_manager(node, namespace)
    master = get_master(namespace)
    ray.get(master.register.remote("shf-live", 1, 1, cfg))
    for shuffle_id in ("shf-live", "shf-orphan"):
        assert ray.get(tm.register_shuffle.remote(shuffle_id, cfg)) > 0
    # One sweep is grace (a shuffle may be in the middle of being registered)...
    assert ray.get(tm.sweep_orphans.remote()) == []
    # ...the second releases what the master does not hold, and gives its quota back.
    assert ray.get(tm.sweep_orphans.remote()) == ["shf-orphan"]
    usage = ray.get(tm.usage.remote())
    assert usage.shuffles == ("shf-live",) and set(usage.quotas) == {"shf-live"}
    # The master dies (its node, in a real cluster): nobody is left to release the rest.
    ray.kill(master)
    deadline = time.monotonic() + 30
    released: list = []
    while not released and time.monotonic() < deadline:
        released = ray.get(tm.sweep_orphans.remote())
    assert released == ["shf-live"]
    usage = ray.get(tm.usage.remote())
    assert usage.shuffles == () and usage.quotas == {}
    assert all(t.used_bytes == 0 for t in usage.tiers)


def test_failed_orphan_sweeps_are_counted_not_swallowed(ray_local):
    """The tier manager's periodic sweep reports each failure (status shows the count and
    the last error) instead of dropping it, and keeps sweeping."""
    import threading

    from hybrid_ray.actors import _call_periodically

    @ray_local.remote
    class BrokenSweeper:
        def sweep_orphans(self):
            raise RuntimeError("master unreachable")

    errors: list[BaseException] = []
    actor = BrokenSweeper.remote()
    # Stopped at the end: a thread left calling into Ray after this module's Ray is shut
    # down would auto-start a Ray without the tests' runtime_env for the next module.
    stop = threading.Event()
    sweeper = threading.Thread(target=_call_periodically,
                               args=(actor, 0.2, errors.append, stop), daemon=True)
    sweeper.start()
    def raised() -> int:  # the first calls may time out while the actor starts
        return sum("master unreachable" in str(e) for e in errors)

    deadline = time.monotonic() + 30
    while raised() < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    sweeper.join(timeout=10)
    assert not sweeper.is_alive()
    assert raised() >= 2, errors
    ray_local.kill(actor)


# A long poll the tests below expect to be answered by news is held this long, not the
# master's 1 s (MAX_POLL_WAIT_S): at 1 s, a loaded machine whose calls between the poll
# and the news took more than that got the poll's deadline answer (without the news).
NEWS_WAIT_S = 60.0


def _master_holding_polls(namespace: str):
    """A master of ``namespace`` whose long polls may wait up to ``NEWS_WAIT_S``."""
    from hybrid_ray.actors import MASTER_NAME, ShuffleMasterActor

    return ShuffleMasterActor.options(name=MASTER_NAME, namespace=namespace).remote(
        namespace, max_poll_wait_s=NEWS_WAIT_S)


def test_master_long_poll_waits_for_news_and_answers_on_commit(ray_local, tmp_path):
    """A reader's poll with nothing new waits in the master (it does not return at once
    to be asked again), a commit answers it at once, and polls waiting on other
    subpartitions, more than the master's default threads, neither block that commit nor
    wake with nothing for them."""
    from hybrid_ray import SegmentId, SegmentMeta, TierName
    from hybrid_ray.actors import MAX_POLL_WAIT_S

    namespace = f"longpoll-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    master = _master_holding_polls(namespace)
    ray.get(master.register.remote("shf-poll", 1, 2, cfg))
    attempt = ray.get(master.begin_map.remote("shf-poll", 0, "n1", 1))

    idle = ray.get(master.poll.remote("shf-poll", 0, {}, 1, 0.5))
    assert idle.updates == [] and not idle.done
    assert idle.waited_s >= 0.5  # it waited for news, the whole time asked for

    others = [master.poll.remote("shf-poll", 1, {}, 1, MAX_POLL_WAIT_S) for _ in range(16)]
    waiting = master.poll.remote("shf-poll", 0, {}, 1, NEWS_WAIT_S)
    time.sleep(0.2)
    meta = SegmentMeta(SegmentId("shf-poll", 0, 0, 0, attempt), TierName.DISK, 10, 1, "n1",
                       "/x/0-0-0")
    assert ray.get(master.commit.remote("shf-poll", 0, attempt, [meta]))
    answered = ray.get(waiting)
    assert [(m, a, reset, [x.id for x in metas]) for m, a, reset, metas in answered.updates] \
        == [(0, attempt, False, [meta.id])]
    assert answered.waited_s < NEWS_WAIT_S  # woken by the commit, not by its deadline
    for result in ray.get(others):  # subpartition 1 got nothing: they waited it out
        assert result.updates == [] and result.waited_s >= MAX_POLL_WAIT_S * 0.9
    ray.get(master.release.remote("shf-poll"))
    ray.kill(master)


def test_master_long_poll_answers_a_batch_of_news_not_every_commit(ray_local, tmp_path):
    """With 8 maps a waiting poll is answered once 2 new segments are in (a quarter of the
    maps), not at the first commit: a reader that started with the maps was answered at
    every commit, about 30 round trips through the master per reader at 17 maps. Whatever
    is in is answered at the deadline, and a complete subpartition at once."""
    from hybrid_ray import SegmentId, SegmentMeta, TierName
    from hybrid_ray.actors import MAX_POLL_WAIT_S

    namespace = f"batchpoll-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    master = _master_holding_polls(namespace)
    ray.get(master.register.remote("shf-batch", 8, 1, cfg))

    def commit(m):
        attempt = ray.get(master.begin_map.remote("shf-batch", m, "n1", 1))
        meta = SegmentMeta(SegmentId("shf-batch", m, 0, 0, attempt), TierName.DISK, 10, 1,
                           "n1", f"/x/{m}")
        assert ray.get(master.finish_map.remote("shf-batch", m, attempt, None, [meta]))

    waiting = master.poll.remote("shf-batch", 0, {}, 1, NEWS_WAIT_S)
    time.sleep(0.2)
    commit(0)
    ready, _ = ray.wait([waiting], timeout=0.3)
    assert not ready  # one segment: not worth an answer yet
    commit(1)
    answered = ray.get(waiting)
    assert sorted(u.map_index for u in answered.updates) == [0, 1]
    assert answered.waited_s < NEWS_WAIT_S  # answered by the batch, not the deadline
    cursors = {u.map_index: (u.attempt, 1) for u in answered.updates}

    commit(2)  # alone at the deadline: answered with what there is
    late = ray.get(master.poll.remote("shf-batch", 0, cursors, 1, MAX_POLL_WAIT_S))
    assert [u.map_index for u in late.updates] == [2] and not late.done
    assert late.waited_s >= MAX_POLL_WAIT_S * 0.9
    cursors[2] = (late.updates[0].attempt, 1)

    for m in range(3, 8):
        commit(m)
    final = ray.get(master.poll.remote("shf-batch", 0, cursors, 1, MAX_POLL_WAIT_S))
    assert final.done and sorted(u.map_index for u in final.updates) == [3, 4, 5, 6, 7]
    ray.get(master.release.remote("shf-batch"))
    ray.kill(master)


def _a_map_on_disk(tmp_path, prefix):
    """A shuffle of one map over two subpartitions, written to the disk tier only, in a
    namespace of its own: (namespace, node, master, shuffle id)."""
    return _a_map(tmp_path, prefix, memory_fraction=0.0)


def _a_map(tmp_path, prefix, **config):
    """A shuffle of one map over two subpartitions, written with a ShuffleConfig of
    ``config``, in a namespace of its own: (namespace, node, master, shuffle id)."""
    from hybrid_ray.map_task import write_map_partition

    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace, **config)
    node = ray.get_runtime_context().get_node_id()
    master = get_master(namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, cfg))
    table = pa.table({"k": list(range(2000)), "v": [b"x" * 50] * 2000})
    write_map_partition(shuffle_id, 0, [table], 2, HashPartitioner(["k"]), cfg, master)
    return namespace, node, master, shuffle_id


def test_master_finds_a_tier_manager_started_again_after_its_kept_handle_died(ray_local,
                                                                              tmp_path):
    """The master keeps tier-manager handles (a lookup by name per deletion was a GCS
    round trip). A handle whose actor died must be dropped: a tier manager started again
    on the node gets the deletions, which would otherwise fail for good."""
    namespace, node, master, shuffle_id = _a_map_on_disk(tmp_path, "tmcache")
    files = {sub: [m.location for m in ray.get(master.segments.remote(shuffle_id))
                   if m.id.subpartition == sub] for sub in (0, 1)}
    assert files[0] and files[1] and all(os.path.exists(f) for f in files[0] + files[1])
    # The master deletes subpartition 0 through the node's tier manager, keeping its handle.
    ray.get(master.free_subpartitions.remote(shuffle_id, [0]))
    deadline = time.monotonic() + 30
    while any(os.path.exists(f) for f in files[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f) for f in files[0])
    # The tier manager dies and another starts on the node.
    ray.kill(get_tier_manager(node, namespace), no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(get_tier_manager(node, namespace).usage.remote(), timeout=30)
            break
        except ray.exceptions.RayActorError:  # the killed one, still registered by name
            time.sleep(0.2)
    ray.get(master.free_subpartitions.remote(shuffle_id, [1]))
    deadline = time.monotonic() + 60  # the failed deletion is retried with backoff
    while any(os.path.exists(f) for f in files[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f) for f in files[1]), ray.get(master.run_deletions.remote())
    ray.get(master.release.remote(shuffle_id))


def test_a_release_reaches_the_files_of_a_tier_manager_that_died(ray_local, tmp_path):
    """A node's tier manager died after a map wrote its disk segments there. The master
    skipped nodes without a tier manager (and a new one knew none of the shuffle's disks),
    so the release counted as done and the spill files stayed for good. It now starts a
    tier manager on the alive node and sends the shuffle's config with the release."""
    namespace, node, master, shuffle_id = _a_map_on_disk(tmp_path, "tmdied")
    files = [m.location for m in ray.get(master.segments.remote(shuffle_id))]
    assert files and all(os.path.exists(f) for f in files)
    ray.kill(get_tier_manager(node, namespace), no_restart=True)
    deadline = time.monotonic() + 30
    while existing_tier_manager(node, namespace) is not None:  # gone from the name table
        assert time.monotonic() < deadline, "the killed tier manager stayed registered"
        time.sleep(0.2)
    ray.get(master.release.remote(shuffle_id))
    deadline = time.monotonic() + 60  # a failed deletion is retried with backoff
    while any(os.path.exists(f) for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f) for f in files), ray.get(master.run_deletions.remote())
    assert files_under(str(tmp_path / "spill")) == []


def test_a_tier_manager_started_again_counts_the_memory_segments_still_held(ray_local,
                                                                           tmp_path):
    """The writers own memory-tier objects, which outlive a tier manager that dies: the one
    started in its place takes the segments the master holds on its node into its books
    (was: empty books, so it granted the node's memory budget again beside them), and
    gives their bytes back as the master frees them."""
    namespace, node, master, shuffle_id = _a_map(tmp_path, "tmadopt",
                                                 memory_capacity_bytes=64 << 20)
    segments = ray.get(master.segments.remote(shuffle_id))
    assert {m.tier for m in segments} == {TierName.MEMORY}
    held = sum(m.nbytes for m in segments)

    def memory_used() -> int:
        usage = ray.get(get_tier_manager(node, namespace).usage.remote(), timeout=30)
        return next(t.used_bytes for t in usage.tiers if t.tier == TierName.MEMORY)

    assert memory_used() == held
    ray.kill(get_tier_manager(node, namespace), no_restart=True)
    deadline = time.monotonic() + 30
    while existing_tier_manager(node, namespace) is not None:  # gone from the name table
        assert time.monotonic() < deadline, "the killed tier manager stayed registered"
        time.sleep(0.2)
    assert memory_used() == held  # the new tier manager's books
    ray.get(master.free_subpartitions.remote(shuffle_id, [0, 1]))
    deadline = time.monotonic() + 30
    while memory_used() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert memory_used() == 0
    ray.get(master.release.remote(shuffle_id))


def test_a_reused_writer_puts_through_a_tier_manager_started_again(ray_local, tmp_path):
    """A process that writes memory-tier segments owned by its node's tier manager (a
    reused Spark Python worker) keeps its tiers per config (``io_tiers_for``). The cached
    memory tier kept the handle of the tier manager it was opened with: once that one died
    and another started on the node, every later map of the process failed putting its
    segments through the dead actor (until 8 other configs evicted the tier set)."""
    from hybrid_ray.map_task import write_map_partition

    namespace = f"tmreuse-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    node = ray.get_runtime_context().get_node_id()
    master = get_master(namespace)
    table = pa.table({"k": list(range(2000)), "v": [b"x" * 50] * 2000})

    def one_map() -> list:
        shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
        ray.get(master.register.remote(shuffle_id, 1, 2, cfg))
        write_map_partition(shuffle_id, 0, [table], 2, HashPartitioner(["k"]), cfg, master)
        segments = ray.get(master.segments.remote(shuffle_id))
        ray.get(master.release.remote(shuffle_id))
        return segments

    assert {m.tier for m in one_map()} == {TierName.MEMORY}
    ray.kill(get_tier_manager(node, namespace), no_restart=True)
    deadline = time.monotonic() + 30
    while existing_tier_manager(node, namespace) is not None:  # gone from the name table
        assert time.monotonic() < deadline, "the killed tier manager stayed registered"
        time.sleep(0.2)
    assert {m.tier for m in one_map()} == {TierName.MEMORY}


def test_a_map_whose_finish_is_refused_reports_itself_skipped(ray_local, tmp_path):
    """An attempt superseded after its last chunk (a newer attempt of the map began
    meanwhile) is refused at finish_map; it still returned its statistics, which the
    driver took for the map's result in place of the run whose output counts."""
    from hybrid_ray.map_task import map_block

    namespace = f"refused-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace, memory_fraction=0.0)
    master = get_master(namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, cfg))
    node = ray.get_runtime_context().get_node_id()

    class SupersededWhileHashing(HashPartitioner):
        def assign(self, table, map_index, num_partitions):
            ray.get(master.begin_map.remote(shuffle_id, map_index, node, 0))  # attempt 1
            return super().assign(table, map_index, num_partitions)

    table = pa.table({"k": list(range(2000)), "v": [b"x" * 50] * 2000})
    result = map_block(shuffle_id, 0, table, 2, SupersededWhileHashing(["k"]), cfg, master)
    assert result == {"rows": 0, "skipped": True}
    ray.get(master.release.remote(shuffle_id))


@ray.remote
def _answer_shuffle_released(shuffle_id):
    raise ShuffleFailedError(f"shuffle {shuffle_id!r} failed and was released: test")


class _MasterReleasedAtFinish:
    """The master as a late map sees it: the shuffle failed and was released between the
    map's last reservation and its finish_map (which then raises)."""

    def __init__(self, master):
        self._master = master
        self.finish_map = self

    def remote(self, shuffle_id, *args):  # finish_map.remote
        return _answer_shuffle_released.remote(shuffle_id)

    def __getattr__(self, name):
        return getattr(self._master, name)


def test_a_map_whose_finish_finds_its_shuffle_released_deletes_what_it_wrote(ray_local,
                                                                             tmp_path):
    """A map's last segments travel with finish_map. If that call finds the shuffle gone,
    the master never took them: the map must delete them itself (a CI run left a late
    map's files behind when the release came after its reservation)."""
    from hybrid_ray.map_task import write_map_partition

    namespace = f"late-{uuid.uuid4().hex[:6]}"
    spill = tmp_path / "spill"
    cfg = ShuffleConfig(spill_dirs=[str(spill)], progress=False, namespace=namespace,
                        memory_fraction=0.0)
    master = get_master(namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, cfg))
    table = pa.table({"k": list(range(2000)), "v": [b"x" * 50] * 2000})
    with pytest.raises(ShuffleFailedError, match="failed and was released: test"):
        write_map_partition(shuffle_id, 0, [table], 2, HashPartitioner(["k"]), cfg,
                            _MasterReleasedAtFinish(master))
    assert [p for p in spill.rglob("*.seg")] == []
    node = ray.get_runtime_context().get_node_id()
    usage = ray.get(get_tier_manager(node, namespace).usage.remote())
    assert [t.used_bytes for t in usage.tiers if t.tier == TierName.DISK] == [0]
    ray.get(master.release.remote(shuffle_id))


@ray.remote
def _commit_once_flagged(flag, master, *args):
    """A commit the master answers only once ``flag`` exists (bounded: a hang guard)."""
    deadline = time.monotonic() + 20
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise TimeoutError("the map never wrote its next chunk while its commit ran")
        time.sleep(0.05)
    return ray.get(master.commit.remote(*args))


class _SlowCommits:
    def __init__(self, master, flag):
        self._master, self._flag = master, flag
        self.commit = self

    def remote(self, *args):  # commit.remote
        return _commit_once_flagged.remote(self._flag, self._master, *args)

    def __getattr__(self, name):
        return getattr(self._master, name)


class _FlagsSecondChunk(HashPartitioner):
    def __init__(self, keys, flag):
        super().__init__(keys)
        self.flag, self.calls = flag, 0

    def assign(self, table, map_index, num_partitions):
        self.calls += 1
        if self.calls == 2:
            open(self.flag, "w").close()
        return super().assign(table, map_index, num_partitions)


def test_a_map_writes_its_next_chunk_while_its_commit_is_answered(ray_local, tmp_path):
    """A map's chunk commit is not waited for before the next chunk is written (a
    blocking round trip per chunk left a core idle): here the master answers the first
    commit only once the second chunk is being partitioned, and the map still finishes
    exactly."""
    from hybrid_ray.map_task import write_map_partition

    namespace = f"async-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace, memory_fraction=0.0,
                        segment_bytes={"disk": 16 * 1024})  # each chunk fills segments
    master = get_master(namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, cfg))
    chunks = [pa.table({"k": list(range(i * 1000, (i + 1) * 1000)), "v": [b"x" * 50] * 1000})
              for i in range(3)]
    flag = str(tmp_path / "second-chunk")
    stats = write_map_partition(shuffle_id, 0, chunks, 2, _FlagsSecondChunk(["k"], flag), cfg,
                                _SlowCommits(master, flag))
    assert stats is not None and stats.rows == 3000
    metas = ray.get(master.segments.remote(shuffle_id))
    assert sum(m.num_rows for m in metas) == 3000
    assert ray.get(master.progress.remote(shuffle_id))["maps"][0]["finished"] == 0
    ray.get(master.release.remote(shuffle_id))


def test_a_jvm_reader_asking_before_a_maps_last_commit_is_held_until_it_arrives(ray_local):
    """A JVM map task sends its last commit without waiting, so a reader can ask for an
    attempt Spark accepted before the commit is in: the master holds that ask and answers
    it when the commit arrives. An attempt whose output was committed and lost since is
    answered at once (no wait: the reader raises FetchFailedException), and one that never
    commits is answered at the ask's bound, still marked as awaited."""
    import json

    namespace = f"jvmwait-{uuid.uuid4().hex[:6]}"
    master = _master_holding_polls(namespace)
    shuffle = "spark-app-waits-0"

    def commit(map_index: int, map_id: int) -> str:
        return master.spark_commit.remote(json.dumps({
            "shuffle": shuffle, "num_partitions": 2, "map_index": map_index, "map_id": map_id,
            "node": "n1", "final": True, "segments": [[0, 0, "memory", 10, f"ref{map_id}"]]}))

    def ask(map_id: int, wait_s: float):
        return master.spark_await_blocks.remote(json.dumps({
            "shuffle": shuffle, "wait_s": wait_s, "blocks": [[map_id, 0]]}))

    ray.get(commit(0, 100))  # registers the shuffle
    start = time.monotonic()
    held = ask(101, NEWS_WAIT_S)
    time.sleep(0.3)
    ray.get(commit(1, 101))
    answer = json.loads(ray.get(held))
    assert answer["blocks"] == [[["memory", 10, "n1", "ref101"]]]
    assert answer["awaited"] is False
    assert time.monotonic() - start < NEWS_WAIT_S  # woken by the commit

    start = time.monotonic()
    never = json.loads(ray.get(ask(999, 0.4)))
    assert never == {"blocks": [None], "awaited": True, "lost": []}
    assert time.monotonic() - start >= 0.4

    ray.get(master.spark_abort.remote(json.dumps({"shuffle": shuffle, "map_id": 100})))
    start = time.monotonic()
    lost = json.loads(ray.get(ask(100, NEWS_WAIT_S)))
    assert lost == {"blocks": [None], "awaited": False, "lost": [0]}
    assert time.monotonic() - start < NEWS_WAIT_S  # not held for its bound

    # A last commit that fails in the master aborts its attempt and wakes the readers
    # waiting for it (was: they slept to their bound; the abort changes the books too).
    start = time.monotonic()
    held = ask(102, NEWS_WAIT_S)
    time.sleep(0.3)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(master.spark_commit.remote(json.dumps({
            "shuffle": shuffle, "num_partitions": 2, "map_index": 1, "map_id": 102,
            "node": "n1", "final": True, "segments": [[0, 0, "no-such-tier", 10, "x"]]})))
    assert json.loads(ray.get(held)) == {"blocks": [None], "awaited": False,
                                         "lost": [0]}
    assert time.monotonic() - start < NEWS_WAIT_S  # woken by the failed commit

    # An attempt that committed part of its output and then failed: its abort wakes the
    # readers waiting for it too (they slept to their bound).
    ray.get(master.spark_commit.remote(json.dumps({
        "shuffle": shuffle, "num_partitions": 2, "map_index": 1, "map_id": 103,
        "node": "n1", "final": False, "segments": [[0, 0, "memory", 10, "ref103"]]})))
    start = time.monotonic()
    held = ask(103, NEWS_WAIT_S)
    time.sleep(0.3)
    ray.get(master.spark_abort.remote(json.dumps({"shuffle": shuffle, "map_id": 103})))
    assert json.loads(ray.get(held)) == {"blocks": [None], "awaited": False,
                                         "lost": [0]}
    assert time.monotonic() - start < NEWS_WAIT_S  # woken by the abort
    ray.get(master.spark_release.remote(json.dumps({"shuffles": [shuffle]})))
    ray.kill(master)


def test_a_spark_shuffle_its_driver_registered_outlives_the_tier_manager_s_sweeps(ray_local,
                                                                                  tmp_path):
    """The JVM driver registers a shuffle with the master when Spark plans it. A map task's
    memory lease registers it on its node's tier manager at once, and a tier manager
    releases a shuffle its master does not know for two sweeps: registered only at its
    first commit, a shuffle whose tasks computed for a minute before committing was
    released under them (their next reservation failed, their files went)."""
    import json

    namespace = f"spkreg-{uuid.uuid4().hex[:6]}"
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    master = get_master(namespace)
    tm = get_tier_manager(ray.get_runtime_context().get_node_id(), namespace)
    ray.get(master.spark_open_session.remote("tok", cfg))
    config = {"session_token": "tok"}

    def lease(shuffle):
        return json.loads(ray.get(tm.spark_lease.remote(json.dumps(
            {"shuffle": shuffle, "bytes": 1000, "config": config}))))["lease"]

    planned = json.dumps({"shuffle": "spk-app-reg-1", "num_partitions": 4, "config": config})
    ray.get(master.spark_register.remote(planned))
    ray.get(master.spark_register.remote(planned))  # again: a no-op
    assert lease("spk-app-reg-1")["granted"] == 1000
    assert lease("spk-app-reg-2")["granted"] == 1000  # one the master never heard of
    assert ray.get(tm.sweep_orphans.remote()) == []
    assert ray.get(tm.sweep_orphans.remote()) == ["spk-app-reg-2"]
    assert ray.get(tm.usage.remote()).shuffles == ("spk-app-reg-1",)
    # Planned but with no map output yet: no report (a stage AQE never ran has none).
    assert ray.get(master.spark_reports.remote("spk-app-reg")) == []
    ray.get(master.spark_release.remote(json.dumps({"prefix": "spk-app-reg"})))
    assert ray.get(master.spark_reports.remote("spk-app-reg")) == []


def test_a_jvm_last_commit_arriving_after_its_attempt_s_abort_is_dropped_not_published(
        ray_local):
    """A JVM task's sender submits its last commit and then its abort without waiting, and
    the master runs calls on several threads: the abort can run first. The late commit's
    segments must then be deleted, not published as a finished attempt holding its data
    until the shuffle's release."""
    import json

    namespace = f"jvmlate-{uuid.uuid4().hex[:6]}"
    master = get_master(namespace)
    shuffle = "spark-app-late-0"

    def commit(map_index: int, map_id: int) -> None:
        ray.get(master.spark_commit.remote(json.dumps({
            "shuffle": shuffle, "num_partitions": 2, "map_index": map_index,
            "map_id": map_id, "node": "n1", "final": True,
            "segments": [[0, 0, "memory", 10, f"ref{map_id}"]]})))

    commit(1, 299)  # another map: the shuffle is known
    ray.get(master.spark_abort.remote(json.dumps({"shuffle": shuffle, "map_id": 300})))
    commit(0, 300)  # the aborted attempt's last commit, late
    commit(0, 301)  # Spark's retry of the same map
    [report] = ray.get(master.spark_reports.remote(shuffle))
    assert report["num_maps"] == 2 and report["superseded_attempts"] == 1
    assert [pair[1] for tiers in report["per_node_tier"].values()
            for pair in tiers.values()] == [2]  # maps 1 and 0 (the retry's) only
    answer = json.loads(ray.get(master.spark_await_blocks.remote(json.dumps(
        {"shuffle": shuffle, "wait_s": 0.0, "blocks": [[300, 0], [301, 0]]}))))
    assert answer["blocks"] == [None, [["memory", 10, "n1", "ref301"]]]
    ray.get(master.spark_release.remote(json.dumps({"shuffles": [shuffle]})))


def test_a_release_whose_store_hangs_answers_within_its_bound(ray_local, tmp_path):
    """A release waits for its data's deletion only so long (``release_wait_s``; the
    default stays inside the callers' call bound): a store that accepts connections and
    never answers once held a driver's release past its 30 s bound, failing a shuffle
    whose every output was stored. The deletion goes on in the background."""
    import socket

    from hybrid_ray.actors import MASTER_NAME, ShuffleMasterActor

    silent = socket.socket()  # accepts (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    namespace = f"hang-{uuid.uuid4().hex[:6]}"
    master = ShuffleMasterActor.options(name=MASTER_NAME, namespace=namespace).remote(
        namespace, release_wait_s=1.0)
    cfg = base_config(tmp_path, namespace=namespace, remote_path="s3://hr-hang/shuffle",
                      storage_options={
                          "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                          "key": S3_KEY, "secret": S3_SECRET,
                          "config_kwargs": {"connect_timeout": 2, "read_timeout": 60,
                                            "retries": {"max_attempts": 1}}})
    try:
        ray.get(master.register.remote("shf-hangs", 1, 1, cfg))
        start = time.monotonic()
        assert ray.get(master.release.remote("shf-hangs"), timeout=30) is True
        assert time.monotonic() - start < 10
        assert "shf-hangs" not in ray.get(master.live_shuffles.remote())  # forgotten
    finally:
        ray.kill(master)
        silent.close()


def test_a_worker_actor_started_again_after_its_process_died_knows_it(ray_local):
    """Was: the flag was set with a ``global`` statement in ``__init__``, which Ray runs
    from a by-value copy of the class with its own globals, so ``restarted_worker`` said
    False in every process. A map that Ray retried after its writer was killed then wrote
    as the dead run's attempt, next to that run's segments: one segment's rows came out
    twice (``test_shuffle.py::test_killed_worker_mid_shuffle_output_still_exact[map]``
    failed about one run in three)."""
    import signal

    from hybrid_ray.actors import ShuffleWorkerActor, restarted_worker

    worker = ShuffleWorkerActor.options(name=f"restart-probe-{uuid.uuid4().hex[:6]}").remote()
    try:
        assert ray.get(worker.run.remote(restarted_worker), timeout=60) is False
        pid = ray.get(worker.run.remote(os.getpid), timeout=60)
        os.kill(pid, signal.SIGKILL)
        # The call is retried (max_task_retries) in the process Ray starts again.
        assert ray.get(worker.run.remote(restarted_worker), timeout=120) is True
        assert ray.get(worker.run.remote(os.getpid), timeout=60) != pid
    finally:
        ray.kill(worker, no_restart=True)


def test_a_tier_manager_tells_a_jvm_reader_a_segment_is_gone_apart_from_a_failed_read(
        ray_local, tmp_path):
    """A JVM reader told Spark every failure to read a segment was a lost map output
    (FetchFailedException): Spark then recomputed every output of the writer's executor,
    for a store that was merely slow. Python errors do not cross to Java by type, so the
    tier manager answers empty bytes for a segment that is gone (file or object removed),
    the bytes for one that is there, and raises for a read that failed otherwise."""
    import json

    from hybrid_ray.segment import SegmentId, encode_segment
    from hybrid_ray.spark_jvm import GONE
    from hybrid_ray.tiers.disk import DiskTier
    from hybrid_ray.tiers.remote import open_remote_tier

    node, cfg, master, tm = _spark_session_tok("spkgone", tmp_path)
    shuffle = "spk-app-gone-1"
    disk_sid, remote_sid = SegmentId(shuffle, 0, 0, 0, 0), SegmentId(shuffle, 1, 0, 0, 0)
    disk_bytes = bytes(encode_segment(pa.table({"v": [1]}), disk_sid))
    remote_bytes = bytes(encode_segment(pa.table({"v": [2]}), remote_sid))
    disk_meta = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for(node)).write(
        disk_sid, disk_bytes)
    remote_meta = open_remote_tier(cfg).write(remote_sid, remote_bytes)

    def read_remote(location):
        return ray.get(tm.spark_read_remote.remote(json.dumps(
            {"shuffle": shuffle, "location": location, "nbytes": len(remote_bytes),
             "config": {"session_token": "tok"}})))

    assert ray.get(tm.spark_read_segment.remote(disk_meta.location)) == disk_bytes
    assert read_remote(remote_meta.location) == remote_bytes
    os.unlink(disk_meta.location)
    os.unlink(remote_meta.location.removeprefix("file://"))
    assert ray.get(tm.spark_read_segment.remote(disk_meta.location)) == GONE == b""
    assert read_remote(remote_meta.location) == GONE
    # Not a missing segment (here: a location outside the shuffle's tree): it raises.
    with pytest.raises(ray.exceptions.RayTaskError, match="UnsafePathError"):
        read_remote(f"file://{tmp_path}/elsewhere/x.seg")
    ray.get(tm.release_shuffle.remote(shuffle, cfg))
    ray.get(master.spark_release.remote(json.dumps({"prefix": "spk-app-gone",
                                                    "close_session": "tok"})))
    assert files_under(str(tmp_path / "spill")) == []


@ray.remote(num_cpus=0)
class _RecordingTierManager:
    """Records what ``free_segments`` received: whether each meta carried an ObjectRef."""

    def __init__(self):
        self.received = []

    def free_segments(self, shuffle_id, metas):
        self.received.extend((m.id.index, m.tier, m.nbytes, m.object_ref) for m in metas)
        return []

    def log(self):
        return self.received


def test_deletions_reach_tier_managers_without_object_refs(ray_local):
    """The master's deletions and a writer's abort tell the tier manager what to free by
    id and size only. A memory segment's ObjectRef in the message (a writer's abort sent
    them all) made the tier manager a borrower of the object, which its owner then had to
    track, and pickling refs costs more than the rest of the meta."""
    from hybrid_ray import actors
    from hybrid_ray.segment import SegmentId, SegmentMeta

    node = ray.get_runtime_context().get_node_id()
    ref = ray.put(b"segment bytes")
    metas = [SegmentMeta(SegmentId("shf-0000000refs", 0, 0, 0), TierName.MEMORY, 13, 1,
                         node_id=node, object_ref=[ref]),
             SegmentMeta(SegmentId("shf-0000000refs", 0, 0, 1), TierName.DISK, 7, 1,
                         node_id=node, location="/nowhere/shf-0000000refs/s0/x.seg")]
    recorder = _RecordingTierManager.remote()
    try:
        master_class = actors.ShuffleMasterActor.__ray_actor_class__

        class FakeMaster:
            _tier_managers = set()

            def _tier_manager(self, node_id):
                assert node_id == node
                return recorder

        state = type("State", (), {"shuffle_id": "shf-0000000refs", "config": None})()
        master_class._delete_segments(FakeMaster(), state, metas)
        actors.ActorNodeStorage(recorder).free_segments("shf-0000000refs", metas)
        received = ray.get(recorder.log.remote())
        assert received == [(0, TierName.MEMORY, 13, None), (1, TierName.DISK, 7, None)] * 2
        # The caller's metas keep their refs (readers still need them).
        assert metas[0].object_ref == [ref]
    finally:
        ray.kill(recorder)


def test_a_jvm_remote_write_queued_before_a_release_leaves_no_remote_tree(ray_local, tmp_path):
    """A JVM writer's remote segment is stored by its node's tier manager, which runs one
    call at a time. The master removed the remote tree while that tier manager was still
    busy, then the write queued before the release ran: the tree (marker and segment) was
    re-created after the removal and stayed. The master now removes the remote tree after
    the tier managers answered their release, so nothing is queued behind it."""
    import json

    namespace = f"jvmlate-{uuid.uuid4().hex[:6]}"
    remote = tmp_path / "remote"
    cfg = base_config(tmp_path, remote_path=f"file://{remote}", namespace=namespace,
                      job_id="job-jvmlate")
    master = get_master(namespace)
    node = ray.get_runtime_context().get_node_id()
    tm = get_tier_manager(node, namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, cfg, False, [node]), timeout=60)
    ray.get(tm.register_shuffle.remote(shuffle_id, cfg), timeout=60)
    # Keep the tier manager busy: a read of a FIFO blocks until the test opens its
    # writing end (below), after the master got the release; then it fails.
    job_dir = remote / "job-jvmlate"
    job_dir.mkdir(parents=True, mode=0o700)
    fifo = job_dir / "busy.fifo"
    os.mkfifo(fifo, 0o600)
    busy = tm.spark_read_remote.remote(json.dumps(
        {"shuffle": shuffle_id, "location": str(fifo), "nbytes": 4}))
    late_write = tm.spark_write_remote.remote(json.dumps(
        {"shuffle": shuffle_id, "map_index": 0, "partition": 0, "index": 0, "map_id": 0}),
        b"late segment bytes")
    time.sleep(0.5)  # both calls are queued at the tier manager
    release = master.release.remote(shuffle_id)
    time.sleep(1.0)  # the master is releasing meanwhile
    # Let the tier manager go on (read, then the late write). Opened without blocking,
    # retried until the tier manager's read has the FIFO open: bounded, never a hang.
    deadline = time.monotonic() + 30
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    os.write(fd, b"done")
    os.close(fd)
    with pytest.raises(RemoteTierError):  # (a FIFO cannot be read as a segment)
        ray.get(busy, timeout=30)
    assert "shf-" in json.loads(ray.get(late_write, timeout=30))["location"]
    ray.get(release, timeout=90)
    deadline = time.monotonic() + 60
    while ray.get(master.status.remote(), timeout=60)["pending_deletions"] \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    os.unlink(fifo)
    assert files_under(str(remote)) == []


def test_objects_a_killed_writer_uploaded_after_the_release_go_with_the_late_sweep(
        ray_local, tmp_path):
    """A writer killed after its upload landed past its shuffle's release never aborts,
    so nothing removed what it re-created (marker and segment). The master removes the
    released shuffle's remote tree once more ``late_sweep_s`` after the release (120 s by
    default; 1 s here)."""
    from hybrid_ray.actors import (
        HEAD_NODE_RESOURCE, MASTER_NAME, RELEASE_WAIT_S, ShuffleMasterActor, _get_or_start,
    )
    from hybrid_ray.segment import SegmentId
    from hybrid_ray.tiers.remote import open_remote_tier

    namespace = f"sweep-{uuid.uuid4().hex[:6]}"
    remote = tmp_path / "remote"
    cfg = base_config(tmp_path, remote_path=f"file://{remote}", namespace=namespace,
                      job_id="job-sweep")
    master = _get_or_start(ShuffleMasterActor, MASTER_NAME, namespace, namespace,
                           RELEASE_WAIT_S, 1.0, resources={HEAD_NODE_RESOURCE: 0.001})
    try:
        shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
        ray.get(master.register.remote(shuffle_id, 1, 2, cfg), timeout=60)
        ray.get(master.release.remote(shuffle_id), timeout=60)
        # The killed writer's upload, landing after the release: its marker and segment.
        open_remote_tier(cfg).write_frame(SegmentId(shuffle_id, 0, 1, 0, 0, "job-sweep"),
                                          b"a late segment")
        assert files_under(str(remote)) != []
        deadline = time.monotonic() + 30
        while files_under(str(remote)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert files_under(str(remote)) == []
        assert ray.get(master.status.remote(), timeout=60)["pending_deletions"] == []
    finally:
        ray.kill(master)


def test_a_remote_location_that_is_not_ours_is_left_once_and_the_rest_deleted(tmp_path,
                                                                             caplog):
    """A remote location the tier refuses (not a segment object of the shuffle, e.g. from
    a JVM commit) raised out of the master's deletion, which was then retried forever with
    backoff, and the batch's later remote segments waited for the shuffle's release (found
    by a review). It is now said and left, like a refused disk location."""
    import logging

    from hybrid_ray import actors
    from hybrid_ray.config import TierName
    from hybrid_ray.segment import SegmentId, SegmentMeta
    from hybrid_ray.tiers import RemoteTier

    tier = RemoteTier(1 << 20, f"file://{tmp_path}/remote", "job-1")
    precious = tmp_path / "remote" / "job-1" / "shf-1" / "precious.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("not ours")
    ours = SegmentId("shf-1", 0, 0, 1, job_id="job-1")
    path = tier.segment_path(ours)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"segment")
    metas = [SegmentMeta(SegmentId("shf-1", 0, 0, 0, job_id="job-1"), TierName.REMOTE, 8, 1,
                         "", str(precious)),
             SegmentMeta(ours, TierName.REMOTE, 7, 1, "", tier.segment_path(ours))]
    master_class = actors.ShuffleMasterActor.__ray_actor_class__

    class FakeMaster:
        _tier_managers = set()

        def _remote_tier(self, config):
            return tier

    state = type("State", (), {"shuffle_id": "shf-1", "config": None})()
    with caplog.at_level(logging.WARNING, logger="hybrid_ray.actors"):
        master_class._delete_segments(FakeMaster(), state, metas)  # raises nothing
    assert precious.read_text() == "not ours"
    assert not os.path.exists(tier.segment_path(ours))
    assert any("not a segment object of shuffle shf-1" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_status_reports_a_silent_or_failing_tier_manager_and_the_others(ray_local,
                                                                       monkeypatch):
    """The master asked each node's tier manager for its usage in turn, 30 s each, and a
    failing one failed the whole status (a review's suspicion): every node is now asked at
    once, within one bound, and a silent or failing one is named beside the others."""
    import time

    import ray

    from hybrid_ray import actors

    @ray.remote(num_cpus=0)
    class FakeTierManager:
        def __init__(self, how):
            self.how = how

        def usage(self):
            if self.how == "silent":
                time.sleep(30)
            if self.how == "failing":
                raise RuntimeError("its books are broken")
            return f"usage of {self.how}"

    fakes = {f"node-{how}": FakeTierManager.remote(how) for how in ("ok", "silent", "failing")}
    ray.get([fake.__ray_ready__.remote() for fake in fakes.values()], timeout=120)
    monkeypatch.setattr(actors.ray, "nodes", lambda: [
        {"NodeID": node_id, "Alive": True} for node_id in fakes])
    monkeypatch.setattr(actors, "existing_tier_manager", lambda node_id, ns: fakes[node_id])
    monkeypatch.setattr(actors, "STATUS_NODE_WAIT_S", 2.0)

    started = time.monotonic()
    usage, unanswered = actors.usage_of_nodes("ns")
    assert time.monotonic() - started < 10
    assert usage == ["usage of ok"], unanswered
    errors = {n["node_id"]: n["error"] for n in unanswered}
    assert errors["node-silent"] == "no answer within 2 s"
    assert "its books are broken" in errors["node-failing"]
    for fake in fakes.values():
        ray.kill(fake)


def test_a_tier_manager_registers_a_spark_shuffle_with_the_session_the_master_holds(
        ray_local, tmp_path):
    """The master forgets idle Spark sessions past SPARK_SESSIONS (c1a85fe keeps only those
    with a live shuffle) and then registers the session's next shuffles with Spark's
    carried fields, without the remote tier. A tier manager kept the session's whole config
    cached and registered them with the remote tier: JVM segments went to a remote tier
    whose segments and tree the master never deletes (it knows none), and readers on other
    nodes, asking the master, found no remote tier to read them from."""
    import json

    from hybrid_ray.spark_jvm import SPARK_SESSIONS, config_to_json

    node, cfg, master, tm = _spark_session_tok("spksess", tmp_path)
    carried = {**json.loads(config_to_json(cfg)), "session_token": "tok"}  # as the JVM sends

    def reserve(shuffle):
        return json.loads(ray.get(tm.spark_reserve.remote(json.dumps(
            {"shuffle": shuffle, "sizes": [100], "config": carried}))))

    assert reserve("spk-sess-1")["remote"] is True
    for i in range(SPARK_SESSIONS):  # other sessions: the idle "tok" is forgotten
        ray.get(master.spark_open_session.remote(f"other{i}", cfg))
    assert ray.get(master.spark_session_config.remote("tok")) is None
    assert reserve("spk-sess-2")["remote"] is False  # as the master registers it
    for shuffle in ("spk-sess-1", "spk-sess-2"):
        ray.get(tm.release_shuffle.remote(shuffle, cfg))


def _spark_session_tok(prefix, tmp_path):
    """A fresh namespace's master holding Spark session "tok" (a config with a ``file://``
    remote tier) and this node's tier manager: (node, config, master, tier manager)."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    node = ray.get_runtime_context().get_node_id()
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace, remote_path=f"file://{tmp_path}/remote")
    master = get_master(namespace)
    tm = get_tier_manager(node, namespace)
    ray.get(master.spark_open_session.remote("tok", cfg))
    return node, cfg, master, tm


def test_the_background_loop_s_error_in_status_never_shows_a_shuffle_s_credentials(
        ray_local):
    """The master's background loop (expiry, deletions) kept any error raw for
    ``status``: a storage library's message quoting a shuffle's options showed its key."""
    namespace = f"loop-{uuid.uuid4().hex[:6]}"
    key, secret = "AKIAEXAMPLELOOPKEY", "loop/Secret/Value123"
    # No remote_path: the release then deletes nothing remote (there is no such store).
    cfg = ShuffleConfig(progress=False, namespace=namespace,
                        storage_options={"key": key, "secret": secret})
    master = get_master(namespace)
    ray.get(master.register.remote("shf-loop", 1, 2, cfg))
    try:
        ray.get(master.__ray_call__.remote(
            lambda self: self._loop_failed(OSError(f"no access with {key}/{secret}"))))
        errors = ray.get(master.status.remote())["background_errors"]
        assert errors == {"count": 1, "last": "OSError: no access with ***/***"}
    finally:
        ray.get(master.release.remote("shf-loop"))


_KILLED_DRIVER = """
import sys, time
import numpy as np, pyarrow as pa, ray, hybrid_ray
from hybrid_ray import Partitioner, ShuffleConfig

class Slow(Partitioner):
    def assign(self, table, map_index, n):
        time.sleep(2.0)
        return (table.column("key").to_numpy() % n).astype(np.int64)

address, namespace, spill, pythonpath = sys.argv[1:5]
ray.init(address=address, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
table = pa.table({"key": np.arange(16000)})
refs = [ray.put(table.slice(i, 1000)) for i in range(0, 16000, 1000)]
print("started", flush=True)
hybrid_ray.run_shuffle(refs, 4, Slow(), table.schema,
                       ShuffleConfig(namespace=namespace, progress=False, spill_dirs=[spill],
                                     map_chunk_bytes=64 * 1024))
"""


def test_the_shuffle_of_a_driver_that_was_killed_is_released_without_waiting_its_ttl(
        ray_local, tmp_path):
    """A driver killed mid-shuffle left its shuffle in the master's books for orphan_ttl_s
    (6 h by default): its hybrid reducers held the namespace's shared readers waiting for
    maps no driver would run, so every other driver's next shuffle, its reducers queued
    behind them, failed as stalled after stall_timeout_s (15 min by default), and its
    memory segments and quota stayed taken (found by a review). The master now releases
    a shuffle once its driver's Ray job is dead."""
    import signal
    import subprocess
    import sys

    ns = f"killed-driver-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "driver.py"
    script.write_text(_KILLED_DRIVER)
    pythonpath = os.environ.get("PYTHONPATH", "")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    driver = subprocess.Popen(
        [sys.executable, str(script), ray_local.get_runtime_context().gcs_address, ns,
         str(tmp_path / "spill"), f"{os.path.dirname(tests_dir)}:{tests_dir}:{pythonpath}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert driver.stdout.readline().strip() == "started"
        master = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until a map finished: its reducers wait
            if master is None:
                try:
                    master = get_master(ns)
                except Exception:  # noqa: BLE001 - not started yet
                    time.sleep(0.5)
                    continue
            shuffles = ray.get(master.status.remote(), timeout=30)["shuffles"]
            if shuffles and shuffles[0]["maps_finished"] >= 1:
                break
            time.sleep(0.5)
        assert shuffles and shuffles[0]["maps_finished"] >= 1
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    deadline = time.monotonic() + 45
    while ray.get(master.live_shuffles.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(1)
    assert ray.get(master.live_shuffles.remote(), timeout=30) == {}
    assert files_under(str(tmp_path / "spill")) == []


def test_a_deletion_whose_outcome_cannot_be_recorded_is_retried_and_its_error_kept(
        monkeypatch):
    """The master's deletion runner: recording a failed deletion that raises (its error
    put in words by the ``Redactor``) dropped the deletion, its data left for good, and
    left the deletions taken with it listed as running for good. Now the deletion runs
    again, the others run, and the error is counted and kept for ``status`` like the
    background loop's. Run on the actor's class in this process (the actor's own threads),
    where the ``Redactor`` can be made to fail."""
    from hybrid_ray import actors
    from hybrid_ray import master as master_module

    calls: list[str] = []

    def release_io(state):
        calls.append(state.shuffle_id)
        if calls == ["a"]:
            raise OSError("storage down")

    monkeypatch.setattr(master_module, "Redactor",
                        redactor_failing_once(master_module.Redactor))
    master_class = actors.ShuffleMasterActor.__ray_metadata__.modified_class
    # Without its background thread: left running in this pytest process, it went on
    # calling Ray after this module's Ray was shut down (Ray then auto-started a local
    # instance of its own), and later modules' workers failed to import their tests.
    # run_deletions below runs the same deletion runner.
    monkeypatch.setattr(master_class, "_background_loop", lambda self: None)
    master = master_class(f"hr-deletions-{uuid.uuid4().hex[:6]}", release_wait_s=0.0)
    master.registry._release_data_io = release_io
    for shuffle_id in ("a", "b"):
        master.registry.register(shuffle_id, 1, 1, ShuffleConfig())
    with master._lock:  # both taken by one round of the runner
        master.registry.release("a")
        master.registry.release("b")
    master.run_deletions()
    deadline = time.monotonic() + 30  # the retry comes due after a 1 s backoff
    while master.run_deletions() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert master.run_deletions() == []
    assert sorted(calls) == ["a", "a", "b"]
    assert master.loop_errors == 1
    assert master.last_loop_error == "RuntimeError: injected: the error could not be scrubbed"
    assert master.registry.deletions_left("") == 0
