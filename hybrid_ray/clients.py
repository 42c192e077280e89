"""Write client and read client (FLIP-301).

The write client cuts each subpartition's rows into segments, asks the node's tier manager
for the first tier (memory > disk) that can take each one, writes it there (or to the remote
tier when no local tier can), and hands the committed segment metadata to a committer (the
shuffle master on a cluster). The segment size follows the tier the subpartition is on, and
every new segment asks the higher tiers again, so writing switches back up when room frees.

Remote-tier segments are uploaded in the background (``ShuffleConfig.remote_transfers`` at
a time) while the writer goes on; a segment is committed only once its upload finished.

The read client reads segments in order from whichever tier holds each one, fetching
remote-tier segments ahead while it decodes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa

from hybrid_ray.config import Compression, ShuffleConfig, TierName, require_count
from hybrid_ray.errors import ConfigError, OutOfSpaceError, ShuffleStalledError
from hybrid_ray.ids import check_id
from hybrid_ray.segment import (
    ScratchArena, SegmentId, SegmentMeta, decode_segment, encode_segment,
    thread_scratch_arena,
)
from hybrid_ray.tier_manager import Placement
from hybrid_ray.tiers import Grant, Tier
from hybrid_ray.tiers.disk import map_segment_file
from hybrid_ray.tiers.memory import MemoryTier, pack_bytes_for, pack_members_for
from hybrid_ray.tiers.remote import RemoteTier

# Compression that does not pay is switched off for a while (Arrow's IPC writer would only
# drop the compressed buffer after paying for compressing it): a segment that shrank by less
# than MIN_COMPRESSION_SAVING makes the next COMPRESSION_BACKOFF_SEGMENTS segments go out
# uncompressed, then compression is tried again. On incompressible data (random keys and
# payloads, already-compressed blobs) lz4 costs more CPU than the whole rest of the map side.
MIN_COMPRESSION_SAVING = 0.10
COMPRESSION_BACKOFF_SEGMENTS = 32


class NodeStorage(Protocol):
    """What a write client needs from its node: a ``TierManager`` or a proxy to its actor.
    A proxy whose calls can go unanswered may also offer ``cancel_unanswered_reserve()``
    (``actors.ActorNodeStorage``), which an aborting client calls."""

    def reserve(self, shuffle_id: str, sizes: Sequence[int],
                settled: Sequence[tuple[Grant, int | None]] = ()) -> list[Placement]: ...

    def settle(self, shuffle_id: str, settled: Sequence[tuple[Grant, int | None]]) -> None: ...

    def free_segments(self, shuffle_id: str, metas: Sequence[SegmentMeta]) -> None: ...


@dataclasses.dataclass
class WriteStats:
    """What one write client did: bytes/segments per tier, tier switches, spills."""

    bytes_per_tier: dict[str, int] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(int))
    segments_per_tier: dict[str, int] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(int))
    rows: int = 0
    tier_switches: int = 0
    # A spill event: a segment went to a lower tier than the highest this shuffle enables.
    spill_events: int = 0
    # Segments written uncompressed because compression was not paying (see
    # MIN_COMPRESSION_SAVING); 0 when compression is off or always paid.
    uncompressed_segments: int = 0
    # Seconds the writer spent in bookkeeping calls to the master and its node's tier
    # manager (see report.PhaseTimes.control_plane); 0 where nobody measured them.
    control_plane_s: float = 0.0

    def merge(self, other: "WriteStats") -> None:
        for k, v in other.bytes_per_tier.items():
            self.bytes_per_tier[k] += v
        for k, v in other.segments_per_tier.items():
            self.segments_per_tier[k] += v
        self.rows += other.rows
        self.tier_switches += other.tier_switches
        self.spill_events += other.spill_events
        self.uncompressed_segments += other.uncompressed_segments
        self.control_plane_s += other.control_plane_s


def _count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (NumPy integers taken), else a ConfigError: the
    config's own check (``require_count``), naming WriteClient."""
    return require_count(f"WriteClient's {name}", value, minimum)


