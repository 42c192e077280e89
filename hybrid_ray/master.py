"""Shuffle master (FLIP-31): the registry of shuffles, map attempts and committed segments.

``ShuffleRegistry`` is plain Python; ``actors.ShuffleMasterActor`` wraps it as one named actor
per Ray namespace. It decides which map attempt's segments count (exactly once: the first
attempt to finish wins; a newer attempt supersedes an unfinished older one, whose segments
are deleted), tells readers what is available, and releases shuffles: on request (the driver, when its
reducers are done), or when the driver stops heartbeating for ``orphan_ttl_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import threading
import time
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from hybrid_ray.config import ShuffleConfig, TierName, require_config
from hybrid_ray.errors import (
    ConfigError, ShuffleNotFoundError, ShuffleReleasedError, ShuffleStateError,
)
from hybrid_ray.ids import check_id
from hybrid_ray.redaction import Redactor
from hybrid_ray.segment import SegmentMeta


@dataclasses.dataclass
class MapState:
    current_attempt: int = -1
    finished_attempt: int | None = None
    pid: int = 0
    node_id: str = ""
    started: float = 0.0
    finished: float = 0.0
    # attempt -> subpartition -> segments in commit order: index order, except where a
    # remote upload committed after a later local segment (readers restore the order)
    segments: dict[int, dict[int, list[SegmentMeta]]] = dataclasses.field(default_factory=dict)
    stats: Any = None
    # Open shuffles (Spark's executors): attempts that finished writing, awaiting the
    # driver's choice at seal: attempt -> (finish time, stats).
    done_attempts: dict[int, tuple[float, Any]] = dataclasses.field(default_factory=dict)
    # Sealed shuffles: rows per subpartition each unfinished attempt committed (those of
    # freed subpartitions included), and those of the attempt that finished first. A map
    # run again after its output was lost must write the same (``_check_rerun``).
    rows_written: dict[int, collections.Counter[int]] = dataclasses.field(
        default_factory=dict)
    finished_rows: dict[int, int] | None = None
    # And which input rows went to each subpartition (``row_digests`` of ``finish_map``) in
    # that attempt; None: not sent (equal counts are then all that is checked).
    finished_digests: dict[int, int] | None = None
    # Sealed shuffles: segments of freed subpartitions (read, and deleted) of an attempt
    # dropped after it was lost, kept for the books alone: its re-run's segments of those
    # subpartitions are not kept, so without these the report lost their bytes.
    freed_segments: dict[int, list[SegmentMeta]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ReaderState:
    """The readers of one subpartition (usually one; a speculative or second Spark job's
    reduce task makes two). ``done``: one of them was told it has everything. It sticks:
    that reader keeps those rows whatever a later reader of the subpartition is told."""

    pid: int = 0
    delivered: int = 0
    first_delivery: float | None = None
    done: bool = False


@dataclasses.dataclass
class ShuffleState:
    shuffle_id: str
    num_maps: int
    num_subpartitions: int
    config: ShuffleConfig
    created: float
    last_heartbeat: float
    maps: list[MapState]
    readers: dict[int, ReaderState] = dataclasses.field(default_factory=dict)
    nodes: set[str] = dataclasses.field(default_factory=set)
    # Subpartitions whose data was deleted because their reducer's output is stored.
    freed: set[int] = dataclasses.field(default_factory=set)
    superseded_attempts: int = 0
    # False while the number of maps is still open (Spark decides it when the job runs):
    # begin_map may then add maps, and readers never see the shuffle as complete.
    sealed: bool = True
    # True if a driver re-runs maps whose finished output was lost (``report_lost``).
    recoverable: bool = False
    # Finished maps whose output was lost, waiting for the driver to re-run them.
    lost: set[int] = dataclasses.field(default_factory=set)
    lost_maps_rerun: int = 0
    # Spark shuffles written by the JVM shuffle manager (``hybrid_ray.spark_jvm``): Spark's
    # map attempt id (task attempt id) -> (map index, this registry's attempt number).
    spark_attempts: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # Spark map attempts whose last commit arrived (even if their output was lost since):
    # a reader waits only for the others (``spark_jvm.missing_blocks``).
    spark_finished: set[int] = dataclasses.field(default_factory=set)
    # Spark map attempts aborted after committing: a commit of theirs arriving later (the
    # master is threaded, so a last commit and the abort sent after it can run in either
    # order) is deleted instead of published (``spark_jvm.commit``).
    spark_aborted: set[int] = dataclasses.field(default_factory=set)
    # Spark map attempt id -> the executor that wrote it (``spark_jvm.executor_lost``).
    spark_executors: dict[int, str] = dataclasses.field(default_factory=dict)
    # What the shuffle's report must say about how it ran other than its config asked
    # (``spark_jvm.unknown_session_note``).
    notes: list[str] = dataclasses.field(default_factory=list)
    # The Ray job of the driver process that registered the shuffle (None: registered
    # from a worker or the JVM). A dead job's driver heartbeats no more: see ``expire``.
    driver_job: str | None = None

    @property
    def all_maps_finished(self) -> bool:
        return self.sealed and all(m.finished_attempt is not None for m in self.maps)


class MapUpdate(typing.NamedTuple):
    """What is new for a reader of one map: segments of ``attempt`` after the reader's
    cursor; ``reset``: drop what was read of this map before (a new attempt)."""

    map_index: int
    attempt: int
    reset: bool
    segments: list[SegmentMeta]


@dataclasses.dataclass(frozen=True)
class PollResult:
    """New segments for a reader, per map; ``done`` when the subpartition is complete."""

    updates: list[MapUpdate]
    done: bool
    # Seconds the master held the poll waiting for news (a long poll): the reader's
    # waiting time, not control-plane time.
    waited_s: float = 0.0


# Deletes the data of segments (callback to the tier managers / remote tier).
Deleter = Callable[[ShuffleState, Sequence[SegmentMeta]], None]
Releaser = Callable[[ShuffleState], None]

# A released shuffle's remote tree is removed once more this long after its release: a
# writer killed after its upload landed (its abort, which removes what it re-created after
# a release, never ran) or an upload still in flight then (bounded by the store's call
# deadline) left objects that nothing else removes. Local disks have the tier managers'
# late-files sweep for the same.
LATE_REMOTE_SWEEP_S = 120.0


# The most map partitions an open (Spark) shuffle takes: its map count grows to the highest
# index a writer begins, so one wild index (2,000,000) took 4 s and 1 GiB in the master, and
# every later poll of the namespace a tenth of a second.
MAX_OPEN_MAPS = 1 << 20


# A long poll answers before its deadline once new segments of 1/POLL_BATCH_DIVISOR of the
# shuffle's maps arrived (``ShuffleRegistry.poll_batch``).
POLL_BATCH_DIVISOR = 4

# Backoff between attempts to delete data whose deletion failed (storage down, node busy).
DELETE_RETRY_MIN_S, DELETE_RETRY_MAX_S = 1.0, 300.0


@dataclasses.dataclass
class PendingDeletion:
    """Data to delete: ``metas`` of ``state``'s shuffle, or (``metas`` None) all of it."""

    state: ShuffleState
    metas: tuple[SegmentMeta, ...] | None
    attempts: int = 0
    last_error: str = ""
    not_before: float = 0.0
    # Set when its first attempt ran, whatever came of it (a release waits for it, bounded).
    tried: threading.Event = dataclasses.field(default_factory=threading.Event,
                                               compare=False, repr=False)
    # A second removal of a released shuffle's remote tree (``LATE_REMOTE_SWEEP_S``).
    late_sweep: bool = False

    @property
    def what(self) -> str:
        if self.late_sweep:
            return f"late writes to the remote tier of shuffle {self.state.shuffle_id}"
        return (f"shuffle {self.state.shuffle_id}" if self.metas is None else
                f"{len(self.metas)} segment(s) of shuffle {self.state.shuffle_id}")


