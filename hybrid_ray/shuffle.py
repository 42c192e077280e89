"""The driver of a distributed hybrid shuffle on Ray, and the Dataset API on top of it.

A shuffle has four parts, each in its own module:

- the map task (``map_task``): one map partition written through the tiers of its node;
- the reduce task (``reduce_task``): one subpartition read from every map, in map order;
- the lifecycle (``lifecycle``): register, run maps, heartbeat, re-run lost maps, report,
  release; the same for every path (Ray Data here, the Spark bridge);
- the driver (here, ``run_shuffle``): plans the maps, runs them (``lifecycle.MapRunner``)
  and the reducers on the actors, and hands the reducers' outputs back.

Public operations (``repartition``, ``sort``, ``random_shuffle``) take and return a
``ray.data.Dataset``; output block i is subpartition i. ``run_shuffle`` is the general entry
point for custom partitioners over lists of Arrow block references.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from hybrid_ray import metrics
from hybrid_ray.actors import get_reader_slots, pack_call, reader_count, start_actors
from hybrid_ray.config import DRIVER_HEARTBEAT_S as HEARTBEAT_S  # noqa: F401 - re-exported
from hybrid_ray.config import ShuffleConfig, ShuffleMode, as_int
from hybrid_ray.errors import (
    ConfigError, ShuffleFailedError, ShuffleMasterLostError, ShuffleStalledError,
)
from hybrid_ray.lifecycle import (  # noqa: F401 - describe_cause re-exported
    MapRunner, ShuffleLifecycle, describe_cause, report_from_summary, report_without_books,
    restart_stuck_worker,
)
from hybrid_ray.map_task import map_block, write_map_partition  # noqa: F401 - re-exported
from hybrid_ray.map_task import BlockPiece, unify_schemas
from hybrid_ray.master import ShuffleSummary
from hybrid_ray.nodes import (
    RESUBMITS_AFTER_WORKER_LOSS, WORKER_LOST_ERRORS, cluster_cpus, lost_with_node,
    worker_process_lost,
)
from hybrid_ray.partitioning import (
    HashPartitioner, MultiKeyRangePartitioner, Partitioner, RandomPartitioner, RangePartitioner,
    range_boundaries, repeated_columns_problem, repeated_names, sort_key_problem,
    sort_key_values, sortable_column, untakeable_column_problem,
)
from hybrid_ray.redaction import Redactor
from hybrid_ray.reduce_task import (  # noqa: F401 - read_subpartition re-exported
    read_subpartition, reduce_partition,
)
from hybrid_ray.report import (
    PhaseTimes, ProgressBar, ReduceTimes, ShuffleReport, forgets_last_report,
)
from hybrid_ray.tiers.remote import open_remote_tier

SAMPLES_PER_BLOCK = 256
# The most partitions a shuffle may have. Every partition costs each map's writer
# bookkeeping (a buffer list, byte count, tier and segment index in the WriteClient, a
# slice per chunk in split_by_partition: about 150 bytes, measured as 1.5 GB at 10**7) and
# at least one segment, master index entry and reader poll per map it receives rows from:
# at 10**7 a shuffle ran for hours. 100,000 keeps a writer's books near 15 MB and a
# partition of a 1 TB shuffle at 10 MB, still a useful read size.
MAX_PARTITIONS = 100_000
# max_concurrent_reducers may exceed the cluster's CPUs (hybrid reducers mostly wait for
# data) by at most this factor. Readers beyond the CPU count are started for one shuffle
# and ended with it; the (named, detached) readers kept across shuffles are at most one
# per CPU.
MAX_REDUCERS_PER_CPU = 4
# Small input blocks are grouped into one map (in input order) until the group reaches a
# target size: a map costs a fixed ~20 ms of round trips (attempt, registration, commits,
# finish) and at least one segment per partition it writes to, so 10,000 one-row blocks
# as 10,000 maps took minutes. The target is map_chunk_bytes / MAP_TARGET_FRACTION, or
# less when the data is small, so that there are still MIN_MAPS_PER_WRITER maps per writer
# to balance the load: the number of maps is bounded by the data's size.
MAP_TARGET_FRACTION = 4
MIN_MAPS_PER_WRITER = 4
# And at most this many blocks per map: each block is one object the writer fetches.
MAX_BLOCKS_PER_MAP = 2048
# The map stage's tail: a writer that finds no map left idles until the others' last maps
# finish, up to one map's time (0.19 s of a 1.96 s warm 1 GiB shuffle on 2 cores: 17
# maps of 64 MB on 2 writers, measured with ray.timeline). So the last large maps, one
# per writer, are each cut into TAIL_PIECES maps of consecutive rows (``_split_tail``):
# the writers then finish within about a piece of each other. A map is large from
# TAIL_SPLIT_MIN_FACTOR times the map target: a small one's tail is short already, and
# every map costs its round trips and a segment per partition.
TAIL_PIECES = 2
TAIL_SPLIT_MIN_FACTOR = 4
# Subpartitions a reader has in hand: the one it reduces and the next, queued behind it in
# the actor, so it starts the moment the first returns instead of after a round trip
# through this driver (those gaps left a core idle for ~0.1 s of a 1 GiB shuffle).
READER_QUEUE_DEPTH = 2
# random_shuffle seeds are in [0, MAX_SEED): NumPy's generators take no negative seeds.
MAX_SEED = 1 << 63

# The report of each thread's most recent shuffle: shuffles run in threads side by side
# must not see each other's (a process-global once returned another thread's report).
_reports = threading.local()

_LOG = logging.getLogger(__name__)


def last_report() -> ShuffleReport | None:
    """The report of the most recent shuffle run by the calling thread (None if it failed
    or was refused, or none ran). The report of a particular result is also on it:
    ``ShuffleResult.report``, ``report_of(dataset)``."""
    return getattr(_reports, "last", None)


def _set_last_report(report: ShuffleReport | None) -> None:
    _reports.last = report


# Every public shuffle call is its thread's most recent as it starts (see last_report).
_most_recent_call = forgets_last_report(lambda: _set_last_report(None))


def report_of(ds: Any) -> ShuffleReport:
    """The report of the shuffle that produced ``ds`` (a Dataset returned by
    ``repartition``, ``sort`` or ``random_shuffle``, or ``.materialize()`` of one)."""
    report = getattr(ds, _REPORT_ATTR, None)
    if report is None:
        report = _report_by_blocks(ds)
    if report is None:
        raise ConfigError("this Dataset was not produced by a hybrid_ray shuffle (or was "
                          "transformed since): keep the Dataset hybrid_ray returned, or use "
                          "hybrid_ray.last_report() right after the call")
    return report


_REPORT_ATTR = "_hybrid_ray_report"
# The reports of the latest results by their blocks' ids, for report_of of a result's
# ``.materialize()``: in Ray 2.60 that is a new Dataset of the same blocks, without the
# attribute. Ids only (bytes): an ObjectRef kept here would pin the blocks.
_REPORTS_BY_BLOCKS: collections.OrderedDict[tuple[bytes, ...], ShuffleReport] = \
    collections.OrderedDict()
REPORTS_BY_BLOCKS_KEPT = 64
_reports_by_blocks_lock = threading.Lock()


def _block_ids(refs: Sequence[ray.ObjectRef]) -> tuple[bytes, ...]:
    return tuple(ref.binary() for ref in refs)


def _remember_report(refs: Sequence[ray.ObjectRef], report: ShuffleReport) -> None:
    if not refs:  # no blocks: any empty dataset would match
        return
    key = _block_ids(refs)
    with _reports_by_blocks_lock:
        _REPORTS_BY_BLOCKS[key] = report
        _REPORTS_BY_BLOCKS.move_to_end(key)
        while len(_REPORTS_BY_BLOCKS) > REPORTS_BY_BLOCKS_KEPT:
            _REPORTS_BY_BLOCKS.popitem(last=False)


def _report_by_blocks(ds: Any) -> ShuffleReport | None:
    """The report of a shuffle result with exactly ``ds``'s blocks (a materialized Dataset
    only: a lazy one is not run to find out), or None."""
    from ray.data.dataset import MaterializedDataset

    if not isinstance(ds, MaterializedDataset) or not _REPORTS_BY_BLOCKS:
        return None
    refs = [entry.ref for bundle in ds.iter_internal_ref_bundles() for entry in bundle.blocks]
    if not refs:
        return None
    with _reports_by_blocks_lock:
        return _REPORTS_BY_BLOCKS.get(_block_ids(refs))


# No CPU asked: a sort must not wait for one (RayDP's executors, or a user's actors, may
# hold every CPU of the cluster; the shuffle's own workers ask none either).
@ray.remote(num_cpus=0)
def _sample_task(key: str, k: int, *blocks: pa.Table) -> np.ndarray:
    """Up to ``k`` sampled non-null, non-NaN keys of each block (nulls and NaNs have a
    partition of their own: see ``RangePartitioner``)."""
    out = []
    for block in blocks:
        column = block.column(key)
        if pa.types.is_dictionary(column.type):
            # Decoded first: a null value in the dictionary is no null of the encoded
            # column, and reached NumPy's sort of the samples ("'<' not supported").
            column = column.cast(column.type.value_type)
        column = pc.drop_null(column)
        if pa.types.is_floating(column.type):
            column = column.filter(pc.invert(pc.is_nan(column)))
        if len(column) == 0:
            continue
        idx = np.random.default_rng(0).choice(len(column), min(k, len(column)), replace=False)
        out.append(sort_key_values(column.take(pa.array(idx))))
    return np.concatenate(out) if out else np.asarray([])


def _block_locations(blocks: Sequence[ray.ObjectRef]
                     ) -> tuple[list[str | None], list[int | None]]:
    """The node holding each block (one of them, if several) and its size in bytes, or
    None where unknown."""
    from ray.experimental import get_object_locations

    locations = get_object_locations(list(blocks)) if blocks else {}
    nodes = [next(iter(locations.get(b, {}).get("node_ids") or []), None) for b in blocks]
    sizes = [locations.get(b, {}).get("object_size") for b in blocks]
    return nodes, sizes


def _group_blocks(sizes: Sequence[int | None], target_bytes: int,
                  max_blocks: int = MAX_BLOCKS_PER_MAP) -> list[list[int]]:
    """Group consecutive block indices into maps of at least ``target_bytes`` (a block of
    unknown size counts as large: it gets a map of its own), at most ``max_blocks`` each.

    Consecutive, so the grouping (and a seeded random shuffle) depends only on the input,
    and rows keep their input order within each output partition.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, size in enumerate(sizes):
        if size is None or size >= target_bytes:
            if current:
                groups.append(current)
                current, current_bytes = [], 0
            groups.append([i])
            continue
        current.append(i)
        current_bytes += size
        if current_bytes >= target_bytes or len(current) >= max_blocks:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    return groups


