"""Map stage straight from parquet files, skipping Spark's executors.

When a DataFrame is nothing but a scan of parquet files (``spark.read.parquet(path)``, not
cached, no filter or projection on top), hybrid_ray's writer actors read the files
themselves with pyarrow and write the shuffle: no row goes JVM -> Arrow -> a Python worker's
socket. On the executor path that hand-over costs about 6 CPU-s per GB in the JVM and as much
again in the Python workers (measured with ``/proc`` CPU deltas around a 1 GB bridge
repartition), more than the shuffle itself.

The direct path is taken only when the writers read exactly the rows and types Spark would:
local (``file:``) paths, no partition columns or bucketing, no reader options beyond the file
listing ones, column types whose parquet -> Spark mapping is unambiguous, and every file
holding every column under its exact name with a type that converts losslessly. Anything
else goes through the executors (the report's ``map_input`` says which path ran and why).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybrid_ray.actors import get_writers
from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import InputChangedError
from hybrid_ray.partitioning import Partitioner
from hybrid_ray.lifecycle import MapRunner, ShuffleLifecycle
from hybrid_ray.map_task import write_map_partition

# Reader options that only choose which files are listed (Spark lower-cases option keys).
LISTING_OPTIONS = {"path", "paths", "pathglobfilter", "recursivefilelookup",
                   "modifiedbefore", "modifiedafter"}
# Spark types whose parquet columns pyarrow reads to the same values (Spark type name ->
# Arrow type of the executor path). Timestamps (INT96, time zones, rebasing) and decimals
# are left to Spark.
SAFE_TYPES = {
    "BooleanType": pa.bool_(), "ByteType": pa.int8(), "ShortType": pa.int16(),
    "IntegerType": pa.int32(), "LongType": pa.int64(), "FloatType": pa.float32(),
    "DoubleType": pa.float64(), "StringType": pa.string(), "BinaryType": pa.binary(),
    "DateType": pa.date32(),
}
# Spark reads unsigned parquet integers as the next wider signed type.
_WIDENED = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64()}
# Files written by Spark 2.x may hold dates in the legacy calendar, which Spark rebases.
_LEGACY_KEYS = (b"org.apache.spark.legacyDateTime", b"org.apache.spark.legacyINT96")
# 1582-10-15 (the first Gregorian day: Spark rebases or refuses dates before it) as days
# since the epoch.
_GREGORIAN_START_DAYS = (datetime.date(1582, 10, 15) - datetime.date(1970, 1, 1)).days
# A map reads about this much (uncompressed) of one file, as Spark's maxPartitionBytes.
MAP_TARGET_BYTES = 128 * 1024 * 1024
# Session settings, at their defaults, under which pyarrow reads what Spark's scan reads.
# Otherwise only Spark's reader does what the user asked (skip corrupt or vanished files,
# match columns by parquet field id), so the executors read.
SPARK_READER_DEFAULTS = {
    "spark.sql.files.ignoreCorruptFiles": "false",
    "spark.sql.files.ignoreMissingFiles": "false",
    "spark.sql.parquet.fieldId.read.enabled": "false",
}


@dataclasses.dataclass(frozen=True)
class ParquetPiece:
    """One map's input: some row groups of one file, as it was when the scan was planned
    (``file_identity``: ``file_identity`` of the file then; None: not checked)."""

    path: str
    row_groups: tuple[int, ...]
    batch_rows: int  # rows per read batch, so a batch is about config.map_chunk_bytes
    file_identity: tuple[int, ...] | None = None


def file_identity(stat: os.stat_result) -> tuple[int, ...]:
    """What tells a file from one that replaced it or was written over it: its size and
    modification time (ns). Not its device or inode: the maps run on every node, reading
    the files through a shared filesystem, and an NFS mount's device number, or the inode
    numbers a FUSE mount (gcsfuse, s3fs-fuse) makes up, differ from node to node."""
    return (stat.st_size, stat.st_mtime_ns)


@dataclasses.dataclass
class ParquetScan:
    pieces: list[ParquetPiece]
    schema: pa.Schema  # the executor path's Arrow schema: what the maps cast to


def plan_scan(df: Any, chunk_bytes: int) -> tuple[ParquetScan | None, str]:
    """The direct-read plan for ``df``, or None and the reason the executors must read it."""
    from pyspark.sql.pandas.types import to_arrow_schema

    plan = df._jdf.queryExecution().optimizedPlan()
    if plan.getClass().getSimpleName() != "LogicalRelation":
        return None, f"the plan is a {plan.getClass().getSimpleName()}, not a file scan"
    relation = plan.relation()
    if relation.getClass().getSimpleName() != "HadoopFsRelation" or \
            relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None, "the source is not parquet files"
    if relation.partitionSchema().length() or not relation.bucketSpec().isEmpty():
        return None, "the files are partitioned or bucketed"
    options = set(relation.options().keySet().mkString("\x00").split("\x00")) - {""}
    if options - LISTING_OPTIONS:
        return None, f"reader options {sorted(options - LISTING_OPTIONS)}"
    for field in df.schema.fields:
        if type(field.dataType).__name__ not in SAFE_TYPES:
            return None, f"column {field.name!r} is {field.dataType.simpleString()}"
    conf = df.sparkSession.conf
    for key, default in SPARK_READER_DEFAULTS.items():
        value = conf.get(key, default)
        if str(value).strip().lower() != default:
            return None, f"{key}={value}"
    listed_twice = _listed_more_than_once(relation)
    if listed_twice:
        return None, listed_twice
    case_sensitive = str(conf.get("spark.sql.caseSensitive", "false")).strip().lower() == "true"
    schema = to_arrow_schema(df.schema)
    pieces = []
    for uri in df.inputFiles():
        if _is_summary_file(uri):
            continue
        parsed = urllib.parse.urlparse(uri)
        if parsed.scheme != "file":
            return None, f"{uri} is not a local file"
        path = urllib.parse.unquote(parsed.path)
        try:
            piece_or_reason = _pieces(path, schema, chunk_bytes, case_sensitive)
        except (OSError, pa.ArrowException) as exc:  # Spark's reader will say what is wrong
            return None, f"pyarrow cannot read {path}: {exc}"
        if isinstance(piece_or_reason, str):
            return None, piece_or_reason
        pieces.extend(piece_or_reason)
    if not pieces:
        return None, "no rows in the listed files"
    return ParquetScan(pieces, schema), ""


def _listed_more_than_once(relation: Any) -> str:
    """Why the writers cannot read ``relation``'s files from ``inputFiles()`` ("" if they
    can): a file listed more than once (``read.parquet("d/a.parquet", "d/a.parquet")``,
    or a directory and a file in it) is read once per listing by Spark, but
    ``inputFiles()`` lists it once, and the direct path silently lost those rows (1000 of
    2000; found by a review). Counted in the JVM: two calls whatever the file count."""
    try:
        files = relation.location().allFiles()
        listed, distinct = files.length(), files.distinct().length()
    except Exception as exc:  # noqa: BLE001 - another kind of file index: Spark reads it
        return f"its file listing cannot be checked for repeats ({type(exc).__name__})"
    if listed != distinct:
        return (f"{listed - distinct} file(s) are listed more than once (Spark reads them "
                "once per listing)")
    return ""


def _is_summary_file(uri: str) -> bool:
    """``_metadata``/``_common_metadata`` (parquet summary files): ``inputFiles()`` lists
    them, Spark's scan skips every ``_``/``.`` file that is not a ``key=value`` dir."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(".") or (name.startswith("_") and "=" not in name)


