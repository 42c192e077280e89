"""The direct parquet scan's file checks and map planning (no Spark needed)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_bridge.parquet_scan import MAP_TARGET_BYTES, _pieces, converts_losslessly


@pytest.mark.parametrize("source,target,ok", [
    (pa.int64(), pa.int64(), True),
    (pa.uint8(), pa.int16(), True),       # Spark reads UINT_8 as ShortType
    (pa.uint32(), pa.int64(), True),
    (pa.uint32(), pa.int32(), False),     # would overflow
    (pa.uint64(), pa.int64(), False),     # Spark: decimal(20,0)
    (pa.int32(), pa.int64(), False),      # a user schema widening: Spark's business
    (pa.large_string(), pa.string(), True),
    (pa.dictionary(pa.int32(), pa.string()), pa.string(), True),
    (pa.binary(10), pa.binary(), True),
    (pa.string(), pa.binary(), False),
    (pa.timestamp("us"), pa.int64(), False),
])
def test_converts_losslessly(source, target, ok):
    assert converts_losslessly(source, target) is ok


def test_pieces_group_row_groups_and_refuse_what_spark_would_read_differently(tmp_path):
    path = str(tmp_path / "a.parquet")
    n = 100_000
    pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()),
                             "s": pa.array([str(i) for i in range(n)])}),
                   path, row_group_size=30_000)
    schema = pa.schema([("id", pa.int64()), ("s", pa.string())])
    pieces = _pieces(path, schema, chunk_bytes=64 * 1024)
    assert len(pieces) == 1 and pieces[0].row_groups == (0, 1, 2, 3)  # 4 small groups
    assert 0 < pieces[0].batch_rows < n  # batches of about chunk_bytes
    assert "no column 'x'" in _pieces(path, schema.append(pa.field("x", pa.int64())), 1 << 20)
    assert "column 'id'" in _pieces(path, pa.schema([("id", pa.int32())]), 1 << 20)
    legacy = str(tmp_path / "legacy.parquet")
    pq.write_table(pa.table({"id": [1]}).replace_schema_metadata(
        {"org.apache.spark.legacyDateTime": ""}), legacy)
    assert "legacy calendar" in _pieces(legacy, pa.schema([("id", pa.int64())]), 1 << 20)
    assert MAP_TARGET_BYTES >= 64 * 1024 * 1024  # maps of whole row groups, Spark-sized


def test_summary_files_are_not_data():
    from spark_bridge.parquet_scan import _is_summary_file

    assert _is_summary_file("file:///d/_metadata")
    assert _is_summary_file("file:///d/_common_metadata")
    assert _is_summary_file("file:///d/.part-0.parquet.crc")
    assert not _is_summary_file("file:///d/part-00000.parquet")


def test_dates_spark_would_rebase_or_refuse_go_through_the_executors(tmp_path):
    import datetime

    schema = pa.schema([("d", pa.date32())])
    modern = pa.table({"d": [datetime.date(2020, 1, 1), datetime.date(1970, 1, 2)]})
    pq.write_table(modern, tmp_path / "modern.parquet")
    assert not isinstance(_pieces(str(tmp_path / "modern.parquet"), schema, 1 << 20), str)
    # pyarrow-written (no Spark version): Spark's default refuses dates before 1582-10-15.
    old = pa.table({"d": [datetime.date(1000, 1, 1)]})
    pq.write_table(old, tmp_path / "old.parquet")
    reason = _pieces(str(tmp_path / "old.parquet"), schema, 1 << 20)
    assert isinstance(reason, str) and "1582-10-15" in reason
    # Written by Spark 2.x: Spark rebases every date from the Julian calendar.
    spark2 = modern.replace_schema_metadata({"org.apache.spark.version": "2.4.8"})
    pq.write_table(spark2, tmp_path / "spark2.parquet")
    reason = _pieces(str(tmp_path / "spark2.parquet"), schema, 1 << 20)
    assert isinstance(reason, str) and "Spark 2.4.8" in reason
    # The statistics of the date column itself, though a nested column comes first (its
    # leaves shift the parquet column index; Spark read only "d" via a user schema).
    nested = pa.table({"s": pa.array([{"a": 1, "b": 2}]), "d": [datetime.date(1000, 1, 1)]})
    pq.write_table(nested, tmp_path / "nested.parquet")
    reason = _pieces(str(tmp_path / "nested.parquet"), schema, 1 << 20)
    assert isinstance(reason, str) and "1582-10-15" in reason
    spark3 = modern.replace_schema_metadata({"org.apache.spark.version": "3.5.7"})
    pq.write_table(spark3, tmp_path / "spark3.parquet")
    assert not isinstance(_pieces(str(tmp_path / "spark3.parquet"), schema, 1 << 20), str)


def test_columns_equal_but_for_case_are_left_to_spark(tmp_path):
    path = str(tmp_path / "cases.parquet")
    pq.write_table(pa.table({"id": [1, 2], "ID": [3, 4], "v": [5, 6]}), path)
    schema = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    reason = _pieces(path, schema, 1 << 20)
    assert isinstance(reason, str) and "['id', 'ID']" in reason and "caseSensitive" in reason
    pieces = _pieces(path, schema, 1 << 20, case_sensitive=True)  # Spark reads "id" exactly
    assert not isinstance(pieces, str) and len(pieces) == 1


def test_dates_beyond_python_s_range_do_not_break_planning(tmp_path):
    """A date column whose smallest value lies past year 9999 (a far-future sentinel, which
    Spark reads) made planning raise pyarrow's ``OverflowError: date value out of range``
    out of ``spark_bridge.repartition``, where Spark's operator runs (found by a review).
    The statistics are compared as days, not as Python dates; dates before year 1 are
    still left to Spark (it refuses them)."""
    schema = pa.schema([("d", pa.date32())])
    pq.write_table(pa.table({"d": pa.array([3_000_000, 3_000_001], pa.date32())}),
                   tmp_path / "far.parquet")
    pieces = _pieces(str(tmp_path / "far.parquet"), schema, 1 << 20)
    assert not isinstance(pieces, str) and len(pieces) == 1
    pq.write_table(pa.table({"d": pa.array([-1_000_000], pa.date32())}),
                   tmp_path / "ancient.parquet")
    reason = _pieces(str(tmp_path / "ancient.parquet"), schema, 1 << 20)
    assert isinstance(reason, str) and "1582-10-15" in reason


def _two_files(directory) -> tuple[list, pa.Schema]:
    directory.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"id": pa.array(range(i * 5000, (i + 1) * 5000), pa.int64()),
                                 "k": pa.array([x % 13 for x in range(5000)], pa.int64())}),
                       str(directory / f"part-{i}.parquet"))
    schema = pa.schema([("id", pa.int64()), ("k", pa.int64())])
    pieces = [p for f in sorted(directory.iterdir()) for p in _pieces(str(f), schema, 1 << 20)]
    return pieces, schema


def test_a_file_removed_or_written_over_after_planning_fails_its_map_with_the_reason(tmp_path):
    """A map of the direct path reads its file again when it runs again (its writer died
    after the call returned); until this check a file written over in place gave its
    rows to row groups planned on the old one, and a removed one a bare
    FileNotFoundError (found by a review)."""
    from hybrid_ray import InputChangedError
    from spark_bridge.parquet_scan import open_planned_file

    pieces, _ = _two_files(tmp_path / "in")
    with open_planned_file(pieces[0]) as handle:  # unchanged: opened as planned
        assert pq.ParquetFile(handle).metadata.num_rows == 5000
    pq.write_table(pa.table({"id": pa.array([7], pa.int64()), "k": pa.array([1], pa.int64())}),
                   pieces[0].path)
    with pytest.raises(InputChangedError, match="part-0.parquet was replaced or written over "
                       "after spark_bridge.repartition planned its maps on it"):
        open_planned_file(pieces[0])
    (tmp_path / "in" / "part-1.parquet").unlink()
    with pytest.raises(InputChangedError, match="part-1.parquet was removed after") as err:
        open_planned_file(pieces[1])
    assert "write the result to a new path, not over its own input" in str(err.value)


def test_a_lost_map_whose_input_was_removed_fails_the_shuffle_naming_the_input(ray_local,
                                                                              tmp_path):
    """The review's case: the direct path's result written over its own input path, then a
    writer dies while the shuffle is read. The map lost with it cannot be run again: the
    read fails, and the held shuffle's error says which input went and why, instead of a
    FileNotFoundError from inside pyarrow."""
    import os
    import time
    import uuid

    import ray

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master, get_writers
    from hybrid_ray.lifecycle import AttemptPolicy, ShuffleLifecycle, held_errors
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.reduce_task import read_subpartition
    from spark_bridge import parquet_scan

    pieces, schema = _two_files(tmp_path / "in")
    config = ShuffleConfig(namespace=f"lostinput-{uuid.uuid4().hex[:6]}", progress=False,
                           spill_dirs=[str(tmp_path / "spill")])
    scan = parquet_scan.ParquetScan(pieces, schema)
    partitioner = HashPartitioner(["k"])
    life = ShuffleLifecycle(config, 4, "spark_repartition", policy=AttemptPolicy.FIRST_FINISH,
                            id_prefix="spk")
    writers = get_writers(config.namespace)
    life.register(len(pieces), writer_nodes=[n for n, _ in writers])
    life.hold()
    parquet_scan.run_maps(scan, life, 4, partitioner, config, None, writers=writers)
    life.hold(rerun=lambda lost: parquet_scan.run_maps(scan, life, 4, partitioner, config,
                                                       None, only=lost))
    for piece in pieces:  # the user's overwrite deletes the input first
        os.unlink(piece.path)
    for _, writer in writers:  # their memory-tier segments die with them
        ray.kill(writer, no_restart=False)
    time.sleep(1)
    try:
        with pytest.raises(Exception):
            for sub in range(4):
                list(read_subpartition(life.shuffle_id, sub, config,
                                       get_master(config.namespace)))
        deadline = time.monotonic() + 60
        while not any(life.shuffle_id in e for e in held_errors()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        errors = [e for e in held_errors() if life.shuffle_id in e]
        assert errors and "InputChangedError" in errors[-1]
        assert "part-0.parquet was removed after spark_bridge.repartition planned" \
            in errors[-1] or "part-1.parquet was removed after" in errors[-1]
    finally:
        try:
            life.release()
        except Exception:  # noqa: BLE001 - released as failed already
            pass
