"""The books of Spark shuffles written by the JVM shuffle manager
(``org.apache.spark.shuffle.hybridray.HybridRayShuffleManager``, built from ``jvm/``).

Its executors and driver call the namespace's shuffle master and their node's tier manager
cross-language. Only strings, bytes and numbers cross that boundary (a Python dict return
throws in Java), so every call takes one JSON string and returns one; the functions here
are what the actors' ``spark_*`` methods run, on the same ``ShuffleRegistry`` and
``TierManager`` as the Ray shuffles: same budgets, same release, TTL and ``status``.

A Spark shuffle is an open shuffle of the registry (its map count is Spark's business):
each Spark map attempt (Spark's task attempt id, the ``mapId`` of its ``MapStatus``)
becomes one registry attempt of its map index. Which attempt counts is decided by Spark's
``MapOutputTracker``; readers ask for the attempts it lists (``locate``), so a failed,
killed or speculative attempt is never read. Memory-tier segments are objects owned by the
executor that put them; their ``location`` is the serialized Java ``ObjectRef`` (id and
owner, base64), which only the JVM reads.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.errors import (
    ConfigError, ShuffleNotFoundError, ShuffleReleasedError, ShuffleStalledError,
)
from hybrid_ray.ids import check_id
from hybrid_ray.master import ShuffleRegistry, ShuffleState
from hybrid_ray.segment import SegmentId, SegmentMeta
from hybrid_ray.tier_manager import ReserveToken, TierManager
from hybrid_ray.tiers import Grant

_LOG = logging.getLogger(__name__)

# ShuffleConfig fields the JVM path carries in Spark's configuration. The remote tier's
# fields are not among them: ``remote_path`` and ``storage_options`` (credentials) must
# never reach Spark's configuration, where the UI, event logs and error messages show them.
# ``spark_bridge.init_spark`` hands the whole config to the shuffle master under a random
# session token instead (``SESSION_FIELD``), and the actors look it up from there; the
# remote tier's I/O runs in the tier managers (fsspec), so a JVM never needs Hadoop's S3A.
JVM_CONFIG_FIELDS = ("memory_fraction", "memory_capacity_bytes", "spill_dirs",
                     "min_reserve_fraction", "disk_capacity_bytes", "segment_bytes", "spilling",
                     "memory_weight", "job_id", "orphan_ttl_s", "namespace")
# The field of a JVM request's config holding the session token: the key the master hands
# the session's whole config (remote-tier credentials included) out under. It is never in
# Spark's configuration: PySpark's launch_gateway passes every Spark config as ``--conf``
# on spark-submit's command line, which any local user can read (``ps``), and Spark's
# redaction covers only its UI and event logs. The driver's JVM reads the token from a file
# (``SESSION_FILE_FIELD``), its executors from the shuffle handles of their tasks.
SESSION_FIELD = "session_token"
# The field of ``spark.hybridray.config`` holding the path of the file (0600, in a 0700
# directory on the driver's node) the driver's JVM reads the session token from while Spark
# starts; ``spark_bridge.init_spark`` removes it once Spark has started.
SESSION_FILE_FIELD = "session_file"
# The field of a JVM request's config saying whether its session has a remote tier (a
# bool; the tier's path and credentials stay with the master). It lets the master say so
# when it no longer knows the session and the shuffle runs on memory and disk only.
REMOTE_TIER_FIELD = "remote_tier"
# What a tier manager answers a JVM reader for a segment that is gone (its file or object
# removed): a segment is never empty (it has a header), and a Python error's type does not
# reach Java. The reader tells Spark the map output is lost (FetchFailedException) only
# then; a call that fails (a store or actor not answering) fails the task, which Spark
# retries, instead of making Spark drop and recompute every output of the writer.
GONE = b""
# Released Spark shuffles whose summaries the master keeps for ``spark_shuffle_reports``.
SPARK_HISTORY = 1000
# Spark sessions whose full ShuffleConfig the master keeps (the oldest are forgotten first;
# a session's config is dropped at ``stop_spark`` anyway).
SPARK_SESSIONS = 64


def config_to_json(config: ShuffleConfig, session_file: str = "") -> str:
    """The part of ``config`` the JVM shuffle manager passes back to the actors, with the
    path of the file holding the session token under which the master holds the whole
    config (if any; never the token itself, see ``SESSION_FIELD``)."""
    out: dict[str, Any] = {SESSION_FILE_FIELD: session_file} if session_file else {}
    out[REMOTE_TIER_FIELD] = config.remote_path is not None
    for name in JVM_CONFIG_FIELDS:
        value = getattr(config, name)
        if name == "spill_dirs":
            value = list(value)
        elif name == "segment_bytes":
            value = {TierName.parse(k).value: v for k, v in value.items()}
        elif hasattr(value, "value"):
            value = value.value
        out[name] = value
    return json.dumps(out, sort_keys=True)


def config_from_json(data: Mapping[str, Any] | None) -> ShuffleConfig:
    """A validated ShuffleConfig from what ``config_to_json`` produced ({} = defaults).
    A key it does not know is a ConfigError: spark.hybridray.config may be written by
    hand (README), and a misspelt key ("spill_dir") or a remote tier given there was
    dropped silently, the shuffles running on the defaults."""
    data = data or {}
    unknown = sorted(set(data) - set(JVM_CONFIG_FIELDS)
                     - {SESSION_FIELD, SESSION_FILE_FIELD, REMOTE_TIER_FIELD})
    if unknown:
        remote = [k for k in unknown if k in ("remote_path", "storage_options")]
        raise ConfigError(
            f"spark.hybridray.config has key(s) {unknown} it does not take; it takes "
            f"{sorted(JVM_CONFIG_FIELDS)}"
            + ("; a remote tier is given to spark_bridge.init_spark(shuffle_config=...), "
               "which keeps its credentials out of Spark's configuration" if remote else ""))
    fields = {k: v for k, v in data.items() if k in JVM_CONFIG_FIELDS}
    return ShuffleConfig(progress=False, **fields)


SessionLookup = Callable[[str], "ShuffleConfig | None"]


def resolve_config(data: Mapping[str, Any] | None, sessions: SessionLookup) -> ShuffleConfig:
    """The config a JVM request stands for: its session's whole config where the master
    holds one (remote tier included), else the fields the request carries. A session
    token the master does not know (a driver that started Spark without ``init_spark``,
    or a master restarted since) falls back to the carried fields: memory and disk only."""
    token = (data or {}).get(SESSION_FIELD)
    if token:
        config = sessions(str(token))
        if config is not None:
            return config
    return config_from_json(data)


def unknown_session_note(data: Mapping[str, Any] | None, sessions: SessionLookup) -> str:
    """What a shuffle's report must say when its session asked for a remote tier the
    shuffle will not have: the master no longer knows the session (restarted since, or the
    session was stopped), so ``resolve_config`` falls back to memory and disk. "" if not."""
    token = (data or {}).get(SESSION_FIELD)
    if not token or not (data or {}).get(REMOTE_TIER_FIELD) or sessions(str(token)) is not None:
        return ""
    return ("remote tier off: the shuffle master does not know this Spark session (it was "
            "restarted, or the session was stopped), so this shuffle stores its data in "
            "memory and on disk only; stop_spark and init_spark again to use the remote tier")


class SparkSessions:
    """The master's table of Spark sessions' whole configs, by session token.

    ``in_use``: whether a live shuffle was registered with a config (the master's books).
    Past ``SPARK_SESSIONS`` the oldest sessions are forgotten, but never one a live
    shuffle uses: its later shuffles were registered with the fields Spark's conf carries,
    which hold no remote tier, so their remote segments (written by tier managers that
    still knew the session) were never deleted, and its reads failed."""

    def __init__(self, in_use: Callable[[ShuffleConfig], bool] | None = None) -> None:
        self._configs: collections.OrderedDict[str, ShuffleConfig] = collections.OrderedDict()
        self._in_use = in_use or (lambda config: False)

    def open(self, token: str, config: ShuffleConfig) -> None:
        check_id("session token", token)
        if not isinstance(config, ShuffleConfig):
            raise ConfigError(f"a Spark session's config must be a ShuffleConfig, got "
                              f"{type(config).__name__}")
        self._configs[token] = config
        self._configs.move_to_end(token)
        if len(self._configs) > SPARK_SESSIONS:
            idle = [t for t, c in self._configs.items() if t != token and not self._in_use(c)]
            for old in idle[:len(self._configs) - SPARK_SESSIONS]:
                del self._configs[old]

    def close(self, token: str) -> None:
        self._configs.pop(token, None)

    def get(self, token: str) -> ShuffleConfig | None:
        return self._configs.get(token)


# ---- shuffle master -------------------------------------------------------------------------
def _ensure_registered(registry: ShuffleRegistry, request: Mapping[str, Any],
                       sessions: SessionLookup) -> ShuffleState:
    shuffle_id = request["shuffle"]
    if shuffle_id not in registry.shuffle_ids():
        if shuffle_id in registry.released:
            raise ShuffleNotFoundError(f"Spark shuffle {shuffle_id!r} was released; a late "
                                       "map attempt cannot write to it")
        registry.register(shuffle_id, None, int(request["num_partitions"]),
                          resolve_config(request.get("config"), sessions))
        early = registry.spark_early_aborts.pop(shuffle_id, None)
        if early:
            registry.state(shuffle_id).spark_aborted.update(early)
        note = unknown_session_note(request.get("config"), sessions)
        if note:
            # Said once per shuffle: in the master's log (shown on the driver's console)
            # and in the shuffle's report, not silently.
            _LOG.warning("Spark shuffle %s: %s", shuffle_id, note)
            registry.state(shuffle_id).notes.append(note)
    return registry.state(shuffle_id)


def register(registry: ShuffleRegistry, request: Mapping[str, Any],
             sessions: SessionLookup) -> None:
    """Register a Spark shuffle when the driver's shuffle manager registers it, before any
    of its map tasks runs (``{shuffle, num_partitions, config}``; registering again is a
    no-op). A task's first call (its memory lease) registers the shuffle on its node's tier
    manager, and a tier manager releases a shuffle the master does not know for two sweeps
    (``actors.ORPHAN_SWEEP_GRACE``): registered only at its first commit, a shuffle whose
    map tasks ran longer than a minute before committing was released under them."""
    registry.heartbeat(_ensure_registered(registry, request, sessions).shuffle_id)


def has_started(registry: ShuffleRegistry, shuffle_id: str) -> bool:
    """Whether a map task of the Spark shuffle committed (a shuffle is registered when
    Spark plans it; one whose stage never ran, e.g. reused under AQE, has no report)."""
    return bool(registry.state(shuffle_id).maps)


def commit(registry: ShuffleRegistry, request: Mapping[str, Any],
           sessions: SessionLookup) -> None:
    """Publish a batch of a map attempt's segments; ``final`` marks its output complete.
    Segments: ``[partition, index, tier, nbytes, location, books]`` (``books``, the
    books that granted its space, may be left out: see ``settle``).

    A commit that fails here aborts its attempt (``abort``) before the error goes back:
    its output can never be complete, and a map task sends its last commit without
    waiting, so readers waiting for that attempt (``spark_await_blocks``) would otherwise
    wait out their whole bound (``commitWaitMs``) before Spark runs the map again."""
    try:
        _commit(registry, request, sessions)
    except Exception:
        try:
            abort(registry, request)
        except Exception:  # noqa: BLE001 - the commit's own error is the one to raise
            pass  # (a request without shuffle or map id, a shuffle released meanwhile)
        raise


def _commit(registry: ShuffleRegistry, request: Mapping[str, Any],
            sessions: SessionLookup) -> None:
    state = _ensure_registered(registry, request, sessions)
    shuffle_id = state.shuffle_id
    registry.heartbeat(shuffle_id)
    map_id, map_index, node = int(request["map_id"]), int(request["map_index"]), request["node"]
    malformed = next((s for s in request["segments"]
                      if not isinstance(s, list) or len(s) not in (5, 6)), None)
    if malformed is not None:
        # Checked before the attempt's books change. Unpacked as they were, a seventh
        # element and beyond were dropped silently (a writer of another version meaning
        # something by them).
        raise ValueError(f"a segment of a Spark commit is [partition, index, tier, nbytes, "
                         f"location] with an optional books entry, got {malformed!r}")
    executor = request.get("executor")
    if isinstance(executor, str) and 0 < len(executor) <= MAX_EXECUTOR_ID_CHARS:
        state.spark_executors.setdefault(map_id, executor)
        if _written_before_loss(registry, shuffle_id, executor, map_id):
            # Sent before its executor died, delivered after the loss was handled: kept,
            # nobody read it (Spark recomputed the executor's maps) and its files and
            # books stayed until the shuffle's release. Dropped as an abort drops one.
            abort(registry, {"shuffle": shuffle_id, "map_id": map_id})
    if map_id in state.spark_finished:
        # A commit of an attempt already finished can only be its last commit delivered
        # again (a retried call): its segments are the published ones. Taken as a refused
        # commit, they were queued for deletion: the files of an attempt Spark accepted.
        return
    entry = state.spark_attempts.get(map_id)
    if entry is None:
        attempt = registry.begin_map(shuffle_id, map_index, node, 0)
        entry = (map_index, attempt)
        # Kept also for an aborted attempt: each later commit of it began a registry
        # attempt of its own, dropped again, and the report counted one failed Spark
        # attempt as several retried ones (found by a review).
        state.spark_attempts[map_id] = entry
    map_index, attempt = entry
    # A sixth element names the books that granted the segment's space (see ``settle``):
    # freed by a tier manager started again, it gives back nothing it never counted.
    metas = [SegmentMeta(SegmentId(shuffle_id, map_index, int(sub), int(index), attempt,
                                   state.config.job_id),
                         TierName(tier), int(nbytes), 0, node_id=node, location=location,
                         granted_by=jvm_books(books[0] if books else None))
             for sub, index, tier, nbytes, location, *books in request["segments"]]
    published = registry.commit(shuffle_id, map_index, attempt, metas)
    if map_id in state.spark_aborted:
        # Its abort ran first: these segments go the way the abort sent the rest (refused
        # by ``commit``, and so deleted, once the attempt is dropped).
        if published:
            registry.drop_attempt(shuffle_id, map_index, attempt)
        return
    if request.get("final"):
        registry.finish_map(shuffle_id, map_index, attempt, None)
        state.spark_finished.add(map_id)


# Longest executor id a commit may name (``executor_lost``); Spark's are short numbers.
MAX_EXECUTOR_ID_CHARS = 128
# Removed executors the master remembers (``ShuffleRegistry.spark_lost_executors``).
LOST_EXECUTORS_KEPT = 4096


def _written_before_loss(registry: ShuffleRegistry, shuffle_id: str, executor: str,
                         map_id: int) -> bool:
    """Whether Spark map attempt ``map_id`` ran on ``executor`` before Spark removed it.
    Task attempt ids grow through an application, so an executor RayDP restarted under
    the same id runs attempts above the last one launched before the removal."""
    return any(shuffle_id.startswith(prefix) and map_id <= last
               for (prefix, lost), last in registry.spark_lost_executors.items()
               if lost == executor)


def executor_lost(registry: ShuffleRegistry, request: Mapping[str, Any]) -> int:
    """Spark removed executor ``executor`` of the application whose shuffles start with
    ``prefix``: drop every map attempt it wrote (as ``abort`` does), returning how many.

    Its memory-tier objects died with it (Ray objects live with their owner), and without
    an external shuffle service Spark forgets all its map outputs and recomputes them
    before any reader asks, so nobody reads them again. Kept, the dead attempts stayed
    in the node's books until the shuffle's release (a review measured 60 MiB counted
    against 48 MiB in the store), shrinking the memory tier for the rest of the session,
    and their disk files stayed too.

    ``last_task``: the highest task attempt id Spark launched on the executor (-1 if
    unknown); a commit of one of its attempts that arrives later is dropped too."""
    executor, prefix = request.get("executor"), request.get("prefix")
    if not isinstance(executor, str) or not executor or not isinstance(prefix, str) \
            or not prefix.startswith("spark-"):
        raise ValueError(f"spark_executor_lost needs an executor id and a Spark application "
                         f"prefix, got executor={executor!r} prefix={prefix!r}")
    last_task = request.get("last_task", -1)
    if isinstance(last_task, bool) or not isinstance(last_task, int):
        raise ValueError(f"spark_executor_lost's last_task must be a task attempt id, got "
                         f"{last_task!r}")
    if last_task >= 0:
        lost = registry.spark_lost_executors
        lost[(prefix, executor)] = max(last_task, lost.get((prefix, executor), -1))
        lost.move_to_end((prefix, executor))
        while len(lost) > LOST_EXECUTORS_KEPT:
            lost.popitem(last=False)
    dropped = 0
    for shuffle_id in matching(registry, {"prefix": prefix}):
        state = registry.state(shuffle_id)
        for map_id in [m for m, e in state.spark_executors.items() if e == executor]:
            del state.spark_executors[map_id]
            abort(registry, {"shuffle": shuffle_id, "map_id": map_id})
            dropped += 1
    return dropped


# Shuffles whose early aborts (``abort``) the master keeps at most, and aborts per shuffle.
EARLY_ABORT_SHUFFLES_KEPT = 256
EARLY_ABORTS_PER_SHUFFLE = 65536


def abort(registry: ShuffleRegistry, request: Mapping[str, Any]) -> None:
    """A map attempt failed after committing some segments: delete them, and any commit of
    it that arrives later (``ShuffleState.spark_aborted``).

    An abort of a shuffle not registered yet is kept and applied at its registration: the
    driver's registration is best effort, and an attempt's last commit (which registers
    the shuffle) and its abort are both sent without waiting, so on the master's threads
    the abort may run first. Dropped, it let that commit publish the failed attempt as
    finished, its segments kept until the release (found by a review)."""
    shuffle_id = request["shuffle"]
    if shuffle_id not in registry.shuffle_ids():
        if shuffle_id not in registry.released:
            early = registry.spark_early_aborts.setdefault(shuffle_id, set())
            registry.spark_early_aborts.move_to_end(shuffle_id)
            if len(early) < EARLY_ABORTS_PER_SHUFFLE:
                early.add(int(request["map_id"]))
            while len(registry.spark_early_aborts) > EARLY_ABORT_SHUFFLES_KEPT:
                registry.spark_early_aborts.popitem(last=False)
        return
    state = registry.state(shuffle_id)
    map_id = int(request["map_id"])
    if map_id in state.spark_aborted:
        return  # aborted already (an abort delivered again, an executor's loss after it)
    state.spark_aborted.add(map_id)
    entry = state.spark_attempts.get(map_id)
    if entry is not None:
        registry.drop_attempt(shuffle_id, *entry)


def _block_segments(m: Any, attempt: int, partition: int) -> list[list[Any]] | None:
    """A complete block's ``[[tier, nbytes, node, location], ...]`` in index order, or None
    if some segment of it is missing (a gap)."""
    metas = sorted(m.segments[attempt].get(partition, []), key=lambda s: s.id.index)
    if [s.id.index for s in metas] != list(range(len(metas))):
        return None
    return [[s.tier.value, s.nbytes, s.node_id, s.location] for s in metas]


def _finished(state: ShuffleState, map_id: int) -> tuple[Any, int] | None:
    """The map state and registry attempt of Spark attempt ``map_id`` if its output is
    complete here, else None (never committed, lost, aborted)."""
    entry = state.spark_attempts.get(map_id)
    if entry is None:
        return None
    map_index, attempt = entry
    m = state.maps[map_index]
    if attempt not in m.done_attempts or attempt not in m.segments:
        return None
    return m, attempt


def locate(registry: ShuffleRegistry, request: Mapping[str, Any]) -> dict[str, Any]:
    """Segments of Spark blocks, in one of two forms.

    ``blocks``: ``[[map_id, partition], ...]``; the answer's ``blocks`` has per block
    ``[[tier, nbytes, node, location], ...]`` in index order, or None if that attempt's
    output is not complete here (lost, aborted, released): the reader then raises
    FetchFailedException.

    ``maps`` and ``partitions`` (``[start, end)`` each): every block of every finished
    attempt of those map indices, as ``[map_id, partition, segments or None]`` in the
    answer's ``attempts``. A reader sends this before it asks Spark's MapOutputTracker
    which attempts count, so the two round trips overlap; it then reads only the attempts
    Spark lists (a finished loser of a speculative pair is in the answer, never read)."""
    state = _state_unless_not_yet_known(registry, request["shuffle"])
    if state is None:  # nothing of it committed yet (see _state_unless_not_yet_known)
        if "maps" in request:
            return {"attempts": []}
        return {"blocks": [None] * len(request["blocks"])}
    registry.heartbeat(state.shuffle_id)
    if "maps" in request:
        map_start, map_end = (int(v) for v in request["maps"])
        part_start, part_end = (int(v) for v in request["partitions"])
        found: list[Any] = []
        for map_id in sorted(state.spark_attempts):
            if not map_start <= state.spark_attempts[map_id][0] < map_end:
                continue
            done = _finished(state, map_id)
            if done is None:
                continue
            m, attempt = done
            partitions = [p for p in m.segments[attempt] if part_start <= p < part_end]
            for partition in sorted(partitions):
                found.append([map_id, partition, _block_segments(m, attempt, partition)])
        return {"attempts": found}
    out: list[Any] = []
    for map_id, partition in request["blocks"]:
        done = _finished(state, int(map_id))
        out.append(None if done is None else _block_segments(*done, int(partition)))
    return {"blocks": out}


def _state_unless_not_yet_known(registry: ShuffleRegistry,
                                shuffle_id: str) -> ShuffleState | None:
    """The shuffle's books, or None if the master has never heard of it: its driver's
    registration (sent without waiting) did not arrive, and its map tasks' last commits,
    which register it too, are still in their executors' senders. A reader then waits for
    them (``missing_blocks``) as for any last commit; answered with the error, it raised
    FetchFailedException and Spark recomputed every output of a healthy executor. A
    released shuffle still raises (``ShuffleReleasedError`` names the release)."""
    try:
        return registry.state(shuffle_id)
    except ShuffleReleasedError:
        raise
    except ShuffleNotFoundError:
        return None


def missing_blocks(registry: ShuffleRegistry, request: Mapping[str, Any],
                   answer: Mapping[str, Any]) -> dict[str, Any]:
    """What a per-block ``locate`` answer lacks, for ``spark_await_blocks``'s answer.

    ``lost``: indices (into the request's ``blocks``) of missing blocks whose attempt
    finished and was lost since, or was aborted (its task failed, or a commit of it
    failed): no commit of it will come, so the reader raises FetchFailedException for one
    of these at once, naming a map whose output is really gone. Not the first missing
    block in order: that one may be of an attempt whose last commit (sent by its task
    without waiting) is still to come, and blaming it made Spark drop every output of a
    healthy executor while the lost map stayed registered.

    ``awaited``: some block is missing, none of them is lost, so all may still come and
    the reader's ask may wait for them."""
    state = _state_unless_not_yet_known(registry, request["shuffle"])
    if state is None:  # every block may still come with its attempt's last commit
        return {"awaited": bool(request.get("blocks")), "lost": []}
    missing = [(i, int(map_id)) for i, ((map_id, _), segments)
               in enumerate(zip(request.get("blocks", ()), answer.get("blocks", ())))
               if segments is None]
    lost = [i for i, m in missing if m in state.spark_finished or m in state.spark_aborted]
    return {"awaited": bool(missing) and not lost, "lost": lost}


def matching(registry: ShuffleRegistry, request: Mapping[str, Any]) -> list[str]:
    """Live Spark shuffle ids named by ``shuffles`` or starting with ``prefix``."""
    named = set(request.get("shuffles") or ())
    prefix = request.get("prefix")
    return [s for s in registry.shuffle_ids()
            if s in named or (prefix and s.startswith(prefix))]


def summary(registry: ShuffleRegistry, shuffle_id: str) -> dict[str, Any]:
    """What a Spark shuffle stored: bytes and segments per node and tier of the map
    attempts that completed (a speculative duplicate counts too), for reports."""
    state = registry.state(shuffle_id)
    per_node_tier: dict[str, dict[str, list[int]]] = collections.defaultdict(dict)
    for m in state.maps:
        for attempt in m.done_attempts:
            for metas in m.segments.get(attempt, {}).values():
                for meta in metas:
                    pair = per_node_tier[meta.node_id].setdefault(meta.tier.value, [0, 0])
                    pair[0] += meta.nbytes
                    pair[1] += 1
    return {
        "shuffle_id": shuffle_id,
        "num_maps": sum(1 for m in state.maps if m.done_attempts),
        "num_partitions": state.num_subpartitions,
        "per_node_tier": {n: {t: tuple(v) for t, v in tiers.items()}
                          for n, tiers in per_node_tier.items()},
        "superseded_attempts": state.superseded_attempts,
        "spilling": state.config.spilling.value,
        "age_s": registry.now() - state.created,
        "released": False,
        "notes": list(state.notes),
    }


def fallback_summary(request: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a Spark shuffle served by Spark's own shuffle, with the reason."""
    shuffle_id = check_id("shuffle", request["shuffle"])
    return {"shuffle_id": shuffle_id, "num_maps": int(request.get("num_maps", 0)),
            "num_partitions": int(request.get("num_partitions", 0)), "per_node_tier": {},
            "superseded_attempts": 0, "spilling": "none", "age_s": 0.0, "released": True,
            "fallback": str(request.get("reason", ""))[:300]}


# ---- tier manager ---------------------------------------------------------------------------
# A grant crosses to Java as what it is: its tier, size and target. A JVM writer settles it
# by sending those back with the bytes it wrote, so the tier manager keeps no record per
# grant: it once kept every grant by number until settled, and a memory grant written in
# full, which changes no books (``Tier.settle_changes_books``), still cost each map task a
# settle call (about 5 ms of a 15 ms write on a small exchange: ``HRPROF``, session-local).
SETTLE_TIERS = (TierName.MEMORY, TierName.DISK)


def settle(tm: TierManager, shuffle_id: str, settlements: Any) -> None:
    """Settle a JVM writer's grants of ``shuffle_id``: each ``[tier, granted bytes,
    target, written bytes or None]`` (None: nothing was written, the space goes back). A
    shuffle no longer registered here (released meanwhile) has nothing to settle.

    A fifth element names the books that granted it (``books`` of the reservation's or
    lease's answer, ``TierManager.books_id``): a tier manager started again after one
    died ignores its predecessor's grants, whose bytes it never counted. Without it, any
    tier manager counted the settlement, and a stale one gave back room that live grants
    of the new tier manager still held (found by a review)."""
    settled = []
    for entry in settlements or ():
        if not isinstance(entry, (list, tuple)) or len(entry) not in (4, 5):
            raise ConfigError(f"a JVM settlement must be [tier, granted bytes, target, "
                              f"written bytes or null, books], got {entry!r}")
        tier, granted, target, written = entry[:4]
        books = jvm_books(entry[4] if len(entry) == 5 else None)
        name = TierName.parse(tier)
        if name not in SETTLE_TIERS:
            raise ConfigError(f"a JVM settlement names tier {tier!r}; only "
                              f"{[t.value for t in SETTLE_TIERS]} grant space")
        if int(granted) < 0 or (written is not None and int(written) < 0):
            raise ConfigError(f"a JVM settlement has negative bytes: {entry!r}")
        settled.append((Grant(name, int(granted), str(target), granted_by=books),
                        None if written is None else int(written)))
    if settled:
        tm.settle(check_id("shuffle", shuffle_id), settled)


def jvm_books(value: Any) -> str:
    """A books id a JVM writer sent back (``TierManager.books_id``, or "" / None where it
    had none: counted by whichever tier manager gets it)."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 64:
        raise ConfigError(f"a JVM grant's books id must be a string of at most 64 "
                          f"characters, got {value!r}")
    return value


def _registered_here(tm: TierManager, request: Mapping[str, Any],
                     sessions: SessionLookup) -> str:
    """The request's shuffle id, registered on ``tm`` with the request's config first if
    this is the node's first JVM call for it."""
    shuffle_id = request["shuffle"]
    if shuffle_id not in tm.shuffle_ids():
        tm.register_shuffle(shuffle_id, resolve_config(request.get("config"), sessions))
    return shuffle_id


def reserve(tm: TierManager, request: Mapping[str, Any],
            sessions: SessionLookup) -> dict[str, Any]:
    """Room for a batch of segments (``sizes``), after settling earlier grants
    (``settle``, see ``settle``): per segment ``{tier, target, settle_if_written,
    refusals}``; tier None when no local tier can take it (refusals say why).
    ``settle_if_written``: whether the grant must be settled even when written in full
    (``Tier.settle_changes_books``; a grant not used always is). ``remote`` says whether
    the shuffle has a remote tier for those (``write_remote``)."""
    shuffle_id = _registered_here(tm, request, sessions)
    settle(tm, shuffle_id, request.get("settle"))
    token = reserve_token(request)
    out = []
    placements = tm.reserve(shuffle_id, [int(n) for n in request["sizes"]], tracked=False,
                            token=token)
    try:
        for placement in placements:
            if placement.grant is None:
                out.append({"tier": None, "target": "",
                            "refusals": list(placement.refusals)})
                continue
            grant = placement.grant
            if grant.tier == TierName.DISK:
                tm.mark_disk_target(shuffle_id, grant.target)
            out.append({"tier": grant.tier.value, "target": grant.target,
                        "settle_if_written": tm.settle_changes_books(shuffle_id, grant,
                                                                     grant.nbytes),
                        "books": tm.books_id, "refusals": []})
    except BaseException:
        # The call fails, so the JVM never hears of these grants and never settles them:
        # given back now (as TierManager.reserve does for a tier failing part-way). Kept,
        # a disk grant whose directory could not be marked (EDQUOT, which statvfs does not
        # show) stayed in flight, refusing room on that filesystem until the release.
        # Through the token where there is one, so a cancel of this call gives nothing back
        # twice.
        if token is None or not tm.cancel_reserve(shuffle_id, token):
            tm.settle(shuffle_id, [(p.grant, None) for p in placements
                                   if p.grant is not None])
        raise
    return {"placements": out, "remote": tm.remote_tier(shuffle_id) is not None}


def reserve_token(request: Mapping[str, Any]) -> ReserveToken | None:
    """The ``ReserveToken`` a JVM writer names its reservation with (``token_writer``, a
    short string unique per writer, and ``token_sequence``, counting its calls), or None
    for a request without one."""
    writer, sequence = request.get("token_writer"), request.get("token_sequence")
    if writer is None and sequence is None:
        return None
    if not isinstance(writer, str) or not 0 < len(writer) <= 64 \
            or isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 0:
        raise ConfigError(f"a JVM reservation's token must be a writer name of 1-64 "
                          f"characters and a sequence number >= 0, got {writer!r} and "
                          f"{sequence!r}")
    return ReserveToken(writer, sequence)


def cancel_reserve(tm: TierManager, request: Mapping[str, Any]) -> int:
    """Give back what a JVM writer's reservation granted when the writer never got the
    answer (its call timed out) and is aborting (``TierManager.cancel_reserve``). Returns
    the grants given back."""
    token = reserve_token(request)
    if token is None:
        raise ConfigError("a JVM reservation cancel needs token_writer and token_sequence")
    return tm.cancel_reserve(check_id("shuffle", request["shuffle"]), token)


def lease(tm: TierManager, request: Mapping[str, Any], sessions: SessionLookup) -> dict[str, Any]:
    """A memory lease for a JVM map task (``bytes``), asked for when the task starts so
    the round trip overlaps its work: ``{"lease": {"granted", "target"}}``, or
    ``{"lease": None}`` when the memory tier cannot take it all (the task then reserves
    per batch, as without a lease). The writer splits the lease into its segments'
    grants and settles the rest as an unused grant (``settle``)."""
    nbytes = request.get("bytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise ConfigError(f"a memory lease request needs 'bytes' as an integer, got "
                          f"{nbytes!r}")
    shuffle_id = _registered_here(tm, request, sessions)
    grant = tm.lease_memory(shuffle_id, nbytes)
    return {"lease": None if grant is None else {"granted": grant.nbytes,
                                                 "target": grant.target,
                                                 "books": tm.books_id}}


def write_remote(tm: TierManager, request: Mapping[str, Any], frame: bytes) -> dict[str, Any]:
    """Store one JVM segment (``frame``: header and payload as the JVM encoded it) in the
    shuffle's remote tier, at the path a Python segment of the same identity would get
    (the map attempt's Spark task attempt id as its attempt); returns its ``location``."""
    shuffle_id = request["shuffle"]
    if shuffle_id not in tm.shuffle_ids() and tm.was_released(shuffle_id):
        # Not a config without remote_path (the message below sent users to fix one that
        # was right): the shuffle is gone here, and a late map's segment with it.
        raise ShuffleReleasedError(f"Spark shuffle {shuffle_id!r} was released on node "
                                   f"{tm.node_id}; a map of it cannot store segments")
    tier = tm.remote_tier(shuffle_id) if shuffle_id in tm.shuffle_ids() else None
    if tier is None:
        raise ConfigError(f"Spark shuffle {shuffle_id!r} has no remote tier on node "
                          f"{tm.node_id} (start Spark with a ShuffleConfig that has "
                          "remote_path, through spark_bridge.init_spark)")
    segment = SegmentId(shuffle_id, *(_segment_number(request, field) for field in
                                      ("map_index", "partition", "index", "map_id")),
                        tier.job_id)
    # On the tier's transfer threads, waited for within its bound (``RemoteTier.outcome``):
    # this runs in the tier manager, one call at a time, and a sync filesystem (NFS through
    # file://) has no per-call deadline: a hung one held the tier manager for good.
    write = tier.io_pool().submit(tier.write_frame, segment, frame)
    try:
        return {"location": tier.outcome(write, f"writing {segment}", len(frame))}
    except ShuffleStalledError:
        # The write goes on; the JVM was told it failed, so nothing will commit it. If it
        # lands, it goes (with the shuffle's tree once released here: the master removes
        # that tree after the tier managers' release, and this write may land after it).
        write.add_done_callback(functools.partial(_drop_late_write, tm, tier, shuffle_id))
        raise


def delete_remote(tm: TierManager, request: Mapping[str, Any]) -> int:
    """Delete remote-tier segments a JVM map attempt stored (``write_remote``) but never
    committed: its batch failed part-way, so the master never heard of them and its abort
    of the attempt could not delete them (they stayed until the shuffle's release).
    ``segments``: ``[[partition, index], ...]`` of map ``map_index``, attempt ``map_id``;
    their paths are derived as ``write_remote`` derived them, never taken from the
    request, so nothing but that attempt's own segments can go. A segment that is not
    there is no error. Returns how many segments were looked for (0 when the shuffle has
    no remote tier here: released meanwhile, its tree goes with the release)."""
    shuffle_id = request["shuffle"]
    tier = tm.remote_tier(shuffle_id) if shuffle_id in tm.shuffle_ids() else None
    pairs = request.get("segments")
    if not isinstance(pairs, list) or any(
            not isinstance(p, list) or len(p) != 2 for p in pairs):
        raise ConfigError(f"a JVM remote delete's segments must be [[partition, index], "
                          f"...], got {pairs!r}")
    if tier is None:
        return 0
    map_index, map_id = (_segment_number(request, f) for f in ("map_index", "map_id"))
    metas = []
    for partition, index in pairs:
        segment = SegmentId(shuffle_id, map_index,
                            _segment_number({"partition": partition}, "partition"),
                            _segment_number({"index": index}, "index"), map_id, tier.job_id)
        metas.append(SegmentMeta(segment, TierName.REMOTE, 0, 0,
                                 location=tier.segment_path(segment)))
    # Every segment is tried: stopping at the first that failed (a store's transient 500)
    # left the others in the store until the shuffle's release. The first error is raised
    # once all were tried. Bounded as write_remote's call is, all together: a hung sync
    # filesystem must not hold the tier manager (waited for in turn, each segment had the
    # whole bound, 600 s, so an attempt's 50 segments held it for over 8 hours).
    pool = tier.io_pool()
    deletes = [(meta, pool.submit(tier.delete, meta)) for meta in metas]
    deadline = time.monotonic() + tier.result_bound_s()
    first_error: Exception | None = None
    for meta, future in deletes:
        try:
            tier.outcome(future, f"deleting {meta.id}",
                         bound_s=deadline - time.monotonic())
        except Exception as exc:  # noqa: BLE001 - raised below, after the others
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return len(metas)


def _segment_number(request: Mapping[str, Any], field: str) -> int:
    """A JVM request's ``field`` that names a segment's object: a whole number >= 0. A
    negative partition was stored as ``sub--0001``, a name no deletion accepts (they
    require ``sub-<digits>``), and the object stayed until the shuffle's whole tree went."""
    value = request.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"a JVM segment request's {field} must be a whole number >= 0, "
                          f"got {value!r}")
    return value


def _drop_late_write(tm: TierManager, tier: Any, shuffle_id: str, write: Any) -> None:
    """Remove a JVM remote write that landed after ``write_remote`` gave up on it."""
    if write.cancelled() or write.exception() is not None:
        return
    try:
        tier.fs.rm_file(write.result(), **tier.deadline())
        if tm.was_released(shuffle_id):
            tier.remove_shuffle_data(shuffle_id)
    except Exception as exc:  # noqa: BLE001 - a leftover for `hybrid-ray cleanup` at worst
        # Scrubbed, and without the traceback: s3fs/botocore quote the endpoint URL, user
        # and password included ('Could not connect to the endpoint URL: "http://user:
        # pass@host/..."'), and the tier manager's log is readable by whoever reads Ray's.
        _LOG.warning("removing a late JVM remote write of shuffle %s failed: %s", shuffle_id,
                     tier.scrub(f"{type(exc).__name__}: {exc}"))


def read_remote(tm: TierManager, request: Mapping[str, Any], sessions: SessionLookup) -> bytes:
    """One JVM segment from the remote tier: ``location`` (checked to lie below the
    config's job directory) and ``nbytes``, for any node's reader."""
    shuffle_id = request["shuffle"]
    if shuffle_id in tm.shuffle_ids() and tm.remote_tier(shuffle_id) is not None:
        tier = tm.remote_tier(shuffle_id)
    else:
        tier = tm.remote_tier_of(resolve_config(request.get("config"), sessions))
    if tier is None:
        raise ConfigError(f"Spark shuffle {shuffle_id!r} has no remote tier in this "
                          "session's ShuffleConfig; a remote segment cannot be read")
    nbytes = int(request["nbytes"])
    what = f"a segment of Spark shuffle {shuffle_id}"
    # Bounded, as write_remote's is: a hung read held the tier manager for good.
    return tier.outcome(tier.io_pool().submit(tier.read_frame, str(request["location"]),
                                              nbytes, what), f"reading {what}", nbytes)
