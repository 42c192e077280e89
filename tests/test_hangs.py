"""Hangs turned into clear errors within a bound: a black-holed S3 endpoint, a missing
segment, a dead cluster address (the last in tests/test_cli.py)."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest

from conftest import assert_no_leftovers, base_config, files_under


@pytest.fixture
def black_hole():
    """A real TCP server on 127.0.0.1 that accepts connections and never answers (an
    endpoint behind a broken proxy or a hung server). Yields its http:// URL."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)  # keep it open, read nothing, answer nothing

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def _black_hole_config(endpoint: str):
    """A remote tier on the black-holed S3 ``endpoint``, with 2 s connect/read timeouts."""
    from hybrid_ray import ShuffleConfig

    return ShuffleConfig(remote_path=f"s3://bucket-{uuid.uuid4().hex[:8]}/shuffle",
                         storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s",
                                          "config_kwargs": {"connect_timeout": 2,
                                                            "read_timeout": 2}},
                         progress=False)


def test_black_holed_s3_endpoint_fails_the_reachability_check_within_its_timeout(black_hole):
    """Was: no error after 190 s (botocore's 60 s timeouts x 5 attempts x s3fs's 5 retries,
    and a PUT waiting for "100 Continue" is not under any read timeout at all)."""
    from hybrid_ray.errors import RemoteTierError
    from hybrid_ray.shuffle import check_remote_tier

    config = _black_hole_config(black_hole)
    started = time.monotonic()
    with pytest.raises(RemoteTierError) as err:
        check_remote_tier(config)
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"took {elapsed:.1f} s"
    message = str(err.value)
    assert black_hole in message and "did not answer in time" in message
    assert "read_timeout" in message and "config_kwargs" in message


def test_a_call_s_own_deadline_is_not_reported_as_the_600_s_wait_running_out(black_hole):
    """fsspec's FSTimeoutError (a call's deadline) is a TimeoutError, which ``outcome``
    took for its own wait running out: a black-holed endpoint failed the reachability
    check after 8 s as "ShuffleStalledError: ... did not finish within 600 s: the store is
    hung or far too slow", beside the hint that it did not answer within its 8 s."""
    from hybrid_ray.errors import RemoteTierError
    from hybrid_ray.shuffle import check_remote_tier

    config = _black_hole_config(black_hole)
    with pytest.raises(RemoteTierError) as err:
        check_remote_tier(config)
    message = str(err.value)
    assert "600 s" not in message and "ShuffleStalledError" not in message, message
    assert "FSTimeoutError" in message and "deadline 8 s" in message, message


def test_default_s3_timeouts_bound_a_call_to_30_s():
    """The defaults alone (no config_kwargs) bound every S3 call well under the 190 s seen."""
    from hybrid_ray.tiers import RemoteTier

    tier = RemoteTier(1 << 20, "s3://bucket/prefix", "job-t",
                      {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
                      check_reachable=False)
    assert tier.deadline()["timeout"] <= 30
    # A user's settings win over the defaults.
    slow = RemoteTier(1 << 20, "s3://bucket/prefix", "job-t",
                      {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
                       "config_kwargs": {"read_timeout": 100}}, check_reachable=False)
    assert slow.deadline()["timeout"] > 200


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_finished_maps_segment_deleted_before_it_is_read_fails_at_once_naming_it(
        ray_local, tmp_path, tier):
    """Was: the reader waited 60 s for a map attempt that never comes, then failed with a
    message naming no segment and no file."""
    import ray

    from hybrid_ray.actors import get_master
    from hybrid_ray.errors import SegmentNotFoundError
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.shuffle import read_subpartition, write_map_partition

    extra = {"remote_path": f"file://{tmp_path}/remote", "disk_capacity_bytes": 0} \
        if tier == "remote" else {}
    config = base_config(tmp_path, spilling="full", mode="blocking",
                         namespace=f"hr-missing-{uuid.uuid4().hex[:6]}", **extra)
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 2, 2, config, True))
    table = pa.table({"key": np.arange(40_000) % 7, "id": np.arange(40_000)})
    try:
        for m in range(2):
            write_map_partition(shuffle_id, m, [table.slice(m * 20_000, 20_000)], 2,
                                HashPartitioner(["key"]), config, master)
        segments = ray.get(master.segments.remote(shuffle_id))
        assert {s.tier.value for s in segments} == {tier}
        victim = next(s for s in segments if s.id.subpartition == 0)
        os.unlink(victim.location.removeprefix("file://"))

        started = time.monotonic()
        with pytest.raises(SegmentNotFoundError) as err:
            read_subpartition(shuffle_id, 0, config, master)
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"took {elapsed:.1f} s"
        message = str(err.value)
        assert victim.location in message and f"{tier} tier" in message
        assert "removed by someone else" in message and "map finished" in message
        # The other subpartition is intact and exact.
        rows = pa.concat_tables(read_subpartition(shuffle_id, 1, config, master))
        parts = np.asarray(HashPartitioner(["key"]).assign(table, 0, 2))
        expected = sorted(table["id"].to_numpy()[parts == 1].tolist())
        assert expected and sorted(rows["id"].to_pylist()) == expected
    finally:
        ray.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray)


