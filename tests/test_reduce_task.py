"""The reduce task's reader (``hybrid_ray.reduce_task``) against a real shuffle master."""

from __future__ import annotations

import dataclasses
import re
import uuid

import numpy as np
import pyarrow as pa
import pytest

from conftest import assert_no_leftovers, base_config


class _CommitsSwapped:
    """A master handle whose first two ``commit`` calls reach the master in reverse order,
    as a remote-tier upload committed after the local segment written next does."""

    def __init__(self, master):
        self._master = master
        self._held = None
        self.swapped = False

    def __getattr__(self, name):
        return getattr(self._master, name)

    @property
    def commit(self):
        outer = self

        class _Commit:
            @staticmethod
            def remote(*args):
                import ray

                if outer._held is None and not outer.swapped:
                    outer._held = args
                    return ray.put(True)  # the writer goes on as if it had been sent
                later = outer._master.commit.remote(*args)
                if outer._held is not None:
                    ray.get(later)
                    earlier, outer._held, outer.swapped = outer._held, None, True
                    return outer._master.commit.remote(*earlier)
                return later

        return _Commit()


def test_a_map_s_rows_come_back_in_written_order_when_its_commits_arrive_out_of_order(
        ray_local, tmp_path):
    """Was: the reader kept a map's segments in the order the master received them. With
    the remote tier a map's upload commits after the local segment written next, so rows
    came back out of order and a seeded ``random_shuffle`` differed run to run."""
    import ray

    from hybrid_ray.actors import get_master
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.reduce_task import read_subpartition
    from hybrid_ray.shuffle import write_map_partition

    config = base_config(tmp_path, mode="blocking",
                         namespace=f"hr-order-{uuid.uuid4().hex[:6]}",
                         segment_bytes={"memory": 64 * 1024, "disk": 64 * 1024,
                                        "remote": 64 * 1024})
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, config, True))
    table = pa.table({"key": np.arange(60_000) % 5, "id": np.arange(60_000)})
    swapping = _CommitsSwapped(master)
    try:
        # Three chunks: the first two are committed on their own (swapped here), the
        # last travels with finish_map.
        write_map_partition(shuffle_id, 0, [table.slice(i * 20_000, 20_000) for i in range(3)],
                            2, HashPartitioner(["key"]), config, swapping)
        assert swapping.swapped
        order = [m.id.index for m in ray.get(master.segments.remote(shuffle_id))
                 if m.id.subpartition == 0]
        assert order != sorted(order), "the master must have received them out of order"
        parts = np.asarray(HashPartitioner(["key"]).assign(table, 0, 2))
        for sub in (0, 1):
            rows = pa.concat_tables(read_subpartition(shuffle_id, sub, config, master))
            assert rows["id"].to_pylist() == table["id"].to_numpy()[parts == sub].tolist()
    finally:
        ray.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray)


class _LostMapsMaster:
    """A scripted master for one subpartition of two maps whose first attempts' segments
    are both gone (their writer died): each map's new attempt appears ``rerun_s`` after a
    reader reports it lost, as the driver's re-run would. Calls answer through Ray refs,
    as an actor's do."""

    def __init__(self, rerun_s: float):
        import time

        from hybrid_ray.segment import SegmentId, SegmentMeta
        from hybrid_ray.config import TierName

        self._clock, self.rerun_s = time.monotonic, rerun_s
        self.rerun_at: dict[int, float] = {}  # map -> when its new attempt is in

        def meta(m, attempt):
            return SegmentMeta(SegmentId("shf-lost", m, 0, 0, attempt), TierName.MEMORY, 8, 1,
                               "node", f"m{m}a{attempt}")

        self.meta = meta
        outer = self

        class _Call:
            def __init__(self, fn):
                self.remote = lambda *args: __import__("ray").put(fn(*args))

        self.poll = _Call(outer._poll)
        self.report_lost = _Call(outer._report_lost)
        self.progress = _Call(outer._progress)
        self.progress_asks = 0

    def _progress(self, shuffle_id):
        self.progress_asks += 1
        now = self._clock()
        return {"maps": [{"finished": None,
                          "attempt": 1 if now >= self.rerun_at.get(m, float("inf")) else 0}
                         for m in (0, 1)]}

    def _report_lost(self, shuffle_id, map_index, attempt):
        self.rerun_at.setdefault(map_index, self._clock() + self.rerun_s)
        return True

    def _poll(self, shuffle_id, sub, cursors, pid, wait_s):
        from hybrid_ray.master import MapUpdate, PollResult

        updates, now = [], self._clock()
        for m in (0, 1):
            attempt = 1 if now >= self.rerun_at.get(m, float("inf")) else 0
            seen_attempt, seen = cursors.get(m, (attempt, 0))
            reset = seen_attempt != attempt
            if reset or seen == 0:
                updates.append(MapUpdate(m, attempt, reset, [self.meta(m, attempt)]))
        done = not updates and all(cursors.get(m, (0, 0))[0] == 1 for m in (0, 1))
        return PollResult(updates, done)


