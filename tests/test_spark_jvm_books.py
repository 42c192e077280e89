"""The shuffle master's books of JVM shuffle-manager shuffles (``hybrid_ray.spark_jvm``),
without Ray or Spark: commits as the JVM sends them, locates as its readers ask."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_ray.master import ShuffleRegistry
from hybrid_ray.spark_jvm import abort, commit, locate, register

SHUFFLE = "spark-app-1-0"


def _registry() -> ShuffleRegistry:
    return ShuffleRegistry(lambda state, metas: None, lambda state: None)


def _commit(registry: ShuffleRegistry, map_index: int, map_id: int,
            segments: list[list[Any]], final: bool = True) -> None:
    commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": map_index,
                      "map_id": map_id, "node": "n1", "final": final, "segments": segments},
           lambda token: None)


def _seg(partition: int, index: int, where: str) -> list[Any]:
    return [partition, index, "memory", 10, where]


def _range(registry: ShuffleRegistry, maps: tuple[int, int],
           partitions: tuple[int, int]) -> list[list[Any]]:
    return locate(registry, {"shuffle": SHUFFLE, "maps": list(maps),
                             "partitions": list(partitions)})["attempts"]


def test_range_locate_gives_every_finished_attempt_in_range() -> None:
    registry = _registry()
    _commit(registry, 0, 100, [_seg(0, 0, "a"), _seg(1, 0, "b"), _seg(1, 1, "c")])
    _commit(registry, 1, 101, [_seg(1, 0, "d"), _seg(3, 0, "e")])
    # A speculative duplicate of map 1 that finished too: in the answer, and the reader
    # keeps the attempt Spark lists.
    _commit(registry, 1, 105, [_seg(1, 0, "f")])
    # Map 2 has not finished: not in the answer.
    _commit(registry, 2, 102, [_seg(1, 0, "g")], final=False)

    got = _range(registry, (0, 2**31 - 1), (1, 3))
    assert got == [
        [100, 1, [["memory", 10, "n1", "b"], ["memory", 10, "n1", "c"]]],
        [101, 1, [["memory", 10, "n1", "d"]]],
        [105, 1, [["memory", 10, "n1", "f"]]],
    ]
    # A skew-split read's map range, and a partition range outside the data.
    assert _range(registry, (1, 2), (3, 4)) == [[101, 3, [["memory", 10, "n1", "e"]]]]
    assert _range(registry, (0, 3), (2, 3)) == []


def test_range_locate_agrees_with_the_per_block_form() -> None:
    registry = _registry()
    _commit(registry, 0, 7, [_seg(0, 0, "x"), _seg(2, 0, "y")], final=False)
    _commit(registry, 0, 7, [_seg(2, 1, "z")])
    _commit(registry, 1, 8, [_seg(0, 0, "w")])
    abort(registry, {"shuffle": SHUFFLE, "map_id": 8})  # failed after committing: gone

    ranged = {(m, p): segs for m, p, segs in _range(registry, (0, 2), (0, 4))}
    blocks = [[7, 0], [7, 2], [8, 0], [9, 0]]
    per_block = locate(registry, {"shuffle": SHUFFLE, "blocks": blocks})["blocks"]
    assert per_block == [ranged.get((m, p)) for m, p in blocks]
    assert per_block[1] == [["memory", 10, "n1", "y"], ["memory", 10, "n1", "z"]]
    assert per_block[2] is None and per_block[3] is None


def test_a_block_with_a_gap_is_none_in_both_forms() -> None:
    registry = _registry()
    _commit(registry, 0, 3, [_seg(1, 0, "a"), _seg(1, 2, "c")])  # index 1 missing
    assert _range(registry, (0, 1), (0, 4)) == [[3, 1, None]]
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[3, 1]]})["blocks"] == [None]


def test_jvm_grants_are_settled_from_what_the_writer_sends_back(tmp_path) -> None:
    """A tier manager keeps no record of its grants to JVM writers: a writer settles a
    grant by sending back its tier, size and target with the bytes it wrote. Disk grants
    are in flight until settled; a memory grant written in full needs no settlement (the
    JVM sends none); an unused grant's space comes back; a bad settlement is refused."""
    import pytest

    from hybrid_ray import ShuffleConfig, TierName
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import reserve, settle
    from hybrid_ray.tier_manager import TierManager

    tm = TierManager("n1", object_store_bytes=1000)
    config = ShuffleConfig(memory_fraction=0.3, spill_dirs=[str(tmp_path / "spill")])
    answer = reserve(tm, {"shuffle": SHUFFLE, "sizes": [200, 150, 50]}, lambda t: config)
    tiers = [p["tier"] for p in answer["placements"]]
    assert tiers == ["memory", "disk", "memory"] and answer["remote"] is False
    # The writer settles a grant written in full only where that changes the books.
    assert [p["settle_if_written"] for p in answer["placements"]] == [False, True, False]
    disk = tm._tier(SHUFFLE, TierName.DISK)
    target = answer["placements"][1]["target"]
    assert disk._in_flight == {(target, SHUFFLE): 150}
    assert tm.memory.used_by(SHUFFLE) == 250
    # The disk segment was written with 140 bytes; the second memory grant went unused.
    reserve(tm, {"shuffle": SHUFFLE, "sizes": [],
                 "settle": [["disk", 150, target, 140], ["memory", 50, "", None]]},
            lambda t: config)
    assert disk._in_flight == {} and disk.used_by(SHUFFLE) == 140
    assert tm.memory.used_by(SHUFFLE) == 200
    with pytest.raises(ConfigError, match="only \\['memory', 'disk'\\] grant space"):
        settle(tm, SHUFFLE, [["remote", 10, "", 10]])
    with pytest.raises(ConfigError, match="must be \\[tier, granted bytes"):
        settle(tm, SHUFFLE, [[7, 100]])
    with pytest.raises(ConfigError, match="negative bytes"):
        settle(tm, SHUFFLE, [["disk", -1, target, None]])
    tm.release_shuffle(SHUFFLE)
    settle(tm, SHUFFLE, [["disk", 100, target, 100]])  # released meanwhile: nothing to do


