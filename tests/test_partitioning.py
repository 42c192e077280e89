"""Hashing and partitioning: equal keys must meet whatever chunk they arrive in."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import pyarrow as pa

from hybrid_ray.errors import ConfigError
from hybrid_ray.partitioning import HashPartitioner, RangePartitioner, hash_column


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


# ---- equal values, different representations (issue 14 item 4) -----------------------------
def assert_same_partition(*arrays: pa.Array, num_partitions: int = 1009) -> None:
    """Every array holds the same values: they must hash, and land, alike row by row."""
    parts = HashPartitioner(["k"])
    first = parts.assign(pa.table({"k": arrays[0]}), 0, num_partitions)
    for other in arrays[1:]:
        assert np.array_equal(hash_column(other), hash_column(arrays[0])), other.type
        got = parts.assign(pa.table({"k": other}), 3, num_partitions)
        assert np.array_equal(got, first), (other.type, got, first)


def test_negative_zero_lands_with_zero():
    assert_same_partition(pa.array([0.0, 0.0, 1.5]), pa.array([-0.0, 0.0, 1.5]),
                          pa.array([-0.0, -0.0, 1.5], pa.float32()))
    assert hash_column(pa.array([0.0]))[0] != hash_column(pa.array([1.0]))[0]


def test_nans_of_any_bit_pattern_land_together():
    bits = np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001,
                     0x7FF80000DEADBEEF], dtype=np.uint64)
    nans = pa.array(bits.view(np.float64))
    assert all(np.isnan(nans.to_numpy()))
    canonical = pa.array([float("nan")] * 4)
    nan32 = pa.array(np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC0BEEF],
                              dtype=np.uint32).view(np.float32))
    assert_same_partition(canonical, nans, nan32)


def test_float32_and_float64_of_one_value_land_together():
    values = [1.5, -2.25, 2.0**10]  # exact in float16 and float32
    assert_same_partition(pa.array(values, pa.float64()), pa.array(values, pa.float32()),
                          pa.array(values, pa.float16()).cast(pa.float64()))
    assert hash_column(pa.array([0.1], pa.float32()))[0] != hash_column(pa.array([0.1]))[0]


def test_dictionary_strings_land_with_plain_strings():
    values = ["USD", "EUR", None, "USD", "a-much-longer-currency-name", ""]
    plain = pa.array(values)
    encoded = plain.dictionary_encode()
    # Another dictionary (other order, unused entries) for the same values.
    reordered = pa.DictionaryArray.from_arrays(
        pa.array([1, 3, None, 1, 0, 2], pa.int32()),
        pa.array(["a-much-longer-currency-name", "USD", "", "EUR", "unused"]))
    assert reordered.to_pylist() == values
    narrow = pa.DictionaryArray.from_arrays(reordered.indices.cast(pa.int8()),
                                            reordered.dictionary)
    assert_same_partition(plain, encoded, reordered, narrow, plain.cast(pa.large_string()))
    chunked = pa.chunked_array([encoded.slice(0, 3), reordered.slice(3)])
    assert np.array_equal(hash_column(chunked), hash_column(plain))


def test_one_instant_in_every_timestamp_unit_lands_together():
    seconds = np.array([0, 1_700_000_000, -86_400 * 365 * 300, 253_402_300_799])
    by_unit = [pa.array(seconds * factor, pa.timestamp(unit))
               for unit, factor in (("s", 1), ("ms", 10**3), ("us", 10**6))]
    in_range = seconds[:3]  # year 9999 does not fit timestamp[ns]
    assert_same_partition(*[a.slice(0, 3) for a in by_unit],
                          pa.array(in_range * 10**9, pa.timestamp("ns")),
                          pa.array(in_range, pa.timestamp("s", tz="UTC")))
    assert_same_partition(*by_unit)
    assert hash_column(by_unit[0])[1] != hash_column(pa.array([1_700_000_001],
                                                              pa.timestamp("s")))[0]


def test_date32_and_date64_of_one_day_land_together():
    days = [datetime.date(2024, 2, 29), datetime.date(1969, 7, 20), datetime.date(1, 1, 1)]
    assert_same_partition(pa.array(days, pa.date32()), pa.array(days, pa.date64()))


def test_integers_of_any_width_land_together():
    assert_same_partition(pa.array([5, -1, 0, 2**31 - 1], pa.int64()),
                          pa.array([5, -1, 0, 2**31 - 1], pa.int32()))
    assert_same_partition(pa.array([5, 200], pa.int64()), pa.array([5, 200], pa.uint8()),
                          pa.array([5, 200], pa.uint64()))


def test_decimals_of_one_value_land_together_whatever_the_scale():
    import decimal

    values = [decimal.Decimal(v) for v in ("1.5", "-1.5", "0", "100", "0.001", "-42.125")]
    arrays = [pa.array(values, pa.decimal128(12, 3)), pa.array(values, pa.decimal128(18, 5)),
              pa.array(values, pa.decimal128(38, 10)), pa.array(values, pa.decimal256(40, 4))]
    assert_same_partition(*arrays)
    assert len(set(hash_column(arrays[0]).tolist())) == len(values)
    big = pa.array([decimal.Decimal("123456789012345678901234.5")], pa.decimal128(38, 1))
    assert hash_column(big)[0] == hash_column(pa.array([big[0].as_py()],
                                                       pa.decimal128(38, 4)))[0]


def test_byte_strings_of_every_length_hash_alike_alone_or_mixed_and_sliced():
    rng = np.random.default_rng(1)
    values = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(0, 41)]
    values += [b"", b"x", b"ab", b"ab\0"]  # short values last: reads near the buffer's end
    mixed = hash_column(pa.array(values))
    alone = np.array([hash_column(pa.array([v] * 3))[1] for v in values], dtype=np.uint64)
    fixed = np.array([hash_column(pa.array([v], pa.binary(len(v))))[0] if v else alone[0]
                      for v in values], dtype=np.uint64)
    assert np.array_equal(mixed, alone) and np.array_equal(mixed, fixed)
    assert len(set(mixed.tolist())) == len(set(values))
    assert np.array_equal(hash_column(pa.array(values).slice(7, 20)), mixed[7:27])
    assert np.array_equal(hash_column(pa.array(values, pa.large_binary()).slice(30)),
                          mixed[30:])


def test_hash_partitions_are_balanced_for_common_key_types():
    n, parts = 200_000, 16
    for keys in (pa.array(np.arange(n)), pa.array([f"k{i}" for i in range(n)]),
                 pa.array(np.arange(n) * 0.5),
                 pa.array(np.arange(n).astype(np.int64).view(np.uint64).astype(np.uint64)
                          * np.uint64(1 << 32))):
        counts = np.bincount(HashPartitioner(["k"]).assign(pa.table({"k": keys}), 0, parts),
                             minlength=parts)
        assert counts.min() > 0.9 * n / parts and counts.max() < 1.1 * n / parts, \
            (keys.type, counts)


def test_multi_key_hash_depends_on_key_order():
    a, b = pa.array(np.arange(1000)), pa.array(np.arange(1000)[::-1].copy())
    ab = HashPartitioner(["a", "b"]).assign(pa.table({"a": a, "b": b}), 0, 1 << 20)
    ba = HashPartitioner(["a", "b"]).assign(pa.table({"a": b, "b": a}), 0, 1 << 20)
    assert (ab != ba).mean() > 0.99


def test_random_assignment_continues_across_the_chunks_of_a_map():
    """Each chunk of a map restarted the map's random stream: row i of every chunk went to
    the same subpartition, so rows a chunk apart were never separated by random_shuffle.
    The stream now runs on across chunks; a fresh copy of the partitioner (as each map run
    gets, pickled with its task) reproduces the map's assignment from the seed."""
    import pickle

    from hybrid_ray.partitioning import RandomPartitioner

    chunk = pa.table({"x": np.arange(4096)})
    partitioner = RandomPartitioner(seed=7)
    first = partitioner.assign(chunk, 3, 16)
    second = partitioner.assign(chunk, 3, 16)
    assert first.shape == second.shape == (4096,)
    assert np.mean(first == second) < 0.2  # about 1/16 by chance; 1.0 when restarted
    other_map = partitioner.assign(chunk, 4, 16)
    assert np.mean(other_map == first) < 0.2
    copy = pickle.loads(pickle.dumps(partitioner))
    assert np.array_equal(copy.assign(chunk, 3, 16), first)
    assert np.array_equal(copy.assign(chunk, 3, 16), second)


