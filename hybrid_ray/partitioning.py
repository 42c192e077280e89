"""How map tasks assign rows to subpartitions, and how reducers finish their partition.

A ``Partitioner`` is plain, picklable Python: ``assign`` maps every row of a table to a
subpartition in ``[0, num_partitions)``; ``finalize`` runs once on a reducer's whole
partition (sort it, shuffle it, or leave it). Subclass it for custom shuffles.
"""

from __future__ import annotations

import abc
import collections
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from hybrid_ray.errors import ConfigError

# splitmix64 constants: a cheap, well-mixing 64-bit hash for integer keys.
_MIX1, _MIX2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), \
    np.uint64(0x9E3779B97F4A7C15)


class Partitioner(abc.ABC):
    """Assigns rows to subpartitions (map side) and finishes a partition (reduce side)."""

    @abc.abstractmethod
    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        """Subpartition of every row of ``table`` (an integer array of ``len(table)``).

        Must be deterministic: the same table and ``map_index`` give the same labels.
        A map whose output was lost (its writer's node died) runs again, and its rows of
        subpartitions already reduced and freed are dropped from the re-run; labels that
        changed between the runs would duplicate some rows and lose others. The master
        refuses a re-run whose row count for such a subpartition changed (``ConfigError``);
        one that swaps rows and keeps the counts is not caught. The built-in partitioners
        are deterministic (``RandomPartitioner`` seeds each map's stream from its seed and
        ``map_index``)."""

    #: Whether ``assign`` ignores the rows' values (it labels rows by position). The map
    #: then binds the rows' contents into the row digests the master compares between a
    #: lost map's runs (``content_digest``): a re-run over an input that changed (a block
    #: rebuilt by a task that is not deterministic) labels its rows exactly as before, so
    #: positions alone let it through, and the output lost and duplicated rows. Where
    #: labels come from the values, changed rows change the positions' digest anyway.
    assigns_by_position: bool = False

    def finalize(self, table: pa.Table, subpartition: int) -> pa.Table:
        """Transform a reducer's complete partition; the default keeps it as read."""
        return table

    def check_schema(self, schema: pa.Schema) -> None:
        """Refuse (``ConfigError`` naming the column and the fix) a schema this
        partitioner cannot work with, before anything runs (``run_shuffle`` calls it).
        The default accepts every schema."""

    def check_partition_count(self, num_partitions: int) -> None:
        """Refuse (``ConfigError``) a partition count this partitioner cannot label rows
        for, before anything runs (``run_shuffle`` calls it). The default accepts any."""


def _mix64_inplace(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied to ``x`` (uint64) in place; returns ``x``.

    In place because the key hash is a quarter of a writer's CPU: every temporary array
    of a million rows is 8 MB of fresh memory to fault in and write.
    """
    with np.errstate(over="ignore"):
        x += _GOLDEN
        t = x >> np.uint64(30)
        x ^= t
        x *= _MIX1
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= _MIX2
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
    return x


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (a new array; ``x`` is left alone)."""
    return _mix64_inplace(np.array(x, dtype=np.uint64, copy=True))


def _scalar_mix(value: int) -> np.uint64:
    return _mix64(np.array([value % (1 << 64)], dtype=np.uint64))[0]


# Temporal values are hashed as nanoseconds (wrapping mod 2**64), so the same instant in
# any unit hashes alike: multiplying by the unit's nanoseconds is a ring homomorphism mod
# 2**64, exact for every value, where a cast to one unit could overflow or truncate.
# Distinct instants 584 years apart collide, which only costs balance, never correctness.
_NANOS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_DAY_NANOS = 86_400 * 10**9
# Byte strings: the length goes into the first word's mix (b"ab" and b"ab\0" differ).
_LENGTH_SALT = np.array([_scalar_mix(0x5EED0000 + n) for n in range(64)], dtype=np.uint64)
# Little-endian masks keeping the first n bytes of a word (n = 0..8).
_PREFIX_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(8)] + [(1 << 64) - 1],
                         dtype=np.uint64)
# Order of the key columns matters: (a, b) and (b, a) must not always collide.
_KEY_STEP = np.uint64(0xD6E8FEB86659FD93)


def _length_salt(lengths: np.ndarray) -> np.ndarray:
    """The per-length salt of every value (lengths of 64 and up share one table slot plus
    the mixed length, computed only for them)."""
    salt = _LENGTH_SALT[np.minimum(lengths, 63)]
    long = lengths >= 63
    if long.any():
        salt[long] = _mix64(lengths[long].astype(np.uint64) + np.uint64(0x5EED0000))
    return salt