def test_a_jvm_memory_lease_is_split_by_the_writer_and_its_rest_settled(tmp_path) -> None:
    """A JVM map task leases memory when it starts: the lease counts as used memory of the
    shuffle at once, the writer places segments in it without a reservation call, and the
    rest comes back as an unused grant. A lease the memory tier cannot take in full (or
    that a shuffle without a memory tier asks for) is refused, never partly granted."""
    import pytest

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import lease, settle
    from hybrid_ray.tier_manager import TierManager

    tm = TierManager("n1", object_store_bytes=1000)
    config = ShuffleConfig(memory_fraction=0.3, spill_dirs=[str(tmp_path / "spill")])
    answer = lease(tm, {"shuffle": SHUFFLE, "bytes": 200}, lambda t: config)
    assert answer == {"lease": {"granted": 200, "target": "plasma", "books": tm.books_id}}
    assert tm.memory.used_by(SHUFFLE) == 200
    # Segments of 120 bytes were written in it; the 80 left go back.
    settle(tm, SHUFFLE, [["memory", 80, "plasma", None]])
    assert tm.memory.used_by(SHUFFLE) == 120
    # 300 is the budget: 120 used, so a lease of 200 is refused whole.
    assert lease(tm, {"shuffle": SHUFFLE, "bytes": 200}, lambda t: config) == {"lease": None}
    assert tm.memory.used_by(SHUFFLE) == 120
    with pytest.raises(ConfigError, match="'bytes' as an integer"):
        lease(tm, {"shuffle": SHUFFLE, "bytes": "lots"}, lambda t: config)
    with pytest.raises(ConfigError, match="must be positive"):
        lease(tm, {"shuffle": SHUFFLE, "bytes": 0}, lambda t: config)
    no_memory = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(tmp_path / "spill")])
    other = SHUFFLE + "-disk-only"
    request = {"shuffle": other, "bytes": 10, "config": {"session_token": "tok"}}
    assert lease(tm, request, {"tok": no_memory}.get) == {"lease": None}


def test_a_reader_waits_only_for_last_commits_still_to_come() -> None:
    """``missing_blocks``: a block missing because its attempt's last commit has not
    arrived is worth waiting for; one whose attempt finished and was lost since is not,
    and then the reader must not wait for anything else either (it fails the fetch at
    once, naming the lost block)."""
    from hybrid_ray.spark_jvm import missing_blocks

    registry = _registry()
    _commit(registry, 0, 100, [_seg(0, 0, "a")])
    _commit(registry, 1, 101, [_seg(0, 0, "b")])
    abort(registry, {"shuffle": SHUFFLE, "map_id": 101})  # finished, then lost

    def ask(*map_ids: int) -> dict[str, Any]:
        request = {"shuffle": SHUFFLE, "blocks": [[m, 0] for m in map_ids]}
        return missing_blocks(registry, request, locate(registry, request))

    assert ask(100) == {"awaited": False, "lost": []}        # all there
    assert ask(100, 102) == {"awaited": True, "lost": []}    # 102's last commit may come
    assert ask(101) == {"awaited": False, "lost": [0]}       # lost: no wait
    assert ask(101, 102) == {"awaited": False, "lost": [0]}  # lost among them: fails anyway


def test_the_lost_block_is_named_not_the_first_missing_one() -> None:
    """Map 0's accepted attempt still has its last commit in its executor's sender; map
    1's had its last commit fail at the master (aborted). A reader asking for both once
    got only "not awaited" and raised FetchFailedException for the first missing block,
    map 0's: Spark dropped every output of a healthy executor and ran the stage again,
    where map 1 (still registered) failed it once more. The answer names map 1's block."""
    import pytest

    from hybrid_ray.spark_jvm import missing_blocks

    registry = _registry()
    _commit(registry, 0, 200, [_seg(0, 0, "a")], final=False)  # last commit still to come
    _commit(registry, 1, 201, [_seg(0, 0, "b")], final=False)
    bad = {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 1, "map_id": 201,
           "node": "n1", "final": True, "segments": [[1, 0, "no-such-tier", 10, "c"]]}
    with pytest.raises(ValueError):
        commit(registry, bad, lambda token: None)  # aborts attempt 201
    request = {"shuffle": SHUFFLE, "blocks": [[200, 0], [200, 1], [201, 0], [201, 1]]}
    answer = locate(registry, request)
    assert answer["blocks"] == [None, None, None, None]
    assert missing_blocks(registry, request, answer) == {"awaited": False, "lost": [2, 3]}
    # Map 0's last commit arrives: only map 1's blocks are missing, and lost.
    _commit(registry, 0, 200, [_seg(1, 0, "d")])
    answer = locate(registry, request)
    assert answer["blocks"][:2] == [[["memory", 10, "n1", "a"]], [["memory", 10, "n1", "d"]]]
    assert missing_blocks(registry, request, answer) == {"awaited": False, "lost": [2, 3]}


