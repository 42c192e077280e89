"""The reduce task: one subpartition read from every map, in map order.

Runs in a reader actor (``run_shuffle``) or a Spark executor's Python worker (the bridge's
reduce stage). The reader long-polls the shuffle master for new segments, reads each from
whichever tier holds it (memory objects on any node, disk files of its own node directly
and of other nodes through their tier manager, the remote store), and follows map attempts:
a superseded or re-run map's rows read so far are dropped and the new attempt is read
instead, so the result is exact.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import ray

from hybrid_ray.actors import (
    DATA_CALL_TIMEOUT_S, MASTER_CALL_TIMEOUT_S, answer_of, existing_tier_manager,
    get_tier_manager,
)
from hybrid_ray.clients import ReadClient
from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.errors import ConfigError, SegmentLostWithNodeError, SegmentNotFoundError
from hybrid_ray.io_tiers import io_tiers_for
from hybrid_ray.map_task import with_extension_types
from hybrid_ray.nodes import WORKER_LOST_ERRORS, lost_with_node, node_alive
from hybrid_ray.partitioning import Partitioner
from hybrid_ray.report import ReduceTimes, Stopwatch
from hybrid_ray.master import MapUpdate
from hybrid_ray.segment import SegmentMeta

# A reader's long poll waits at most this long in the master for new segments (then it
# asks again); a reader waiting for a map attempt to restart checks every POLL_RETRY_S.
POLL_WAIT_S, POLL_RETRY_S = 1.0, 0.25
# How long a reader waits for the new attempt of a map whose segment it found gone while
# a re-run is coming (the attempt was superseded, is being retried, or its memory-tier
# segments died with their writer and the driver re-runs it: see read_subpartition). A
# re-run map may queue behind running maps for a free writer: past this wait, a reader
# whose map the master still counts unfinished waits on, up to the config's
# ``stall_timeout_s``. read_subpartition's ``missing_wait_s`` overrides it. A disk or
# remote segment of a finished map that is gone is lost for good and fails at once.
MISSING_SEGMENT_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class _Missing:
    """A segment found gone whose map will run again: the reader waits for its new attempt
    (the master then resets the reader's cursor for that map)."""

    meta: SegmentMeta
    error: SegmentNotFoundError


def read_subpartition(shuffle_id: str, subpartition: int, config: ShuffleConfig,
                      master: Any, missing_wait_s: float = MISSING_SEGMENT_WAIT_S,
                      times: ReduceTimes | None = None) -> list[pa.Table]:
    """All rows of one subpartition, in map order (and within a map in the order its
    segments were written), once every map has finished.

    Follows the maps while they write (hybrid): polls the master for new segments and reads
    each from whichever tier holds it. If a map attempt is superseded, what was read of it is
    dropped and the new attempt is read instead, so the result is exact. A memory-tier
    segment that died with its owner is reported to the master, which has the map re-run
    (or, if nobody can re-run it, the read fails). A disk or remote segment of a finished
    map that is gone was removed by someone else (a cleanup, a tmp cleaner, a user): no
    attempt will bring it back, so the read fails at once with ``SegmentNotFoundError``
    naming the segment and its path. Waits for a coming attempt end after
    ``missing_wait_s`` with the same error.

    ``times``, if given, is added the seconds this read slept waiting for segments not
    committed yet and spent in calls to the master (see ``report.PhaseTimes``).
    """
    node_id = ray.get_runtime_context().get_node_id()
    times = times if times is not None else ReduceTimes()
    control, waiting = Stopwatch(), Stopwatch()


    reader = ReadClient(io_tiers_for(config, node_id), node_id,
                        functools.partial(fetch_from_node, namespace=config.namespace),
                        functools.partial(start_fetch_from_node, namespace=config.namespace))
    cursors: dict[int, tuple[int, int]] = {}
    # Per map, (segment index, rows): the master lists a map's segments in commit order,
    # which is not their index order when some went to the remote tier (an upload is
    # committed when it finishes, a local segment written after it at once). Rows are put
    # back in index order at the end, so a map's rows keep their order (a seeded
    # random_shuffle gives the same result every run).
    per_map: dict[int, list[tuple[int, pa.Table]]] = collections.defaultdict(list)

    def read_updates(updates: list[MapUpdate]) -> _Missing | None:
        """Read the poll's new segments in order; the segment found gone whose map runs
        again, if one was."""
        for map_index, attempt, reset, _ in updates:
            if reset:
                per_map[map_index] = []
                cursors[map_index] = (attempt, 0)
        # One pass over every new segment, so remote ones are fetched ahead across maps.
        todo = [(map_index, attempt, meta)
                for map_index, attempt, _, metas in updates for meta in metas]
        tables = reader.read_in_order([meta for _, _, meta in todo], config.remote_transfers)
        for map_index, attempt, meta in todo:
            try:
                per_map[map_index].append((meta.id.index, next(tables)))
            except SegmentNotFoundError as exc:
                # Memory segments die with their owner, any local segment with its node:
                # the master has such a map run again (if anyone can). A disk or remote
                # segment of a finished map on a live node is lost for good.
                if meta.tier == TierName.MEMORY or isinstance(exc, SegmentLostWithNodeError):
                    with control:
                        rerun = answer_of(master.report_lost.remote(
                            shuffle_id, map_index, attempt),
                            f"the shuffle master's report_lost for map {map_index}")
                    if not rerun:
                        raise
                else:
                    with control:
                        finished = _finished_attempt(master, shuffle_id, map_index)
                    if finished == attempt:
                        raise _segment_lost(meta, exc, subpartition) from exc
                return _Missing(meta, exc)
            _, nxt = cursors.get(map_index, (attempt, 0))
            cursors[map_index] = (attempt, nxt + 1)
        return None

    # A segment that vanished while its map was being retried (the dead attempt's data is
    # deleted) is expected: wait for the master to reset that map to the new attempt.
    # Still missing after missing_wait_s without a reset is real loss: fail loudly. The
    # clock is per (map, attempt): maps lost together (one writer's) are found one after
    # the other, each once the one before is back, and sharing one window failed
    # shuffles that were recovering. Each map's wait is bounded, and so is their number.
    missing_since: float | None = None
    missing_key: tuple[int, int] | None = None
    # Past missing_wait_s, a map the master still counts unfinished (its re-run has not
    # begun: it may queue behind long maps for a free writer) is waited for up to the
    # shuffle's stall bound, asked once per (map, attempt): _awaiting_rerun.
    rerun_checked: dict[tuple[int, int], bool] = {}
    while True:
        # A long poll: the master answers at once if something is new, else holds the
        # call until a commit (or POLL_WAIT_S) instead of this reader sleeping and asking.
        with control:
            result = answer_of(master.poll.remote(shuffle_id, subpartition, cursors,
                                                  os.getpid(), POLL_WAIT_S),
                               f"the shuffle master's poll for subpartition {subpartition}",
                               POLL_WAIT_S + MASTER_CALL_TIMEOUT_S)
        control.seconds -= result.waited_s
        waiting.seconds += result.waited_s
        missing = read_updates(result.updates)
        if missing is not None:
            now = time.monotonic()
            key = (missing.meta.id.map_partition, missing.meta.id.attempt)
            if missing_since is None or key != missing_key:
                missing_since, missing_key = now, key
            if now - missing_since > missing_wait_s and not (
                    now - missing_since <= config.stall_timeout_s
                    and _awaiting_rerun(master, shuffle_id, missing, rerun_checked)):
                # Say how long it really waited and which setting bounded it: past
                # missing_wait_s a map the master still counted unfinished was waited for
                # up to stall_timeout_s, and the message quoted missing_wait_s.
                held = rerun_checked.get(key, False)
                bound = (f"the master still counted the map unfinished but its re-run did "
                         f"not start within stall_timeout_s={config.stall_timeout_s:g} s; "
                         "raise it if maps queue that long for a writer") if held else \
                    f"no re-run was under way after {missing_wait_s:g} s"
                raise SegmentNotFoundError(
                    f"subpartition {subpartition} of {shuffle_id}: {missing.meta.id} is gone "
                    f"from the {missing.meta.tier.value} tier "
                    f"({missing.meta.location or 'object store'}) and no new attempt of map "
                    f"{missing.meta.id.map_partition} started in the "
                    f"{now - missing_since:.0f} s this reader waited ({bound}; "
                    f"{missing.error})") from missing.error
            with waiting:
                time.sleep(POLL_RETRY_S)
            continue
        missing_since = missing_key = None
        # Complete, and every segment of the answer read: nothing more can come (asking
        # again cost every reader one more round trip through the master).
        if result.done:
            break
    times.waiting += waiting.seconds
    times.control_plane += control.seconds
    return [table for m in sorted(per_map)
            for _, table in sorted(per_map[m], key=lambda indexed: indexed[0])]


def _awaiting_rerun(master: Any, shuffle_id: str, missing: _Missing,
                    checked: dict[tuple[int, int], bool]) -> bool:
    """Whether the master still counts the map of a missing segment unfinished at the
    attempt the reader last saw (a re-run is coming: the driver's own stall bound fails
    the shuffle if none does). Asked once per (map, attempt), remembered in ``checked``."""
    key = (missing.meta.id.map_partition, missing.meta.id.attempt)
    if key not in checked:
        progress = answer_of(master.progress.remote(shuffle_id),
                             f"the shuffle master's progress of {shuffle_id}")
        state = progress["maps"][key[0]]
        checked[key] = state["finished"] is None and state["attempt"] <= key[1]
    return checked[key]


def _finished_attempt(master: Any, shuffle_id: str, map_index: int) -> int | None:
    """The attempt of a map the master counts as finished (None: no attempt finished, so
    one is still running or will be retried)."""
    progress = answer_of(master.progress.remote(shuffle_id),
                         f"the shuffle master's progress of {shuffle_id}")
    return progress["maps"][map_index]["finished"]


def _segment_lost(meta: Any, cause: Exception, subpartition: int) -> SegmentNotFoundError:
    """The error for a disk or remote segment of a finished map that is gone for good."""
    return SegmentNotFoundError(
        f"{meta.id} is gone from the {meta.tier.value} tier at {meta.location} (node "
        f"{meta.node_id or '?'}), though its map finished: it was removed by someone else "
        "while the shuffle ran (`hybrid-ray cleanup`, a tmp cleaner, a user's rm, a bucket "
        "lifecycle rule). No attempt will bring it back; subpartition "
        f"{subpartition} cannot be read. Keep spill dirs and remote_path out of other "
        f"cleaners' reach and re-run the shuffle. ({cause})")


def _read_through(tm: Any, meta: SegmentMeta) -> bytes:
    return _answer_of_read(tm.read_disk_segment.remote(meta), meta)


def _answer_of_read(ref: Any, meta: SegmentMeta) -> bytes:
    """The bytes of a tier manager's ``read_disk_segment`` call for ``meta``, bounded."""
    return answer_of(ref, f"node {meta.node_id}'s tier manager reading {meta.id}",
                     DATA_CALL_TIMEOUT_S)


def fetch_from_node(meta: SegmentMeta, namespace: str) -> bytes:
    """Disk segment ``meta`` of another node, served by that node's tier manager.

    ``SegmentLostWithNodeError`` if the node died (the caller reports the map lost). If
    the node is alive but its tier manager died (the memory monitor, a crash), the files
    are still there: a tier manager started again serves them (it serves the files of
    shuffle directories marked as ours, ``TierManager.serve_segment_file``). Once: a
    second death raises.

    After the first failure only a glance at Ray's node table decides (``node_alive``):
    a node it still counts alive gets a tier manager started again at once. Waiting there
    for the table to call the node dead (``lost_with_node``, up to ``NODE_DEATH_WAIT_S``)
    cost every read through a tier manager that died on a live node 15 s, the common
    case. A node that did die but is not marked yet costs no more than before: the tier
    manager pinned to it cannot start, and the second failure waits for the table."""
    # Never start a tier manager before the node is known alive: one pinned to a dead node
    # would never run.
    tm = existing_tier_manager(meta.node_id, namespace)
    for last_try in (False, True):
        try:
            if tm is None:
                raise ray.exceptions.ActorDiedError()
            return _read_through(tm, meta)
        except WORKER_LOST_ERRORS as exc:
            node_dead = lost_with_node(meta.node_id, exc) if last_try \
                else not node_alive(meta.node_id) \
                or isinstance(exc, ray.exceptions.ActorUnschedulableError)
            if node_dead:
                raise SegmentLostWithNodeError(
                    f"{meta.id} is gone from the disk tier of node {meta.node_id}: the "
                    "node died") from None
            if last_try:
                raise
        tm = get_tier_manager(meta.node_id, namespace)
    raise AssertionError("unreachable")  # the loop returns or raises


def start_fetch_from_node(meta: SegmentMeta, namespace: str) -> Callable[[], bytes]:
    """Start reading disk segment ``meta`` of another node through that node's tier
    manager; returns the call that waits for the bytes (a reader's read-ahead). The wait
    is bounded as ``fetch_from_node``'s; if the tier manager was gone or died meanwhile,
    it is ``fetch_from_node`` that then tells a dead node from a dead tier manager (and
    asks one started again)."""
    tm = existing_tier_manager(meta.node_id, namespace)
    ref = tm.read_disk_segment.remote(meta) if tm is not None else None

    def wait() -> bytes:
        if ref is not None:
            try:
                return _answer_of_read(ref, meta)
            except WORKER_LOST_ERRORS:
                pass  # below: the node's death, or a tier manager started again
        return fetch_from_node(meta, namespace)
    return wait


def reduce_partition(shuffle_id: str, subpartition: int, schema: pa.Schema,
                     partitioner: Partitioner, config: ShuffleConfig, master: Any
                     ) -> tuple[pa.Table, tuple[int, int, pa.Schema], ReduceTimes]:
    """One reducer (run by a reader ``ShuffleWorkerActor``): the finished partition, its
    (rows, bytes, schema), from which the driver builds the output Dataset's block
    metadata instead of running a task per block to learn it, and the reducer's waiting
    and control-plane seconds for the report. Three separate returns: the driver waits on
    the small ones without pulling the table to its node."""
    times = ReduceTimes()
    # Before any segment is decoded: a column of an extension type this process had not
    # registered decoded as its storage type (see with_extension_types).
    schema = with_extension_types(schema)
    tables = read_subpartition(shuffle_id, subpartition, config, master, times=times)
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = checked_finalize(partitioner, table, subpartition)
    return table, (table.num_rows, table.nbytes, table.schema), times


def checked_finalize(partitioner: Partitioner, table: pa.Table, subpartition: int
                     ) -> pa.Table:
    """``partitioner.finalize(table, subpartition)``, or a ``ConfigError`` naming the
    partitioner if it returned anything but a ``pyarrow.Table`` (as ``assign``'s labels
    are checked by the maps): a custom ``finalize`` without its ``return`` failed the
    shuffle with a bare "AttributeError: 'NoneType' object has no attribute 'num_rows'",
    and one returning a DataFrame the same way."""
    result = partitioner.finalize(table, subpartition)
    if not isinstance(result, pa.Table):
        raise ConfigError(
            f"{type(partitioner).__name__}.finalize returned {type(result).__name__} for "
            f"subpartition {subpartition}: it must return the partition as a pyarrow.Table "
            "(the table it was given, e.g. sorted; the default returns it unchanged)")
    return result

