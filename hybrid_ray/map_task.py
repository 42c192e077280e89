"""The map task: one map partition written through the tiers of its node.

Runs in any process connected to the cluster: a writer actor (``run_shuffle``, the Spark
bridge's direct parquet scan) or a Spark executor's Python worker (the bridge's executor
path). Each attempt of a map asks the shuffle master for an attempt number, cuts its rows
into segments per subpartition (``clients.WriteClient``), commits them chunk by chunk so
hybrid readers see data while the map still writes, and finishes; an attempt that fails
deletes what it wrote before its error propagates.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from hybrid_ray.actors import ActorNodeStorage, answer_of, get_tier_manager, restarted_worker
from hybrid_ray.clients import WriteClient, WriteStats
from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.errors import (
    ConfigError, ShuffleFailedError, ShuffleReleasedError, ShuffleStalledError,
)
from hybrid_ray.io_tiers import io_tiers_for
from hybrid_ray.partitioning import Partitioner, content_digest, split_by_partition
from hybrid_ray.report import Stopwatch
from hybrid_ray.segment import SegmentMeta

_LOG = logging.getLogger(__name__)


# ---- tasks -----------------------------------------------------------------------------------
def write_map_partition(shuffle_id: str, map_index: int, chunks: Iterable[pa.Table],
                        num_partitions: int, partitioner: Partitioner, config: ShuffleConfig,
                        master: Any, raise_if_superseded: bool = False,
                        own_memory_segments: bool = False,
                        on_attempt: Callable[[int], None] | None = None,
                        attempt: int | None = None) -> WriteStats | None:
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
    ``attempt``: the attempt begun for this map at registration (``MapRunner`` passes 0
    for a map's first run); None: ask the master for one (``begin_map``). A given attempt
    is used only if this process may be its only run (``_first_run_of``).
    """
    node_id = ray.get_runtime_context().get_node_id()
    # Every bookkeeping call of this attempt is timed into one stopwatch: the report's
    # control-plane time (the stats travel with finish_map, so that call is not in it).
    control = Stopwatch()
    pid = os.getpid()
    if attempt is None or not _first_run_of(shuffle_id, map_index, attempt):
        with control:
            attempt = answer_of(master.begin_map.remote(shuffle_id, map_index, node_id, pid),
                                f"the shuffle master's begin_map for map {map_index}")
    if attempt is None:
        return None
    if on_attempt is not None:
        on_attempt(attempt)
    # The node's tier manager registers the shuffle with this map's first reservation.
    tm = get_tier_manager(node_id, config.namespace)
    superseded = []
    # The segments of the last flush (``close``) travel with finish_map: one call, not two.
    last_segments: list[SegmentMeta] | None = None

    # The commit sent last, not waited for yet: the map writes its next chunk meanwhile
    # (a blocking commit per chunk left a core idle for a round trip each time).
    sent: list[ray.ObjectRef] = []

    def settle_sent():
        """Wait for the commit sent last (long done, normally: a chunk's work came since)
        and note whether the master refused it. Before the next commit and before
        finish_map: the master runs calls on several threads, so a later call must not be
        sent before the previous one ran (segments are kept in the order of their index)."""
        if sent:
            with control:
                live = answer_of(sent.pop(),
                                 f"the shuffle master's commit for map {map_index}")
            if not live:
                superseded.append(True)

    def commit(metas):
        if last_segments is not None:  # closing: held for finish_map
            last_segments.extend(metas)
            return
        settle_sent()
        with control:
            sent.append(master.commit.remote(shuffle_id, map_index, attempt, metas, pid))

    # Which input rows went to each subpartition (``split_by_partition``), for the
    # master's check of a re-run against reducers that kept this run's rows.
    digests = [0] * num_partitions
    rows_seen = 0
    client = WriteClient(shuffle_id, map_index, num_partitions, config,
                         ActorNodeStorage(tm, control, register=config),
                         io_tiers_for(config, node_id, own_memory_segments, owner=tm),
                         attempt=attempt, node_id=node_id, on_commit=commit)
    try:
        # Commit chunk by chunk: hybrid readers see data while the partition is being
        # written. The last chunk's segments are placed with the tails and committed with
        # finish_map: a commit and a reservation just before close cost two round trips
        # and showed readers nothing sooner.
        pending = iter(chunks)
        upcoming = next(pending, None)
        while upcoming is not None:
            chunk, upcoming = upcoming, next(pending, None)
            if chunk.num_rows == 0:
                continue
            parts = _checked_assignment(partitioner, chunk, map_index, num_partitions)
            last = upcoming is None
            content = content_digest(chunk) if partitioner.assigns_by_position else 0
            client.write_many(split_by_partition(chunk, parts, num_partitions, digests,
                                                 rows_seen, content), place=not last)
            rows_seen += chunk.num_rows
            if not last:
                client.flush()
            if superseded:
                break
        settle_sent()
        if not superseded:
            last_segments = []
            # Its last segments go to finish_map, its last settlements beside it (below).
            client.close(settle=False)
        if superseded:
            # A newer attempt of this map runs (a lost map run again): the master refused
            # and deleted this attempt's segments; its work is simply not needed.
            client.abort()
    except BaseException as exc:
        _abort_keeping_the_cause(client, exc)
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
    # The last settle (disk grants written) travels beside finish_map: two round trips
    # waited for together, not one after the other.
    settled = client.start_settling()
    # Refused (another attempt finished first, or this one was superseded meanwhile): the
    # master deletes the last segments as it does a refused commit's.
    try:
        row_digests = {sub: d for sub, d in enumerate(digests) if d}
        finished = answer_of(
            master.finish_map.remote(shuffle_id, map_index, attempt, client.stats,
                                     last_segments, pid, row_digests),
            f"the shuffle master's finish_map for map {map_index}")
    except (ShuffleStalledError, ray.exceptions.ActorUnavailableError):
        # No answer in time, or the master unreachable for a moment (Ray: the call "may
        # or may not have been executed"): the call may have run or still run, and the
        # master take this attempt as the map's output. Deleting its files now left the
        # master listing segments that were gone (readers then failed naming "someone
        # else" as the culprit). They are the shuffle's: its release removes them (a late
        # write after a release is swept by the tier manager's late-files sweep), and
        # this attempt fails.
        settled()  # (its error is the lesser one: the stall is raised)
        raise
    except BaseException as exc:
        # No answer, or the shuffle is gone (failed and released while this map wrote):
        # the master never took the last segments, and a release that came after this
        # map's reservation may have found none of its files yet. Delete them here, once
        # the settle answered: if it failed, its settlements go again with the abort.
        settled()
        _abort_keeping_the_cause(client, exc)
        raise
    _settled_after_finish(client, settled(), shuffle_id, map_index)
    if not finished and raise_if_superseded:
        # Spark runs speculative attempts side by side: report failure so Spark keeps the
        # attempt whose segments count. (A Ray task retry only follows a dead attempt.)
        raise ShuffleFailedError(f"map {map_index} attempt {attempt} was superseded before "
                                 "it finished; its segments do not count")
    if not finished:
        # Its segments do not count: its statistics must not replace those of the run
        # whose output does (MapRunner keeps a map's result unless a run was skipped).
        return None
    return client.stats


