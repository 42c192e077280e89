"""The data path between Spark and hybrid_ray: no row passes through RayDP's converters.

Map side, if ``df`` is a plain scan of local parquet files: hybrid_ray's writer actors read
the files themselves (``parquet_scan``). Otherwise ``df.mapInArrow`` runs in the executors'
Python workers. Each worker connects to
the Ray cluster once (workers are reused) and writes its partition's Arrow batches through
hybrid_ray's write client on its own node: memory tier (objects owned by the node's tier
manager, so they outlive the worker), local disk, remote store. Spark's task partition id is
the map index; a retried or speculative Spark task is a new map attempt that writes all its
rows, and the driver seals the shuffle with the attempt of each task that Spark reports as
succeeded (``ShuffleRegistry.seal``), so exactly one attempt per map counts.

On the direct path the writer actors own the memory-tier segments they wrote. A writer that
dies (and is restarted by Ray) takes them along: a reader that finds one gone reports it, and
the driver runs that map again (``ShuffleLifecycle.hold``) for as long as it holds the
shuffle, since Spark may run the reduce stage any time, and again.

Reduce side: ``spark.range(n, numPartitions=n).mapInArrow(...)`` gives Spark task i the
subpartition i, which it reads through the read client and hands back to the JVM as Arrow.
The map stage runs eagerly (one Spark job) so the report is ready when the call returns; the
reduce stage is an ordinary lazy DataFrame that Spark may recompute, so the shuffle's data
stays until ``release(df)``, ``release_all()``, ``stop_spark()`` or, if this driver dies,
the shuffle master's orphan TTL.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import ray

from hybrid_ray.actors import get_master, get_writers
from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import ShuffleFailedError, ShuffleNotFoundError
from hybrid_ray.partitioning import Partitioner
from hybrid_ray.report import ShuffleReport
from hybrid_ray import lifecycle
from hybrid_ray import metrics
from hybrid_ray.lifecycle import AttemptPolicy, ShuffleLifecycle, error_kind
from hybrid_ray.map_task import write_map_partition
from hybrid_ray.reduce_task import read_subpartition
from hybrid_ray.shuffle import check_remote_tier
from spark_bridge import parquet_scan

# The bridge's shuffle ids start with this (the JVM shuffle manager's with its own).
SHUFFLE_ID_PREFIX = "spk"
MAP_RESULT_SCHEMA = "map_index int, attempt int, rows long, bytes long"
# Batches handed back to the JVM are cut to this many rows: Spark converts each batch to
# rows in one go, and very large batches only raise its peak memory.
MAX_ROWS_PER_OUTPUT_BATCH = 1 << 17

# A chunk transform runs on each map-side chunk before partitioning (projection, partial
# aggregation); a reducer turns the tables of its subpartition (one list per input shuffle)
# into output tables.
ChunkTransform = Callable[[pa.Table], pa.Table]
Reducer = Callable[[list[list[pa.Table]], int], Iterator[pa.Table]]


# ---- in the executors' Python workers ---------------------------------------------------------
def connect_ray(address: str) -> None:
    """Join the driver's Ray cluster from a Spark Python worker (once per reused worker).

    The address is passed explicitly: "auto" could find another cluster on a shared machine.
    """
    if not ray.is_initialized():
        # Keep Ray's C++ INFO lines out of every Spark task's stderr.
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "warning")
        ray.init(address=address, log_to_driver=False, configure_logging=False)


def _arrow_chunks(batches: Iterator[pa.RecordBatch], target_bytes: int,
                  transform: ChunkTransform | None) -> Iterator[pa.Table]:
    """Group Spark's small Arrow batches (10k rows by default) into ~target_bytes tables:
    partitioning per tiny batch would cut tiny segments and cost a commit each."""
    pending: list[pa.RecordBatch] = []
    size = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        size += batch.nbytes
        if size >= target_bytes:
            table = pa.Table.from_batches(pending)
            yield transform(table) if transform else table
            pending, size = [], 0
    if pending:
        table = pa.Table.from_batches(pending)
        yield transform(table) if transform else table


def make_map_function(address: str, shuffle_id: str, num_partitions: int,
                      partitioner: Partitioner, config: ShuffleConfig,
                      transform: ChunkTransform | None = None
                      ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of the map stage: writes the partition, yields one row."""

    def map_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        connect_ray(address)
        map_index = TaskContext.get().partitionId()
        input_bytes = 0

        def counted() -> Iterator[pa.RecordBatch]:
            nonlocal input_bytes
            for batch in batches:
                input_bytes += batch.nbytes
                yield batch

        master = get_master(config.namespace)
        attempts: list[int] = []
        stats = write_map_partition(
            shuffle_id, map_index, _arrow_chunks(counted(), config.map_chunk_bytes, transform),
            num_partitions, partitioner, config, master, raise_if_superseded=True,
            on_attempt=attempts.append)
        if stats is None or not attempts:  # the shuffle is open: every attempt writes
            raise ShuffleFailedError(f"map {map_index} of {shuffle_id} wrote nothing")
        # The attempt goes back with Spark's result: the driver keeps the segments of the
        # attempt whose task succeeded, not of whichever attempt finished writing first.
        yield pa.RecordBatch.from_pydict(
            {"map_index": [map_index], "attempt": [attempts[0]],
             "rows": [stats.rows], "bytes": [input_bytes]},
            schema=pa.schema([("map_index", pa.int32()), ("attempt", pa.int32()),
                              ("rows", pa.int64()), ("bytes", pa.int64())]))

    return map_partition