def test_nested_keys_hash_by_value_whatever_else_their_chunk_holds():
    """Struct keys were hashed through pandas, which turned a struct's int field into a
    float when another row of the chunk had it null: equal keys went to different
    partitions (repartition's promise broken), and list or map keys failed the map."""
    with_null = pa.array([{"a": 1, "b": 2.5}, {"a": None, "b": None}])
    alone = pa.array([{"a": 1, "b": 2.5}])
    assert hash_column(with_null)[0] == hash_column(alone)[0]
    assert hash_column(pa.array([{"a": -0.0}]))[0] == hash_column(pa.array([{"a": 0.0}]))[0]
    table = pa.table({"k": pa.chunked_array([with_null, alone])})
    parts = HashPartitioner(["k"]).assign(table, 0, 64)
    assert parts[0] == parts[2]
    lists = hash_column(pa.array([[1, 2], [], [3], None, [2, 1]]))
    again = hash_column(pa.array([[3], [1, 2], []], pa.large_list(pa.int32())))
    assert (lists[0], lists[1], lists[2]) == (again[1], again[2], again[0])
    assert lists[0] != lists[4]  # order matters
    assert lists[3] == 0  # a null key
    maps = pa.array([[("k", 1)], [("j", 2), ("k", 1)]], pa.map_(pa.string(), pa.int64()))
    same = pa.array([[("j", 2), ("k", 1)]], pa.map_(pa.string(), pa.int64()))
    assert hash_column(maps)[1] == hash_column(same)[0] != hash_column(maps)[0]
    sliced = pa.array([[9], [1, 2], [5]]).slice(1, 1)  # an offset into the values
    assert hash_column(sliced)[0] == lists[0]


