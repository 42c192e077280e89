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
the driver runs that map again (``_LiveShuffles``) for as long as it holds the shuffle, since
Spark may run the reduce stage any time, and again.

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
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import ray

from hybrid_ray.actors import get_master
from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import ConfigError, ShuffleFailedError, ShuffleNotFoundError
from hybrid_ray.partitioning import Partitioner
from hybrid_ray.report import ShuffleReport
from hybrid_ray.shuffle import (
    HEARTBEAT_S, _make_report, check_remote_tier, read_subpartition, write_map_partition,
)
from spark_bridge import parquet_scan

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


# How often the driver asks the master for maps to run again (their output died with its
# writer); readers wait for the new attempt meanwhile.
RECOVERY_POLL_S = 1.0


class _LiveShuffles:
    """Shuffles the bridge holds, kept alive by heartbeats from a daemon thread, which also
    runs again the maps of direct-path shuffles whose output was lost (``recover_with``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shuffles: dict[str, ShuffleConfig] = {}
        self._rerun: dict[str, Callable[[list[int]], Any]] = {}
        self._thread: threading.Thread | None = None

    def add(self, shuffle_id: str, config: ShuffleConfig) -> None:
        with self._lock:
            self._shuffles[shuffle_id] = config
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._beat, daemon=True,
                                                name="hybrid_ray-bridge-heartbeat")
                self._thread.start()

    def recover_with(self, shuffle_id: str, rerun: Callable[[list[int]], Any]) -> None:
        """From now on, maps of ``shuffle_id`` reported lost are run with ``rerun(maps)``."""
        with self._lock:
            if shuffle_id in self._shuffles:
                self._rerun[shuffle_id] = rerun

    def remove(self, shuffle_id: str) -> ShuffleConfig | None:
        with self._lock:
            self._rerun.pop(shuffle_id, None)
            return self._shuffles.pop(shuffle_id, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._shuffles)

    def _beat(self) -> None:
        last_beat = time.monotonic()
        while True:
            time.sleep(RECOVERY_POLL_S)
            with self._lock:
                live = list(self._shuffles.items())
                recoverable = [(s, self._shuffles[s], r) for s, r in self._rerun.items()]
            for shuffle_id, config, rerun in recoverable:
                self._recover(shuffle_id, config, rerun)
            if not live or time.monotonic() - last_beat < HEARTBEAT_S:
                continue
            last_beat = time.monotonic()
            try:
                for shuffle_id, config in live:
                    get_master(config.namespace).heartbeat.remote(shuffle_id)
            except Exception:  # Ray shut down or the master restarting: try again later
                pass

    def _recover(self, shuffle_id: str, config: ShuffleConfig,
                 rerun: Callable[[list[int]], Any]) -> None:
        try:
            lost = ray.get(get_master(config.namespace).take_lost.remote(shuffle_id))
        except ShuffleNotFoundError:  # released meanwhile
            return
        except Exception:  # Ray shut down or the master restarting: try again later
            return
        if not lost:
            return
        try:
            rerun(lost)
        except Exception as exc:
            # Readers wait for the new attempts: tell them, rather than let them time out.
            _release_failed(shuffle_id, f"re-running maps {lost}, whose output died with "
                                        f"their writer, failed: {_explain_spark_failure(exc)}")


_live = _LiveShuffles()
_last_shuffle: BridgeShuffle | None = None


def last_report() -> ShuffleReport | None:
    """The report of the most recent exchange the bridge ran in this process (waiting for
    its map stage if that still runs; raising ``ShuffleFailedError`` if it failed)."""
    return _last_shuffle.report if _last_shuffle is not None else None


def release(shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
    """Delete a held shuffle's data on every node and the remote tier (readers still
    running are told ``reason``; with ``failed``, as a ``ShuffleFailedError``)."""
    config = _live.remove(shuffle_id)
    if config is None or not ray.is_initialized():
        return False
    return bool(ray.get(get_master(config.namespace).release.remote(shuffle_id, reason,
                                                                     failed)))


def _release_failed(shuffle_id: str, why: str) -> None:
    """Release a shuffle that failed, telling its readers ``why``; if Ray is going down,
    the master's orphan TTL removes the data instead."""
    try:
        release(shuffle_id, why, failed=True)
    except Exception:
        pass


def release_all() -> int:
    """Release every shuffle this process's bridge holds; returns how many."""
    return sum(release(s) for s in _live.ids())


def held_shuffles() -> list[str]:
    return _live.ids()


