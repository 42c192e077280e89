"""The life of one shuffle on its driver: register, run maps, keep alive, re-run lost maps,
seal, report, release.

``ShuffleLifecycle`` is that one object per shuffle. Every path that shuffles through
hybrid_ray's tiers drives its shuffle with it; they differ in where the maps come from and
in which attempt of a map counts (``AttemptPolicy``):

=====================================  ===========================  =======================
path                                   maps come from               attempt that counts
=====================================  ===========================  =======================
``shuffle.run_shuffle`` (Ray Data)     Ray blocks, on writer        first to finish
                                       actors (``MapRunner``)       (``FIRST_FINISH``)
``spark_bridge`` direct parquet scan   parquet pieces, on writer    first to finish
                                       actors (``MapRunner``)
``spark_bridge`` executor map stage    Spark tasks in the           the one Spark reports
                                       executors' Python workers    succeeded, at ``seal``
                                                                    (``CHOSEN_AT_SEAL``)
JVM shuffle manager                    Spark's JVM map writers      the ones Spark's
                                                                    ``MapOutputTracker``
                                                                    lists (``spark_jvm``)
=====================================  ===========================  =======================

The JVM shuffle manager's driver is a JVM (Spark's ``ShuffleManager`` lives there), so it
drives the same phases on the same ``ShuffleRegistry`` through the master's ``spark_*``
calls (``hybrid_ray.spark_jvm``) rather than through this class.

Heartbeats and the re-running of lost maps exist once, here: while a call runs its
shuffle, the caller's loop heartbeats (``heartbeat``) and its ``MapRunner`` takes lost
maps; a shuffle whose data outlives the call (the Spark bridge's, read by a lazy
DataFrame) is *held* (``hold``): a daemon thread heartbeats it and re-runs its lost maps
until it is released.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hybrid_ray import metrics
from hybrid_ray.actors import (
    MASTER_CALL_TIMEOUT_S, answer_of, driver_job_id, existing_tier_manager, get_master,
    pack_call,
)
from hybrid_ray.clients import WriteStats
from hybrid_ray.config import DRIVER_HEARTBEAT_S as HEARTBEAT_S
from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import (
    ConfigError, ShuffleFailedError, ShuffleMasterLostError, ShuffleNotFoundError,
    ShuffleReleasedError, ShuffleStalledError,
)
from hybrid_ray.master import ShuffleSummary
from hybrid_ray.nodes import (
    RESUBMITS_AFTER_WORKER_LOSS, WORKER_LOST_ERRORS, lost_with_node, node_alive,
    worker_process_lost,
)
from hybrid_ray.report import PhaseTimes, ShuffleReport, Stopwatch
from hybrid_ray.tiers.remote import open_remote_tier

# How often a held shuffle's thread asks the master for maps to run again (their output
# died with its writer); readers wait for the new attempt meanwhile.
RECOVERY_POLL_S = 1.0
# A running MapRunner asks the master for lost maps at most this often: asked on every
# wake-up of the driver's loop (each map or reducer that finished), it was a tenth of the
# master's calls in a 1 GiB shuffle. A lost map's readers wait for it anyway.
LOST_MAPS_POLL_S = 0.5
# While nothing is lost, the interval doubles up to this (a lost map is rare: each ask is a
# master call, and a 1 GiB shuffle asked five times for nothing).
LOST_MAPS_POLL_MAX_S = 4.0
# Subpartitions freed within this many seconds of the last free go to the master together
# (one call, one deletion per node): one call per reducer was a tenth of the master's calls.
FREE_BATCH_S = 0.25
# Maps a writer has in hand: the one it runs and the next, queued behind it, while more
# maps wait than there are writers. A writer handed its next map only when the driver saw
# the last one finish sat idle for that round trip (6-15 ms per map, about 4% of a 1 GiB
# map stage on 2 cores, from Ray's task timeline). The last maps are not queued: they go to
# whichever writer frees first, so no map waits behind another while a writer is idle.
MAP_QUEUE_DEPTH = 2
# Errors of held shuffles' background work (heartbeats, re-runs) kept for ``held_errors``.
HELD_ERRORS_KEPT = 100

_LOG = logging.getLogger(__name__)


class _WriterProgress:
    """When a map run last returned from each writer actor, over every shuffle this driver
    runs (thread-safe): a shuffle whose maps wait in a writer's queue behind another
    shuffle's is not stalled while that writer finishes those. Counting only its own maps,
    it failed after ``stall_timeout_s`` (and restarted the writers, losing the other
    shuffle's memory segments) while nothing was stuck. Keyed by actor id: a writer
    restarted by Ray keeps its id; the writers are a fixed set per namespace and node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[Any, float] = {}

    @staticmethod
    def _key(writer: Any) -> Any:
        return getattr(writer, "_actor_id", None) or id(writer)

    def record(self, writer: Any) -> None:
        with self._lock:
            self._at[self._key(writer)] = time.monotonic()

    def latest(self, writers: Sequence[Any]) -> float:
        """The last return from any of ``writers`` (monotonic; 0.0: none seen)."""
        with self._lock:
            return max((self._at.get(self._key(w), 0.0) for w in writers), default=0.0)


_WRITER_PROGRESS = _WriterProgress()


class AttemptPolicy(enum.Enum):
    """Which attempt of a map counts (see ``ShuffleRegistry``)."""

    # Maps run on hybrid_ray's writer actors; the map count is known at registration. The
    # first attempt to finish wins; a map whose finished output is lost runs again.
    FIRST_FINISH = "first_finish"
    # Maps run as an engine's tasks (Spark executors' Python workers), attempts side by
    # side (speculation, retries); the map count is known once the stage ran. The driver
    # seals the shuffle with the attempt of each map that the engine reports succeeded.
    CHOSEN_AT_SEAL = "chosen_at_seal"


def _unwrap_task_error(exc: BaseException) -> BaseException:
    """The error behind ``exc``: a task's error unwrapped from Ray's ``RayTaskError``s."""
    cause = exc
    while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None \
            and cause.cause is not cause:
        cause = cause.cause
    return cause


def describe_cause(exc: BaseException) -> str:
    """``Type: message`` of the error behind ``exc``: a task's error is unwrapped from
    Ray's ``RayTaskError``, whose text is the whole remote traceback (kept on the
    exception chain, not pasted into messages)."""
    cause = _unwrap_task_error(exc)
    text = str(cause).strip()
    if isinstance(cause, ray.exceptions.RayTaskError):
        text = text.splitlines()[-1] if text else text  # no cause object: its last line
    if isinstance(cause, ShuffleFailedError):
        return text  # already says what failed
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def error_kind(exc: BaseException) -> str:
    """The class name of the error behind a failed shuffle (a task's error unwrapped from
    Ray's ``RayTaskError``, as ``describe_cause`` does): the ``kind`` of the error metric."""
    return type(_unwrap_task_error(exc)).__name__


def report_from_summary(summary: ShuffleSummary, operation: str, config: ShuffleConfig,
                        wall: float, phases: PhaseTimes | None = None) -> ShuffleReport:
    """The report of a finished shuffle from the master's books. ``phases``: the driver's
    measurements, to which the writers' control-plane time (in the maps' stats) is added;
    None leaves the report without phases (not measured)."""
    stats = WriteStats()
    for s in summary.map_stats:
        if s is not None:
            stats.merge(s)
    first, last = summary.first_delivery, summary.last_map_finish
    return ShuffleReport(
        shuffle_id=summary.shuffle_id, operation=operation, mode=config.mode.value,
        spilling=config.spilling.value, num_maps=summary.num_maps,
        num_partitions=summary.num_subpartitions, rows=stats.rows,
        input_bytes=0, wall_time_s=wall,
        per_node_tier={node: dict(tiers) for node, tiers in summary.per_node_tier.items()},
        tier_switches=stats.tier_switches, spill_events=stats.spill_events,
        superseded_attempts=summary.superseded_attempts,
        lost_maps_rerun=summary.lost_maps_rerun,
        hybrid_overlap=bool(first is not None and last is not None and first < last),
        uncompressed_segments=stats.uncompressed_segments,
        phases=None if phases is None else dataclasses.replace(
            phases, control_plane=phases.control_plane + stats.control_plane_s),
    )


def report_without_books(shuffle_id: str, operation: str, config: ShuffleConfig,
                         num_maps: int, num_partitions: int, rows: int, wall: float,
                         phases: PhaseTimes | None, why: str) -> ShuffleReport:
    """The report of a shuffle whose output is complete but whose master died with its
    books as it ended (``ShuffleReport.books_lost``): only what the driver itself knows
    (its maps and partitions, the rows its reducers returned, the times it measured),
    with ``why`` as a note. The master's counts (bytes per tier and node, tier switches,
    spill events, retried attempts, overlap) are not known: left empty and 0, and marked
    so, never guessed. ``phases``' control-plane time lacks the writers' share (it came
    with the maps' stats, in the books)."""
    return ShuffleReport(
        shuffle_id=shuffle_id, operation=operation, mode=config.mode.value,
        spilling=config.spilling.value, num_maps=num_maps, num_partitions=num_partitions,
        rows=rows, input_bytes=0, wall_time_s=wall, per_node_tier={}, tier_switches=0,
        spill_events=0, superseded_attempts=0, hybrid_overlap=False, phases=phases,
        notes=(why,), books_lost=True)


class ShuffleLifecycle:
    """One shuffle on its driver, from registration to release (see the module docstring).

    Every call to the master goes through here and is timed into ``control`` (the
    driver's share of the report's control-plane time). Calls the driver does not wait for
    (heartbeats, freeing subpartitions) are checked later, never dropped: an error in one
    surfaces at the next heartbeat or at ``summary``.
    """

    def __init__(self, config: ShuffleConfig, num_partitions: int, operation: str, *,
                 policy: AttemptPolicy = AttemptPolicy.FIRST_FINISH, id_prefix: str = "shf",
                 master: Any = None, started: float | None = None) -> None:
        """``operation`` names the shuffle in reports and errors; ``id_prefix`` starts its
        id (``shf`` for Ray shuffles, ``spk`` for the Spark bridge's). ``started``: when
        the shuffle's work began (``time.perf_counter``; default now), the start of its
        report's wall time."""
        if not isinstance(policy, AttemptPolicy):
            raise ConfigError(f"policy must be a hybrid_ray.lifecycle.AttemptPolicy, got "
                              f"{policy!r}")
        self.config = config
        self.num_partitions = num_partitions
        self.operation = operation
        self.policy = policy
        self.shuffle_id = f"{id_prefix}-{uuid.uuid4().hex[:12]}"
        self.master = master if master is not None else get_master(config.namespace)
        self.control = Stopwatch()
        self.started = time.perf_counter() if started is None else started
        self.released = False
        self._last_beat = 0.0
        self._unchecked: list[ray.ObjectRef] = []  # calls not waited for, checked later
        self._frees: list[int] = []  # subpartitions to free, not sent yet
        self._frees_sent = 0.0  # when frees were last sent (monotonic)
        self._begun_maps: set[int] = set()  # see register
        # A held shuffle's thread heartbeats while the caller's thread may seal or report.
        self._unchecked_lock = threading.Lock()

    # ---- the phases, in order ------------------------------------------------------------
    def register(self, num_maps: int | None = None,
                 writer_nodes: Sequence[str] | None = None) -> None:
        """Register with the master: ``num_maps`` maps (``FIRST_FINISH``), or a map count
        left open until ``seal`` (``CHOSEN_AT_SEAL``, ``num_maps`` None).

        ``writer_nodes``: the nodes of the writer actors a ``MapRunner`` will run the maps
        on. Every map's attempt 0 then begins at registration (``take_begun_maps``): a
        map's first run makes no ``begin_map`` call."""
        if (num_maps is None) != (self.policy is AttemptPolicy.CHOSEN_AT_SEAL):
            raise ConfigError(
                f"a {self.policy.value} shuffle registers "
                + ("with its map count" if num_maps is None else
                   "without a map count (it is fixed at seal)"))
        begun = sorted(set(writer_nodes)) if writer_nodes is not None else None
        # The master releases it once this driver's Ray job ended (it exited or was
        # killed), rather than only after orphan_ttl_s (6 h by default).
        self._call(self.master.register, num_maps, self.num_partitions, self.config,
                   self.policy is AttemptPolicy.FIRST_FINISH, begun, driver_job_id())
        self._begun_maps = set(range(num_maps or 0)) if begun is not None else set()
        self._last_beat = time.monotonic()

    def take_begun_maps(self) -> set[int]:
        """The maps whose attempt 0 began at registration, handed out once: the first
        ``MapRunner`` runs them as attempt 0; any later run of a map begins its own."""
        begun, self._begun_maps = self._begun_maps, set()
        return begun

    def heartbeat(self, force: bool = False) -> None:
        """Tell the master this driver still holds the shuffle (it expires a silent one
        after ``orphan_ttl_s``), at most every ``HEARTBEAT_S`` unless ``force``. Not waited
        for; the previous beat's answer is checked here (a shuffle the master no longer
        knows raises ``ShuffleNotFoundError``)."""
        self._send_frees()
        now = time.monotonic()
        if not force and now - self._last_beat < HEARTBEAT_S:
            return
        self._check_unchecked(wait=False)
        with self.control:
            ref = self.master.heartbeat.remote(self.shuffle_id)
        with self._unchecked_lock:
            self._unchecked.append(ref)
        self._last_beat = now

    def take_lost(self) -> list[int]:
        """Maps whose finished output was lost, to run again (each returned once)."""
        return self._call(self.master.take_lost)

    def free_subpartition(self, subpartition: int) -> None:
        """A reducer's output is stored: its subpartition's segments can go. Sent with the
        others freed within ``FREE_BATCH_S`` (by this call, the next ``heartbeat`` or
        ``flush_frees``); not waited for, checked at the next heartbeat or at ``summary``.
        Frees still unsent at ``release`` are dropped: the release deletes everything."""
        with self._unchecked_lock:
            self._frees.append(subpartition)
        self._send_frees()

    def flush_frees(self) -> None:
        """Send every free held back now, in one call. For the last reducers of a shuffle:
        a batch held back then was deleted by the release instead, while the driver waited
        and the cores idled (40-55 ms of disk-tier unlinks at the end of a 2 s 1 GiB
        shuffle); sent at once, the deletions run beside the last reducers."""
        self._send_frees(now=True)

    def _send_frees(self, now: bool = False) -> None:
        if not self._frees or (not now and time.monotonic() - self._frees_sent < FREE_BATCH_S):
            return
        with self._unchecked_lock:
            subpartitions, self._frees = self._frees, []
        self._frees_sent = time.monotonic()
        with self.control:
            ref = self.master.free_subpartitions.remote(self.shuffle_id, subpartitions)
        with self._unchecked_lock:
            self._unchecked.append(ref)

    def seal(self, num_maps: int, attempts: Mapping[int, int]) -> None:
        """Fix the map count of a ``CHOSEN_AT_SEAL`` shuffle and the attempt of each map
        that counts (map -> attempt, as the engine reports its succeeded tasks)."""
        if self.policy is not AttemptPolicy.CHOSEN_AT_SEAL:
            raise ConfigError(f"a {self.policy.value} shuffle is sealed at registration")
        self._call(self.master.seal, num_maps, dict(attempts))

    def summary(self) -> ShuffleSummary:
        """The master's books of the shuffle (after every call not waited for landed)."""
        self._check_unchecked(wait=True)
        return self._call(self.master.summary)

    def report(self, wall: float | None = None, phases: PhaseTimes | None = None,
               input_bytes: int = 0, map_input: str = "") -> ShuffleReport:
        """The shuffle's report: ``wall`` seconds (default: since this object was made),
        the driver's ``phases`` if measured. Records it in the metrics."""
        wall = time.perf_counter() - self.started if wall is None else wall
        report = report_from_summary(self.summary(), self.operation, self.config, wall,
                                     phases)
        report.input_bytes = input_bytes
        report.map_input = map_input
        metrics.record_shuffle(report)
        return report

    def release(self, reason: str = "", failed: bool = False) -> bool:
        """Delete the shuffle's data on every node and the remote tier; readers still
        running are told ``reason`` (with ``failed``, as a ``ShuffleFailedError``).
        Returns whether the master knew the shuffle. Releasing twice is a no-op."""
        if not self._mark_released():
            return False
        return bool(self._call(self.master.release, reason, failed))

    def _mark_released(self) -> bool:
        """Stop holding the shuffle and drop the frees not sent (the release covers
        them); False if it was released already."""
        _held.unhold(self.shuffle_id)
        if self.released:
            return False
        self.released = True
        with self._unchecked_lock:
            self._frees = []
        return True

    def summarize_and_release(self) -> ShuffleSummary:
        """The end of a shuffle that succeeded: the master's books of it, taken as its
        data is released, in one call (``summary`` then ``release`` cost the driver two
        round trips while the cores idled). The calls not waited for (frees, heartbeats)
        are checked after it, so one that failed still raises here.

        A master that died (killed, OOM, its node lost) raises ``ShuffleMasterLostError``:
        the books went with it, the shuffle's data stays where it is (see
        ``release_without_master``). The caller decides: a shuffle whose output is complete
        (``run_shuffle``, every reducer's block returned) is not failed by it."""
        if not self._mark_released():
            raise ShuffleFailedError(f"shuffle {self.shuffle_id} was released already: "
                                     "its books went with it")
        try:
            summary = self._call(self.master.summarize_and_release)
        except ray.exceptions.ActorDiedError as exc:
            if isinstance(exc, ray.exceptions.RayTaskError):
                raise  # the master's own call failed on a dead actor: the master is alive
            raise ShuffleMasterLostError(
                f"the shuffle master of namespace {self.config.namespace!r} died as shuffle "
                f"{self.shuffle_id} was released (its node died or it was killed), and its "
                "books of the shuffle with it") from exc
        # The master runs calls on several threads, in no fixed order: a heartbeat or the
        # last frees (``flush_frees``), sent just before, may run after this release and be
        # told the shuffle was released. That is this release, not a failure: a shuffle
        # that succeeded was reported failed.
        self._check_unchecked(wait=True, released_here=True)
        return summary

    def release_without_master(self, nodes: Sequence[str]) -> list[str]:
        """Remove the data of a shuffle whose master died before releasing it (see
        ``summarize_and_release``): the tier managers of ``nodes`` (where its maps ran)
        release it, as the master's release does, and the driver removes its remote tree.
        Returns what could not be removed, each a line for the caller's report; waits at
        most ``MASTER_CALL_TIMEOUT_S`` for the nodes and as long for the remote tier.

        Only this shuffle's own directories go (by its id; the remote tree only below a
        marker of ours). Left alone, the tier managers' orphan sweeps (``sweep_orphans``)
        release it on the nodes a minute or two later, but nothing but ``hybrid-ray
        cleanup`` removes its remote tree. A tier manager whose removal fails retries it
        in its own sweep; whatever is left keeps its marker for ``hybrid-ray cleanup``."""
        problems: list[str] = []
        waits: dict[ray.ObjectRef, str] = {}
        for node in sorted(set(nodes)):
            tm = existing_tier_manager(node, self.config.namespace)
            if tm is not None:  # none: nothing of the shuffle is accounted there
                waits[tm.release_shuffle.remote(self.shuffle_id, self.config)] = node
        if waits:
            ready, late = ray.wait(list(waits), num_returns=len(waits),
                                   timeout=MASTER_CALL_TIMEOUT_S)
            problems += [f"node {waits[ref]}: no answer within {MASTER_CALL_TIMEOUT_S:.0f} s"
                         for ref in late]
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    if node_alive(waits[ref]):  # else its data went with the node
                        problems.append(f"node {waits[ref]}: {describe_cause(exc)}")
                except Exception as exc:  # noqa: BLE001 - reported; its sweep retries it
                    problems.append(f"node {waits[ref]}: {describe_cause(exc)}")
        # After the nodes answered, as the master's release does (``_release_data``).
        if self.config.remote_path:
            tier = None
            try:
                tier = open_remote_tier(self.config)
                tier.outcome(tier.io_pool().submit(tier.remove_shuffle_data, self.shuffle_id),
                             f"removing shuffle {self.shuffle_id} from the remote tier",
                             bound_s=MASTER_CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - reported; hybrid-ray cleanup removes it
                problems.append(f"its remote tree: {describe_cause(exc)}")
            finally:
                if tier is not None:
                    tier.close()
        return problems

    def fail(self, exc: BaseException) -> BaseException:
        """The shuffle failed with ``exc``: release its data (never masking ``exc``) and
        return the error to raise, translated at this phase boundary: the cause first in
        the message, Ray's remote traceback on ``__cause__`` rather than pasted in.

        - a user's stop (``KeyboardInterrupt``) is returned as is;
        - a gone master becomes ``ShuffleMasterLostError``;
        - a bad input (a map's ``ConfigError``) stays a ``ConfigError``, without the
          remote traceback around it;
        - everything else becomes ``ShuffleFailedError`` naming the cause.
        """
        if not isinstance(exc, KeyboardInterrupt):  # a user's stop is not a failure
            metrics.record_error(error_kind(exc))
        # A deletion that fails stays queued at the master, which retries it until the
        # data is gone; tasks still running fail at their next commit or poll.
        master_alive = self._release_after_failure()
        if isinstance(exc, KeyboardInterrupt):
            return exc
        what = f"{self.operation} shuffle {self.shuffle_id}"
        if not master_alive:
            error: BaseException = ShuffleMasterLostError(
                f"{what} failed: the shuffle master of namespace {self.config.namespace!r} "
                "is gone (its node died or it was killed), and with it the books of every "
                "shuffle in flight; run it again")
            error.__cause__ = exc
            return error
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        if isinstance(cause, ConfigError):
            error = ConfigError(f"{what} failed and its data was removed: {cause}")
            error.__cause__, error.__suppress_context__ = None, True
            return error
        if isinstance(exc, ShuffleFailedError) and not isinstance(
                exc, ray.exceptions.RayTaskError):
            return exc
        error = ShuffleFailedError(
            f"{what} failed: {describe_cause(exc)} (its data was removed; the remote "
            "traceback is on this error's __cause__)")
        error.__cause__ = exc
        return error

    def hold(self, rerun: Callable[[list[int]], Any] | None = None) -> None:
        """Keep the shuffle after the call that made it returns: a daemon thread
        heartbeats it and, given ``rerun``, runs maps whose output was lost with
        ``rerun(maps)`` until ``release``. A failed re-run releases the shuffle, telling
        its readers why. A released shuffle is not held again (a map stage that ends
        just after the user released its shuffle)."""
        if not self.released:
            _held.hold(self, rerun)

    # ---- helpers ---------------------------------------------------------------------------
    def _call(self, method: Any, *args: Any) -> Any:
        """A call to the master about this shuffle, waited for (bounded: a master that
        never answers raises ``ShuffleStalledError`` naming the call) and timed."""
        with self.control:
            return answer_of(method.remote(self.shuffle_id, *args),
                             f"the shuffle master's {getattr(method, '_method_name', 'call')} of "
                             f"{self.shuffle_id}")

    def _check_unchecked(self, wait: bool, released_here: bool = False) -> None:
        """Raise the error of a call not waited for, if one failed (``wait``: wait,
        bounded, for all of them; else look only at those already answered).
        ``released_here``: this driver's own release succeeded, so a call refused because
        the shuffle was released ran after it and is no error."""
        with self._unchecked_lock:
            pending = list(self._unchecked)
        if not pending:
            return
        if wait:
            with self.control:
                ready, _ = ray.wait(pending, num_returns=len(pending),
                                    timeout=MASTER_CALL_TIMEOUT_S, fetch_local=True)
        else:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0,
                                fetch_local=True)
        done = set(ready)
        with self._unchecked_lock:
            self._unchecked = [r for r in self._unchecked if r not in done]
        # Of the calls waited for: one sent meanwhile (a held shuffle's thread beats) was not.
        unanswered = len(pending) - len(ready)
        if wait and unanswered:
            # Frees and heartbeats only: the release deletes whatever a free did not.
            _LOG.warning("%d call(s) of shuffle %s to the shuffle master (frees, heartbeats) "
                         "got no answer within %.0f s; going on (the release deletes what "
                         "they did not)", unanswered, self.shuffle_id, MASTER_CALL_TIMEOUT_S)
        for ref in ready:
            try:
                ray.get(ref, timeout=MASTER_CALL_TIMEOUT_S)
            except ShuffleReleasedError:
                if not released_here:
                    raise
            except ray.exceptions.RayActorError as exc:
                # The master died after this driver's release answered (with the books):
                # the release covered what a lost free or heartbeat would have done.
                if not released_here or isinstance(exc, ray.exceptions.RayTaskError):
                    raise

    def _release_after_failure(self) -> bool:
        """Release a failed shuffle; returns False if the master is gone (nothing to
        release: its books went with it; ``hybrid-ray cleanup`` removes the data left
        behind)."""
        _held.unhold(self.shuffle_id)
        self.released = True
        try:
            ray.get(self.master.release.remote(self.shuffle_id, "its driver's shuffle failed",
                                               True), timeout=MASTER_CALL_TIMEOUT_S)
            return True
        except ray.exceptions.RayActorError:
            return False
        except Exception:  # noqa: BLE001 - the shuffle's own error is what the caller needs
            return True


# ---- maps on the writer actors ------------------------------------------------------------
class MapRunner:
    """Runs the maps of one ``FIRST_FINISH`` shuffle on the writer actors: each writer
    runs one map at a time and has the next queued behind it (``MAP_QUEUE_DEPTH``) while
    more maps wait than there are writers.

    A free writer takes the next map whose input is on its node, else the next map (so a
    node with idle writers helps with the others' inputs). Maps reported lost
    (``ShuffleRegistry.report_lost``) go to the front of the queue: readers wait for them.
    """

    def __init__(self, lifecycle: ShuffleLifecycle, writers: list[tuple[str, Any]],
                 inputs: Sequence[Any], map_fn: Callable[..., Any], map_args: tuple,
                 input_nodes: Sequence[str | None] | None = None,
                 maps: Sequence[int] | None = None) -> None:
        """Runs ``map_fn(shuffle_id, map_index, inputs[map_index], *map_args,
        attempt=...)`` for every input (or the inputs ``maps``) on ``writers`` ((node,
        actor) pairs); ``input_nodes[i]`` is the node holding input i (None: anywhere).
        ``attempt`` is 0 for a map's first run if it began at registration
        (``ShuffleLifecycle.register``), else None: the map begins its own attempt."""
        self._lifecycle = lifecycle
        self._writers = writers
        self._inputs = inputs
        self._map_fn = map_fn
        self._args = map_args
        self._packed: ray.ObjectRef | None = None  # (map_fn, map_args), put once
        self._queue: collections.deque[int] = collections.deque(
            range(len(inputs)) if maps is None else maps)
        self._total = len(self._queue)
        # writer slot -> its maps in flight, (map, ref), in the order the writer runs them
        self._running: dict[int, list[tuple[int, ray.ObjectRef]]] = {}
        self._input_nodes = list(input_nodes) if input_nodes is not None \
            else [None] * len(inputs)
        self.results: dict[int, Any] = {}  # map index -> map_fn's result (last run)
        self.lost_nodes: set[str] = set()  # nodes that died while their writers ran maps
        self._dead_slots: set[int] = set()
        # Maps reported lost while a run of them was still in flight: queued again when
        # that run returns (see _requeue).
        self._lost_while_running: set[int] = set()
        # Maps queued again (lost): the next free writer takes them whatever its node, as
        # readers wait for them (a bounded wait: see reduce_task.MISSING_SEGMENT_WAIT_S).
        self._urgent: set[int] = set()
        # Maps submitted again after their writer process died (nodes module).
        self._resubmitted: collections.Counter[int] = collections.Counter()
        self._lost_asked = 0.0  # when the master was last asked for lost maps (monotonic)
        # Monotonic times: when each map's latest run was handed out, and when the master
        # first named each map it still names as lost (see poll).
        self._dispatched: dict[int, float] = {}
        self._lost_since: dict[int, float] = {}
        self._lost_interval = LOST_MAPS_POLL_S  # until the next ask (see poll)
        # Maps whose attempt 0 began at registration: their first run here is attempt 0.
        self._begun = lifecycle.take_begun_maps()
        # For the report's phases (perf_counter): when the first map was dispatched and
        # the last one was seen finished.
        self.first_dispatch: float | None = None
        self.last_finish: float | None = None
        # When a map last finished (or the runner started; monotonic): the stall bound's
        # clock (``check_stalled``).
        self.last_progress = time.monotonic()
        self._dispatch()

    @property
    def done(self) -> bool:
        return not self._queue and not self._running

    @property
    def num_finished(self) -> int:
        return self._total - len(self._queue) - len(self._in_flight())

    def running_refs(self) -> list[ray.ObjectRef]:
        return [ref for _, ref in self._in_flight()]

    def _in_flight(self) -> list[tuple[int, ray.ObjectRef]]:
        """(map, ref) of every map run handed to a writer and not collected yet."""
        return [run for runs in self._running.values() for run in runs]

    def poll(self, ready: set[ray.ObjectRef] | None = None) -> None:
        """Collect finished maps (raising a failed one's error), queue lost maps again,
        and hand out the queue to free writers. ``ready``: the refs a caller's own
        ``ray.wait`` found ready (then this one asks Ray nothing: each wait is a call into
        the core worker, a good share of a driver's CPU); None: check every running map.

        A writer that died with its node takes its running map with it: that map goes
        back to the front of the queue, the node's writers leave the pool, and the map
        runs again on another node (its dead attempt is superseded at the master). Maps
        that had finished there and whose segments died with the node come back through
        ``take_lost`` when a reader misses them.
        """
        if self._running:
            by_ref = {ref: (slot, run) for slot, runs in self._running.items()
                      for run in runs for ref in (run[1],)}
            if ready is None:
                ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0,
                                    fetch_local=False)
            for ref in [r for r in ready if r in by_ref]:
                slot, run = by_ref[ref]
                map_index = run[0]
                self._running[slot].remove(run)
                if not self._running[slot]:
                    del self._running[slot]
                try:
                    result = ray.get(ref)
                    _WRITER_PROGRESS.record(self._writers[slot][1])
                    # A run that found its map finished already wrote nothing: its empty
                    # result must not replace the run that wrote the map's output.
                    if not (isinstance(result, dict) and result.get("skipped")) \
                            or map_index not in self.results:
                        self.results[map_index] = result
                    self.last_finish = time.perf_counter()
                    self.last_progress = time.monotonic()
                except WORKER_LOST_ERRORS as exc:
                    node = self._writers[slot][0]
                    # A held shuffle is heartbeat by its keeper's thread (its call timer
                    # is not reentrant); any other by this one, also while it waits here.
                    beat = None if held_shuffle(self._lifecycle.shuffle_id) is not None \
                        else self._lifecycle.heartbeat
                    if worker_process_lost(exc) and lost_with_node(node, exc, beat):
                        self._drop_node(node)
                    elif self._resubmitted[map_index] < RESUBMITS_AFTER_WORKER_LOSS:
                        # Its writer process died more often than Ray retries a call,
                        # perhaps while it ran the map queued ahead of this one.
                        self._resubmitted[map_index] += 1
                    else:
                        raise
                    self._requeue([map_index])
                if map_index in self._lost_while_running:
                    self._lost_while_running.discard(map_index)
                    self._requeue([map_index])
        if time.monotonic() - self._lost_asked >= self._lost_interval:
            self._lost_asked = now = time.monotonic()
            lost = self._lifecycle.take_lost()
            self._lost_interval = LOST_MAPS_POLL_S if lost else \
                min(2 * self._lost_interval, LOST_MAPS_POLL_MAX_S)
            # The master names a lost map until its re-run begins (take_lost): a map whose
            # run was handed out after it was first named is that re-run, not a new loss.
            self._lost_since = {m: self._lost_since.get(m, now) for m in lost}
            running = {m for m, _ in self._in_flight()}
            self._requeue([m for m in lost if not (
                m in running and self._dispatched.get(m, -1.0) >= self._lost_since[m])])
        self._dispatch()

    def run_to_end(self, wait_s: float = 1.0) -> dict[int, Any]:
        """Poll until every map ran (raising the first failed map's error); the maps'
        results. For callers with nothing else to do meanwhile."""
        while not self.done:
            self.poll()
            self.check_stalled()
            # Maps may run for longer than the orphan TTL: the master must not expire the
            # shuffle meanwhile. A held one is heartbeat by its holder's thread (one thread
            # per lifecycle: its call timer is not reentrant); others here, rate-limited.
            if held_shuffle(self._lifecycle.shuffle_id) is None:
                self._lifecycle.heartbeat()
            running = self.running_refs()
            if running:
                ray.wait(running, num_returns=1, timeout=wait_s, fetch_local=False)
        return self.results

    def check_stalled(self, other_progress: float = 0.0,
                      other_running: str = "",
                      restart_others: Callable[[list[str]], None] | None = None
                      ) -> None:
        """Raise ``ShuffleStalledError`` if work is running but no map finished (and
        nothing the caller tracks made progress: ``other_progress``, monotonic; nor did
        the writers of its maps in flight finish another shuffle's map, ahead of them in
        their queues) for the config's ``stall_timeout_s``. A hung writer would otherwise
        keep its shuffle, and every later shuffle dispatched to it, waiting forever: the
        writers of the running maps (and the caller's stuck workers, ``restart_others``)
        are restarted first.
        ``other_running`` names the caller's running work for the message;
        ``restart_others`` adds the restarts that failed to the list it is given."""
        timeout = self._lifecycle.config.stall_timeout_s
        writers = _WRITER_PROGRESS.latest([self._writers[slot][1] for slot in self._running])
        idle = time.monotonic() - max(self.last_progress, other_progress, writers)
        if idle <= timeout or not (self._running or other_running):
            return
        maps = sorted(m for m, _ in self._in_flight())
        nodes = sorted({self._writers[slot][0][:12] for slot in self._running})
        running = [f"maps {maps} on writers at node(s) {', '.join(nodes)}"] if maps else []
        running += [other_running] if other_running else []
        failures: list[str] = []
        for slot in list(self._running):
            restart_stuck_worker(self._writers[slot][1], failures)
        if restart_others is not None:
            restart_others(failures)
        unrestarted = f" Restarting some failed: {'; '.join(failures)}." if failures else ""
        raise ShuffleStalledError(
            f"shuffle {self._lifecycle.shuffle_id} made no progress for {idle:.0f} s: no map "
            f"and no reducer finished ({'; '.join(running)} still running). Their worker "
            "processes were restarted and the shuffle's data is removed. If maps or "
            "reducers legitimately take longer (very large blocks, a slow remote store), "
            f"raise ShuffleConfig.stall_timeout_s (now {timeout:g} s).{unrestarted}")

    def _requeue(self, maps: Sequence[int]) -> None:
        """Put maps at the front of the queue, each once: a map lost with its node can be
        reported both by its writer's failure and by a reader missing its segments, and two
        runs at once would supersede each other.

        A map still in flight is queued when its run returns, not dropped: that run may
        be the one whose output was just reported lost (it finished, its result not
        collected yet), or a retry that found the map finished and wrote nothing. The
        master hands a lost map out once (``take_lost``), so dropping it here left the map
        unfinished for good and its readers failing. Run again, a map whose latest run did
        finish a new attempt writes nothing (``begin_map`` refuses a finished map)."""
        running = {m for m, _ in self._in_flight()}
        self._lost_while_running.update(m for m in maps if m in running)
        fresh = [m for m in maps if m not in running and m not in self._queue]
        self._queue.extendleft(reversed(fresh))
        self._urgent.update(maps)

    def _drop_node(self, node: str) -> None:
        """Stop using the writers of a node that died (``lost_nodes`` records it)."""
        self.lost_nodes.add(node)
        self._dead_slots.update(slot for slot, (n, _) in enumerate(self._writers) if n == node)
        if len(self._dead_slots) == len(self._writers):
            raise ShuffleFailedError(
                f"every node with writers died (last: {node}); no node is left to run the "
                "maps on")

    def _dispatch(self) -> None:
        """Hand maps to the idle writers, then queue one behind each busy writer while
        more maps wait than there are live writers (see ``MAP_QUEUE_DEPTH``)."""
        live = [slot for slot in range(len(self._writers)) if slot not in self._dead_slots]
        for depth in range(MAP_QUEUE_DEPTH):
            for slot in live:
                if not self._queue or (depth > 0 and len(self._queue) <= len(live)):
                    return
                if len(self._running.get(slot, ())) <= depth:
                    self._start(slot)

    def _start(self, slot: int) -> None:
        """Send writer ``slot`` the first map queued again (lost), else the next map whose
        input is on its node, else the next."""
        node, writer = self._writers[slot]
        pick = next((m for m in self._queue if m in self._urgent), None)
        if pick is None:
            pick = next((m for m in self._queue if self._input_nodes[m] == node),
                        self._queue[0])
        self._queue.remove(pick)
        self._urgent.discard(pick)
        attempt = 0 if pick in self._begun else None  # None: the map begins its own
        self._begun.discard(pick)
        if self._packed is None:  # put once, at the first map (see run_packed)
            self._packed = pack_call(self._map_fn, self._args)
        ref = writer.run_packed.remote(self._packed, self._lifecycle.shuffle_id, pick,
                                       self._inputs[pick], attempt=attempt)
        self._dispatched[pick] = time.monotonic()
        self._running.setdefault(slot, []).append((pick, ref))
        if self.first_dispatch is None:
            self.first_dispatch = time.perf_counter()