def test_fixed_size_list_keys_with_null_rows_hash_by_value():
    """A fixed-size-list key column holding a null row failed every map with NumPy's
    "operands could not be broadcast" (Arrow's flatten leaves a null row's elements out,
    so the elements no longer lined up with the rows); sliced ones must hash alike too."""
    t = pa.list_(pa.int64(), 2)
    with_null = hash_column(pa.array([[1, 2], None, [3, 4]], type=t))
    alone = hash_column(pa.array([[3, 4], [1, 2]], type=t))
    assert (with_null[0], with_null[2]) == (alone[1], alone[0])
    assert with_null[1] == 0  # a null key
    sliced = hash_column(pa.array([[9, 9], None, [3, 4]], type=t).slice(1))
    assert (sliced[0], sliced[1]) == (0, alone[0])
    # The same lists hash alike whether their list type is of fixed size or not.
    assert hash_column(pa.array([[3, 4]]))[0] == alone[0]


def test_a_partitioner_that_labels_too_few_rows_or_out_of_range_is_refused():
    """A custom partitioner returning fewer labels than rows had the chunk's other rows
    dropped without a word (split_by_partition took as many rows as labels)."""
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.map_task import _checked_assignment
    from hybrid_ray.partitioning import Partitioner

    class Scripted(Partitioner):
        def __init__(self, labels):
            self.labels = labels

        def assign(self, table, map_index, num_partitions):
            return self.labels

    chunk = pa.table({"x": np.arange(10)})
    with pytest.raises(ConfigError, match=r"Scripted.assign returned int64 of shape \(5,\) "
                                          "for a chunk of 10 rows of map 3"):
        _checked_assignment(Scripted(np.zeros(5, dtype=np.int64)), chunk, 3, 4)
    with pytest.raises(ConfigError, match="one integer subpartition per row"):
        _checked_assignment(Scripted(np.zeros(10)), chunk, 3, 4)  # floats
    with pytest.raises(ConfigError, match=r"from -1 to 0 for map 3: each must be in \[0, 4\)"):
        _checked_assignment(Scripted(np.array([0] * 9 + [-1])), chunk, 3, 4)
    with pytest.raises(ConfigError, match=r"from 0 to 4 for map 3"):
        _checked_assignment(Scripted(np.array([0] * 9 + [4])), chunk, 3, 4)
    good = np.arange(10) % 4
    assert np.array_equal(_checked_assignment(Scripted(list(good)), chunk, 3, 4), good)