def _explain_spark_failure(exc: BaseException) -> str:
    """The line of a Spark job failure that says what went wrong in our code, if any.
    A map of the direct path failed in a writer actor: its cause, not Ray's task header."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return f"{type(exc.cause).__name__}: {exc.cause}"
    text = str(exc)
    for line in text.splitlines():
        if "hybrid_ray.errors." in line or "Error:" in line and "hybrid_ray" in line:
            return line.strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:1000]
    return type(exc).__name__


def check_config(config: Any) -> ShuffleConfig:
    if config is None:
        return ShuffleConfig()
    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"config must be a hybrid_ray.ShuffleConfig, got "
                          f"{type(config).__name__}")
    return config


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
    ``BridgeShuffle.report``, and in the reduce tasks)."""
    global _last_shuffle
    if not ray.is_initialized():
        raise ShuffleFailedError("Ray is not running in this process: start Spark with "
                                 "spark_bridge.init_spark(...) first")
    check_remote_tier(config)  # before Spark runs a task
    from pyspark.sql.pandas.types import to_arrow_schema

    master = get_master(config.namespace)
    shuffle = BridgeShuffle(f"spk-{uuid.uuid4().hex[:12]}", num_partitions, config,
                            shuffled_schema or to_arrow_schema(df.schema))
    started = time.monotonic()
    if scan is not None:  # planned by the caller (``plan_scan``): not planned twice
        why_not = ""
    elif direct_scan:
        scan, why_not = parquet_scan.plan_scan(df, config.map_chunk_bytes)
    else:
        why_not = "direct_scan=False"
    if scan is not None:
        # The map count is known: readers can tell when the shuffle is complete. Lost maps
        # (their writer died with their memory-tier segments) can be run again.
        ray.get(master.register.remote(shuffle.shuffle_id, len(scan.pieces), num_partitions,
                                       config, True))
        _live.add(shuffle.shuffle_id, config)

        def run_direct() -> tuple[str, int, int]:
            num_maps, input_bytes = parquet_scan.run_maps(
                scan, shuffle.shuffle_id, num_partitions, partitioner, config, master,
                transform)
            # While the stage ran, its dispatcher re-ran lost maps; from now on, the bridge.
            _live.recover_with(shuffle.shuffle_id, lambda lost: parquet_scan.run_maps(
                scan, shuffle.shuffle_id, num_partitions, partitioner, config, master,
                transform, only=lost))
            return "parquet files", num_maps, input_bytes
        threading.Thread(target=_map_stage, daemon=True, name=f"{shuffle.shuffle_id}-maps",
                         args=(shuffle, master, operation, started, run_direct)).start()
        _last_shuffle = shuffle
        return shuffle

    ray.get(master.register.remote(shuffle.shuffle_id, None, num_partitions, config))
    _live.add(shuffle.shuffle_id, config)
    address = ray.get_runtime_context().gcs_address
    fn = make_map_function(address, shuffle.shuffle_id, num_partitions, partitioner, config,
                           transform)

    def run_in_executors() -> tuple[str, int, int]:
        rows = df.mapInArrow(fn, MAP_RESULT_SCHEMA).collect()
        num_maps = len(rows)
        if sorted(r.map_index for r in rows) != list(range(num_maps)):
            raise ShuffleFailedError(f"map stage of {shuffle.shuffle_id} returned map "
                                     f"indices {sorted(r.map_index for r in rows)}")
        ray.get(master.seal.remote(shuffle.shuffle_id, num_maps,
                                   {r.map_index: r.attempt for r in rows}))
        return f"spark executors ({why_not})", num_maps, sum(r.bytes for r in rows)
    _map_stage(shuffle, master, operation, started, run_in_executors)
    shuffle.report  # raises if the map stage failed  # noqa: B018
    _last_shuffle = shuffle
    return shuffle


def _map_stage(shuffle: BridgeShuffle, master: Any, operation: str, started: float,
               run: Callable[[], tuple[str, int, int]]) -> None:
    """Run a map stage, then complete ``shuffle`` with its report or its error (the data
    of a failed stage is removed, and its readers are told why)."""
    try:
        map_input, _num_maps, input_bytes = run()
        summary = ray.get(master.summary.remote(shuffle.shuffle_id))
        report = _make_report(summary, f"spark_{operation}", shuffle.config,
                              time.monotonic() - started)
        report.input_bytes = input_bytes
        report.map_input = map_input
        shuffle._report = report
    except BaseException as exc:
        if shuffle.shuffle_id not in _live.ids():
            # Released by the user (release(df), release_all, stop_spark) while the maps
            # ran: that, not the maps' resulting "unknown shuffle", is what happened.
            why = ("it was released (spark_bridge.release, release_all or stop_spark) "
                   "while its map stage ran; run the operation again")
        else:
            why = f"its map stage failed: {_explain_spark_failure(exc)}"
            _release_failed(shuffle.shuffle_id, why)
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
    except BaseException:
        for shuffle in shuffles:
            _release_failed(shuffle.shuffle_id, "its reduce stage could not be built")
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

