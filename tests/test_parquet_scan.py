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
