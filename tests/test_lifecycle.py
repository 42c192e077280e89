"""The shuffle lifecycle on a real local Ray: phases in order, held shuffles kept alive and
their lost maps re-run, errors translated at the phase boundary, nothing swallowed."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from conftest import base_config
from hybrid_ray import lifecycle
from hybrid_ray.config import MIN_ORPHAN_TTL_S, TierName
from hybrid_ray.errors import (
    ConfigError, ShuffleFailedError, ShuffleNotFoundError, ShuffleStateError,
)
from hybrid_ray.lifecycle import AttemptPolicy, ShuffleLifecycle
from hybrid_ray.segment import SegmentId, SegmentMeta


@pytest.fixture
def config(ray_local, tmp_path):
    return base_config(tmp_path, namespace="hr_lifecycle")


def _known(shuffle: ShuffleLifecycle) -> bool:
    try:
        ray.get(shuffle.master.summary.remote(shuffle.shuffle_id))
        return True
    except ShuffleNotFoundError:
        return False
    except ShuffleFailedError:  # released as failed
        return False


def _finish_map_with_a_segment(shuffle: ShuffleLifecycle, map_index: int) -> int:
    """Write one (memory-tier, location-less) segment of ``map_index`` and finish it, as a
    writer would; returns the attempt."""
    master = shuffle.master
    attempt = ray.get(master.begin_map.remote(shuffle.shuffle_id, map_index, "node-x", 1))
    meta = SegmentMeta(SegmentId(shuffle.shuffle_id, map_index, 0, 0, attempt),
                       TierName.MEMORY, 10, 1, "node-x")
    assert ray.get(master.commit.remote(shuffle.shuffle_id, map_index, attempt, [meta]))
    assert ray.get(master.finish_map.remote(shuffle.shuffle_id, map_index, attempt, None))
    return attempt


def test_register_checks_the_policy_and_a_second_registration_is_a_typed_error(config):
    first = ShuffleLifecycle(config, 2, "test")
    with pytest.raises(ConfigError, match="first_finish shuffle registers with its map count"):
        first.register(None)
    first.register(1)
    with pytest.raises(ConfigError, match="sealed at registration"):
        first.seal(1, {0: 0})
    open_ = ShuffleLifecycle(config, 2, "test", policy=AttemptPolicy.CHOSEN_AT_SEAL)
    with pytest.raises(ConfigError, match="without a map count"):
        open_.register(3)
    # The registry's refusals cross the actor boundary as ShuffleStateError, not a bare
    # ValueError inside Ray's wrapper.
    with pytest.raises(ShuffleStateError, match="is already registered"):
        ray.get(first.master.register.remote(first.shuffle_id, 1, 2, config))
    assert first.release() is True
    assert first.release() is False  # twice: a no-op
    assert not _known(first)


def test_seal_keeps_the_attempt_the_engine_reports_and_the_report_counts_it(config):
    shuffle = ShuffleLifecycle(config, 1, "engine", policy=AttemptPolicy.CHOSEN_AT_SEAL)
    shuffle.register()
    master = shuffle.master
    attempts = []
    for _ in range(2):  # a task and its speculative copy, both finish writing
        attempt = ray.get(master.begin_map.remote(shuffle.shuffle_id, 0, "node-x", 1))
        meta = SegmentMeta(SegmentId(shuffle.shuffle_id, 0, 0, 0, attempt),
                           TierName.MEMORY, 7 + attempt, 1, "node-x")
        ray.get(master.commit.remote(shuffle.shuffle_id, 0, attempt, [meta]))
        ray.get(master.finish_map.remote(shuffle.shuffle_id, 0, attempt, None))
        attempts.append(attempt)
    shuffle.seal(1, {0: attempts[1]})
    report = shuffle.report(input_bytes=123, map_input="test")
    assert report.per_node_tier == {"node-x": {"memory": (7 + attempts[1], 1)}}
    assert report.superseded_attempts == 1 and report.input_bytes == 123
    assert report.operation == "engine" and report.shuffle_id == shuffle.shuffle_id
    shuffle.release()


def test_a_heartbeat_surfaces_a_release_it_did_not_make(config):
    """Heartbeats are not waited for, but their answers are checked: a shuffle the master
    dropped under the driver fails the driver's next beat instead of going unnoticed."""
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    shuffle.heartbeat(force=True)
    # That beat's answer first: the master is threaded, and a beat it ran after the
    # release below failed the next line, outside pytest.raises (seen once in ~10 runs).
    shuffle._check_unchecked(wait=True)
    ray.get(shuffle.master.release.remote(shuffle.shuffle_id, "an operator released it"))
    shuffle.heartbeat(force=True)  # sends the beat the master refuses
    deadline = time.monotonic() + 30
    with pytest.raises(ShuffleNotFoundError, match="an operator released it"):
        while time.monotonic() < deadline:
            shuffle.heartbeat(force=True)
            time.sleep(0.1)


