"""Segments: the unit of storage and of tier switching (FLIP-301).

A segment holds continuous records of one subpartition of one map partition, encoded as an
Arrow IPC stream (optionally lz4/zstd compressed) behind a 40-byte header (32 bytes
until format version 2; the identity digest takes 8 more, keeping the body 8-byte aligned).

Every segment is bound to its identity, (job, shuffle, map partition, attempt, subpartition,
index): a valid segment read in place of another one (files swapped or misplaced in a spill
dir or the remote store, an object of another job, a segment crafted with ``encode_segment``
for another identity) would otherwise be read without error, losing some rows and
duplicating or inventing others. Format version 3 binds it twice, at the cost of one tiny
hash per segment (the body is still hashed in one pass):

* ``identity digest``: XXH3-64 of the identity, encoded without ambiguity (ids are
  length-prefixed, see ``identity_digest``). The reader compares it with the digest of the
  segment it expects, so a wrong segment is reported as such ("holds the bytes of a
  different segment"), not as corrupt bytes.
* ``body checksum``: XXH3-64 of the body *seeded with the identity digest*. A header whose
  digest was rewritten without the body's checksum being recomputed for that identity
  still fails, and a bit flip in the body is reported as corrupt bytes.

Both are verified on every read, as are the body length, the row count of the header
against the reader's metadata (``SegmentMeta.num_rows``) and against the decoded table. So a
corrupt, truncated or misplaced segment is reported with its id and tier instead of
silently yielding wrong rows. This detects accidents and tampering by anyone who does not
know the identity a segment is stored under; it is not a keyed MAC: whoever can write the
storage and knows the identity can still encode a segment that passes (as with any unkeyed
checksum).

The job is part of ``SegmentId`` (``job_id``; the writer fills it from
``ShuffleConfig.job_id``), so the reader's expected identity, ``SegmentMeta.id`` as
committed by the writer, names the job too.
"""

from __future__ import annotations

import dataclasses
import numbers
import struct
import threading
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import xxhash

from hybrid_ray.config import Compression, TierName
from hybrid_ray.errors import ConfigError, CorruptSegmentError, InvalidIdError

# magic, format version, codec, reserved, identity digest, checksum of body (seeded with
# the identity digest), body length, number of rows: 40 bytes, a multiple of 8, so the IPC
# body (and its buffers) stays 8-byte aligned.
_HEADER = struct.Struct("<4sBBHQQQQ")
_MAGIC = b"HRSG"
# Version 2: XXH3-64 replaced zlib's CRC32. Every byte is checksummed twice (written, read)
# and zlib's CRC32 ran at ~2 GB/s: 10% of a shuffle's CPU in perf. XXH3 runs at memory
# speed (~14 GB/s here) and detects corruption as well for this purpose (zstd frames use
# the same family).
# Version 3: the segment is bound to its identity (see the module docstring).
_VERSION = 3
_checksum = xxhash.xxh3_64_intdigest
# Separates segment identity digests from any other use of XXH3 on the same strings.
_IDENTITY_DOMAIN = "hybrid_ray-segment-v3"
HEADER_BYTES = _HEADER.size
_CODECS = {Compression.NONE: 0, Compression.LZ4: 1, Compression.ZSTD: 2}
_IPC_COMPRESSION = {Compression.NONE: None, Compression.LZ4: "lz4", Compression.ZSTD: "zstd"}


