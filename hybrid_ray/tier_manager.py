"""The tiers of one node: space decisions for every writer on the node (FLIP-31's
ShuffleEnvironment, FLIP-301's tier selection).

``TierManager`` is plain Python: the per-node Ray actor (``hybrid_ray.actors``) wraps it, and
local use (tests, single process) calls it directly. It owns the accounting of the memory
and disk tiers so that concurrent writers on the node never overshoot a budget together.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

from hybrid_ray.config import ShuffleConfig, TierName, require_bytes, require_config
from hybrid_ray.errors import (
    ConfigError, ShuffleNotFoundError, ShuffleReleasedError, SpillDirError, UnsafePathError,
)
from hybrid_ray.ids import (
    check_id, is_below_resolved, is_inside, realpath_cached, resolved_dir,
)
from hybrid_ray.segment import SegmentId, SegmentMeta
from hybrid_ray.tiers import DiskTier, Grant, MemoryTier, RemoteTier, Tier, TierUsage
from hybrid_ray.tiers.disk import (
    DATA_DIR_NAME, check_spill_dir_writable, marked_shuffle_dir_problem, read_segment_file,
    require_segment_file, shuffle_dir_of, unlink_all,
)
from hybrid_ray.tiers.remote import open_remote_tier, remote_tier_key

# Released shuffle ids a tier manager remembers (see TierManager.register_shuffle).
RELEASED_MEMORY = 10_000
# Writers per shuffle whose last reservation a tier manager remembers (the newest), so
# that one whose answer never came can be cancelled (TierManager.cancel_reserve): a map
# task of a long Spark application's shuffle (one writer per task attempt) stays in them
# until the shuffle's release otherwise. Far more than write on a node at once.
LAST_GRANTS_KEPT = 4096
# How long after a release the node looks for files a late writer left (see
# TierManager.remove_late_files).
LATE_FILES_WINDOW_S = 600.0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Answer to a reservation: a grant from a local tier, or None with the reasons why no
    local tier could take the segment (the writer then uses the remote tier, if any)."""

    grant: Grant | None
    refusals: tuple[str, ...] = ()
    # A faster local tier than the one that took the segment (or than the remote tier,
    # for a refused one) that has room for a segment of its own, smaller size: the
    # writer cuts its next segment of that subpartition at that size, so writing switches
    # back up. (Cut at the slower tier's size, 16 MiB remote segments never fit a disk
    # capped at 12 MiB, and every later segment stayed remote on an empty disk.)
    faster: TierName | None = None


@dataclasses.dataclass(frozen=True)
class ReserveToken:
    """Names one reservation call of one writer: ``writer`` is unique per writer (a map
    attempt's storage proxy), ``sequence`` counts its calls. See
    ``TierManager.cancel_reserve``."""

    writer: str
    sequence: int


@dataclasses.dataclass(frozen=True)
class NodeUsage:
    node_id: str
    tiers: tuple[TierUsage, ...]
    shuffles: tuple[str, ...]
    quotas: dict[str, int]
    # Failed background orphan sweeps of the node's tier manager, and the last one's error.
    sweep_errors: int = 0
    last_sweep_error: str = ""
    # Segment files this node refused to delete (not provably hybrid_ray's: see
    # TierManager._deletable_segment_file), and the last refusal.
    refused_deletions: int = 0
    last_refused_deletion: str = ""


def build_io_tiers(config: ShuffleConfig, owner: Any = None, memory_budget: int = 0,
                   check_remote: bool = True, node_id: str = "") -> dict[TierName, Tier]:
    """Instantiate the tiers ``config`` enables, for I/O in this process on ``node_id``.
    ``memory_budget``: the bytes this process's memory tier may hold, an integer >= 0
    (NumPy's too). hybrid_ray's own writers and readers leave it 0: the node's tier
    manager grants their memory-tier space (``TierManager.reserve``)."""
    require_config("build_io_tiers", config)
    # Checked as TierManager's object_store_bytes: a negative, bool or float budget was
    # taken (True as a 1-byte budget), NaN let the memory tier take every segment without
    # bound, a string failed the first reservation with a bare TypeError, and a NumPy
    # integer stayed one in the tier (require_bytes gives the plain int).
    memory_budget = require_bytes("build_io_tiers(memory_budget=...)", memory_budget)
    tiers: dict[TierName, Tier] = {}
    seg = config.segment_bytes
    if TierName.MEMORY in config.enabled_tiers:
        tiers[TierName.MEMORY] = MemoryTier(seg[TierName.MEMORY], memory_budget, owner)
    tiers[TierName.DISK] = _open_disk_tier(node_id, seg[TierName.DISK],
                                           config.spill_dirs_for(node_id),
                                           config.min_reserve_fraction,
                                           config.disk_capacity_bytes)
    if config.remote_path is not None:
        tiers[TierName.REMOTE] = open_remote_tier(config, check_reachable=check_remote)
    return tiers


def _open_disk_tier(node_id: str, *args: Any, **kwargs: Any) -> DiskTier:
    """``DiskTier(*args, **kwargs)``, its ``SpillDirError`` naming ``node_id`` (if given):
    spill dirs are each node's own, and a shuffle's error named the dir, not the node."""
    try:
        return DiskTier(*args, **kwargs)
    except SpillDirError as exc:
        if not node_id:
            raise
        raise SpillDirError(f"node {node_id}: {exc}") from None