def test_a_held_shuffle_has_its_lost_maps_run_again(config):
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(2)
    attempt = _finish_map_with_a_segment(shuffle, 1)
    reran = []
    done = threading.Event()

    def rerun(maps):
        reran.append(list(maps))
        done.set()

    shuffle.hold(rerun)
    assert shuffle.shuffle_id in lifecycle.held_shuffle_ids()
    # A reader found map 1's segment gone: the master queues it for the driver.
    assert ray.get(shuffle.master.report_lost.remote(shuffle.shuffle_id, 1, attempt))
    assert done.wait(30), "the holder never re-ran the lost map"
    assert reran == [[1]]
    shuffle.release()
    assert shuffle.shuffle_id not in lifecycle.held_shuffle_ids()
    assert not _known(shuffle)


def test_a_failed_rerun_releases_the_shuffle_and_tells_its_readers_why(config):
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    attempt = _finish_map_with_a_segment(shuffle, 0)

    def rerun(maps):
        raise OSError("the input files are gone")

    shuffle.hold(rerun)
    ray.get(shuffle.master.report_lost.remote(shuffle.shuffle_id, 0, attempt))
    deadline = time.monotonic() + 30
    while _known(shuffle) and time.monotonic() < deadline:
        time.sleep(0.2)
    # A reader still polling learns why, as a ShuffleFailedError naming the cause.
    with pytest.raises(ShuffleFailedError, match="OSError: the input files are gone"):
        ray.get(shuffle.master.poll.remote(shuffle.shuffle_id, 0, {}, 1, 0.0))
    assert shuffle.shuffle_id not in lifecycle.held_shuffle_ids()
    assert any(shuffle.shuffle_id in e and "the input files are gone" in e
               for e in lifecycle.held_errors())


def test_a_held_shuffle_outlives_the_orphan_ttl(config):
    """Held, the driver's thread heartbeats: the master's expiry keeps it past the TTL; a
    shuffle nobody holds is expired."""
    import dataclasses

    cfg = dataclasses.replace(config, orphan_ttl_s=MIN_ORPHAN_TTL_S)
    held = ShuffleLifecycle(cfg, 1, "held")
    held.register(1)
    held.hold()
    orphan = ShuffleLifecycle(cfg, 1, "orphan")
    orphan.register(1)
    time.sleep(MIN_ORPHAN_TTL_S + 2)
    expired = ray.get(held.master.expire.remote())
    # The orphan is gone, by this call or by the master's own expiry, which runs every
    # EXPIRY_CHECK_INTERVAL_S and on a loaded machine came first (the call then returned
    # [] and the test failed with the expiry working).
    assert held.shuffle_id not in expired
    assert _known(held) and not _known(orphan)
    held.release()


def test_held_shuffles_keep_their_heartbeats_while_lost_maps_are_re_run(config):
    """A re-run of lost maps takes as long as the maps do. It ran on the holder's thread,
    which then heartbeat no held shuffle: past the orphan TTL the master expired them all,
    the one being re-run included, and deleted their data under their readers."""
    import dataclasses

    cfg = dataclasses.replace(config, orphan_ttl_s=MIN_ORPHAN_TTL_S)
    rerun_shuffle = ShuffleLifecycle(cfg, 1, "rerun")
    rerun_shuffle.register(1)
    attempt = _finish_map_with_a_segment(rerun_shuffle, 0)
    bystander = ShuffleLifecycle(cfg, 1, "bystander")
    bystander.register(1)
    bystander.hold()
    started, finish = threading.Event(), threading.Event()

    def slow_rerun(maps):
        started.set()
        finish.wait(MIN_ORPHAN_TTL_S + 30)

    rerun_shuffle.hold(slow_rerun)
    ray.get(rerun_shuffle.master.report_lost.remote(rerun_shuffle.shuffle_id, 0, attempt))
    try:
        assert started.wait(30), "the holder never re-ran the lost map"
        time.sleep(MIN_ORPHAN_TTL_S + 3)
        expired = ray.get(rerun_shuffle.master.expire.remote())
        assert rerun_shuffle.shuffle_id not in expired and bystander.shuffle_id not in expired
        assert _known(rerun_shuffle) and _known(bystander)
    finally:
        finish.set()
        rerun_shuffle.release()
        bystander.release()


class _Boom(Exception):
    pass