def test_a_shuffle_whose_writers_hang_fails_within_its_stall_bound_and_the_next_one_runs(
        ray_local, tmp_path):
    """Was: with its writer processes stuck in a task (a call that never returns),
    ``repartition`` waited forever, and so did every later shuffle sent to those
    writers."""
    import ray

    import hybrid_ray
    from hybrid_ray.actors import get_writers

    config = base_config(tmp_path, namespace=f"hr-stall-{uuid.uuid4().hex[:6]}",
                         stall_timeout_s=3)
    hybrid_ray.init(config)
    table = pa.table({"key": np.arange(200_000) % 97, "id": np.arange(200_000)})
    ds = ray.data.from_arrow([table.slice(i * 50_000, 50_000) for i in range(4)])
    writers = [w for _, w in get_writers(config.namespace)]
    stuck = [ray.get(w.run.remote(os.getpid), timeout=30) for w in writers]
    # Not retried on the restarted writer (a stuck map is: it then fails at once, its
    # shuffle released).
    hangs = [w.run.options(max_task_retries=0).remote(time.sleep, 3600) for w in writers]
    started = time.monotonic()
    with pytest.raises(hybrid_ray.ShuffleStalledError) as err:
        hybrid_ray.repartition(ds, 4, keys=["key"], config=config).materialize()
    elapsed = time.monotonic() - started
    assert 3 <= elapsed < 20, f"took {elapsed:.1f} s"
    message = str(err.value)
    assert "made no progress for" in message and "still running" in message
    assert "maps [" in message and "ShuffleConfig.stall_timeout_s (now 3 s)" in message
    assert_no_leftovers(config, ray)

    # The stuck writers were restarted: new processes, and the next shuffle is exact.
    for hang in hangs:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(hang, timeout=60)
    fresh = [ray.get(w.run.remote(os.getpid), timeout=60) for w in writers]
    assert not set(fresh) & set(stuck)
    out = pa.concat_tables(ray.get(
        hybrid_ray.repartition(ds, 4, keys=["key"], config=config).to_arrow_refs()))
    assert sorted(out["id"].to_pylist()) == list(range(200_000))
    assert_no_leftovers(config, ray)