# Remote tiers a tier manager keeps open beyond those its registered shuffles use.
REMOTE_TIERS_KEPT = 4
# Disk tiers (one per spill dirs, reserve fraction and cap) kept by a tier manager that no
# registered or recently released shuffle uses and that hold no bytes. A tier manager
# outlives jobs, and a job with fresh spill dirs (a temporary directory per run) added one
# for good: every release and status then went through all of them.
DISK_TIERS_KEPT = 8


def _pack_key(meta: SegmentMeta) -> tuple[int, int, int, int]:
    """The key of a packed memory-tier segment's pack in ``TierManager._open_packs``:
    (map, attempt, lead subpartition, lead index)."""
    return (meta.id.map_partition, meta.id.attempt, meta.pack.lead_subpartition,
            meta.pack.lead_index)


class TierManager:
    """Memory and disk tiers of one node, shared by every shuffle that writes on it.

    Memory quotas follow FLIP-53: each active shuffle registers a weight and gets
    ``weight / sum(weights)`` of the node budget, capped by its own configured budget.
    """

    def __init__(self, node_id: str, object_store_bytes: int, owner: Any = None) -> None:
        self.node_id = check_id("node_id", node_id)
        # A negative or non-number size made every memory budget negative or a TypeError.
        if isinstance(object_store_bytes, bool) \
                or not isinstance(object_store_bytes, numbers.Real) \
                or not 0 <= object_store_bytes < float("inf"):
            raise ConfigError(f"TierManager's object_store_bytes must be the node's object "
                              f"store size in bytes (>= 0), got {object_store_bytes!r}")
        self.object_store_bytes = object_store_bytes
        self.owner = owner
        # Names these books: stamped on every grant (``Grant.granted_by``) and from there
        # on its segment's meta. A tier manager started again after one died (Ray's memory
        # monitor kills one under pressure) is a new instance with empty books; the
        # segments of its predecessor's grants are freed through it, and giving their
        # bytes back lowered its books below what it had granted since: 16 MiB went to
        # disk under a 10 MiB cap, 1,500 bytes into a 1,000-byte memory budget.
        self.books_id = secrets.token_hex(8)
        self.memory = MemoryTier(0, 0, owner)
        self._disks: dict[tuple, DiskTier] = {}
        # The spill dirs of each disk tier as a set of resolved paths: what the node's
        # disk cap compares (``_disk_used_in``), so an order or a symlink is the same dirs.
        self._disk_dirs: dict[tuple, frozenset[str]] = {}
        # Bytes granted on each spill directory and not yet written, shared by every disk
        # tier of this node (see DiskTier): statvfs sees only what is written.
        self._disk_in_flight: dict[tuple[str, str], int] = {}
        self._remotes: dict[tuple, RemoteTier] = {}
        self._shuffles: dict[str, dict[str, Any]] = {}
        # Segments already freed, per shuffle: a failed attempt's segments are freed by its
        # writer's abort and again when the master drops the attempt; space must come
        # back once, or the tier under-counts and overshoots its budget.
        self._freed: dict[str, set[Any]] = {}
        # Memory-tier packs (``PackSlot``) some of whose members were freed, per shuffle:
        # (map, attempt, lead subpartition, lead index) -> [members left, their bytes
        # freed]. A pack's object stays in the store until its last member goes, so its
        # bytes stay counted until then (given back per member, the budget would believe in
        # room the store does not have).
        self._open_packs: dict[str, dict[tuple[int, int, int, int], list[int]]] = {}
        # Per shuffle, per writer (``ReserveToken.writer``): its last reservation that
        # granted anything, as (sequence number, grants). A writer whose wait for that
        # answer ran out never saw the grants, so it cannot settle them: it cancels the
        # call instead (``cancel_reserve``), and without this record their bytes stayed
        # counted, refusing other shuffles room, until the shuffle's release (a review's
        # reproduction). One entry per writer: a writer sends its next reservation only
        # after the answer to its last one came. The last LAST_GRANTS_KEPT writers per
        # shuffle are kept: a writer cancels within its call's bound of its reservation.
        self._last_grants: dict[str, collections.OrderedDict[str, tuple[int, list[Grant]]]] \
            = {}
        # Shuffles released here -> when (monotonic), oldest first, the last RELEASED_MEMORY:
        # a map that began just before its shuffle was released must not register it again
        # (its space would stay counted, its quota taken, for good), and the recent ones are
        # looked at for late writers' files (``remove_late_files``).
        self._released: collections.OrderedDict[str, float] = collections.OrderedDict()
        # The disk tier of each shuffle in ``_released``: kept while its late files may
        # still be swept (``remove_late_files``), see ``_prune_disks``.
        self._released_disks: dict[str, tuple] = {}
        # Released shuffles whose files could not all be removed: ``remove_late_files``
        # tries them again on every sweep, past its window, until nothing is left. (A
        # release by the orphan sweep has no master to retry it.)
        self._removal_failed: set[str] = set()
        # (shuffle, spill dir) pairs whose shuffle directory carries our marker, made for
        # JVM disk grants (``mark_disk_target``); a shuffle's go with its release.
        self._marked: set[tuple[str, str]] = set()
        # Memory-tier segments of a predecessor's grants taken into these books
        # (``adopt_memory_segments``), per shuffle: freed through here, their bytes go back.
        self._adopted: dict[str, set[SegmentId]] = {}
        # Segment files refused for deletion (see _deletable_segment_file), for ``usage``.
        self.refused_deletions = 0
        self.last_refused_deletion = ""

    # ---- registration and quotas -----------------------------------------------------------
    def register_shuffle(self, shuffle_id: str, config: ShuffleConfig) -> int:
        """Register a shuffle writing on this node; returns its memory quota in bytes.
        Raises ``ShuffleNotFoundError`` for a shuffle already released here, and
        ``InvalidIdError`` for an id that is not a safe directory name."""
        check_id("shuffle_id", shuffle_id)
        require_config("TierManager.register_shuffle", config)
        if shuffle_id in self._shuffles:
            return self.memory.quota(shuffle_id)
        if shuffle_id in self._released:
            raise ShuffleReleasedError(f"shuffle {shuffle_id!r} was released on node "
                                       f"{self.node_id}; a map of it cannot start writing")
        disk_key = self._disk_key(config)
        remote_key = self._remote_key(config)
        uses_memory = TierName.MEMORY in config.enabled_tiers
        self._shuffles[shuffle_id] = {
            "disk": disk_key, "remote": remote_key, "memory": uses_memory,
            "weight": config.memory_weight,
            "budget": config.memory_budget(self.object_store_bytes) if uses_memory else 0,
            "segment_bytes": dict(config.segment_bytes),
        }
        self._rebalance_quotas()
        return self.memory.quota(shuffle_id) if uses_memory else 0

    def check_spill_dirs(self, config: ShuffleConfig) -> list[str]:
        """Create ``config``'s spill dirs on this node where missing (0700, as a shuffle's
        first use would) and check that each is safe and takes a file; returns hybrid_ray's
        data dir in each. Raises ``SpillDirError`` naming the dir, this node and the fix.

        ``hybrid_ray.init`` asks every node's tier manager: spill dirs are each node's
        own, so the driver cannot check them, and one that could not be created or written
        (under /proc, below a regular file, read-only) was taken by init and failed the
        first shuffle instead."""
        require_config("TierManager.check_spill_dirs", config)
        data_dirs = []
        for spill_dir in config.spill_dirs_for(self.node_id):
            try:
                data_dirs.append(check_spill_dir_writable(spill_dir))
            except SpillDirError as exc:
                raise SpillDirError(f"node {self.node_id}: {exc}") from None
        return data_dirs

    def _disk_key(self, config: ShuffleConfig) -> tuple:
        """The key of ``config``'s disk tier on this node, the tier opened if need be."""
        spill_dirs = config.spill_dirs_for(self.node_id)
        disk_key = (spill_dirs, config.min_reserve_fraction, config.disk_capacity_bytes)
        if disk_key not in self._disks:
            self._disks[disk_key] = _open_disk_tier(
                self.node_id, config.segment_bytes[TierName.DISK], spill_dirs,
                config.min_reserve_fraction, config.disk_capacity_bytes,
                in_flight=self._disk_in_flight,
                node_used=functools.partial(self._disk_used_in, disk_key))
            self._disk_dirs[disk_key] = frozenset(os.path.realpath(d) for d in spill_dirs)
            self._prune_disks(keep=disk_key)
        return disk_key

    def _prune_disks(self, keep: tuple | None = None) -> None:
        """Forget disk tiers, oldest first, while more than ``DISK_TIERS_KEPT`` are open:
        only one that holds no bytes (granted or written), that no registered shuffle uses
        and whose shuffles' releases are older than ``LATE_FILES_WINDOW_S`` and removed in
        full (their late files are swept through it), nor ``keep``. What it knew is not
        needed after: a release or a free names the config or finds our marker
        (``_deletable_segment_file``), as after a restart."""
        if len(self._disks) <= DISK_TIERS_KEPT:
            return
        now = time.monotonic()
        in_use = {info["disk"] for info in self._shuffles.values()} | {keep}
        in_use |= {key for shuffle_id, key in self._released_disks.items()
                   if now - self._released[shuffle_id] <= LATE_FILES_WINDOW_S
                   or shuffle_id in self._removal_failed}
        # A failed removal's tier is kept whatever the shuffle's age: the late-files sweep
        # retries it through the tiers, and one forgotten made it give up (files kept).
        failed = sorted(self._removal_failed)
        for key in [k for k, disk in self._disks.items()
                    if k not in in_use and disk.used_bytes == 0]:
            if len(self._disks) <= DISK_TIERS_KEPT:
                break
            if any(self._disks[key].has_shuffle_data(s) for s in failed):
                continue
            del self._disks[key]
            self._disk_dirs.pop(key, None)

    def _disk_used_in(self, disk_key: tuple) -> int:
        """Bytes the node's disk tiers over the spill dirs of ``disk_key``'s tier hold
        (granted, written or not): what ``disk_capacity_bytes``, a cap per node, bounds for
        shuffles spilling there. Tiers over other directories are not counted: a shuffle
        with no cap, or a larger one, elsewhere must not use up a capped shuffle's room (a
        review of the first version, which summed every disk tier of the node). The dirs
        are compared as sets of resolved paths: the same dirs listed in another order, or
        through a symlink, were counted apart and each config got the whole cap. A tier
        sharing some of the dirs counts whole (tiers keep no bytes per dir): counted only
        where the sets were equal, configs over [X] and [X, Y] each got the whole cap on X
        (found by a review). Counting it whole refuses early rather than over the cap."""
        dirs = self._disk_dirs[disk_key]
        return sum(disk.used_bytes for key, disk in self._disks.items()
                   if self._disk_dirs[key] & dirs)

    def _remote_key(self, config: ShuffleConfig) -> tuple | None:
        """Key of ``config``'s remote tier in ``_remotes`` (opened on first use), or None."""
        if config.remote_path is None:
            return None
        key = remote_tier_key(config)
        if key not in self._remotes:
            self._remotes[key] = open_remote_tier(config)
            self._prune_remotes(keep=key)
        return key

    def _prune_remotes(self, keep: tuple | None = None) -> None:
        """Close remote tiers no registered shuffle uses, oldest first, while more than
        ``REMOTE_TIERS_KEPT`` are open (a tier a registered shuffle uses is never closed,
        nor ``keep``, the one just opened for a caller)."""
        in_use = {info["remote"] for info in self._shuffles.values()} | {keep}
        for key in [k for k in self._remotes if k not in in_use]:
            if len(self._remotes) <= REMOTE_TIERS_KEPT:
                break
            self._remotes.pop(key).close()

    def remote_tier(self, shuffle_id: str) -> RemoteTier | None:
        """The remote tier of a shuffle registered here, or None if its config has none."""
        key = self._shuffles[shuffle_id]["remote"]
        return None if key is None else self._remotes[key]

    def remote_tier_of(self, config: ShuffleConfig) -> RemoteTier | None:
        """The remote tier of ``config`` (shared with the shuffles registered with the same
        one), for reading a shuffle that never wrote on this node."""
        key = self._remote_key(config)
        return None if key is None else self._remotes[key]

    def _rebalance_quotas(self) -> None:
        users = {s: info for s, info in self._shuffles.items() if info["memory"]}
        self.memory.budget_bytes = max((i["budget"] for i in users.values()), default=0)
        total_weight = sum(i["weight"] for i in users.values())
        for shuffle_id, info in users.items():
            share = int(self.memory.budget_bytes * info["weight"] / total_weight)
            self.memory.set_quota(shuffle_id, min(share, info["budget"]))

    def quota(self, shuffle_id: str) -> int:
        info = self._shuffles.get(shuffle_id)
        return self.memory.quota(shuffle_id) if info and info["memory"] else 0

    def _local_tiers(self, shuffle_id: str) -> list[Tier]:
        info = self._shuffles.get(shuffle_id)
        if info is None:
            if shuffle_id in self._released:
                raise ShuffleReleasedError(f"shuffle {shuffle_id!r} was released on node "
                                           f"{self.node_id}; a map of it cannot write")
            raise ShuffleNotFoundError(
                f"shuffle {shuffle_id!r} is not registered on node {self.node_id}: "
                "reserve space with the shuffle's config first (register_shuffle)")
        tiers: list[Tier] = [self.memory] if info["memory"] else []
        tiers.append(self._disks[info["disk"]])
        return tiers

    def _tier(self, shuffle_id: str, name: TierName) -> Tier:
        if name == TierName.MEMORY:
            return self.memory
        info = self._shuffles[shuffle_id]
        if name == TierName.DISK:
            return self._disks[info["disk"]]
        return self._remotes[info["remote"]]

    # ---- the write path ---------------------------------------------------------------------
    def reserve(self, shuffle_id: str, sizes: Sequence[int],
                settled: Sequence[tuple[Grant, int | None]] = (),
                register: ShuffleConfig | None = None,
                tracked: bool = True,
                token: ReserveToken | None = None) -> list[Placement]:
        """Settle finished grants, then pick for each new segment the first local tier, in
        priority order, that can take it (FLIP-301: try the higher tiers again every time,
        so writing switches back up when space frees). ``register``: register the shuffle
        with this config first (``register_shuffle``), in the same call. ``tracked``: see
        ``Tier.try_reserve`` (False for a JVM writer's). ``token``: names the call, so that
        a writer that never got its answer can give its grants back (``cancel_reserve``).

        Raises ``ShuffleNotFoundError`` for a shuffle not registered here (or released)."""
        if register is not None:
            self.register_shuffle(shuffle_id, register)
        self.settle(shuffle_id, settled)
        tiers = self._local_tiers(shuffle_id)
        bad = [n for n in sizes
               if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0]
        if bad:
            # A negative size lowered the books (reserving -8 MiB let 9 MiB in under a
            # 10 MiB cap beside 8 MiB already used).
            raise ConfigError(f"segment sizes to reserve must be positive integers, got "
                              f"{bad[:5]}")
        placements: list[Placement] = []
        segment_bytes = self._shuffles[shuffle_id]["segment_bytes"]
        try:
            for nbytes in sizes:
                refusals = []
                for placed_at, tier in enumerate(tiers):
                    grant = tier.try_reserve(shuffle_id, nbytes, tracked)
                    if grant is not None:
                        grant = dataclasses.replace(grant, granted_by=self.books_id)
                        break
                    refusals.append(tier.describe_refusal(nbytes))
                else:
                    grant, placed_at = None, len(tiers)
                faster = self._room_above(shuffle_id, tiers[:placed_at], nbytes, segment_bytes)
                placements.append(Placement(grant, () if grant else tuple(refusals), faster))
        except BaseException:
            # A tier that failed part-way (statvfs raising): the grants this call made
            # never reach the writer, so they go back now (they stayed counted until the
            # shuffle's release).
            self.settle(shuffle_id, [(p.grant, None) for p in placements
                                     if p.grant is not None])
            raise
        if token is not None:
            grants = [p.grant for p in placements if p.grant is not None]
            by_writer = self._last_grants.setdefault(shuffle_id, collections.OrderedDict())
            by_writer.pop(token.writer, None)
            if grants:
                by_writer[token.writer] = (token.sequence, grants)
                if len(by_writer) > LAST_GRANTS_KEPT:
                    by_writer.popitem(last=False)
        return placements

    def cancel_reserve(self, shuffle_id: str, token: ReserveToken) -> int:
        """Give back what the reservation ``token`` granted: its writer's wait for the
        answer ran out (the tier manager was busy past the bound), so the writer never
        knew of the grants and cannot settle them. A call that granted nothing, that has
        not run, or that a later reservation of the same writer followed (whose writer
        therefore got the answer) changes nothing. Returns the grants given back."""
        by_writer = self._last_grants.get(shuffle_id, {})
        last = by_writer.get(token.writer)
        if last is None or last[0] != token.sequence:
            return 0
        del by_writer[token.writer]
        self.settle(shuffle_id, [(grant, None) for grant in last[1]])
        return len(last[1])

    @staticmethod
    def _room_above(shuffle_id: str, faster: Sequence[Tier], nbytes: int,
                    segment_bytes: dict[TierName, int]) -> TierName | None:
        """The first of the ``faster`` tiers (which refused ``nbytes``) with room for a
        segment of its own, smaller size, probed without keeping a grant; else None."""
        for tier in faster:
            own = segment_bytes.get(tier.name, nbytes)
            # A segment cut at ``own`` encodes a little larger (IPC framing, uneven rows):
            # probed at ``own`` alone, a tier with room in between took none of them, and
            # the writer cut every segment small for nothing (a review's experiment: all
            # 16 went remote at the disk's size). The probe asks for that margin too.
            probe = own + own // 8 + 4096
            if probe >= nbytes:
                continue  # it refused this segment; it cannot take one that large
            grant = tier.try_reserve(shuffle_id, probe)
            if grant is not None:
                tier.settle(shuffle_id, grant, None)  # a probe: give it back at once
                return tier.name
        return None

    def lease_memory(self, shuffle_id: str, nbytes: int) -> Grant | None:
        """One memory grant of ``nbytes`` for many segments to come (a JVM map task asks
        for one when it starts, so a task whose output fits makes no reservation call);
        the writer splits it into segments and settles what it did not use. None when the
        memory tier (disabled for the shuffle, or full) cannot take it all."""
        if nbytes <= 0:
            raise ConfigError(f"a memory lease must be positive, got {nbytes} bytes")
        self._local_tiers(shuffle_id)  # raises for a shuffle not registered here
        if not self._shuffles[shuffle_id]["memory"]:
            return None
        return self.memory.try_reserve(shuffle_id, nbytes)

    def settle(self, shuffle_id: str, settled: Sequence[tuple[Grant, int | None]]) -> None:
        """Record what became of grants: bytes written, or None for a failed write. A grant
        of another tier manager (``Grant.granted_by``: one that died, whose writer settles
        with its successor) changes nothing here: its bytes were never in these books."""
        if shuffle_id not in self._shuffles:
            return
        for grant, written in settled:
            if not self._counted_here(grant.granted_by):
                continue
            self._tier(shuffle_id, grant.tier).settle(shuffle_id, grant, written)

    def _counted_here(self, granted_by: str) -> bool:
        """Whether space granted by ``granted_by`` (``Grant.granted_by``) is in these
        books: granted here, or unnamed (a JVM writer's); not a predecessor's."""
        return not granted_by or granted_by == self.books_id

    def settle_changes_books(self, shuffle_id: str, grant: Grant,
                             written_bytes: int | None) -> bool:
        """Whether settling ``grant`` of a shuffle registered here with ``written_bytes``
        changes its tier's books (``Tier.settle_changes_books``)."""
        return self._tier(shuffle_id, grant.tier).settle_changes_books(grant, written_bytes)

    # ---- deletion ----------------------------------------------------------------------------
    def free_segments(self, shuffle_id: str, metas: Sequence[SegmentMeta]) -> list[str]:
        """Delete segments stored on this node (abandoned attempts, consumed data). Data is
        deleted even if the shuffle was already released here (a late writer's files).
        A disk segment whose file this node may not delete (``_deletable_segment_file``)
        is left alone, counted (``usage``) and returned as the refusal's message: retrying
        would never make it ours, so it does not fail the deletion (whose other segments
        are gone) nor come back to it. A file that cannot be unlinked (EBUSY, EIO) fails
        the call, so the master retries, after every other file of the batch was tried
        and the bytes of those that went were given back."""
        registered = shuffle_id in self._shuffles
        freed = self._freed.setdefault(shuffle_id, set()) if registered else set()
        refused = []
        resolved: dict[str, str] = {}  # this call's resolved directories (realpath_cached)
        todo: list[tuple[SegmentMeta, str | None]] = []  # (segment, its file if on disk)
        in_batch: set[SegmentId] = set()  # a segment listed twice is freed once
        for meta in metas:
            if meta.tier == TierName.REMOTE or meta.id in freed or meta.id in in_batch:
                continue
            in_batch.add(meta.id)
            location = None
            if meta.tier == TierName.DISK:
                try:
                    location = self._deletable_segment_file(shuffle_id, meta, resolved)
                except UnsafePathError as exc:
                    refused.append(str(exc))
                    continue
            todo.append((meta, location))
        # The files go first, every one tried even if some fail (unlink_all), then the
        # books of those that went. (The first failure used to stop the batch: every
        # later file stayed, and its bytes counted, until the retry.)
        unlink_errors = unlink_all([loc for _, loc in todo if loc is not None])
        for meta, location in todo:
            if location in unlink_errors:
                continue  # its bytes stay counted; the error is raised below
            if registered:
                tier = self._tier(shuffle_id, meta.tier)
                if meta.tier != TierName.DISK:  # (a disk file is gone already: unlinked above)
                    tier.delete(meta)
                if self._counted_here(meta.granted_by) \
                        or meta.id in self._adopted.get(shuffle_id, ()):
                    nbytes = self._pack_bytes_gone(shuffle_id, meta) \
                        if meta.tier == TierName.MEMORY and meta.pack is not None \
                        else meta.nbytes
                    if nbytes:
                        tier.free(shuffle_id, nbytes)
            # Marked freed last: a deletion that raised before its bytes were freed is
            # done again by the master's retry (it was skipped as done, its bytes counted
            # until the shuffle's release; DiskTier.delete's literal-prefix check raised
            # for a file _deletable_segment_file had accepted through a symlinked dir).
            freed.add(meta.id)
        if unlink_errors:
            # Raised before the refusals are counted: the master's retry refuses them again
            # and counts them then (once), as before the files were tried all together.
            path, error = next(iter(unlink_errors.items()))
            also = f"; {len(refused)} refused: {refused[0]}" if refused else ""
            raise OSError(f"freeing segments of shuffle {shuffle_id} could not delete "
                          f"{len(unlink_errors)} file(s), first {path}: {error}{also}"
                          ) from error
        if not registered and shuffle_id in self._released:
            # A late writer reserved before the release and wrote after it, creating the
            # shuffle's directories (and marker) again: they go with its files.
            for disk in self._disks.values():
                disk.remove_shuffle_data(shuffle_id)
        if refused:
            self.refused_deletions += len(refused)
            self.last_refused_deletion = refused[-1][:500]
        return refused

    def adopt_memory_segments(self, shuffle_id: str, config: ShuffleConfig,
                              metas: Sequence[SegmentMeta]) -> int:
        """Take into these books the memory-tier segments of this node that another tier
        manager granted (one that died: this one started in its place) and that still
        hold the object store's memory: their writers own the objects, which outlive the
        tier manager. Without this the new books started empty, granted the whole budget
        again beside them, and the shuffle's memory tier went 52-70% over
        ``memory_capacity_bytes`` (a review's harness). Registers the shuffle here first
        (not one released here). Freed through here later, their bytes go back once; a
        pack's bytes go back with its last member still held. Returns the bytes taken."""
        if shuffle_id in self._released:
            return 0
        self.register_shuffle(shuffle_id, config)
        adopted = self._adopted.setdefault(shuffle_id, set())
        freed = self._freed.get(shuffle_id, set())
        taken = 0
        for meta in metas:
            if meta.tier != TierName.MEMORY or meta.node_id != self.node_id \
                    or meta.granted_by == self.books_id or meta.id in adopted \
                    or meta.id in freed:
                continue  # another node's or tier's, granted here, taken, or gone
            adopted.add(meta.id)
            taken += meta.nbytes
            if meta.pack is not None:
                # Only the members held count down: each one freed through here lowers
                # the count, and the last gives back what was taken for the members.
                packs = self._open_packs.setdefault(shuffle_id, {})
                packs.setdefault(_pack_key(meta), [0, 0])[0] += 1
        self.memory.count(shuffle_id, taken)
        return taken

    def _pack_bytes_gone(self, shuffle_id: str, meta: SegmentMeta) -> int:
        """A packed memory-tier segment of ``shuffle_id`` is freed (once: see ``_freed``):
        the bytes of its whole pack once it was the last member, else 0."""
        key = _pack_key(meta)
        packs = self._open_packs.setdefault(shuffle_id, {})
        left_and_bytes = packs.setdefault(key, [meta.pack.members, 0])
        left_and_bytes[0] -= 1
        left_and_bytes[1] += meta.nbytes
        if left_and_bytes[0] > 0:
            return 0
        del packs[key]
        if not packs:
            del self._open_packs[shuffle_id]
        return left_and_bytes[1]

    def _deletable_segment_file(self, shuffle_id: str, meta: SegmentMeta,
                                resolved_dirs: dict[str, str] | None = None) -> str:
        """The file of disk segment ``meta`` if this node may delete it for ``shuffle_id``,
        else ``UnsafePathError``. A location comes from another process (the master's books,
        a JVM's commit), so it must be a segment file of that very shuffle (segment id and
        path both name it) and lie inside the data dir of one of this node's disk tiers, or,
        for a data dir this tier manager does not know (it was started again since), in a
        directory that carries hybrid_ray's marker for that shuffle (Python writers and
        the grants of JVM disk reservations write it) and that the file does not lead out
        of through a symlink. Never a file hybrid_ray did not write. ``resolved_dirs``:
        see ``require_own_segment_file``."""
        location = require_segment_file(meta.location, "delete")
        shuffle_directory = shuffle_dir_of(location)
        if meta.id.shuffle_id != shuffle_id or os.path.basename(shuffle_directory) != shuffle_id:
            raise UnsafePathError(
                f"refusing to delete {location!r} for shuffle {shuffle_id}: the segment "
                f"({meta.id}) or its path names another shuffle. This is a bug in the "
                "caller; please report it")
        return self._segment_file_of_ours(location, "delete", resolved_dirs,
                                          hint="If it is a leftover of ours, `hybrid-ray "
                                               "cleanup` removes it")

    def _segment_file_of_ours(self, location: str, action: str,
                              resolved_dirs: dict[str, str] | None = None,
                              hint: str = "") -> str:
        """``location`` (a segment file) if it lies inside the data dir of one of this
        node's disk tiers or, for a data dir this tier manager does not know (it was
        started again since the shuffle wrote: Ray restarts a tier manager the memory
        monitor killed, and the new one has registered none of the old shuffles' disks),
        in a shuffle directory that carries hybrid_ray's marker for the shuffle its path
        names and that the file does not lead out of through a symlink. Else
        ``UnsafePathError``."""
        try:
            return self.require_own_segment_file(location, action, resolved_dirs)
        except UnsafePathError as not_in_our_dirs:
            shuffle_directory = shuffle_dir_of(location)
            shuffle_id = os.path.basename(shuffle_directory)
            problem = marked_shuffle_dir_problem(shuffle_directory, shuffle_id)
            if problem is None and is_inside(shuffle_directory, location):
                return location
            raise UnsafePathError(
                f"refusing to {action} {location!r}: it is neither inside the data dir of a "
                f"spill dir this node's disk tier uses nor in a shuffle directory marked as "
                f"hybrid_ray's for shuffle {shuffle_id} in a private data dir of ours "
                f"({problem or 'the file leads out of it'}). {hint + ' ' if hint else ''}"
                f"({not_in_our_dirs})") from None

    def mark_disk_target(self, shuffle_id: str, spill_dir: str) -> None:
        """Give the shuffle's directory in ``spill_dir`` (a disk grant's target) hybrid_ray's
        marker, once: JVM writers write none, and without it ``hybrid-ray cleanup`` and a
        tier manager started again would leave their files (``DiskTier.mark_shuffle``)."""
        if (shuffle_id, spill_dir) not in self._marked:
            disk = self._tier(shuffle_id, TierName.DISK)
            assert isinstance(disk, DiskTier)
            disk.mark_shuffle(shuffle_id, spill_dir)
            self._marked.add((shuffle_id, spill_dir))

    def release_shuffle(self, shuffle_id: str, config: ShuffleConfig | None = None) -> None:
        """Forget a shuffle: give back its quota and remove its files on this node.
        Raises ``OSError`` naming what could not be removed (after forgetting the shuffle:
        calling again retries the removal; ``remove_late_files`` retries it too).

        ``config``: the shuffle's config (the master sends it), so a tier manager started
        again since the shuffle wrote here, which knows none of its disks, still removes
        its files from the config's spill dirs."""
        check_id("shuffle_id", shuffle_id)
        disk_key = None
        if config is not None and shuffle_id not in self._shuffles:
            disk_key = self._released_disk_key(config)
        info = self._shuffles.pop(shuffle_id, None)
        self._marked = {m for m in self._marked if m[0] != shuffle_id}
        self._freed.pop(shuffle_id, None)
        self._open_packs.pop(shuffle_id, None)
        self._adopted.pop(shuffle_id, None)
        self._last_grants.pop(shuffle_id, None)
        self._released[shuffle_id] = time.monotonic()
        self._released.move_to_end(shuffle_id)
        disk_key = info["disk"] if info is not None else disk_key
        if disk_key is not None:
            self._released_disks[shuffle_id] = disk_key
        while len(self._released) > RELEASED_MEMORY:
            self._released_disks.pop(self._released.popitem(last=False)[0], None)
        self.memory.release_shuffle(shuffle_id)
        failures: list[str] = []
        for disk in self._disks.values():
            try:
                disk.release_shuffle(shuffle_id)
            except OSError as exc:  # every disk is tried; what is left is raised below
                failures.append(str(exc))
        if info is not None:
            self._rebalance_quotas()
            self._prune_remotes()
        self._prune_disks()
        if failures:
            # The quota is given back (the shuffle is gone); the files left are raised so
            # the caller retries the release (the master queues it again) and the late
            # files sweep removes them meanwhile, however long that takes.
            self._removal_failed.add(shuffle_id)
            raise OSError("; ".join(failures))
        self._removal_failed.discard(shuffle_id)

    def _released_disk_key(self, config: ShuffleConfig) -> tuple | None:
        """The key of the disk tier a shuffle not registered here is released through
        (``release_shuffle``): None where its spill dirs cannot be opened and none of them
        holds a data dir, so nothing of it is there to remove. (A shuffle whose spill dir
        is a file or cannot be created failed its first reservation; its release raised
        the spill dir's error on every retry, and the master retried it for good.)"""
        try:
            return self._disk_key(config)
        except SpillDirError:
            if any(os.path.lexists(os.path.join(d, DATA_DIR_NAME))
                   for d in config.spill_dirs_for(self.node_id)):
                raise  # files of ours may be there: the retry removes them once it can
            return None

    def remove_late_files(self, window_s: float = LATE_FILES_WINDOW_S) -> list[str]:
        """Remove what writers left of shuffles released here in the last ``window_s``;
        returns the shuffles whose directories were found again. A map that reserved space
        before its shuffle's release and wrote after it recreates the shuffle's directory;
        its abort removes it, but a writer killed before its abort leaves its files. A
        release whose removal failed is tried again whatever its age, until it succeeds.
        Run periodically (the tier manager actor's sweep). Raises ``OSError`` naming what
        could not be removed, after trying every shuffle."""
        now = time.monotonic()
        recent = []
        for shuffle_id, released in reversed(self._released.items()):  # newest first
            if now - released > window_s:
                break
            recent.append(shuffle_id)
        # A release whose removal failed is tried until it succeeds, past the window too.
        recent += sorted(self._removal_failed.difference(recent))
        found = []
        failures: list[str] = []
        for shuffle_id in recent:
            left = [d for d in self._disks.values() if d.has_shuffle_data(shuffle_id)]
            failed = False
            for disk in left:
                try:
                    disk.remove_shuffle_data(shuffle_id)
                except OSError as exc:  # tried again next sweep; the others go on
                    failures.append(str(exc))
                    failed = True
            if failed:
                self._removal_failed.add(shuffle_id)
            else:
                self._removal_failed.discard(shuffle_id)
            if left:
                found.append(shuffle_id)
        if failures:
            raise OSError("; ".join(failures))
        return found

    def was_released(self, shuffle_id: str) -> bool:
        """Whether ``shuffle_id`` was released here (among the last RELEASED_MEMORY)."""
        return shuffle_id in self._released

    def shuffle_ids(self) -> list[str]:
        """The shuffles registered on this node (not released)."""
        return list(self._shuffles)

    def read_disk_segment(self, meta: SegmentMeta) -> bytes:
        """Serve a disk segment of this node to a reader on another node (only a segment
        file of ours: the location comes from the caller; see ``serve_segment_file``)."""
        self.serve_segment_file(meta.location)
        return read_segment_file(meta)

    def serve_segment_file(self, location: str) -> str:
        """``location`` if this node may serve it to a reader: a segment file of ours
        (``_segment_file_of_ours``), also after this tier manager was started again."""
        return self._segment_file_of_ours(require_segment_file(location, "serve"), "serve")

    def require_own_segment_file(self, location: str, action: str,
                                 resolved_dirs: dict[str, str] | None = None) -> str:
        """``location`` if it is a segment file inside the data dir of one of this node's
        disk tiers (symlinks resolved), else ``UnsafePathError``. A location comes from
        another process (the master's books, a Spark reader); the shape check alone would
        let a bad one name any ``.../hybrid_ray/<id>/sub-<n>/<file>`` on this node.
        ``resolved_dirs``: a cache of resolved directories for a batch of locations checked
        at once (see ``ids.realpath_cached``), including the data dirs."""
        require_segment_file(location, action)
        cache = {} if resolved_dirs is None else resolved_dirs
        roots = sorted({d for disk in self._disks.values() for d in disk.data_dirs()})
        real = realpath_cached(location, cache)
        if not any(is_below_resolved(resolved_dir(root, cache), real) for root in roots):
            raise UnsafePathError(
                f"refusing to {action} {location!r}: it is not inside the data dir of a "
                f"spill dir of this node's disk tier ({', '.join(roots) or 'none registered'}"
                "). This is a bug in the caller; please report it")
        return location

    def usage(self) -> NodeUsage:
        tiers = [self.memory.usage()] + [d.usage() for d in self._disks.values()]
        return NodeUsage(self.node_id, tuple(tiers), tuple(self._shuffles),
                         {s: self.memory.quota(s) for s, i in self._shuffles.items() if i["memory"]},
                         refused_deletions=self.refused_deletions,
                         last_refused_deletion=self.last_refused_deletion)
