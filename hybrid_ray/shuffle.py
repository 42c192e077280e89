"""Distributed hybrid shuffle on Ray: maps write through the tiers of their node,
reducers read their subpartition, the shuffle master keeps the books.

Public operations (``repartition``, ``sort``, ``random_shuffle``) take and return a
``ray.data.Dataset``; output block i is subpartition i. ``run_shuffle`` is the general entry
point for custom partitioners over lists of Arrow block references.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from hybrid_ray import metrics
from hybrid_ray.actors import (
    MASTER_CALL_TIMEOUT_S, ActorNodeStorage, existing_tier_manager, get_reader_slots,
    get_tier_manager, reader_count, start_actors,
)
from hybrid_ray.clients import ReadClient, WriteClient, WriteStats
from hybrid_ray.config import ShuffleConfig, ShuffleMode, TierName
from hybrid_ray.tiers.cache import LruCache
from hybrid_ray.tiers.remote import open_remote_tier
from hybrid_ray.errors import (
    ConfigError, SegmentLostWithNodeError, SegmentNotFoundError, ShuffleFailedError,
    ShuffleMasterLostError,
)
from hybrid_ray.partitioning import (
    HashPartitioner, Partitioner, RandomPartitioner, RangePartitioner, range_boundaries,
    split_by_partition,
)
from hybrid_ray.report import PhaseTimes, ProgressBar, ReduceTimes, ShuffleReport, Stopwatch

# A reader's long poll waits at most this long in the master for new segments (then it
# asks again); a reader waiting for a map attempt to restart checks every POLL_RETRY_S.
POLL_WAIT_S, POLL_RETRY_S = 1.0, 0.25
# The driver heartbeats the master this often; the master expires a silent shuffle after
# its config's orphan_ttl_s.
from hybrid_ray.config import DRIVER_HEARTBEAT_S as HEARTBEAT_S  # noqa: E402
SAMPLES_PER_BLOCK = 256
# How long a reader waits for the new attempt of a map whose segment it found gone while
# a re-run is coming (the attempt was superseded, is being retried, or its memory-tier
# segments died with their writer and the driver re-runs it: see read_subpartition). A
# re-run map may queue behind running maps for a free writer; read_subpartition's
# ``missing_wait_s`` overrides it. A disk or remote segment of a finished map that is gone
# is lost for good and fails at once.
MISSING_SEGMENT_WAIT_S = 60.0
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
# random_shuffle seeds are in [0, MAX_SEED): NumPy's generators take no negative seeds.
MAX_SEED = 1 << 63

# The report of each thread's most recent shuffle: shuffles run in threads side by side
# must not see each other's (a process-global once returned another thread's report).
_reports = threading.local()


def last_report() -> ShuffleReport | None:
    """The report of the most recent shuffle run by the calling thread. The report of a
    particular result is also on it: ``ShuffleResult.report``, ``report_of(dataset)``."""
    return getattr(_reports, "last", None)


def _set_last_report(report: ShuffleReport) -> None:
    _reports.last = report


def report_of(ds: Any) -> ShuffleReport:
    """The report of the shuffle that produced ``ds`` (a Dataset returned by
    ``repartition``, ``sort`` or ``random_shuffle``)."""
    report = getattr(ds, _REPORT_ATTR, None)
    if report is None:
        raise ConfigError("this Dataset was not produced by a hybrid_ray shuffle (or was "
                          "transformed since): keep the Dataset hybrid_ray returned, or use "
                          "hybrid_ray.last_report() right after the call")
    return report


_REPORT_ATTR = "_hybrid_ray_report"


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


# ---- tasks -----------------------------------------------------------------------------------
def write_map_partition(shuffle_id: str, map_index: int, chunks: Iterable[pa.Table],
                        num_partitions: int, partitioner: Partitioner, config: ShuffleConfig,
                        master: Any, raise_if_superseded: bool = False,
                        own_memory_segments: bool = False,
                        on_attempt: Callable[[int], None] | None = None) -> WriteStats | None:
    """Write one map partition through this node's tiers, committing chunk by chunk.

    Runs in any process connected to the Ray cluster (a writer actor, or a Spark executor's
    Python worker). Returns the write statistics, or None if an earlier attempt of this map
    partition already finished (the master decides; this attempt then writes nothing).
    On any error the attempt's segments are deleted before the error propagates.

    ``own_memory_segments``: this process owns the memory-tier objects it writes (it must
    outlive the shuffle: a writer actor). Otherwise the node's tier manager owns them,
    at the cost of a second object-store copy (see ``put_many_owned_by``).
    ``on_attempt``: told the attempt number the master gave this run (the Spark bridge
    reports it, so the driver can seal with the attempts whose Spark tasks succeeded).
    """
    node_id = ray.get_runtime_context().get_node_id()
    # Every bookkeeping call of this attempt is timed into one stopwatch: the report's
    # control-plane time (the stats travel with finish_map, so that call is not in it).
    control = Stopwatch()
    with control:
        attempt = ray.get(master.begin_map.remote(shuffle_id, map_index, node_id,
                                                  os.getpid()))
    if attempt is None:
        return None
    if on_attempt is not None:
        on_attempt(attempt)
    tm = get_tier_manager(node_id, config.namespace)
    with control:
        ray.get(tm.register_shuffle.remote(shuffle_id, config))
    superseded = []

    def commit(metas):
        with control:
            live = ray.get(master.commit.remote(shuffle_id, map_index, attempt, metas))
        if not live:
            superseded.append(True)

    client = WriteClient(shuffle_id, map_index, num_partitions, config,
                         ActorNodeStorage(tm, control),
                         _io_tiers_cached(config, node_id, own_memory_segments),
                         attempt=attempt, node_id=node_id, on_commit=commit)
    try:
        # Commit chunk by chunk: hybrid readers see data while the partition is being written.
        for chunk in chunks:
            if chunk.num_rows == 0:
                continue
            parts = partitioner.assign(chunk, map_index, num_partitions)
            client.write_many(split_by_partition(chunk, np.asarray(parts), num_partitions))
            client.flush()
            if superseded:
                break
        if not superseded:
            client.close()  # commits the last segments (and may learn it was superseded)
        if superseded:
            # A newer attempt of this map runs (a lost map run again): the master refused
            # and deleted this attempt's segments; its work is simply not needed.
            client.abort()
    except BaseException:
        _abort_keeping_the_cause(client)
        raise
    finally:
        # Drop this process's references to the memory-tier objects it wrote: the master
        # holds the committed ones, and a cached, reused worker must not keep every
        # segment it ever wrote alive in the object store.
        memory = client.io_tiers.get(TierName.MEMORY)
        if memory is not None:
            memory.remove_shuffle_data(shuffle_id)
    if superseded:
        if raise_if_superseded:
            raise ShuffleFailedError(f"map {map_index} attempt {attempt} was superseded "
                                     "before it finished; its segments do not count")
        return None
    client.stats.control_plane_s = control.seconds
    finished = ray.get(master.finish_map.remote(shuffle_id, map_index, attempt, client.stats))
    if not finished and raise_if_superseded:
        # Spark runs speculative attempts side by side: report failure so Spark keeps the
        # attempt whose segments count. (A Ray task retry only follows a dead attempt.)
        raise ShuffleFailedError(f"map {map_index} attempt {attempt} was superseded before "
                                 "it finished; its segments do not count")
    return client.stats


def _abort_keeping_the_cause(client: WriteClient) -> None:
    """Abort a failed map attempt's writes without masking why it failed.

    The storage that failed the map often fails the abort's deletions too (an S3 store
    that went down fails the upload, then the delete of what was uploaded before): the
    map's error was then a raw ``EndpointConnectionError`` of the delete instead of the
    ``RemoteTierError`` naming the upload. What the abort could not delete is deleted with
    the shuffle: the failed map fails the shuffle (or, on Spark, its release), and the
    master retries that deletion until the data is gone.
    """
    try:
        client.abort()
    except Exception:  # noqa: BLE001 - the map's own error is what the caller needs
        pass


def map_block(shuffle_id: str, map_index: int, block: pa.Table | Sequence[ray.ObjectRef],
              num_partitions: int, partitioner: Partitioner, config: ShuffleConfig,
              master: Any, schema: pa.Schema | None = None) -> dict:
    """One map of ``run_shuffle``, run by a writer actor (``get_writers``) that owns the
    memory-tier segments it writes.

    ``block`` is one table, or the references of a group of small input blocks (see
    ``_group_blocks``) that this map reads and partitions as one table. Every block must
    have ``schema`` (when given): a block that differs fails the map, before it writes
    anything, with both schemas' differing fields named.
    """
    if isinstance(block, pa.Table):
        tables = [block]
    else:
        tables = ray.get(list(block))
    if schema is not None:
        tables = [_conform(table, schema, f"input block {i} of map {map_index}")
                  for i, table in enumerate(tables)]
    if len(tables) > 1:
        # One chunk, not one per block: the hash and split work per chunk.
        block = pa.concat_tables(tables).combine_chunks()
    else:
        block = tables[0]
    rows_per_chunk = max(1, int(block.num_rows * config.map_chunk_bytes / max(block.nbytes, 1)))
    chunks = (block.slice(start, rows_per_chunk)
              for start in range(0, block.num_rows, rows_per_chunk))
    stats = write_map_partition(shuffle_id, map_index, chunks, num_partitions, partitioner,
                                config, master, own_memory_segments=True)
    return {"rows": stats.rows if stats else 0, "skipped": stats is None}


def _describe_field(field: pa.Field | None, name: str) -> str:
    if field is None:
        return f"no column {name!r}"
    return f"{field.name}: {field.type}{'' if field.nullable else ' not null'}"


def _schema_difference(got: pa.Schema, expected: pa.Schema) -> str:
    """The fields of two schemas that differ, named: 'id: int32 vs id: int64'."""
    diffs = []
    for name in dict.fromkeys(expected.names + got.names):
        a = got.field(name) if name in got.names else None
        b = expected.field(name) if name in expected.names else None
        if a is None or b is None or not a.equals(b):
            diffs.append(f"{_describe_field(a, name)} vs {_describe_field(b, name)}")
    if not diffs and got.names != expected.names:
        diffs.append(f"column order {got.names} vs {expected.names}")
    return "; ".join(diffs)


def _decoded(field: pa.Field) -> pa.DataType:
    """A field's type with dictionary encoding taken off: the type of its values."""
    t = field.type
    return t.value_type if pa.types.is_dictionary(t) else t