def test_a_failed_commit_aborts_its_attempt_so_readers_do_not_wait_for_it() -> None:
    """A JVM map task sends its last commit without waiting. When that commit fails in the
    master, no commit of the attempt will ever complete it: readers waiting for it
    (``missing_blocks``) used to wait their whole bound (commitWaitMs, 30 s) before Spark ran the
    map again. The failed commit aborts the attempt, and an aborted attempt is not
    awaited; a later commit of it is dropped."""
    import pytest

    from hybrid_ray.spark_jvm import missing_blocks

    registry = _registry()
    _commit(registry, 0, 100, [_seg(0, 0, "a")], final=False)
    bad = {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 0, "map_id": 100,
           "node": "n1", "final": True, "segments": [[0, 1, "no-such-tier", 10, "b"]]}
    with pytest.raises(ValueError):
        commit(registry, bad, lambda token: None)
    request = {"shuffle": SHUFFLE, "blocks": [[100, 0]]}
    assert locate(registry, request)["blocks"] == [None]
    assert missing_blocks(registry, request, locate(registry, request)) == {
        "awaited": False, "lost": [0]}
    # The task's retry as the same Spark attempt id cannot complete it either.
    _commit(registry, 0, 100, [_seg(0, 1, "c")])
    assert locate(registry, request)["blocks"] == [None]
    # An attempt never aborted is still waited for.
    assert missing_blocks(registry, {"shuffle": SHUFFLE, "blocks": [[101, 0]]},
                          {"blocks": [None]}) == {"awaited": True, "lost": []}


def _deleting_registry() -> tuple[ShuffleRegistry, list[str]]:
    deleted: list[str] = []
    registry = ShuffleRegistry(
        lambda state, metas: deleted.extend(m.location for m in metas), lambda state: None)
    return registry, deleted


def test_a_last_commit_delivered_twice_deletes_nothing_of_the_finished_attempt() -> None:
    """A repeated delivery of a map attempt's last commit (a retried call) found the
    attempt finished, took its segments for a refused commit and queued them for deletion:
    the files of an attempt Spark accepted."""
    registry, deleted = _deleting_registry()
    _commit(registry, 0, 100, [_seg(0, 0, "a")], final=False)
    _commit(registry, 0, 100, [_seg(0, 1, "b")])
    _commit(registry, 0, 100, [_seg(0, 1, "b")])  # the same last commit again
    assert deleted == []
    assert _range(registry, (0, 1), (0, 1)) == [
        [100, 0, [["memory", 10, "n1", "a"], ["memory", 10, "n1", "b"]]]]


def test_a_commit_the_writer_gave_up_on_is_deleted_by_its_abort_whenever_it_lands() -> None:
    """A writer whose first commit timed out aborts the attempt, not knowing whether the
    master applied it: an abort before the commit, or after it, leaves nothing readable
    and the segments deleted (the master's half of the JVM's abort-after-timeout)."""
    for abort_first in (True, False):
        registry, deleted = _deleting_registry()
        register(registry, {"shuffle": SHUFFLE, "num_partitions": 4}, lambda token: None)
        if abort_first:
            abort(registry, {"shuffle": SHUFFLE, "map_id": 100})
        _commit(registry, 0, 100, [_seg(0, 0, "a")], final=False)
        if not abort_first:
            abort(registry, {"shuffle": SHUFFLE, "map_id": 100})
        assert deleted == ["a"]
        assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[100, 0]]})["blocks"] == [None]


def test_an_abort_that_arrives_before_its_shuffle_is_known_still_deletes_the_attempt() -> None:
    """The driver's registration did not arrive (it is best effort), and a map attempt's
    last commit (which registers the shuffle) and its abort, both sent without waiting,
    ran on the master's threads abort first: the abort found no shuffle and was dropped,
    so the commit published the failed attempt as finished, its segments kept until the
    release and counted in the report (found by a review). Now kept and applied."""
    registry, deleted = _deleting_registry()
    abort(registry, {"shuffle": SHUFFLE, "map_id": 100})
    _commit(registry, 0, 100, [_seg(0, 0, "a")], final=True)
    assert deleted == ["a"]
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[100, 0]]})["blocks"] == [None]
    assert registry.state(SHUFFLE).spark_finished == set()
    assert SHUFFLE not in registry.spark_early_aborts  # applied, not kept
    # Another attempt of the same map is not affected.
    _commit(registry, 0, 101, [_seg(0, 0, "b")], final=True)
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[101, 0]]})["blocks"] == \
        [[["memory", 10, "n1", "b"]]]
    # Kept for a bounded number of shuffles.
    from hybrid_ray.spark_jvm import EARLY_ABORT_SHUFFLES_KEPT

    for i in range(EARLY_ABORT_SHUFFLES_KEPT + 5):
        abort(registry, {"shuffle": f"spark-app-1-{i + 10}", "map_id": 1})
    assert len(registry.spark_early_aborts) == EARLY_ABORT_SHUFFLES_KEPT
    assert "spark-app-1-10" not in registry.spark_early_aborts  # the oldest went