def _dates_need_rebase(path: str, metadata: Any, schema: pa.Schema) -> str | None:
    """Why Spark would not read this file's dates as pyarrow does, or None. Spark rebases
    dates of files written by Spark 2.x (Julian calendar), and by default refuses dates
    before 1582-10-15 in files of unknown origin; pyarrow does neither."""
    date_columns = [f.name for f in schema if f.type == pa.date32()]
    if not date_columns:
        return None
    version = (metadata.metadata or {}).get(b"org.apache.spark.version")
    if version is not None:
        major = version.decode(errors="replace").split(".")[0]
        if not major.isdigit() or int(major) < 3:
            return f"{path} was written by Spark {version.decode(errors='replace')} " \
                   "(dates in the legacy calendar)"
        return None
    # Row-group statistics are indexed by parquet leaf column, not by Arrow field: a nested
    # column before a date column has several leaves.
    leaves = {metadata.schema.column(i).path: i for i in range(metadata.num_columns)}
    for name in date_columns:
        index = leaves.get(name)
        if index is None:
            continue  # missing from this file: _pieces refuses it
        for g in range(metadata.num_row_groups):
            stats = metadata.row_group(g).column(index).statistics
            if stats is None or not stats.has_min_max:
                return f"{path}: column {name!r} has no statistics to rule out dates " \
                       "before 1582-10-15"
            # As days (the physical INT32): ``stats.min`` as a Python date overflows past
            # year 9999, dates Spark reads.
            if stats.physical_type != "INT32" or stats.min_raw < _GREGORIAN_START_DAYS:
                return f"{path}: column {name!r} holds dates before 1582-10-15 (Spark " \
                       "rebases or refuses them)"
    return None