def _settled_after_finish(client: WriteClient, error: BaseException | None, shuffle_id: str,
                          map_index: int) -> None:
    """A map's last settle, sent beside its ``finish_map``, failed (``error``; None: it did
    not): the map's output counts (or was refused and is deleted by the master) whatever
    became of it, so the map does not fail for it. The settlements go once more; if that
    fails too, the node counts those disk grants as in flight until the shuffle's release
    (its space, never its data), and a warning says so."""
    if error is None:
        return
    try:
        client.settle_pending()
    except Exception as exc:  # noqa: BLE001 - space accounting only: warned, not raised
        _LOG.warning("map %d of shuffle %s: its last settle failed twice (%s: %s, then "
                     "%s: %s); its node counts those disk grants as in flight until the "
                     "shuffle's release", map_index, shuffle_id, type(error).__name__,
                     error, type(exc).__name__, exc)


def _checked_assignment(partitioner: Partitioner, chunk: pa.Table, map_index: int,
                        num_partitions: int) -> np.ndarray:
    """``partitioner.assign`` of a chunk, checked: one integer in [0, num_partitions) per
    row. A custom partitioner returning fewer labels than rows had its chunk's other rows
    dropped without a word, and one returning labels out of range failed deep in numpy."""
    parts = np.asarray(partitioner.assign(chunk, map_index, num_partitions))
    name = type(partitioner).__name__
    if parts.shape != (chunk.num_rows,) or not np.issubdtype(parts.dtype, np.integer):
        raise ConfigError(
            f"{name}.assign returned {parts.dtype} of shape {parts.shape} for a chunk of "
            f"{chunk.num_rows} rows of map {map_index}: it must return one integer "
            "subpartition per row")
    if len(parts) and (parts.min() < 0 or parts.max() >= num_partitions):
        raise ConfigError(
            f"{name}.assign returned subpartitions from {parts.min()} to {parts.max()} for "
            f"map {map_index}: each must be in [0, {num_partitions})")
    return parts


# (shuffle, map, attempt) begun at registration that this process started, newest last.
_STARTED_ATTEMPTS: collections.OrderedDict[tuple[str, int, int], None] = \
    collections.OrderedDict()