@ray.remote
def _fails_with(exc):
    raise exc


def test_fail_translates_the_error_and_removes_the_data(config):
    # A task's ConfigError (a bad input block) stays a ConfigError, without the remote
    # traceback, and names the shuffle.
    shuffle = ShuffleLifecycle(config, 1, "repartition")
    shuffle.register(1)
    try:
        ray.get(_fails_with.remote(ConfigError("block 3 has no column 'k'")))
    except ray.exceptions.RayTaskError as exc:
        error = shuffle.fail(exc)
    assert type(error) is ConfigError
    assert str(error) == (f"repartition shuffle {shuffle.shuffle_id} failed and its data "
                          "was removed: block 3 has no column 'k'")
    assert error.__suppress_context__ and error.__cause__ is None
    assert not _known(shuffle) and shuffle.released

    # Anything else: ShuffleFailedError, the cause first, the traceback on __cause__.
    shuffle = ShuffleLifecycle(config, 1, "sort")
    shuffle.register(1)
    try:
        ray.get(_fails_with.remote(_Boom("disk on fire")))
    except ray.exceptions.RayTaskError as exc:
        task_error = exc
        error = shuffle.fail(exc)
    assert type(error) is ShuffleFailedError
    assert str(error).startswith(f"sort shuffle {shuffle.shuffle_id} failed: _Boom: disk on "
                                 "fire (its data was removed")
    assert error.__cause__ is task_error
    assert not _known(shuffle)

    # A user's stop is handed back as is (and still removes the data).
    shuffle = ShuffleLifecycle(config, 1, "sort")
    shuffle.register(1)
    stop = KeyboardInterrupt()
    assert shuffle.fail(stop) is stop
    assert not _known(shuffle)


def test_a_held_shuffle_released_elsewhere_as_failed_is_let_go_once(config):
    """Released as failed by someone else (another process, an operator), a held shuffle's
    heartbeat gets a ShuffleFailedError: the holder lets it go and notes it once, instead of
    noting the same error every second."""
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    shuffle.hold()
    ray.get(shuffle.master.release.remote(shuffle.shuffle_id, "a disk failed", True))
    deadline = time.monotonic() + 30
    while shuffle.shuffle_id in lifecycle.held_shuffle_ids() and time.monotonic() < deadline:
        lifecycle._held._tend(shuffle, None)  # what the holder's thread does each second
        time.sleep(0.2)
    assert shuffle.shuffle_id not in lifecycle.held_shuffle_ids()
    time.sleep(2 * lifecycle.RECOVERY_POLL_S + 1)
    notes = [e for e in lifecycle.held_errors() if shuffle.shuffle_id in e]
    assert len(notes) == 1 and "a disk failed" in notes[0]


class _CountsLostAsks:
    """A lifecycle that answers ``take_lost`` from a script and counts the asks."""

    def __init__(self, answers):
        self.answers, self.asks = list(answers), 0

    def take_begun_maps(self):
        return set()

    def take_lost(self):
        self.asks += 1
        return self.answers.pop(0) if self.answers else []


def test_a_map_runner_asks_for_lost_maps_less_often_while_none_are_lost(monkeypatch):
    """Each ask for lost maps is a master call: while none is lost the interval doubles
    (0.5 s up to LOST_MAPS_POLL_MAX_S), and a loss brings it back to 0.5 s."""
    clock = [1000.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: clock[0])
    fake = _CountsLostAsks([[], [], [], [], [], [], [7]])
    runner = lifecycle.MapRunner(fake, [], [None] * 8, lambda *a, **k: None, ())
    asked_at = []
    for _ in range(240):  # 30 s of driver loop turns, one every 125 ms
        before = fake.asks
        runner.poll(set())
        if fake.asks > before:
            asked_at.append(clock[0] - 1000.0)
        clock[0] += 0.125
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    # Nothing lost: 1, 2, 4, 4... s apart (the first ask set 0.5 s, doubled at once); map 7
    # came back in the 7th answer: the next ask is 0.5 s later.
    assert gaps[:7] == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 0.5], gaps
    assert 7 in runner._queue


class _ScriptedRef:
    """A map run's result as a fake object ref (``lifecycle.ray.get`` is patched)."""

    def __init__(self, value=None):
        self.value = value


class _ScriptedWriter:
    """A writer actor whose runs are recorded and return scripted refs."""

    def __init__(self):
        self.runs: list[tuple[int, int | None, _ScriptedRef]] = []
        self.run_packed = self

    def remote(self, _fn, _shuffle_id, map_index, _input, *args, attempt=None):
        ref = _ScriptedRef({"rows": 1})
        self.runs.append((map_index, attempt, ref))
        return ref