class WriteClient:
    """Writes one map partition's subpartitions as segments through the tiers.

    Args:
        shuffle_id, map_partition, num_subpartitions, attempt: identity of the producer.
        config: the shuffle's configuration (segment sizes, compression, enabled tiers).
        storage: the node's tier manager (or its actor proxy) that grants space.
        io_tiers: tier objects for I/O in this process (``build_io_tiers``).
        node_id: recorded in each segment's metadata, so readers know where it lives.
        on_commit: called with each batch of finished segments (e.g. the master's commit).
    """

    def __init__(self, shuffle_id: str, map_partition: int, num_subpartitions: int,
                 config: ShuffleConfig, storage: NodeStorage, io_tiers: dict[TierName, Tier],
                 *, attempt: int = 0, node_id: str = "",
                 on_commit: Callable[[list[SegmentMeta]], None] | None = None) -> None:
        # Checked here: a dict config, a float or str count failed with a bare
        # AttributeError or TypeError, and a negative map index was taken.
        if not isinstance(config, ShuffleConfig):
            raise ConfigError(f"WriteClient's config must be a hybrid_ray.ShuffleConfig, got "
                              f"{type(config).__name__}: build one with ShuffleConfig(...)")
        num_subpartitions = _count("num_subpartitions", num_subpartitions, 1)
        map_partition = _count("map_partition", map_partition, 0)
        attempt = _count("attempt", attempt, 0)
        self.shuffle_id = check_id("shuffle_id", shuffle_id)  # it names directories
        self.map_partition = map_partition
        self.num_subpartitions = num_subpartitions
        self.attempt = attempt
        self.config = config
        self.storage = storage
        self.io_tiers = io_tiers
        self.node_id = node_id
        self.on_commit = on_commit
        self.stats = WriteStats()
        self._top_tier = config.enabled_tiers[0]
        self._buffers: list[list[pa.Table]] = [[] for _ in range(num_subpartitions)]
        self._buffered_bytes = [0] * num_subpartitions
        self._current_tier = [self._top_tier] * num_subpartitions
        # The tier whose segment size the next cut of each subpartition uses: where its
        # last segment landed, or a faster tier the tier manager says has room for a
        # segment of its size (``Placement.faster``: how writing switches back up).
        self._size_tier = [self._top_tier] * num_subpartitions
        self._next_index = [0] * num_subpartitions
        self._unsettled: list[tuple[Grant, int | None]] = []
        # Full segments kept for close (``write_many(place=False)``), not written yet.
        self._held: list[tuple[int, pa.Table]] = []
        self._compression = Compression(config.compression)
        self._skip_compression = 0  # segments left to write uncompressed
        self._uncommitted: list[SegmentMeta] = []
        self.written: list[SegmentMeta] = []
        # Remote uploads still running, oldest first; their segments are counted in the
        # stats already but committed only once the upload finished.
        self._uploads: collections.deque[concurrent.futures.Future[SegmentMeta]] = \
            collections.deque()
        # Whether this client sent anything to the remote tier (see ``abort``).
        self._wrote_remote = False
        self._closed = False

    # ---- public API ----------------------------------------------------------------------------
    def write(self, subpartition: int, data: pa.Table | pa.RecordBatch) -> None:
        """Append rows to a subpartition; full segments are written out as they fill."""
        self.write_many([(subpartition, data)])

    def write_many(self, parts: Iterable[tuple[int, pa.Table | pa.RecordBatch]],
                   place: bool = True) -> None:
        """Append to several subpartitions, placing all segments that filled in one round
        trip. ``place=False``: keep the full segments to place with the tails at ``close``
        (the writer's last rows: one reservation for both)."""
        self._check_open()
        ready = []
        for subpartition, data in parts:
            if isinstance(subpartition, bool) or not isinstance(subpartition, numbers.Integral) \
                    or not 0 <= subpartition < self.num_subpartitions:
                raise ValueError(f"subpartition must be in [0, {self.num_subpartitions}), "
                                 f"got {subpartition!r}")
            table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
            if not isinstance(table, pa.Table):
                raise ConfigError(f"WriteClient writes pyarrow Tables or RecordBatches, got a "
                                  f"{type(data).__name__} for subpartition {subpartition}: "
                                  "convert it first, e.g. pa.Table.from_pandas(df)")
            if table.num_rows == 0:
                continue
            buffered = self._buffers[subpartition]
            if buffered and not table.schema.equals(buffered[0].schema, check_metadata=False):
                # Found when the segment was cut, as Arrow's bare "Schema at index 1 was
                # different", after the writes before it.
                raise ConfigError(f"subpartition {subpartition} of map {self.map_partition} "
                                  f"got rows of another schema ({table.schema}) than its "
                                  f"earlier rows ({buffered[0].schema}): cast every table "
                                  "to one schema first (table.cast(schema))")
            self._buffers[subpartition].append(table)
            self._buffered_bytes[subpartition] += table.nbytes
            if self._buffered_bytes[subpartition] >= self._segment_bytes(subpartition):
                ready.extend(self._cut(subpartition, final=False))
        if place:
            self._place(ready)
        else:
            self._held.extend(ready)

    def flush(self, wait_uploads: bool = False) -> list[SegmentMeta]:
        """Commit the segments written so far (they become visible to readers). Remote
        uploads still running are committed by a later flush or by ``close``, unless
        ``wait_uploads``."""
        self._collect_uploads(keep_in_flight=0, wait=wait_uploads)
        committed, self._uncommitted = self._uncommitted, []
        if committed and self.on_commit is not None:
            self.on_commit(committed)
        return committed

    def close(self, settle: bool = True) -> list[SegmentMeta]:
        """Write the partial tail segments, settle space, commit; returns all segments.
        ``settle=False``: leave the last settlements to ``start_settling``, which sends
        them without waiting (a map sends them beside its ``finish_map``)."""
        self._check_open()
        tails, self._held = self._held, []
        for sub in range(self.num_subpartitions):
            tails.extend(self._cut(sub, final=True))
        self._place(tails)
        if settle:
            self._settle_changes()
        self.flush(wait_uploads=True)
        self._closed = True
        return list(self.written)

    def settle_pending(self) -> None:
        """Send the settlements not sent yet and wait for the answer (raises its error;
        the tracked ones are then kept for another try)."""
        self._settle_changes()

    def start_settling(self) -> Callable[[], BaseException | None]:
        """Send the settlements not sent yet without waiting for the answer, where the
        storage can (``start_settle``; otherwise they are settled now). Returns the wait
        for the answer: it gives the call's error instead of raising it, and keeps the
        settlements that may be sent again (``_keep_for_resending``) for a later
        ``_settle_changes`` or ``abort``. Each round trip a map waits for at its end left
        its core idle: profiled, 5 ms for the settle and 5 for ``finish_map``."""
        changed = self._take_settles()
        if not changed:
            return lambda: None
        start = getattr(self.storage, "start_settle", None)
        if start is None:  # an in-process TierManager: settled now, its error handed over
            self._unsettled.extend(changed)
            try:
                self._settle_changes()
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as below
                return lambda: exc
            return lambda: None
        try:
            wait = start(self.shuffle_id, changed)
        except Exception as exc:  # noqa: BLE001 - not sent: kept, as if it had failed
            self._keep_for_resending(changed)
            return lambda: exc

        def settled() -> BaseException | None:
            try:
                wait()
            except Exception as exc:  # noqa: BLE001 - the caller decides what it means
                self._keep_for_resending(changed)
                return exc
            return None
        return settled

    def abort(self, shuffle_released: bool = False) -> None:
        """Delete everything this client wrote and give its space back (failed producer).

        ``shuffle_released``: the shuffle is gone (its master or tier manager said so). Its
        release removed the shuffle's remote directory, and an upload of this client that
        landed after that removal re-created the directory's marker, which is not a
        segment and stayed (cleanup then finds a marked directory of a shuffle nobody
        will release again). The whole remote directory of the shuffle goes too: nothing
        in it is needed any more, and each late writer removes it after its own uploads."""
        # Let running uploads end first: an object landing after the delete below would
        # outlive the attempt. (Uploads not started yet are cancelled.)
        for upload in self._uploads:
            upload.cancel()
        if self._uploads:
            # One bound for all of them: waited for one after another, each with its own,
            # four hung uploads held an abort four times as long.
            remote = self.io_tiers[TierName.REMOTE]
            deadline = time.monotonic() + remote.result_bound_s(self._upload_bytes_bound())
        for upload in self._uploads:
            try:
                self.written.append(remote.outcome(upload, "an upload being aborted",
                                                   bound_s=deadline - time.monotonic()))
            except Exception:  # failed, cancelled or hung: nothing it wrote is known
                pass
        self._uploads.clear()
        self._held = []
        # The deletions run whatever the settle does: a settle call that failed (the tier
        # manager busy or restarting) skipped them, and the files and their bytes stayed
        # until the shuffle's release. The first error is raised once all was tried.
        errors: list[BaseException] = []
        # A reservation whose answer never came may have granted space this client never
        # saw (so never settles): a proxy to a tier-manager actor can take it back.
        cancel = getattr(self.storage, "cancel_unanswered_reserve", None)
        if cancel is not None:
            try:
                cancel()
            except Exception as exc:  # noqa: BLE001 - raised below, after the deletions
                errors.append(exc)
        settle_error: BaseException | None = None
        try:
            self._settle_changes()
        except Exception as exc:  # noqa: BLE001 - raised below, after the deletions
            settle_error = exc
        local = [m for m in self.written if m.tier != TierName.REMOTE]
        try:
            if local:
                self.storage.free_segments(self.shuffle_id, local)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        errors += self._remove_remote([m for m in self.written if m.tier == TierName.REMOTE],
                                      shuffle_released and self._wrote_remote)
        if settle_error is not None:
            # Once more, after the deletions gave the tier manager time: the settlements
            # kept for resending (tracked grants, counted once however often they come)
            # were dropped with this client, and a disk grant stayed in flight on the
            # node until the shuffle's release, refusing other shuffles room (found by a
            # review).
            try:
                self._settle_changes()
            except Exception:  # noqa: BLE001 - the first error is the one raised
                errors.insert(0, settle_error)
        self.written, self._uncommitted = [], []
        self._closed = True
        if errors:
            raise errors[0]

    # ---- internals -----------------------------------------------------------------------------
    def _remove_remote(self, metas: list[SegmentMeta], whole_shuffle: bool
                       ) -> list[BaseException]:
        """Delete an aborted attempt's remote segments (then, with ``whole_shuffle``, the
        shuffle's remote directory), all on the tier's transfer threads within one bound:
        called inline, a sync filesystem (NFS through ``file://``) that hung held the
        abort, and the failed map with it, forever. Returns the errors."""
        if not metas and not whole_shuffle:
            return []
        remote = self.io_tiers[TierName.REMOTE]
        deadline = time.monotonic() + remote.result_bound_s()
        pool = remote.io_pool()
        errors: list[BaseException] = []
        deletions = [(meta, pool.submit(remote.delete, meta)) for meta in metas]
        for meta, future in deletions:
            try:
                remote.outcome(future, f"deleting {meta.id}",
                               bound_s=deadline - time.monotonic())
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if whole_shuffle:
            try:
                remote.outcome(pool.submit(remote.remove_shuffle_data, self.shuffle_id),
                               f"removing shuffle {self.shuffle_id}",
                               bound_s=deadline - time.monotonic())
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        return errors

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"write client of map {self.map_partition} is closed")

    def _take_settles(self) -> list[tuple[Grant, int | None]]:
        """The grants not settled yet whose settling changes the tier manager's books
        (``Tier.settle_changes_books``); all are taken off ``_unsettled``. A map whose
        segments all went to the memory tier in full has none: no call."""
        changed = [(g, w) for g, w in self._unsettled
                   if self.io_tiers[g.tier].settle_changes_books(g, w)]
        self._unsettled = []
        return changed

    def _reserve(self, sizes: list[int]) -> list[Placement]:
        """Reserve room for segments of ``sizes``, settling what became of earlier grants
        in the same call. A call that fails keeps those settlements for the next call or
        the abort: dropped, they stayed counted (disk space in flight) until the shuffle's
        release. Whether the failed call ran is not known; settling twice changes the books
        once (``Grant.grant_id``), so only tracked grants are kept (``_keep_for_resending``)."""
        settles = self._take_settles()
        try:
            return self.storage.reserve(self.shuffle_id, sizes, settles)
        except BaseException:
            self._keep_for_resending(settles)
            raise

    def _settle_changes(self) -> None:
        """Tell the tier manager what became of the grants not settled yet, if anything."""
        changed = self._take_settles()
        if changed:
            try:
                self.storage.settle(self.shuffle_id, changed)
            except BaseException:
                self._keep_for_resending(changed)  # see _reserve
                raise

    def _keep_for_resending(self, settles: list[tuple[Grant, int | None]]) -> None:
        """After a call carrying ``settles`` failed, keep those that may safely be sent
        again: tracked grants only (``Grant.grant_id``), which the tier manager settles
        once however often they come. An untracked one (memory, remote) may have been
        applied by the failed call already; sent again it would lower the books twice,
        below what the shuffle holds, so it is dropped: its bytes stay counted until the
        shuffle's release, which errs on the safe side of the quota."""
        self._unsettled.extend((g, w) for g, w in settles if g.grant_id)

    def _upload_bytes_bound(self) -> int:
        """At most the bytes of one upload (a remote segment, cut at the remote tier's
        size; twice that covers the encoding's overshoot): sizes its wait."""
        return 2 * self.config.segment_bytes[TierName.REMOTE]

    def _segment_bytes(self, subpartition: int) -> int:
        return self.config.segment_bytes[self._size_tier[subpartition]]

    def _cut(self, sub: int, final: bool) -> list[tuple[int, pa.Table]]:
        """Take full segments (and, if ``final``, the tail) out of a subpartition's buffer."""
        if not self._buffers[sub]:
            return []
        table = pa.concat_tables(self._buffers[sub]) if len(self._buffers[sub]) > 1 \
            else self._buffers[sub][0]
        nbytes = self._buffered_bytes[sub]
        target = self._segment_bytes(sub)
        rows_per_segment = max(1, int(table.num_rows * target / max(nbytes, 1)))
        pieces = []
        offset = 0
        while table.num_rows - offset >= rows_per_segment:
            pieces.append((sub, table.slice(offset, rows_per_segment)))
            offset += rows_per_segment
        rest = table.slice(offset)
        if final and rest.num_rows:
            pieces.append((sub, rest))
            rest = rest.slice(0, 0)
        self._buffers[sub] = [rest] if rest.num_rows else []
        self._buffered_bytes[sub] = rest.nbytes if rest.num_rows else 0
        return pieces

    def _place(self, pieces: list[tuple[int, pa.Table]]) -> None:
        if not pieces:
            return
        # Every payload of the previous batch has been copied out by its tier: reuse the
        # memory (see ScratchArena). Tiers copy synchronously, so this batch is safe too.
        arena = thread_scratch_arena()
        arena.reset()
        # Each segment is encoded for its identity (bound into its header, see segment.py).
        sids = []
        for sub, _ in pieces:
            sids.append(SegmentId(self.shuffle_id, self.map_partition, sub,
                                  self._next_index[sub], self.attempt,
                                  job_id=self.config.job_id or ""))
            self._next_index[sub] += 1
        payloads = [self._encode(t, sid, arena) for (_, t), sid in zip(pieces, sids)]
        placements = self._reserve([len(p) for p in payloads])
        # Grants not yet settled: if a write raises, they are given back (with abort).
        granted = {i for i, p in enumerate(placements) if p.grant is not None}
        try:
            self._write_placed(pieces, payloads, placements, sids, granted)
        except BaseException:
            self._unsettled.extend((placements[i].grant, None) for i in sorted(granted))
            raise

    def _write_placed(self, pieces: list[tuple[int, pa.Table]], payloads: list[Any],
                      placements: list[Placement], sids: list[SegmentId],
                      granted: set[int]) -> None:
        """Write each piece where it was placed; ``granted`` loses each index whose grant
        went into ``_unsettled``."""
        # Memory-tier segments go to the node's object store in one round trip, packed
        # into shared objects where their readers are on this node (``pack_bytes_for``).
        metas: dict[int, SegmentMeta] = {}
        in_memory = [i for i, p in enumerate(placements)
                     if p.grant is not None and p.grant.tier == TierName.MEMORY]
        if in_memory:
            members = pack_members_for(self.num_subpartitions)
            pack_bytes = pack_bytes_for(self.config.memory_pack_bytes) \
                if len(in_memory) > 1 and members > 1 else 0
            written = self.io_tiers[TierName.MEMORY].write_many(
                [(sids[i], payloads[i]) for i in in_memory], self.node_id, pack_bytes,
                members, granted_by=placements[in_memory[0]].grant.granted_by)
            for i, meta in zip(in_memory, written):
                self._unsettled.append((placements[i].grant, len(payloads[i])))
                granted.discard(i)
                metas[i] = meta
                # Settled as written: abort must free it even if a piece placed before it
                # fails below (it was kept only when the loop reached it, and its space
                # stayed counted until the shuffle's release).
                self.written.append(meta)
        for i, ((sub, table), payload, placement) in enumerate(zip(pieces, payloads,
                                                                   placements)):
            if i in metas:  # in the memory tier, and in ``written`` already
                self._count(sub, TierName.MEMORY, metas[i].nbytes, table.num_rows)
                self._uncommitted.append(metas[i])  # committed in the batch's order
                continue
            granted.discard(i)  # _write_one settles the grant, whatever happens
            meta = self._write_one(sids[i], payload, placement)
            if isinstance(meta, concurrent.futures.Future):
                self._count(sub, TierName.REMOTE, len(payload), table.num_rows)
                self._uploads.append(meta)
                # Bound the payloads held for uploads: wait for the oldest.
                self._collect_uploads(keep_in_flight=self.config.remote_transfers, wait=True)
            else:
                self._count(sub, meta.tier, meta.nbytes, table.num_rows)
                self._keep(meta)
            if placement.faster is not None:
                self._size_tier[sub] = placement.faster

    def _encode(self, table: pa.Table, sid: SegmentId, arena: ScratchArena) -> memoryview:
        """Encode segment ``sid``, compressing only while compression pays (see
        ``MIN_COMPRESSION_SAVING``); uncompressed ones go into ``arena``."""
        if self._compression == Compression.NONE:
            return encode_segment(table, sid, Compression.NONE, arena)
        if self._skip_compression > 0:
            self._skip_compression -= 1
            self.stats.uncompressed_segments += 1
            return encode_segment(table, sid, Compression.NONE, arena)
        payload = encode_segment(table, sid, self._compression)
        if len(payload) > (1 - MIN_COMPRESSION_SAVING) * max(table.nbytes, 1):
            self._skip_compression = COMPRESSION_BACKOFF_SEGMENTS
        return payload

    def _collect_uploads(self, keep_in_flight: int, wait: bool) -> None:
        """Keep the segments of finished uploads (oldest first); with ``wait``, wait until
        at most ``keep_in_flight`` are running. A failed upload raises here."""
        while self._uploads and (self._uploads[0].done()
                                 or (wait and len(self._uploads) > keep_in_flight)):
            meta = self.io_tiers[TierName.REMOTE].outcome(
                self._uploads[0], f"an upload of map {self.map_partition}'s segment",
                self._upload_bytes_bound())
            self._uploads.popleft()
            self._keep(meta)

    def _write_one(self, sid: SegmentId, payload: bytes, placement: Placement
                   ) -> SegmentMeta | concurrent.futures.Future[SegmentMeta]:
        refusals = list(placement.refusals)
        if placement.grant is not None:
            grant = placement.grant
            # The grant is settled here whatever happens (see _place).
            try:
                meta = self.io_tiers[grant.tier].write(sid, payload, grant, self.node_id)
            except OutOfSpaceError as exc:  # the disk filled behind our back: fall through
                self._unsettled.append((grant, None))
                # Say how full it is now (free space, reserve), as a refusal at reservation
                # does: the write's own error names only the directory.
                now = self.io_tiers[grant.tier].describe_refusal(len(payload))
                refusals.append(f"{exc} ({now})")
            except BaseException:
                self._unsettled.append((grant, None))
                raise
            else:
                self._unsettled.append((grant, len(payload)))
                return meta
        remote = self.io_tiers.get(TierName.REMOTE)
        if remote is None:
            raise OutOfSpaceError(
                f"no tier can take {sid} ({len(payload)} bytes): " + "; ".join(refusals)
                + ". Configure a remote tier (ShuffleConfig(remote_path='s3://bucket/prefix')), "
                "add spill_dirs, or free disk space.")
        self._wrote_remote = True
        if isinstance(remote, RemoteTier):
            return remote.write_async(sid, payload, self.node_id)
        return remote.write(sid, payload, None, self.node_id)

    def _count(self, sub: int, tier: TierName, nbytes: int, rows: int) -> None:
        """Account a placed segment: stats, and the tier the subpartition is now on."""
        self._size_tier[sub] = tier
        if tier != self._current_tier[sub]:
            self.stats.tier_switches += 1
            self._current_tier[sub] = tier
        if tier != self._top_tier:
            self.stats.spill_events += 1
        self.stats.bytes_per_tier[tier.value] += nbytes
        self.stats.segments_per_tier[tier.value] += 1
        self.stats.rows += rows

    def _keep(self, meta: SegmentMeta) -> None:
        """A segment is complete in its tier: delete it on abort, commit it on flush."""
        self.written.append(meta)
        self._uncommitted.append(meta)