def test_partitioners_refuse_arguments_that_would_partition_wrongly():
    """Each was accepted: unsorted range boundaries sent keys to the wrong partitions (the
    sorted output was silently out of order); a bare key string was split into its
    characters (partitioning by columns "a" and "b" where they existed); an empty key
    list and a negative seed failed only inside the maps."""
    from hybrid_ray import ConfigError, HashPartitioner, RandomPartitioner, RangePartitioner

    with pytest.raises(ConfigError, match="boundaries must be in ascending order"):
        RangePartitioner("k", [30, 20, 10], descending=True)
    with pytest.raises(ConfigError, match="boundaries must be in ascending order"):
        RangePartitioner("k", [4, 6, 17, 8, 5])
    assert list(RangePartitioner("k", ["a", "b", "b", "c"]).boundaries) == ["a", "b", "b", "c"]
    assert HashPartitioner("ab").keys == ["ab"]
    with pytest.raises(ConfigError, match="non-empty list of column names"):
        HashPartitioner([])
    with pytest.raises(ConfigError, match="seed must be an integer >= 0"):
        RandomPartitioner(-1)


def test_range_boundaries_drop_nans_and_nats_as_documented():
    """RangePartitioner drops nulls and NaNs given among the boundaries (its docstring);
    a NaN left in an object array (a None beside it) or a NaT among datetimes was kept,
    and the boundaries were refused as "not in ascending order" although they were."""
    table = pa.table({"k": np.arange(30)})
    for given in ([None, 10.0, float("nan"), 20], [10, np.nan, 20.0]):
        partitioner = RangePartitioner("k", given)
        assert list(partitioner.boundaries) == [10, 20]
        partitioner.check_schema(table.schema)
        assert np.bincount(partitioner.assign(table, 0, 3)).tolist() == [10, 10, 10]
    days = np.array(["2020-01-01", "NaT", "2020-01-03"], dtype="datetime64[D]")
    assert list(RangePartitioner("d", days).boundaries) == [days[0], days[2]]


@pytest.mark.parametrize("given", [None, {10, 20}, {10: 1}, (b for b in [10, 20]), 10,
                                   [[10, 20], [30]], [[10], [20]]])
def test_range_boundaries_that_are_no_flat_sequence_are_refused_by_name(given):
    """None, a set, a dict or a generator failed with a bare "TypeError: iteration over
    a 0-d array", ragged nested lists with NumPy's "inhomogeneous shape" ValueError."""
    with pytest.raises(ConfigError, match="RangePartitioner's boundaries must be a flat "
                                          f"sequence of key values .* got {type(given).__name__}"):
        RangePartitioner("k", given)


def test_range_boundaries_of_another_type_than_the_key_are_refused():
    """Only the boundaries' order among themselves was checked: int keys searched among
    string boundaries were compared as text, and the concatenated output of a range
    shuffle was silently out of order ([0, 1, 2, 10, ..., 19, 3, ..., 9, 20, ...]).
    ``check_schema`` (called by run_shuffle before anything runs) refuses them, and
    keeps boundaries of the key's type in the form its values take in ``assign``."""
    from hybrid_ray import ConfigError, RangePartitioner

    ints = pa.schema([("k", pa.int64())])
    with pytest.raises(ConfigError, match="boundaries .* are not values of its key column "
                                          "'k' of type int64: they are not numbers"):
        RangePartitioner("k", ["10", "20"]).check_schema(ints)
    with pytest.raises(ConfigError, match="not values of its key column 'k' of type string"):
        RangePartitioner("k", [10, 20]).check_schema(pa.schema([("k", pa.string())]))
    with pytest.raises(ConfigError, match="key column 'x' is not in the blocks' schema"):
        RangePartitioner("x", [1]).check_schema(ints)
    table = pa.table({"k": np.arange(30)})
    # Numbers of another width or kind are fine, also Python ones left in an object array
    # by a None among them (dropped) or a Decimal (a review found these refused).
    from decimal import Decimal

    for numbers_given in ([9.5, 19.5], [None, 10, 20], [Decimal("9.5"), 20]):
        fractional = RangePartitioner("k", numbers_given)
        fractional.check_schema(ints)
        assert np.bincount(fractional.assign(table, 0, 3)).tolist() == [10, 10, 10]
    with pytest.raises(ConfigError, match="they are not numbers"):
        RangePartitioner("k", [None, "10"]).check_schema(ints)
    when = pa.schema([("t", pa.timestamp("us", tz="UTC"))])
    days = RangePartitioner("t", np.array(["2020-01-02"], dtype="datetime64[D]"))
    days.check_schema(when)
    stamps = pa.table({"t": pa.array([datetime.datetime(2020, 1, 1, 12),
                                      datetime.datetime(2020, 1, 2, 12)],
                                     pa.timestamp("us", tz="UTC"))})
    assert days.assign(stamps, 0, 2).tolist() == [0, 1]