class _RegistryLifecycle:
    """The two calls MapRunner makes on its lifecycle, answered by a real registry."""

    def __init__(self, registry, shuffle_id):
        self.registry, self.shuffle_id = registry, shuffle_id

    def take_begun_maps(self):
        return {0, 1}

    def take_lost(self):
        return self.registry.take_lost(self.shuffle_id)


def test_a_map_reported_lost_before_its_finished_run_is_collected_runs_again(monkeypatch):
    """A reader can report a finished map's segments lost (their owner died) before the
    driver has collected that map's result. The master hands each lost map out once; the
    runner used to drop it because a run of it was still "running", so no attempt of it
    ever finished again and its readers failed. It must run again once that run returns."""
    from hybrid_ray.config import ShuffleConfig
    from hybrid_ray.master import ShuffleRegistry

    monkeypatch.setattr(lifecycle.ray, "get", lambda ref, **_: ref.value)
    registry = ShuffleRegistry(lambda *_: None, lambda *_: None)
    sid = "shf-lostwhilerunning"
    registry.register(sid, 2, 1, ShuffleConfig(progress=False), recoverable=True,
                      maps_begun_on=["node-a", "node-b"])
    writer_a, writer_b = _ScriptedWriter(), _ScriptedWriter()
    runner = lifecycle.MapRunner(_RegistryLifecycle(registry, sid),
                                 [("node-a", writer_a), ("node-b", writer_b)],
                                 [None, None], lambda *a, **k: None, ())
    (map0, attempt0, ref0), = writer_a.runs
    assert (map0, attempt0) == (0, 0)
    segment = SegmentMeta(SegmentId(sid, 0, 0, 0, 0), TierName.MEMORY, 10, 1, "node-a")
    assert registry.finish_map(sid, 0, 0, None, [segment])
    # A reader misses the segment before the driver saw map 0 finish; the driver then asks.
    assert registry.report_lost(sid, 0, 0) is True
    runner._lost_asked = runner._lost_interval = 0
    runner.poll(set())
    assert registry.state(sid).lost == {0}  # handed out, kept until its re-run begins
    runner.poll({ref0})  # map 0's first run returns (its output since lost)
    assert [(m, a) for m, a, _ in writer_a.runs] == [(0, 0), (0, None)], \
        "map 0 was not run again: its lost output would never be replaced"
    # The master names map 0 until its re-run begins: asked again meanwhile, the runner
    # knows the run in flight is that re-run and queues no third one.
    runner._lost_asked = runner._lost_interval = 0
    runner.poll(set())
    assert [(m, a) for m, a, _ in writer_a.runs] == [(0, 0), (0, None)]
    (_, _, ref1), = writer_b.runs
    assert registry.finish_map(sid, 1, 0, None, [])
    runner.poll({ref1})
    assert not runner.done
    attempt = registry.begin_map(sid, 0, "node-a")  # what the new run does first
    assert attempt == 1 and registry.finish_map(sid, 0, attempt, None, [])
    runner.poll({writer_a.runs[-1][2]})
    assert runner.done and registry.poll(sid, 0, {}).done


def test_a_held_shuffle_stays_held_when_the_master_is_slow_to_answer():
    """A master call that times out raises ShuffleStalledError, a ShuffleFailedError. The
    keeper of held shuffles took that for "released or expired" and let go of the shuffle
    (found in review): its heartbeats stopped and the master expired it, deleting data a
    DataFrame still used. A slow answer is retried at the next turn instead."""
    from hybrid_ray.errors import ShuffleStalledError

    class SlowMaster:
        shuffle_id, beats = "shf-slowmaster0", 0

        def heartbeat(self):
            self.beats += 1

        def take_lost(self):
            raise ShuffleStalledError("the shuffle master's take_lost got no answer")

    held = lifecycle._HeldShuffles()
    slow = SlowMaster()
    with held._lock:  # held without starting the keeper's thread: turns run by hand
        held._held[slow.shuffle_id] = (slow, lambda maps: None)
    held._tend(slow, lambda maps: None)
    held._tend(slow, lambda maps: None)
    assert held.ids() == [slow.shuffle_id] and slow.beats == 2
    assert len(held.errors) == 2 and "take_lost got no answer" in held.errors[-1]