def restart_stuck_worker(actor: Any, failures: list[str] | None = None) -> None:
    """Restart a long-lived worker actor stuck in a task (it comes back empty, through
    its ``max_restarts``). A kill that fails (the actor is gone already) is added to
    ``failures`` for the caller's error: the stall stays the error to raise."""
    try:
        ray.kill(actor, no_restart=False)
    except Exception as exc:  # noqa: BLE001 - reported in the caller's error
        if failures is not None:
            failures.append(f"{type(exc).__name__}: {exc}")


# ---- shuffles held after the call that made them -------------------------------------------
class _HeldShuffles:
    """Shuffles whose data outlives the call that made them, kept alive by one daemon
    thread: it heartbeats each and re-runs the lost maps of those given a ``rerun``.
    Errors of that background work are kept (``errors``), never swallowed silently."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[ShuffleLifecycle, Callable[[list[int]], Any] | None]] = {}
        self._thread: threading.Thread | None = None
        self.errors: collections.deque[str] = collections.deque(maxlen=HELD_ERRORS_KEPT)
        # Held shuffles whose lost maps are being re-run, each on a thread of its own: a
        # re-run on the holder's thread stopped every held shuffle's heartbeats while it
        # ran, and the master expired them all after orphan_ttl_s.
        self._rerunning: set[str] = set()

    def hold(self, lifecycle: ShuffleLifecycle,
             rerun: Callable[[list[int]], Any] | None) -> None:
        with self._lock:
            self._held[lifecycle.shuffle_id] = (lifecycle, rerun)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hybrid_ray-held-shuffles")
                self._thread.start()

    def unhold(self, shuffle_id: str) -> ShuffleLifecycle | None:
        with self._lock:
            entry = self._held.pop(shuffle_id, None)
        return entry[0] if entry else None

    def get(self, shuffle_id: str) -> ShuffleLifecycle | None:
        with self._lock:
            entry = self._held.get(shuffle_id)
        return entry[0] if entry else None

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def _run(self) -> None:
        while True:
            time.sleep(RECOVERY_POLL_S)
            with self._lock:
                held = list(self._held.values())
            for lifecycle, rerun in held:
                try:
                    self._tend(lifecycle, rerun)
                except Exception as exc:  # noqa: BLE001 - kept; the other shuffles go on
                    # This one thread beats for every held shuffle: ended by one error, it
                    # left them all to the master's orphan expiry, data still in use.
                    self._note(lifecycle, f"tending it failed: {describe_cause(exc)}")

    def _tend(self, lifecycle: ShuffleLifecycle,
              rerun: Callable[[list[int]], Any] | None) -> None:
        with self._lock:
            rerunning = lifecycle.shuffle_id in self._rerunning
        try:
            lifecycle.heartbeat()
            # Maps lost meanwhile wait for the re-run running now to end.
            lost = lifecycle.take_lost() if rerun is not None and not rerunning else []
        except ShuffleStalledError as exc:  # a master slow to answer: try again next turn
            # (a ShuffleFailedError too, but not a released shuffle: let go of it here and
            # its heartbeats stopped, the master expired it and deleted data still in use)
            self._note(lifecycle, describe_cause(exc))
            return
        except (ShuffleNotFoundError, ShuffleFailedError) as exc:  # released, expired
            if self.unhold(lifecycle.shuffle_id) is not None:
                self._note(lifecycle, f"the master no longer knows it: {exc}")
            return
        except ray.exceptions.ActorDiedError as exc:
            # The master is never restarted (its books went with it): holding on, the
            # shuffle was beaten for, and noted as failing, every turn for the session.
            if self.unhold(lifecycle.shuffle_id) is not None:
                self._note(lifecycle, "let go: its shuffle master is gone (its node died or "
                                      f"it was killed), and its books with it: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - Ray going down, master restarting: retry
            self._note(lifecycle, describe_cause(exc))
            return
        if not lost:
            return
        with self._lock:
            self._rerunning.add(lifecycle.shuffle_id)
        try:
            threading.Thread(target=self._rerun, args=(lifecycle, rerun, lost), daemon=True,
                             name=f"hybrid_ray-rerun-{lifecycle.shuffle_id}").start()
        except Exception as exc:  # noqa: BLE001 - no thread (the process is out of them)
            # The lost maps were taken from the master: not re-run, their readers would
            # wait until the stall bound. Failed like a re-run that failed, loudly.
            def cannot_start(_lost: list[int]) -> None:
                raise exc
            self._rerun(lifecycle, cannot_start, lost)

    def _rerun(self, lifecycle: ShuffleLifecycle, rerun: Callable[[list[int]], Any],
               lost: list[int]) -> None:
        """Re-run a held shuffle's ``lost`` maps; a failure releases the shuffle, telling
        its readers why, and is kept in ``errors``."""
        try:
            rerun(lost)
        except Exception as exc:  # noqa: BLE001 - told to the readers and kept
            why = (f"re-running maps {lost}, whose output died with their writer, failed: "
                   f"{describe_cause(exc)}")
            self._note(lifecycle, why)
            try:
                lifecycle.release(why, failed=True)  # readers wait for those maps: tell them
            except Exception as release_exc:  # noqa: BLE001 - the orphan TTL removes it
                self._note(lifecycle, f"releasing it failed: {describe_cause(release_exc)}")
        finally:
            with self._lock:
                self._rerunning.discard(lifecycle.shuffle_id)

    def _note(self, lifecycle: ShuffleLifecycle, what: str) -> None:
        self.errors.append(f"{time.strftime('%H:%M:%S')} {lifecycle.shuffle_id}: {what}")


_held = _HeldShuffles()


def held_shuffle(shuffle_id: str) -> ShuffleLifecycle | None:
    """The held shuffle with this id (None: not held, or released)."""
    return _held.get(shuffle_id)


def held_shuffle_ids() -> list[str]:
    """The ids of the shuffles this process holds (see ``ShuffleLifecycle.hold``)."""
    return _held.ids()


def held_errors() -> list[str]:
    """The most recent errors of held shuffles' background work (heartbeats, re-runs of
    lost maps), oldest first, each with the time and the shuffle id."""
    return list(_held.errors)