def test_an_executor_spark_removed_takes_the_attempts_it_wrote_with_it() -> None:
    """Was: a killed executor's memory-tier objects died with it and Spark recomputed its
    maps before any reader asked, so nothing reported them lost: they stayed in the
    node's books (a review measured 60 MiB counted against 48 MiB in the store) and their
    files on disk until the release. The driver now names each removed executor."""
    from hybrid_ray.spark_jvm import executor_lost

    registry, deleted = _deleting_registry()

    def commit_from(shuffle: str, map_index: int, map_id: int, executor: Any,
                    where: str) -> None:
        commit(registry, {"shuffle": shuffle, "num_partitions": 4, "map_index": map_index,
                          "map_id": map_id, "node": "n1", "final": True,
                          "executor": executor, "segments": [_seg(0, 0, where)]},
               lambda token: None)

    commit_from(SHUFFLE, 0, 100, "1", "a")
    commit_from(SHUFFLE, 1, 101, "2", "b")
    commit_from(SHUFFLE, 2, 102, "2", "c")
    commit_from("spark-otherapp-0", 0, 100, "2", "d")  # another application's executor 2
    commit_from(SHUFFLE, 3, 103, None, "e")  # a commit of an older jar names none
    assert executor_lost(registry, {"prefix": "spark-app-", "executor": "2"}) == 2
    assert sorted(deleted) == ["b", "c"]
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[100, 0], [101, 0], [102, 0],
                                                            [103, 0]]})["blocks"] == [
        [["memory", 10, "n1", "a"]], None, None, [["memory", 10, "n1", "e"]]]
    assert executor_lost(registry, {"prefix": "spark-app-", "executor": "2"}) == 0  # once
    assert executor_lost(registry, {"prefix": "spark-app-", "executor": "9"}) == 0
    commit_from(SHUFFLE, 1, 101, "2", "b")  # its last commit delivered again (a retry)
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[101, 0]]})["blocks"] == [None]
    for bad in ({"prefix": "spark-app-"}, {"prefix": "", "executor": "1"},
                {"prefix": "app-", "executor": "1"}):
        with pytest.raises(ValueError, match="needs an executor id and a Spark application"):
            executor_lost(registry, bad)

def test_a_commit_sent_before_its_executor_was_removed_and_delivered_after_is_dropped(
        ) -> None:
    """Was kept as a finished attempt (found by a review): Spark had dropped the executor's
    outputs, so nobody read it, and its files and books stayed until the release. The
    driver names the last task it launched there; an executor RayDP restarts under the
    same id runs higher task ids, and those commits count."""
    from hybrid_ray.spark_jvm import executor_lost

    registry, deleted = _deleting_registry()

    def commit_from(map_index: int, map_id: int, executor: str, where: str) -> None:
        commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": map_index,
                          "map_id": map_id, "node": "n1", "final": True,
                          "executor": executor, "segments": [_seg(0, 0, where)]},
               lambda token: None)

    commit_from(0, 100, "7", "a")
    assert executor_lost(registry, {"prefix": "spark-app-", "executor": "7",
                                    "last_task": 101}) == 1
    commit_from(1, 101, "7", "late")  # launched before the removal, delivered after it
    commit_from(2, 102, "7", "restarted")  # the same id, restarted: a later task
    commit_from(3, 99, "8", "other")  # another executor's, below that id: counts
    assert sorted(deleted) == ["a", "late"]
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[101, 0], [102, 0], [99, 0]]}
                  )["blocks"] == [None, [["memory", 10, "n1", "restarted"]],
                                  [["memory", 10, "n1", "other"]]]
    for bad in ("9", 1.5, True):
        with pytest.raises(ValueError, match="last_task must be a task attempt id"):
            executor_lost(registry, {"prefix": "spark-app-", "executor": "7",
                                     "last_task": bad})


def test_a_commit_whose_segment_entries_are_malformed_is_refused() -> None:
    # Was: entries of seven elements and more were taken, the rest dropped silently.
    registry, deleted = _deleting_registry()
    for bad in ([0, 0, "memory", 10, "a", None, "extra"], [0, 0, "memory", 10], "0,0"):
        with pytest.raises(ValueError, match=r"a segment of a Spark commit is \[partition, "
                                             r"index, tier, nbytes, location\]"):
            commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 0,
                              "map_id": 100, "node": "n1", "final": True,
                              "segments": [_seg(0, 0, "ok"), bad]}, lambda token: None)
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[100, 0]]})["blocks"] == [None]


def test_the_tier_manager_s_remote_io_for_the_jvm_is_bounded(tmp_path, monkeypatch) -> None:
    """A JVM segment is written to and read from the remote tier by the node's tier
    manager (``spark_jvm.write_remote`` / ``read_remote``), an actor that runs one call at
    a time. Those calls went straight to the filesystem: a sync one (NFS through
    ``file://``) has no deadline, so a hung server held the tier manager forever, and with
    it every writer's reservation on the node. They are now waited for within the tier's
    bound (``RemoteTier.outcome``), as a Python reader's and writer's are."""
    import threading
    import time

    import pytest

    from hybrid_ray import SegmentId
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.spark_jvm import read_remote, write_remote
    from hybrid_ray.tiers import remote as remote_module

    tm, tier, cfg = _tier_manager_with_a_remote_tier(tmp_path)
    hung = threading.Event()
    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 0.5)
    monkeypatch.setattr(tier.fs, "pipe_file", lambda *a, **k: hung.wait(5))
    monkeypatch.setattr(tier.fs, "cat_file", lambda *a, **k: hung.wait(5))
    request = {"shuffle": SHUFFLE, "map_index": 0, "partition": 0, "index": 0, "map_id": 7}
    try:
        started = time.monotonic()
        with pytest.raises(ShuffleStalledError):
            write_remote(tm, request, b"x" * 100)
        with pytest.raises(ShuffleStalledError):
            read_remote(tm, {"shuffle": SHUFFLE, "nbytes": 100,
                             "location": tier.segment_path(SegmentId(SHUFFLE, 0, 0, 0, 7))},
                        lambda token: None)
        assert time.monotonic() - started < 4
    finally:
        hung.set()