def test_range_partitioner_takes_time_of_day_keys_and_boundaries_in_nanoseconds():
    """Time keys and boundaries became Python ``datetime.time`` objects, which hold no
    nanoseconds: a time64[ns] key or boundary off the microsecond failed in ``assign``
    and in the constructor ("has non-zero nanoseconds")."""
    from hybrid_ray import RangePartitioner

    times = pa.array([5, 999, 1_000, 1_001, None, 2_500], pa.int64()).cast(pa.time64("ns"))
    table = pa.table({"t": times})
    partitioner = RangePartitioner("t", pa.array([999, 2_000]).cast(pa.time64("ns")))
    partitioner.check_schema(table.schema)
    assert partitioner.assign(table, 0, 3).tolist() == [0, 1, 1, 1, 2, 2]
    seconds = RangePartitioner("t", [datetime.time(0, 0, 2)])
    seconds.check_schema(pa.schema([("t", pa.time32("s"))]))
    clock = pa.table({"t": pa.array([1, 2, 3], pa.int32()).cast(pa.time32("s"))})
    assert seconds.assign(clock, 0, 2).tolist() == [0, 1, 1]


def test_range_boundaries_given_as_times_are_converted_to_the_key_s_unit_or_refused():
    """Boundaries given as an Arrow time array became integer counts of their own unit,
    then were taken as counts of the key's: 01:00 as time32[s] (3,600) was 3.6
    microseconds of a time64[ns] key, so every row landed beyond it; and times were taken
    for an int, date or timestamp key (refused before, as values of another kind)."""
    from hybrid_ray import ConfigError, RangePartitioner

    hour = pa.array([3_600], pa.int32()).cast(pa.time32("s"))
    keys = pa.array([1_800, 7_200], pa.int32()).cast(pa.time32("s")).cast(pa.time64("ns"))
    part = RangePartitioner("t", hour)
    part.check_schema(pa.schema([("t", pa.time64("ns"))]))
    assert part.assign(pa.table({"t": keys}), 0, 2).tolist() == [0, 1]
    for other in (pa.int64(), pa.date32(), pa.timestamp("s")):
        with pytest.raises(ConfigError, match=r"are not values of its key column 't' of "
                                              r"type .*: they are times of day \(time32"):
            RangePartitioner("t", hour).check_schema(pa.schema([("t", other)]))
    with pytest.raises(ConfigError, match="would lose data"):
        RangePartitioner("t", pa.array([1_500], pa.int32()).cast(pa.time32("ms"))) \
            .check_schema(pa.schema([("t", pa.time32("s"))]))


def test_a_null_value_inside_a_dictionary_sorts_as_a_null():
    """A dictionary key whose dictionary holds a null (pointed to by a valid index) is a
    null, though the encoded column's is_null does not say so: it reached NumPy's search
    among the boundaries ("'<' not supported between 'str' and 'NoneType'")."""
    from hybrid_ray import RangePartitioner

    key = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 1, 0]), pa.array([None, "b", "a"]))
    table = pa.table({"k": key})
    partitioner = RangePartitioner("k", ["aa"])
    partitioner.check_schema(table.schema)
    # nulls last ascending (Ray Data's order): "a" in 0; "b" and the nulls in 1
    assert partitioner.assign(table, 0, 2).tolist() == [1, 1, 0, 1, 1]


def test_list_view_and_extension_keys_hash_as_their_values_and_unions_are_refused():
    """A list_view key and an extension-typed one (uuid) went through pandas, which failed
    inside every map ("setting an array element with a sequence"); a union key failed
    there too. List views hash as the same lists, extension values as what they store,
    and a union key is refused before anything runs."""
    from hybrid_ray import ConfigError

    lists = [[1], None, [2, 3], [], None, [4]]
    assert (hash_column(pa.array(lists, pa.list_view(pa.int64())))
            == hash_column(pa.array(lists, pa.list_(pa.int64())))).all()
    raw = [b"1" * 16, b"0" * 16, None]
    assert (hash_column(pa.array(raw, pa.uuid()))
            == hash_column(pa.array(raw, pa.binary(16)))).all()
    union = pa.sparse_union([pa.field("i", pa.int64()), pa.field("s", pa.string())])
    for t in (union, pa.struct([("u", union)])):
        with pytest.raises(ConfigError, match="cannot partition by column 'k' of type .*"
                                              "is a union"):
            HashPartitioner(["k"]).check_schema(pa.schema([("k", t)]))
    HashPartitioner(["k"]).check_schema(pa.schema([("k", pa.list_view(pa.int64()))]))