def _unify_schemas(schemas: Sequence[pa.Schema], what: Callable[[int], str]) -> pa.Schema:
    """The one schema blocks with ``schemas`` are shuffled as.

    Blocks may differ only in representation: a column dictionary-encoded in some blocks
    and not in others (decoded to its value type) or nullable in some (nullable).
    Anything else is refused with both differing fields named, and the fix.
    """
    first = schemas[0]
    fields = list(first)
    for i, other in enumerate(schemas[1:], 1):
        if other.equals(first, check_metadata=False):
            continue
        if other.names != first.names or any(
                _decoded(a) != _decoded(b) for a, b in zip(other, fields)):
            raise ConfigError(
                f"the blocks to shuffle have different schemas: {what(i)} differs from "
                f"{what(0)} in {_schema_difference(other, first)}. Cast every block to one "
                "schema first (e.g. ds.map_batches(lambda t: t.cast(schema), "
                "batch_format='pyarrow'), with schema = pyarrow.unify_schemas([...]))")
        for k, (a, b) in enumerate(zip(other, fields)):
            if not a.equals(b):
                fields[k] = pa.field(b.name, _decoded(b), b.nullable or a.nullable)
    return pa.schema(fields, metadata=first.metadata)


def _conform(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """``table`` as ``schema`` (dictionaries decoded: see ``_unify_schemas``), or a
    ConfigError naming the fields that differ."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    _unify_schemas([schema, table.schema],
                   lambda i: what if i else "the shuffle's schema")
    return table.cast(schema)


def _io_tiers_cached(config: ShuffleConfig, node_id: str,
                     own_memory_segments: bool = False) -> dict:
    """This process's I/O tiers for ``config`` on ``node_id``, opened once and kept in a
    bounded cache (``_IO_CACHE``)."""
    # ShuffleConfig holds dicts (unhashable); cache on its repr, which is deterministic.
    key = (repr(config), node_id, own_memory_segments)

    def open_tiers() -> dict:
        from hybrid_ray.tier_manager import build_io_tiers

        owner = None if own_memory_segments else get_tier_manager(node_id, config.namespace)
        return build_io_tiers(config, owner=owner, check_remote=False, node_id=node_id)
    return _IO_CACHE.get_or_create(key, open_tiers)


def _close_io_tiers(tiers: dict) -> None:
    remote = tiers.get(TierName.REMOTE)
    if remote is not None:
        remote.close()


# The tiers of the last IO_CACHE_SIZE configs this process wrote or read with: a
# long-lived writer or reader serves shuffle after shuffle, often each with a new config
# (a job id per run), and kept every tier set it ever opened.
IO_CACHE_SIZE = 8
_IO_CACHE: LruCache[dict] = LruCache(IO_CACHE_SIZE, on_evict=_close_io_tiers)


def read_subpartition(shuffle_id: str, subpartition: int, config: ShuffleConfig,
                      master: Any, missing_wait_s: float = MISSING_SEGMENT_WAIT_S,
                      times: ReduceTimes | None = None) -> list[pa.Table]:
    """All rows of one subpartition, in map order, once every map has finished.

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

    def fetch_from_node(meta):
        # Never start a tier manager here: one pinned to a dead node would never run.
        tm = existing_tier_manager(meta.node_id, config.namespace)
        try:
            if tm is None:
                raise ray.exceptions.ActorDiedError()
            return ray.get(tm.read_disk_segment.remote(meta))
        except WORKER_LOST_ERRORS as exc:
            if not lost_with_node(meta.node_id, exc):
                raise
            raise SegmentLostWithNodeError(
                f"{meta.id} is gone from the disk tier of node {meta.node_id}: the node "
                "died") from None

    reader = ReadClient(_io_tiers_cached(config, node_id), node_id, fetch_from_node)
    cursors: dict[int, tuple[int, int]] = {}
    per_map: dict[int, list[pa.Table]] = collections.defaultdict(list)
    # A segment that vanished while its map was being retried (the dead attempt's data is
    # deleted) is expected: wait for the master to reset that map to the new attempt.
    # Still missing after missing_wait_s without a reset is real loss: fail loudly.
    missing_since: float | None = None
    missing: tuple[Any, Exception] | None = None  # (meta, its error) while waiting
    while True:
        # A long poll: the master answers at once if something is new, else holds the
        # call until a commit (or POLL_WAIT_S) instead of this reader sleeping and asking.
        with control:
            result = ray.get(master.poll.remote(shuffle_id, subpartition, cursors,
                                                os.getpid(), POLL_WAIT_S),
                             timeout=POLL_WAIT_S + MASTER_CALL_TIMEOUT_S)
        control.seconds -= result.waited_s
        waiting.seconds += result.waited_s
        got = False
        try:
            for map_index, attempt, reset, _ in result.updates:
                if reset:
                    per_map[map_index] = []
                    cursors[map_index] = (attempt, 0)
            # One pass over every new segment, so remote ones are fetched ahead across maps.
            todo = [(map_index, attempt, meta)
                    for map_index, attempt, _, metas in result.updates for meta in metas]
            tables = reader.read_in_order([meta for _, _, meta in todo], config.remote_transfers)
            for map_index, attempt, meta in todo:
                try:
                    per_map[map_index].append(next(tables))
                except SegmentNotFoundError as exc:
                    # Memory segments die with their owner, any local segment with its
                    # node: the master has such a map run again (if anyone can). A disk
                    # or remote segment of a finished map on a live node is lost for good.
                    if meta.tier == TierName.MEMORY or isinstance(
                            exc, SegmentLostWithNodeError):
                        with control:
                            rerun = ray.get(master.report_lost.remote(
                                shuffle_id, map_index, attempt))
                        if not rerun:
                            raise
                    else:
                        with control:
                            finished = _finished_attempt(master, shuffle_id, map_index)
                        if finished == attempt:
                            raise _segment_lost(meta, exc, subpartition) from exc
                    missing = (meta, exc)
                    raise _AwaitingAttempt() from None
                _, nxt = cursors.get(map_index, (attempt, 0))
                cursors[map_index] = (attempt, nxt + 1)
                got = True
            missing_since, missing = None, None
        except _AwaitingAttempt:
            now = time.monotonic()
            missing_since = missing_since or now
            if now - missing_since > missing_wait_s:
                meta, exc = missing
                raise SegmentNotFoundError(
                    f"subpartition {subpartition} of {shuffle_id}: {meta.id} is gone from "
                    f"the {meta.tier.value} tier ({meta.location or 'object store'}) and no "
                    f"new attempt of map {meta.id.map_partition} started within "
                    f"{missing_wait_s:.0f} s ({exc})") from exc
            with waiting:
                time.sleep(POLL_RETRY_S)
            continue
        if result.done and not got:
            break
    times.waiting += waiting.seconds
    times.control_plane += control.seconds
    return [t for m in sorted(per_map) for t in per_map[m]]


def _finished_attempt(master: Any, shuffle_id: str, map_index: int) -> int | None:
    """The attempt of a map the master counts as finished (None: no attempt finished, so
    one is still running or will be retried)."""
    return ray.get(master.progress.remote(shuffle_id))["maps"][map_index]["finished"]


def _segment_lost(meta: Any, cause: Exception, subpartition: int) -> SegmentNotFoundError:
    """The error for a disk or remote segment of a finished map that is gone for good."""
    return SegmentNotFoundError(
        f"{meta.id} is gone from the {meta.tier.value} tier at {meta.location} (node "
        f"{meta.node_id or '?'}), though its map finished: it was removed by someone else "
        "while the shuffle ran (`hybrid-ray cleanup`, a tmp cleaner, a user's rm, a bucket "
        "lifecycle rule). No attempt will bring it back; subpartition "
        f"{subpartition} cannot be read. Keep spill dirs and remote_path out of other "
        f"cleaners' reach and re-run the shuffle. ({cause})")


class _AwaitingAttempt(Exception):
    """A segment is gone because its map attempt died or was lost; a new attempt of the
    map is coming (the master resets the reader's cursor for it)."""


def reduce_partition(shuffle_id: str, subpartition: int, schema: pa.Schema,
                     partitioner: Partitioner, config: ShuffleConfig, master: Any
                     ) -> tuple[pa.Table, tuple[int, int, pa.Schema], ReduceTimes]:
    """One reducer (run by a reader ``ShuffleWorkerActor``): the finished partition, its
    (rows, bytes, schema), from which the driver builds the output Dataset's block
    metadata instead of running a task per block to learn it, and the reducer's waiting
    and control-plane seconds for the report. Three separate returns: the driver waits on
    the small ones without pulling the table to its node."""
    times = ReduceTimes()
    tables = read_subpartition(shuffle_id, subpartition, config, master, times=times)
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = partitioner.finalize(table, subpartition)
    return table, (table.num_rows, table.nbytes, table.schema), times


@ray.remote
def _sample_task(key: str, k: int, *blocks: pa.Table) -> np.ndarray:
    """Up to ``k`` sampled non-null, non-NaN keys of each block (nulls and NaNs have a
    partition of their own: see ``RangePartitioner``)."""
    out = []
    for block in blocks:
        column = pc.drop_null(block.column(key))
        if pa.types.is_floating(column.type):
            column = column.filter(pc.invert(pc.is_nan(column)))
        if len(column) == 0:
            continue
        idx = np.random.default_rng(0).choice(len(column), min(k, len(column)), replace=False)
        out.append(column.take(pa.array(idx)).to_numpy(zero_copy_only=False))
    return np.concatenate(out) if out else np.asarray([])


# ---- the driver --------------------------------------------------------------------------------
class _MapDispatcher:
    """Runs the maps of one shuffle on the writer actors, one map per writer at a time.

    A free writer takes the next map whose input block is on its node, else the next map
    (so a node with idle writers helps with the others' blocks). Maps reported lost
    (``ShuffleRegistry.report_lost``) go to the front of the queue: readers wait for them.
    """

    def __init__(self, writers: list[tuple[str, Any]], inputs: Sequence[Any],
                 shuffle_id: str, master: Any, map_fn: Callable[..., Any],
                 map_args: tuple, input_nodes: Sequence[str | None] | None = None,
                 maps: Sequence[int] | None = None) -> None:
        """Runs ``map_fn(shuffle_id, map_index, inputs[map_index], *map_args)`` for every
        input (or the inputs ``maps``); ``input_nodes[i]`` is the node holding input i
        (None: anywhere)."""
        self._writers = writers
        self._blocks = inputs
        self._map_fn = map_fn
        self._args = map_args
        self._shuffle_id = shuffle_id
        self._master = master
        self._queue: collections.deque[int] = collections.deque(
            range(len(inputs)) if maps is None else maps)
        self._running: dict[int, tuple[int, ray.ObjectRef]] = {}  # writer -> (map, ref)
        self._block_nodes = list(input_nodes) if input_nodes is not None \
            else [None] * len(inputs)
        self.results: dict[int, Any] = {}  # map index -> map_fn's result (last run)
        self.lost_nodes: set[str] = set()  # nodes that died while their writers ran maps
        self._dead_slots: set[int] = set()
        # For the report's phases (perf_counter): when the first map was dispatched and
        # the last one was seen finished, and the time spent asking the master for lost maps.
        self.first_dispatch: float | None = None
        self.last_finish: float | None = None
        self.control = Stopwatch()
        self._dispatch()

    @property
    def done(self) -> bool:
        return not self._queue and not self._running

    @property
    def num_finished(self) -> int:
        return len(self._blocks) - len(self._queue) - len(self._running)

    def running_refs(self) -> list[ray.ObjectRef]:
        return [ref for _, ref in self._running.values()]

    def poll(self) -> None:
        """Collect finished maps (raising a failed one's error), queue lost maps again,
        and hand out the queue to free writers.

        A writer that died with its node takes its running map with it: that map goes
        back to the front of the queue, the node's writers leave the pool, and the map
        runs again on another node (its dead attempt is superseded at the master). Maps
        that had finished there and whose segments died with the node come back through
        ``take_lost`` when a reader misses them.
        """
        if self._running:
            by_ref = {ref: slot for slot, (_, ref) in self._running.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0,
                                fetch_local=False)
            for ref in ready:
                slot = by_ref[ref]
                map_index = self._running.pop(slot)[0]
                try:
                    self.results[map_index] = ray.get(ref)
                    self.last_finish = time.perf_counter()
                except WORKER_LOST_ERRORS as exc:
                    node = self._writers[slot][0]
                    if not lost_with_node(node, exc):
                        raise
                    self._drop_node(node)
                    self._requeue([map_index])
        with self.control:
            lost = ray.get(self._master.take_lost.remote(self._shuffle_id))
        self._requeue(lost)
        self._dispatch()

    def _requeue(self, maps: Sequence[int]) -> None:
        """Put maps at the front of the queue, each once: a map lost with its node can be
        reported both by its writer's failure and by a reader missing its segments, and two
        runs at once would supersede each other."""
        running = {m for m, _ in self._running.values()}
        fresh = [m for m in maps if m not in running and m not in self._queue]
        self._queue.extendleft(reversed(fresh))

    def _drop_node(self, node: str) -> None:
        """Stop using the writers of a node that died (``lost_nodes`` records it)."""
        self.lost_nodes.add(node)
        self._dead_slots.update(slot for slot, (n, _) in enumerate(self._writers) if n == node)
        if len(self._dead_slots) == len(self._writers):
            raise ShuffleFailedError(
                f"every node with writers died (last: {node}); no node is left to run the "
                "maps on")

    def _dispatch(self) -> None:
        for slot, (node, writer) in enumerate(self._writers):
            if not self._queue:
                return
            if slot in self._running or slot in self._dead_slots:
                continue
            pick = next((m for m in self._queue if self._block_nodes[m] == node),
                        self._queue[0])
            self._queue.remove(pick)
            ref = writer.run.remote(self._map_fn, self._shuffle_id, pick, self._blocks[pick],
                                    *self._args)
            self._running[slot] = (pick, ref)
            if self.first_dispatch is None:
                self.first_dispatch = time.perf_counter()


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


def _plan_maps(sizes: Sequence[int | None], config: ShuffleConfig) -> list[list[int]]:
    """The blocks of each map (see MAP_TARGET_FRACTION)."""
    total = sum(size or 0 for size in sizes)
    target = min(config.map_chunk_bytes // MAP_TARGET_FRACTION,
                 total // (MIN_MAPS_PER_WRITER * _cluster_cpus()))
    return _group_blocks(sizes, max(1, target))


def _map_inputs(blocks: Sequence[ray.ObjectRef], config: ShuffleConfig
                ) -> tuple[list[Any], list[str | None]]:
    """The input of each map (a block ref, or a list of small blocks' refs) and the node
    to run it on (that of its largest block)."""
    nodes, sizes = _block_locations(blocks)
    groups = _plan_maps(sizes, config)
    inputs: list[Any] = []
    input_nodes: list[str | None] = []
    for group in groups:
        inputs.append(blocks[group[0]] if len(group) == 1 else [blocks[i] for i in group])
        largest = max(group, key=lambda i: sizes[i] or 0)
        input_nodes.append(nodes[largest])
    return inputs, input_nodes


def _cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def node_alive(node_id: str | None) -> bool:
    """Whether Ray still counts ``node_id`` among its alive nodes (None: unknown, alive)."""
    if not node_id:
        return True
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())


# What a call to a worker on a node that died raises: the actor died with it, or (hard
# affinity to the gone node) it cannot be started again.
WORKER_LOST_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)
# Ray's node table marks a removed node dead a moment after its actors' calls fail.
NODE_DEATH_WAIT_S = 15.0