def hash_column(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A deterministic uint64 hash per value (the same in every process and run).

    The hash of a value depends on the value alone: not on the other values in its array
    (map tasks hash chunk by chunk, and equal keys must land in the same partition whatever
    else their chunk holds), and not on how the value is represented, so blocks of one
    dataset whose columns differ in representation still agree:

    * integers of any width and sign hash by value (int32 5 == int64 5);
    * floats as float64 (float32 1.5 == float64 1.5), with -0.0 hashed as 0.0 and every
      NaN as one canonical NaN (as Spark normalises them before hashing);
    * timestamps, durations and times of any unit by their instant in nanoseconds, and
      date32 and date64 of the same day alike;
    * decimals by their value whatever the scale or precision (1.50 == 1.500);
    * binary and string, large or not, fixed-size or not, by their bytes;
    * dictionary-encoded values as their decoded value (the dictionary is hashed once).

    Nulls hash to 0.
    """
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return _hash_array(column.chunk(0))
        parts = [_hash_array(chunk) for chunk in column.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
    return _hash_array(column)


def _hash_array(column: pa.Array) -> np.ndarray:
    t = column.type
    n = len(column)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if pa.types.is_dictionary(t):
        # Decode by hashing the (small) dictionary once and taking by index.
        values = _hash_array(column.dictionary)
        indices = column.indices
        if indices.null_count:  # null slots may hold any index
            indices = pc.fill_null(indices, 0)
        out = values[_fixed_width_values(indices, n)] if len(values) \
            else np.zeros(n, dtype=np.uint64)
    elif pa.types.is_integer(t):
        out = _mix64_inplace(_fixed_width_values(column, n).astype(np.int64).view(np.uint64))
    elif pa.types.is_boolean(t):
        values = pc.fill_null(column, False) if column.null_count else column
        out = _mix64_inplace(values.to_numpy(zero_copy_only=False).astype(np.uint64))
    elif pa.types.is_floating(t):
        out = _hash_floats(column)
    elif pa.types.is_temporal(t) and _nanos_per_unit(t) is not None:
        out = _hash_temporal(column, n, _nanos_per_unit(t))
    elif pa.types.is_decimal(t):
        out = _hash_decimals(column)
    elif _is_bytes_like(t):
        out = _hash_bytes(column)
    elif (getattr(pa.types, "is_string_view", None) and pa.types.is_string_view(t)) or \
            (getattr(pa.types, "is_binary_view", None) and pa.types.is_binary_view(t)):
        out = _hash_bytes(column.cast(pa.large_binary()))
    elif pa.types.is_null(t):
        return np.zeros(n, dtype=np.uint64)
    elif pa.types.is_struct(t):
        out = _hash_struct(column, n)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t) \
            or pa.types.is_fixed_size_list(t):
        out = _hash_lists(column, n)
    elif _is_list_view(t):  # the same lists as a list's (sizes and offsets apart)
        return _hash_array(_as_large_list(column))
    elif isinstance(t, pa.BaseExtensionType):  # by the values it stores (uuid, json, ...)
        return _hash_array(column.storage)
    else:
        # Other rare key types (unions, extension types, intervals). pandas is imported
        # here, not at module level: it costs a new Ray worker ~0.5 s of CPU to import.
        import pandas as pd

        values = column.to_numpy(zero_copy_only=False)
        out = pd.util.hash_array(values, categorize=False).astype(np.uint64, copy=False)
    if column.null_count:
        out[column.is_null().to_numpy(zero_copy_only=False)] = 0
    return out


def _is_list_view(t: pa.DataType) -> bool:
    return pa.types.is_list_view(t) or pa.types.is_large_list_view(t)


def _as_large_list(column: pa.Array) -> pa.Array:
    """A list view's lists as a large list array. Not Arrow's cast: in Arrow 26 it gave a
    trailing null slot offset 0 (offsets [0, 1, 3, 3, 0]), which broke the lengths."""
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(column) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pc.list_flatten(column),
                                         type=pa.large_list(column.type.value_field),
                                         mask=column.is_null())


# Ray Data's column type for Python objects Arrow cannot hold: their pickled bytes.
PICKLED_OBJECT_EXTENSION = "ray.data.arrow_pickled_object"


def hash_key_problem(t: pa.DataType) -> str:
    """Why values of type ``t`` cannot be a hash key ("" if they can): unions, whose
    values have no representation ``hash_column`` can hash by value (they failed inside
    every map, after the actors started), and pickled Python objects, whose bytes are no
    such representation; searched through nested types."""
    if pa.types.is_union(t):
        return f"{t} is a union"
    if pa.types.is_dictionary(t):
        return hash_key_problem(t.value_type)
    if isinstance(t, pa.BaseExtensionType):
        if t.extension_name == PICKLED_OBJECT_EXTENSION:
            # Hashed as stored, equal keys went to different partitions (a group split):
            # frozenset([1, 9]) and frozenset([9, 1]) pickle apart, and so does a set of
            # strings built in another process (string hashes are salted per process).
            return ("it holds pickled Python objects (Ray Data's arrow_pickled_object), "
                    "and equal objects (sets, or objects built in another process) pickle "
                    "to different bytes")
        return hash_key_problem(t.storage_type)
    return next((p for p in (hash_key_problem(t.field(i).type) for i in range(t.num_fields))
                 if p), "")


def _hash_struct(column: pa.StructArray, n: int) -> np.ndarray:
    """Structs by their fields' values, each hashed as a column of its own and combined
    in field order (null fields hash to 0; null structs are zeroed by the caller). Hashed
    through pandas before, a struct's int field became a float when another row of the
    chunk had it null, so equal keys hashed apart by what else their chunk held."""
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for field in column.flatten():  # the struct's offset applied to every field
            h = h * _KEY_STEP + _hash_array(field)
    return _mix64_inplace(h)


def _hash_lists(column: pa.Array, n: int) -> np.ndarray:
    """Lists (and maps, lists of key/value structs) by their elements' values in order and
    their length: every element is hashed as a column, salted with its position, and the
    row's elements summed."""
    if pa.types.is_fixed_size_list(column.type):
        size = column.type.list_size
        offsets = np.arange(n + 1, dtype=np.int64) * size
        # Not flatten(): it leaves out the elements behind null rows, which shifted every
        # later row's elements (NumPy then refused the shapes, failing every map).
        values = column.values.slice(column.offset * size, n * size)
    else:
        offsets = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    element = _hash_array(values)
    # Each element's position in its row, salted in before the sum (order matters).
    positions = np.arange(len(element), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    with np.errstate(over="ignore"):
        salted = _mix64_inplace(element ^ (positions.astype(np.uint64) * _KEY_STEP))
        sums = np.zeros(n, dtype=np.uint64)
        nonempty = lengths > 0
        if nonempty.any():
            sums[nonempty] = np.add.reduceat(salted, offsets[:-1][nonempty])
        h = sums ^ _length_salt(lengths)
    return _mix64_inplace(h)


def _fixed_width_values(column: pa.Array, n: int) -> np.ndarray:
    """The values buffer of a fixed-width integer-like array as signed or unsigned
    integers of its width (zero-copy; null slots hold arbitrary values)."""
    width = column.type.bit_width // 8
    signed = not (pa.types.is_unsigned_integer(column.type))
    dtype = np.dtype(f"<{'i' if signed else 'u'}{width}")
    return np.frombuffer(column.buffers()[1], dtype=dtype, count=n, offset=column.offset * width)


def _hash_floats(column: pa.Array) -> np.ndarray:
    values = column.to_numpy(zero_copy_only=False)  # nulls become NaN; zeroed later
    # Adding +0.0 turns -0.0 into 0.0 (IEEE 754) and, for float64, makes the copy that
    # the in-place mix then overwrites.
    with np.errstate(invalid="ignore"):  # signalling NaNs are expected, and normalised
        values = values.astype(np.float64) + 0.0
    nan = np.isnan(values)
    if nan.any():
        values[nan] = np.nan
    return _mix64_inplace(values.view(np.uint64))


def _nanos_per_unit(t: pa.DataType) -> int | None:
    """Nanoseconds per stored unit of a date, time, timestamp or duration type; None for
    other temporal types (intervals)."""
    if pa.types.is_date32(t):
        return _DAY_NANOS
    if pa.types.is_date64(t):
        return _NANOS["ms"]
    return _NANOS.get(getattr(t, "unit", None))


def _hash_temporal(column: pa.Array, n: int, nanos: int) -> np.ndarray:
    values = _fixed_width_values(column, n).astype(np.int64).view(np.uint64)
    if nanos != 1:
        with np.errstate(over="ignore"):
            values *= np.uint64(nanos)  # wraps mod 2**64 (see _NANOS)
    return _mix64_inplace(values)


def _hash_decimals(column: pa.Array) -> np.ndarray:
    """Hash decimals by value: the unscaled integer with its trailing zeros removed, and
    the exponent that leaves (1.50 as decimal(3, 2) and 1.500 as decimal(10, 3) are both
    (15, 1))."""
    t = column.type
    n = len(column)
    width = t.bit_width // 8
    if t.precision <= 18:
        # The unscaled value fits an int64: it is the low 4 or 8 bytes of each
        # little-endian two's-complement value, sign included.
        word = 4 if width == 4 else 8
        raw = np.frombuffer(column.buffers()[1], dtype=np.uint8,
                            count=(n + column.offset) * width)[column.offset * width:]
        unscaled = np.ndarray((n,), dtype=f"<i{word}", buffer=raw, strides=(width,)) \
            .astype(np.int64)
        exponent = np.full(n, t.scale, dtype=np.int64)
        if column.null_count:
            unscaled[column.is_null().to_numpy(zero_copy_only=False)] = 0
        exponent[unscaled == 0] = 0
        for _ in range(19):
            strip = (unscaled % 10 == 0) & (unscaled != 0)
            if not strip.any():
                break
            unscaled[strip] //= 10
            exponent[strip] -= 1
        words, salts = unscaled.view(np.uint64), exponent.view(np.uint64)
    else:
        import decimal

        context = decimal.Context(prec=200)
        words = np.zeros(n, dtype=np.uint64)
        salts = np.zeros(n, dtype=np.uint64)
        for i, value in enumerate(column.to_pylist()):
            if value is None or value == 0:
                continue
            sign, digits, exp = context.normalize(value).as_tuple()
            unscaled = int("".join(map(str, digits))) * (-1 if sign else 1)
            # Values that fit an int64 hash as the precision <= 18 path above does.
            high = 0 if -(1 << 63) <= unscaled < (1 << 63) else unscaled >> 64
            words[i] = unscaled % (1 << 64)
            salts[i] = (-exp ^ (high * 0x9E3779B97F4A7C15)) % (1 << 64)
    h = _mix64(words)
    h ^= salts
    return _mix64_inplace(h)


def _is_bytes_like(t: pa.DataType) -> bool:
    return (pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_binary(t)
            or pa.types.is_large_string(t) or pa.types.is_fixed_size_binary(t))


def _word_view(buffer: Any, n: int, offset: int, stride: int) -> np.ndarray:
    """The little-endian uint64 at ``offset + i * stride`` of ``buffer`` for i < n, as a
    zero-copy strided (possibly unaligned, possibly overlapping) view."""
    return np.ndarray((n,), dtype="<u8", buffer=buffer, offset=offset, strides=(stride,))


def _hash_fixed_rows(data: Any, start: int, n: int, width: int) -> np.ndarray:
    """Hash ``n`` byte strings of ``width`` bytes stored back to back in ``data`` from byte
    ``start``: ceil(width / 8) mixing passes over 8-byte words, the length salted into the
    first. A value's last word is read at ``width - 8`` (overlapping the one before it)
    rather than zero-padded, so no pass copies the bytes; values shorter than 8 bytes are
    zero-padded (``_hash_varying_rows`` masks to the same words)."""
    salt = _length_salt(np.array([width]))[0]
    if width < 8:
        words = np.zeros((n, 8), dtype=np.uint8)
        if width:
            rows = np.frombuffer(data, dtype=np.uint8, count=n * width, offset=start)
            words[:, :width] = rows.reshape(n, width)
        h = words.view("<u8").ravel()
        h ^= salt
        return _mix64_inplace(h)
    h = _word_view(data, n, start, width) ^ salt
    _mix64_inplace(h)
    for k in range(1, -(-width // 8)):
        h ^= _word_view(data, n, start + min(8 * k, width - 8), width)
        _mix64_inplace(h)
    return h


def _hash_varying_rows(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Hash byte strings of differing lengths (``offsets`` into ``data``) to the same
    values as ``_hash_fixed_rows``: one gather of 8-byte words per word position, through
    a view of ``data`` with an 8-byte word starting at every byte."""
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    size = len(data)
    words_at = _word_view(data, max(size - 7, 0), 0, 1) if size >= 8 else None

    def gather(pos: np.ndarray) -> np.ndarray:
        # A read of a short value near the end of the buffer may pass its end: those few
        # come from a zero-padded copy of the last bytes (masked off afterwards anyway).
        late = pos > size - 8
        if not late.any():
            return words_at[pos]
        base = max(size - 8, 0)
        tail = np.zeros(24, dtype=np.uint8)
        tail[:size - base] = data[base:]
        out = np.empty(len(pos), dtype=np.uint64)
        if words_at is not None:
            out[~late] = words_at[pos[~late]]
        out[late] = _word_view(tail, 16, 0, 1)[pos[late] - base]
        return out

    first = gather(starts)
    first &= _PREFIX_MASKS[np.minimum(lengths, 8)]
    first ^= _length_salt(lengths)
    h = _mix64_inplace(first)
    num_words = np.maximum((lengths + 7) // 8, 1)
    for k in range(1, int(num_words.max(initial=1))):
        rows = np.flatnonzero(num_words > k)
        pos = np.minimum(starts[rows] + 8 * k, starts[rows] + lengths[rows] - 8)
        h[rows] = _mix64_inplace(h[rows] ^ gather(pos))
    return h


def _hash_bytes(column: pa.Array) -> np.ndarray:
    """Hash binary/string values by their bytes: fixed-size and variable-length arrays
    holding the same bytes hash alike (Spark hands 10-byte keys over as binary)."""
    n = len(column)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    t = column.type
    if pa.types.is_fixed_size_binary(t):
        width = t.byte_width
        return _hash_fixed_rows(column.buffers()[1], column.offset * width, n, width)
    large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
    itemsize = 8 if large else 4
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64 if large else np.int32,
                            count=n + 1, offset=column.offset * itemsize)
    data_buf = column.buffers()[2]
    data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None
            else np.zeros(0, dtype=np.uint8))
    lengths = np.diff(offsets)
    if lengths.min() == lengths.max():  # the common case (fixed-width keys): zero-copy
        return _hash_fixed_rows(data, int(offsets[0]), n, int(lengths[0]))
    return _hash_varying_rows(data, offsets.astype(np.int64))


def _to_partitions(h: np.ndarray, num_partitions: int) -> np.ndarray:
    """Partition ``floor(high32(h) * num_partitions / 2**32)``: the high bits of a
    well-mixed hash, scaled, with a multiply and shifts instead of a 64-bit modulo (whose
    division costs more than the hash). Needs ``num_partitions < 2**32``."""
    high = h >> np.uint64(32)
    high *= np.uint64(num_partitions)
    high >>= np.uint64(32)
    return high.view(np.int64)


class HashPartitioner(Partitioner):
    """Rows with equal key values go to the same subpartition (see ``hash_column`` for
    which values are equal)."""

    def __init__(self, keys: Sequence[str]) -> None:
        # A bare string was taken as the sequence of its characters: HashPartitioner("ab")
        # partitioned by columns "a" and "b" where they existed.
        if isinstance(keys, str):
            keys = [keys]
        # Any string names a column, "" too (Arrow and Ray Data allow it; it was refused
        # as "a non-empty list of column names" when given): check_schema refuses a name
        # the blocks do not have.
        if isinstance(keys, (bytes, dict)) or not isinstance(keys, Sequence) \
                or not keys or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"HashPartitioner takes a non-empty list of column names, got "
                              f"{keys!r}: e.g. HashPartitioner(['user_id'])")
        self.keys = list(keys)

    def check_schema(self, schema: pa.Schema) -> None:
        for key in self.keys:
            t = _key_type(schema, key, "HashPartitioner")
            problem = hash_key_problem(t)
            if problem:
                raise ConfigError(
                    f"cannot partition by column {key!r} of type {t}: {problem}, whose "
                    "values hybrid_ray cannot hash by value. Partition by another column, "
                    "or by one derived from it (e.g. its string form)")

    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        if not self.keys:
            raise ValueError("HashPartitioner needs at least one key column")
        h = hash_column(table.column(self.keys[0]))
        for key in self.keys[1:]:
            # hash_column's result is already mixed: one key needs no further pass.
            with np.errstate(over="ignore"):
                h = h * _KEY_STEP
            h ^= hash_column(table.column(key))
            _mix64_inplace(h)
        return _to_partitions(h, num_partitions)


class RangePartitioner(Partitioner):
    """Subpartition i holds keys between sampled boundaries i-1 and i; reducers sort.

    Concatenating the output partitions in order gives a globally sorted table. Nulls and
    NaNs go to the first partition if ``nulls_first`` else to the last, and sort there
    (NaNs between the values and the nulls, as Arrow sorts them). ``nulls_first=None``
    sorts nulls as Ray Data's own sort does: last, ascending and descending (checked on
    Ray 2.60: ``ds.sort("k", descending=True)`` gives ``[7, 3, nan, None]``). ``boundaries``
    hold no nulls, NaNs or NaTs (any given are dropped).
    """

    def __init__(self, key: str, boundaries: Sequence, descending: bool = False,
                 nulls_first: bool | None = None) -> None:
        self.key = key
        # The Arrow time type of boundaries given as an Arrow time array: sort_key_values
        # makes them counts of its unit, which check_schema converts to the key's unit
        # (taken as counts of the key's, 01:00 in seconds was 3.6 microseconds of a
        # time64[ns] key, and times were taken for ints, dates and timestamps).
        self._time_type: pa.DataType | None = None
        given = boundaries
        if isinstance(boundaries, (pa.Array, pa.ChunkedArray)):
            if pa.types.is_time(boundaries.type):
                self._time_type = boundaries.type
            boundaries = sort_key_values(pc.drop_null(boundaries))
        try:
            boundaries = np.asarray(boundaries)
        except ValueError:  # nested lists of different lengths
            boundaries = None
        # Checked before the values are looked at: None, a set, a dict or a generator (a
        # 0-d array) failed with a bare "TypeError: iteration over a 0-d array", nested
        # lists of different lengths with NumPy's "inhomogeneous shape" ValueError.
        if boundaries is None or boundaries.ndim != 1:
            shape = "" if boundaries is None else f" (an array of shape {boundaries.shape})"
            raise ConfigError(f"RangePartitioner's boundaries must be a flat sequence of key "
                              f"values (a list or a NumPy or Arrow array), got "
                              f"{type(given).__name__}{shape}: e.g. RangePartitioner('k', "
                              f"[10, 20, 30])")
        if boundaries.dtype == object:
            # NaN too (a None beside it keeps it in an object array): it compares false
            # with everything, so the boundaries were refused as out of order.
            boundaries = boundaries[[not _is_missing(b) for b in boundaries]]
        elif boundaries.dtype.kind == "f":
            boundaries = boundaries[~np.isnan(boundaries)]
        elif boundaries.dtype.kind in "Mm":
            boundaries = boundaries[~np.isnat(boundaries)]
        if not isinstance(key, str):  # "" is a column name too (see HashPartitioner)
            raise ConfigError(f"RangePartitioner's key must be a column name, got {key!r}")
        # Bools only: a truthy string ("no") compared unequal to True below and put the
        # nulls in the end partition opposite to where ``finalize`` sorts them.
        if not isinstance(descending, bool):
            raise ConfigError(f"RangePartitioner's descending must be True or False, got "
                              f"{descending!r}")
        if nulls_first is not None and not isinstance(nulls_first, bool):
            raise ConfigError(f"RangePartitioner's nulls_first must be True, False or None, "
                              f"got {nulls_first!r}")
        # Assignment binary-searches the boundaries: unsorted ones sent keys to the wrong
        # partitions and the concatenated output was silently out of order.
        try:
            ascending = bool(np.all(boundaries[:-1] <= boundaries[1:]))
        except TypeError as exc:
            raise ConfigError(f"RangePartitioner's boundaries cannot be compared with each "
                              f"other: {exc}") from None
        if not ascending:
            raise ConfigError("RangePartitioner's boundaries must be in ascending order (also "
                              "with descending=True, which reverses the partitions): sort "
                              "them, e.g. sorted(boundaries)")
        self.boundaries = boundaries
        self.descending = descending
        self.nulls_first = False if nulls_first is None else nulls_first

    def check_schema(self, schema: pa.Schema) -> None:
        """The key must be sortable, and the boundaries values of its type: int keys
        searched among string boundaries were compared as text, and the concatenated
        output was silently out of order ([0, 1, 2, 10, ..., 19, 3, ...]). Boundaries are
        kept in the form the key's values take in ``assign`` (decoded, as NumPy)."""
        t = _key_type(schema, self.key, "RangePartitioner")
        problem = sort_key_problem(t)
        if problem:
            raise ConfigError(f"cannot sort by column {self.key!r} of type {t}: {problem}")
        value_type = t.value_type if pa.types.is_dictionary(t) else t
        if len(self.boundaries) == 0:
            return
        if self._time_type is not None:
            self._check_time_boundaries(t, value_type)
            return
        numeric = pa.types.is_integer(value_type) or pa.types.is_floating(value_type)
        if numeric:
            # NumPy numbers, or Python ones in an object array (a None given among them
            # and dropped, ints beyond int64, Decimals): NumPy compares both with the keys.
            kind = self.boundaries.dtype.kind
            if kind not in "iuf" and not (kind == "O" and all(
                    isinstance(b, numbers.Number) and not isinstance(b, (bool, np.bool_))
                    for b in self.boundaries)):
                raise ConfigError(self._foreign_boundaries(t, "they are not numbers"))
            return
        try:
            # NumPy datetimes keep their unit through Arrow; anything else converts from
            # Python values, strictly (ints are not taken for strings, nor strings parsed).
            source = self.boundaries if self.boundaries.dtype.kind in "Mm" \
                else self.boundaries.tolist()
            self.boundaries = sort_key_values(pa.array(source, type=value_type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError,
                ValueError, OverflowError) as exc:
            raise ConfigError(self._foreign_boundaries(t, str(exc))) from None

    def check_partition_count(self, num_partitions: int) -> None:
        """N boundaries make N + 1 ranges: more than ``num_partitions`` labelled rows
        beyond the last partition. Each map refused those labels, after the actors had
        started; where no row fell beyond, the extra boundaries went unnoticed."""
        if len(self.boundaries) > num_partitions - 1:
            raise ConfigError(
                f"RangePartitioner has {len(self.boundaries)} boundaries, which make "
                f"{len(self.boundaries) + 1} key ranges, but the shuffle has "
                f"{num_partitions} partitions: give at most {num_partitions - 1} "
                f"boundaries, or ask for {len(self.boundaries) + 1} partitions")

    def _check_time_boundaries(self, t: pa.DataType, value_type: pa.DataType) -> None:
        """Boundaries given as an Arrow time array, now counts of its unit: as counts of
        the key's unit, or a ConfigError if the key holds no times (or a boundary is off
        the key's unit)."""
        given = self._time_type
        if not pa.types.is_time(value_type):
            raise ConfigError(self._foreign_boundaries(t, f"they are times of day ({given})"))
        try:
            self.boundaries = sort_key_values(
                pa.array(self.boundaries, type=given).cast(value_type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ConfigError(self._foreign_boundaries(t, str(exc))) from None
        self._time_type = value_type  # check_schema may run again (another shuffle)

    def _foreign_boundaries(self, t: pa.DataType, why: str) -> str:
        return (f"RangePartitioner's boundaries (NumPy {self.boundaries.dtype}) are not "
                f"values of its key column {self.key!r} of type {t}: {why}. Keys compared "
                "with boundaries of another type land in the wrong partitions; give "
                "boundaries of the key's type")

    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        column = table.column(self.key)
        if pa.types.is_dictionary(column.type):
            # Decoded: a dictionary may hold a null value that a valid index points to,
            # which is_null does not see on the encoded column.
            column = column.cast(column.type.value_type)
        missing = column.is_null(nan_is_null=True)
        if not pc.any(missing).as_py():
            idx = self._positions(sort_key_values(column))
        else:
            # Nulls cannot be compared with the boundaries (and NaNs compare false with
            # everything): they get the end of the order nulls_first picks, unlike NumPy's
            # NaN-last order or an object array holding None.
            mask = missing.to_numpy(zero_copy_only=False)
            idx = np.full(table.num_rows, 0 if self.nulls_first != self.descending
                          else len(self.boundaries), dtype=np.int64)
            present = column.filter(pc.invert(missing))
            idx[~mask] = self._positions(sort_key_values(present))
        return (num_partitions - 1 - idx) if self.descending else idx

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.boundaries, keys, side="right")

    def finalize(self, table: pa.Table, subpartition: int) -> pa.Table:
        order = "descending" if self.descending else "ascending"
        placement = "at_start" if self.nulls_first else "at_end"
        column = table.column(self.key)
        sortable = sortable_column(column)
        if sortable is column:
            return table.sort_by([(self.key, order, placement)])
        # Arrow cannot sort some key types (dictionary-encoded, float16):
        # sort their decoded values, then take the rows in that order.
        indices = pc.sort_indices(pa.table({"key": sortable}),
                                  sort_keys=[("key", order, placement)])
        return table.take(indices)


class MultiKeyRangePartitioner(Partitioner):
    """Range partitioning by several sort keys, each ascending or descending: the order
    of ``pyarrow.Table.sort_by`` with nulls (and NaNs, before them) last, which is Ray
    Data's ``Dataset.sort([...], descending=[...])``.

    ``boundaries`` is a table of the key columns whose rows are in that order; a row goes
    to partition i when i boundary rows sort before it or equal to it. Each map chunk's
    keys are sorted together with the boundaries by the comparator the reducers sort with
    (Arrow's stable ``sort_indices``, the boundaries first), so rows with equal keys never
    straddle two partitions and the partitions in order form the sorted whole. Costs a
    sort of each chunk's keys, where ``RangePartitioner`` binary-searches one key: it is
    for sorts by more than one column.
    """

    def __init__(self, keys: Sequence[str], boundaries: pa.Table,
                 descending: Sequence[bool]) -> None:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or not keys \
                or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"MultiKeyRangePartitioner takes a non-empty list of column "
                              f"names, got {keys!r}")
        repeated = repeated_names(keys)
        if repeated:
            raise ConfigError(f"sort keys name column(s) {repeated} more than once; name "
                              "each column once (a later mention never changes the order)")
        if isinstance(descending, (str, bytes)) or not isinstance(descending, Sequence) \
                or len(descending) != len(keys) \
                or not all(isinstance(d, (bool, np.bool_)) for d in descending):
            raise ConfigError(f"descending must be one True or False per sort key ({len(keys)}"
                              f" keys), got {descending!r}")
        if not isinstance(boundaries, pa.Table) or boundaries.column_names != list(keys):
            raise ConfigError("MultiKeyRangePartitioner's boundaries must be a pyarrow Table "
                              f"of exactly the key columns {list(keys)}, in that order")
        self.keys = list(keys)
        self.descending = [bool(d) for d in descending]
        self.boundaries = boundaries

    @property
    def sort_keys(self) -> list[tuple[str, str]]:
        """The keys as ``pyarrow.compute.sort_indices`` takes them (nulls last)."""
        return [(k, "descending" if d else "ascending", "at_end")
                for k, d in zip(self.keys, self.descending)]

    def check_schema(self, schema: pa.Schema) -> None:
        """Every key must be sortable, and the boundaries values of its type (cast now:
        boundaries of another type would compare keys wrongly, or fail in every map)."""
        columns = []
        for i, key in enumerate(self.keys):
            t = _key_type(schema, key, "MultiKeyRangePartitioner")
            problem = sort_key_problem(t)
            if problem:
                raise ConfigError(f"cannot sort by column {key!r} of type {t}: {problem}")
            target, given = _sortable_type(t), self.boundaries.schema.field(i).type
            # Decoded as the key's are: boundaries taken from the data itself may be
            # dictionary-encoded too (they were refused as "another kind of value").
            problem = "" if _same_kind(_sortable_type(given), target) \
                else "another kind of value"
            if not problem:
                try:
                    columns.append(self.boundaries.column(i).cast(target))
                except (pa.ArrowInvalid, pa.ArrowTypeError,
                        pa.ArrowNotImplementedError) as exc:
                    problem = str(exc)
            if problem:
                # Strict, as RangePartitioner: ints are not taken for timestamps (Arrow
                # casts them as epoch counts), nor strings parsed as numbers.
                raise ConfigError(
                    f"MultiKeyRangePartitioner's boundaries of key {key!r} ({given}) are not "
                    f"values of its type {t}: {problem}; give boundaries of the key's type")
        self.boundaries = pa.table(columns, names=self.keys)

    def check_partition_count(self, num_partitions: int) -> None:
        """As ``RangePartitioner.check_partition_count``: N boundary rows make N + 1
        ranges."""
        if self.boundaries.num_rows > num_partitions - 1:
            raise ConfigError(
                f"MultiKeyRangePartitioner has {self.boundaries.num_rows} boundary rows, "
                f"which make {self.boundaries.num_rows + 1} key ranges, but the shuffle has "
                f"{num_partitions} partitions: give at most {num_partitions - 1}")

    def _keys_of(self, table: pa.Table) -> pa.Table:
        return pa.table([sortable_column(table.column(k)) for k in self.keys], names=self.keys)

    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        n = table.num_rows
        bounds = self.boundaries
        if bounds.num_rows == 0 or n == 0:
            return np.zeros(n, dtype=np.int64)
        keys = self._keys_of(table)
        # Boundaries in the chunk's exact types (a block's string may be large_string).
        bounds = pa.table([bounds.column(i).cast(keys.column(i).type)
                           for i in range(len(self.keys))], names=self.keys)
        both = pa.concat_tables([bounds, keys])
        order = pc.sort_indices(both, sort_keys=self.sort_keys).to_numpy()
        is_boundary = order < bounds.num_rows
        seen = np.cumsum(is_boundary)  # boundary rows at or before each position
        labels = np.empty(n, dtype=np.int64)
        rows = ~is_boundary
        labels[order[rows] - bounds.num_rows] = seen[rows]
        return labels

    def finalize(self, table: pa.Table, subpartition: int) -> pa.Table:
        indices = pc.sort_indices(self._keys_of(table), sort_keys=self.sort_keys)
        return table.take(indices)


def repeated_names(names: Sequence[str]) -> list[str]:
    """The names given more than once, sorted."""
    counts = collections.Counter(names)
    return sorted(name for name, count in counts.items() if count > 1)


def _same_kind(given: pa.DataType, target: pa.DataType) -> bool:
    """Whether boundary values of type ``given`` are values of a key of type ``target``:
    the same type, no values at all (null), numbers for numbers, text for text, bytes for
    bytes."""
    types = pa.types
    if given == target or types.is_null(given):
        return True
    for kind in (lambda x: types.is_integer(x) or types.is_floating(x) or types.is_decimal(x),
                 lambda x: types.is_string(x) or types.is_large_string(x),
                 lambda x: types.is_binary(x) or types.is_large_binary(x)):
        if kind(given) and kind(target):
            return True
    return False


def _sortable_type(t: pa.DataType) -> pa.DataType:
    """The type ``sortable_column`` turns a column of type ``t`` into."""
    if pa.types.is_dictionary(t):
        return _sortable_type(t.value_type)
    if pa.types.is_float16(t):
        return pa.float32()
    return t


def _is_missing(value: Any) -> bool:
    """Whether a boundary given in an object array is a null or a NaN (float, NumPy or
    Decimal), which ``RangePartitioner`` drops."""
    if value is None:
        return True
    try:
        return bool(value != value)
    except (TypeError, ValueError, ArithmeticError):  # pd.NA, arrays, signalling NaNs
        return False


def _key_type(schema: pa.Schema, key: str, who: str) -> pa.DataType:
    index = schema.get_field_index(key)
    if index < 0:
        raise ConfigError(f"{who}'s key column {key!r} is not in the blocks' schema; "
                          f"their columns are {schema.names}")
    return schema.field(index).type


def sort_key_problem(t: pa.DataType) -> str:
    """Why values of type ``t`` cannot be sorted by ("" if they can): nested, union,
    interval and extension types have no order Arrow sorts by."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_nested(t) or pa.types.is_union(t) or pa.types.is_interval(t) \
            or isinstance(t, pa.BaseExtensionType):
        return ("its values have no order; sort by a column of numbers, strings, binary, "
                "dates, times or decimals (e.g. a struct's field, selected into a column)")
    return ""


def sort_key_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The non-null values of a sort key column as NumPy values that compare in the key's
    order: what sampled boundaries and the keys searched among them are. Times are their
    integer counts of the type's unit: NumPy has no time of day, and Arrow gives Python
    ``datetime.time`` objects, which cannot hold nanoseconds (a time64[ns] key with any
    value off the microsecond failed every sort with "has non-zero nanoseconds")."""
    t = column.type
    if pa.types.is_time(t):
        column = column.cast(pa.int32() if t.bit_width == 32 else pa.int64())
    return column.to_numpy(zero_copy_only=False)


def sortable_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` as a type Arrow's sort takes, holding the same values (the column itself
    when it is one already)."""
    t = column.type
    if pa.types.is_dictionary(t):
        return sortable_column(column.cast(t.value_type))
    if pa.types.is_float16(t):
        return column.cast(pa.float32())
    return column


class RandomPartitioner(Partitioner):
    """Seeded random assignment; reducers also permute rows, seeded, so the result is a
    reproducible random shuffle."""

    assigns_by_position = True

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"RandomPartitioner's seed must be an integer >= 0, got {seed!r}")
        self.seed = int(seed)
        # map index -> its random stream, continued chunk after chunk. A stream started
        # afresh for every chunk gave row i of each chunk of a map the same subpartition
        # (rows a chunk apart always stayed together: not a uniform shuffle). Each map run
        # gets its own copy of the partitioner (it travels pickled with the task), so a
        # map's assignment still depends only on the seed, the map and its chunking.
        self._streams: dict[int, np.random.Generator] = {}

    def __getstate__(self) -> dict:
        return {"seed": self.seed}  # a copy starts every map's stream from the seed

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["seed"])

    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        rng = self._streams.get(map_index)
        if rng is None:
            rng = self._streams[map_index] = np.random.default_rng([self.seed, map_index])
        return rng.integers(0, num_partitions, table.num_rows)

    def finalize(self, table: pa.Table, subpartition: int) -> pa.Table:
        rng = np.random.default_rng([self.seed, 1 << 30, subpartition])
        return table.take(rng.permutation(table.num_rows))


def range_boundaries(samples: np.ndarray, num_partitions: int) -> np.ndarray:
    """``num_partitions - 1`` quantile boundaries of sorted key samples."""
    if len(samples) == 0 or num_partitions == 1:
        return samples[:0]
    samples = np.sort(samples)
    picks = (np.arange(1, num_partitions) * len(samples)) // num_partitions
    return samples[np.minimum(picks, len(samples) - 1)]


def repeated_columns_problem(schema: pa.Schema) -> str:
    """Why the rows of ``schema`` cannot be shuffled for its column names ("" if they
    can): a name held by two or more columns. Ray's serializer looks Arrow columns up by
    name, so such blocks ran maps and failed in a task with Arrow's bare "Field "a"
    exists 2 times in schema"; and a key of that name was refused as "not in the
    blocks' schema" while the message listed it."""
    repeated = repeated_names(schema.names)
    if not repeated:
        return ""
    names = ", ".join(repr(name) for name in repeated)
    return (f"cannot shuffle data with more than one column named {names} (its columns "
            f"are {schema.names}): columns are found by name. Rename them apart first, "
            "e.g. table.rename_columns([...]) or, for a Dataset, "
            "ds.map_batches(lambda t: t.rename_columns([...]), batch_format='pyarrow')")


def untakeable_column_problem(schema: pa.Schema) -> str:
    """Why the rows of ``schema`` cannot be shuffled ("" if they can): a column of a type
    Arrow cannot ``take`` rows of (string_view, binary_view, run-end encoded; also inside
    a struct or list), which failed inside every map after the actors started."""
    def untakeable(t: pa.DataType) -> bool:
        if pa.types.is_string_view(t) or pa.types.is_binary_view(t) \
                or pa.types.is_run_end_encoded(t):
            return True
        if pa.types.is_dictionary(t):
            return untakeable(t.value_type)
        if isinstance(t, pa.BaseExtensionType):
            return untakeable(t.storage_type)
        return any(untakeable(t.field(i).type) for i in range(t.num_fields))

    bad = [f"{field.name!r} ({field.type})" for field in schema if untakeable(field.type)]
    if not bad:
        return ""
    return (f"cannot shuffle column(s) {', '.join(bad)}: Arrow {pa.__version__} cannot take "
            "rows of string_view, binary_view or run-end encoded arrays. Cast them first "
            "to string, binary or the decoded type, e.g. ds.map_batches(lambda t: "
            "t.cast(target_schema), batch_format='pyarrow')")


def split_by_partition(table: pa.Table, parts: np.ndarray, num_partitions: int,
                       row_digests: list[int] | None = None,
                       first_row: int = 0, content: int = 0) -> list[tuple[int, pa.Table]]:
    """Group rows by subpartition: one ``take`` then zero-copy slices.

    ``row_digests``: one int per subpartition, to which a digest of which rows go there is
    added (XXH3 of their indices, the table's rows being ``first_row`` on in the map's
    input; wrapping at 2**64): a re-run of the map that sends a subpartition other rows,
    even as many, gives it another digest (the master's ``_check_rerun``). The indices are
    the sort's order, so this costs one hash over 8 bytes a row. ``content``: the
    table's ``content_digest`` where the partitioner assigns by position, else 0."""
    # NumPy's stable sort is a radix sort for integers of 16 bits or less: 6x faster than
    # the merge sort it uses on int64 (5 vs 36 ms for 640k rows), with the same order.
    small = np.uint8 if num_partitions <= 1 << 8 else np.uint16 \
        if num_partitions <= 1 << 16 else None
    keys = parts.astype(small, copy=False) if small is not None else parts
    order = np.argsort(keys, kind="stable")
    grouped = table.take(pa.array(order))
    counts = np.bincount(parts, minlength=num_partitions)
    out, offset = [], 0
    for sub, count in enumerate(counts):
        if count:
            out.append((sub, grouped.slice(offset, int(count))))
            if row_digests is not None:
                digest = xxhash.xxh3_64_intdigest(order[offset:offset + int(count)],
                                                  seed=(first_row ^ content) & _U64_MASK)
                row_digests[sub] = (row_digests[sub] + digest) & _U64_MASK
        offset += int(count)
    return out


_U64_MASK = (1 << 64) - 1


def content_digest(table: pa.Table) -> int:
    """XXH3 of ``table``'s rows as an Arrow IPC stream writes them: equal for equal rows
    in equal order and layout (a slice of a block rebuilt alike), different for other rows
    (the same rows laid out otherwise may differ too: a re-run then fails, never passes
    wrongly). For the row digests of partitioners that assign by position
    (``Partitioner.assigns_by_position``); it reads every byte once more (0.28-0.37 CPU-s
    per GiB here), so others skip it."""
    # An IPC stream, not each batch's serialize(): that leaves dictionaries out, so a
    # dictionary column whose values changed behind the same indices hashed alike.
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return xxhash.xxh3_64_intdigest(sink.getvalue())