def test_pickled_python_object_keys_are_refused_before_anything_runs():
    """Were hashed by their pickled bytes: frozenset([1, 9]) and frozenset([9, 1]) are
    equal and pickle apart, so one key's rows went to two partitions (found by a review:
    100 rows of one key came out as two blocks of 50)."""
    from ray.air.util.object_extensions.arrow import ArrowPythonObjectType

    from hybrid_ray import ConfigError

    for t in (ArrowPythonObjectType(), pa.struct([("o", ArrowPythonObjectType())])):
        with pytest.raises(ConfigError, match=r"cannot partition by column 'k' of type .*: it "
                                              r"holds pickled Python objects \(Ray Data's "
                                              r"arrow_pickled_object\).* Partition by another "
                                              r"column, or by one derived from it"):
            HashPartitioner(["k"]).check_schema(pa.schema([("k", t)]))


def test_range_partitioner_takes_only_bools_for_its_order_flags():
    """A truthy non-bool ``descending`` or ``nulls_first`` ("yes", 1) was kept as is and
    compared unequal to True: nulls went to the end partition opposite to where the
    partition's sort put them (found by a review)."""
    from hybrid_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="descending must be True or False, got 'yes'"):
        RangePartitioner("k", [1, 2], descending="yes")
    with pytest.raises(ConfigError, match="nulls_first must be True, False or None, got 1"):
        RangePartitioner("k", [1, 2], nulls_first=1)
    assert RangePartitioner("k", [1, 2], descending=True).nulls_first is False


def test_content_digest_tells_rows_apart():
    """The row digests of a positional partitioner (RandomPartitioner) carry the rows'
    contents through ``content_digest``: the same chunk of a block rebuilt alike must
    agree, other rows at the same positions must differ."""
    from hybrid_ray.partitioning import content_digest, split_by_partition

    def block(prefix):
        return pa.table({"id": np.arange(1000), "s": [f"{prefix}{i}" for i in range(1000)]})

    alone = block("v").slice(200, 300)
    assert content_digest(alone) == content_digest(block("v").slice(200, 300))
    other = block("w").slice(200, 300)
    assert content_digest(other) != content_digest(alone)
    # A dictionary column's values count, not only its indices.
    ab = pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode()})
    ac = pa.table({"d": pa.array(["a", "c", "a"]).dictionary_encode()})
    assert content_digest(ab) != content_digest(ac)
    from hybrid_ray.partitioning import RandomPartitioner

    parts = RandomPartitioner(3).assign(alone, 0, 4)
    digests = {}
    for name, table in (("alone", alone), ("other", other)):
        d = [0] * 4
        split_by_partition(table, parts, 4, d, 0, content_digest(table))
        digests[name] = d
    assert all(a != b for a, b in zip(digests["alone"], digests["other"]))
    plain = [0] * 4
    split_by_partition(alone, parts, 4, plain, 0)  # other partitioners: positions only
    assert plain != digests["alone"]


def test_a_column_named_by_the_empty_string_is_a_key_like_any_other():
    """Arrow and Ray Data allow a column named "" (Ray Data sorts by it); repartition and
    sort refused it, HashPartitioner as "a non-empty list of column names, got ['']" and
    RangePartitioner as "must be a column name", of a column the dataset has (found by a
    review). A name the blocks lack is still refused, by ``check_schema``."""
    from hybrid_ray import ConfigError

    table = pa.table({"": [3, 1, None, 2, 3], "v": [0, 1, 2, 3, 4]})
    hashed = HashPartitioner([""])
    hashed.check_schema(table.schema)
    labels = hashed.assign(table, 0, 4)
    assert labels[0] == labels[4]  # equal keys meet
    ranged = RangePartitioner("", [2])
    ranged.check_schema(table.schema)
    assert list(ranged.assign(table, 0, 2)) == [1, 0, 1, 1, 1]  # 3, 1, null(last), 2, 3
    assert ranged.finalize(table.slice(0, 1), 0)[""].to_pylist() == [3]
    assert ranged.finalize(table, 1)[""].to_pylist() == [1, 2, 3, 3, None]
    with pytest.raises(ConfigError, match="key column '' is not in the blocks' schema"):
        HashPartitioner([""]).check_schema(pa.schema([("k", pa.int64())]))
    with pytest.raises(ConfigError, match="key column '' is not in the blocks' schema"):
        RangePartitioner("", [1]).check_schema(pa.schema([("k", pa.int64())]))