class _ReadsOnlyNewAttempts:
    """A read client for which every attempt-0 segment is gone (died with its writer)."""

    def __init__(self, *args, **kwargs):
        pass

    def read_in_order(self, metas, transfers):
        from hybrid_ray.errors import SegmentNotFoundError

        for meta in metas:
            if meta.id.attempt == 0:
                def gone(meta=meta):
                    raise SegmentNotFoundError(f"{meta.id} died with its writer")
                yield gone()
            yield pa.table({"map": [meta.id.map_partition]})


@pytest.fixture
def reduce_task(monkeypatch):
    """hybrid_ray.reduce_task reading through ``_ReadsOnlyNewAttempts`` (no real tiers)."""
    from hybrid_ray import reduce_task as module

    monkeypatch.setattr(module, "ReadClient", _ReadsOnlyNewAttempts)
    monkeypatch.setattr(module, "io_tiers_for", lambda *args, **kwargs: {})
    return module


def test_maps_lost_together_each_get_their_own_wait_for_a_new_attempt(
        ray_local, tmp_path, reduce_task):
    """Two maps of one dead writer are found gone one after the other (the reader stops at
    the first, and meets the second once the first is back). Each re-run takes 0.8 s of a
    1.2 s wait: the reader must get both, in map order. It shared one wait across the
    maps and failed a shuffle that was recovering (1.6 s > 1.2 s)."""
    master = _LostMapsMaster(rerun_s=0.8)
    tables = reduce_task.read_subpartition("shf-lost", 0, base_config(tmp_path), master,
                                           missing_wait_s=1.2)
    assert [t["map"].to_pylist() for t in tables] == [[0], [1]]
    assert sorted(master.rerun_at) == [0, 1]


def test_a_re_run_that_waits_long_for_a_writer_is_still_waited_for(
        ray_local, tmp_path, reduce_task):
    """A lost map's re-run may queue behind long maps for a free writer. The reader gave
    up after missing_wait_s although the master still counted the map unfinished, and a
    recovering shuffle failed. Past that wait it now asks the master once and waits on,
    up to the shuffle's stall bound."""
    master = _LostMapsMaster(rerun_s=1.5)
    tables = reduce_task.read_subpartition("shf-lost", 0, base_config(tmp_path), master,
                                           missing_wait_s=0.5)
    assert [t["map"].to_pylist() for t in tables] == [[0], [1]]
    assert master.progress_asks == 2  # once per lost map, not once per poll