def test_a_held_shuffle_whose_master_died_is_let_go_once():
    """Was: a dead master's ActorDiedError was taken for a master restarting, so the held
    shuffle was beaten for and noted as failing every turn for the rest of the session
    (the master is never restarted: its books are gone)."""
    class DeadMaster:
        shuffle_id, beats = "shf-deadmaster0", 0

        def heartbeat(self):
            self.beats += 1
            raise ray.exceptions.ActorDiedError()

    held = lifecycle._HeldShuffles()
    dead = DeadMaster()
    with held._lock:  # held without starting the keeper's thread: turns run by hand
        held._held[dead.shuffle_id] = (dead, None)
    held._tend(dead, None)
    held._tend(dead, None)  # a turn that was already under way when it was let go
    assert held.ids() == [] and len(held.errors) == 1
    assert "let go: its shuffle master is gone" in held.errors[0]

def test_a_re_run_that_found_its_map_finished_keeps_the_map_s_result(monkeypatch):
    """A lost map queued again after Ray's own retry already re-ran it writes nothing and
    returns "skipped"; the map's result (its rows and bytes, for the report) stays the
    run's that wrote it."""
    from hybrid_ray.config import ShuffleConfig
    from hybrid_ray.master import ShuffleRegistry

    monkeypatch.setattr(lifecycle.ray, "get", lambda ref, **_: ref.value)
    registry = ShuffleRegistry(lambda *_: None, lambda *_: None)
    sid = "shf-skippedrerun"
    registry.register(sid, 1, 1, ShuffleConfig(progress=False), recoverable=True,
                      maps_begun_on=["node-a"])
    writer = _ScriptedWriter()
    runner = lifecycle.MapRunner(_RegistryLifecycle(registry, sid), [("node-a", writer)],
                                 [None], lambda *a, **k: None, ())
    (_, _, first), = writer.runs
    first.value = {"rows": 1000, "skipped": False}
    runner.poll({first})
    runner._requeue([0])
    runner._dispatch()
    assert len(writer.runs) == 2
    (_, _, again) = writer.runs[-1]
    again.value = {"rows": 0, "skipped": True}
    runner.poll({again})
    assert runner.done and runner.results[0] == {"rows": 1000, "skipped": False}


def test_each_writer_has_its_next_map_queued_but_the_last_maps_wait_for_a_free_writer(
        monkeypatch):
    """A writer handed its next map only once the driver saw its last one finish sat idle
    for that round trip every map: each writer has its next map queued behind the one it
    runs. The last maps (no more than there are writers) are not queued behind a busy
    writer: they go to whichever writer frees first. Every map runs exactly once."""
    monkeypatch.setattr(lifecycle.ray, "get", lambda ref, **_: ref.value)
    monkeypatch.setattr(lifecycle, "held_shuffle", lambda _sid: None)
    a, b = _ScriptedWriter(), _ScriptedWriter()
    fake = _CountsLostAsks([])
    fake.shuffle_id = "shf-queueddepth"
    runner = lifecycle.MapRunner(fake, [("node-a", a), ("node-b", b)],
                                 [None] * 7, lambda *a, **k: None, ())
    assert [m for m, _, _ in a.runs] == [0, 2] and [m for m, _, _ in b.runs] == [1, 3]
    runner.poll({a.runs[0][2]})  # a finished map 0: map 4 queued behind map 2
    assert [m for m, _, _ in a.runs] == [0, 2, 4] and list(runner._queue) == [5, 6]
    runner.poll({b.runs[0][2]})  # two maps left for two writers: none queued behind 3
    assert [m for m, _, _ in b.runs] == [1, 3] and list(runner._queue) == [5, 6]
    runner.poll({b.runs[1][2]})  # b is idle: it takes map 5 at once
    assert [m for m, _, _ in b.runs] == [1, 3, 5] and list(runner._queue) == [6]
    runner.poll({a.runs[1][2]})  # a still runs map 4: map 6 waits for a free writer
    assert list(runner._queue) == [6]
    runner.poll({b.runs[2][2]})
    assert [m for m, _, _ in b.runs] == [1, 3, 5, 6]
    runner.poll({a.runs[2][2], b.runs[3][2]})
    assert runner.done and sorted(runner.results) == list(range(7))
    assert sorted(m for w in (a, b) for m, _, _ in w.runs) == list(range(7))