def _in_thread(fn, *args):
    """Run ``fn`` in a daemon thread; (thread, outcome dict with "error" or "result")."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_map_and_reduce_tasks_give_up_on_a_master_that_never_answers(ray_local, tmp_path,
                                                                       monkeypatch):
    """Was: a map or reduce task waited on the shuffle master without a bound, so a hung
    master held Spark's executors forever (the Ray driver's stall bound ends its own
    shuffles only after ``stall_timeout_s``, 15 minutes by default)."""
    import ray

    from hybrid_ray import actors
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.shuffle import read_subpartition, write_map_partition

    @ray.remote(num_cpus=0, max_concurrency=4)
    class SilentMaster:
        def begin_map(self, *args):
            time.sleep(600)

        def poll(self, *args):
            time.sleep(600)

    from hybrid_ray import reduce_task

    monkeypatch.setattr(actors, "MASTER_CALL_TIMEOUT_S", 2.0)
    monkeypatch.setattr(reduce_task, "MASTER_CALL_TIMEOUT_S", 2.0)  # the poll's bound
    silent = SilentMaster.remote()
    config = base_config(tmp_path, namespace=f"hr-silent-{uuid.uuid4().hex[:6]}")
    table = pa.table({"key": np.arange(1_000) % 7})
    try:
        writer, wrote = _in_thread(write_map_partition, "shf-000000silent", 0, [table], 2,
                                   HashPartitioner(["key"]), config, silent)
        reader, read = _in_thread(read_subpartition, "shf-000000silent", 0, config, silent)
        writer.join(60)
        reader.join(60)
        assert not writer.is_alive() and not reader.is_alive(), "still waiting on the master"
        for outcome, call in ((wrote, "begin_map for map 0"),
                              (read, "poll for subpartition 0")):
            error = outcome.get("error")
            assert isinstance(error, ShuffleStalledError), outcome
            assert f"the shuffle master's {call} got no answer within" in str(error)
    finally:
        ray.kill(silent)


@pytest.mark.parametrize("lost_answer", ["stalled", "actor_unavailable"])
def test_a_finish_map_answered_late_keeps_the_files_the_master_took(ray_local, tmp_path,
                                                                    monkeypatch, lost_answer):
    """A writer that got no answer to its finish_map in time deleted the attempt's files,
    but the call was still queued at the master, which then took the attempt as the map's
    output: its books listed segments whose files were gone, and readers failed blaming
    "someone else". The files now stay for the shuffle's release. The same for Ray's
    ``ActorUnavailableError`` ("may or may not have been executed"; review of
    2026-11-27: the writer still deleted the files then)."""
    import ray

    from hybrid_ray import map_task
    from hybrid_ray.actors import get_master
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.shuffle import write_map_partition

    config = base_config(tmp_path, spilling="full", mode="blocking",
                         namespace=f"hr-late-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, config, True))
    real_answer_of = map_task.answer_of

    error = ShuffleStalledError if lost_answer == "stalled" else \
        ray.exceptions.ActorUnavailableError

    def finish_map_answered_late(ref, what, *args, **kwargs):
        if "finish_map" in what:
            ray.get(ref)  # the master runs it, the writer's wait ends first
            if lost_answer == "stalled":
                raise ShuffleStalledError(f"{what} got no answer within 30 s (injected)")
            raise ray.exceptions.ActorUnavailableError("RPC to the master failed (injected)",
                                                       None)
        return real_answer_of(ref, what, *args, **kwargs)

    monkeypatch.setattr(map_task, "answer_of", finish_map_answered_late)
    table = pa.table({"key": np.arange(20_000) % 7, "id": np.arange(20_000)})
    try:
        with pytest.raises(error, match="injected"):
            write_map_partition(shuffle_id, 0, [table], 2, HashPartitioner(["key"]), config,
                                master)
        segments = ray.get(master.segments.remote(shuffle_id))
        assert segments and {s.tier.value for s in segments} == {"disk"}
        assert all(os.path.exists(s.location) for s in segments)
    finally:
        ray.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray)


@pytest.mark.parametrize("chunks", [1, 2], ids=["refused-at-finish", "refused-at-commit"])
def test_a_writer_s_first_remote_write_after_the_release_leaves_no_marker(
        ray_local, tmp_path, monkeypatch, chunks):
    """A map that reserved space before its shuffle was released (a failed shuffle's other
    map) and uploaded its first remote segment after the release's removal re-created the
    shuffle's remote marker. The refused commit's abort deleted the segment, not the
    marker, and the released shuffle's remote directory stayed (seen once in
    ``test_failed_shuffle_cleans_everything``). The writer now removes what it re-created."""
    import ray

    from hybrid_ray import HashPartitioner
    from hybrid_ray.actors import get_master
    from hybrid_ray.errors import ShuffleFailedError
    from hybrid_ray.map_task import write_map_partition
    from hybrid_ray.tiers.remote import RemoteTier

    remote = tmp_path / "remote"
    config = base_config(tmp_path, memory_capacity_bytes=0, disk_capacity_bytes=0,
                         remote_path=f"file://{remote}",
                         namespace=f"hr-late-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, config, True), timeout=60)
    real_write = RemoteTier.write
    released = []
    first_upload = threading.Lock()

    def upload_after_the_release(self, segment, *args, **kwargs):
        """The shuffle fails elsewhere while this map's first upload is on its way (the
        uploads run on several threads: all wait until the release is done)."""
        with first_upload:
            if not released:
                ray.get(master.release.remote(shuffle_id, "map 1 failed", True), timeout=60)
                released.append(True)
        return real_write(self, segment, *args, **kwargs)

    monkeypatch.setattr(RemoteTier, "write", upload_after_the_release)
    table = pa.table({"key": np.arange(20_000) % 7, "id": np.arange(20_000)})
    pieces = [table.slice(i * 10_000, 10_000) for i in range(2)] if chunks == 2 else [table]
    with pytest.raises(ShuffleFailedError, match="map 1 failed"):
        write_map_partition(shuffle_id, 0, pieces, 2, HashPartitioner(["key"]), config,
                            master)
    assert released
    assert files_under(str(remote)) == []
    assert_no_leftovers(config, ray)


def test_the_driver_gives_up_on_a_master_that_never_answers_naming_the_call(ray_local,
                                                                          tmp_path,
                                                                          monkeypatch):
    """The driver's lifecycle calls (register, take_lost, seal, summary, release) are
    bounded like the tasks': a hung master fails the shuffle with ``ShuffleStalledError``
    naming the call (was: a bare ``GetTimeoutError`` from ``ray.get``)."""
    import ray

    from hybrid_ray import actors
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.lifecycle import ShuffleLifecycle

    @ray.remote(num_cpus=0)
    class SilentMaster:
        def register(self, *args, **kwargs):
            time.sleep(600)

    monkeypatch.setattr(actors, "MASTER_CALL_TIMEOUT_S", 2.0)
    silent = SilentMaster.remote()
    try:
        shuffle = ShuffleLifecycle(base_config(tmp_path), 4, "custom", master=silent)
        started = time.monotonic()
        with pytest.raises(ShuffleStalledError) as err:
            shuffle.register(2)
        assert time.monotonic() - started < 30
        assert "the shuffle master's register of shf-" in str(err.value)
        assert "got no answer within 2 s" in str(err.value)
    finally:
        ray.kill(silent)


def test_a_writer_waits_for_a_busy_tier_manager_longer_than_for_the_master(ray_local,
                                                                           monkeypatch):
    """A tier manager runs one call at a time: a writer's reserve queues behind its slow
    calls (segments stored for other processes, disk segments served to other nodes,
    a released shuffle's files deleted), so it gets ``TIER_MANAGER_CALL_TIMEOUT_S``, not
    the master's 30 s (was, in review: a busy, healthy node failed the task)."""
    import ray

    from hybrid_ray import actors
    from hybrid_ray.errors import ShuffleStalledError

    @ray.remote(num_cpus=0)
    class BusyTierManager:
        def reserve(self, *args):
            time.sleep(3)
            return ["placed"]

    monkeypatch.setattr(actors, "MASTER_CALL_TIMEOUT_S", 1.0)
    busy = BusyTierManager.remote()
    try:
        storage = actors.ActorNodeStorage(busy)
        assert storage.reserve("shf-00000000busy", [10]) == ["placed"]
        monkeypatch.setattr(actors, "TIER_MANAGER_CALL_TIMEOUT_S", 1.0)
        with pytest.raises(ShuffleStalledError, match="the tier manager's reserve for shuffle "
                                                      "shf-00000000busy got no answer within 1 s"):
            storage.reserve("shf-00000000busy", [10])
    finally:
        ray.kill(busy)


def test_a_tier_manager_storing_segments_for_another_process_is_waited_for_within_a_bound(
        ray_local, monkeypatch):
    """A process that cannot own memory-tier objects (a Spark executor's Python worker)
    has its node's tier manager store them; that wait is bounded too and names the call
    and what to change."""
    import ray

    from hybrid_ray import actors
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.tiers.memory import put_many_owned_by

    @ray.remote(num_cpus=0)
    class SlowOwner:
        def put_objects(self, values):
            time.sleep(3)
            return [ray.put(v) for v in values]

    owner = SlowOwner.remote()
    try:
        refs = put_many_owned_by(owner, [b"segment"])
        assert ray.get(refs) == [b"segment"]
        monkeypatch.setattr(actors, "DATA_CALL_TIMEOUT_S", 1.0)
        with pytest.raises(ShuffleStalledError, match=r"the tier manager storing 1 memory-tier "
                                                      r"segment\(s\) got no answer within 1 s.*"
                                                      r"ShuffleConfig.memory_fraction"):
            put_many_owned_by(owner, [b"segment"])
    finally:
        ray.kill(owner)


def test_a_read_ahead_from_a_hung_sync_store_fails_within_its_bound(tmp_path, monkeypatch):
    """A sync filesystem's calls (NFS through file://, HDFS, sftp) get no per-call deadline,
    and the reader waited for its read-ahead without a bound: a hung server held a Spark
    executor's reducer forever. It now fails naming the segment and the store."""
    from hybrid_ray.clients import ReadClient
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.segment import SegmentId, encode_segment
    from hybrid_ray.tiers import remote as remote_module
    from hybrid_ray.tiers.remote import RemoteTier, open_remote_tier

    config = base_config(tmp_path, remote_path=f"file://{tmp_path}/remote")
    tier = open_remote_tier(config)
    sid = SegmentId("shf-hung", 0, 0, 0, 0)
    meta = tier.write(sid, encode_segment(pa.table({"v": [1, 2]}), sid))
    real_read = RemoteTier.read

    def hung_read(self, m):
        time.sleep(20)
        return real_read(self, m)

    monkeypatch.setattr(RemoteTier, "read", hung_read)
    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 1.0)
    reader = ReadClient({tier.name: tier}, "n1")
    # Also the public one-segment read (was: no bound at all).
    for read in (lambda: list(reader.read_in_order([meta])), lambda: reader.read(meta)):
        thread, outcome = _in_thread(read)
        thread.join(10)
        assert not thread.is_alive(), "still waiting on the hung store"
        error = outcome.get("error")
        assert isinstance(error, ShuffleStalledError), outcome
        assert f"the read of {sid}" in str(error) and "did not finish within" in str(error)


