"""Hashing and partitioning: equal keys must meet whatever chunk they arrive in."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import pyarrow as pa

from hybrid_ray.partitioning import HashPartitioner, hash_column


def test_a_key_hashes_alike_whatever_else_its_chunk_holds():
    # Equal-length chunks take a zero-copy path; nulls and mixed lengths take another.
    # Both must agree, or "USD" lands in two partitions and a group-by splits it.
    plain = pa.array(["USD", "EUR", "USD"])
    mixed = pa.array(["USD", None, "EURO", "USD", ""])
    assert hash_column(plain)[0] == hash_column(mixed)[0] == hash_column(mixed)[3]
    assert hash_column(mixed)[1] == 0
    assert hash_column(pa.array(["EURO"]))[0] != hash_column(plain)[1]
    big = pa.array(["USD"] * 5, pa.large_string())
    assert hash_column(big)[0] == hash_column(plain)[0]
    parts = HashPartitioner(["k"])
    a = parts.assign(pa.table({"k": plain}), 0, 7)
    b = parts.assign(pa.table({"k": mixed}), 1, 7)
    assert a[0] == a[2] == b[0] == b[3]


def test_fixed_and_variable_binary_with_the_same_bytes_hash_alike_even_sliced():
    values = [bytes([i]) * 10 for i in range(6)]
    fixed = pa.array(values, pa.binary(10))
    variable = pa.array(values + [b"short"])
    assert (hash_column(fixed) == hash_column(variable)[:6]).all()
    assert (hash_column(fixed.slice(2)) == hash_column(variable.slice(2, 4))).all()
    assert hash_column(pa.array([b"ab"]))[0] != hash_column(pa.array([b"ab\0"]))[0]


def test_temporal_keys_including_dates_hash():
    dates = pa.array([datetime.date(2024, 1, 1), None, datetime.date(2024, 1, 1)])
    h = hash_column(dates)
    assert h[0] == h[2] and h[1] == 0
    ts = pa.array(np.array([1, 2, 1], dtype="datetime64[us]"))
    assert hash_column(ts)[0] == hash_column(ts)[2] != hash_column(ts)[1]


@pytest.mark.parametrize("num_partitions", [3, 256, 257, 70_000])
def test_split_by_partition_keeps_row_order_within_each_subpartition(num_partitions):
    from hybrid_ray.partitioning import split_by_partition

    rng = np.random.default_rng(num_partitions)
    table = pa.table({"i": np.arange(50_000)})
    parts = rng.integers(0, num_partitions, table.num_rows)
    pieces = split_by_partition(table, parts, num_partitions)
    assert sum(t.num_rows for _, t in pieces) == table.num_rows
    for sub, piece in pieces:
        expected = np.flatnonzero(parts == sub)  # original order, stable
        assert np.array_equal(piece["i"].to_numpy(), expected)