def _cut(table: pa.Table, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    if table.schema != schema:
        table = table.select(schema.names).cast(schema)
    yield from table.to_batches(max_chunksize=MAX_ROWS_PER_OUTPUT_BATCH)


def make_reduce_function(address: str, shuffles: Sequence[BridgeShuffle], reducer: Reducer,
                         out_schema: pa.Schema
                         ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of the reduce stage over ``spark.range(n)``: each input
    id is a subpartition to read from every shuffle and reduce."""
    handles = [(s.shuffle_id, s.config) for s in shuffles]

    def reduce_partitions(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        connect_ray(address)
        for batch in ids:
            for subpartition in batch.column(0).to_pylist():
                inputs = []
                for shuffle_id, config in handles:
                    try:
                        inputs.append(read_subpartition(shuffle_id, subpartition, config,
                                                        get_master(config.namespace)))
                    except ShuffleFailedError as exc:  # its map stage failed: say why
                        raise ShuffleFailedError(str(exc)) from None
                    except ShuffleNotFoundError as exc:
                        raise ShuffleNotFoundError(
                            f"{exc}. The hybrid_ray shuffle behind this DataFrame was released "
                            "(spark_bridge.release/stop_spark, or its driver stopped "
                            "heartbeating); run the spark_bridge operation again") from None
                for table in reducer(inputs, subpartition):
                    yield from _cut(table, out_schema)

    return reduce_partitions


# ---- on the driver ------------------------------------------------------------------------------
@dataclasses.dataclass
class BridgeShuffle:
    """A hybrid_ray shuffle written by a map stage and held for its reduce stage.

    A direct-scan map stage runs in the background: the reduce stage may start at once and
    read segments as the writers commit them (hybrid). ``report`` waits for the map stage.
    """

    shuffle_id: str
    num_partitions: int
    config: ShuffleConfig
    schema: pa.Schema  # the Arrow schema of the rows that were shuffled
    _report: ShuffleReport | None = None
    _error: BaseException | None = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def report(self) -> ShuffleReport:
        """The map stage's report, once it has finished; raises ``ShuffleFailedError`` if
        it failed (its data is then gone)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    @property
    def map_stage_done(self) -> bool:
        return self._done.is_set()


# The most recent exchange of each thread: exchanges run in threads side by side must not
# see each other's (``last_report``).
_last = threading.local()


def last_report() -> ShuffleReport | None:
    """The report of the most recent exchange the bridge ran in the calling thread (waiting
    for its map stage if that still runs; raising ``ShuffleFailedError`` if it failed);
    None if the most recent operation ran Spark's own operator through the session's
    shuffle manager (its reports: ``spark_shuffle_reports()``). A DataFrame's own shuffles
    are named on it (``df._hybrid_ray_shuffles``)."""
    shuffle = getattr(_last, "shuffle", None)
    return shuffle.report if shuffle is not None else None


def forget_last() -> None:
    """The calling thread's next operation runs through the shuffle manager: from now
    ``last_report()`` is None (it returned an older exchange's report after a fallback)."""
    _last.shuffle = None


def release(shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
    """Delete a held shuffle's data on every node and the remote tier (readers still
    running are told ``reason``; with ``failed``, as a ``ShuffleFailedError``)."""
    shuffle = lifecycle.held_shuffle(shuffle_id)
    if shuffle is None or not ray.is_initialized():
        return False
    return shuffle.release(reason, failed)


def _release_failed(shuffle_id: str, why: str) -> str:
    """Release a shuffle that failed, telling its readers ``why``. Returns "" or, if the
    release itself failed (Ray going down, the master gone), a sentence saying so for the
    error the caller raises: the caller's failure stays the error, and the data is then
    removed by the master's orphan TTL (or ``hybrid-ray cleanup``)."""
    try:
        release(shuffle_id, why, failed=True)
    except Exception as exc:  # noqa: BLE001 - reported in the caller's error, not raised
        return (f" (its data could not be removed now: {type(exc).__name__}: {exc}; the "
                "shuffle master removes it after the config's orphan_ttl_s, or run "
                "`hybrid-ray cleanup`)")
    return ""


def release_all() -> int:
    """Release every shuffle this process's bridge holds; returns how many. Each is tried:
    one whose release fails (its master gone) does not keep the others held; the first
    such error is raised after all were tried."""
    released, errors = 0, []
    for shuffle_id in held_shuffles():
        try:
            released += release(shuffle_id)
        except Exception as exc:  # noqa: BLE001 - raised below, after the others
            errors.append(exc)
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"{len(errors) - 1} more shuffle release(s) failed too")
        raise errors[0]
    return released


def held_shuffles() -> list[str]:
    """The ids of the bridge's shuffles this process holds for their reduce stages."""
    return [s for s in lifecycle.held_shuffle_ids() if s.startswith(SHUFFLE_ID_PREFIX + "-")]


def _explain_spark_failure(exc: BaseException) -> str:
    """The line of a Spark job failure that says what went wrong in our code, if any.
    A map of the direct path failed in a writer actor: its cause, not Ray's task header
    (``lifecycle.describe_cause`` unwraps it, however deeply nested)."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        return lifecycle.describe_cause(exc)
    text = str(exc)
    for line in text.splitlines():
        if "hybrid_ray.errors." in line or "Error:" in line and "hybrid_ray" in line:
            return line.strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:1000]
    return type(exc).__name__


def run_map_stage(df: Any, num_partitions: int, partitioner: Partitioner,
                  config: ShuffleConfig, operation: str,
                  transform: ChunkTransform | None = None,
                  shuffled_schema: pa.Schema | None = None,
                  direct_scan: bool = True,
                  scan: parquet_scan.ParquetScan | None = None) -> BridgeShuffle:
    """Shuffle ``df``'s rows (after ``transform``) into ``num_partitions`` subpartitions.

    If ``df`` is a plain scan of local parquet files (and ``direct_scan``), hybrid_ray's
    writer actors read the files (``parquet_scan``) in the background and this returns at
    once: the reduce stage consumes while the maps write. Otherwise one Spark job's tasks
    write through hybrid_ray, and this returns when the job is done. A failed map stage
    removes the shuffle's data and raises ``ShuffleFailedError`` (from here, from
    ``BridgeShuffle.report``, and in the reduce tasks).

    Either way the shuffle is one ``hybrid_ray.lifecycle.ShuffleLifecycle``, held (kept
    alive, its lost maps re-run) until ``release``."""
    if not ray.is_initialized():
        raise ShuffleFailedError("Ray is not running in this process: start Spark with "
                                 "spark_bridge.init_spark(...) first")
    check_remote_tier(config)  # before Spark runs a task
    from pyspark.sql.pandas.types import to_arrow_schema

    if scan is not None:  # planned by the caller (``plan_scan``): not planned twice
        why_not = ""
    elif direct_scan:
        scan, why_not = parquet_scan.plan_scan(df, config.map_chunk_bytes)
    else:
        why_not = "direct_scan=False"
    policy = AttemptPolicy.FIRST_FINISH if scan is not None else AttemptPolicy.CHOSEN_AT_SEAL
    life = ShuffleLifecycle(config, num_partitions, f"spark_{operation}", policy=policy,
                            id_prefix=SHUFFLE_ID_PREFIX)
    shuffle = BridgeShuffle(life.shuffle_id, num_partitions, config,
                            shuffled_schema or to_arrow_schema(df.schema))
    if scan is not None:
        # The map count is known: readers can tell when the shuffle is complete. Lost maps
        # (their writer died with their memory-tier segments) run again, also after the
        # map stage, for as long as the shuffle is held.
        writers = get_writers(config.namespace)
        life.register(len(scan.pieces), writer_nodes=[node for node, _ in writers])
        life.hold()

        def run_direct() -> tuple[str, int]:
            input_bytes = parquet_scan.run_maps(scan, life, num_partitions, partitioner,
                                                config, transform, writers=writers)
            # While the stage ran, its MapRunner re-ran lost maps; from now on, the holder.
            life.hold(rerun=lambda lost: parquet_scan.run_maps(
                scan, life, num_partitions, partitioner, config, transform, only=lost))
            return "parquet files", input_bytes
        threading.Thread(target=_map_stage, daemon=True, name=f"{life.shuffle_id}-maps",
                         args=(shuffle, life, run_direct)).start()
        _last.shuffle = shuffle
        return shuffle

    life.register()
    life.hold()
    address = ray.get_runtime_context().gcs_address
    fn = make_map_function(address, life.shuffle_id, num_partitions, partitioner, config,
                           transform)

    def run_in_executors() -> tuple[str, int]:
        rows = df.mapInArrow(fn, MAP_RESULT_SCHEMA).collect()
        num_maps = len(rows)
        if sorted(r.map_index for r in rows) != list(range(num_maps)):
            raise ShuffleFailedError(f"map stage of {life.shuffle_id} returned map "
                                     f"indices {sorted(r.map_index for r in rows)}")
        life.seal(num_maps, {r.map_index: r.attempt for r in rows})
        return f"spark executors ({why_not})", sum(r.bytes for r in rows)
    _map_stage(shuffle, life, run_in_executors)
    shuffle.report  # raises if the map stage failed  # noqa: B018
    _last.shuffle = shuffle
    return shuffle


def _map_stage(shuffle: BridgeShuffle, life: ShuffleLifecycle,
               run: Callable[[], tuple[str, int]]) -> None:
    """Run a map stage, then complete ``shuffle`` with its report or its error (the data
    of a failed stage is removed, and its readers are told why)."""
    try:
        map_input, input_bytes = run()
        shuffle._report = life.report(input_bytes=input_bytes, map_input=map_input)
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):  # counted as ShuffleLifecycle.fail does
            metrics.record_error(error_kind(exc))
        if life.released:
            # Released by the user (release(df), release_all, stop_spark) while the maps
            # ran: that, not the maps' resulting "unknown shuffle", is what happened.
            why = ("it was released (spark_bridge.release, release_all or stop_spark) "
                   "while its map stage ran; run the operation again")
        else:
            why = f"its map stage failed: {_explain_spark_failure(exc)}"
            why += _release_failed(shuffle.shuffle_id, why)
        operation = life.operation.removeprefix("spark_")
        error = ShuffleFailedError(f"spark_bridge {operation}: hybrid_ray shuffle "
                                   f"{shuffle.shuffle_id} did not complete and its data was "
                                   f"removed: {why}")
        error.__cause__ = exc
        shuffle._error = error
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        shuffle._done.set()


def reduce_frame(spark: Any, shuffles: Sequence[BridgeShuffle], reducer: Reducer,
                 out_spark_schema: Any) -> Any:
    """A DataFrame with one partition per subpartition, produced by ``reducer``. If it
    cannot be built, ``shuffles`` are released: no DataFrame will ever hold them."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        address = ray.get_runtime_context().gcs_address
        n = shuffles[0].num_partitions
        fn = make_reduce_function(address, shuffles, reducer, to_arrow_schema(out_spark_schema))
        out = spark.range(0, n, 1, n).mapInArrow(fn, out_spark_schema)
    except BaseException as exc:
        for shuffle in shuffles:
            left = _release_failed(shuffle.shuffle_id, "its reduce stage could not be built")
            if left:
                exc.add_note(f"hybrid_ray shuffle {shuffle.shuffle_id}{left}")
        raise
    out._hybrid_ray_shuffles = [s.shuffle_id for s in shuffles]  # for release(df)
    return out


def ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def read_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(io.BytesIO(data)).read_all()