# A reader gets at most this many memory-tier segments, and this many bytes, with one
# ``ray.get`` (MemoryBatches): what a batch pins in the object store is what the reducer
# holds anyway until it concatenates its subpartition.
MEMORY_BATCH_SEGMENTS = 64
MEMORY_BATCH_BYTES = 256 << 20


class MemoryBatches:
    """The memory-tier segments of a ``read_in_order``, got from the object store a batch
    at a time (``MemoryTier.read_many``) instead of one ``ray.get`` each: every get is a
    request to the node's object store, and a reducer reads one segment per map.

    A batch that fails to be read is not an error by itself: its segments are then read
    one by one (``take`` says not found), so the segment that is gone raises when its
    turn comes with its own error and the ones before it still count. A batch that timed
    out (a node that stopped answering) raises ``ShuffleStalledError`` at its first
    segment's turn: the read fails either way, without waiting the bound again per
    segment."""

    def __init__(self, tier: Tier | None, metas: Sequence[SegmentMeta]) -> None:
        self._tier = tier if isinstance(tier, MemoryTier) else None
        self._metas = metas
        self._got: dict[int, Any] = {}
        self._batched_up_to = 0  # metas[:_batched_up_to] were considered for a batch
        self._stalled: ShuffleStalledError | None = None
        self._stalled_batch: set[int] = set()

    def take(self, index: int) -> tuple[bool, Any]:
        """(True, the data) of segment ``index`` if a batch got it, else (False, None)."""
        if self._tier is None or self._metas[index].tier != TierName.MEMORY:
            return False, None
        if index >= self._batched_up_to:
            self._get_batch(index)
        if self._stalled is not None and index in self._stalled_batch:
            raise self._stalled
        if index in self._got:
            return True, self._got.pop(index)
        return False, None

    def _get_batch(self, first: int) -> None:
        indices, nbytes = [], 0
        objects: set[Any] = set()  # refs in this batch already
        i = first
        while i < len(self._metas) and len(indices) < MEMORY_BATCH_SEGMENTS:
            meta = self._metas[i]
            if meta.tier == TierName.MEMORY:
                # What the get pins: a packed member's whole object (pulled whole from
                # another node), counted once. (Estimated from the member count only where
                # the pack's size is unknown: with skewed members that undercounted.)
                ref = meta.object_ref[0] if meta.object_ref else None
                pinned = 0 if ref is not None and ref in objects else \
                    pinned_bytes(meta)
                if indices and nbytes + pinned > MEMORY_BATCH_BYTES:
                    break
                indices.append(i)
                nbytes += pinned
                if ref is not None:
                    objects.add(ref)
            i += 1
        self._batched_up_to = i
        self._stalled, self._stalled_batch = None, set()
        try:
            values = self._tier.read_many([self._metas[j] for j in indices])
        except ShuffleStalledError as exc:
            self._stalled, self._stalled_batch = exc, set(indices)
            return
        except Exception:  # noqa: BLE001 - read one by one: each raises its own error
            return
        self._got.update(zip(indices, values))