_STARTED_ATTEMPTS_KEPT = 4096


def _first_run_of(shuffle_id: str, map_index: int, attempt: int) -> bool:
    """Whether this run may write as ``attempt``, begun for it at registration.

    Ray runs an actor task again after its process died (``max_task_retries``), with the
    same arguments, and may run it again in the same process if the call's reply was lost.
    A second run writing as the first one's attempt would add its segments to the first
    one's: duplicate rows. So a run Ray retried (its task attempt number is above 0; where
    this Ray cannot say, any run in a restarted writer) or a process that already started
    this attempt asks the master for a new attempt instead, which supersedes the first
    run's (its segments are deleted, its readers reset). Only retried runs: a restarted
    writer's later maps use their registered attempts, so its later shuffles report no
    retried attempts that never happened."""
    task_attempt = _ray_task_attempt()
    if task_attempt is None:
        if restarted_worker():
            return False
    elif task_attempt > 0:
        return False
    key = (shuffle_id, map_index, attempt)
    if key in _STARTED_ATTEMPTS:
        return False
    _STARTED_ATTEMPTS[key] = None
    while len(_STARTED_ATTEMPTS) > _STARTED_ATTEMPTS_KEPT:
        _STARTED_ATTEMPTS.popitem(last=False)
    return True


def _ray_task_attempt() -> int | None:
    """Ray's attempt number of the task running in this thread: 0 for its first run, 1 or
    more when Ray runs it again (after its actor's process died). None where this Ray
    version does not expose it (the call is Ray-internal)."""
    try:
        worker = ray._private.worker.global_worker  # noqa: SLF001 - no public API for it
        return int(worker.core_worker.get_current_task_attempt_number())
    except Exception:  # noqa: BLE001 - fall back to restarted_worker()
        return None


def _abort_keeping_the_cause(client: WriteClient, cause: BaseException) -> None:
    """Abort a failed map attempt's writes without masking why it failed (``cause``).

    The storage that failed the map often fails the abort's deletions too (an S3 store
    that went down fails the upload, then the delete of what was uploaded before): the
    map's error was then a raw ``EndpointConnectionError`` of the delete instead of the
    ``RemoteTierError`` naming the upload. What the abort could not delete is deleted with
    the shuffle: the failed map fails the shuffle (or, on Spark, its release), and the
    master retries that deletion until the data is gone.
    """
    try:
        client.abort(shuffle_released=_says_shuffle_released(cause))
    except Exception:  # noqa: BLE001 - the map's own error is what the caller needs
        pass


def _says_shuffle_released(error: BaseException) -> bool:
    """Whether a map's error says its shuffle was released (by the master or the node's
    tier manager): nothing will release it again. (Not a bare ``ShuffleNotFoundError``:
    a master started again after a crash knows no shuffle, and a live one's data stays.)"""
    return isinstance(error, ShuffleReleasedError)


@dataclasses.dataclass(frozen=True)
class BlockPiece:
    """The input of a map that partitions one piece of a large input block: rows
    ``[n * index // count, n * (index + 1) // count)`` of the block's ``n``, so the pieces
    ``0 .. count-1`` (consecutive maps) hold every row once, in order."""

    block: ray.ObjectRef
    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"piece {self.index} of {self.count}: index must be in "
                             f"[0, {self.count})")

    def rows_of(self, table: pa.Table) -> pa.Table:
        """This piece's rows of ``table`` (the whole block), zero-copy."""
        n = table.num_rows
        start = n * self.index // self.count
        return table.slice(start, n * (self.index + 1) // self.count - start)


def map_block(shuffle_id: str, map_index: int,
              block: pa.Table | Sequence[ray.ObjectRef] | BlockPiece,
              num_partitions: int, partitioner: Partitioner, config: ShuffleConfig,
              master: Any, schema: pa.Schema | None = None,
              attempt: int | None = None) -> dict:
    """One map of ``run_shuffle``, run by a writer actor (``get_writers``) that owns the
    memory-tier segments it writes.

    ``block`` is one table, the references of a group of small input blocks (see
    ``_group_blocks``) that this map reads and partitions as one table, or one piece of a
    large block (``BlockPiece``, see ``_split_tail``). Every block must have ``schema``
    (when given): a block that differs fails the map, before it writes anything, with
    both schemas' differing fields named. ``attempt``: see ``write_map_partition``.
    """
    if isinstance(block, BlockPiece):
        tables = [block.rows_of(_input_table(ray.get(block.block), 0, map_index))]
    else:
        if isinstance(block, (list, tuple)) and all(isinstance(b, ray.ObjectRef)
                                                    for b in block):
            values = ray.get(list(block))
        else:  # one block, its value (Ray resolved the reference)
            values = [block]
        tables = [_input_table(value, i, map_index) for i, value in enumerate(values)]
    if schema is not None:
        schema = with_extension_types(schema)
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
                                config, master, own_memory_segments=True, attempt=attempt)
    return {"rows": stats.rows if stats else 0, "skipped": stats is None}