def test_a_jvm_remote_write_that_lands_after_its_bound_and_the_release_leaves_nothing(
        tmp_path, monkeypatch) -> None:
    """6911c74 runs a JVM segment's remote write on the transfer threads and gives up on
    it after the bound, but the write goes on. The master removes a released shuffle's
    remote tree after the tier managers' release, relying on no JVM write of it coming
    after (the tier manager ran one call at a time): a write that landed late re-created
    the shuffle's marked directory and its segment, which no one committed nor removed."""
    import os
    import threading

    import pytest

    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.spark_jvm import write_remote
    from hybrid_ray.tiers import remote as remote_module

    tm, tier, cfg = _tier_manager_with_a_remote_tier(tmp_path)
    hung = threading.Event()
    real_pipe = tier.fs.pipe_file

    def slow_pipe(*args, **kwargs):
        hung.wait(5)
        return real_pipe(*args, **kwargs)

    monkeypatch.setattr(remote_module, "RESULT_WAIT_S", 0.3)
    monkeypatch.setattr(tier.fs, "pipe_file", slow_pipe)
    request = {"shuffle": SHUFFLE, "map_index": 0, "partition": 0, "index": 0, "map_id": 7}
    with pytest.raises(ShuffleStalledError):
        write_remote(tm, request, b"x" * 100)
    pool = tier.io_pool()  # the write's threads (a release may close the tier's pool)
    tm.release_shuffle(SHUFFLE, cfg)
    tier.remove_shuffle_data(SHUFFLE)  # the master, after the tier managers' release
    hung.set()  # the store answers again: the write lands
    pool.shutdown(wait=True)
    assert not os.path.exists(tier.shuffle_path(SHUFFLE)), os.listdir(
        tier.shuffle_path(SHUFFLE))


def _tier_manager_with_a_remote_tier(tmp_path):
    """A tier manager with SHUFFLE registered on a ``file://`` remote tier, that tier and
    the shuffle's config."""
    from hybrid_ray import ShuffleConfig
    from hybrid_ray.tier_manager import TierManager

    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], memory_capacity_bytes=0,
                        remote_path=f"file://{tmp_path}/remote", progress=False)
    tm = TierManager("n1", 0)
    tm.register_shuffle(SHUFFLE, cfg)
    return tm, tm.remote_tier(SHUFFLE), cfg


def test_a_session_the_master_forgot_is_said_in_the_report_not_silently_left_off(
        tmp_path, caplog) -> None:
    """A Spark session whose config the master no longer holds (restarted since, or the
    session stopped) registers its shuffles with the fields Spark's conf carries: memory
    and disk, no remote tier. That happened silently: a user who configured S3 to keep a
    small disk from filling saw nothing until the disk filled."""
    import json
    import logging

    from hybrid_ray.config import ShuffleConfig
    from hybrid_ray.spark_jvm import SparkSessions, config_to_json, summary
    from spark_bridge.hybrid_shuffle import _report

    with_remote = ShuffleConfig(spill_dirs=[str(tmp_path)], remote_path=f"file://{tmp_path}/r",
                                progress=False)
    sessions = SparkSessions()
    registry = _registry()

    def register_as_the_jvm(shuffle: str, config: ShuffleConfig) -> None:
        carried = {**json.loads(config_to_json(config)), "session_token": "s1"}
        register(registry, {"shuffle": shuffle, "num_partitions": 4, "config": carried},
                 sessions.get)

    # Known session: its whole config, nothing to say.
    sessions.open("s1", with_remote)
    register_as_the_jvm("spark-app-1-1", with_remote)
    assert registry.state("spark-app-1-1").config.remote_path == with_remote.remote_path
    assert summary(registry, "spark-app-1-1")["notes"] == []
    # Forgotten session: no remote tier, and the log and the report say so.
    sessions.close("s1")
    with caplog.at_level(logging.WARNING, logger="hybrid_ray.spark_jvm"):
        register_as_the_jvm("spark-app-1-2", with_remote)
    assert registry.state("spark-app-1-2").config.remote_path is None
    [note] = summary(registry, "spark-app-1-2")["notes"]
    assert note.startswith("remote tier off: the shuffle master does not know this Spark")
    assert note in caplog.text and "spark-app-1-2" in caplog.text
    report = _report(summary(registry, "spark-app-1-2"))
    assert report.notes == (note,) and f"note: {note}" in report.table()
    # A session that never had a remote tier loses nothing: no note.
    register_as_the_jvm("spark-app-1-3", ShuffleConfig(spill_dirs=[str(tmp_path)],
                                                       progress=False))
    assert summary(registry, "spark-app-1-3")["notes"] == []


def test_a_jvm_reservation_that_fails_marking_its_disk_target_gives_its_grants_back(
        tmp_path, monkeypatch) -> None:
    """A JVM reservation marks each disk grant's shuffle directory as hybrid_ray's. When
    that failed (a user quota: EDQUOT, which statvfs does not show), the call raised with
    its grants counted, in flight on the disk, though the JVM never heard of them: room
    refused to every shuffle on that filesystem until this one's release."""
    import errno

    import pytest

    from hybrid_ray import ShuffleConfig, TierName
    from hybrid_ray.spark_jvm import reserve
    from hybrid_ray.tier_manager import TierManager
    from hybrid_ray.tiers.disk import DiskTier

    tm = TierManager("n1", object_store_bytes=1000)
    config = ShuffleConfig(memory_fraction=0.3, spill_dirs=[str(tmp_path / "spill")])

    def quota_exceeded(self, shuffle_id, spill_dir):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(DiskTier, "mark_shuffle", quota_exceeded)
    with pytest.raises(OSError, match="quota"):
        reserve(tm, {"shuffle": SHUFFLE, "sizes": [200, 150, 50]}, lambda t: config)
    disk = tm._tier(SHUFFLE, TierName.DISK)
    assert disk._in_flight == {} and disk.used_by(SHUFFLE) == 0
    assert tm.memory.used_by(SHUFFLE) == 0
    tm.release_shuffle(SHUFFLE)