def test_a_lost_map_goes_to_the_next_free_writer_whatever_its_node(monkeypatch):
    """A free writer took the first queued map whose input is on its node, passing over a
    lost map at the front of the queue whose input is elsewhere; readers waiting for that
    map could time out. A map queued again now goes first to any free writer."""
    monkeypatch.setattr(lifecycle.ray, "get", lambda ref, **_: ref.value)
    x, y = _ScriptedWriter(), _ScriptedWriter()
    fake = _CountsLostAsks([])
    fake.shuffle_id = "shf-urgent"
    runner = lifecycle.MapRunner(fake, [("node-x", x), ("node-y", y)], [None] * 4,
                                 lambda *a, **k: None, (),
                                 input_nodes=["node-x", "node-x", "node-y", "node-y"])
    assert [m for m, _, _ in x.runs] == [0] and [m for m, _, _ in y.runs] == [2]
    runner.poll({x.runs[0][2]})  # map 0 finished; x takes its local map 1
    assert [m for m, _, _ in x.runs] == [0, 1] and list(runner._queue) == [3]
    fake.answers = [[0]]  # a reader then found map 0's output gone
    runner._lost_asked = runner._lost_interval = 0
    runner.poll({y.runs[0][2]})  # y is free: it must take lost map 0, not its local map 3
    assert [m for m, _, _ in y.runs] == [2, 0] and list(runner._queue) == [3]