def _pieces(path: str, schema: pa.Schema, chunk_bytes: int,
            case_sensitive: bool = False) -> list[ParquetPiece] | str:
    """The map pieces of one file, or why Spark's reader must read it."""
    # Taken before the metadata: a file replaced in between then fails its maps' check.
    identity = file_identity(os.stat(path))
    metadata = pq.read_metadata(path)
    if any(k in (metadata.metadata or {}) for k in _LEGACY_KEYS):
        return f"{path} was written with Spark's legacy calendar"
    rebase = _dates_need_rebase(path, metadata, schema)
    if rebase:
        return rebase
    file_schema = pq.read_schema(path)
    if not case_sensitive:
        # Spark (spark.sql.caseSensitive=false) matches columns ignoring case, and fails on
        # a file holding e.g. both "id" and "ID"; pyarrow would read one of them.
        for field in schema:
            same = [n for n in file_schema.names if n.lower() == field.name.lower()]
            if len(same) > 1:
                return f"{path} has columns {same}, equal but for case " \
                       "(spark.sql.caseSensitive=false)"
    for field in schema:
        index = file_schema.get_field_index(field.name)
        if index < 0:
            return f"{path} has no column {field.name!r} (Spark fills such gaps with nulls)"
        if not converts_losslessly(file_schema.field(index).type, field.type):
            return f"{path}: column {field.name!r} is {file_schema.field(index).type}"
    groups: list[int] = []
    size = 0
    out = []
    rows = max(metadata.num_rows, 1)
    row_bytes = max(1, sum(metadata.row_group(i).total_byte_size
                           for i in range(metadata.num_row_groups)) // rows)
    batch_rows = max(1, chunk_bytes // row_bytes)
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        if group.num_rows == 0:
            continue
        groups.append(i)
        size += group.total_byte_size
        if size >= MAP_TARGET_BYTES:
            out.append(ParquetPiece(path, tuple(groups), batch_rows, identity))
            groups, size = [], 0
    if groups:
        out.append(ParquetPiece(path, tuple(groups), batch_rows, identity))
    return out


def converts_losslessly(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether pyarrow's values of ``source`` are the values Spark reads as ``target``."""
    if pa.types.is_dictionary(source):
        source = source.value_type
    if source == target or _WIDENED.get(source) == target:
        return True
    if target == pa.string():
        return pa.types.is_large_string(source)
    if target == pa.binary():
        return pa.types.is_large_binary(source) or pa.types.is_fixed_size_binary(source)
    return False


def open_planned_file(piece: ParquetPiece) -> Any:
    """``piece``'s file opened for reading, if it is still the file the scan was planned
    on (its ``file_identity``, checked on the open file itself); else
    ``InputChangedError``. A map runs again when its writer died after the call
    returned, and reads its input again: a file removed or written over since (the result
    written over its own input path) would fail with a bare FileNotFoundError, or give
    the rows of another file to row groups planned on this one."""
    try:
        handle = open(piece.path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise InputChangedError(_input_changed(piece, "was removed")) from None
    if piece.file_identity is None or \
            file_identity(os.fstat(handle.fileno())) == piece.file_identity:
        return handle
    handle.close()
    raise InputChangedError(_input_changed(piece, "was replaced or written over"))


def _input_changed(piece: ParquetPiece, what: str) -> str:
    return (f"{piece.path} {what} after spark_bridge.repartition planned its maps on it, so "
            "its rows are not the planned ones (a map whose writer died is run again from "
            "its input file). Keep a direct-path repartition's input files unchanged until "
            "its result is consumed: write the result to a new path, not over its own input")


def map_parquet_piece(shuffle_id: str, map_index: int, piece: ParquetPiece, schema: pa.Schema,
                      num_partitions: int, partitioner: Partitioner, config: ShuffleConfig,
                      master: Any, transform: Callable[[pa.Table], pa.Table] | None,
                      attempt: int | None = None) -> dict:
    """One map of the direct path, run by a writer actor (which owns its memory segments).
    ``attempt``: see ``hybrid_ray.map_task.write_map_partition``."""
    input_bytes = 0

    def chunks():
        nonlocal input_bytes
        with open_planned_file(piece) as handle:
            reader = pq.ParquetFile(handle)
            for batch in reader.iter_batches(batch_size=piece.batch_rows,
                                             row_groups=list(piece.row_groups),
                                             columns=schema.names, use_threads=False):
                table = pa.Table.from_batches([batch]).select(schema.names).cast(schema)
                input_bytes += table.nbytes
                yield transform(table) if transform else table

    stats = write_map_partition(shuffle_id, map_index, chunks(), num_partitions, partitioner,
                                config, master, own_memory_segments=True, attempt=attempt)
    return {"rows": stats.rows if stats else 0, "bytes": input_bytes, "skipped": stats is None}


def run_maps(scan: ParquetScan, shuffle: ShuffleLifecycle, num_partitions: int,
             partitioner: Partitioner, config: ShuffleConfig,
             transform: Callable[[pa.Table], pa.Table] | None,
             only: Sequence[int] | None = None,
             writers: Sequence[tuple[str, Any]] | None = None) -> int:
    """Run every piece's map (or the maps ``only``) of ``shuffle`` on the writer actors
    (``writers``, as ``get_writers`` gives them; None: looked up here); returns the input
    bytes read. Raises the first map's error (a writer that died is retried by Ray, as a
    new map attempt)."""
    if writers is None:
        writers = get_writers(config.namespace)
    maps = MapRunner(shuffle, list(writers), scan.pieces, map_parquet_piece,
                     (scan.schema, num_partitions, partitioner, config, shuffle.master,
                      transform), maps=only)
    return sum(r["bytes"] for r in maps.run_to_end().values())
