"""The Ray actors: a per-node tier manager, the namespace's shuffle master, and the
long-lived worker processes that run maps (writers) and reducers (readers).

The first two are thin shells over plain classes (``TierManager``, ``ShuffleRegistry``), so
the logic is tested without a cluster. All are named and detached: a tier manager must
outlive the Spark executors' processes whose memory-tier objects it owns, a writer the
shuffles whose objects it owns, and the master a crashed driver, to remove that driver's
orphaned data after the TTL.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybrid_ray import spark_jvm
from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.errors import SegmentNotFoundError, ShuffleStalledError, UnsafePathError
from hybrid_ray.master import (
    LATE_REMOTE_SWEEP_S, PendingDeletion, PollResult, ShuffleRegistry, ShuffleState,
    ShuffleSummary, metas_by_node,
)
from hybrid_ray.nodes import node_alive
from hybrid_ray.object_store import ObjectStoreWarmUp, default_warm_up_bytes
from hybrid_ray.report import Stopwatch
from hybrid_ray.segment import SegmentMeta
from hybrid_ray.tier_manager import (
    REMOTE_TIERS_KEPT, NodeUsage, Placement, ReserveToken, TierManager)
from hybrid_ray.tiers import Grant, RemoteTier
from hybrid_ray.tiers.cache import LruCache
from hybrid_ray.tiers.remote import open_remote_tier, remote_tier_key

_LOG = logging.getLogger(__name__)
MASTER_NAME = "hybrid_ray_shuffle_master"
# A custom resource only the head node has (Ray 2.x): actors that ask for a sliver of it run
# there.
HEAD_NODE_RESOURCE = "node:__internal_head__"
TIER_MANAGER_PREFIX = "hybrid_ray_tier_manager_"
READER_PREFIX = "hybrid_ray_reader_"
WRITER_PREFIX = "hybrid_ray_writer_"
# A reader or writer process killed mid-partition is restarted and the call run again.
WORKER_MAX_RETRIES = 3
# Environment of the writer and reader processes. pyarrow's allocator (mimalloc) hands
# freed memory back to the OS 10 ms after a free by default, so every map chunk's take and
# hash buffers were faulted in afresh, and on VMs whose host backs guest memory lazily a
# fresh page costs more than the copy into it. One second keeps the buffers of consecutive
# chunks warm and still returns an idle worker's memory. Measured on a 1 GB shuffle
# (/tmp/prof/run4.py, warm round): 262-268 MB/s with the default, 296-346 with purging
# off, 299 with 1 s.
WORKER_ENV = {"MIMALLOC_PURGE_DELAY": "1000"}
# How often the master looks for shuffles whose driver stopped heartbeating. A shuffle is
# released up to this long after its orphan_ttl_s: at 30 s a driver killed with a 20 s TTL
# was cleaned up after 20-50 s. Expiry scans the master's in-memory books under its lock
# (microseconds for hundreds of shuffles) and the background loop wakes every second
# anyway, so checking as often as drivers heartbeat (shuffle.HEARTBEAT_S) costs nothing.
EXPIRY_CHECK_INTERVAL_S = 5.0
# How often the master ends the writers and readers of jobs that ended
# (``end_workers_of_ended_jobs``): one GCS listing of named actors each time.
JOB_WORKER_SWEEP_S = 10.0
# Tier managers release shuffles the master no longer holds (see sweep_orphans).
ORPHAN_SWEEP_INTERVAL_S = 30.0
ORPHAN_SWEEP_GRACE = 2
# How long a tier manager starting waits for the master's list of the memory-tier segments
# it takes over (``TierManagerActor._adopt_held_memory_segments``).
ADOPT_WAIT_S = 10.0
# Bound on one control call to the shuffle master (from a driver, a map or reduce task, a
# tier manager or the CLI; see ``answer_of``) or to a tier manager from the master.
MASTER_CALL_TIMEOUT_S = 30.0
# Bound on a call that carries segments' bytes (a disk segment read from another node's
# tier manager; a tier manager storing memory-tier segments for a process that cannot own
# them, while the object store may have to spill others' objects first): megabytes, so
# far more than a control call's, but not forever.
DATA_CALL_TIMEOUT_S = 300.0
# Bound on a writer's control call to its node's tier manager (reserve, settle,
# free_segments). The tier manager runs one call at a time, so these queue behind its
# slow ones (storing segments for a process that cannot own them while the object store
# spills, serving a disk segment to another node, deleting a released shuffle's files:
# each bounded at up to DATA_CALL_TIMEOUT_S), and a node's first reservation may start
# the tier manager's process: a control call's 30 s would fail healthy, busy nodes.
TIER_MANAGER_CALL_TIMEOUT_S = DATA_CALL_TIMEOUT_S
# How often the master retries deletions that failed (each has its own backoff).
DELETION_CHECK_INTERVAL_S = 1.0
# Bound on waiting for a node's tier manager to delete a shuffle's data.
NODE_DELETE_TIMEOUT_S = 60.0


def answer_of(ref: ray.ObjectRef, what: str, timeout_s: float | None = None,
              error: type[Exception] = ShuffleStalledError, hint: str = "") -> Any:
    """The answer of an actor call, waited for at most ``timeout_s`` (default
    ``MASTER_CALL_TIMEOUT_S``). A master or tier manager that never answers (hung, or its
    node paused) fails the task waiting on it with ``error`` (``ShuffleStalledError``)
    naming the call, and ``hint`` (what else to check for this call), instead of holding
    it forever: Spark's executors have no stall bound of ours. The call itself is not
    cancelled (Ray cannot cancel an actor's running call): what it does when it runs late
    is undone with the failed task's attempt."""
    bound = MASTER_CALL_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return ray.get(ref, timeout=bound)
    except ray.exceptions.GetTimeoutError:
        raise error(
            f"{what} got no answer within {bound:.0f} s: the actor is hung or its node is "
            "overloaded (`hybrid-ray status` shows the master's and tier managers' state). "
            "Gave up instead of waiting forever; run the job again once the cluster is "
            "healthy" + (f". {hint}" if hint else "")) from None


def _wait_for_nodes(waits: Sequence[tuple[str, ray.ObjectRef]], what: str,
                    on_dead: Callable[[str], None] = lambda node_id: None) -> None:
    """Wait (bounded) for tier-manager calls; raise naming the nodes where they failed.
    A tier manager that died with its node is not an error: its data went with it.
    ``on_dead(node)`` is told of each node whose tier manager died."""
    problems = []
    for node_id, ref in waits:
        try:
            ray.get(ref, timeout=NODE_DELETE_TIMEOUT_S)
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
            on_dead(node_id)
            if node_alive(node_id):
                problems.append(f"node {node_id}: its tier manager is unavailable")
        except ray.exceptions.GetTimeoutError:
            problems.append(f"node {node_id}: no answer in {NODE_DELETE_TIMEOUT_S:.0f} s")
        except Exception as exc:  # noqa: BLE001 - collected and raised together below
            problems.append(f"node {node_id}: {type(exc).__name__}: {exc}")
    if problems:
        raise OSError(f"{what} failed on {len(problems)} node(s): " + "; ".join(problems))


def _call_periodically(actor: Any, interval_s: float,
                       on_error: Callable[[BaseException], None],
                       stop: threading.Event | None = None) -> None:
    """Call ``actor.sweep_orphans`` every ``interval_s`` through the actor's own queue, so
    the sweep never runs beside another call on the actor's single-threaded state. A
    failed or late sweep is handed to ``on_error`` (counted, shown by ``usage``/``status``)
    and the next one tries again. Runs until ``stop`` is set (for the actor: forever)."""
    stop = stop or threading.Event()
    while not stop.wait(interval_s):
        try:
            ray.get(actor.sweep_orphans.remote(), timeout=interval_s)
        except Exception as exc:  # noqa: BLE001 - reported through on_error, then retried
            on_error(exc)


def _delete_remote_segments(tier: RemoteTier, metas: Sequence[SegmentMeta]
                            ) -> list[Exception]:
    """Delete remote segments, every one tried; returns the errors of those that failed.
    A location the tier refuses (not ours: from another process, e.g. a JVM commit) is
    said and left, as a tier manager does with a disk location: raised, it was retried
    forever and held back the batch's other segments."""
    failed: list[Exception] = []
    for meta in metas:
        try:
            tier.delete(meta)
        except UnsafePathError as exc:
            _LOG.warning("hybrid_ray shuffle master: %s", exc)
        except Exception as exc:  # noqa: BLE001 - the rest are still deleted
            failed.append(exc)
    return failed


def usage_of_nodes(namespace: str) -> tuple[list[Any], list[dict[str, str]]]:
    """(the usage of every alive node's tier manager of ``namespace``, the nodes whose
    tier manager did not answer within ``STATUS_NODE_WAIT_S`` or failed, with why).
    Every node is asked at once and waited for together: asked in turn with 30 s each, a
    few silent tier managers outlasted every caller's bound, and one that had died failed
    the whole status."""
    asked = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        tm = existing_tier_manager(node["NodeID"], namespace)
        if tm is not None:
            asked.append((node["NodeID"], tm.usage.remote()))
    ready = set(ray.wait([ref for _, ref in asked], num_returns=len(asked),
                         timeout=STATUS_NODE_WAIT_S)[0]) if asked else set()
    usage, unanswered = [], []
    for node_id, ref in asked:
        if ref not in ready:
            unanswered.append({"node_id": node_id,
                               "error": f"no answer within {STATUS_NODE_WAIT_S:g} s"})
            continue
        try:
            usage.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - that node is reported, not the call
            cause = getattr(exc, "cause", None) or exc  # a task error's own, not its trace
            unanswered.append({"node_id": node_id,
                               "error": f"{type(cause).__name__}: {str(cause)[:300]}"})
    return usage, unanswered


def _node_object_store_bytes(node_id: str) -> int:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return 0


@ray.remote(num_cpus=0, max_restarts=0)
class TierManagerActor:
    """Owns one node's memory-tier objects and disk-tier accounting; serves its disk
    segments to readers on other nodes."""

    def __init__(self, node_id: str, namespace: str) -> None:
        self.tm = TierManager(node_id, _node_object_store_bytes(node_id))
        self.namespace = namespace
        # Spark session token -> its whole ShuffleConfig (from the master), or None.
        self._spark_sessions: dict[str, Any] = {}
        # Shuffle -> consecutive sweeps that found the master without it.
        self._unknown_to_master: dict[str, int] = {}
        self._warm_up = ObjectStoreWarmUp()
        self._adopt_held_memory_segments()
        me = ray.get_runtime_context().current_actor
        self.sweep_errors = 0
        self.last_sweep_error = ""
        threading.Thread(target=_call_periodically,
                         args=(me, ORPHAN_SWEEP_INTERVAL_S, self._sweep_failed),
                         daemon=True, name="hybrid-ray-orphan-sweep").start()

    def _adopt_held_memory_segments(self) -> None:
        """Before granting anything: take the memory-tier segments the master still holds
        on this node into the new books (``TierManager.adopt_memory_segments``): a tier
        manager started in place of one that died would otherwise grant the node's whole
        memory budget again beside objects that still fill it. No master (none ran yet),
        or none answering within ``ADOPT_WAIT_S``: nothing is taken (said in the log)."""
        from hybrid_ray.errors import ShuffleMasterLostError

        try:
            held = ray.get(master_handle(self.namespace).memory_segments_on.remote(
                self.tm.node_id), timeout=ADOPT_WAIT_S)
        except ShuffleMasterLostError:
            return
        except Exception as exc:  # noqa: BLE001 - the node works on without them
            _LOG.warning("hybrid_ray tier manager of node %s: could not ask the shuffle "
                         "master for the memory-tier segments held on this node (%s: %s); "
                         "they are not counted against its memory budget", self.tm.node_id,
                         type(exc).__name__, str(exc)[:300])
            return
        for shuffle_id, config, metas in held:
            try:
                self.tm.adopt_memory_segments(shuffle_id, config, metas)
            except Exception as exc:  # noqa: BLE001 - never fail the tier manager's start
                _LOG.warning("hybrid_ray tier manager of node %s: the memory-tier segments "
                             "of shuffle %s held on this node are not counted (%s: %s)",
                             self.tm.node_id, shuffle_id, type(exc).__name__,
                             str(exc)[:300])

    def sweep_orphans(self) -> list[str]:
        """Release the shuffles registered here that the namespace's master no longer
        holds (released while this node could not be told, or the master died with its
        node, taking the books with it): their space and memory quota would otherwise
        stay taken for good. A shuffle goes after ``ORPHAN_SWEEP_GRACE`` consecutive
        sweeps without it; a master that does not answer in time releases nothing."""
        from hybrid_ray.errors import ShuffleMasterLostError

        # What late writers left of shuffles released here lately: no master needed. A
        # failure is raised after the orphans' turn (counted by _sweep_failed, retried by
        # the next sweep), so one stuck file does not keep orphans' space taken.
        failures: list[str] = []
        try:
            self.tm.remove_late_files()
        except OSError as exc:
            failures.append(str(exc))
        try:
            live = set(ray.get(master_handle(self.namespace).live_shuffles.remote(),
                               timeout=MASTER_CALL_TIMEOUT_S))
        except ShuffleMasterLostError:
            live = set()
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            if failures:
                raise OSError("; ".join(failures)) from None
            return []
        except ray.exceptions.ActorDiedError:
            live = set()
        released = []
        for shuffle_id in self.tm.shuffle_ids():
            if shuffle_id in live:
                self._unknown_to_master.pop(shuffle_id, None)
                continue
            misses = self._unknown_to_master.get(shuffle_id, 0) + 1
            self._unknown_to_master[shuffle_id] = misses
            if misses >= ORPHAN_SWEEP_GRACE:
                self._unknown_to_master.pop(shuffle_id, None)
                released.append(shuffle_id)
                try:
                    self.tm.release_shuffle(shuffle_id)
                except OSError as exc:  # released; its files go with the late files sweep
                    failures.append(str(exc))
        if failures:
            raise OSError("; ".join(failures))
        return released

    def put_objects(self, values: list[Any]) -> list[ray.ObjectRef]:
        """Put each value as an object this actor owns (memory-tier segments). The refs
        come back inside a list, so Ray hands back the refs, not the values."""
        return [ray.put(v) for v in values]

    def register_shuffle(self, shuffle_id: str, config: ShuffleConfig) -> int:
        return self.tm.register_shuffle(shuffle_id, config)

    def check_spill_dirs(self, config: ShuffleConfig) -> list[str]:
        return self.tm.check_spill_dirs(config)

    def reserve(self, shuffle_id: str, sizes: Sequence[int],
                settled: Sequence[tuple[Grant, int | None]] = (),
                register: ShuffleConfig | None = None,
                token: ReserveToken | None = None) -> list[Placement]:
        return self.tm.reserve(shuffle_id, sizes, settled, register, token=token)

    def cancel_reserve(self, shuffle_id: str, token: ReserveToken) -> int:
        return self.tm.cancel_reserve(shuffle_id, token)

    def settle(self, shuffle_id: str, settled: Sequence[tuple[Grant, int | None]]) -> None:
        self.tm.settle(shuffle_id, settled)

    def free_segments(self, shuffle_id: str, metas: Sequence[SegmentMeta]) -> None:
        for refusal in self.tm.free_segments(shuffle_id, metas):  # counted in usage too
            _LOG.warning("hybrid_ray tier manager: %s", refusal)

    def release_shuffle(self, shuffle_id: str, config: ShuffleConfig | None = None) -> None:
        self.tm.release_shuffle(shuffle_id, config)

    def read_disk_segment(self, meta: SegmentMeta) -> bytes:
        return self.tm.read_disk_segment(meta)

    def _sweep_failed(self, exc: BaseException) -> None:
        self.sweep_errors += 1
        self.last_sweep_error = f"{type(exc).__name__}: {exc}"[:500]

    def warm_object_store(self, nbytes: int | None = None) -> int:
        """Have this node's object store pages allocated ahead of the first shuffle, in the
        background (``hybrid_ray.object_store``): ``nbytes`` of it, by default
        ``default_warm_up_bytes`` of the node's store. Once per tier manager: later calls
        start nothing. Returns the bytes this call set out to warm (0 if none)."""
        if nbytes is None:
            nbytes = default_warm_up_bytes(self.tm.object_store_bytes)
        if nbytes <= 0 or not self._warm_up.start(nbytes):
            return 0
        return nbytes

    def object_store_warm_up(self) -> dict[str, Any]:
        """How far this node's object-store warm-up got (``ObjectStoreWarmUp.state``)."""
        return self._warm_up.state()

    def usage(self) -> NodeUsage:
        return dataclasses.replace(self.tm.usage(), sweep_errors=self.sweep_errors,
                                   last_sweep_error=self.last_sweep_error)

    # ---- the JVM shuffle manager (JSON strings in and out: see hybrid_ray.spark_jvm) ------
    def spark_reserve(self, request: str) -> str:
        return json.dumps(spark_jvm.reserve(self.tm, json.loads(request),
                                            self._spark_session_now))

    def spark_cancel_reserve(self, request: str) -> str:
        """A JVM writer's reservation whose answer it never got, given back
        (``spark_jvm.cancel_reserve``)."""
        return json.dumps({"cancelled": spark_jvm.cancel_reserve(self.tm,
                                                                json.loads(request))})

    def spark_lease(self, request: str) -> str:
        """A memory lease for a JVM map task (``spark_jvm.lease``)."""
        return json.dumps(spark_jvm.lease(self.tm, json.loads(request),
                                          self._spark_session_now))

    def _spark_session_now(self, token: str) -> Any:
        """``_spark_session`` asked of the master again: what a shuffle registers with here
        (once per shuffle and node) must be what the master registered it with. The master
        forgets idle sessions (``SparkSessions``) and then registers their shuffles without
        the remote tier; registered here from the cache, their JVM segments went to a
        remote tier the master never deletes from."""
        return self._spark_session(token, fresh=True)

    def _spark_session(self, token: str, fresh: bool = False) -> Any:
        """A Spark session's whole ShuffleConfig, asked of the master once per session."""
        if fresh or token not in self._spark_sessions:
            if token not in self._spark_sessions and \
                    len(self._spark_sessions) >= spark_jvm.SPARK_SESSIONS:
                self._spark_sessions.clear()
            self._spark_sessions[token] = ray.get(
                master_handle(self.namespace).spark_session_config.remote(token),
                timeout=MASTER_CALL_TIMEOUT_S)
        return self._spark_sessions[token]

    def spark_write_remote(self, request: str, frame: bytes) -> str:
        """Store a JVM segment in its shuffle's remote tier (fsspec here, so no JVM needs
        Hadoop's S3A); returns ``{"location": ...}``."""
        return json.dumps(spark_jvm.write_remote(self.tm, json.loads(request), frame))

    def spark_delete_remote(self, request: str) -> str:
        """Remote-tier segments of a failed JVM map attempt that it never committed,
        deleted (``spark_jvm.delete_remote``)."""
        return json.dumps({"deleted": spark_jvm.delete_remote(self.tm, json.loads(request))})

    def spark_read_remote(self, request: str) -> bytes:
        """A JVM segment from the remote tier, for a Spark reader on this node; empty bytes
        if it is gone (``spark_jvm.GONE``: a Python error's type does not cross to Java,
        and only a segment that is gone is a lost map output to Spark; a store that fails
        to answer raises)."""
        try:
            return spark_jvm.read_remote(self.tm, json.loads(request), self._spark_session)
        except SegmentNotFoundError:
            return spark_jvm.GONE

    def spark_settle(self, request: str) -> str:
        request = json.loads(request)
        spark_jvm.settle(self.tm, request["shuffle"], request.get("settle"))
        return "ok"

    def spark_read_segment(self, location: str) -> bytes:
        """A disk segment file of this node, for a Spark reader on another node; empty
        bytes if it is gone (``spark_jvm.GONE``)."""
        self.tm.serve_segment_file(location)
        try:
            with open(location, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return spark_jvm.GONE  # see spark_read_remote


class ActorNodeStorage:
    """``NodeStorage`` for a write client: forwards space decisions to a tier-manager actor.

    ``stopwatch``: times each call (the writer's control-plane time in its report).
    ``register``: the shuffle's config, sent with the first reservation so that the tier
    manager registers the shuffle in the same call (a map that writes nothing never
    registers: it needs no space).
    """

    def __init__(self, actor: Any, stopwatch: Stopwatch | None = None,
                 register: ShuffleConfig | None = None) -> None:
        self.actor = actor
        self.stopwatch = stopwatch or Stopwatch()
        self._register = register
        self._writer = secrets.token_hex(8)  # names this proxy's reservations (ReserveToken)
        self._sequence = 0
        # (shuffle, token) of the last reservation whose answer never came: it may have
        # run and granted space this writer does not know of (cancel_unanswered_reserve).
        self._unanswered: tuple[str, ReserveToken] | None = None

    def reserve(self, shuffle_id, sizes, settled=()):
        register, self._register = self._register, None
        self._sequence += 1
        token = ReserveToken(self._writer, self._sequence)
        with self.stopwatch:
            try:
                return answer_of(self.actor.reserve.remote(shuffle_id, list(sizes),
                                                           list(settled), register, token),
                                 f"the tier manager's reserve for shuffle {shuffle_id}",
                                 TIER_MANAGER_CALL_TIMEOUT_S)
            except BaseException:
                self._unanswered = (shuffle_id, token)
                raise

    def cancel_unanswered_reserve(self) -> None:
        """Give back the space of the last reservation whose answer never came (the wait
        ran out, the task was cancelled while waiting): the call may still run on the
        tier manager, and this writer, aborting, will never settle grants it never saw.
        Sent after the reservation on the same actor, so it runs after it."""
        if self._unanswered is None:
            return
        shuffle_id, token = self._unanswered
        self._unanswered = None
        with self.stopwatch:
            answer_of(self.actor.cancel_reserve.remote(shuffle_id, token),
                      f"the tier manager's cancel_reserve for shuffle {shuffle_id}",
                      TIER_MANAGER_CALL_TIMEOUT_S)

    def settle(self, shuffle_id, settled):
        with self.stopwatch:
            answer_of(self.actor.settle.remote(shuffle_id, list(settled)),
                      f"the tier manager's settle for shuffle {shuffle_id}",
                      TIER_MANAGER_CALL_TIMEOUT_S)

    def start_settle(self, shuffle_id, settled) -> Callable[[], None]:
        """``settle`` sent without waiting: returns the wait for its answer (raising the
        call's error), so a map's last settle travels beside its ``finish_map``."""
        with self.stopwatch:
            ref = self.actor.settle.remote(shuffle_id, list(settled))

        def wait() -> None:
            with self.stopwatch:
                answer_of(ref, f"the tier manager's settle for shuffle {shuffle_id}",
                          TIER_MANAGER_CALL_TIMEOUT_S)
        return wait

    def free_segments(self, shuffle_id, metas):
        with self.stopwatch:
            answer_of(self.actor.free_segments.remote(
                shuffle_id, [m.without_object_ref() for m in metas]),
                      f"the tier manager's free_segments for shuffle {shuffle_id}",
                      TIER_MANAGER_CALL_TIMEOUT_S)


def _get_or_start(actor_class: Any, name: str, namespace: str, *args: Any,
                  **options: Any) -> Any:
    """The named actor, started (detached) if it is not running yet."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    return actor_class.options(name=name, namespace=namespace, lifetime="detached",
                               get_if_exists=True, **options).remote(*args)


def get_tier_manager(node_id: str, namespace: str) -> Any:
    """The tier manager of ``node_id``, started (pinned to that node) if not running yet."""
    return _get_or_start(
        TierManagerActor, TIER_MANAGER_PREFIX + node_id, namespace, node_id, namespace,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def existing_tier_manager(node_id: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(TIER_MANAGER_PREFIX + node_id, namespace=namespace)
    except ValueError:
        return None


# Tier-manager handles the master keeps (one per node it deletes on).
TIER_MANAGER_HANDLES_KEPT = 4096
# Readers' long polls wait in their own thread pool, so however many wait, commits and
# registrations still find a thread. Beyond this many waiting polls, further ones queue for
# at most MAX_POLL_WAIT_S (a waiting poll returns by then).
POLL_THREADS = 64
# How long a release waits for its data's deletion before it answers (see
# ShuffleMasterActor._await_deletions): well inside the callers' MASTER_CALL_TIMEOUT_S.
RELEASE_WAIT_S = 20.0
MAX_POLL_WAIT_S = 1.0
# How long ``status`` waits for the tier managers' usage, all nodes together: inside the
# CLI's default 15 s bound on the call.
STATUS_NODE_WAIT_S = 10.0


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8,
            concurrency_groups={"poll": POLL_THREADS})
class ShuffleMasterActor:
    """One per namespace. Calls are serialised by a lock; a background thread expires
    orphans and retries deletions that failed. Deleting data (tier managers, the remote
    store) never happens under the lock: the registry queues it and ``_run_deletions``
    performs it, so a slow or failing store never blocks registrations, commits or polls.

    Readers long-poll (``poll(..., wait_s)``): a poll with nothing new waits on
    ``_changed``, which every state change notifies, instead of the reader sleeping and
    asking again. Profiled before (1 GiB, 2 cores): half of the readers' CPU and much of the
    master's went to polls that found nothing, and a segment committed during a reader's
    backoff sleep waited for the sleep to end.
    """

    def __init__(self, namespace: str, release_wait_s: float = RELEASE_WAIT_S,
                 late_sweep_s: float = LATE_REMOTE_SWEEP_S,
                 max_poll_wait_s: float = MAX_POLL_WAIT_S) -> None:
        self.namespace = namespace
        self._release_wait_s = release_wait_s
        # The longest a long poll (poll, spark_await_blocks) is held: tests raise it, so
        # that "woken by the commit, not by the deadline" does not depend on their speed.
        self._max_poll_wait_s = max_poll_wait_s
        self._lock = threading.RLock()
        # Notified (under _lock, by _changing) by every call that may give a reader news.
        self._changed = threading.Condition(self._lock)
        # One deletion runner at a time (the background thread, or ``run_deletions``).
        self._deletion_lock = threading.Lock()
        self._wake = threading.Event()
        self.registry = ShuffleRegistry(self._delete_segments, self._release_data,
                                        delete_inline=False,
                                        sweep_remote=self._remove_remote_tree,
                                        late_sweep_s=late_sweep_s)
        self.loop_errors = 0
        self.last_loop_error = ""
        self._spark_history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=spark_jvm.SPARK_HISTORY)
        self._spark_sessions = spark_jvm.SparkSessions(self._config_in_use)
        self._remote_tiers: LruCache[RemoteTier] = LruCache(REMOTE_TIERS_KEPT,
                                                            on_evict=RemoteTier.close)
        self._tier_managers: LruCache[Any] = LruCache(TIER_MANAGER_HANDLES_KEPT)
        threading.Thread(target=self._background_loop, daemon=True,
                         name="hybrid-ray-master-background").start()

    # ---- deletion I/O (called by _run_deletions, never under the lock) ---------------------
    def _delete_segments(self, state: ShuffleState, metas: Sequence[SegmentMeta]) -> None:
        """Delete segments on their nodes and in the remote tier; raises if any deletion
        failed on a node that is alive (a dead node's data went with it)."""
        waits = []
        for node_id, local in metas_by_node(metas).items():
            tm = self._tier_manager(node_id)
            if tm is not None:
                # The tier manager frees by id and size. (The registry has usually emptied
                # a memory segment's ref list by now; never sending refs makes it certain:
                # a deserialized ref makes the tier manager a borrower, see
                # without_object_ref.)
                waits.append((node_id, tm.free_segments.remote(
                    state.shuffle_id, [m.without_object_ref() for m in local])))
        remote = [m for m in metas if m.tier == TierName.REMOTE]
        failed: list[Exception] = []
        if remote:
            # On the tier's transfer threads, waited for within a bound: a sync filesystem
            # (NFS through file://, HDFS, sftp) has no per-call deadline, and a hung one
            # held this thread, and with it every later deletion, forever. Timed out, the
            # deletion stays queued and is tried again.
            tier = self._remote_tier(state.config)
            failed = tier.outcome(
                tier.io_pool().submit(_delete_remote_segments, tier, remote),
                f"deleting {len(remote)} segment(s) of shuffle {state.shuffle_id}")
        _wait_for_nodes(waits, f"deleting segments of shuffle {state.shuffle_id}",
                        self._tier_managers.discard)
        if failed:
            raise failed[0]

    def _release_data(self, state: ShuffleState) -> None:
        """Remove all of a shuffle's data on every node it used and in the remote tier;
        raises if some of it could not be removed (the registry retries).

        The remote tree goes after the nodes answered: a tier manager runs one call at a
        time and stores JVM writers' remote segments (``spark_write_remote``), so once its
        release has run, no such write of the shuffle can come after the removal and
        re-create the tree. (Removed side by side, a write queued before the release
        landed after the removal, and the shuffle's marked directory stayed.)"""
        waits = []
        for node_id in state.nodes:
            tm = self._tier_manager(node_id, start=True)
            if tm is not None:
                waits.append((node_id, tm.release_shuffle.remote(state.shuffle_id,
                                                                 state.config)))
        node_error = None
        try:
            _wait_for_nodes(waits, f"releasing shuffle {state.shuffle_id}",
                            self._tier_managers.discard)
        except OSError as exc:  # raised after the remote tree was tried too
            node_error = exc
        if state.config.remote_path:
            try:
                self._remove_remote_tree(state)
            except Exception as exc:  # noqa: BLE001 - the nodes' error is reported first
                if node_error is None:
                    raise
        if node_error is not None:
            raise node_error

    def _tier_manager(self, node_id: str, start: bool = False) -> Any | None:
        """The tier manager of ``node_id`` (None: none runs there), its handle kept: a
        lookup by name is a GCS round trip, and deletions ran one per node per freed
        subpartition. A handle whose actor died is dropped (``_wait_for_nodes``), so a
        tier manager started again later is found. ``start``: start one if none runs on
        a node that is alive (a release must reach the files of a tier manager that died:
        skipped, they stayed for good)."""
        tm = self._tier_managers.get(node_id)
        if tm is None:
            tm = existing_tier_manager(node_id, self.namespace)
            if tm is None and start and node_alive(node_id):
                tm = get_tier_manager(node_id, self.namespace)
            if tm is not None:
                tm = self._tier_managers.get_or_create(node_id, lambda: tm)
        return tm

    def _remove_remote_tree(self, state: ShuffleState) -> None:
        """Remove a shuffle's remote tree: at its release, and once more for late writes
        (``LATE_REMOTE_SWEEP_S``)."""
        tier = self._remote_tier(state.config)
        # Bounded as the segments' deletion is (see _delete_segments).
        tier.outcome(tier.io_pool().submit(tier.remove_shuffle_data, state.shuffle_id),
                     f"removing shuffle {state.shuffle_id}")

    def _remote_tier(self, config: ShuffleConfig) -> RemoteTier:
        """The remote tier deletions go through, opened once per config (it was opened
        anew for every deletion: a filesystem client each time)."""
        return self._remote_tiers.get_or_create(remote_tier_key(config),
                                                lambda: open_remote_tier(config))

    def _run_deletions(self) -> None:
        """Perform the registry's due deletions outside the lock; failures stay queued.

        Recording a deletion's outcome that raises (``deletion_done``, which queues a
        failed deletion again first) is counted and kept for ``status`` like the
        background loop's errors, and the other deletions taken go on: raised at once,
        those after it stayed listed as running for good and never ran."""
        with self._deletion_lock:
            with self._lock:
                due = self.registry.take_due_deletions()
            for deletion in due:
                error = self.registry.perform_deletion(deletion)
                try:
                    with self._lock:
                        self.registry.deletion_done(deletion, error)
                except Exception as exc:  # noqa: BLE001 - counted; the deletion is queued
                    self._loop_failed(exc)

    def _background_loop(self) -> None:
        """Expire orphans every ``EXPIRY_CHECK_INTERVAL_S``; run queued and failed
        deletions as they come due. An error is counted and kept for ``status``, never
        allowed to end the loop."""
        last_expiry = last_job_sweep = time.monotonic()
        while True:
            self._wake.wait(DELETION_CHECK_INTERVAL_S)
            self._wake.clear()
            try:
                if time.monotonic() - last_expiry >= EXPIRY_CHECK_INTERVAL_S:
                    last_expiry = time.monotonic()
                    with self._lock:
                        jobs = self.registry.driver_jobs()
                    dead = dead_ray_jobs(jobs) if jobs else set()  # a GCS call: unlocked
                    with self._changing():
                        self.registry.expire(dead)
                self._run_deletions()
                if time.monotonic() - last_job_sweep >= JOB_WORKER_SWEEP_S:
                    last_job_sweep = time.monotonic()
                    end_workers_of_ended_jobs(self.namespace)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any bug
                self._loop_failed(exc)

    def _loop_failed(self, exc: BaseException) -> None:
        """Count a failed turn of the background loop and keep its error for ``status``,
        without the credentials of any shuffle it may quote."""
        with self._lock:
            self.loop_errors += 1
            # Its class until its text is scrubbed: an error whose text cannot be had (a
            # str() that raises) must not end the loop from inside its own handler.
            self.last_loop_error = type(exc).__name__
            with contextlib.suppress(Exception):
                self.last_loop_error = self.registry.scrub_secrets(
                    f"{type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock for a call that changes the books, then wake the waiting long
        polls (each checks whether the change gave it something)."""
        with self._lock:
            try:
                yield
            finally:  # a call that failed may have changed the books too (an aborted attempt)
                self._changed.notify_all()

    def _queued(self) -> None:
        """A call may have queued deletions: let the background thread run them now."""
        if self.registry.pending:
            self._wake.set()

    def deletions_left(self, prefix: str) -> int:
        """Deletions not done of the shuffles whose id starts with ``prefix``
        (``ShuffleRegistry.deletions_left``)."""
        with self._lock:
            return self.registry.deletions_left(str(prefix))

    def run_deletions(self) -> list[dict[str, Any]]:
        """Run due deletions now; returns those still pending (for tests and operators)."""
        self._run_deletions()
        with self._lock:
            return self.registry.pending_deletions()

    # ---- the API (each a locked call into the registry) --------------------------------------
    def register(self, shuffle_id: str, num_maps: int | None, num_subpartitions: int,
                 config: ShuffleConfig, recoverable: bool = False,
                 maps_begun_on: list[str] | None = None,
                 driver_job: str | None = None) -> None:
        with self._changing():  # expire may release shuffles that readers poll for
            self.registry.expire()
            self.registry.register(shuffle_id, num_maps, num_subpartitions, config,
                                   recoverable, maps_begun_on, driver_job)
        self._queued()

    def seal(self, shuffle_id: str, num_maps: int,
             attempts: dict[int, int] | None = None) -> None:
        with self._changing():
            self.registry.seal(shuffle_id, num_maps, attempts)
        self._queued()

    def heartbeat(self, shuffle_id: str) -> None:
        with self._lock:
            self.registry.heartbeat(shuffle_id)

    def begin_map(self, shuffle_id: str, map_index: int, node_id: str, pid: int) -> int | None:
        with self._changing():
            result = self.registry.begin_map(shuffle_id, map_index, node_id, pid)
        self._queued()
        return result

    def commit(self, shuffle_id: str, map_index: int, attempt: int,
               metas: list[SegmentMeta], pid: int = 0) -> bool:
        with self._changing():
            result = self.registry.commit(shuffle_id, map_index, attempt, metas, pid)
        self._queued()
        return result

    def finish_map(self, shuffle_id: str, map_index: int, attempt: int, stats: Any,
                   last_segments: list[SegmentMeta] | None = None, pid: int = 0,
                   row_digests: dict[int, int] | None = None) -> bool:
        with self._changing():
            result = self.registry.finish_map(shuffle_id, map_index, attempt, stats,
                                              last_segments or (), pid, row_digests)
        self._queued()
        return result

    def report_lost(self, shuffle_id: str, map_index: int, attempt: int) -> bool:
        with self._changing():
            return self.registry.report_lost(shuffle_id, map_index, attempt)

    def take_lost(self, shuffle_id: str) -> list[int]:
        with self._lock:
            return self.registry.take_lost(shuffle_id)

    @ray.method(concurrency_group="poll")
    def poll(self, shuffle_id: str, subpartition: int, cursors: dict, pid: int,
             wait_s: float = 0.0) -> PollResult:
        """The reader's news (``ShuffleRegistry.poll``). With nothing new and the
        subpartition not complete, wait up to ``wait_s`` (at most ``max_poll_wait_s``,
        ``MAX_POLL_WAIT_S``) for a change before answering; ``PollResult.waited_s`` says how
        long it waited."""
        start = time.monotonic()
        deadline = start + max(0.0, min(float(wait_s), self._max_poll_wait_s))
        with self._lock:
            # Answer once a batch of news is in (``ShuffleRegistry.poll_batch``), a map
            # was reset, the subpartition is complete, or at the deadline with what there is.
            batch = self.registry.poll_batch(shuffle_id) if wait_s > 0 else 1
            while True:
                result = self.registry.poll(shuffle_id, subpartition, cursors, pid,
                                            record=False)
                remaining = deadline - time.monotonic()
                news = sum(len(u.segments) for u in result.updates)
                if result.done or news >= batch or remaining <= 0 \
                        or any(u.reset for u in result.updates):
                    break
                self._changed.wait(remaining)
            result = self.registry.poll(shuffle_id, subpartition, cursors, pid)
            return dataclasses.replace(result, waited_s=time.monotonic() - start)

    def free_subpartitions(self, shuffle_id: str, subpartitions: list[int]) -> int:
        with self._lock:
            result = self.registry.free_subpartitions(shuffle_id, subpartitions)
        self._queued()
        return result

    def release(self, shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
        """Forget the shuffle and have its data deleted: normally gone when this returns,
        which is after at most ``release_wait_s`` (``_await_deletions``). A deletion that
        fails (storage down) or is not done by then never raises here: it stays queued and
        is retried until the data is gone (``status()['pending_deletions']``), so a
        caller's own error is not masked."""
        with self._changing():
            released = self.registry.release(shuffle_id, reason, failed)
            queued = self._queued_releases([shuffle_id])
        self._await_deletions(queued)
        return released

    def summarize_and_release(self, shuffle_id: str) -> ShuffleSummary:
        """A shuffle's books (``summary``) taken as it is released (``release``): one
        call, not two, at the end of a shuffle that succeeded, where the cores idle
        while the driver waits for each answer."""
        with self._changing():
            summary = self.registry.summary(shuffle_id)
            self.registry.release(shuffle_id)
            queued = self._queued_releases([shuffle_id])
        self._await_deletions(queued)
        return summary

    def _queued_releases(self, shuffle_ids: Sequence[str]) -> list[PendingDeletion]:
        """The queued deletions of all the data of ``shuffle_ids`` (under the lock)."""
        ids = set(shuffle_ids)
        return [d for d in self.registry.pending
                if d.metas is None and d.state.shuffle_id in ids]

    def _await_deletions(self, deletions: Sequence[PendingDeletion]) -> None:
        """Have the background thread run ``deletions`` now, and wait until each was tried
        once, at most ``release_wait_s`` in all: the data is normally gone when a release
        answers, and a store or tier manager that hangs never holds the caller past its
        call bound (it once timed out a driver whose shuffle had succeeded) nor one of
        the master's threads for long. A deletion not done goes on, retried, meanwhile."""
        if not deletions:
            return
        self._wake.set()
        deadline = time.monotonic() + self._release_wait_s
        for deletion in deletions:
            if not deletion.tried.wait(max(0.0, deadline - time.monotonic())):
                return

    def node_id(self) -> str:
        """The node the master runs on (the head node)."""
        return ray.get_runtime_context().get_node_id()

    def expire(self) -> list[str]:
        with self._changing():
            result = self.registry.expire()
        self._queued()
        return result

    def summary(self, shuffle_id: str) -> ShuffleSummary:
        with self._lock:
            return self.registry.summary(shuffle_id)

    def segments(self, shuffle_id: str) -> list[SegmentMeta]:
        with self._lock:
            return self.registry.segments(shuffle_id)

    def memory_segments_on(self, node_id: str
                           ) -> list[tuple[str, ShuffleConfig, list[SegmentMeta]]]:
        """``ShuffleRegistry.memory_segments_on``: asked by a tier manager as it starts."""
        with self._lock:
            return self.registry.memory_segments_on(node_id)

    def live_shuffles(self) -> dict[str, str]:
        """Shuffle id -> job id of every live shuffle (read-only; ``hybrid-ray cleanup``)."""
        with self._lock:
            return self.registry.live_shuffles()

    def progress(self, shuffle_id: str) -> dict[str, Any]:
        """Producers and readers of a shuffle (pids, segments): for status and fault tests."""
        with self._lock:
            state = self.registry.state(shuffle_id)
            return {
                "maps": [{"attempt": m.current_attempt, "finished": m.finished_attempt,
                          "pid": m.pid, "node_id": m.node_id,
                          "segments": sum(len(v) for v in m.segments.get(m.current_attempt, {}).values()),
                          "segments_per_tier": dict(collections.Counter(
                              meta.tier.value
                              for v in m.segments.get(m.current_attempt, {}).values()
                              for meta in v))}
                         for m in state.maps],
                "readers": {s: dataclasses.asdict(r) for s, r in state.readers.items()},
            }

    # ---- the JVM shuffle manager (JSON strings in and out: see hybrid_ray.spark_jvm) ------
    def spark_tier_manager(self, node_id: str) -> str:
        """Start ``node_id``'s tier manager if it is not running (Java cannot start a
        Python actor with a node affinity)."""
        get_tier_manager(node_id, self.namespace)
        return "ok"

    def spark_register(self, request: str) -> str:
        """A Spark shuffle the driver registered (``spark_jvm.register``)."""
        with self._changing():
            spark_jvm.register(self.registry, json.loads(request), self._spark_sessions.get)
        self._queued()
        return "ok"

    def spark_commit(self, request: str) -> str:
        # Wakes readers waiting for this attempt (``spark_await_blocks``): a map task sends
        # its last commit without waiting for it.
        try:
            with self._changing():
                spark_jvm.commit(self.registry, json.loads(request), self._spark_sessions.get)
        finally:  # a failed commit aborts its attempt: its segments are queued for deletion
            self._queued()
        return "ok"

    def spark_open_session(self, token: str, config: Any) -> None:
        """Hold a Spark session's whole ShuffleConfig (remote tier and its credentials
        included) under ``token``, the only part of it in Spark's configuration."""
        with self._lock:
            self._spark_sessions.open(token, config)

    def _config_in_use(self, config: ShuffleConfig) -> bool:
        """Whether a live shuffle was registered with ``config`` (this very object: a Spark
        session's, see ``SparkSessions``). Called with the lock held."""
        return any(self.registry.state(s).config is config for s in self.registry.shuffle_ids())

    def spark_session_config(self, token: str) -> Any:
        """The ShuffleConfig of an open Spark session, or None (for the tier managers)."""
        with self._lock:
            return self._spark_sessions.get(token)

    def spark_abort(self, request: str) -> str:
        # Wakes readers waiting for this attempt (``spark_await_blocks``): it will not
        # finish now, so they stop waiting at once (they slept to their bound).
        with self._changing():
            spark_jvm.abort(self.registry, json.loads(request))
        self._queued()
        return "ok"

    def spark_executor_lost(self, request: str) -> str:
        """Spark removed an executor: drop the map attempts it wrote (see
        ``spark_jvm.executor_lost``); answers how many."""
        with self._changing():
            dropped = spark_jvm.executor_lost(self.registry, json.loads(request))
        self._queued()
        return json.dumps({"dropped": dropped})

    def spark_locate(self, request: str) -> str:
        with self._lock:
            return json.dumps(spark_jvm.locate(self.registry, json.loads(request)))

    @ray.method(concurrency_group="poll")
    def spark_await_blocks(self, request: str) -> str:
        """``spark_locate``'s per-block form, waiting up to ``wait_s`` (at most
        ``max_poll_wait_s``) while some block is not complete: a JVM map task sends its last
        commit without waiting, so a reader can ask for an attempt Spark already accepted
        before that commit is in. ``awaited`` in the answer: every missing block may still come;
        ``lost``: the indices of those that will not (``spark_jvm.missing_blocks``). The JVM
        reader fails the fetch of a lost one, else asks again until its own bound."""
        parsed = json.loads(request)
        deadline = time.monotonic() + max(0.0, min(float(parsed.get("wait_s", 0.0)),
                                                   self._max_poll_wait_s))
        with self._lock:
            while True:
                answer = spark_jvm.locate(self.registry, parsed)
                answer.update(spark_jvm.missing_blocks(self.registry, parsed, answer))
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not answer["awaited"]:
                    return json.dumps(answer)
                self._changed.wait(remaining)

    def spark_heartbeat(self, request: str) -> str:
        with self._lock:
            for shuffle_id in spark_jvm.matching(self.registry, json.loads(request)):
                self.registry.heartbeat(shuffle_id)
        return "ok"

    def spark_release(self, request: str) -> str:
        """Release Spark shuffles (``shuffles`` and/or all ids with ``prefix``), keeping
        their summaries for ``spark_reports``."""
        parsed = json.loads(request)
        # _changing: readers long-polling (poll, spark_await_blocks) learn of the release
        # now, not at their 1 s bound.
        with self._changing():
            ids = spark_jvm.matching(self.registry, parsed)
            if parsed.get("close_session"):
                self._spark_sessions.close(str(parsed["close_session"]))
            for shuffle_id in ids:
                if spark_jvm.has_started(self.registry, shuffle_id):
                    done = spark_jvm.summary(self.registry, shuffle_id)
                    done["released"] = True
                    self._spark_history.append(done)
                self.registry.release(shuffle_id)
            queued = self._queued_releases(ids)
        self._await_deletions(queued)
        return json.dumps({"released": ids})

    def spark_fallback(self, request: str) -> str:
        """A Spark shuffle that Spark's own shuffle serves (barrier stage, push-based):
        kept among the session's summaries so ``spark_shuffle_reports`` says so."""
        with self._lock:
            self._spark_history.append(spark_jvm.fallback_summary(json.loads(request)))
        return "ok"

    def spark_reports(self, prefix: str) -> list[dict[str, Any]]:
        """Summaries of the Spark shuffles whose id starts with ``prefix``: released ones
        (oldest first), then live ones."""
        with self._lock:
            out = [s for s in self._spark_history if s["shuffle_id"].startswith(prefix)]
            out += [spark_jvm.summary(self.registry, s) for s in self.registry.shuffle_ids()
                    if s.startswith(prefix) and spark_jvm.has_started(self.registry, s)]
        return out

    def status(self) -> dict[str, Any]:
        with self._lock:
            shuffles = [self.registry.summary(s).for_status()
                        for s in self.registry.shuffle_ids()]
            nodes = {n for s in self.registry.shuffle_ids() for n in self.registry.state(s).nodes}
        usage, unanswered = usage_of_nodes(self.namespace)
        with self._lock:
            pending = self.registry.pending_deletions()
        return {"shuffles": shuffles, "nodes": usage, "unanswered_nodes": unanswered,
                "active_nodes": sorted(nodes), "pending_deletions": pending,
                "background_errors": {"count": self.loop_errors,
                                      "last": self.last_loop_error}}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=WORKER_MAX_RETRIES)
class ShuffleWorkerActor:
    """A long-lived process that runs map or reduce functions, one at a time.

    Why not Ray tasks: hybrid reducers hold no CPU (they mostly wait for data), so each
    one needs a worker process beyond Ray's pool of one per CPU, and Ray kills such extra
    idle workers after a second. Every shuffle then paid for new processes importing Ray,
    pyarrow and hybrid_ray: ~1.3 CPU-s each, a fifth of the CPU of a 1 GiB shuffle on two
    cores (profiled with py-spy). Detached workers stay warm across shuffles.

    Writers (map side) also own the memory-tier objects they put: being long-lived, they
    can, and each segment is then written to the object store once. A map task instead had
    to hand its segments to the tier manager to own, as task arguments the manager put
    again (Ray 2.56 removed ``ray.put(_owner=...)``): two object-store writes per segment,
    and on this VM every fresh object-store page costs more than the copy itself. If a
    writer dies, so do its objects; readers report the loss and the driver re-runs those
    maps (``ShuffleRegistry.report_lost``).
    """

    def __init__(self) -> None:
        # Asked once per process (a GCS lookup), for map_task's retry check: Ray runs a
        # task again in the restarted process of an actor that died running it. Set
        # through a module function, not a ``global`` statement here: Ray ships actor
        # classes pickled by value, so this method's globals are a copy of the module's,
        # and a flag set in them was never seen by ``restarted_worker`` (a map retried
        # after its writer died wrote as its dead run's attempt: rows came out twice).
        _set_restarted_worker(bool(ray.get_runtime_context().was_current_actor_reconstructed))

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def run_packed(self, packed: tuple[Any, tuple], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, *common, **kwargs)`` for ``packed = (fn, common)``: the arguments
        every map (or reducer) of a shuffle shares, passed as the ref of one object put
        once per shuffle (``pack_call``). Sent with each call, the driver serialised the
        function, partitioner, config, schema and master handle for every map and reducer
        (profiled: 20 ms of its CPU per 1 GiB shuffle, a quarter of it)."""
        fn, common = packed
        return fn(*args, *common, **kwargs)


def pack_call(fn: Callable[..., Any], common: Sequence[Any]) -> ray.ObjectRef:
    """The ref of ``(fn, common)`` for ``ShuffleWorkerActor.run_packed``."""
    return ray.put((fn, tuple(common)))


# Whether this process is a worker actor started again after its predecessor died
# (None: not a worker actor). See ``ShuffleWorkerActor.__init__``.
_RESTARTED_WORKER: bool | None = None


def _set_restarted_worker(restarted: bool) -> None:
    global _RESTARTED_WORKER
    _RESTARTED_WORKER = restarted


def restarted_worker() -> bool:
    """True in a worker actor's process that Ray started again after the previous one
    died: calls it runs may be Ray's retries of calls that died with that process."""
    return bool(_RESTARTED_WORKER)


def _alive_cpu_nodes() -> list[dict]:
    nodes = [n for n in ray.nodes()
             if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(nodes, key=lambda n: n["NodeID"])


def _job_worker_tag() -> str:
    """"" for a caller in Ray's default runtime environment, else ``job<id>_``: a job
    with a runtime environment of its own (a working_dir, pip packages, env_vars) gets
    writers and readers of its own, ended by the master after the job ended
    (``end_workers_of_ended_jobs``). Shared, the namespace's kept workers ran
    every later job's maps with the first job's code and environment variables: a later
    job's partitioner was not found ("No module named ..."), or ran as the first job's
    version, and the first job's credentials served the later job's remote tier."""
    env = dict(ray.get_runtime_context().runtime_env or {})
    if env.get("env_vars") == WORKER_ENV:  # called inside one of our own workers
        env.pop("env_vars")
    return f"{JOB_TAG}{ray.get_runtime_context().get_job_id()}_" if env else ""


# What starts the job tag in a job's own workers' names (``_job_worker_tag``).
JOB_TAG = "job"


def worker_name(prefix: str, node: str, k: int, tag: str | None = None) -> str:
    """The name of writer or reader ``k`` of ``node`` for the calling job; ``tag``:
    ``_job_worker_tag()``, looked up here if not given (callers naming many take it once)."""
    return f"{prefix}{_job_worker_tag() if tag is None else tag}{node}_{k}"


def _worker(name: str, node: str, namespace: str) -> Any:
    """Writer or reader ``name`` (``worker_name``) of ``node``, started if not running."""
    # Hard affinity: with soft affinity Ray placed a new node's writer on the driver's node
    # about half the time on a fresh two-node cluster (its view of the new node lagging),
    # leaving that node's CPUs idle and its tier manager unused. If the node dies, the
    # worker dies with it, as does the node's tier manager and every segment on it: the
    # shuffle in flight fails loudly, and later ones use only the alive nodes.
    return _get_or_start(ShuffleWorkerActor, name, namespace,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                         runtime_env={"env_vars": WORKER_ENV})


def dead_ray_jobs(jobs: set[str]) -> set[str]:
    """Those of ``jobs`` (Ray job ids, hex) that Ray's job table counts dead; a job it
    does not list is not counted dead."""
    return {job["JobID"] for job in ray._private.state.jobs()
            if job.get("IsDead") and job.get("JobID") in jobs}


def driver_job_id() -> str | None:
    """The Ray job id of this process if it is a driver, else None: a worker, e.g. a
    detached actor that runs shuffles, outlives the job that started it, so that job's
    end says nothing about it."""
    worker = ray._private.worker.global_worker
    if worker.mode != ray._private.worker.SCRIPT_MODE:
        return None
    return ray.get_runtime_context().get_job_id()


def end_workers_of_ended_jobs(namespace: str) -> list[str]:
    """Kill the writers and readers of jobs that ended (``_job_worker_tag``); returns
    their names. They are detached like the shared ones (owned by whichever process asked
    first, a task's or an actor's, they died with it, and a second thread's lookup handle
    did not keep them alive), so the master ends them once Ray's job table says their
    job is dead. A job Ray does not list is left alone."""
    tagged = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != namespace:
            continue
        for prefix in (WRITER_PREFIX, READER_PREFIX):
            if name.startswith(prefix + JOB_TAG):
                tagged[name] = name[len(prefix) + len(JOB_TAG):].split("_", 1)[0]
    if not tagged:
        return []
    dead = dead_ray_jobs(set(tagged.values()))
    ended = []
    for name, job in tagged.items():
        if job in dead:
            try:
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            except ValueError:  # gone meanwhile
                continue
            ended.append(name)
    return ended


def _worker_nodes(nodes: list[dict]) -> list[str]:
    """Ids of the nodes that get writers and readers (the driver's if none has CPUs)."""
    return [n["NodeID"] for n in nodes] or [ray.get_runtime_context().get_node_id()]


# Writers a node with at least two CPUs gets beyond one per CPU. A writer blocks many times
# a map: on the object store (creating and sealing each memory segment), its tier manager
# (leases), the master (commits) and page-cache writes of disk segments. With exactly one
# writer per CPU, a core idled whenever every writer of its node waited at once: 6.4-7.1% of
# a 2-core node's time in a warm 1 GiB repartition, 4.1-4.5% with one spare writer, at the
# same control-plane share and speed (``python -m benchmarks.cpu_by_process --size 1
# --rounds 6``, A/B/A/B; README, Architecture, "Since 37b02ad"). A spare costs a process (its
# imports and warm-up heap, see ``warm_up_worker``), no CPU reservation: workers ask for
# none. A one-CPU node gets none: it would double the writers' processes and map memory on
# what is usually a small node, and on the suite's simulated one-CPU nodes (4 on 2 cores)
# rounds were 4-25% slower with it (four A/B pairs).
SPARE_WRITERS_PER_NODE = 1


def writers_per_node(cpus: int) -> int:
    """Writers on a node with ``cpus`` CPUs: one per CPU, plus SPARE_WRITERS_PER_NODE
    where there are at least two."""
    cpus = max(1, int(cpus))
    return cpus + (SPARE_WRITERS_PER_NODE if cpus >= 2 else 0)


def _writer_slots(nodes: list[dict]) -> list[tuple[str, int]]:
    """(node, k) of every writer: ``writers_per_node`` of each node, node by node."""
    cpus = {n["NodeID"]: int(n["Resources"]["CPU"]) for n in nodes}
    return [(node, k) for node in _worker_nodes(nodes)
            for k in range(writers_per_node(cpus.get(node, 1)))]


def _reader_slots(nodes: list[dict], count: int) -> list[tuple[str, int]]:
    """(node, k) of ``count`` readers spread evenly over the nodes."""
    ids = _worker_nodes(nodes)
    return [(node, k) for k in range(-(-count // len(ids))) for node in ids][:count]


def get_readers(namespace: str, count: int) -> list[Any]:
    """``count`` reader actors spread evenly over the alive nodes with CPUs, started (and
    kept) on first use. Reader ``k`` of a node keeps its name across shuffles."""
    return [actor for _, actor in get_reader_slots(namespace, count)]


def get_reader_slots(namespace: str, count: int) -> list[tuple[str, Any]]:
    """``get_readers`` as (node id, actor) pairs."""
    tag = _job_worker_tag()
    return [(node, _worker(worker_name(READER_PREFIX, node, k, tag), node, namespace))
            for node, k in _reader_slots(_alive_cpu_nodes(), count)]


def get_writers(namespace: str) -> list[tuple[str, Any]]:
    """The writer actors of every alive node (``writers_per_node``: one per CPU and a
    spare on nodes with two or more), as (node id, actor): maps run on the node that holds
    their input block, as many at once as the node has writers."""
    tag = _job_worker_tag()
    return [(node, _worker(worker_name(WRITER_PREFIX, node, k, tag), node, namespace))
            for node, k in _writer_slots(_alive_cpu_nodes())]


def get_master(namespace: str) -> Any:
    """The namespace's shuffle master, started on first use, on the head node: the
    cluster ends with the head node anyway, so pinning it there means no other node's
    loss can take the books of every shuffle with it."""
    return _get_or_start(ShuffleMasterActor, MASTER_NAME, namespace, namespace,
                         resources={HEAD_NODE_RESOURCE: 0.001})


def master_handle(namespace: str) -> Any:
    """The running master of ``namespace`` (never starts one); raises
    ``ShuffleMasterLostError`` if there is none."""
    from hybrid_ray.errors import ShuffleMasterLostError

    try:
        return ray.get_actor(MASTER_NAME, namespace=namespace)
    except ValueError:
        raise ShuffleMasterLostError(
            f"the hybrid_ray shuffle master of namespace {namespace!r} is gone (its node "
            "died or it was killed); the shuffles it tracked cannot finish: run them "
            "again") from None


# Bound on ``start_actors(wait=True)`` (``hybrid_ray.init``) waiting for every actor to
# answer: a new process imports Ray, pyarrow and hybrid_ray (~1.3 CPU-s each on a 2-core
# VM), and Ray starts at most a node's CPU count of them at once.
START_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ActorSlot:
    """One actor the shuffles of a namespace use: its name in the namespace, the node it
    runs on, and its handle."""

    name: str
    node_id: str
    handle: Any = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class ShuffleActors:
    """Every actor the shuffles of ``namespace`` use (``start_actors``): the master on the
    head node, a tier manager per node with CPUs, the writers of those nodes (one per CPU
    and a spare on nodes with two or more: ``writers_per_node``), and the readers."""

    namespace: str
    master: ActorSlot
    tier_managers: tuple[ActorSlot, ...]
    writers: tuple[ActorSlot, ...]
    readers: tuple[ActorSlot, ...]

    def all(self) -> tuple[ActorSlot, ...]:
        return (self.master, *self.tier_managers, *self.writers, *self.readers)


def _head_node_id() -> str:
    """The head node's id (where the master is pinned): the node with Ray's head resource."""
    for node in ray.nodes():
        if node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def start_actors(namespace: str, num_readers: int, *, wait: bool = False,
                 timeout_s: float = START_TIMEOUT_S, compression: str = "lz4",
                 remote_protocol: str | None = None, heap_bytes: int = 0) -> ShuffleActors:
    """Every actor the shuffles of ``namespace`` need, started (detached) where not running.

    Each actor is a process of its own, and a new one imports Ray, pyarrow and hybrid_ray
    (~1.3 CPU-s on a 2-core VM). Started one after another on first use (the master, then
    the writers, each starting its node's tier manager in its first map, then the readers),
    they made a first 1,000-row shuffle take 13.7 s where a warm one takes 0.33 s. Here
    every handle is created before anything is waited for, so Ray starts the processes side
    by side (at most a node's CPU count at a time: Ray's start-up concurrency), in the order
    a first map needs them: the master (the driver registers the shuffle with it before any
    map runs), the tier managers, the writers, then the readers. The master and tier
    managers run in Ray's default runtime environment, so they can take the worker
    processes Ray starts ahead (one per CPU, with Ray already imported); writers and
    readers run with ``WORKER_ENV`` and need processes of their own anyway (an actor
    holds its process for life).

    With ``wait``, returns once each actor answered one cheap call, bounded by
    ``timeout_s``; writers and readers also run ``warm_up_worker``, so what a process
    initialises lazily on its first map or reduce is done before the first shuffle
    (``compression``: the codec to initialise; ``remote_protocol``: the remote tier's
    filesystem to import; ``heap_bytes``: the map chunk to size their memory for).
    Raises ``ActorStartError`` naming the actors that failed or did not answer.
    """
    nodes = _alive_cpu_nodes()
    master = ActorSlot(MASTER_NAME, _head_node_id(), get_master(namespace))
    tier_managers = tuple(ActorSlot(TIER_MANAGER_PREFIX + node, node,
                                    get_tier_manager(node, namespace))
                          for node in _worker_nodes(nodes))
    tag = _job_worker_tag()

    def worker_slot(prefix: str, node: str, k: int) -> ActorSlot:
        name = worker_name(prefix, node, k, tag)
        return ActorSlot(name, node, _worker(name, node, namespace))
    writers = tuple(worker_slot(WRITER_PREFIX, node, k) for node, k in _writer_slots(nodes))
    readers = tuple(worker_slot(READER_PREFIX, node, k)
                    for node, k in _reader_slots(nodes, num_readers))
    actors = ShuffleActors(namespace, master, tier_managers, writers, readers)
    if wait:
        _wait_until_ready(actors, timeout_s, compression, remote_protocol, heap_bytes)
    return actors


def _wait_until_ready(actors: ShuffleActors, timeout_s: float, compression: str,
                      remote_protocol: str | None, heap_bytes: int) -> None:
    """One cheap call per actor, all in flight at once, waited for within ``timeout_s``."""
    calls = {actors.master.handle.live_shuffles.remote(): actors.master}
    calls.update({tm.handle.usage.remote(): tm for tm in actors.tier_managers})
    calls.update({w.handle.run.remote(warm_up_worker, compression, remote_protocol,
                                      heap_bytes): w
                  for w in (*actors.writers, *actors.readers)})
    ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    problems = [f"{calls[ref].name} on node {calls[ref].node_id}: no answer in "
                f"{timeout_s:g} s" for ref in pending]
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - collected and raised together below
            problems.append(f"{calls[ref].name} on node {calls[ref].node_id}: "
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")
    if problems:
        from hybrid_ray.errors import ActorStartError

        raise ActorStartError(
            f"{len(problems)} of the {len(calls)} hybrid_ray actors of namespace "
            f"{actors.namespace!r} did not start: " + "; ".join(problems) + ". Check that "
            "Ray can start worker processes on those nodes (`ray status`, and the raylet "
            "and worker logs under the session's logs directory), or give init a longer "
            "timeout_s on a loaded machine")


def warm_up_worker(compression: str = "lz4", remote_protocol: str | None = None,
                   heap_bytes: int = 0) -> int:
    """Run in a new writer or reader: a tiny map and read of the real data path (segments
    encoded without compression and with ``compression``), so the imports and
    initialisations its first map or reduce would pay for happen now (pyarrow imports
    pandas on first converting a NumPy array: ~0.5 CPU-s on a 2-core VM), and the remote
    tier's filesystem (s3fs for ``s3``) is imported.

    ``heap_bytes``: then partition and encode a chunk of about that size, as a map does
    with each ``map_chunk_bytes`` of its block, so the process's allocator and its
    thread's segment arena hold the memory a map needs. On this VM a fresh page costs more
    than the copy into it: a new process's first 128 MiB of maps took 0.75 CPU-s, the next
    0.30 (``WORKER_ENV`` keeps the freed pages warm for the next chunks and shuffles).
    Returns the process id."""
    import fsspec
    import numpy as np
    import pyarrow as pa

    from hybrid_ray.config import Compression
    from hybrid_ray.partitioning import HashPartitioner, split_by_partition
    from hybrid_ray.segment import (
        SegmentId, decode_segment, encode_segment, thread_scratch_arena,
    )

    table = pa.table({"key": pa.array(np.arange(4, dtype=np.int64)),
                      "value": pa.array([b"a", b"b", b"c", b"d"], pa.binary(1))})
    parts = HashPartitioner(["key"]).assign(table, 0, 2)
    for sub, part in split_by_partition(table, np.asarray(parts), 2):
        segment = SegmentId("shf-000000000000", 0, sub, 0)
        for codec in {Compression.NONE, Compression(compression)}:
            decode_segment(encode_segment(part, segment, codec), segment,
                           TierName.MEMORY)
    pa.concat_tables([table, table]).combine_chunks()
    if heap_bytes > 0:
        rows = max(1, heap_bytes // 100)
        # Distinct keys spread the rows over the subpartitions; a zero payload is never
        # written here (calloc'd), only the copies a map makes of it are.
        chunk = pa.table({"key": pa.array(np.arange(rows, dtype=np.int64)),
                          "payload": pa.FixedSizeBinaryArray.from_buffers(
                              pa.binary(92), rows,
                              [None, pa.py_buffer(np.zeros(rows * 92, np.uint8))])})
        arena = thread_scratch_arena()
        arena.reset()
        split = split_by_partition(chunk, HashPartitioner(["key"]).assign(chunk, 0, 16), 16)
        encoded = [encode_segment(part, SegmentId("shf-000000000000", 0, sub, 0),
                                  Compression.NONE, arena) for sub, part in split]
        del split, encoded, chunk
    if remote_protocol:
        fsspec.get_filesystem_class(remote_protocol)
    return os.getpid()


def reader_count(config: ShuffleConfig) -> int:
    """Kept (named) readers a shuffle with ``config`` uses: ``max_concurrent_reducers``,
    else one per CPU of the cluster, never more than one per CPU (a window beyond the CPUs
    adds readers owned by that one shuffle: see ``shuffle._ReaderPool``)."""
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    return min(config.max_concurrent_reducers or cpus, cpus)