def _input_table(value: Any, index: int, map_index: int) -> pa.Table:
    """``value`` if it is an Arrow table, else a ConfigError naming what it is and the fix:
    a reference to a pandas DataFrame or a list (``run_shuffle``'s blocks are only
    checked to be references) failed the map with Ray's "Attempting to call `get` on the
    value 'key', which is not an ray.ObjectRef", or an AttributeError."""
    if isinstance(value, pa.Table):
        return value
    raise ConfigError(f"input block {index} of map {map_index} is a "
                      f"{type(value).__module__}.{type(value).__qualname__}, not a "
                      "pyarrow.Table: run_shuffle's blocks must be references of Arrow "
                      "tables, e.g. ray.put(pa.Table.from_pandas(df)) or a Dataset's "
                      "to_arrow_refs()")


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


_EXTENSION_NAME = b"ARROW:extension:name"


def with_extension_types(schema: pa.Schema) -> pa.Schema:
    """``schema`` with the extension types its fields name registered and restored.

    A schema that crosses processes in Arrow's IPC form (as Ray passes it to a worker)
    comes out with an extension field's storage type and the extension's name in the
    field's metadata when the receiving process has not registered that type yet. Ray
    Data registers its tensor and Python-object types when its modules are imported,
    which a fresh writer had not done: the first shuffle of a dataset with a tensor column
    failed there ("different schemas ... ArrowTensorTypeV2 vs large_list"), and readers
    decoded such columns as plain lists. Ray Data's types are registered here (by
    importing it) and the schema read again; other unregistered types stay as stored.
    """
    names = [field.metadata.get(_EXTENSION_NAME) for field in schema
             if field.metadata and _EXTENSION_NAME in field.metadata]
    if not names:
        return schema
    if any(name.startswith(b"ray.data.") for name in names):
        import ray.data  # noqa: F401 - registers Ray Data's Arrow extension types
    return pa.ipc.read_schema(pa.py_buffer(schema.serialize()))


def unify_schemas(schemas: Sequence[pa.Schema], what: Callable[[int], str]) -> pa.Schema:
    """The one schema blocks with ``schemas`` are shuffled as.

    Blocks may differ only in representation: a column dictionary-encoded in some blocks
    and not in others (decoded to its value type), nullable in some (nullable), or of
    Arrow's null type in some (a block whose values are all None, as Ray Data infers
    from_items and JSON: the other blocks' type). Anything else is refused with both
    differing fields named, and the fix.
    """
    first = schemas[0]
    fields = list(first)

    def compatible(a: pa.Field, b: pa.Field) -> bool:
        return _decoded(a) == _decoded(b) or pa.types.is_null(a.type) \
            or pa.types.is_null(b.type)

    for i, other in enumerate(schemas[1:], 1):
        if other.equals(first, check_metadata=False):
            continue
        if other.names != first.names or not all(
                compatible(a, b) for a, b in zip(other, fields)):
            # The fix named must work for the differences refused here: pyarrow's
            # default unify_schemas refuses int32 vs int64 itself, and a cast to a schema
            # whose columns are in another order fails; hence permissive and select.
            raise ConfigError(
                f"the blocks to shuffle have different schemas: {what(i)} differs from "
                f"{what(0)} in {_schema_difference(other, first)}. Cast every block to one "
                "schema first (e.g. ds.map_batches(lambda t: t.select(schema.names)"
                ".cast(schema), batch_format='pyarrow'), with schema = "
                "pyarrow.unify_schemas([...], promote_options='permissive'))")
        for k, (a, b) in enumerate(zip(other, fields)):
            if not a.equals(b):
                kind = _decoded(a) if pa.types.is_null(b.type) else _decoded(b)
                nullable = b.nullable or a.nullable or pa.types.is_null(a.type) \
                    or pa.types.is_null(b.type)
                fields[k] = pa.field(b.name, kind, nullable)
    return pa.schema(fields, metadata=first.metadata)


def _conform(table: pa.Table, schema: pa.Schema, what: str) -> pa.Table:
    """``table`` as ``schema`` (dictionaries decoded: see ``unify_schemas``), or a
    ConfigError naming the fields that differ."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    unify_schemas([schema, table.schema],
                   lambda i: what if i else "the shuffle's schema")
    return table.cast(schema)