def test_an_abort_waits_for_hung_uploads_within_one_bound_not_one_each(tmp_path,
                                                                       monkeypatch):
    """An abort lets running uploads end before it deletes what they wrote. Each hung
    upload had a bound of its own, waited for one after another: four hung uploads held
    the abort (and the failed map) four times as long. They share one bound now."""
    import concurrent.futures

    from hybrid_ray import TierName
    from hybrid_ray.clients import WriteClient
    from hybrid_ray.tier_manager import TierManager
    from hybrid_ray.tiers import remote as remote_module
    from hybrid_ray.tiers.remote import open_remote_tier

    config = base_config(tmp_path, remote_path=f"file://{tmp_path}/remote")
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("shf-abort", config)
    client = WriteClient("shf-abort", 0, 1, config, tm,
                         {TierName.REMOTE: open_remote_tier(config)})
    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 1.0)
    monkeypatch.setattr(client, "_upload_bytes_bound", lambda: 0)
    hung = [concurrent.futures.Future() for _ in range(4)]
    for future in hung:
        future.set_running_or_notify_cancel()  # running: cancel() cannot stop it
        client._uploads.append(future)
    started = time.monotonic()
    client.abort()
    elapsed = time.monotonic() - started
    assert elapsed < 3.0, f"the abort waited {elapsed:.1f} s for 4 hung uploads (bound 1 s)"
    tm.release_shuffle("shf-abort")