def test_a_jvm_reservation_whose_answer_never_came_is_cancelled_once(tmp_path) -> None:
    """A JVM writer whose reservation call timed out never saw its grants: its abort
    cancels the call by its token, which gives them back once. The token is checked, and
    a call whose marking failed, given back by the call itself, is not given back again
    by a cancel."""
    import errno

    import pytest

    from hybrid_ray import ShuffleConfig, TierName
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import cancel_reserve, reserve
    from hybrid_ray.tier_manager import TierManager
    from hybrid_ray.tiers.disk import DiskTier

    tm = TierManager("n1", object_store_bytes=1000)
    config = ShuffleConfig(memory_fraction=0.3, spill_dirs=[str(tmp_path / "spill")])
    kept = reserve(tm, {"shuffle": SHUFFLE, "sizes": [100]}, lambda t: config)
    token = {"token_writer": "w-1", "token_sequence": 1}
    lost = reserve(tm, {"shuffle": SHUFFLE, "sizes": [200, 150], **token}, lambda t: config)
    assert [p["tier"] for p in kept["placements"] + lost["placements"]] == \
        ["memory", "memory", "disk"]
    disk = tm._tier(SHUFFLE, TierName.DISK)
    assert tm.memory.used_by(SHUFFLE) == 300 and disk.used_by(SHUFFLE) == 150
    assert cancel_reserve(tm, {"shuffle": SHUFFLE, **token}) == 2
    assert tm.memory.used_by(SHUFFLE) == 100 and disk.used_by(SHUFFLE) == 0
    assert disk._in_flight == {}
    assert cancel_reserve(tm, {"shuffle": SHUFFLE, **token}) == 0  # once only
    assert tm.memory.used_by(SHUFFLE) == 100

    for bad in ({"token_writer": "", "token_sequence": 1},
                {"token_writer": "w", "token_sequence": -1},
                {"token_writer": "w", "token_sequence": True},
                {"token_writer": 7, "token_sequence": 1}):
        with pytest.raises(ConfigError, match="token must be a writer name"):
            reserve(tm, {"shuffle": SHUFFLE, "sizes": [10], **bad}, lambda t: config)
    with pytest.raises(ConfigError, match="needs token_writer and token_sequence"):
        cancel_reserve(tm, {"shuffle": SHUFFLE})

    # A reservation that fails marking its disk target (a shuffle's first disk grant
    # here) gives its grants back itself; a cancel of it afterwards (its writer saw the
    # call fail) gives nothing back twice.
    other = "spark-app-1-1"
    original = DiskTier.mark_shuffle

    def quota_exceeded(self, shuffle_id, spill_dir):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    DiskTier.mark_shuffle = quota_exceeded
    try:
        failing = {"token_writer": "w-2", "token_sequence": 1}
        with pytest.raises(OSError, match="quota"):
            reserve(tm, {"shuffle": other, "sizes": [50, 600], **failing}, lambda t: config)
    finally:
        DiskTier.mark_shuffle = original
    other_disk = tm._tier(other, TierName.DISK)
    assert tm.memory.used_by(other) == 0 and other_disk.used_by(other) == 0
    assert cancel_reserve(tm, {"shuffle": other, **failing}) == 0
    assert tm.memory.used_by(other) == 0 and other_disk.used_by(other) == 0
    tm.release_shuffle(other)
    tm.release_shuffle(SHUFFLE)


def test_a_jvm_remote_write_for_a_released_shuffle_says_so(tmp_path) -> None:
    """A JVM map storing a remote segment after its shuffle was released on the node was
    told that its Spark session's ShuffleConfig has no remote_path (start Spark with one),
    though it has one: the user was sent to fix a config that was right."""
    import pytest

    from hybrid_ray.errors import ShuffleReleasedError
    from hybrid_ray.spark_jvm import write_remote

    tm, tier, _ = _tier_manager_with_a_remote_tier(tmp_path)
    tm.release_shuffle(SHUFFLE)
    request = {"shuffle": SHUFFLE, "map_index": 0, "partition": 0, "index": 0, "map_id": 7}
    with pytest.raises(ShuffleReleasedError, match=f"{SHUFFLE}' was released on node n1") \
            as info:
        write_remote(tm, request, b"x" * 100)
    assert "remote_path" not in str(info.value)


@pytest.mark.parametrize("field", ["map_index", "partition", "index", "map_id"])
def test_a_jvm_remote_write_with_a_negative_number_is_refused_before_writing(
        tmp_path, field) -> None:
    """A JVM request's numbers name the segment's remote object. A negative partition was
    stored as ``sub--0001``, a name ``RemoteTier.delete`` refuses (it requires
    ``sub-<digits>``): the object stayed until the whole tree went at the release."""
    import os

    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import write_remote

    tm, tier, _ = _tier_manager_with_a_remote_tier(tmp_path)
    request = {"shuffle": SHUFFLE, "map_index": 0, "partition": 0, "index": 0, "map_id": 7}
    request[field] = -1
    with pytest.raises(ConfigError, match=f"{field} must be a whole number >= 0, got -1"):
        write_remote(tm, request, b"x" * 100)
    written = [f for _, _, files in os.walk(tmp_path / "remote") for f in files
               if not f.startswith(".")]
    assert written == []