def test_a_re_run_that_never_begins_fails_the_reader_at_the_stall_bound(
        ray_local, tmp_path, reduce_task):
    """The longer wait is bounded: a map that never runs again fails the reader once the
    shuffle's stall_timeout_s has passed, naming the segment, the time it waited and the
    setting that bounded it (it said "within 0 s", missing_wait_s, after waiting 1.5 s)."""
    import time

    from hybrid_ray.errors import SegmentNotFoundError

    master = _LostMapsMaster(rerun_s=3600)
    config = dataclasses.replace(base_config(tmp_path), stall_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(SegmentNotFoundError) as info:
        reduce_task.read_subpartition("shf-lost", 0, config, master, missing_wait_s=0.5)
    assert 1.5 <= time.monotonic() - started < 10
    assert re.search(r"no new attempt of map 0 started in the [2-9] s this reader waited "
                     r"\(the master still counted the map unfinished but its re-run did not "
                     r"start within stall_timeout_s=1\.5 s; raise it if maps queue that long",
                     str(info.value)), str(info.value)


def test_a_read_ahead_whose_tier_manager_died_falls_back_to_the_recovering_fetch(
        monkeypatch):
    """``start_fetch_from_node`` sends its read at once; if the owning node's tier manager
    dies before answering, waiting for it must go through ``fetch_from_node``, which tells
    a dead node from a dead tier manager and asks one started again, instead of raising
    the actor's death (and with no tier manager found at all, the same)."""
    import ray

    from hybrid_ray import reduce_task

    calls = []

    class Handle:
        class read_disk_segment:  # noqa: N801 - mimics an actor method
            @staticmethod
            def remote(meta):
                calls.append(("sent", meta))
                return "ref"

    def died(ref, what, timeout_s):
        calls.append(("waited", ref))
        raise ray.exceptions.ActorDiedError()

    def recovering_fetch(meta, namespace):
        calls.append(("recovered", meta, namespace))
        return b"the segment"

    monkeypatch.setattr(reduce_task, "existing_tier_manager", lambda node, ns: Handle())
    monkeypatch.setattr(reduce_task, "answer_of", died)
    monkeypatch.setattr(reduce_task, "fetch_from_node", recovering_fetch)
    meta = dataclasses.make_dataclass("Meta", ["node_id", "id"])("node-a", "seg-1")
    wait = reduce_task.start_fetch_from_node(meta, "ns")
    assert calls == [("sent", meta)]  # sent before anyone waits
    assert wait() == b"the segment"
    assert calls[1:] == [("waited", "ref"), ("recovered", meta, "ns")]
    calls.clear()
    monkeypatch.setattr(reduce_task, "existing_tier_manager", lambda node, ns: None)
    assert reduce_task.start_fetch_from_node(meta, "ns")() == b"the segment"
    assert calls == [("recovered", meta, "ns")]


@pytest.mark.parametrize("node_alive", [True, False])
def test_a_dead_tier_manager_on_a_live_node_is_replaced_without_waiting_for_the_node_table(
        monkeypatch, node_alive):
    """A read whose tier manager died asks one started again at once when Ray's node
    table still counts the node alive: it waited up to ``NODE_DEATH_WAIT_S`` (15 s) for the
    table to call a live node dead first. A node the table counts dead loses the segment
    with it, also at once, and no tier manager is started there."""
    import ray

    from hybrid_ray import reduce_task
    from hybrid_ray.errors import SegmentLostWithNodeError

    events = []

    def read_through(tm, meta):
        events.append(("read", tm))
        if tm == "dead":
            raise ray.exceptions.ActorDiedError()
        return b"the segment"

    def waited_for_the_table(node_id, exc):
        events.append(("waited for the node table", node_id))
        return not node_alive

    monkeypatch.setattr(reduce_task, "existing_tier_manager", lambda node, ns: "dead")
    monkeypatch.setattr(reduce_task, "get_tier_manager",
                        lambda node, ns: events.append(("started", node)) or "new")
    monkeypatch.setattr(reduce_task, "_read_through", read_through)
    monkeypatch.setattr(reduce_task, "lost_with_node", waited_for_the_table)
    monkeypatch.setattr(reduce_task, "node_alive", lambda node: node_alive)
    meta = dataclasses.make_dataclass("Meta", ["node_id", "id"])("node-a", "seg-1")
    if node_alive:
        assert reduce_task.fetch_from_node(meta, "ns") == b"the segment"
        assert events == [("read", "dead"), ("started", "node-a"), ("read", "new")]
    else:
        with pytest.raises(SegmentLostWithNodeError, match="node node-a: the node died"):
            reduce_task.fetch_from_node(meta, "ns")
        assert events == [("read", "dead")]


@pytest.mark.parametrize("returned", [None, "a DataFrame", "a RecordBatch"])
def test_a_custom_finalize_that_returns_no_table_is_named(monkeypatch, tmp_path, returned):
    """Was: a custom ``Partitioner.finalize`` without its ``return`` (or returning a pandas
    DataFrame) failed the shuffle with a bare "AttributeError: 'NoneType' object has no
    attribute 'num_rows'"; its ``assign`` was already checked by the maps."""
    from hybrid_ray import ConfigError, HashPartitioner
    from hybrid_ray import reduce_task

    table = pa.table({"k": [1, 2, 3]})
    monkeypatch.setattr(reduce_task, "read_subpartition", lambda *args, **kwargs: [table])

    class Forgetful(HashPartitioner):
        def finalize(self, t, subpartition):
            if returned == "a DataFrame":
                return t.to_pandas()
            if returned == "a RecordBatch":
                return t.to_batches()[0]
            return None

    with pytest.raises(ConfigError, match=r"Forgetful.finalize returned \w+ for subpartition "
                                          r"2: it must return the partition as a "
                                          r"pyarrow.Table"):
        reduce_task.reduce_partition("shf-1", 2, table.schema, Forgetful(["k"]),
                                     base_config(tmp_path), master=None)
    # The default (and any finalize returning a table) passes through unchanged.
    out, stats, _ = reduce_task.reduce_partition("shf-1", 2, table.schema,
                                                 HashPartitioner(["k"]),
                                                 base_config(tmp_path), master=None)
    assert out.equals(table) and stats[0] == 3