def pinned_bytes(meta: SegmentMeta) -> int:
    """The bytes a get of memory-tier segment ``meta`` pins: its pack's, if it has one."""
    if meta.pack is None:
        return meta.nbytes
    return meta.pack.pack_bytes or meta.nbytes * meta.pack.members


def _require_metas(metas: Sequence[Any]) -> None:
    """TypeError naming what is not a ``SegmentMeta`` among ``metas`` (it failed with an
    AttributeError, "'str' object has no attribute 'tier'")."""
    wrong = next((m for m in metas if not isinstance(m, SegmentMeta)), None)
    if wrong is not None:
        raise TypeError(f"ReadClient reads SegmentMetas (what WriteClient.close and flush "
                        f"return), got a {type(wrong).__name__}")


class ReadClient:
    """Reads segments from whichever tier holds each, verifying every checksum and that
    each segment's bytes are the segment its metadata names (identity and row count): a
    swapped, misplaced or crafted segment raises ``CorruptSegmentError``, whatever path
    its bytes came by (memory, a disk file mapped or fetched from another node, remote).

    Args:
        io_tiers: tier objects for I/O in this process (``build_io_tiers``).
        node_id: this process's node; disk segments of other nodes go through
            ``fetch_from_node`` (the owning node's tier manager), local ones are read from file.
        start_node_fetch: optional; starts such a fetch and returns the call that waits
            for its bytes, so ``read_in_order`` reads other nodes' disk segments ahead
            (each fetch is a round trip through the owning node's tier manager and object
            store; one at a time, a reader on 2 simulated nodes spent a third of its time
            waiting for them). Without it they are fetched when their turn comes.
    """

    def __init__(self, io_tiers: dict[TierName, Tier], node_id: str = "",
                 fetch_from_node: Callable[[SegmentMeta], Any] | None = None,
                 start_node_fetch: Callable[[SegmentMeta], Callable[[], Any]] | None = None
                 ) -> None:
        # A ShuffleConfig given here (ReadClient(config)) failed at the first read with
        # "'ShuffleConfig' object has no attribute 'get'".
        if not isinstance(io_tiers, Mapping):
            raise ConfigError(f"ReadClient takes the tiers build_io_tiers(config) returns, "
                              f"got {type(io_tiers).__name__}: ReadClient(build_io_tiers("
                              "config))")
        self.io_tiers = io_tiers
        self.node_id = check_id("node_id", node_id) if node_id else node_id
        self.fetch_from_node = fetch_from_node
        self.start_node_fetch = start_node_fetch
        self.bytes_read: dict[str, int] = collections.defaultdict(int)

    def _on_other_node(self, meta: SegmentMeta) -> bool:
        return bool(meta.node_id) and meta.node_id != self.node_id

    def read_bytes(self, meta: SegmentMeta) -> Any:
        _require_metas([meta])
        if meta.tier == TierName.DISK:
            if self._on_other_node(meta) and self.fetch_from_node:
                return self.fetch_from_node(meta)
            return map_segment_file(meta)  # zero-copy: decoding reads the page cache
        tier = self.io_tiers.get(meta.tier)
        if tier is None:
            raise ValueError(f"{meta.id} is in the {meta.tier.value} tier, which this read "
                             "client was not configured with")
        if isinstance(tier, RemoteTier):
            # Bounded as a read-ahead is: a sync store's call (NFS through file://) has no
            # deadline of its own, and a hung server held this read forever.
            return tier.outcome(tier.read_async(meta), f"the read of {meta.id}", meta.nbytes)
        return tier.read(meta)

    def read(self, meta: SegmentMeta) -> pa.Table:
        """Read and decode one segment."""
        return self._decode(meta, self.read_bytes(meta))

    def _decode(self, meta: SegmentMeta, data: Any) -> pa.Table:
        self.bytes_read[meta.tier.value] += meta.nbytes
        return decode_segment(data, meta.id, meta.tier, num_rows=meta.num_rows)

    def read_segments(self, metas: Iterable[SegmentMeta]) -> Iterator[pa.Table]:
        """Decode segments in the order of their ids (map partition, subpartition, index)."""
        metas = list(metas)
        _require_metas(metas)
        yield from self.read_in_order(sorted(metas, key=lambda m: m.id))

    def read_in_order(self, metas: Sequence[SegmentMeta], ahead: int = 4
                      ) -> Iterator[pa.Table]:
        """Decode ``metas`` in the given order while the remote-tier segments and other
        nodes' disk segments among the next ``ahead`` are fetched in the background, and
        the memory-tier ones are got from the object store in batches (``MemoryBatches``).
        A segment that cannot be read raises when its turn comes, as ``read`` would;
        remote fetches not yet used are then cancelled."""
        _require_metas(metas)
        memory = MemoryBatches(self.io_tiers.get(TierName.MEMORY), metas)
        fetches: dict[int, tuple[Callable[[], Any], Callable[[], Any]]] = {}  # wait, cancel
        started = 0  # metas[:started] have been considered for a background fetch
        try:
            for i, meta in enumerate(metas):
                while ahead >= 1 and started < len(metas) and started < i + ahead:
                    fetch = self._start_fetch(metas[started])
                    if fetch is not None:
                        fetches[started] = fetch
                    started += 1
                fetch = fetches.pop(i, None)
                if fetch is None:
                    yield self._read_at(i, meta, memory)
                    continue
                wait, _ = fetch
                yield self._decode(meta, wait())
        finally:
            for _, cancel in fetches.values():
                cancel()

    def _start_fetch(self, meta: SegmentMeta
                     ) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
        """(the call that waits for the bytes, the call that abandons them) of a
        background fetch of ``meta``, or None if its tier is read when its turn comes."""
        remote = self.io_tiers.get(TierName.REMOTE)
        if meta.tier == TierName.REMOTE and isinstance(remote, RemoteTier):
            future = remote.read_async(meta)
            return (lambda: remote.outcome(future, f"the read of {meta.id}", meta.nbytes),
                    future.cancel)
        if (meta.tier == TierName.DISK and self.start_node_fetch is not None
                and self._on_other_node(meta)):
            # A fetch through the owning node's tier manager cannot be cancelled: one not
            # waited for is only its answer dropped.
            return self.start_node_fetch(meta), lambda: None
        return None

    def _read_at(self, index: int, meta: SegmentMeta, memory: MemoryBatches) -> pa.Table:
        """Segment ``index`` of a ``read_in_order``: from its memory batch if it has one."""
        found, data = memory.take(index)
        return self._decode(meta, data) if found else self.read(meta)
