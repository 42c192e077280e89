"""A segment is bound to its identity (job, shuffle, map, attempt, subpartition, index).

A valid segment read in place of another one (files swapped or misplaced in a tier, a
segment crafted with ``encode_segment`` for another identity) used to be read without
error: rows were lost, duplicated or invented. Every read path must refuse it with a
``CorruptSegmentError`` naming the segment it expected and the tier.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import uuid

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
import hybrid_ray.shuffle
from conftest import base_config
from hybrid_ray import (
    CorruptSegmentError, MiB, ReadClient, SegmentId, ShuffleConfig, ShuffleFailedError,
    TierManager, TierName, WriteClient, build_io_tiers, decode_segment, encode_segment,
)
from hybrid_ray.tiers import MemoryTier
from hybrid_ray.tiers.disk import shuffle_dir

MAPS, SUBS = 3, 2


def rows(ids: np.ndarray) -> pa.Table:
    """Rows whose every value is a function of the row's id (so a wrong row is visible)."""
    return pa.table({"id": ids, "v": ids * 7 + 3})


def _table(n: int = 1000, start: int = 0) -> pa.Table:
    return rows(np.arange(start, start + n, dtype=np.int64))


# ---- decode_segment ------------------------------------------------------------------------


SID = SegmentId("shf", 3, 5, 7, attempt=1, job_id="job-a")


@pytest.mark.parametrize("other", [
    dataclasses.replace(SID, job_id="job-b"),
    dataclasses.replace(SID, shuffle_id="shg"),
    dataclasses.replace(SID, map_partition=4),
    dataclasses.replace(SID, attempt=2),
    dataclasses.replace(SID, subpartition=6),
    dataclasses.replace(SID, index=8),
], ids=["job", "shuffle", "map", "attempt", "subpartition", "index"])
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_segment_read_as_another_identity_is_refused(other, compression):
    data = encode_segment(_table(), other, compression)
    assert decode_segment(data, other, "disk").equals(_table())
    with pytest.raises(CorruptSegmentError) as info:
        decode_segment(data, SID, "disk")
    msg = str(info.value)
    assert str(SID) in msg and "disk tier" in msg
    assert "different segment" in msg and "swapped" in msg and "run the shuffle again" in msg


def test_ids_are_bound_without_ambiguity():
    # "a/b" + "c" and "a" + "b/c" must not share an identity digest.
    data = encode_segment(_table(), SegmentId("b/c", 0, 0, 0, job_id="a"))
    with pytest.raises(CorruptSegmentError, match="different segment"):
        decode_segment(data, SegmentId("c", 0, 0, 0, job_id="a/b"), "remote")


def test_encode_segment_requires_the_identity():
    with pytest.raises(TypeError, match="needs the SegmentId"):
        encode_segment(_table(), "lz4")
    with pytest.raises(TypeError, match="must be a SegmentId"):
        decode_segment(encode_segment(_table(), SID), "shf", "disk")


def test_damaged_identity_digest_is_told_apart_from_another_segment():
    data = bytearray(encode_segment(_table(), SID, "lz4"))
    data[8] ^= 0x01  # first byte of the identity digest
    with pytest.raises(CorruptSegmentError) as info:
        decode_segment(bytes(data), SID, "memory")
    msg = str(info.value)
    assert str(SID) in msg and "memory tier" in msg and "identity digest in its header is corrupt" in msg
    assert "different segment" not in msg


def test_corrupt_body_is_reported_as_corrupt_not_as_another_segment():
    data = bytearray(encode_segment(_table(), SID, "lz4"))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(CorruptSegmentError) as info:
        decode_segment(bytes(data), SID, "disk")
    assert "failed its checksum: the stored bytes are corrupt" in str(info.value)
    assert "different segment" not in str(info.value)