def test_a_shuffle_queued_behind_another_on_its_writers_is_not_stalled(monkeypatch):
    """Shuffles of one driver share the writers. One whose maps wait in a writer's queue
    behind another shuffle's long maps counted only its own progress: past stall_timeout_s
    it failed and restarted the writers (losing the other shuffle's memory segments) while
    nothing was stuck (found by a review). Another shuffle's map finishing on that writer
    is progress; a writer that returns nothing for the bound is still stalled."""
    from types import SimpleNamespace

    from hybrid_ray.errors import ShuffleStalledError

    clock = [1000.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(lifecycle.ray, "get", lambda ref, **_: ref.value)
    monkeypatch.setattr(lifecycle, "held_shuffle", lambda _sid: None)
    restarted = []
    monkeypatch.setattr(lifecycle, "restart_stuck_worker",
                        lambda writer, failures: restarted.append(writer))
    monkeypatch.setattr(lifecycle, "_WRITER_PROGRESS", lifecycle._WriterProgress())
    shared = _ScriptedWriter()

    def runner(name, maps):
        fake = _CountsLostAsks([])
        fake.shuffle_id = name
        fake.config = SimpleNamespace(stall_timeout_s=60.0)
        return lifecycle.MapRunner(fake, [("node-a", shared)], [None] * maps,
                                   lambda *a, **k: None, ())
    busy = runner("shf-long", 20)   # its maps fill the writer's queue first
    waiting = runner("shf-queued", 1)
    assert waiting.running_refs()  # handed to the writer, queued behind busy's maps
    collected = 0
    for _ in range(10):  # busy's maps finish every 50 s: 500 s in all, none stalled
        clock[0] += 50
        ref = busy.running_refs()[0]
        busy.poll({ref})
        collected += 1
        waiting.check_stalled()
    assert collected == 10 and restarted == []
    clock[0] += 61  # then the writer returns nothing for longer than the bound
    with pytest.raises(ShuffleStalledError, match="shf-queued made no progress for 61 s"):
        waiting.check_stalled()
    assert restarted == [shared]

def test_frees_of_the_last_reducers_are_sent_at_once_with_those_held_back(monkeypatch):
    """Frees are batched (FREE_BATCH_S), but those of a shuffle's last reducers go at
    once, with every free held back: left for the release, their deletion kept the
    driver and the cores waiting at the end of each shuffle."""
    # lifecycle's clock stands still: frees 1-3 are within FREE_BATCH_S of free 0 however
    # long this process is descheduled between the calls (0.25 s of real time between free
    # 0 and free 1 sent free 1 alone: [[0], [1]]).
    class StoppedClock:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def monotonic():
            return 1000.0

    monkeypatch.setattr(lifecycle, "time", StoppedClock())

    class Calls:
        def __init__(self):
            self.sent = []

        def remote(self, shuffle_id, subpartitions):
            self.sent.append(list(subpartitions))
            return None

    class Master:
        free_subpartitions = Calls()

    from hybrid_ray.config import ShuffleConfig

    shuffle = ShuffleLifecycle(ShuffleConfig(), 4, "test", master=Master())
    shuffle.free_subpartition(0)  # the first batch goes at once
    shuffle.free_subpartition(1)  # held back: within FREE_BATCH_S of the first
    shuffle.free_subpartition(2)
    assert Master.free_subpartitions.sent == [[0]]
    shuffle.free_subpartition(3)
    shuffle.flush_frees()
    assert Master.free_subpartitions.sent == [[0], [1, 2, 3]]


def test_a_lost_map_whose_hand_out_answer_was_lost_is_still_run_again():
    """take_lost emptied the master's lost set as it answered: when that answer never
    reached the keeper of a held shuffle (a call that timed out), the map was never run
    again and every reader of it waited out the stall bound. The map is now handed out
    until its re-run begins."""
    from hybrid_ray.config import ShuffleConfig
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.master import ShuffleRegistry

    registry = ShuffleRegistry(lambda *_: None, lambda *_: None)
    sid = "shf-lostanswer0"
    registry.register(sid, 1, 1, ShuffleConfig(progress=False), recoverable=True)
    attempt = registry.begin_map(sid, 0, "node-a")
    assert registry.finish_map(sid, 0, attempt, None, [])
    assert registry.report_lost(sid, 0, attempt) is True

    class Lifecycle:
        shuffle_id, asks = sid, 0

        def heartbeat(self):
            pass

        def take_lost(self):
            self.asks += 1
            lost = registry.take_lost(sid)  # the master answered...
            if self.asks == 1:  # ...but the answer did not arrive in time
                raise ShuffleStalledError("the shuffle master's take_lost got no answer")
            return lost

    rerun_with = []
    done = threading.Event()

    def rerun(maps):
        rerun_with.append(list(maps))
        done.set()

    held = lifecycle._HeldShuffles()
    shuffle = Lifecycle()
    with held._lock:  # held without starting the keeper's thread: turns run by hand
        held._held[sid] = (shuffle, rerun)
    held._tend(shuffle, rerun)
    assert rerun_with == []
    held._tend(shuffle, rerun)
    assert done.wait(10) and rerun_with == [[0]]


def test_the_driver_heartbeats_while_it_waits_for_a_node_to_be_declared_dead(monkeypatch):
    """A worker call that failed with its node still alive made the driver poll Ray's
    node table for NODE_DEATH_WAIT_S (15 s) without heartbeating: as long as the
    shortest orphan TTL, so the master could expire the shuffle, deleting its data, in
    the middle of a failure the driver recovers from."""
    from hybrid_ray import nodes
    from hybrid_ray.config import DRIVER_HEARTBEAT_S

    assert nodes.NODE_DEATH_WAIT_S >= MIN_ORPHAN_TTL_S - DRIVER_HEARTBEAT_S  # why it matters
    monkeypatch.setattr(nodes, "NODE_DEATH_WAIT_S", 1.2)
    monkeypatch.setattr(nodes, "node_alive", lambda node: True)
    beats = []
    error = ray.exceptions.RayActorError()
    assert nodes.lost_with_node("n" * 56, error, lambda: beats.append(1)) is False
    assert len(beats) >= 2


def test_calls_not_answered_in_time_are_named_in_a_warning(config, monkeypatch, caplog):
    """Frees and heartbeats are not waited for; the report waits for them, bounded, and
    went on silently past those that never answered. It says so now."""
    import logging

    @ray.remote(num_cpus=0)
    def never_answers():
        time.sleep(60)

    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    monkeypatch.setattr(lifecycle, "MASTER_CALL_TIMEOUT_S", 1.0)
    stuck = never_answers.remote()
    shuffle._unchecked.append(stuck)
    with caplog.at_level(logging.WARNING, logger="hybrid_ray.lifecycle"):
        shuffle.summary()
    assert (f"1 call(s) of shuffle {shuffle.shuffle_id} to the shuffle master (frees, "
            "heartbeats) got no answer within 1 s") in caplog.text
    ray.cancel(stuck, force=True)
    shuffle.release()


def test_an_unreadable_node_table_is_named_in_a_warning(monkeypatch, caplog):
    """After a node died, the output blocks' nodes are checked in Ray's node table; when
    it could not be read (a GCS restarting), the check fell back to the nodes the driver
    saw die without a word."""
    import logging

    from hybrid_ray import shuffle as shuffle_module

    class Readers:
        lost_nodes: set = set()

        def node_of(self, sub):
            return "node-a"

    def unreadable():
        raise ConnectionError("GCS restarting")

    monkeypatch.setattr(shuffle_module.ray, "nodes", unreadable)
    with caplog.at_level(logging.WARNING, logger="hybrid_ray.shuffle"):
        shuffle_module._check_outputs_survived([object()], Readers())
    assert "could not read Ray's node table" in caplog.text and "GCS restarting" in caplog.text


def test_the_books_come_with_the_release_and_a_failed_free_still_raises(config):
    """A shuffle that succeeded ends with one call that returns its books and releases
    it. The calls not waited for are checked after it: a free the master refused (the
    shuffle was released under the driver) still fails the shuffle's end, and a second
    end is refused rather than answered with books that went with the release."""
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    _finish_map_with_a_segment(shuffle, 0)
    summary = shuffle.summarize_and_release()
    assert summary.shuffle_id == shuffle.shuffle_id and summary.maps_finished == 1
    assert summary.per_node_tier == {"node-x": {"memory": (10, 1)}}
    assert not _known(shuffle)
    with pytest.raises(ShuffleFailedError, match="was released already"):
        shuffle.summarize_and_release()

    other = ShuffleLifecycle(config, 2, "test")
    other.register(1)
    _finish_map_with_a_segment(other, 0)

    @ray.remote(num_cpus=0)
    def refused():
        raise ShuffleNotFoundError("injected: a free the master refused")

    other._unchecked.append(refused.remote())
    with pytest.raises(ShuffleNotFoundError, match="injected"):
        other.summarize_and_release()
    assert not _known(other)  # released all the same


def test_a_heartbeat_that_runs_after_the_shuffle_s_own_release_is_no_failure(config):
    """The master runs calls on several threads in no fixed order: a heartbeat or the last
    frees, sent just before the end of a shuffle that succeeded, could run after its
    release and be told the shuffle was released, and the end then raised: a shuffle that
    succeeded was reported failed (found by a review). Only this driver's own release is
    forgiven: a refusal for another reason still raises (the test above)."""
    from hybrid_ray.errors import ShuffleReleasedError

    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    _finish_map_with_a_segment(shuffle, 0)

    @ray.remote(num_cpus=0)
    def ran_after_the_release(shuffle_id: str) -> None:
        raise ShuffleReleasedError(f"unknown shuffle {shuffle_id!r} (it was released: "
                                   "its data is gone; re-run the shuffle)")

    shuffle._unchecked.append(ran_after_the_release.remote(shuffle.shuffle_id))
    summary = shuffle.summarize_and_release()
    assert summary.maps_finished == 1 and not _known(shuffle)


def test_a_master_that_died_after_answering_the_release_fails_nothing(config):
    """A free or heartbeat not waited for that failed because the master died after it
    answered this driver's release (with the books) failed the shuffle's end: its books
    were in hand and its release done. A master dead before answering raises
    ``ShuffleMasterLostError`` (the caller decides; see ``run_shuffle``)."""
    from hybrid_ray.errors import ShuffleMasterLostError

    @ray.remote(num_cpus=0)
    class Master:
        def heartbeat(self, shuffle_id):
            pass

        def summarize_and_release(self, shuffle_id):
            raise AssertionError("never called: killed before")

    dead = Master.remote()
    ray.kill(dead)
    shuffle = ShuffleLifecycle(config, 1, "test")
    shuffle.register(1)
    _finish_map_with_a_segment(shuffle, 0)
    shuffle._unchecked.append(dead.heartbeat.remote(shuffle.shuffle_id))  # the master's
    summary = shuffle.summarize_and_release()
    assert summary.maps_finished == 1 and not _known(shuffle)

    other = ShuffleLifecycle(config, 1, "test", master=dead)
    with pytest.raises(ShuffleMasterLostError, match=f"died as shuffle {other.shuffle_id} "
                                                     "was released"):
        other.summarize_and_release()
    assert other.released


def test_a_re_run_that_cannot_start_fails_its_shuffle_and_the_others_keep_their_beat(
        monkeypatch):
    """Was: the re-run thread's failed start ended the one thread that heartbeats every
    held shuffle (the others then expired at the master, data still in use); the shuffle
    with the lost maps stayed marked as re-running and its readers waited for maps
    nobody re-ran."""
    class Shuffle:
        def __init__(self, sid, lost):
            self.shuffle_id, self.lost, self.beats, self.released = sid, lost, 0, None

        def heartbeat(self):
            self.beats += 1

        def take_lost(self):
            lost, self.lost = self.lost, []
            return lost

        def release(self, reason="", failed=False):
            self.released = (reason, failed)
            return True

    real_thread = threading.Thread

    class NoRerunThread(real_thread):
        def start(self):
            if self.name.startswith("hybrid_ray-rerun"):
                raise RuntimeError("can't start new thread")
            return super().start()

    monkeypatch.setattr(lifecycle.threading, "Thread", NoRerunThread)
    monkeypatch.setattr(lifecycle, "RECOVERY_POLL_S", 0.02)
    held = lifecycle._HeldShuffles()
    lossy, healthy = Shuffle("shf-lossy0", [3]), Shuffle("shf-healthy0", [])
    held.hold(lossy, rerun=lambda maps: None)
    held.hold(healthy, rerun=None)
    deadline = time.monotonic() + 10
    while healthy.beats < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held._thread.is_alive() and healthy.beats >= 20
    assert lossy.released is not None and lossy.released[1] is True
    assert "re-running maps [3]" in lossy.released[0]
    assert "can't start new thread" in lossy.released[0]
    assert held._rerunning == set()
    assert any("can't start new thread" in e for e in held.errors)
    for sid in held.ids():
        held.unhold(sid)