def lost_with_node(node_id: str | None, exc: BaseException) -> bool:
    """Whether a worker call failed because ``node_id`` died (waits, bounded, for Ray's
    node table to agree; an unschedulable hard-pinned actor means the node is gone)."""
    if not node_id:
        return False
    if isinstance(exc, ray.exceptions.ActorUnschedulableError):
        return True
    deadline = time.monotonic() + NODE_DEATH_WAIT_S
    while time.monotonic() < deadline:
        if not node_alive(node_id):
            return True
        time.sleep(0.5)
    return False


class _ReaderPool:
    """The reader actors reducing one shuffle's subpartitions, one at a time each.

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
        self._busy: dict[str, int] = {}  # reader actor id -> subpartition
        self._node_of: dict[int, str] = {}  # subpartition -> node of its reader

    def _fill(self) -> list[tuple[str, Any]]:
        from hybrid_ray.actors import WORKER_ENV, ShuffleWorkerActor
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        kept = [(n, r) for n, r in get_reader_slots(self._namespace,
                                                    min(self._window, _cluster_cpus()))
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

    def has_free(self) -> bool:
        return len(self._busy) < len(self._readers)

    def submit(self, sub: int, fn: Callable[..., Any], *args: Any
               ) -> tuple[ray.ObjectRef, ray.ObjectRef, ray.ObjectRef]:
        """Run ``fn(*args)`` (reducing ``sub``) on a free reader: the refs of its three
        returns (table, stats, times: see ``reduce_partition``)."""
        node, reader = next((n, r) for n, r in self._readers
                            if _actor_key(r) not in self._busy)
        self._busy[_actor_key(reader)] = sub
        self._node_of[sub] = node
        table_ref, stats_ref, times_ref = reader.run.options(num_returns=3).remote(fn, *args)
        return table_ref, stats_ref, times_ref

    def done(self, sub: int) -> None:
        self._busy = {k: s for k, s in self._busy.items() if s != sub}

    def node_of(self, sub: int) -> str | None:
        return self._node_of.get(sub)

    def drop_nodes(self, nodes: set[str]) -> None:
        """Forget readers on ``nodes`` (dead) and fill the pool from the alive nodes."""
        self.lost_nodes |= set(nodes)
        self._readers = self._fill()
        keys = {_actor_key(r) for _, r in self._readers}
        self._busy = {k: s for k, s in self._busy.items() if k in keys}

    def close(self) -> None:
        """End this shuffle's extra readers (their output blocks stay: the driver owns
        them)."""
        for _, reader in self._extras:
            ray.kill(reader, no_restart=True)
        self._extras = []


def _actor_key(actor: Any) -> str:
    return actor._actor_id.hex()


def _check_outputs_survived(refs: Sequence[ray.ObjectRef | None], readers: _ReaderPool
                            ) -> None:
    """After a node died mid-shuffle: an output block that lived on it is gone, and its
    subpartition's segments were freed when its reducer finished, so it cannot be made
    again. Fail now, naming the node, rather than hand out a Dataset with a hole."""
    if not readers.lost_nodes:
        return
    lost = [sub for sub, ref in enumerate(refs)
            if ref is not None and readers.node_of(sub) in readers.lost_nodes]
    if lost:
        nodes = sorted({readers.node_of(sub) for sub in lost})
        raise ShuffleFailedError(
            f"node(s) {', '.join(nodes)} died after reducing partitions {lost}: their output "
            "blocks were stored there and went with the node; run the shuffle again")


def _release_quietly(master: Any, shuffle_id: str) -> bool:
    """Release a failed shuffle; returns False if the master is gone (nothing to release:
    its books went with it; ``hybrid-ray cleanup`` removes the data left behind)."""
    try:
        ray.get(master.release.remote(shuffle_id, "its driver's shuffle failed", True),
                timeout=MASTER_CALL_TIMEOUT_S)
        return True
    except ray.exceptions.RayActorError:
        return False
    except Exception:  # noqa: BLE001 - the shuffle's own error is what the caller needs
        return True


@dataclasses.dataclass
class ShuffleResult:
    """Reducer outputs (one Arrow table ref per partition) and the shuffle's report.

    ``block_stats`` holds, per partition, a ref to its (rows, bytes, schema).
    """

    refs: list[ray.ObjectRef]
    report: ShuffleReport
    block_stats: list[ray.ObjectRef] = dataclasses.field(default_factory=list)


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
    task fails beyond its retries.
    """
    config = config or ShuffleConfig()
    check_num_partitions(num_partitions)
    if not isinstance(schema, pa.Schema):
        raise ConfigError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
    if len(schema) == 0:
        raise ConfigError(
            "the blocks to shuffle have no columns: their rows cannot be shuffled (Arrow "
            "drops rows without columns when it takes or encodes them). Add a column, or "
            "count the rows instead of shuffling them")
    if not ray.is_initialized():
        ray.init()
    window = _reducer_window(config)
    check_remote_tier(config)
    # The wall clock and the phases start together, before the actors are looked up (or
    # started): the report's startup phase is what a user waits for before the first map.
    started = time.perf_counter()
    control = Stopwatch()  # the driver's calls to the master (PhaseTimes.control_plane)
    # Every actor at once (a no-op lookup once they run, or after hybrid_ray.init): started
    # one by one on first use, they made a first shuffle many times slower than the next.
    actors = start_actors(config.namespace, reader_count(config))
    master = actors.master.handle
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    inputs, input_nodes = _map_inputs(blocks, config)
    # Recoverable: a map whose memory-tier output died with its writer is run again.
    with control:
        ray.get(master.register.remote(shuffle_id, len(inputs), num_partitions, config,
                                       True))
    progress = ProgressBar(f"hybrid_ray {operation}", config.progress)
    readers: _ReaderPool | None = None
    try:
        maps = _MapDispatcher([(w.node_id, w.handle) for w in actors.writers], inputs,
                              shuffle_id, master, map_block,
                              (num_partitions, partitioner, config, master, schema),
                              input_nodes)
        hybrid = config.mode == ShuffleMode.HYBRID
        readers = _ReaderPool(config.namespace, window)
        # Reducer i is tracked by its small (rows, bytes, schema) result: waiting on the
        # tables would pull every output block to the driver's node.
        reduce_refs: list[ray.ObjectRef | None] = [None] * num_partitions
        stats_refs: list[ray.ObjectRef | None] = [None] * num_partitions
        running: dict[ray.ObjectRef, int] = {}  # stats ref -> subpartition
        times_refs: dict[int, ray.ObjectRef] = {}  # subpartition -> its ReduceTimes
        finished: set[int] = set()  # subpartitions whose block is stored
        todo = collections.deque(range(num_partitions))
        last_beat = 0.0
        # The reduce phase (perf_counter) and the reducers' own times, summed.
        reduce_start: float | None = None
        reduce_end: float | None = None
        reduce_times = ReduceTimes()
        while True:
            maps.poll()
            if maps.lost_nodes - readers.lost_nodes:
                readers.drop_nodes(maps.lost_nodes)
            maps_done = maps.done
            if running:
                ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0,
                                    fetch_local=False)
                for ref in ready:
                    sub = running.pop(ref)
                    try:
                        ray.get(ref)  # raise a failed reducer's error now
                    except WORKER_LOST_ERRORS as exc:
                        node = readers.node_of(sub)
                        if not lost_with_node(node, exc):
                            raise
                        # Its reader died with its node; the subpartition's segments
                        # are all still there (not freed): reduce it again elsewhere.
                        readers.drop_nodes({node})
                        todo.appendleft(sub)
                        continue
                    readers.done(sub)
                    finished.add(sub)
                    reduce_end = time.perf_counter()
                    # Returned with the stats, so ready now: a small inlined object.
                    times = ray.get(times_refs[sub])
                    reduce_times.waiting += times.waiting
                    reduce_times.control_plane += times.control_plane
                    # Its block is stored (owned by this driver): its segments can go now.
                    with control:
                        master.free_subpartition.remote(shuffle_id, sub)
            if hybrid or maps_done:
                while todo and readers.has_free():
                    sub = todo.popleft()
                    table_ref, stats_ref, times_refs[sub] = readers.submit(
                        sub, reduce_partition, shuffle_id, sub, schema, partitioner,
                        config, master)
                    reduce_refs[sub], stats_refs[sub] = table_ref, stats_ref
                    running[stats_ref] = sub
                    if reduce_start is None:
                        reduce_start = time.perf_counter()
            progress.update(maps.num_finished, len(inputs), len(finished), num_partitions)
            if maps_done and len(finished) == num_partitions:
                break
            if time.monotonic() - last_beat > HEARTBEAT_S:
                with control:
                    master.heartbeat.remote(shuffle_id)
                last_beat = time.monotonic()
            # Wake on the next map or reducer to finish (or fail: handled above).
            ray.wait(maps.running_refs() + list(running), num_returns=1, timeout=0.5,
                     fetch_local=False)
        _check_outputs_survived(reduce_refs, readers)
        with control:
            summary = ray.get(master.summary.remote(shuffle_id))
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):  # a user's stop is not a failure
            metrics.record_error(_error_kind(exc))
        # No ray.cancel(force=True): force-killing workers here was seen to take the driver
        # down with it. Released, the shuffle is unknown to the master, so tasks still
        # running fail at their next commit or poll, and a map deletes what it wrote.
        # The release never masks the shuffle's own error: a deletion that fails stays
        # queued at the master, which retries it until the data is gone.
        master_alive = _release_quietly(master, shuffle_id)
        if readers is not None:
            readers.close()
        progress.close()
        if isinstance(exc, KeyboardInterrupt):
            raise
        if not master_alive:
            raise ShuffleMasterLostError(
                f"{operation} shuffle {shuffle_id} failed: the shuffle master of namespace "
                f"{config.namespace!r} is gone (its node died or it was killed), and with it "
                "the books of every shuffle in flight; run it again") from exc
        # A bad input block (a map's ConfigError) is the user's to fix: say so, without
        # the remote traceback around it.
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        if isinstance(cause, ConfigError):
            raise ConfigError(f"{operation} shuffle {shuffle_id} failed and its data was "
                              f"removed: {cause}") from None
        if isinstance(exc, ShuffleFailedError) and not isinstance(
                exc, ray.exceptions.RayTaskError):
            raise
        error = ShuffleFailedError(
            f"{operation} shuffle {shuffle_id} failed: {describe_cause(exc)} (its data was "
            "removed; the remote traceback is on this error's __cause__)")
        raise error from exc
    with control:
        ray.get(master.release.remote(shuffle_id))
    # Every reducer has returned: its block is stored, owned by this driver.
    readers.close()
    progress.update(len(inputs), len(inputs), num_partitions, num_partitions, force=True)
    progress.close()
    ended = time.perf_counter()
    # No map (no input) or no reducer: that phase took no time; startup ran until then.
    first_map = maps.first_dispatch or ended
    phases = PhaseTimes(
        startup=first_map - started,
        map=(maps.last_finish or first_map) - first_map,
        reduce=(reduce_end or ended) - (reduce_start or ended),
        waiting=reduce_times.waiting,
        control_plane=control.seconds + maps.control.seconds + reduce_times.control_plane)
    report = _make_report(summary, operation, config, ended - started, phases)
    _set_last_report(report)
    metrics.record_shuffle(report)
    return ShuffleResult(list(reduce_refs), report, list(stats_refs))