def _map_target(sizes: Sequence[int | None], config: ShuffleConfig) -> int:
    """The bytes a map aims at (see MAP_TARGET_FRACTION)."""
    total = sum(size or 0 for size in sizes)
    return max(1, min(config.map_chunk_bytes // MAP_TARGET_FRACTION,
                      total // (MIN_MAPS_PER_WRITER * cluster_cpus())))


def _plan_maps(sizes: Sequence[int | None], config: ShuffleConfig) -> list[list[int]]:
    """The blocks of each map (see MAP_TARGET_FRACTION)."""
    return _group_blocks(sizes, _map_target(sizes, config))


def _split_tail(groups: Sequence[Sequence[int]], sizes: Sequence[int | None],
                target_bytes: int, writers: int) -> list[tuple[list[int], int, int]]:
    """The maps as (blocks, piece, pieces): ``groups`` with the last ``writers`` large
    single-block maps (at least TAIL_SPLIT_MIN_FACTOR x ``target_bytes``; unknown sizes
    count as small here) each cut into TAIL_PIECES consecutive pieces (see TAIL_PIECES).
    The pieces stay where their block was, so map order is still input order; only
    shuffles with more maps than writers have a tail to balance."""
    plan = [(list(g), 0, 1) for g in groups]
    if len(groups) <= writers:
        return plan
    large = [i for i, g in enumerate(groups) if len(g) == 1 and sizes[g[0]] is not None
             and sizes[g[0]] >= TAIL_SPLIT_MIN_FACTOR * target_bytes]
    split = set(large[-writers:]) if writers > 0 else set()
    out: list[tuple[list[int], int, int]] = []
    for i, entry in enumerate(plan):
        if i in split:
            out.extend((entry[0], piece, TAIL_PIECES) for piece in range(TAIL_PIECES))
        else:
            out.append(entry)
    return out


def _map_inputs(blocks: Sequence[ray.ObjectRef], config: ShuffleConfig, writers: int
                ) -> tuple[list[Any], list[str | None]]:
    """The input of each map (a block ref, a list of small blocks' refs, or a
    ``BlockPiece`` of a large block at the tail: see ``_split_tail``) and the node to run
    it on (that of its largest block)."""
    nodes, sizes = _block_locations(blocks)
    plan = _split_tail(_plan_maps(sizes, config), sizes, _map_target(sizes, config), writers)
    inputs: list[Any] = []
    input_nodes: list[str | None] = []
    for group, piece, pieces in plan:
        if pieces > 1:
            inputs.append(BlockPiece(blocks[group[0]], piece, pieces))
        else:
            inputs.append(blocks[group[0]] if len(group) == 1 else [blocks[i] for i in group])
        largest = max(group, key=lambda i: sizes[i] or 0)
        input_nodes.append(nodes[largest])
    return inputs, input_nodes


class _ReaderQueues:
    """The subpartitions every shuffle of this driver handed to each reader actor, in the
    order they were submitted (the order a reader runs one caller's calls), and when a
    reducer last returned from each reader (thread-safe). A shuffle whose reducers wait in
    a reader's queue behind another shuffle's is not stalled: a hybrid reducer holds its
    reader until its own shuffle's last map finished. Counting only its own reducers, a
    shuffle failed after ``stall_timeout_s`` (and restarted the readers, killing the
    other shuffle's reducers) while nothing was stuck. The kept readers are shared by
    every shuffle of the namespace; see ``_WriterProgress`` for the writers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[tuple[int, int]]] = {}  # reader -> (pool, sub)
        self._at: dict[str, float] = {}  # reader -> last return (monotonic)

    def add(self, reader: str, pool: int, sub: int) -> None:
        with self._lock:
            self._queues.setdefault(reader, []).append((pool, sub))

    def remove(self, reader: str, pool: int, sub: int, returned: bool) -> None:
        """``sub`` of ``pool`` left ``reader`` (``returned``: its reducer came back)."""
        with self._lock:
            queue = [e for e in self._queues.get(reader, []) if e != (pool, sub)]
            if queue:
                self._queues[reader] = queue
            else:
                self._queues.pop(reader, None)
            if returned:
                self._at[reader] = time.monotonic()

    def behind_others(self, reader: str, pool: int) -> bool:
        """Whether another pool's subpartition is ahead of all of ``pool``'s on
        ``reader``."""
        with self._lock:
            queue = self._queues.get(reader, [])
        first = next((i for i, (p, _) in enumerate(queue) if p == pool), len(queue))
        return any(p != pool for p, _ in queue[:first])

    def latest(self, readers: Sequence[str]) -> float:
        """The last return from any of ``readers`` (monotonic; 0.0: none seen)."""
        with self._lock:
            return max((self._at.get(r, 0.0) for r in readers), default=0.0)


_READER_QUEUES = _ReaderQueues()


class _ReaderPool:
    """The reader actors reducing one shuffle's subpartitions, one at a time each, with
    the next one queued behind it (``READER_QUEUE_DEPTH``) while more wait than there
    are readers.

    The namespace's kept readers (named, one per CPU at most, reused across shuffles),
    and for a window beyond the cluster's CPUs, extra readers owned by this shuffle and
    ended by ``close`` (no process beyond one per CPU outlives its shuffle). A reader
    that died with its node leaves the pool with its node's other readers; readers on the
    nodes still alive take their place.
    """

    def __init__(self, namespace: str, window: int) -> None:
        self._namespace = namespace
        self._window = window
        self._extras: list[tuple[str, Any]] = []
        self.lost_nodes: set[str] = set()
        self._readers = self._fill()  # (node, actor)
        self._busy: dict[str, list[int]] = {}  # reader actor id -> its subpartitions
        self._reader_of: dict[int, str] = {}  # subpartition in hand -> its reader actor id
        self._node_of: dict[int, str] = {}  # subpartition -> node of its reader

    def _fill(self) -> list[tuple[str, Any]]:
        from hybrid_ray.actors import WORKER_ENV, ShuffleWorkerActor
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        kept = [(n, r) for n, r in get_reader_slots(self._namespace,
                                                    min(self._window, cluster_cpus()))
                if n not in self.lost_nodes]
        self._extras = [(n, r) for n, r in self._extras if n not in self.lost_nodes]
        nodes = sorted({n for n, _ in kept}) or [ray.get_runtime_context().get_node_id()]
        while len(kept) + len(self._extras) < self._window:
            node = nodes[len(self._extras) % len(nodes)]
            self._extras.append((node, ShuffleWorkerActor.options(
                num_cpus=0, runtime_env={"env_vars": WORKER_ENV},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()))
        return kept + self._extras

    def _load(self, reader: Any) -> int:
        return len(self._busy.get(_actor_key(reader), ()))

    def has_free(self, depth: int = 1) -> bool:
        """Whether a reader has fewer than ``depth`` subpartitions in hand."""
        return any(self._load(r) < depth for _, r in self._readers)

    def can_take(self, waiting: int) -> bool:
        """Whether to submit one of ``waiting`` subpartitions now: a reader is idle, or
        more wait than there are readers and one has room in its queue
        (``READER_QUEUE_DEPTH``). The last ones are not queued behind a busy reader: a
        slow (skewed) subpartition would hold them while other readers sit idle."""
        if waiting <= 0:
            return False
        return self.has_free(1) or (waiting > len(self._readers)
                                    and self.has_free(READER_QUEUE_DEPTH))

    def submit(self, sub: int, packed: ray.ObjectRef, *args: Any
               ) -> tuple[ray.ObjectRef, ray.ObjectRef, ray.ObjectRef]:
        """Run ``fn(*args, *common)`` for ``packed`` = the ref of ``(fn, common)``
        (``pack_call``; reducing ``sub``) on the reader with the fewest subpartitions in
        hand (queued behind its current one, if any): the refs of its three returns
        (table, stats, times: see ``reduce_partition``)."""
        node, reader = min(self._readers, key=lambda nr: self._load(nr[1]))
        key = _actor_key(reader)
        self._busy.setdefault(key, []).append(sub)
        self._reader_of[sub] = key
        _READER_QUEUES.add(key, id(self), sub)
        self._node_of[sub] = node
        table_ref, stats_ref, times_ref = reader.run_packed.options(
            num_returns=3).remote(packed, *args)
        return table_ref, stats_ref, times_ref

    def done(self, sub: int) -> None:
        """``sub``'s reducer returned (or failed): its reader has one less in hand."""
        self._busy = {k: left for k, subs in self._busy.items()
                      if (left := [s for s in subs if s != sub])}
        key = self._reader_of.pop(sub, None)
        if key is not None:
            _READER_QUEUES.remove(key, id(self), sub, returned=True)

    def _forget(self, keep: set[str] | None = None) -> None:
        """Take this pool's subpartitions off the shared queues of its readers (all, or
        those of readers not in ``keep``)."""
        for sub, key in list(self._reader_of.items()):
            if keep is None or key not in keep:
                del self._reader_of[sub]
                _READER_QUEUES.remove(key, id(self), sub, returned=False)

    def _running_readers(self) -> list[str]:
        """The readers holding this pool's subpartitions with none of another shuffle's
        ahead of them: those reducing for this shuffle now (see ``_ReaderQueues``)."""
        return [k for k in self._busy if not _READER_QUEUES.behind_others(k, id(self))]

    def progress(self) -> float:
        """When a reducer (of any shuffle of this driver) last returned from a reader
        holding this pool's subpartitions (monotonic; 0.0: none seen)."""
        return _READER_QUEUES.latest(list(self._busy))

    def node_of(self, sub: int) -> str | None:
        return self._node_of.get(sub)

    def drop_nodes(self, nodes: set[str]) -> None:
        """Forget readers on ``nodes`` (dead) and fill the pool from the alive nodes."""
        self.lost_nodes |= set(nodes)
        self._readers = self._fill()
        keys = {_actor_key(r) for _, r in self._readers}
        self._busy = {k: subs for k, subs in self._busy.items() if k in keys}
        self._forget(keep=keys)

    def busy_subpartitions(self) -> list[int]:
        """This shuffle's subpartitions its readers reduce now or have queued behind its
        own, not those queued behind another shuffle's reducers (see ``_ReaderQueues``)."""
        return sorted(s for k in self._running_readers() for s in self._busy[k])

    def restart_busy(self, failures: list[str]) -> None:
        """Restart the readers still reducing for this shuffle (stuck: see
        ``MapRunner.check_stalled``); restarts that failed are added to ``failures``."""
        busy = set(self._running_readers())
        for _, reader in self._readers:
            if _actor_key(reader) in busy:
                restart_stuck_worker(reader, failures)

    def close(self) -> None:
        """End this shuffle's extra readers (their output blocks stay: the driver owns
        them)."""
        for _, reader in self._extras:
            ray.kill(reader, no_restart=True)
        self._extras = []
        self._forget()


def _actor_key(actor: Any) -> str:
    return actor._actor_id.hex()


def _check_outputs_survived(refs: Sequence[ray.ObjectRef | None], readers: _ReaderPool
                            ) -> None:
    """After a node died mid-shuffle: an output block that lived on it is gone, and its
    subpartition's segments were freed when its reducer finished, so it cannot be made
    again. Fail now, naming the node, rather than hand out a Dataset with a hole.

    Ray's node table is asked too (one call): a node can die while nothing of the shuffle
    runs there, its maps' lost segments run again elsewhere, and the driver never learns
    that the outputs its readers stored there went with it."""
    output_nodes = {readers.node_of(sub) for sub, ref in enumerate(refs) if ref is not None}
    try:
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
    except Exception as exc:  # noqa: BLE001 - GCS restarting: fall back to what the driver saw
        _LOG.warning("could not read Ray's node table to check that the output blocks' "
                     "nodes are alive (%s: %s); checked only the nodes this driver saw die",
                     type(exc).__name__, exc)
        alive = output_nodes
    dead = readers.lost_nodes | {n for n in output_nodes if n and n not in alive}
    if not dead:
        return
    lost = [sub for sub, ref in enumerate(refs)
            if ref is not None and readers.node_of(sub) in dead]
    if lost:
        nodes = sorted({readers.node_of(sub) for sub in lost})
        raise ShuffleFailedError(
            f"node(s) {', '.join(nodes)} died after reducing partitions {lost}: their output "
            "blocks were stored there and went with the node; run the shuffle again")


@dataclasses.dataclass
class ShuffleResult:
    """Reducer outputs (one Arrow table ref per partition) and the shuffle's report.

    ``block_stats`` holds, per partition, a ref to its (rows, bytes, schema).
    """

    refs: list[ray.ObjectRef]
    report: ShuffleReport
    block_stats: list[ray.ObjectRef] = dataclasses.field(default_factory=list)


@_most_recent_call
def run_shuffle(blocks: Sequence[ray.ObjectRef], num_partitions: int, partitioner: Partitioner,
                schema: pa.Schema, config: ShuffleConfig | None = None,
                operation: str = "custom") -> ShuffleResult:
    """Shuffle Arrow blocks into ``num_partitions`` partitions with ``partitioner``.

    Small blocks are grouped into one map each (see ``_group_blocks``), so the report's
    ``num_maps`` can be lower than ``len(blocks)``. Every block must have ``schema``
    (a block that differs fails the shuffle with both schemas named), and ``schema``
    must have a column: Arrow cannot carry rows without columns through a shuffle.

    Raises ``ConfigError`` for bad arguments (before anything runs), and
    ``ShuffleFailedError`` (after removing all of the shuffle's data) if a map or reduce
    task fails beyond its retries. A master lost once every reducer returned its block
    fails nothing: the output is complete; the report says its books were lost
    (``ShuffleReport.books_lost``).
    """
    config = check_config(config)
    num_partitions = check_num_partitions(num_partitions)
    if not isinstance(operation, str) or not operation.strip() or len(operation) > 64:
        # A number was taken and reached the metrics, whose tags must be strings.
        raise ConfigError(f"operation must be a short name for the report (a non-empty str "
                          f"of at most 64 characters), got {operation!r:.80}")
    # Checked before any actor starts: tables, a generator or a partitioner class failed
    # only later, deep inside the dispatch or a map.
    if isinstance(blocks, (ray.ObjectRef, pa.Table)) or not isinstance(blocks, Sequence):
        raise ConfigError(f"blocks must be a list of ObjectRefs of Arrow tables (ray.put(table) "
                          f"or a Dataset's to_arrow_refs()), got {type(blocks).__name__}")
    wrong = next((b for b in blocks if not isinstance(b, ray.ObjectRef)), None)
    if wrong is not None:
        raise ConfigError(f"blocks must be ObjectRefs of Arrow tables (ray.put(table)), got a "
                          f"{type(wrong).__name__} among them")
    if not isinstance(partitioner, Partitioner):
        raise ConfigError(f"partitioner must be a hybrid_ray Partitioner instance (e.g. "
                          f"HashPartitioner(['key'])), got {partitioner!r}")
    if not isinstance(schema, pa.Schema):
        raise ConfigError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
    if len(schema) == 0:
        raise ConfigError(
            "the blocks to shuffle have no columns: their rows cannot be shuffled (Arrow "
            "drops rows without columns when it takes or encodes them). Add a column, or "
            "count the rows instead of shuffling them")
    problem = repeated_columns_problem(schema) or untakeable_column_problem(schema)
    if problem:  # before the partitioner's check: it looked a repeated key up as missing
        raise ConfigError(problem)
    partitioner.check_schema(schema)
    partitioner.check_partition_count(num_partitions)
    if not ray.is_initialized():
        ray.init()
    window = _reducer_window(config)
    check_remote_tier(config)
    # Every actor at once (a no-op lookup once they run, or after hybrid_ray.init): started
    # one by one on first use, they made a first shuffle many times slower than the next.
    # The lifecycle's clock starts before: the report's startup phase is what a user waits
    # for before the first map.
    started = time.perf_counter()
    actors = start_actors(config.namespace, reader_count(config))
    shuffle = ShuffleLifecycle(config, num_partitions, operation,
                               master=actors.master.handle, started=started)
    inputs, input_nodes = _map_inputs(blocks, config, len(actors.writers))
    shuffle.register(len(inputs), writer_nodes=[w.node_id for w in actors.writers])
    progress = ProgressBar(f"hybrid_ray {operation}", config.progress)
    readers: _ReaderPool | None = None
    try:
        maps = MapRunner(shuffle, [(w.node_id, w.handle) for w in actors.writers], inputs,
                         map_block, (num_partitions, partitioner, config, shuffle.master,
                                     schema), input_nodes)
        readers = _ReaderPool(config.namespace, window)
        reduced = _run_reducers(shuffle, maps, readers, progress, len(inputs), schema,
                                partitioner)
        _check_outputs_survived(reduced.table_refs, readers)
        try:
            summary = shuffle.summarize_and_release()
        except ShuffleMasterLostError as exc:
            # Every reducer has returned its block (stored, owned by this driver): the
            # output is complete and exact, only the books went with the master. Failed
            # here, a whole shuffle's finished output was lost to the user.
            summary, books_lost = None, exc
    except BaseException as exc:
        # No ray.cancel(force=True): force-killing workers here was seen to take the driver
        # down with it. Released, the shuffle is unknown to the master, so tasks still
        # running fail at their next commit or poll, and a map deletes what it wrote.
        error = shuffle.fail(exc)
        if readers is not None:
            readers.close()
        progress.close()
        if error is exc:
            raise
        raise error
    # Every reducer has returned: its block is stored, owned by this driver.
    if summary is None:
        why = _remove_without_master(shuffle, [w.node_id for w in actors.writers], books_lost)
    readers.close()
    progress.update(len(inputs), len(inputs), num_partitions, num_partitions, force=True)
    progress.close()
    ended = time.perf_counter()
    # No map (no input) or no reducer: that phase took no time; startup ran until then.
    first_map = maps.first_dispatch or ended
    phases = PhaseTimes(
        startup=first_map - started,
        map=(maps.last_finish or first_map) - first_map,
        reduce=(reduced.end or ended) - (reduced.start or ended),
        waiting=reduced.times.waiting,
        control_plane=shuffle.control.seconds + reduced.times.control_plane)
    if summary is not None:
        report = report_from_summary(summary, operation, config, ended - started, phases)
    else:  # rows: the reducers' own counts (in their small stats, not the blocks)
        rows = sum(stats[0] for stats in ray.get(list(reduced.stats_refs)))
        report = report_without_books(shuffle.shuffle_id, operation, config, len(inputs),
                                      num_partitions, rows, ended - started, phases, why)
    metrics.record_shuffle(report)
    _set_last_report(report)
    return ShuffleResult(list(reduced.table_refs), report, list(reduced.stats_refs))


def _remove_without_master(shuffle: ShuffleLifecycle, nodes: list[str],
                           lost: ShuffleMasterLostError) -> str:
    """Remove the data of a shuffle whose output is complete but whose master died at its
    release (``ShuffleLifecycle.release_without_master``); the report's note saying so,
    also logged: the user's output is fine, the master (and every other shuffle in flight
    with it) is not."""
    try:
        problems = shuffle.release_without_master(nodes)
    except Exception as exc:  # noqa: BLE001 - the output is complete: not lost to this
        problems = [describe_cause(exc)]
    why = (f"{lost}. The output is complete (every reducer returned its block), but this "
           "report holds only what the driver measured: the rows its reducers returned and "
           "its times (control-plane time without the writers' share). ")
    why += ("The driver removed the shuffle's data itself." if not problems else
            f"Removing the shuffle's data failed ({'; '.join(problems)}): the tier managers' "
            "orphan sweeps and `hybrid-ray cleanup` remove what is left.")
    # Logged and kept in the report: a storage library's error may quote the credentials
    # it was given (as the master scrubs its deletions' errors).
    config = shuffle.config
    why = Redactor(config.remote_path, config.storage_options).scrub(why)
    _LOG.warning("hybrid_ray: %s", why)
    return why


@dataclasses.dataclass
class _Reduced:
    """What ``_run_reducers`` hands back: per subpartition, the refs of its stored table
    and of its (rows, bytes, schema); the reduce phase's span and the reducers' own times."""

    table_refs: list[ray.ObjectRef | None]
    stats_refs: list[ray.ObjectRef | None]
    start: float | None
    end: float | None
    times: ReduceTimes


def _run_reducers(shuffle: ShuffleLifecycle, maps: MapRunner, readers: _ReaderPool,
                  progress: ProgressBar, num_maps: int, schema: pa.Schema,
                  partitioner: Partitioner) -> _Reduced:
    """Drive the maps and reducers of ``shuffle`` until every subpartition is stored.

    Reducers start with the maps (hybrid) or once all maps finished (blocking). A reducer
    whose reader died with its node is run again elsewhere (its segments are still there);
    any other failure raises."""
    config, num_partitions = shuffle.config, shuffle.num_partitions
    hybrid = config.mode == ShuffleMode.HYBRID
    # Reducer i is tracked by its small (rows, bytes, schema) result: waiting on the
    # tables would pull every output block to the driver's node.
    table_refs: list[ray.ObjectRef | None] = [None] * num_partitions
    stats_refs: list[ray.ObjectRef | None] = [None] * num_partitions
    running: dict[ray.ObjectRef, int] = {}  # stats ref -> subpartition
    times_refs: dict[int, ray.ObjectRef] = {}  # subpartition -> its ReduceTimes
    finished: set[int] = set()  # subpartitions whose block is stored
    resubmitted: collections.Counter[int] = collections.Counter()  # see the nodes module
    todo = collections.deque(range(num_partitions))
    start: float | None = None
    end: float | None = None
    times = ReduceTimes()
    last_reduced = 0.0  # when a reducer last finished (monotonic): the stall bound's clock
    # Refs the last wait found ready: one ray.wait per turn of this loop, not three.
    ready: set[ray.ObjectRef] = set()
    packed: ray.ObjectRef | None = None  # reduce_partition's common arguments, put once
    while True:
        maps.poll(ready)
        busy = readers.busy_subpartitions()
        maps.check_stalled(max(last_reduced, readers.progress()),
                           f"reducers of subpartitions {busy}" if busy else "",
                           readers.restart_busy)
        if maps.lost_nodes - readers.lost_nodes:
            readers.drop_nodes(maps.lost_nodes)
        maps_done = maps.done
        freed_now = False
        if running:
            for ref in [r for r in ready if r in running]:
                sub = running.pop(ref)
                try:
                    # Its stats and times in one get (each get is a call into the core
                    # worker); a failed reducer's error is raised now.
                    _, reducer_times = ray.get([ref, times_refs[sub]])
                except WORKER_LOST_ERRORS as exc:
                    node = readers.node_of(sub)
                    if not (worker_process_lost(exc)
                            and lost_with_node(node, exc, shuffle.heartbeat)):
                        # Its reader process died more often than Ray retries a call,
                        # perhaps while it ran the reducer queued ahead of this one.
                        if resubmitted[sub] >= RESUBMITS_AFTER_WORKER_LOSS:
                            raise
                        resubmitted[sub] += 1
                        readers.done(sub)
                        todo.appendleft(sub)
                        continue
                    # Its reader died with its node; the subpartition's segments are all
                    # still there (not freed): reduce it again elsewhere.
                    readers.drop_nodes({node})
                    todo.appendleft(sub)
                    continue
                readers.done(sub)
                finished.add(sub)
                end = time.perf_counter()
                last_reduced = time.monotonic()
                times.waiting += reducer_times.waiting
                times.control_plane += reducer_times.control_plane
                # Its block is stored (owned by this driver): its segments can go now
                # (batched; see below for the last reducers).
                shuffle.free_subpartition(sub)
                freed_now = True
            if freed_now and maps_done and not todo:
                # The last reducers (every subpartition handed out): their frees go at
                # once, one call for this turn's, so the release has little left to
                # delete (see ShuffleLifecycle.flush_frees).
                shuffle.flush_frees()
        if hybrid or maps_done:
            while readers.can_take(len(todo)):
                sub = todo.popleft()
                if packed is None:  # put once, at the first reducer (see run_packed)
                    packed = pack_call(reduce_partition,
                                       (schema, partitioner, config, shuffle.master))
                table_ref, stats_ref, times_refs[sub] = readers.submit(
                    sub, packed, shuffle.shuffle_id, sub)
                table_refs[sub], stats_refs[sub] = table_ref, stats_ref
                running[stats_ref] = sub
                if start is None:
                    start = time.perf_counter()
        progress.update(maps.num_finished, num_maps, len(finished), num_partitions)
        if maps_done and len(finished) == num_partitions:
            break
        shuffle.heartbeat()
        # Wake on the next map or reducer to finish (or fail: handled next turn).
        waiting_on = maps.running_refs() + list(running)
        if waiting_on:
            ready = set(ray.wait(waiting_on, num_returns=1, timeout=0.5,
                                 fetch_local=False)[0])
        else:  # nothing in flight this turn (a writer freed just now): look again soon
            ready = set()
            time.sleep(0.01)
    return _Reduced(table_refs, stats_refs, start, end, times)


def _check_sortable(schema: pa.Schema | None, key: str) -> None:
    """Refuse a sort key whose values have no order Arrow sorts by (nested, union,
    interval, extension), before anything runs: a struct key failed in the driver's
    sampling with NumPy's "'<' not supported", a list key in every reducer after the
    whole map phase."""
    if schema is None:
        return
    t = schema.field(key).type
    problem = sort_key_problem(t)
    if problem:
        raise ConfigError(f"cannot sort by column {key!r} of type "
                          f"{t.value_type if pa.types.is_dictionary(t) else t}: {problem}")


def _reducer_window(config: ShuffleConfig) -> int:
    """Reducers run at once: ``max_concurrent_reducers`` or the cluster's CPU count,
    refused above ``MAX_REDUCERS_PER_CPU`` times the CPUs (each is a process)."""
    cpus = cluster_cpus()
    window = config.max_concurrent_reducers
    if window is None:
        return cpus
    limit = MAX_REDUCERS_PER_CPU * cpus
    if window > limit:
        raise ConfigError(
            f"max_concurrent_reducers={window} is more than this cluster can run: at most "
            f"{limit} ({MAX_REDUCERS_PER_CPU} per CPU, {cpus} CPUs), each one a reader "
            "process. Use a smaller value, or None for one per CPU")
    return window


# ---- public Dataset API ---------------------------------------------------------------------------
def check_remote_tier(config: ShuffleConfig) -> None:
    """Fail fast, with the fix, before any task runs if the remote tier is unreachable
    (constructing the tier probes it once)."""
    if config.remote_path is not None:
        open_remote_tier(config, check_reachable=True).close()


def check_config(config: Any) -> ShuffleConfig:
    """``config``, or the default ``ShuffleConfig()`` for None; anything else is refused
    (a dict was taken for the defaults when empty and failed deep inside otherwise)."""
    if config is None:
        return ShuffleConfig()
    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"config must be a hybrid_ray.ShuffleConfig, got "
                          f"{type(config).__name__}: build one with ShuffleConfig(...)")
    return config


def check_num_partitions(num_partitions: Any) -> int:
    """``num_partitions`` as a Python int, or ``ConfigError`` if it is not a partition
    count in ``[1, MAX_PARTITIONS]``."""
    # A NumPy integer (np.int64(8), a computed count) is the int it is (as_int); a bool
    # is not a count.
    number = as_int(num_partitions)
    if number is None or number <= 0:
        raise ConfigError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    num_partitions = number
    if num_partitions > MAX_PARTITIONS:
        raise ConfigError(
            f"num_partitions={num_partitions} is more than hybrid_ray's limit of "
            f"{MAX_PARTITIONS}: every partition costs each map's writer memory and at least "
            "one segment. Use fewer partitions (a partition of even 1 TB at the limit is "
            "10 MB)")
    return num_partitions


@dataclasses.dataclass
class _Blocks:
    """A materialized dataset's non-empty blocks and what its metadata says of them."""

    refs: list[ray.ObjectRef]
    schema: pa.Schema | None  # None: unknown (e.g. a dataset filtered to no rows)
    nbytes: int
    num_rows: int


def _dataset_blocks(ds: Any) -> _Blocks:
    """The blocks of ``ds`` (materialized once), without running a task: the schema, rows
    and sizes come from block metadata. Blocks with no rows are left out. Blocks whose
    schemas differ, or with two columns of one name, are refused here, before anything
    is shuffled."""
    if not isinstance(ds, ray.data.Dataset):
        raise TypeError(f"expected a ray.data.Dataset, got {type(ds).__name__}; "
                        "wrap Arrow tables with ray.data.from_arrow(...)")
    from ray.data.dataset import MaterializedDataset

    if not isinstance(ds, MaterializedDataset):  # materializing one again
        ds = ds.materialize()  # cost the driver 10 ms for nothing (copies of its plan)
    if _has_pandas_blocks(ds):
        # ray.data.from_pandas and map_batches(batch_format="pandas") make pandas blocks;
        # maps and reducers read Arrow tables (they failed with AttributeError on these).
        ds = ds.map_batches(_same_batch, batch_format="pyarrow",
                            zero_copy_batch=True).materialize()
    refs: list[ray.ObjectRef] = []
    schemas: list[tuple[int, pa.Schema]] = []  # (block index, schema) of non-empty blocks
    nbytes = num_rows = index = 0
    for bundle in ds.iter_internal_ref_bundles():
        for entry in bundle.blocks:
            meta = entry.metadata
            rows = meta.num_rows
            index += 1
            if rows == 0:
                continue
            refs.append(entry.ref)
            num_rows += rows or 0
            nbytes += meta.size_bytes or 0
            block_schema = _arrow_schema(getattr(meta, "schema", None) or bundle.schema)
            if block_schema is not None:
                schemas.append((index - 1, block_schema))
    schema = _arrow_schema(ds.schema())
    if schemas:
        schema = unify_schemas([sch for _, sch in schemas],
                                lambda k: f"block {schemas[k][0]} of the dataset")
    elif schema is None and refs:
        schema = ray.get(refs[0]).schema
    # Checked here, before any key is looked up or sampled (see repeated_columns_problem).
    repeated = repeated_columns_problem(schema) if schema is not None else ""
    if repeated:
        raise ConfigError(repeated)
    return _Blocks(refs, schema, nbytes, num_rows)


def _has_pandas_blocks(ds: Any) -> bool:
    """Whether any of a materialized dataset's blocks is a pandas DataFrame: its schema in
    the block's metadata (or, where that is missing, the dataset's) is not an Arrow one.
    The dataset's schema alone is its first block's: a union of Arrow blocks and pandas
    ones reached the maps (and the sort's sampling) with DataFrames."""
    for bundle in ds.iter_internal_ref_bundles():
        for entry in bundle.blocks:
            block_schema = getattr(entry.metadata, "schema", None)
            if block_schema is not None and not isinstance(
                    getattr(block_schema, "base_schema", block_schema), pa.Schema):
                return True
    schema = ds.schema()
    schema = getattr(schema, "base_schema", schema)
    return schema is not None and not isinstance(schema, pa.Schema)


def _same_batch(batch: pa.Table) -> pa.Table:
    return batch


def _arrow_schema(schema: Any) -> pa.Schema | None:
    """An Arrow schema from Ray Data's schema objects (None stays None: unknown)."""
    if schema is None:
        return None
    schema = schema.base_schema if hasattr(schema, "base_schema") else schema
    return schema if isinstance(schema, pa.Schema) else None


def _check_columns(schema: pa.Schema | None, columns: Sequence[str], what: str) -> None:
    """Refuse columns the dataset does not have; with the schema unknown (a dataset with
    no rows whose producer gave none), any column is accepted: there is nothing to look
    up."""
    if schema is None:
        return
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ConfigError(f"{what}: unknown column(s) {missing}; the dataset has columns "
                          f"{schema.names}")


def _empty_dataset(num_partitions: int, schema: pa.Schema | None, operation: str,
                   config: ShuffleConfig) -> ray.data.Dataset:
    """The result of shuffling no rows: ``num_partitions`` empty blocks of ``schema``, or,
    with the schema unknown, a dataset with no blocks (and so no schema either). Its report
    (``report_of``, ``last_report``) says so: no shuffle ran, nothing was stored."""
    if schema is None:
        ds = _materialized_dataset([], [])
    else:
        refs = [ray.put(schema.empty_table())] * num_partitions
        ds = _materialized_dataset(refs, [(0, 0, schema)] * num_partitions)
    report = ShuffleReport(
        shuffle_id="", operation=operation, mode=config.mode.value,
        spilling=config.spilling.value, num_maps=0, num_partitions=num_partitions, rows=0,
        input_bytes=0, wall_time_s=0.0, per_node_tier={}, tier_switches=0, spill_events=0,
        superseded_attempts=0, hybrid_overlap=False,
        notes=("the dataset has no rows: no shuffle ran and nothing was stored",))
    _set_last_report(report)
    setattr(ds, _REPORT_ATTR, report)
    if schema is not None:  # report_of(ds.materialize()) finds it, as for a shuffle's result
        _remember_report(refs, report)
    return ds


def _check_optional_partitions(num_partitions: Any) -> int | None:
    return None if num_partitions is None else check_num_partitions(num_partitions)


def _to_dataset(result: ShuffleResult, input_bytes: int) -> ray.data.Dataset:
    result.report.input_bytes = input_bytes
    try:
        ds = _materialized_dataset(result.refs, ray.get(result.block_stats))
    except BaseException:  # the call failed after its shuffle: no report of it stands
        _set_last_report(None)
        raise
    setattr(ds, _REPORT_ATTR, result.report)
    _remember_report(result.refs, result.report)
    _set_last_report(result.report)
    return ds


def _materialized_dataset(refs: list[ray.ObjectRef],
                          stats: list[tuple[int, int, pa.Schema]]) -> ray.data.Dataset:
    """``ray.data.from_arrow_refs(refs)`` with the block metadata the reducers reported.

    ``from_arrow_refs`` runs one task per block to learn its rows, size and schema; on a
    small cluster those tasks start workers that import Ray Data, which cost a 1 GiB
    shuffle 0.9 s of its 7 s (profiled). This builds the same Dataset through Ray Data's
    internal operators; ray is pinned in pyproject.toml, and a Ray upgrade that moves them
    fails here loudly (and in the tests) rather than silently going slow.
    """
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.from_operators import FromArrow
    from ray.data._internal.stats import DatasetStats
    from ray.data.block import BlockMetadataWithSchema
    from ray.data.context import DataContext
    from ray.data.dataset import MaterializedDataset

    metadata = [BlockMetadataWithSchema(num_rows=rows, size_bytes=int(nbytes),
                                        exec_stats=None, input_files=(), schema=schema)
                for rows, nbytes, schema in stats]
    context = DataContext.get_current().copy()
    plan = LogicalPlan(FromArrow(refs, metadata), context)
    return MaterializedDataset(plan, context,
                               DatasetStats(metadata={"FromArrow": metadata}, parent=None))


@_most_recent_call
def repartition(ds: ray.data.Dataset, num_partitions: int, keys: Sequence[str],
                config: ShuffleConfig | None = None) -> ray.data.Dataset:
    """Hash-partition ``ds`` by ``keys`` into ``num_partitions`` blocks through the tiers.

    Rows with equal keys land in the same output block, whatever their representation
    (see ``hybrid_ray.partitioning.hash_column``); every row appears exactly once. A
    dataset with no rows gives ``num_partitions`` empty blocks. The shuffle's report is
    available from ``hybrid_ray.last_report()``.
    """
    num_partitions = check_num_partitions(num_partitions)
    config = check_config(config)
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"keys must be a column name or a list of column names, got "
                          f"{keys!r}")
    if not keys:
        raise ConfigError("keys must name at least one column to partition by")
    blocks = _dataset_blocks(ds)
    _check_columns(blocks.schema, keys, "repartition keys")
    if not blocks.refs:
        return _empty_dataset(num_partitions, blocks.schema, "repartition", config)
    result = run_shuffle(blocks.refs, num_partitions, HashPartitioner(keys), blocks.schema,
                         config, "repartition")
    return _to_dataset(result, blocks.nbytes)