class ShuffleRegistry:
    """All shuffles of a namespace. ``delete_segments`` and ``release_data`` perform the I/O
    of deleting, so this class is testable without a cluster."""

    def __init__(self, delete_segments: Deleter, release_data: Releaser,
                 clock: Callable[[], float] = time.monotonic, delete_inline: bool = True,
                 sweep_remote: Releaser | None = None,
                 late_sweep_s: float = LATE_REMOTE_SWEEP_S) -> None:
        """``delete_inline``: run queued deletions at the end of each call that queued one
        (plain use and tests). The master actor passes False and runs ``run_deletions``
        itself, outside its lock, so slow or failing storage never blocks the books.

        ``clock``: monotonic, as orphan expiry compares heartbeat ages with it: on the wall
        clock, a VM resumed from a pause (or a clock stepped forward) expired every shuffle
        at the next check, before any driver could beat, deleting data in use.

        ``sweep_remote``: removes a released shuffle's remote tree again, ``late_sweep_s``
        after its release succeeded, for shuffles with a remote tier (see
        ``LATE_REMOTE_SWEEP_S``); None: no second removal."""
        self._shuffles: dict[str, ShuffleState] = {}
        self._delete_segments_io = delete_segments
        self._release_data_io = release_data
        self._clock = clock
        self._delete_inline = delete_inline
        self._sweep_remote_io = sweep_remote
        self._late_sweep_s = late_sweep_s
        # Deletions not done yet: queued by state changes, run by ``run_deletions``,
        # retried with backoff until the data is gone (a shuffle is forgotten by the books
        # at release, but its deletion stays here until it succeeded).
        self.pending: collections.deque[PendingDeletion] = collections.deque()
        # Late sweeps of released shuffles' remote trees, in the order they come due (kept
        # apart from ``pending``: a call that queues nothing must not wake the deletion
        # runner for them; it finds them due on its periodic round).
        self.late_sweeps: collections.deque[PendingDeletion] = collections.deque()
        # Every deletion taken out of ``pending`` and running now (outside the caller's
        # lock): listed by ``pending_deletions``, so a release that outlasted the caller's
        # wait (a tier manager removing 80,000 files on a loaded node) is not reported as
        # done; a release's shuffle id is not free for a new registration until it is.
        self._running: list[PendingDeletion] = []
        self.deletion_failures = 0
        self.released: collections.deque[str] = collections.deque(maxlen=1000)
        # Why a recently released shuffle was released, if its driver said, and whether it
        # failed (a failed map stage): readers still running then fail with that reason.
        self.release_reasons: dict[str, tuple[str, bool]] = {}
        # Spark map attempts aborted before their shuffle was known here, by shuffle (see
        # ``spark_jvm.abort``): applied when it is registered.
        self.spark_early_aborts: collections.OrderedDict[str, set[int]] = \
            collections.OrderedDict()
        # Spark executors removed, by (application prefix, executor id): the highest map
        # attempt id launched there (``spark_jvm.executor_lost``); a later commit of one of
        # those attempts is dropped.
        self.spark_lost_executors: collections.OrderedDict[tuple[str, str], int] = \
            collections.OrderedDict()

    def _get(self, shuffle_id: str) -> ShuffleState:
        try:
            return self._shuffles[shuffle_id]
        except KeyError:
            reason, failed = self.release_reasons.get(shuffle_id, ("", False))
            if failed:
                raise ShuffleReleasedError(
                    f"shuffle {shuffle_id!r} failed and was released: {reason}") from None
            if reason or shuffle_id in self.released:
                hint = (f" because {reason}" if reason else
                        ": its data is gone; re-run the shuffle")
                raise ShuffleReleasedError(
                    f"unknown shuffle {shuffle_id!r} (it was released{hint})") from None
            raise ShuffleNotFoundError(f"unknown shuffle {shuffle_id!r}") from None

    # ---- lifecycle --------------------------------------------------------------------------
    def register(self, shuffle_id: str, num_maps: int | None, num_subpartitions: int,
                 config: ShuffleConfig, recoverable: bool = False,
                 maps_begun_on: Sequence[str] | None = None,
                 driver_job: str | None = None) -> None:
        """Register a shuffle. ``num_maps=None`` leaves the map count open until ``seal``.
        ``recoverable``: the driver re-runs maps whose finished output is lost (it polls
        ``take_lost``); otherwise such a loss fails the readers.

        ``maps_begun_on``: the nodes of the writers that will run the maps. Every map's
        attempt 0 then begins here, so a map's first run starts writing without a
        ``begin_map`` call of its own (one round trip per map, a quarter of the master's
        calls); a map run again (a retry, a lost map) still calls ``begin_map``.

        ``driver_job``: the Ray job id of the driver process registering it: once Ray
        counts that job dead, ``expire`` releases the shuffle without waiting out
        ``orphan_ttl_s``."""
        check_id("shuffle_id", shuffle_id)  # it names directories on every tier
        # Checked here, not when ``expire`` first reads it: a dict taken as the config made
        # every later registration and expiry of the namespace fail.
        require_config(f"registering shuffle {shuffle_id!r}", config)
        if shuffle_id in self._shuffles:
            raise ShuffleStateError(f"shuffle {shuffle_id!r} is already registered")
        if any(d.metas is None and not d.late_sweep and d.state.shuffle_id == shuffle_id
               for d in (*self.pending, *self._running)):
            # Its release is still being retried (storage down): the retry would delete the
            # new shuffle's data on its nodes and in the remote tier.
            raise ShuffleStateError(f"shuffle {shuffle_id!r} was released and its data is "
                                    "still being deleted; register the shuffle under a new id")
        if maps_begun_on is not None and num_maps is None:
            raise ShuffleStateError("maps can begin at registration only with a map count")
        for name, count in (("num_maps", num_maps), ("num_subpartitions", num_subpartitions)):
            if count is not None and (isinstance(count, bool)
                                      or not isinstance(count, numbers.Integral) or count < 0):
                raise ShuffleStateError(f"{name} of shuffle {shuffle_id!r} must be an integer "
                                        f">= 0, got {count!r}")
        now = self._clock()
        maps = [MapState() for _ in range(num_maps or 0)]
        state = ShuffleState(shuffle_id, num_maps or 0, num_subpartitions, config, now, now,
                             maps, sealed=num_maps is not None, recoverable=recoverable,
                             driver_job=driver_job)
        if maps_begun_on is not None:
            for m in maps:
                m.current_attempt, m.started = 0, now
                m.segments[0] = collections.defaultdict(list)
            # The writers' nodes are told at release even if no map commits there (a
            # writer that failed after its first reservation registered it on its node).
            state.nodes.update(maps_begun_on)
        self._shuffles[shuffle_id] = state

    def seal(self, shuffle_id: str, num_maps: int,
             attempts: Mapping[int, int] | None = None) -> None:
        """Fix the map count of an open shuffle once its map stage ran, keeping for each map
        the attempt whose task succeeded (``attempts``: map -> attempt, as Spark reports
        it; None: the one attempt that finished). Every map in ``[0, num_maps)`` must have
        that attempt finished and no other map may have written. The other attempts'
        segments are deleted."""
        state = self._get(shuffle_id)
        if state.sealed:
            # Sealing again cut every map of a sealed shuffle (its maps have no finished
            # attempts left to choose from) and reported it complete without rows.
            raise ShuffleStateError(f"shuffle {shuffle_id!r} is sealed already (at "
                                    f"{state.num_maps} maps)")
        if isinstance(num_maps, bool) or not isinstance(num_maps, numbers.Integral) \
                or num_maps < 0:
            # (A negative count sliced maps off the end of the list below.)
            raise ShuffleStateError(f"cannot seal shuffle {shuffle_id!r} at {num_maps!r} maps: "
                                    "the map count must be an integer >= 0")
        extra = [i for i, m in enumerate(state.maps[num_maps:], num_maps) if m.current_attempt >= 0]
        chosen: dict[int, int] = {}
        missing, ambiguous = [], []
        for i in range(num_maps):
            done = state.maps[i].done_attempts if i < len(state.maps) else {}
            if attempts is None and len(done) > 1:
                ambiguous.append(i)
                continue
            pick = attempts.get(i) if attempts is not None else next(iter(done), None)
            if pick in done:
                chosen[i] = pick
            else:
                missing.append(i if attempts is None else f"{i} (attempt {pick})")
        if extra or missing or ambiguous:
            raise ShuffleStateError(f"cannot seal shuffle {shuffle_id!r} at {num_maps} maps: maps "
                             f"{missing} did not finish, maps {extra} are beyond the count"
                             + (f", maps {ambiguous} finished more than one attempt (name "
                                "the one that counts)" if ambiguous else ""))
        del state.maps[num_maps:]
        for i, pick in chosen.items():
            m = state.maps[i]
            for attempt in [a for a in m.segments if a != pick]:
                self._drop_attempt(state, m, attempt)
                state.superseded_attempts += 1
            m.current_attempt = m.finished_attempt = pick
            m.finished, m.stats = m.done_attempts[pick]
            m.done_attempts = {}
        state.num_maps, state.sealed = num_maps, True

    def heartbeat(self, shuffle_id: str) -> None:
        self._get(shuffle_id).last_heartbeat = self._clock()

    def begin_map(self, shuffle_id: str, map_index: int, node_id: str, pid: int = 0) -> int | None:
        """Start an attempt of a map partition; None if the partition is already finished.

        Ray retries a task only after its attempt died, so an unfinished older attempt is dead:
        its segments are deleted and readers that followed it start over on the new attempt.
        """
        state = self._get(shuffle_id)
        if not state.sealed and isinstance(map_index, numbers.Integral) \
                and map_index >= MAX_OPEN_MAPS:
            raise ShuffleStateError(f"map index {map_index!r} of shuffle {shuffle_id!r} is "
                                    f"beyond the {MAX_OPEN_MAPS} map partitions a shuffle "
                                    "takes: use fewer, larger map partitions")
        if map_index >= len(state.maps) and not state.sealed:
            state.maps.extend(MapState() for _ in range(map_index + 1 - len(state.maps)))
            state.num_maps = len(state.maps)
        m = self._map(state, map_index)
        if not state.sealed:
            # Open shuffle (Spark's executors): attempts of a task may run side by side
            # (speculation), and an attempt may finish writing and still fail its Spark
            # task (an upstream error can end its input cleanly, at a message boundary).
            # So every attempt writes all its rows, none is dropped here, and ``seal``
            # keeps the attempt whose task Spark reports as succeeded.
            m.current_attempt += 1
            m.segments[m.current_attempt] = collections.defaultdict(list)
            m.pid, m.node_id, m.started = pid, node_id, self._clock()
            state.nodes.add(node_id)
            return m.current_attempt
        if m.finished_attempt is not None:
            return None
        if m.current_attempt >= 0:
            self._drop_attempt(state, m, m.current_attempt)
            state.superseded_attempts += 1
        state.lost.discard(map_index)  # its re-run has begun (see take_lost)
        m.current_attempt += 1
        m.segments[m.current_attempt] = collections.defaultdict(list)
        m.pid, m.node_id, m.started = pid, node_id, self._clock()
        state.nodes.add(node_id)
        return m.current_attempt

    def commit(self, shuffle_id: str, map_index: int, attempt: int,
               metas: Sequence[SegmentMeta], pid: int = 0) -> bool:
        """Publish finished segments of an attempt; False (and deleted) if it was superseded.
        ``pid``: the writer's process, recorded for progress (a map begun at registration
        names its writer first here)."""
        state = self._get(shuffle_id)
        m = self._map(state, map_index)
        self._check_attempt(state, map_index, m, attempt)
        for meta in metas:
            self._check_subpartition(state, meta.id.subpartition)
            self._check_owner(state, map_index, attempt, meta)
        live = (attempt in m.segments and attempt not in m.done_attempts) if not state.sealed \
            else (attempt == m.current_attempt and m.finished_attempt is None)
        if not live:
            self._delete_segments(state, metas)
            return False
        if pid and attempt == m.current_attempt and metas:
            m.pid, m.node_id = pid, metas[0].node_id
        subs = m.segments[attempt]
        if state.sealed:
            rows = m.rows_written.setdefault(attempt, collections.Counter())
            for meta in metas:
                rows[meta.id.subpartition] += meta.num_rows
        # A re-run map (see report_lost) writes every subpartition again, including those
        # whose reducer already stored its output: those segments are not needed.
        unneeded = [meta for meta in metas if meta.id.subpartition in state.freed]
        if unneeded:
            self._delete_segments(state, unneeded)
        for meta in metas:
            if meta.id.subpartition not in state.freed:
                subs[meta.id.subpartition].append(meta)
            state.nodes.add(meta.node_id)
        return True

    def finish_map(self, shuffle_id: str, map_index: int, attempt: int, stats: Any = None,
                   last_segments: Sequence[SegmentMeta] = (), pid: int = 0,
                   row_digests: Mapping[int, int] | None = None) -> bool:
        """Mark an attempt complete, after committing its ``last_segments`` (one call for
        a map's final commit and its finish: a map's calls to the master are a large share
        of the control plane). The first attempt to finish wins (in an open shuffle, the
        attempt named at ``seal``). False: the attempt does not count (its last segments
        are then deleted like any refused commit's).

        ``row_digests``: subpartition -> a digest of which of the map's input rows the
        attempt sent there (``map_task.row_digests``), checked against a re-run's."""
        if last_segments and not self.commit(shuffle_id, map_index, attempt, last_segments,
                                             pid):
            return False
        state = self._get(shuffle_id)
        m = self._map(state, map_index)
        self._check_attempt(state, map_index, m, attempt)
        if not state.sealed:  # open shuffle: seal chooses among the finished attempts
            if attempt not in m.segments or attempt in m.done_attempts:
                return False
            m.done_attempts[attempt] = (self._clock(), stats)
            return True
        if m.finished_attempt is not None or attempt != m.current_attempt:
            return False
        self._check_rerun(state, map_index, m, attempt, row_digests)
        m.finished_attempt, m.finished, m.stats = attempt, self._clock(), stats
        return True

    def _check_rerun(self, state: ShuffleState, map_index: int, m: MapState,
                     attempt: int, row_digests: Mapping[int, int] | None = None) -> None:
        """Record the rows per subpartition of a map's finished attempt (their count and,
        if sent, a digest of which input rows they are); refuse a later one (a re-run
        after its output was lost) that wrote others to a subpartition whose reducer
        finished meanwhile. That reducer kept the earlier attempt's rows and the re-run's
        rows for it are dropped (``commit``), so a re-run that partitions differently
        loses or duplicates rows: a partitioner whose ``assign`` is not a pure function of
        its input (unseeded randomness, wall-clock time, a counter kept across calls).
        Counts alone missed a balanced one (an unseeded permutation dealt round-robin
        sends each subpartition as many rows every run, but others). Where no reducer
        finished, readers drop what they read of the lost attempt and read the re-run
        instead: exact whatever the partitioner did."""
        written = {sub: n for sub, n in m.rows_written.pop(attempt, {}).items() if n}
        digests = {sub: d for sub, d in (row_digests or {}).items() if d}
        before, m.finished_rows = m.finished_rows, written
        before_digests = m.finished_digests
        m.finished_digests = digests if row_digests is not None else None
        if before is None:
            return
        # Kept: freed, or its reader was told it has everything (its poll answered done:
        # it polls no more, so it never hears of the re-run, and its free may still be on
        # the way; checking the freed ones alone let such a re-run through).
        kept = state.freed | {sub for sub, reader in state.readers.items() if reader.done}
        compare_digests = before_digests is not None and row_digests is not None
        differ = sorted(sub for sub in kept if written.get(sub, 0) != before.get(sub, 0)
                        or compare_digests
                        and digests.get(sub, 0) != before_digests.get(sub, 0))
        if differ:
            m.finished_rows, m.finished_digests = before, before_digests
            examples = ", ".join(
                f"subpartition {sub}: {before.get(sub, 0)} rows then, {written.get(sub, 0)} "
                "now" + (" but other rows" if written.get(sub, 0) == before.get(sub, 0)
                         else "") for sub in differ[:3])
            raise ConfigError(
                f"map {map_index} of shuffle {state.shuffle_id} was run again after its "
                f"output was lost and partitioned its rows differently ({examples}), where "
                "reducers had already stored the first run's rows: the partitioner is not "
                "deterministic, or the map's input changed between the runs (a block rebuilt "
                "by a task that is not deterministic), and the shuffle's output would lose or "
                "duplicate rows. Make Partitioner.assign a pure function of the rows and the "
                "map index (seed any randomness from them, as RandomPartitioner does), and "
                "the tasks that make the shuffle's input deterministic")

    def report_lost(self, shuffle_id: str, map_index: int, attempt: int) -> bool:
        """A reader found a segment of ``attempt`` gone: its memory-tier objects died with
        the process that owned them. Returns True if the reader should wait for the map's
        next attempt (readers then get a reset), False if no attempt will come.

        An unfinished attempt is being retried already (its producer died with the
        objects). A finished one is invalidated and queued for the driver (``take_lost``)
        if the shuffle is recoverable.
        """
        state = self._get(shuffle_id)
        m = self._map(state, map_index)
        if attempt != m.current_attempt:
            return True
        if m.finished_attempt is None:
            return True
        if not state.recoverable:
            return False
        m.finished_attempt = None
        state.lost.add(map_index)
        state.lost_maps_rerun += 1
        return True

    def now(self) -> float:
        """The registry's clock (monotonic seconds): what its timestamps are read against."""
        return self._clock()

    def take_lost(self, shuffle_id: str) -> list[int]:
        """Maps the driver must run again: each is returned until an attempt of it begins
        (``begin_map``). Handed out once, a map whose answer was lost (a call that timed
        out in the driver) was never run again, and its readers waited out the stall
        bound; the driver drops a map it is running already (``MapRunner._requeue``)."""
        return sorted(self._get(shuffle_id).lost)

    # ---- the read side -------------------------------------------------------------------------
    def poll(self, shuffle_id: str, subpartition: int,
             cursors: dict[int, tuple[int, int]], pid: int = 0,
             record: bool = True) -> PollResult:
        """Segments of ``subpartition`` a reader has not seen, given its per-map cursors
        ``{map: (attempt, next_index)}``. A reset tells it to drop what it read of that map.
        ``record=False``: only look (a long poll deciding whether to answer yet); the
        delivery is not counted."""
        state = self._get(shuffle_id)
        # Else a reader of a subpartition the shuffle does not have was told "done" with
        # no rows: an empty partition instead of an error naming the bad index.
        self._check_subpartition(state, subpartition)
        if subpartition in state.freed:
            # Its reducer's output was stored and its data deleted: a second reader (a
            # reducer Ray re-executed after it returned) found no object references,
            # reported every map lost and waited out the stall bound for re-runs whose
            # rows for a freed subpartition are dropped.
            raise ShuffleStateError(
                f"subpartition {subpartition} of shuffle {shuffle_id} was read to the end "
                "and its data freed (free_subpartitions): it cannot be read again. Keep "
                "the first reducer's output (a freed subpartition must never be "
                "recomputed)")
        reader = state.readers.setdefault(subpartition, ReaderState())
        reader.pid = pid or reader.pid
        updates: list[MapUpdate] = []
        complete = True
        for map_index, m in enumerate(state.maps):
            attempt = m.current_attempt
            if attempt < 0:
                complete = False
                continue
            # (An open shuffle's current attempt may have been dropped, drop_attempt: it
            # has no segments, and the poll raised KeyError. Its number is not reused, so
            # a late commit of it stays refused; seal resets readers to the chosen one.)
            segs = m.segments.get(attempt, {}).get(subpartition, [])
            seen_attempt, next_index = cursors.get(map_index, (attempt, 0))
            reset = seen_attempt != attempt
            start = 0 if reset else next_index
            if reset or start < len(segs):
                updates.append(MapUpdate(map_index, attempt, reset, segs[start:]))
            if m.finished_attempt is None:
                complete = False
        complete = complete and state.sealed
        if record and any(u.segments for u in updates):
            reader.delivered += sum(len(u.segments) for u in updates)
            if reader.first_delivery is None:
                reader.first_delivery = self._clock()
        # Never cleared: a second reader's poll (Spark's speculative copy of the reduce
        # task) that is not complete does not undo what the first was told, which
        # _check_rerun relies on (cleared, a re-run moving rows was accepted: 8 of 10).
        reader.done = reader.done or (complete and record)
        return PollResult(updates, complete)

    def poll_batch(self, shuffle_id: str) -> int:
        """New segments worth answering a long poll for before its deadline: a quarter of
        the maps' worth (at least 1). A reader that started with the maps was otherwise
        answered at every commit: about 30 polls per reader at 17 maps, each a round trip
        through the master (profiled: its CPU is per call, not per segment)."""
        state = self._shuffles.get(shuffle_id)
        return max(1, len(state.maps) // POLL_BATCH_DIVISOR) if state is not None else 1

    def free_subpartitions(self, shuffle_id: str, subpartitions: Sequence[int]) -> int:
        """Delete the data of subpartitions whose output is safely stored elsewhere
        (finished Ray Data reducers' blocks), keeping their metadata for the report: one
        deletion for all of them (one call per node).

        Why: without it every segment lived until the whole shuffle was released, so the
        object store held input, memory tier and output at once, and a 4 GiB shuffle made
        Ray spill. Never call it while the subpartition may be read again (the Spark
        bridge's reduce stage is recomputable and does not). Returns the segments freed.
        """
        state = self._shuffles.get(shuffle_id)
        if state is None:
            return 0
        for sub in subpartitions:  # all checked before any is freed
            self._check_subpartition(state, sub)
        fresh = set(subpartitions) - state.freed
        if not fresh:
            return 0
        state.freed |= fresh
        metas = [meta for m in state.maps for subs in m.segments.values()
                 for sub in sorted(fresh) for meta in subs.get(sub, [])]
        self._delete_segments(state, metas)
        for meta in metas:
            if meta.object_ref:
                meta.object_ref.clear()  # the master's reference: the object can go
        return len(metas)

    # ---- release --------------------------------------------------------------------------------
    def release(self, shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
        """Delete all data of a shuffle on every node and the remote tier. ``reason`` is
        what its readers are told afterwards; with ``failed`` (e.g. its map stage failed)
        they get ``ShuffleFailedError`` instead of ``ShuffleNotFoundError``."""
        state = self._shuffles.pop(shuffle_id, None)
        if state is None:
            return False
        if len(self.released) == self.released.maxlen:
            self.release_reasons.pop(self.released[0], None)
        self.released.append(shuffle_id)
        if reason or failed:
            self.release_reasons[shuffle_id] = (reason, failed)
        # The master's references to memory-tier objects go now, whatever the storage does.
        for m in state.maps:
            for subs in m.segments.values():
                for metas in subs.values():
                    for meta in metas:
                        if meta.object_ref:
                            meta.object_ref.clear()
        self._queue(PendingDeletion(state, None))
        return True

    def driver_jobs(self) -> set[str]:
        """The Ray jobs of the drivers that registered the shuffles in the books (see
        ``register``): those whose death ``expire`` needs to hear of."""
        return {s.driver_job for s in self._shuffles.values() if s.driver_job}

    def expire(self, dead_jobs: Collection[str] = ()) -> list[str]:
        """Release shuffles whose driver stopped heartbeating more than ``orphan_ttl_s`` ago,
        and those registered by a driver whose Ray job is in ``dead_jobs``: it exited or
        was killed and will never beat again. Its hybrid reducers, on the namespace's
        shared readers, waited for its maps until the TTL (6 h by default), and every
        other driver's reducers queued behind them, until their shuffles failed as
        stalled; its memory quota and segments stayed taken as long."""
        now = self._clock()
        ended = [s for s in self._shuffles.values() if s.driver_job in dead_jobs]
        for state in ended:
            self.release(state.shuffle_id,
                         f"its driver's Ray job {state.driver_job} ended (the driver exited "
                         "or was killed) before it released the shuffle, so its data was "
                         "deleted")
        expired = [s for s in self._shuffles.values()
                   if now - s.last_heartbeat > s.config.orphan_ttl_s]
        for state in expired:
            # The reason its driver, writers and readers are told at their next call: without
            # it a driver that was paused (GC, a suspended VM) past the TTL, or whose
            # heartbeats could not reach the master, read only "released".
            self.release(state.shuffle_id,
                         f"its driver sent no heartbeat for {now - state.last_heartbeat:.0f} s, "
                         f"more than orphan_ttl_s={state.config.orphan_ttl_s:g} (the driver "
                         "died, hung or was paused), so it was expired and its data deleted")
        return [state.shuffle_id for state in ended + expired]

    def drop_attempt(self, shuffle_id: str, map_index: int, attempt: int) -> None:
        """Delete one attempt of a map of an open shuffle (a Spark map attempt that failed
        after committing some segments); the map's other attempts stay."""
        state = self._get(shuffle_id)
        m = self._map(state, map_index)
        m.done_attempts.pop(attempt, None)
        self._drop_attempt(state, m, attempt)
        state.superseded_attempts += 1

    @staticmethod
    def _map(state: ShuffleState, map_index: int) -> MapState:
        """Map ``map_index`` of ``state``, or a ShuffleStateError naming the bad index
        (indexed as is, a negative one addressed another map: a loss reported for map -2
        of two maps re-ran map 0)."""
        if not 0 <= map_index < len(state.maps):
            raise ShuffleStateError(f"map index {map_index!r} is outside [0, "
                                    f"{len(state.maps)}) of shuffle {state.shuffle_id!r}")
        return state.maps[map_index]

    @staticmethod
    def _check_attempt(state: ShuffleState, map_index: int, m: MapState, attempt: int) -> None:
        """A ShuffleStateError unless ``attempt`` is one ``begin_map`` handed out for the
        map (current or earlier): finishing attempt -1 of a map never begun marked it
        finished with no attempt to read, and its readers waited until the stall bound."""
        if isinstance(attempt, bool) or not isinstance(attempt, numbers.Integral) \
                or not 0 <= attempt <= m.current_attempt:
            raise ShuffleStateError(
                f"attempt {attempt!r} of map {map_index} of shuffle {state.shuffle_id!r} was "
                f"never begun (begun: 0..{m.current_attempt}); call begin_map first")

    @staticmethod
    def _check_owner(state: ShuffleState, map_index: int, attempt: int,
                     meta: SegmentMeta) -> None:
        """A ShuffleStateError unless ``meta`` names the shuffle, map and attempt it is
        committed under: one filed under another map was served as that map's rows (read
        twice), and one of another shuffle was deleted with this one's attempt."""
        sid = meta.id
        if (sid.shuffle_id, sid.map_partition, sid.attempt) != (state.shuffle_id, map_index,
                                                                  attempt):
            raise ShuffleStateError(
                f"segment {sid.shuffle_id}/m{sid.map_partition}/a{sid.attempt} committed as "
                f"map {map_index} attempt {attempt} of shuffle {state.shuffle_id!r}: a writer "
                "commits only the segments it wrote under the attempt begin_map gave it")

    @staticmethod
    def _check_subpartition(state: ShuffleState, subpartition: int) -> None:
        """A ShuffleStateError unless ``subpartition`` is one of the shuffle's: a segment
        of another is read by nobody (its rows lost), a reader of one reads no rows."""
        if not 0 <= subpartition < state.num_subpartitions:
            raise ShuffleStateError(
                f"subpartition {subpartition!r} is outside [0, {state.num_subpartitions}) "
                f"of shuffle {state.shuffle_id!r}")

    def _drop_attempt(self, state: ShuffleState, m: MapState, attempt: int) -> None:
        m.rows_written.pop(attempt, None)
        # Freed subpartitions' segments are deleted already (their metadata stays).
        segments = m.segments.pop(attempt, {})
        dropped = [meta for sub, metas in segments.items()
                   if sub not in state.freed for meta in metas]
        if dropped:
            self._delete_segments(state, dropped)
        if state.sealed:
            # In a sealed shuffle only the attempt that finished has segments of freed
            # subpartitions (they are freed once every map finished; a re-run's are not
            # kept): what their readers read, still counted in the report.
            for sub, metas in segments.items():
                if sub in state.freed and metas:
                    m.freed_segments.setdefault(sub, list(metas))

    # ---- deletion: queued by state changes, performed and retried apart from them -----------
    def _delete_segments(self, state: ShuffleState, metas: Sequence[SegmentMeta]) -> None:
        if metas:
            # The master's references to memory-tier objects go now: tier managers free
            # by id and size, and readers hold their own. Kept until the deletion
            # succeeded, one retried for long (a tier manager down, a file that cannot be
            # unlinked) pinned the objects, also past the shuffle's release.
            for meta in metas:
                if meta.object_ref:
                    meta.object_ref.clear()
            self._queue(PendingDeletion(state, tuple(metas)))

    def _queue(self, deletion: PendingDeletion) -> None:
        self.pending.append(deletion)
        if self._delete_inline:
            self.run_deletions()

    def run_deletions(self) -> list[PendingDeletion]:
        """Perform the queued deletions that are due; a failed one stays queued and is
        retried with exponential backoff (``DELETE_RETRY_MIN_S`` .. ``DELETE_RETRY_MAX_S``)
        until the data is gone. Returns the deletions that failed this time."""
        failed, problem = [], None
        for deletion in self.take_due_deletions():
            error = self.perform_deletion(deletion)
            try:
                self.deletion_done(deletion, error)
            except Exception as exc:  # noqa: BLE001 - raised once the others are recorded
                # (raised at once, the deletions after it stayed listed as running for good,
                # never run; this one is queued again by deletion_done)
                problem = problem if problem is not None else exc
            if error is not None:
                failed.append(deletion)
        if problem is not None:
            raise problem
        return failed

    def take_due_deletions(self) -> list[PendingDeletion]:
        """Remove and return the queued deletions due now (a caller holding a lock performs
        them outside it, then reports each with ``deletion_done``)."""
        now = self._clock()
        due = [d for d in self.pending if d.not_before <= now]
        self.pending = collections.deque(d for d in self.pending if d.not_before > now)
        while self.late_sweeps and self.late_sweeps[0].not_before <= now:
            due.append(self.late_sweeps.popleft())
        self._running.extend(due)
        return due

    def perform_deletion(self, deletion: PendingDeletion) -> Exception | None:
        """Run one deletion's I/O; returns its error instead of raising it."""
        try:
            if deletion.late_sweep:
                # Never the tree of a shuffle registered again under the same id.
                if self._sweep_remote_io is not None \
                        and deletion.state.shuffle_id not in self._shuffles:
                    self._sweep_remote_io(deletion.state)
            elif deletion.metas is None:
                self._release_data_io(deletion.state)
            else:
                self._delete_segments_io(deletion.state, deletion.metas)
        except Exception as exc:  # storage errors of any kind: reported, retried later
            return exc
        return None

    def deletion_done(self, deletion: PendingDeletion, error: Exception | None) -> None:
        """Record a deletion's outcome: on ``error`` it is queued again with backoff. A
        release that succeeded queues its remote tree's late sweep.

        A failed deletion is queued again before anything here can raise (its error put
        in words: a ``str()`` that raises, the ``Redactor``; the clock): raised after it
        was taken off ``_running`` and before it was queued, it was dropped, and its data
        stayed for good. Raising after, it is retried (due at once if the backoff was not
        set) and the caller reports the error."""
        deletion.tried.set()
        self._running = [d for d in self._running if d is not deletion]
        if error is None:
            if deletion.metas is None and not deletion.late_sweep \
                    and self._sweep_remote_io is not None \
                    and deletion.state.config.remote_path:
                self.late_sweeps.append(PendingDeletion(
                    deletion.state, None, late_sweep=True,
                    not_before=self._clock() + self._late_sweep_s))
            return
        deletion.attempts += 1
        self.deletion_failures += 1
        deletion.last_error = type(error).__name__  # until its text is scrubbed, below
        self.pending.append(deletion)
        deletion.not_before = self._clock() + min(
            DELETE_RETRY_MIN_S * 2 ** (deletion.attempts - 1), DELETE_RETRY_MAX_S)
        # Shown by status: a storage library's error may quote the credentials it was given.
        config = deletion.state.config
        deletion.last_error = Redactor(config.remote_path, config.storage_options).scrub(
            f"{type(error).__name__}: {error}")

    def pending_deletions(self) -> list[dict[str, Any]]:
        """Deletions not done yet, with their last error (for status and tests): those
        running now (``running``: True; they were missing, so a release still deleting
        files read as done) and those queued. A late sweep waiting for its time is not
        listed (nothing is known to be left); one that failed is, queued again like any
        failed deletion."""
        return [{"shuffle_id": d.state.shuffle_id, "what": d.what, "attempts": d.attempts,
                 "last_error": d.last_error, "running": running}
                for running, deletions in ((True, self._running), (False, self.pending))
                for d in deletions]

    def deletions_left(self, prefix: str) -> int:
        """How many deletions (running or queued) of shuffles whose id starts with
        ``prefix`` are not done: what a session's stop waits for."""
        return sum(1 for d in (*self._running, *self.pending)
                   if d.state.shuffle_id.startswith(prefix))

    def scrub_secrets(self, text: Any) -> str:
        """``str(text)`` without the credentials of any shuffle in the books or waiting for
        its deletion: for errors whose shuffle is unknown (the background loop's)."""
        states = list(self._shuffles.values()) + [d.state for d in self.pending]
        out = str(text)
        for remote_path, options in {(s.config.remote_path, repr(s.config.storage_options)):
                                     (s.config.remote_path, s.config.storage_options)
                                     for s in states}.values():
            out = Redactor(remote_path, options).scrub(out)
        return out

    # ---- introspection --------------------------------------------------------------------------
    def shuffle_ids(self) -> list[str]:
        return list(self._shuffles)

    def live_shuffles(self) -> dict[str, str]:
        """Shuffle id -> job id of every registered shuffle: what cleanup must keep."""
        return {s.shuffle_id: s.config.job_id for s in self._shuffles.values()}

    def state(self, shuffle_id: str) -> ShuffleState:
        return self._get(shuffle_id)

    def segments(self, shuffle_id: str) -> list[SegmentMeta]:
        """Committed segments of the winning (or current) attempt of every map."""
        state = self._get(shuffle_id)
        out = []
        for m in state.maps:
            attempt = m.finished_attempt if m.finished_attempt is not None else m.current_attempt
            for metas in m.segments.get(attempt, {}).values():
                out.extend(metas)
        return out

    def memory_segments_on(self, node_id: str
                           ) -> list[tuple[str, ShuffleConfig, list[SegmentMeta]]]:
        """Per registered shuffle: (id, config, its memory-tier segments on ``node_id`` that
        are still held: every attempt's, those of freed subpartitions excepted), without
        their object refs. What a tier manager started again on the node takes into its
        books (``TierManager.adopt_memory_segments``): the objects outlive the tier manager
        that granted their space (their writers own them)."""
        out = []
        for shuffle_id, state in self._shuffles.items():
            metas = [meta.without_object_ref() for m in state.maps
                     for subs in m.segments.values()
                     for sub, segs in subs.items() if sub not in state.freed
                     for meta in segs
                     if meta.tier == TierName.MEMORY and meta.node_id == node_id]
            if metas:
                out.append((shuffle_id, state.config, metas))
        return out

    def summary(self, shuffle_id: str) -> "ShuffleSummary":
        """What the shuffle stored (bytes and segments per node and tier of the attempts
        that count: a freed subpartition's segments still count) and how its maps went."""
        state = self._get(shuffle_id)
        per_node_tier: dict[str, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
        counted = self.segments(shuffle_id) + [
            meta for m in state.maps for sub, metas in m.freed_segments.items()
            for meta in metas]
        for meta in counted:
            nbytes, count = per_node_tier[meta.node_id].get(meta.tier.value, (0, 0))
            per_node_tier[meta.node_id][meta.tier.value] = (nbytes + meta.nbytes, count + 1)
        # Maps whose finished attempt counts: a lost one (``report_lost``) keeps the time
        # its lost attempt finished, and gave a last finish while its re-run still ran.
        finishes = [m.finished for m in state.maps if m.finished_attempt is not None] \
            if state.sealed else []
        deliveries = [r.first_delivery for r in state.readers.values() if r.first_delivery]
        return ShuffleSummary(
            shuffle_id=shuffle_id,
            num_maps=state.num_maps,
            num_subpartitions=state.num_subpartitions,
            maps_finished=sum(m.finished_attempt is not None for m in state.maps),
            per_node_tier=dict(per_node_tier),
            map_stats=[m.stats for m in state.maps],
            superseded_attempts=state.superseded_attempts,
            lost_maps_rerun=state.lost_maps_rerun,
            first_delivery=min(deliveries) if deliveries else None,
            # (No maps, e.g. a DataFrame of zero partitions: none finished last.)
            last_map_finish=max(finishes) if finishes and len(finishes) == state.num_maps
            else None,
            age_s=self._clock() - state.created,
            mode=state.config.mode.value,
        )


@dataclasses.dataclass(frozen=True)
class ShuffleSummary:
    """The master's books of one shuffle, from which its driver builds the report
    (``lifecycle.report_from_summary``) and ``hybrid-ray status`` its lines."""

    shuffle_id: str
    num_maps: int
    num_subpartitions: int
    maps_finished: int
    # node id -> tier name -> (bytes, segments)
    per_node_tier: dict[str, dict[str, tuple[int, int]]]
    # Per map, the write statistics its counted attempt sent with finish_map (None: none).
    map_stats: list[Any]
    superseded_attempts: int
    lost_maps_rerun: int
    # When a reader first got a segment and when the last map finished (the master's
    # clock; None: not yet): a first delivery before the last finish is hybrid overlap.
    first_delivery: float | None
    last_map_finish: float | None
    age_s: float
    mode: str

    def for_status(self) -> dict[str, Any]:
        """The summary as plain values for ``hybrid-ray status`` (without the maps'
        write statistics)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "map_stats"}


def metas_by_node(metas: Sequence[SegmentMeta]) -> dict[str, list[SegmentMeta]]:
    out: dict[str, list[SegmentMeta]] = collections.defaultdict(list)
    for meta in metas:
        if meta.tier != TierName.REMOTE:
            out[meta.node_id].append(meta)
    return out