def _error_kind(exc: BaseException) -> str:
    """The class name of the error behind a failed shuffle (a task's error unwrapped from
    Ray's ``RayTaskError``, as ``describe_cause`` does): the ``kind`` of the error metric."""
    return type(_unwrap_task_error(exc)).__name__


def _reducer_window(config: ShuffleConfig) -> int:
    """Reducers run at once: ``max_concurrent_reducers`` or the cluster's CPU count,
    refused above ``MAX_REDUCERS_PER_CPU`` times the CPUs (each is a process)."""
    cpus = _cluster_cpus()
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


def _make_report(summary: dict, operation: str, config: ShuffleConfig,
                 wall: float, phases: PhaseTimes | None = None) -> ShuffleReport:
    """The report of a finished shuffle from the master's ``summary``. ``phases``: the
    driver's measurements, to which the writers' control-plane time (in the maps' stats)
    is added; None leaves the report without phases (not measured)."""
    stats = WriteStats()
    for s in summary["map_stats"]:
        if s is not None:
            stats.merge(s)
    per_node: dict[str, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
    for key, (nbytes, count) in summary["per_node_tier"].items():
        node, tier = key.split("|")
        per_node[node][tier] = (nbytes, count)
    first, last = summary["first_delivery"], summary["last_map_finish"]
    return ShuffleReport(
        shuffle_id=summary["shuffle_id"], operation=operation, mode=config.mode.value,
        spilling=config.spilling.value, num_maps=summary["num_maps"],
        num_partitions=summary["num_subpartitions"], rows=stats.rows,
        input_bytes=0, wall_time_s=wall, per_node_tier=dict(per_node),
        tier_switches=stats.tier_switches, spill_events=stats.spill_events,
        superseded_attempts=summary["superseded_attempts"],
        lost_maps_rerun=summary["lost_maps_rerun"],
        hybrid_overlap=bool(first is not None and last is not None and first < last),
        uncompressed_segments=stats.uncompressed_segments,
        phases=None if phases is None else dataclasses.replace(
            phases, control_plane=phases.control_plane + stats.control_plane_s),
    )


# ---- public Dataset API ---------------------------------------------------------------------------
def check_remote_tier(config: ShuffleConfig) -> None:
    """Fail fast, with the fix, before any task runs if the remote tier is unreachable
    (constructing the tier probes it once)."""
    if config.remote_path is not None:
        open_remote_tier(config, check_reachable=True).close()


def check_num_partitions(num_partitions: Any) -> None:
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) \
            or num_partitions <= 0:
        raise ConfigError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    if num_partitions > MAX_PARTITIONS:
        raise ConfigError(
            f"num_partitions={num_partitions} is more than hybrid_ray's limit of "
            f"{MAX_PARTITIONS}: every partition costs each map's writer memory and at least "
            "one segment. Use fewer partitions (a partition of even 1 TB at the limit is "
            "10 MB)")


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
    schemas differ are refused here, before anything is shuffled."""
    if not isinstance(ds, ray.data.Dataset):
        raise TypeError(f"expected a ray.data.Dataset, got {type(ds).__name__}; "
                        "wrap Arrow tables with ray.data.from_arrow(...)")
    ds = ds.materialize()
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
        schema = _unify_schemas([sch for _, sch in schemas],
                                lambda k: f"block {schemas[k][0]} of the dataset")
    elif schema is None and refs:
        schema = ray.get(refs[0]).schema
    return _Blocks(refs, schema, nbytes, num_rows)


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


def _empty_dataset(num_partitions: int, schema: pa.Schema | None) -> ray.data.Dataset:
    """The result of shuffling no rows: ``num_partitions`` empty blocks of ``schema``, or,
    with the schema unknown, a dataset with no blocks (and so no schema either)."""
    if schema is None:
        return _materialized_dataset([], [])
    empty = schema.empty_table()
    ref = ray.put(empty)
    return _materialized_dataset([ref] * num_partitions,
                                 [(0, 0, schema)] * num_partitions)


def _check_optional_partitions(num_partitions: Any) -> None:
    if num_partitions is not None:
        check_num_partitions(num_partitions)


def _to_dataset(result: ShuffleResult, input_bytes: int) -> ray.data.Dataset:
    result.report.input_bytes = input_bytes
    _set_last_report(result.report)
    ds = _materialized_dataset(result.refs, ray.get(result.block_stats))
    setattr(ds, _REPORT_ATTR, result.report)
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


def repartition(ds: ray.data.Dataset, num_partitions: int, keys: Sequence[str],
                config: ShuffleConfig | None = None) -> ray.data.Dataset:
    """Hash-partition ``ds`` by ``keys`` into ``num_partitions`` blocks through the tiers.

    Rows with equal keys land in the same output block, whatever their representation
    (see ``hybrid_ray.partitioning.hash_column``); every row appears exactly once. A
    dataset with no rows gives ``num_partitions`` empty blocks. The shuffle's report is
    available from ``hybrid_ray.last_report()``.
    """
    check_num_partitions(num_partitions)
    if isinstance(keys, str):
        keys = [keys]
    if not keys:
        raise ConfigError("keys must name at least one column to partition by")
    blocks = _dataset_blocks(ds)
    _check_columns(blocks.schema, keys, "repartition keys")
    if not blocks.refs:
        return _empty_dataset(num_partitions, blocks.schema)
    result = run_shuffle(blocks.refs, num_partitions, HashPartitioner(keys), blocks.schema,
                         config, "repartition")
    return _to_dataset(result, blocks.nbytes)


def sort(ds: ray.data.Dataset, key: str, descending: bool = False,
         config: ShuffleConfig | None = None, num_partitions: int | None = None
         ) -> ray.data.Dataset:
    """Globally sort ``ds`` by ``key``: range partitions from sampled boundaries, each
    sorted by its reducer, so the blocks in order form the sorted dataset.

    Nulls (and NaNs) sort as Ray Data sorts them: greater than every value, so last when
    ascending and first when descending, NaNs next to the nulls. ``num_partitions``
    defaults to the number of maps (input blocks, small ones grouped).
    """
    if not isinstance(key, str):
        raise ConfigError(f"sort key must be a column name, got {key!r}")
    _check_optional_partitions(num_partitions)
    blocks = _dataset_blocks(ds)
    _check_columns(blocks.schema, [key], "sort key")
    config = config or ShuffleConfig()
    if not blocks.refs:
        return _empty_dataset(num_partitions or 1, blocks.schema)
    n = num_partitions or _default_partitions(blocks.refs, config)
    groups = _plan_maps(_block_locations(blocks.refs)[1], config)
    samples = ray.get([_sample_task.remote(key, SAMPLES_PER_BLOCK,
                                           *[blocks.refs[i] for i in group])
                       for group in groups])
    non_empty = [s for s in samples if len(s)]
    boundaries = range_boundaries(np.concatenate(non_empty) if non_empty else np.asarray([]), n)
    result = run_shuffle(blocks.refs, n, RangePartitioner(key, boundaries, descending),
                         blocks.schema, config, "sort")
    return _to_dataset(result, blocks.nbytes)


def _default_partitions(refs: Sequence[ray.ObjectRef], config: ShuffleConfig) -> int:
    """One output partition per map: per input block, small blocks grouped (so 10,000
    one-row blocks do not become 10,000 one-row partitions)."""
    return max(1, min(MAX_PARTITIONS, len(_plan_maps(_block_locations(refs)[1], config))))


def random_shuffle(ds: ray.data.Dataset, seed: int | None = None,
                   config: ShuffleConfig | None = None, num_partitions: int | None = None
                   ) -> ray.data.Dataset:
    """Randomly permute the rows of ``ds``; the same ``seed`` (an integer in
    ``[0, 2**63)``) gives the same result. ``num_partitions`` defaults to the number of
    maps (input blocks, small ones grouped)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < MAX_SEED):
        raise ConfigError(f"seed must be None or an integer with 0 <= seed < 2**63, got "
                          f"{seed!r}")
    _check_optional_partitions(num_partitions)
    blocks = _dataset_blocks(ds)
    config = config or ShuffleConfig()
    if not blocks.refs:
        return _empty_dataset(num_partitions or 1, blocks.schema)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % MAX_SEED)
    n = num_partitions or _default_partitions(blocks.refs, config)
    result = run_shuffle(blocks.refs, n, RandomPartitioner(seed), blocks.schema, config,
                         "random_shuffle")
    return _to_dataset(result, blocks.nbytes)