def test_a_failed_jvm_attempts_uncommitted_remote_segments_are_deleted_and_no_others(
        tmp_path) -> None:
    """A JVM map attempt whose batch failed after some of its segments went to the remote
    tier never commits them, so the master's abort cannot delete them: the attempt has
    the tier manager delete them (``delete_remote``), by the paths ``write_remote`` gave
    them. Another attempt's segment and the shuffle's marker stay; a segment that is not
    there is no error; a bad request is refused before anything is deleted."""
    import os

    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import delete_remote, write_remote

    tm, tier, _ = _tier_manager_with_a_remote_tier(tmp_path)
    mine = {"shuffle": SHUFFLE, "map_index": 0, "partition": 1, "index": 0, "map_id": 7}
    other = dict(mine, map_id=8)
    mine_path = write_remote(tm, mine, b"x" * 100)["location"]
    other_path = write_remote(tm, other, b"y" * 100)["location"]
    with pytest.raises(ConfigError, match="must be"):
        delete_remote(tm, {"shuffle": SHUFFLE, "map_index": 0, "map_id": 7,
                           "segments": [[1, -1]]})
    with pytest.raises(ConfigError, match=r"\[\[partition, index\]"):
        delete_remote(tm, {"shuffle": SHUFFLE, "map_index": 0, "map_id": 7,
                           "segments": ["../x"]})
    assert os.path.exists(mine_path)
    assert delete_remote(tm, {"shuffle": SHUFFLE, "map_index": 0, "map_id": 7,
                              "segments": [[1, 0], [2, 0]]}) == 2
    assert not os.path.exists(mine_path)
    assert os.path.exists(other_path)
    tm.release_shuffle(SHUFFLE)  # released meanwhile: its tree went with the release
    assert delete_remote(tm, dict(other, segments=[[1, 0]])) == 0


def test_a_failed_remote_delete_of_a_jvm_attempt_does_not_stop_the_others(
        tmp_path, monkeypatch) -> None:
    """The deletes of a failed JVM attempt's uncommitted remote segments stopped at the
    first that failed (a store's transient error), so the segments after it stayed in the
    store until the shuffle's release. Every one is tried; the first error is raised."""
    import os

    from hybrid_ray.spark_jvm import delete_remote, write_remote

    tm, tier, _ = _tier_manager_with_a_remote_tier(tmp_path)
    first = {"shuffle": SHUFFLE, "map_index": 0, "partition": 1, "index": 0, "map_id": 7}
    second = dict(first, partition=2)
    first_path = write_remote(tm, first, b"x" * 100)["location"]
    second_path = write_remote(tm, second, b"y" * 100)["location"]
    real_delete = type(tier).delete

    def flaky_delete(self, meta):
        if meta.id.subpartition == 1:
            raise OSError("503 Slow Down")
        return real_delete(self, meta)

    monkeypatch.setattr(type(tier), "delete", flaky_delete)
    with pytest.raises(Exception, match="503 Slow Down"):
        delete_remote(tm, {"shuffle": SHUFFLE, "map_index": 0, "map_id": 7,
                           "segments": [[1, 0], [2, 0]]})
    assert os.path.exists(first_path)
    assert not os.path.exists(second_path)


def test_the_remote_deletes_of_a_jvm_attempt_share_one_bound_on_a_hung_store(
        tmp_path, monkeypatch) -> None:
    """With every segment tried, each delete waited the tier's whole result bound (600 s)
    in turn: on a hung sync filesystem, a failed attempt's N uncommitted segments held the
    tier manager's call for N times the bound. All are waited for within one bound."""
    import threading
    import time

    import hybrid_ray.tiers.remote as remote_mod
    from hybrid_ray.errors import ShuffleStalledError
    from hybrid_ray.spark_jvm import delete_remote, write_remote

    tm, tier, _ = _tier_manager_with_a_remote_tier(tmp_path)
    request = {"shuffle": SHUFFLE, "map_index": 0, "index": 0, "map_id": 7}
    for partition in range(8):
        write_remote(tm, dict(request, partition=partition), b"x" * 10)
    hung = threading.Event()
    monkeypatch.setattr(type(tier), "delete", lambda self, meta: hung.wait(30))
    monkeypatch.setattr(remote_mod, "RESULT_WAIT_S", 0.5)
    started = time.monotonic()
    try:
        with pytest.raises(ShuffleStalledError, match="did not finish within"):
            delete_remote(tm, dict(request, segments=[[p, 0] for p in range(8)]))
        elapsed = time.monotonic() - started
    finally:
        hung.set()  # the store answers again: the hung deletes end
    assert elapsed < 2.0, f"8 hung deletes took {elapsed:.1f} s, not one bound (0.5 s)"


def test_a_shuffle_whose_registration_and_commits_are_still_on_their_way_is_waited_for(
) -> None:
    """The driver registers a Spark shuffle without waiting, and a map task's last commit
    (which registers it too) leaves its executor without waiting: a reader could ask
    before either arrived. The master answered "unknown shuffle", which the reader takes
    as the master's word and fails the fetch: Spark then recomputed every output of a
    healthy executor (found by a review). Unknown now reads as nothing committed yet;
    a released shuffle still fails."""
    from hybrid_ray.errors import ShuffleReleasedError
    from hybrid_ray.spark_jvm import missing_blocks

    registry = _registry()
    request = {"shuffle": SHUFFLE, "blocks": [[100, 0], [100, 1]]}
    answer = locate(registry, request)
    assert answer == {"blocks": [None, None]}
    assert missing_blocks(registry, request, answer) == {"awaited": True, "lost": []}
    assert _range(registry, (0, 5), (0, 4)) == []
    _commit(registry, 0, 100, [_seg(0, 0, "a"), _seg(1, 0, "b")])  # the last commit lands
    answer = locate(registry, request)
    assert answer["blocks"] == [[["memory", 10, "n1", "a"]], [["memory", 10, "n1", "b"]]]
    assert missing_blocks(registry, request, answer) == {"awaited": False, "lost": []}
    registry.release(SHUFFLE)
    with pytest.raises(ShuffleReleasedError, match="released"):
        locate(registry, request)
    with pytest.raises(ShuffleReleasedError, match="released"):
        _range(registry, (0, 5), (0, 4))