@_most_recent_call
def sort(ds: ray.data.Dataset, key: str | Sequence[str], descending: bool | Sequence[bool]
         = False, config: ShuffleConfig | None = None, num_partitions: int | None = None
         ) -> ray.data.Dataset:
    """Globally sort ``ds`` by ``key``: range partitions from sampled boundaries, each
    sorted by its reducer, so the blocks in order form the sorted dataset.

    ``key`` is a column name or a list of them (sorted by the first, ties by the next,
    ...), and ``descending`` one flag for all keys or one per key, as in Ray Data's
    ``Dataset.sort``. Nulls (and NaNs) sort as Ray Data's own ``Dataset.sort`` puts them:
    last, ascending and descending, NaNs before the nulls (descending: ``[7, 3, nan,
    None]``; it put them first when descending before, unlike Ray Data).
    ``num_partitions`` defaults to the number of maps (input blocks, small ones grouped).
    """
    keys, flags = _sort_keys(key, descending)
    config = check_config(config)
    num_partitions = _check_optional_partitions(num_partitions)
    blocks = _dataset_blocks(ds)
    _check_columns(blocks.schema, keys, "sort key")
    for k in keys:
        _check_sortable(blocks.schema, k)
    untakeable = untakeable_column_problem(blocks.schema) if blocks.schema is not None else ""
    if untakeable:  # before the sampling, which takes rows of the key
        raise ConfigError(untakeable)
    if not blocks.refs:
        return _empty_dataset(num_partitions or 1, blocks.schema, "sort", config)
    n = num_partitions or _default_partitions(blocks.refs, config)
    groups = _plan_maps(_block_locations(blocks.refs)[1], config)
    sample = _sample_task if len(keys) == 1 else _sample_rows_task
    sampling = [sample.remote(keys[0] if len(keys) == 1 else keys, SAMPLES_PER_BLOCK,
                              *[blocks.refs[i] for i in group])
                for group in groups]
    try:
        samples = ray.get(sampling, timeout=config.stall_timeout_s)
    except ray.exceptions.GetTimeoutError:
        # Not left running (or queued for a CPU) after the sort has failed: they held CPUs
        # the caller's next job waits for, and pinned the input blocks.
        for task in sampling:
            ray.cancel(task, force=True)
        raise ShuffleStalledError(
            f"sort: sampling the keys of {len(blocks.refs)} blocks took longer than "
            f"stall_timeout_s ({config.stall_timeout_s:g} s); check that the cluster's "
            "nodes are alive (ray status), or raise ShuffleConfig.stall_timeout_s") from None
    if len(keys) == 1:
        non_empty = [s for s in samples if len(s)]
        boundaries = range_boundaries(
            np.concatenate(non_empty) if non_empty else np.asarray([]), n)
        partitioner: Partitioner = RangePartitioner(keys[0], boundaries, flags[0])
    else:
        partitioner = MultiKeyRangePartitioner(
            keys, _row_boundaries(samples, keys, flags, n), flags)
    result = run_shuffle(blocks.refs, n, partitioner, blocks.schema, config, "sort")
    return _to_dataset(result, blocks.nbytes)