def test_multi_key_range_partitioner_labels_follow_the_sort_order():
    """Rows labelled by ``MultiKeyRangePartitioner`` and concatenated partition by
    partition, each sorted by ``finalize``, are the whole table in sort order: labels never
    go down along the sorted rows, rows equal in every key share a label (a tie at a
    boundary row goes after it), and nulls and NaNs sort last in each key."""
    from hybrid_ray import MultiKeyRangePartitioner

    table = pa.table({"a": [1.0, None, float("nan"), 1.0, 2.0, 2.0, 0.0, None],
                      "b": ["x", "y", "y", "z", None, "x", "q", "y"],
                      "row": list(range(8))})
    sort_keys = [("a", "ascending", "at_end"), ("b", "descending", "at_end")]
    boundaries = pa.table({"a": [1.0, 2.0], "b": ["x", "x"]})
    part = MultiKeyRangePartitioner(["a", "b"], boundaries, [False, True])
    part.check_schema(table.schema)
    labels = part.assign(table, 0, 3)
    by_label = {i: part.finalize(table.filter(pa.array(labels == i)), i) for i in range(3)}
    assert pa.concat_tables(by_label.values())["row"].to_pylist() \
        == table.sort_by(sort_keys)["row"].to_pylist()
    # (1, "x") equals the first boundary row: after it, in partition 1; (2, "x") likewise.
    assert labels.tolist() == [1, 2, 2, 0, 2, 2, 0, 2]


def test_multi_key_range_partitioner_takes_boundaries_of_a_dictionary_encoded_key():
    """Boundary rows taken from the data itself, whose key is dictionary-encoded, were
    refused as "another kind of value" than the very same dictionary type."""
    from hybrid_ray import MultiKeyRangePartitioner

    table = pa.table({"s": pa.array(["a", "c", "b", "d"]).dictionary_encode(),
                      "i": [1, 2, 3, 4]})
    part = MultiKeyRangePartitioner(["s", "i"], table.slice(1, 1), [False, False])
    part.check_schema(table.schema)
    assert part.assign(table, 0, 2).tolist() == [0, 1, 0, 1]


def test_multi_key_range_partitioner_refuses_bad_keys_flags_and_boundaries():
    from hybrid_ray import MultiKeyRangePartitioner
    from hybrid_ray.errors import ConfigError

    bounds = pa.table({"a": [1], "b": ["x"]})
    with pytest.raises(ConfigError, match=r"column\(s\) \['a'\] more than once"):
        MultiKeyRangePartitioner(["a", "a"], pa.table({"a": [1], "a2": [1]}), [True, True])
    with pytest.raises(ConfigError, match=r"one True or False per sort key \(2 keys\), got "
                                          r"\[True\]"):
        MultiKeyRangePartitioner(["a", "b"], bounds, [True])
    with pytest.raises(ConfigError, match="got \\[1, 0\\]"):
        MultiKeyRangePartitioner(["a", "b"], bounds, [1, 0])
    with pytest.raises(ConfigError, match=r"exactly the key columns \['b', 'a'\]"):
        MultiKeyRangePartitioner(["b", "a"], bounds, [True, False])
    part = MultiKeyRangePartitioner(["a", "b"], bounds, [False, False])
    with pytest.raises(ConfigError, match="boundaries of key 'a' \\(int64\\) are not values "
                                          "of its type timestamp"):
        part.check_schema(pa.schema([("a", pa.timestamp("s")), ("b", pa.string())]))
    with pytest.raises(ConfigError, match="cannot sort by column 'b' of type list<item: "
                                          "int64>"):
        part.check_schema(pa.schema([("a", pa.int64()), ("b", pa.list_(pa.int64()))]))
    with pytest.raises(ConfigError, match="1 boundary rows, which make 2 key ranges, but the "
                                          "shuffle has 1 partitions"):
        part.check_partition_count(1)