def test_an_abort_s_remote_deletions_give_up_on_a_hung_sync_store_within_one_bound(
        tmp_path, monkeypatch):
    """An abort deletes the remote segments its attempt wrote. It called the filesystem
    inline: a sync one (NFS through file://) that hung held the abort, and the failed map
    with it, forever (found by a review). The deletions now share the tier's bound; the
    abort raises ShuffleStalledError naming what hung."""
    from hybrid_ray import TierName
    from hybrid_ray.clients import WriteClient
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.segment import SegmentId, encode_segment
    from hybrid_ray.tier_manager import TierManager
    from hybrid_ray.tiers import remote as remote_module
    from hybrid_ray.tiers.remote import open_remote_tier

    config = base_config(tmp_path, remote_path=f"file://{tmp_path}/remote")
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("shf-abort", config)
    tier = open_remote_tier(config)
    client = WriteClient("shf-abort", 0, 1, config, tm, {TierName.REMOTE: tier})
    sids = [SegmentId("shf-abort", 0, 0, i, job_id=config.job_id) for i in range(3)]
    client.written = [tier.write(sid, encode_segment(pa.table({"v": [i]}), sid))
                      for i, sid in enumerate(sids)]
    client._wrote_remote = True
    hung = threading.Event()
    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 1.0)
    monkeypatch.setattr(tier.fs, "rm_file", lambda *a, **k: hung.wait(10))
    started = time.monotonic()
    try:
        with pytest.raises(ShuffleStalledError, match=re.escape(f"deleting {sids[0]}")):
            client.abort(shuffle_released=True)
        elapsed = time.monotonic() - started
        assert elapsed < 3.0, f"the abort waited {elapsed:.1f} s on a hung store (bound 1 s)"
    finally:
        hung.set()
    tm.release_shuffle("shf-abort")