@dataclasses.dataclass(frozen=True, order=True)
class SegmentId:
    """Identity of a segment: (shuffle, map partition, subpartition, index) of one attempt
    of one job.

    ``attempt`` names the producing attempt of the map partition, so segments of a crashed
    and retried map task can be told apart and only one attempt's segments are read.
    ``job_id`` is the writing shuffle's ``ShuffleConfig.job_id`` ("" for segments written
    outside a shuffle); the whole identity is bound into the segment's header.
    """

    shuffle_id: str
    map_partition: int
    subpartition: int
    index: int
    attempt: int = 0
    job_id: str = ""

    @property
    def file_name(self) -> str:
        """Name of this segment's file in the disk and remote tiers."""
        return f"m{self.map_partition:06d}-a{self.attempt:03d}-s{self.index:06d}.seg"

    @property
    def relative_path(self) -> str:
        """``sub-<subpartition>/<file_name>``: where the segment lives below its shuffle's
        directory in the disk and remote tiers. ``InvalidIdError`` for a number that is not
        an int >= 0: a negative subpartition made ``sub--0001``, a path every per-segment
        delete then refused (its file stayed until the shuffle's release)."""
        bad = self.bad_number()
        if bad is not None:
            raise InvalidIdError(f"segment {bad[0]} must be an int >= 0 to name a file, "
                                 f"got {bad[1]!r}")
        return f"sub-{self.subpartition:05d}/{self.file_name}"

    def bad_number(self) -> tuple[str, Any] | None:
        """(field, value) of the first of the map, attempt, subpartition and index that is
        not an int >= 0 (a bool is not one), or None when all are."""
        for name in ("map_partition", "attempt", "subpartition", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                return name, value
        return None

    def __str__(self) -> str:
        job = f"job={self.job_id}, " if self.job_id else ""
        return (f"segment({job}shuffle={self.shuffle_id}, map={self.map_partition}, "
                f"sub={self.subpartition}, index={self.index}, attempt={self.attempt})")

    def __reduce__(self) -> tuple[Any, tuple]:
        # Pickled as a tuple of its fields (see SegmentMeta.__reduce__).
        return SegmentId, (self.shuffle_id, self.map_partition, self.subpartition,
                           self.index, self.attempt, self.job_id)


def identity_digest(segment: SegmentId) -> int:
    """XXH3-64 of ``segment``'s identity (job, shuffle, map, attempt, subpartition, index).

    The string ids are length-prefixed, so no two identities share an encoding whatever
    characters the ids hold (``job="a/b", shuffle="c"`` differs from ``"a", "b/c"``).
    """
    if not isinstance(segment, SegmentId):
        raise TypeError(f"a segment's identity must be a SegmentId, got "
                        f"{type(segment).__name__} {segment!r}")
    # int() below took "x" with a bare "invalid literal for int()", and -1 as it is.
    bad = segment.bad_number()
    if bad is not None:
        raise ConfigError(f"{segment!s}: {bad[0]} must be an integer >= 0, got {bad[1]!r}")
    job, shuffle = str(segment.job_id), str(segment.shuffle_id)
    text = (f"{_IDENTITY_DOMAIN}/{len(job)}:{job}/{len(shuffle)}:{shuffle}/"
            f"{int(segment.map_partition)}/{int(segment.attempt)}/"
            f"{int(segment.subpartition)}/{int(segment.index)}")
    return _checksum(text.encode("utf-8", "surrogatepass"))


class PackSlot(NamedTuple):
    """Where a memory-tier segment sits in an object it shares with others of its batch.

    A writer puts the memory-tier segments of one batch (a map's flush: one per
    subpartition) as one object, a list of their payloads, instead of one object each: each
    object costs the node's object store a create and a seal round trip (0.7 ms of raylet
    CPU per object here, and the writer waits for both), whatever its size (see
    ``hybrid_ray.tiers.memory``). The object stays in the store until every member is freed,
    so a pack is known by its first member (``lead_subpartition``, ``lead_index``; the map
    and attempt are every member's) and counts ``members``: the node's tier manager gives the
    pack's bytes back once all of them were freed. ``position`` is this segment's place in
    the list; ``pack_bytes`` the payload bytes of all members (what a get of any member
    pins; 0 where unknown).
    """

    lead_subpartition: int
    lead_index: int
    members: int
    position: int
    pack_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class SegmentMeta:
    """Where a committed segment lives and how big it is.

    ``location`` is the file path (disk tier, on ``node_id``) or the full remote URL path
    (remote tier). For the memory tier ``object_ref`` is a one-element list holding the
    Ray ObjectRef: wrapping it keeps Ray from resolving it when the meta is passed around;
    ``pack`` says where the segment is in an object shared with others (None: the object
    is the segment's alone).
    """

    id: SegmentId
    tier: TierName
    nbytes: int
    num_rows: int
    node_id: str = ""
    location: str = ""
    object_ref: list[Any] | None = None
    pack: PackSlot | None = None
    # The tier manager instance that counted the segment's space (``Grant.granted_by``).
    granted_by: str = ""

    def __reduce__(self) -> tuple[Any, tuple]:
        # Segment metadata crosses processes in bulk (a map's commit, every poll answer, the
        # master's deletions: about 3 x 400 per GiB shuffled). A dataclass is pickled
        # through copyreg's generic path, with Ray's Python-level reducer called for it,
        # its SegmentId and its TierName: ~8 us each. As one flat tuple of builtins the
        # C pickler does nearly all of it (a third less CPU per list, measured).
        i = self.id
        return _segment_meta, (i.shuffle_id, i.map_partition, i.subpartition, i.index,
                               i.attempt, i.job_id, self.tier.value, self.nbytes,
                               self.num_rows, self.node_id, self.location, self.object_ref,
                               None if self.pack is None else tuple(self.pack),
                               self.granted_by)

    def without_object_ref(self) -> "SegmentMeta":
        """This meta without its ObjectRef, for a process that only needs to know what to
        free: a deserialized ref makes that process one of the object's borrowers, which
        its owner must then track and wait for."""
        # (An emptied list, as the registry leaves a freed segment's, carries no ref either:
        # no copy for it.)
        return self if not self.object_ref else dataclasses.replace(self, object_ref=None)


def _segment_meta(shuffle_id: str, map_partition: int, subpartition: int, index: int,
                  attempt: int, job_id: str, tier: str, nbytes: int, num_rows: int,
                  node_id: str, location: str, object_ref: list[Any] | None,
                  pack: tuple[int, ...] | None = None, granted_by: str = "") -> SegmentMeta:
    """Rebuild a ``SegmentMeta`` pickled by ``SegmentMeta.__reduce__``."""
    return SegmentMeta(SegmentId(shuffle_id, map_partition, subpartition, index, attempt,
                                 job_id), TierName(tier), nbytes, num_rows, node_id, location,
                       object_ref, None if pack is None else PackSlot(*pack), granted_by)


class ScratchArena:
    """Reusable memory that uncompressed segments are encoded into before a tier copies
    them out (to a file, the object store or the remote store).

    Why: encoding into a fresh, growing ``BufferOutputStream`` touches new pages for every
    segment, and a first touch costs more than the encoding itself (profiled: the IPC write
    into fresh buffers was 13% of a shuffle's CPU; into reused memory it is a plain copy).
    A view handed out by ``take`` is valid until the next ``reset``: the caller must be
    done with every payload of a batch before encoding the next batch.
    """

    def __init__(self, initial_bytes: int = 0) -> None:
        self._buffer = np.empty(initial_bytes, dtype=np.uint8)
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self._buffer)

    def reset(self) -> None:
        """Make all memory reusable (invalidates every view taken since the last reset)."""
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable view of ``nbytes`` bytes, not overlapping any taken since ``reset``."""
        if self._used + nbytes > len(self._buffer):
            # Views already taken keep the old buffer alive; the rest of this batch and all
            # later batches use the new one, sized so that this batch would have fitted.
            self._buffer = np.empty(max(2 * len(self._buffer), self._used + nbytes),
                                    dtype=np.uint8)
            self._used = 0
        view = self._buffer[self._used:self._used + nbytes]
        self._used += nbytes
        return view


_thread_arenas = threading.local()


def thread_scratch_arena() -> ScratchArena:
    """This thread's ``ScratchArena``, shared by every write client the thread runs (each
    finishes with its payloads before it encodes more, so they never overlap)."""
    arena = getattr(_thread_arenas, "arena", None)
    if arena is None:
        arena = _thread_arenas.arena = ScratchArena()
    return arena


def encode_segment(table: pa.Table, segment: SegmentId,
                   compression: Compression = Compression.LZ4,
                   arena: ScratchArena | None = None) -> memoryview:
    """Encode ``table`` as the segment ``segment``: header + Arrow IPC stream body (a
    bytes-like view).

    ``segment`` is the identity the segment will be stored and read under; it is bound into
    the header, and ``decode_segment`` refuses the bytes under any other identity.

    The header is reserved at the start of the output and filled in afterwards, so the body
    is never copied to put the two together. Uncompressed segments are written into
    ``arena`` when one is given (exact size measured first; the view lives until the
    arena's next reset); compressed ones, whose size is only known after compressing, into
    a buffer of their own.
    """
    if not isinstance(segment, SegmentId):
        raise TypeError(
            f"encode_segment(table, segment, compression, arena) needs the SegmentId the "
            f"segment will be stored under (it is bound into the segment and checked on "
            f"read), got {type(segment).__name__} {segment!r}")
    if not isinstance(table, pa.Table):  # an AttributeError ('... has no attribute schema')
        raise TypeError(f"encode_segment encodes a pyarrow.Table, got "
                        f"{type(table).__name__}: convert it first, e.g. "
                        "pa.Table.from_pandas(df)")
    digest = identity_digest(segment)
    try:
        compression = Compression(compression)
    except ValueError:
        raise ConfigError(f"encode_segment's compression must be one of "
                          f"{', '.join(c.value for c in Compression)}, got {compression!r}"
                          ) from None
    options = pa.ipc.IpcWriteOptions(compression=_IPC_COMPRESSION[compression])
    if arena is not None and compression == Compression.NONE:
        sizer = pa.MockOutputStream()
        with pa.ipc.new_stream(sizer, table.schema, options=options) as writer:
            writer.write_table(table)
        out = memoryview(arena.take(HEADER_BYTES + sizer.size()))
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(out[HEADER_BYTES:]))
        with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
    else:
        stream = pa.BufferOutputStream()
        stream.write(bytes(HEADER_BYTES))
        with pa.ipc.new_stream(stream, table.schema, options=options) as writer:
            writer.write_table(table)
        out = memoryview(stream.getvalue()).cast("B")  # mutable: header written in place
    body = out[HEADER_BYTES:]
    _HEADER.pack_into(out, 0, _MAGIC, _VERSION, _CODECS[compression], 0, digest,
                      _checksum(body, digest), len(body), table.num_rows)
    return out


def decode_segment(data: Any, segment: SegmentId, tier: TierName | str, *,
                   num_rows: int | None = None) -> pa.Table:
    """Decode segment bytes (any buffer-protocol object) read as ``segment`` from ``tier``,
    verifying the header, that the bytes are ``segment``'s (identity digest), the body's
    checksum and the row count (``num_rows``: what the segment's metadata says, if known).

    Raises ``CorruptSegmentError`` naming the segment and tier when the bytes are damaged
    or belong to another segment.
    """
    expected = identity_digest(segment)  # also refuses an identity that is no SegmentId
    view = memoryview(data).cast("B")
    where = f"{segment} in the {TierName.parse(tier).value} tier"
    if len(view) < HEADER_BYTES:
        raise CorruptSegmentError(f"{where} is truncated: {len(view)} bytes, no header")
    magic, version, _codec, _, digest, checksum, length, header_rows = \
        _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise CorruptSegmentError(f"{where} has no segment header (magic {magic!r})")
    if version != _VERSION:
        raise CorruptSegmentError(
            f"{where} has segment format version {version}, this hybrid_ray reads version "
            f"{_VERSION}: it was written by another hybrid_ray version; run the shuffle again")
    body = view[HEADER_BYTES:]
    if digest != expected:
        # Tell a whole segment of another identity from a damaged header: the former's body
        # verifies under its own digest. (An error path: the extra pass costs nothing.)
        if len(body) == length and _checksum(body, digest) == checksum:
            raise CorruptSegmentError(
                f"{where} holds the bytes of a different segment (swapped, misplaced, or "
                f"written for another identity, e.g. crafted with encode_segment): its "
                f"header's identity digest is {digest:#018x}, the expected segment's is "
                f"{expected:#018x}. The shuffle's storage was changed outside hybrid_ray; "
                "its output cannot be trusted: run the shuffle again")
        if len(body) == length and _checksum(body, expected) == checksum:
            raise CorruptSegmentError(
                f"{where} failed its checksum: the identity digest in its header is "
                "corrupt (its body verifies); run the shuffle again")
        raise CorruptSegmentError(
            f"{where} does not hold this segment: its header names another identity "
            f"(digest {digest:#018x}, expected {expected:#018x}) and its body does not "
            "verify under either: the stored bytes belong to a different segment (e.g. a "
            "swapped file of another size) or are corrupt; run the shuffle again")
    if len(body) != length:
        raise CorruptSegmentError(
            f"{where} is truncated: body has {len(body)} bytes, header says {length}")
    if _checksum(body, expected) != checksum:
        raise CorruptSegmentError(f"{where} failed its checksum: the stored bytes are corrupt")
    if num_rows is not None and header_rows != num_rows:
        raise CorruptSegmentError(
            f"{where} has {header_rows} rows, its metadata says {num_rows}: the stored "
            "bytes do not match what the writer committed; run the shuffle again")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except pa.ArrowException as exc:
        raise CorruptSegmentError(f"{where} cannot be decoded: {exc}") from exc
    if table.num_rows != header_rows:
        raise CorruptSegmentError(
            f"{where} decoded {table.num_rows} rows, header says {header_rows}")
    return table


def segment_num_rows(data: Any) -> int:
    """Rows in an encoded segment, read from its header without decoding."""
    return _HEADER.unpack_from(memoryview(data).cast("B"))[7]