def _sort_keys(key: Any, descending: Any) -> tuple[list[str], list[bool]]:
    """``sort``'s ``key`` and ``descending`` as a list of column names and one flag per
    name, both checked (as Ray Data's ``Dataset.sort`` takes them)."""
    keys = [key] if isinstance(key, str) else key
    if not isinstance(keys, (list, tuple)) or not keys \
            or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"sort key must be a column name or a non-empty list of column "
                          f"names, got {key!r}")
    repeated = repeated_names(keys)
    if repeated:
        raise ConfigError(f"sort key names column(s) {repeated} more than once; name each "
                          "column once")
    if isinstance(descending, (bool, np.bool_)):
        flags = [bool(descending)] * len(keys)
    elif isinstance(descending, (list, tuple)) and len(descending) == len(keys) \
            and all(isinstance(d, (bool, np.bool_)) for d in descending):
        flags = [bool(d) for d in descending]
    else:
        raise ConfigError(f"descending must be True or False, got {descending!r}; or a list "
                          f"of one of them per sort key ({len(keys)} here)")
    return list(keys), flags


@ray.remote(num_cpus=0)
def _sample_rows_task(keys: list[str], k: int, *blocks: pa.Table) -> pa.Table:
    """Up to ``k`` sampled rows of ``keys`` from each block (nulls and NaNs included: in a
    sort by several keys they are values like any other, sorted last)."""
    out = []
    for block in blocks:
        if block.num_rows == 0:
            continue
        idx = np.random.default_rng(0).choice(block.num_rows, min(k, block.num_rows),
                                              replace=False)
        columns = [sortable_column(block.column(key).take(pa.array(idx))) for key in keys]
        out.append(pa.table(columns, names=keys))
    if not out:
        return pa.table({})
    return pa.concat_tables(out, promote_options="permissive")