def test_a_jvm_grant_of_a_tier_manager_that_died_changes_nothing_at_its_successor(tmp_path):
    """A JVM writer's grants crossed to Java without the books that granted them, so a
    tier manager started again after one died counted the dead one's settlements and
    frees as its own: a stale lease given back freed room live leases held (the memory
    budget overshot), a stale disk grant dropped a live grant's bytes in flight (found by
    a review). Grants, settlements and committed segments now name their books."""
    from hybrid_ray import ShuffleConfig, TierName
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import lease, reserve, settle
    from hybrid_ray.tier_manager import TierManager

    config = ShuffleConfig(memory_fraction=0.3, spill_dirs=[str(tmp_path / "spill")])
    sessions = lambda token: config  # noqa: E731 - the session lookup
    request = {"shuffle": SHUFFLE, "config": {"session_token": "tok"}}
    dead = TierManager("n1", object_store_bytes=1000)  # memory budget 300
    stale = lease(dead, {**request, "bytes": 200}, sessions)["lease"]
    assert stale["books"] == dead.books_id
    stale_disk = reserve(dead, {**request, "sizes": [400]}, sessions)["placements"][0]
    assert stale_disk["tier"] == "disk" and stale_disk["books"] == dead.books_id
    successor = TierManager("n1", object_store_bytes=1000)  # started under the same name
    live = lease(successor, {**request, "bytes": 250}, sessions)["lease"]
    assert live["books"] == successor.books_id != dead.books_id
    settle(successor, SHUFFLE, [["memory", stale["granted"], stale["target"], None,
                                 stale["books"]]])
    assert successor.memory.used_by(SHUFFLE) == 250  # the live lease still counted
    assert lease(successor, {**request, "bytes": 250}, sessions)["lease"] is None  # full
    live_disk = reserve(successor, {**request, "sizes": [400]}, sessions)["placements"][0]
    disk = successor._tier(SHUFFLE, TierName.DISK)
    in_flight = dict(disk._in_flight)
    settle(successor, SHUFFLE, [[stale_disk["tier"], 400, stale_disk["target"], None,
                                 stale_disk["books"]]])
    assert disk._in_flight == in_flight and live_disk["books"] == successor.books_id
    # A committed JVM segment written under the dead one, freed at its successor.
    registry = _registry()
    commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 0, "map_id": 7,
                      "node": "n1", "final": True,
                      "segments": [[0, 0, "memory", 200, "ref", stale["books"]]]},
           lambda token: None)
    meta = registry.state(SHUFFLE).maps[0].segments[0][0][0]
    assert meta.granted_by == dead.books_id
    successor.free_segments(SHUFFLE, [meta.without_object_ref()])  # as the master sends it
    assert successor.memory.used_by(SHUFFLE) == 250
    # Without books (an older writer): counted by whichever tier manager gets it, as before.
    settle(successor, SHUFFLE, [["memory", 50, live["target"], None]])
    assert successor.memory.used_by(SHUFFLE) == 200
    with pytest.raises(ConfigError, match="books id must be a string"):
        settle(successor, SHUFFLE, [["memory", 1, live["target"], None, 7]])


def test_a_failed_spark_attempt_counts_once_in_the_report_however_its_commits_arrive(
        ) -> None:
    """Each commit of an aborted attempt arriving after its abort (the abort ran first on
    the master's threads, a last commit delivered again, one sent before its executor's
    loss) began a registry attempt of its own and dropped it: the report's
    ``superseded_attempts`` counted one failed Spark attempt two or three times (found by
    a review). Its segments are deleted all the same."""
    from hybrid_ray.spark_jvm import executor_lost, summary

    registry, deleted = _deleting_registry()
    register(registry, {"shuffle": SHUFFLE, "num_partitions": 4}, lambda token: None)
    abort(registry, {"shuffle": SHUFFLE, "map_id": 100})
    _commit(registry, 0, 100, [_seg(0, 0, "a")])
    _commit(registry, 0, 100, [_seg(0, 0, "a")])  # the same last commit again
    abort(registry, {"shuffle": SHUFFLE, "map_id": 100})  # and its abort again
    _commit(registry, 0, 101, [_seg(0, 0, "b")])
    assert deleted == ["a", "a"]
    assert summary(registry, SHUFFLE)["superseded_attempts"] == 1

    commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 1, "map_id": 102,
                      "node": "n1", "final": False, "executor": "7",
                      "segments": [_seg(1, 0, "c")]}, lambda token: None)
    assert executor_lost(registry, {"prefix": "spark-app-", "executor": "7",
                                    "last_task": 102}) == 1
    # Its last commit, sent before the loss, delivered after it.
    commit(registry, {"shuffle": SHUFFLE, "num_partitions": 4, "map_index": 1, "map_id": 102,
                      "node": "n1", "final": True, "executor": "7",
                      "segments": [_seg(1, 1, "d")]}, lambda token: None)
    assert deleted == ["a", "a", "c", "d"]
    assert summary(registry, SHUFFLE)["superseded_attempts"] == 2
    assert locate(registry, {"shuffle": SHUFFLE, "blocks": [[100, 0], [101, 0], [102, 1]]}
                  )["blocks"] == [None, [["memory", 10, "n1", "b"]], None]