def test_another_segment_cut_to_the_expected_size_is_refused():
    # A remote read asks for the expected segment's size: a swapped, longer object arrives
    # cut short, so its body cannot be verified under either identity.
    other = dataclasses.replace(SID, map_partition=0)
    data = encode_segment(_table(2000), other, "none")
    with pytest.raises(CorruptSegmentError) as info:
        decode_segment(data[:len(data) // 2], SID, "remote")
    msg = str(info.value)
    assert str(SID) in msg and "remote tier" in msg and "does not hold this segment" in msg
    assert "belong to a different segment" in msg


def test_row_count_is_checked_against_the_metadata():
    data = encode_segment(_table(1000), SID)
    assert decode_segment(data, SID, "disk", num_rows=1000).num_rows == 1000
    with pytest.raises(CorruptSegmentError, match="has 1000 rows, its metadata says 999"):
        decode_segment(data, SID, "disk", num_rows=999)


# ---- read client over real tiers -----------------------------------------------------------


def write_shuffle(tmp_path, **cfg) -> tuple[list, dict, TierManager, str, ShuffleConfig]:
    """A finished shuffle of MAPS maps x SUBS subpartitions, several segments each.

    Returns (metas, io tiers, tier manager, shuffle id, config); row ids are unique across
    the shuffle, subpartition = id % SUBS.
    """
    cfg.setdefault("memory_capacity_bytes", 0)
    cfg.setdefault("spill_dirs", [str(tmp_path / "spill")])
    config = ShuffleConfig(compression="none", job_id="job-ident",
                           segment_bytes={"memory": 64 * 1024, "disk": 64 * 1024,
                                          "remote": 64 * 1024}, **cfg)
    tm = TierManager("node-a", 0)
    shuffle = f"id-{uuid.uuid4().hex[:6]}"
    tm.register_shuffle(shuffle, config)
    io = build_io_tiers(config)
    metas = []
    for m in range(MAPS):
        client = WriteClient(shuffle, m, SUBS, config, tm, io, node_id="node-a")
        t = _table(40_000, start=m * 40_000)
        parts = np.asarray(t["id"]) % SUBS
        client.write_many((s, t.filter(pa.array(parts == s))) for s in range(SUBS))
        metas += client.close()
    assert all(m.id.job_id == "job-ident" for m in metas)
    per = {(m.id.map_partition, m.id.subpartition) for m in metas if m.id.index == 1}
    assert len(per) == MAPS * SUBS  # at least two segments per (map, subpartition)
    return metas, io, tm, shuffle, config


def _meta(metas, m, s, i):
    return next(x for x in metas if (x.id.map_partition, x.id.subpartition, x.id.index)
                == (m, s, i))


def _swap(a: str, b: str) -> None:
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)


def _expected_sub(s: int) -> list[int]:
    return [i for i in range(MAPS * 40_000) if i % SUBS == s]


SWAPS = {
    "same subpartition, other map": ((0, 0, 0), (1, 0, 0)),
    "other subpartition, same map": ((0, 0, 0), (0, 1, 0)),
    "same map and subpartition, other index": ((1, 1, 0), (1, 1, 1)),
}


@pytest.mark.parametrize("path", ["local file", "fetched from its node"])
@pytest.mark.parametrize("swap", list(SWAPS))
def test_swapped_disk_segments_of_a_finished_shuffle_are_refused(tmp_path, swap, path):
    metas, io, tm, shuffle, _ = write_shuffle(tmp_path)
    assert {m.tier for m in metas} == {TierName.DISK}
    if path == "local file":  # memory-mapped by the reader
        reader = ReadClient(io, "node-a")
    else:  # a reader on another node: the owning node's tier manager serves the bytes
        reader = ReadClient(io, "node-b", fetch_from_node=tm.read_disk_segment)
    for s in range(SUBS):  # intact, every row exactly once
        got = pa.concat_tables(reader.read_segments([m for m in metas if m.id.subpartition == s]))
        assert sorted(got["id"].to_pylist()) == _expected_sub(s)
    a, b = (_meta(metas, *key) for key in SWAPS[swap])
    _swap(a.location, b.location)
    for victim in (a, b):
        sub = [m for m in metas if m.id.subpartition == victim.id.subpartition]
        with pytest.raises(CorruptSegmentError) as info:
            list(reader.read_segments(sub))
        msg = str(info.value)
        first = min((a, b) if a.id.subpartition == b.id.subpartition else (victim,),
                    key=lambda m: m.id)  # segments are read in id order
        assert str(first.id) in msg and "job=job-ident" in msg
        assert "disk tier" in msg and "different segment" in msg
    tm.release_shuffle(shuffle)


def test_segment_crafted_for_another_identity_is_refused(tmp_path):
    metas, io, tm, shuffle, _ = write_shuffle(tmp_path)
    victim = _meta(metas, 2, 1, 0)
    invented = rows(np.full(victim.num_rows, -1, dtype=np.int64))
    # Crafted with the public encoder, for every identity but the victim's own.
    for other in (dataclasses.replace(victim.id, job_id=""),
                  dataclasses.replace(victim.id, attempt=victim.id.attempt + 1),
                  SegmentId(shuffle, 9, 1, 0, job_id="job-ident")):
        with open(victim.location, "wb") as f:
            f.write(encode_segment(invented, other, "none"))
        with pytest.raises(CorruptSegmentError) as info:
            ReadClient(io).read(victim)
        assert str(victim.id) in str(info.value) and "different segment" in str(info.value)
    tm.release_shuffle(shuffle)


def test_swapped_remote_segments_are_refused(tmp_path):
    metas, io, tm, shuffle, _ = write_shuffle(
        tmp_path, disk_capacity_bytes=0, remote_path=f"file://{tmp_path}/remote")
    assert {m.tier for m in metas} == {TierName.REMOTE}
    reader = ReadClient(io)
    got = pa.concat_tables(reader.read_segments([m for m in metas if m.id.subpartition == 0]))
    assert sorted(got["id"].to_pylist()) == _expected_sub(0)
    a, b = _meta(metas, 0, 0, 0), _meta(metas, 2, 0, 0)
    _swap(a.location, b.location)
    with pytest.raises(CorruptSegmentError) as info:  # read ahead in the background
        list(reader.read_segments([m for m in metas if m.id.subpartition == 0]))
    msg = str(info.value)
    assert str(a.id) in msg and "remote tier" in msg and "different segment" in msg
    with pytest.raises(CorruptSegmentError, match="different segment"):
        reader.read(b)  # read on its own
    tm.release_shuffle(shuffle)
    io[TierName.REMOTE].remove_shuffle_data(shuffle)


def test_swapped_memory_segments_are_refused(ray_local):
    tier = MemoryTier(MiB, budget_bytes=64 * MiB)
    shuffle = f"mem-{uuid.uuid4().hex[:6]}"
    sids = [SegmentId(shuffle, m, 0, 0, job_id="j") for m in range(2)]
    metas = [tier.write(sid, encode_segment(_table(100, 100 * i), sid)) for i, sid in
             enumerate(sids)]
    reader = ReadClient({TierName.MEMORY: tier})
    assert reader.read(metas[0]).equals(_table(100, 0))
    swapped = dataclasses.replace(metas[0], object_ref=metas[1].object_ref)
    with pytest.raises(CorruptSegmentError) as info:
        reader.read(swapped)
    msg = str(info.value)
    assert str(sids[0]) in msg and "memory tier" in msg and "different segment" in msg
    tier.release_shuffle(shuffle)


# ---- a whole shuffle -----------------------------------------------------------------------


_real_reduce_partition = hybrid_ray.shuffle.reduce_partition


def swapping_reduce_partition(shuffle_id, subpartition, schema, partitioner, config, master):
    """``reduce_partition`` that first swaps the first segment files of maps 0 and 1 of
    subpartition 0 on disk: a blocking shuffle's maps have all finished when reducers start,
    so every file exists; the reducer of subpartition 0 then reads them."""
    if subpartition == 0:
        (spill,) = config.spill_dirs
        sub_dir = os.path.join(shuffle_dir(spill, shuffle_id), "sub-00000")
        (a,) = glob.glob(os.path.join(sub_dir, "m000000-a*-s000000.seg"))
        (b,) = glob.glob(os.path.join(sub_dir, "m000001-a*-s000000.seg"))
        _swap(a, b)
    return _real_reduce_partition(shuffle_id, subpartition, schema, partitioner, config,
                                  master)


def test_repartition_with_a_swapped_segment_fails_loudly(ray_local, tmp_path, monkeypatch):
    table = _table(200_000)
    ds = ray_local.data.from_arrow(table).repartition(4).materialize()
    cfg = base_config(tmp_path, mode="blocking", memory_capacity_bytes=0, compression="none")
    # The driver hands this function to the reducers (workers import this module).
    monkeypatch.setattr(hybrid_ray.shuffle, "reduce_partition", swapping_reduce_partition)
    with pytest.raises(ShuffleFailedError) as info:
        out = hybrid_ray.repartition(ds, 3, keys=["id"], config=cfg)
        out.materialize()
    msg = str(info.value)
    assert "CorruptSegmentError" in msg and "disk tier" in msg and "different segment" in msg
    assert "map=0, sub=0, index=0" in msg and f"job={cfg.job_id}" in msg