def _row_boundaries(samples: Sequence[pa.Table], keys: list[str], flags: list[bool],
                    num_partitions: int) -> pa.Table:
    """``num_partitions - 1`` quantile rows of the sampled key rows, in sort order."""
    non_empty = [t for t in samples if t.num_rows]
    if not non_empty or num_partitions == 1:
        return pa.table({k: pa.array([], pa.null()) for k in keys}) if not non_empty \
            else non_empty[0].slice(0, 0)
    rows = pa.concat_tables(non_empty, promote_options="permissive")
    order = pc.sort_indices(rows, sort_keys=[(k, "descending" if d else "ascending", "at_end")
                                             for k, d in zip(keys, flags)])
    rows = rows.take(order)
    picks = (np.arange(1, num_partitions) * rows.num_rows) // num_partitions
    return rows.take(pa.array(np.minimum(picks, rows.num_rows - 1)))


def _default_partitions(refs: Sequence[ray.ObjectRef], config: ShuffleConfig) -> int:
    """One output partition per map: per input block, small blocks grouped (so 10,000
    one-row blocks do not become 10,000 one-row partitions)."""
    return max(1, min(MAX_PARTITIONS, len(_plan_maps(_block_locations(refs)[1], config))))


@_most_recent_call
def random_shuffle(ds: ray.data.Dataset, seed: int | None = None,
                   config: ShuffleConfig | None = None, num_partitions: int | None = None
                   ) -> ray.data.Dataset:
    """Randomly permute the rows of ``ds``; the same ``seed`` (an integer in
    ``[0, 2**63)``) gives the same result. ``num_partitions`` defaults to the number of
    maps (input blocks, small ones grouped)."""
    if seed is not None:
        number = as_int(seed)
        if number is None or not 0 <= number < MAX_SEED:
            raise ConfigError(f"seed must be None or an integer with 0 <= seed < 2**63, got "
                              f"{seed!r}")
        seed = number
    config = check_config(config)
    num_partitions = _check_optional_partitions(num_partitions)
    blocks = _dataset_blocks(ds)
    if not blocks.refs:
        return _empty_dataset(num_partitions or 1, blocks.schema, "random_shuffle", config)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % MAX_SEED)
    n = num_partitions or _default_partitions(blocks.refs, config)
    result = run_shuffle(blocks.refs, n, RandomPartitioner(seed), blocks.schema, config,
                         "random_shuffle")
    return _to_dataset(result, blocks.nbytes)

