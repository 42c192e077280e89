import numpy as np
import pyarrow as pa
import pytest

from hybrid_ray import CorruptSegmentError, SegmentId, TierName, decode_segment, encode_segment


def _table(n=1000):
    return pa.table({"k": pa.array(range(n), pa.int64()),
                     "v": pa.array([f"row-{i}" for i in range(n)])})


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_roundtrip_exact(compression):
    t = _table()
    data = encode_segment(t, SegmentId("s", 0, 0, 0), compression)
    assert decode_segment(data, SegmentId("s", 0, 0, 0), "disk").equals(t)


def test_compression_shrinks_repetitive_data():
    t = pa.table({"x": pa.array([7] * 100_000, pa.int64())})
    sid = SegmentId("s", 0, 0, 0)
    assert len(encode_segment(t, sid, "zstd")) < len(encode_segment(t, sid, "none")) / 10


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "version"])
def test_corruption_is_detected_and_names_segment_and_tier(damage):
    sid = SegmentId("shf", 3, 5, 7, attempt=1)
    data = bytearray(encode_segment(_table(), sid, "lz4"))
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "header":
        data[0:4] = b"XXXX"
    else:
        data[4] = 1  # a segment of the CRC32 format (version 1)
    with pytest.raises(CorruptSegmentError) as info:
        decode_segment(bytes(data), sid, "remote")
    msg = str(info.value)
    assert "map=3" in msg and "sub=5" in msg and "index=7" in msg and "remote tier" in msg
    if damage == "version":
        assert "format version 1" in msg and "run the shuffle again" in msg


def test_segment_body_is_8_byte_aligned_after_the_header():
    # Arrow reads buffers in place; an unaligned body would make every column unaligned.
    data = encode_segment(_table(), SegmentId("s", 0, 0, 0), "none")
    from hybrid_ray.segment import HEADER_BYTES
    assert HEADER_BYTES % 8 == 0 and len(data) > HEADER_BYTES


def test_scratch_arena_segments_of_a_batch_never_overlap_even_across_growth():
    from hybrid_ray.segment import ScratchArena

    arena = ScratchArena(initial_bytes=1024)  # far too small: forces growth mid-batch
    tables = [_table(300 + 50 * i) for i in range(6)]
    payloads = [encode_segment(t, SegmentId("s", 0, 0, i), "none", arena)
                for i, t in enumerate(tables)]
    # Every payload of the batch is still intact after the later ones were written.
    for i, (t, data) in enumerate(zip(tables, payloads)):
        assert decode_segment(data, SegmentId("s", 0, 0, i), "memory").equals(t)
        # same bytes as unpooled
        assert bytes(data) == bytes(encode_segment(t, SegmentId("s", 0, 0, i), "none"))
    grown = arena.capacity
    arena.reset()
    again = encode_segment(tables[0], SegmentId("s", 0, 0, 0), "none", arena)
    assert arena.capacity == grown  # memory reused, not reallocated
    assert decode_segment(again, SegmentId("s", 0, 0, 0), "memory").equals(tables[0])


def test_compressed_segments_do_not_use_the_arena():
    from hybrid_ray.segment import ScratchArena

    arena = ScratchArena()
    t = _table()
    data = encode_segment(t, SegmentId("s", 0, 0, 0), "lz4", arena)
    assert arena.capacity == 0
    assert decode_segment(data, SegmentId("s", 0, 0, 0), "disk").equals(t)


def test_segment_meta_pickles_as_flat_fields_and_round_trips():
    """Segment metadata crosses processes by the hundred per shuffle: it pickles as one
    tuple of builtins (no copyreg state dicts, no per-field reducers) and comes back equal,
    tier and ref included."""
    import pickle

    from hybrid_ray.segment import SegmentId, SegmentMeta, _segment_meta

    for tier, ref in ((TierName.MEMORY, ["a ref stands here"]), (TierName.DISK, None),
                      (TierName.REMOTE, None)):
        meta = SegmentMeta(SegmentId("shf-00000000flat", 3, 5, 7, 2, "job-1"), tier, 4096,
                           100, node_id="node-a", location="/spill/x.seg", object_ref=ref,
                           granted_by="3f2a9c0d11e4b7a8")
        rebuild, fields = meta.__reduce__()
        assert rebuild is _segment_meta
        assert all(isinstance(f, (str, int, list, type(None))) for f in fields)
        assert pickle.loads(pickle.dumps(meta)) == meta
        # The tier manager that counted it travels too (TierManager.free_segments).
        assert pickle.loads(pickle.dumps(meta)).granted_by == "3f2a9c0d11e4b7a8"
        assert meta.without_object_ref().granted_by == "3f2a9c0d11e4b7a8"
        assert pickle.loads(pickle.dumps(meta.id)) == meta.id
        assert meta.without_object_ref().object_ref is None
        assert meta.without_object_ref().id == meta.id


def test_encode_segment_names_a_bad_table_compression_or_identity():
    """encode_segment is public: a DataFrame failed with "'DataFrame' object has no
    attribute 'schema'", a SegmentId field "x" with a bare "invalid literal for int()",
    and a negative map index was bound into the segment as it was."""
    from hybrid_ray import ConfigError

    table = pa.table({"a": [1, 2]})
    sid = SegmentId("shf-1", 0, 0, 0)
    with pytest.raises(TypeError, match="encodes a pyarrow.Table, got DataFrame"):
        encode_segment(table.to_pandas(), sid)
    with pytest.raises(ConfigError, match="compression must be one of none, lz4, zstd"):
        encode_segment(table, sid, "gzip")
    for bad, name in [(SegmentId("shf-1", -1, 0, 0), "map_partition"),
                      (SegmentId("shf-1", 0, "x", 0), "subpartition")]:
        with pytest.raises(ConfigError, match=f"{name} must be an integer >= 0"):
            encode_segment(table, bad)
    ok = SegmentId("shf-1", np.int64(3), 1, 2)
    assert decode_segment(encode_segment(table, ok), ok, TierName.DISK).equals(table)