def test_the_master_s_remote_deletions_give_up_on_a_hung_sync_store_within_a_bound(
        tmp_path, monkeypatch):
    """The master deleted remote segments and removed a released shuffle's remote tree on
    its background thread without a bound: a sync filesystem (NFS through file://, HDFS,
    sftp) that hung held that thread, and every later deletion and orphan expiry of the
    namespace, forever (found by a review). Each is now waited for within the remote
    tier's bound; the deletion fails naming what hung, stays queued and is tried again."""
    from hybrid_ray import actors
    from hybrid_ray.config import TierName
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.segment import SegmentId, SegmentMeta, encode_segment
    from hybrid_ray.tiers import remote as remote_module
    from hybrid_ray.tiers.remote import RemoteTier

    tier = RemoteTier(1 << 20, f"file://{tmp_path}/remote", "job-1")
    sid = SegmentId("shf-1", 0, 0, 0, job_id="job-1")
    meta = tier.write(sid, encode_segment(pa.table({"v": [1, 2]}), sid))
    assert meta.tier == TierName.REMOTE
    hung = threading.Event()

    def hang(*args, **kwargs):
        hung.wait(30)

    monkeypatch.setattr(RemoteTier, "delete", hang)
    monkeypatch.setattr(RemoteTier, "remove_shuffle_data", hang)
    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 1.0)

    class FakeMaster:
        _tier_managers = set()

        def _remote_tier(self, config):
            return tier

    master_class = actors.ShuffleMasterActor.__ray_actor_class__
    state = type("State", (), {"shuffle_id": "shf-1", "config": None})()
    try:
        for call, what in ((lambda: master_class._delete_segments(FakeMaster(), state, [meta]),
                            "deleting 1 segment(s) of shuffle shf-1"),
                           (lambda: master_class._remove_remote_tree(FakeMaster(), state),
                            "removing shuffle shf-1")):
            thread, outcome = _in_thread(call)
            thread.join(10)
            assert not thread.is_alive(), f"still waiting on the hung store: {what}"
            error = outcome.get("error")
            assert isinstance(error, ShuffleStalledError), outcome
            assert what in str(error) and "did not finish within 1 s" in str(error)
    finally:
        hung.set()
        tier.close()


def test_a_sort_whose_sampling_stalls_fails_and_leaves_no_sampling_task_running(
        ray_local, tmp_path, monkeypatch):
    """``sort`` raised ShuffleStalledError when sampling the keys outran stall_timeout_s,
    but left its sampling tasks running (or queued for a CPU): they held CPUs the
    caller's next job waited for. They are cancelled now."""
    import ray

    import hybrid_ray
    from hybrid_ray import shuffle as shuffle_module

    marker = str(tmp_path / "sampling-went-on")

    @ray.remote(num_cpus=1, max_retries=0)
    def slow_sample(key, k, *blocks):
        time.sleep(6)
        with open(marker, "a") as f:  # reached only if the task was left running
            f.write("x")
        return np.asarray([])

    monkeypatch.setattr(shuffle_module, "_sample_task", slow_sample)
    config = base_config(tmp_path, namespace=f"hr-sample-{uuid.uuid4().hex[:6]}",
                         stall_timeout_s=2)
    ds = ray.data.from_arrow([pa.table({"key": np.arange(1000) + i}) for i in range(2)])
    with pytest.raises(hybrid_ray.ShuffleStalledError, match="sort: sampling the keys"):
        hybrid_ray.sort(ds, "key", config=config)
    time.sleep(8)
    assert not os.path.exists(marker)


def test_a_reservation_whose_answer_never_came_gives_its_space_back_with_the_abort(
        ray_local, monkeypatch, tmp_path):
    """A writer's wait for its reservation ran out (the tier manager busy past the bound),
    yet the call ran later and granted space the writer never saw, so never settled: the
    bytes stayed counted, refusing other shuffles room, until the shuffle's release (a
    review's reproduction). The writer's abort now cancels the call on the tier manager."""
    import ray

    from hybrid_ray import MiB, ShuffleConfig, TierName, actors
    from hybrid_ray.clients import WriteClient
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.tier_manager import TierManager, build_io_tiers

    @ray.remote(num_cpus=0)
    class LateTierManager:
        """A real TierManager whose first reservation answers after the writer gave up."""

        def __init__(self, config):
            self.tm, self.late = TierManager("n1", object_store_bytes=0), True
            self.tm.register_shuffle("shf-000000000late", config)

        def reserve(self, shuffle_id, sizes, settled, register, token=None):
            if self.late:
                self.late = False
                time.sleep(2)
            return self.tm.reserve(shuffle_id, sizes, settled, register,
                                   **({"token": token} if token else {}))

        def cancel_reserve(self, shuffle_id, token):
            return self.tm.cancel_reserve(shuffle_id, token)

        def settle(self, shuffle_id, settled):
            self.tm.settle(shuffle_id, settled)

        def free_segments(self, shuffle_id, metas):
            self.tm.free_segments(shuffle_id, metas)

        def grants_60_mib(self, shuffle_id):
            """Whether 60 MiB more fit the 64 MiB cap (a probe: given back at once)."""
            [placed] = self.tm.reserve(shuffle_id, [60 * MiB])
            if placed.grant is None:
                return False
            self.tm.settle(shuffle_id, [(placed.grant, None)])
            return placed.grant.tier == TierName.DISK

    config = ShuffleConfig(memory_fraction=0, spill_dirs=[str(tmp_path / "spill")],
                           disk_capacity_bytes=64 * MiB, progress=False)
    late = LateTierManager.remote(config)
    try:
        monkeypatch.setattr(actors, "TIER_MANAGER_CALL_TIMEOUT_S", 0.5)
        writer = WriteClient("shf-000000000late", 0, 1, config, actors.ActorNodeStorage(late),
                             build_io_tiers(config, node_id="n1"))
        rows = pa.table({"x": pa.array(np.arange(3_000_000), pa.int64())})  # 24 MiB
        with pytest.raises(ShuffleStalledError, match="the tier manager's reserve for shuffle "
                                                      "shf-000000000late got no answer"):
            writer.write(0, rows)
        monkeypatch.setattr(actors, "TIER_MANAGER_CALL_TIMEOUT_S", 30.0)
        assert not ray.get(late.grants_60_mib.remote("shf-000000000late"))  # 24 MiB granted
        writer.abort()
        assert ray.get(late.grants_60_mib.remote("shf-000000000late"))
    finally:
        ray.kill(late)
