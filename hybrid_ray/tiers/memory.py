"""Memory tier: segments as objects in the node's Ray object store (plasma).

Objects must outlive the process that wrote them unless it is long-lived (a writer actor,
``owner=None``): a short-lived writer (a Spark executor's Python worker) has the node's
tier-manager actor own them (``owner``), which puts them itself (see ``put_many_owned_by``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from hybrid_ray.config import TierName
from hybrid_ray.errors import CorruptSegmentError, SegmentNotFoundError, ShuffleStalledError
from hybrid_ray.nodes import alive_node_count
from hybrid_ray.segment import PackSlot, SegmentId, SegmentMeta, segment_num_rows
from hybrid_ray.tiers.base import Grant, Tier

_LOG = logging.getLogger(__name__)

# How long a reader waits for one memory-tier segment (a pull from another node included):
# as long as a data call to a tier manager (actors.DATA_CALL_TIMEOUT_S).
READ_TIMEOUT_S = 300.0


class MemoryTier(Tier):
    """Ray object store tier with a node budget and per-shuffle quotas (FLIP-53).

    ``budget_bytes`` bounds the sum over all shuffles; ``set_quota`` bounds one shuffle.
    """

    name = TierName.MEMORY

    def __init__(self, segment_bytes: int, budget_bytes: int, owner: Any = None) -> None:
        super().__init__(segment_bytes)
        self.budget_bytes = budget_bytes
        self.owner = owner
        self._quotas: dict[str, int] = {}
        # Refs of segments written through this instance, keyed by id: they keep the objects
        # alive in local use; on a cluster the shuffle master holds the committed refs.
        self._refs: dict[SegmentId, ray.ObjectRef] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes

    def set_quota(self, shuffle_id: str, quota_bytes: int | None) -> None:
        if quota_bytes is None:
            self._quotas.pop(shuffle_id, None)
        else:
            self._quotas[shuffle_id] = quota_bytes

    def quota(self, shuffle_id: str) -> int:
        return self._quotas.get(shuffle_id, self.budget_bytes)

    def _room_for(self, shuffle_id: str, nbytes: int) -> str | None:
        if self.used_bytes + nbytes > self.budget_bytes:
            return None
        if self.used_by(shuffle_id) + nbytes > self.quota(shuffle_id):
            return None
        return "plasma"

    def describe_refusal(self, nbytes: int) -> str:
        return (f"memory tier budget exhausted: {self.used_bytes} of {self.budget_bytes} "
                f"bytes used, segment needs {nbytes}")

    def write(self, segment: SegmentId, payload: bytes, grant: Grant | None = None,
              node_id: str = "") -> SegmentMeta:
        return self.write_many([(segment, payload)], node_id,
                               granted_by=grant.granted_by if grant is not None else "")[0]

    def write_many(self, items: Sequence[tuple[SegmentId, bytes]], node_id: str = "",
                   pack_bytes: int = 0, max_members: int | None = None,
                   granted_by: str = "") -> list[SegmentMeta]:
        """Store several granted segments with one round trip to the owner.
        ``granted_by``: the tier manager whose grants they are (``Grant.granted_by``).

        ``pack_bytes`` > 0: consecutive segments go into shared objects (``PackSlot``) of
        at most that many bytes and ``max_members`` segments each (``pack_groups``; a
        larger segment alone): one object-store create and seal per pack instead of per
        segment. Readers on the writer's node read a member zero-copy, but one on another
        node pulls the whole pack, so packing is for segments read where they are written
        (``pack_bytes_for``)."""
        # A numpy array is stored out-of-band, so readers on the node get a zero-copy view;
        # a list of them is one object holding each as its own out-of-band buffer.
        arrays = [np.frombuffer(payload, dtype=np.uint8) for _, payload in items]
        groups = pack_groups([len(a) for a in arrays], pack_bytes, max_members,
                             [segment.subpartition for segment, _ in items])
        refs = put_many_owned_by(self.owner, [arrays[g[0]] if len(g) == 1
                                              else [arrays[i] for i in g] for g in groups])
        metas = []
        for group, ref in zip(groups, refs):
            lead = items[group[0]][0]
            pack_bytes = sum(len(arrays[i]) for i in group)
            for position, i in enumerate(group):
                segment, payload = items[i]
                self._refs[segment] = ref
                slot = None if len(group) == 1 else PackSlot(
                    lead.subpartition, lead.index, len(group), position, pack_bytes)
                metas.append(SegmentMeta(segment, self.name, len(payload),
                                         segment_num_rows(payload), node_id=node_id,
                                         object_ref=[ref], pack=slot,
                                         granted_by=granted_by))
        return metas

    def read(self, meta: SegmentMeta) -> Any:
        if not meta.object_ref:
            raise SegmentNotFoundError(f"{meta.id} has no object reference in the memory tier")
        try:
            return _member(meta, ray.get(meta.object_ref[0], timeout=READ_TIMEOUT_S))
        except ray.exceptions.GetTimeoutError as exc:
            # A pull from a node that stopped answering but was not declared dead: every
            # other wait of a reader is bounded; this one waited forever.
            raise ShuffleStalledError(
                f"{meta.id} could not be fetched from the memory tier of node "
                f"{meta.node_id} within {READ_TIMEOUT_S:g} s: the node or its object store "
                "stopped answering; check the node's health (ray status)") from exc
        except ray.exceptions.OwnerDiedError as exc:
            # The usual loss in a Ray shuffle: the object lives with the writer process
            # that put it (was blamed on "its tier manager or node").
            raise SegmentNotFoundError(
                f"{meta.id} was lost from the memory tier of node {meta.node_id}: its "
                f"owner, the writer process of map {meta.id.map_partition} attempt "
                f"{meta.id.attempt} (or that process's node), died; use spilling='full' to "
                "make segments outlive their writer") from exc
        except ray.exceptions.ObjectLostError as exc:
            raise SegmentNotFoundError(
                f"{meta.id} was lost from the memory tier of node {meta.node_id} "
                "(its tier manager or node died); use spilling='full' to make segments "
                "survive node loss") from exc

    def read_many(self, metas: Sequence[SegmentMeta]) -> list[Any]:
        """Read several segments with one ``ray.get``: one request to the object store
        for all of them, and their pulls from other nodes run side by side. 200 gets of
        4 MiB objects one by one cost a reader 22-35 ms of CPU here, in one call 4-5 ms.
        ``ShuffleStalledError`` if the batch could not be fetched in time; otherwise raises
        if any segment cannot be read now (which one is not said: read them one by one
        with ``read`` to find out and get its error)."""
        if not all(meta.object_ref for meta in metas):
            raise SegmentNotFoundError("a segment has no object reference in the memory tier")
        # Members of one pack share a ref: each object is fetched (and deserialized) once.
        unique: dict[ray.ObjectRef, int] = {}
        for meta in metas:
            unique.setdefault(meta.object_ref[0], len(unique))
        try:
            objects = ray.get(list(unique), timeout=READ_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:  # as in read: every wait is bounded
            raise ShuffleStalledError(
                f"{len(metas)} memory-tier segment(s) from {metas[0].id} on could not be "
                f"fetched within {READ_TIMEOUT_S:g} s: a node or its object store stopped "
                "answering; check the nodes' health (ray status)") from exc
        return [_member(meta, objects[unique[meta.object_ref[0]]]) for meta in metas]

    def has(self, segment: SegmentId) -> bool:
        return segment in self._refs

    def delete(self, meta: SegmentMeta) -> None:
        self._refs.pop(meta.id, None)

    def remove_shuffle_data(self, shuffle_id: str) -> None:
        for sid in [s for s in self._refs if s.shuffle_id == shuffle_id]:
            del self._refs[sid]
        self._quotas.pop(shuffle_id, None)


def _member(meta: SegmentMeta, stored: Any) -> Any:
    """Segment ``meta``'s payload out of its object as read (``stored``): the object
    itself, or its member at ``meta.pack.position``. A pack that is not a list of the
    member count (a ref swapped with another object's) is a ``CorruptSegmentError``, as
    a swapped segment file is: nothing else of it is handed over."""
    if meta.pack is None:
        if isinstance(stored, list):
            raise CorruptSegmentError(
                f"{meta.id} should be an object of its own in the memory tier of node "
                f"{meta.node_id}, but its object holds a pack of {len(stored)}")
        return stored
    if not isinstance(stored, list) or len(stored) != meta.pack.members \
            or not 0 <= meta.pack.position < len(stored):
        got = f"a list of {len(stored)}" if isinstance(stored, list) else type(stored).__name__
        raise CorruptSegmentError(
            f"{meta.id} should be member {meta.pack.position} of a pack of "
            f"{meta.pack.members} in the memory tier of node {meta.node_id}, but its object "
            f"holds {got}")
    return stored[meta.pack.position]


# Members of one pack at most: a reader deserializes every member of the list to get
# one (3.6 ms a get for 1000 members against 0.2 for one).
PACK_MEMBERS_MAX = 8
# A flush (one segment per subpartition, in order) goes into at least this many packs.
# Reducers consume subpartitions in order, so a pack of neighbours is freed once its
# share of the reducers finished: a pack of all of them held the whole memory tier until
# the last reducer, undoing the per-subpartition freeing that keeps the store from holding
# input, memory tier and output at once (see ShuffleRegistry.free_subpartitions).
MIN_PACKS_PER_FLUSH = 4


def pack_members_for(num_subpartitions: int) -> int:
    """Members of one pack at most for a writer of ``num_subpartitions``: at most
    ``PACK_MEMBERS_MAX``, and few enough for ``MIN_PACKS_PER_FLUSH`` packs per flush (1,
    no packing, below 8 subpartitions)."""
    return max(1, min(PACK_MEMBERS_MAX, num_subpartitions // MIN_PACKS_PER_FLUSH))


def pack_groups(sizes: Sequence[int], pack_bytes: int, max_members: int | None = None,
                subpartitions: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in groups of at most ``max_members`` (default
    ``PACK_MEMBERS_MAX``) whose sizes sum to at most ``pack_bytes`` (a larger one alone);
    ``pack_bytes <= 0``: every index alone.

    With ``subpartitions`` (each index's), a group also ends where the order steps back
    (subpartition 0's tail after 31's held segments): a pack is freed with its last
    member's reducer, so one spanning distant subpartitions kept the early one's bytes
    counted until the late one's reducer was done."""
    limit = PACK_MEMBERS_MAX if max_members is None else max_members
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        steps_back = subpartitions is not None and bool(groups) \
            and subpartitions[i] < subpartitions[groups[-1][-1]]
        if not groups or pack_bytes <= 0 or total + size > pack_bytes \
                or len(groups[-1]) >= limit or steps_back:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


# Packs of at most this many bytes where packing is automatic (``pack_bytes_for``).
AUTO_PACK_BYTES = 64 * 1024 * 1024
# How long a process trusts its last count of the cluster's nodes (``pack_bytes_for``).
NODE_COUNT_TTL_S = 30.0
_node_count_cache: list[float] = []  # [count, when] (monotonic)


def pack_bytes_for(configured: int | None) -> int:
    """The pack bound a writer uses: ``ShuffleConfig.memory_pack_bytes``, or where that is
    None (automatic) ``AUTO_PACK_BYTES`` while the cluster has one node and 0 (no packing)
    when it has more. A reader on another node pulls a member's whole pack: across N nodes
    packing would multiply the bytes sent between them by up to N. The count is the one
    seen within the last ``NODE_COUNT_TTL_S`` (a node that joins meanwhile only makes its
    readers pull more)."""
    if configured is not None:
        return configured
    now = time.monotonic()
    if not _node_count_cache or now - _node_count_cache[1] > NODE_COUNT_TTL_S:
        try:
            alive: float = alive_node_count()
        except Exception as exc:  # noqa: BLE001 - the GCS did not answer: write without packing
            # Said once per TTL (and not asked again before it: each ask of a GCS that
            # does not answer costs the writer its timeout).
            _LOG.warning("hybrid_ray: could not count the cluster's nodes (%s: %s); "
                         "memory-tier segments are written unpacked for the next %.0f s. "
                         "Set ShuffleConfig.memory_pack_bytes to choose packing yourself",
                         type(exc).__name__, exc, NODE_COUNT_TTL_S)
            alive = math.inf
        _node_count_cache[:] = [alive, now]
    return AUTO_PACK_BYTES if _node_count_cache[0] <= 1 else 0


def put_many_owned_by(owner: Any, values: Sequence[Any]) -> list[ray.ObjectRef]:
    """Store each of ``values`` as an object owned by actor ``owner``, in one actor call.

    ``owner`` must have a ``put_objects(values) -> [refs]`` method. ``ray.put(...,
    _owner=...)`` would save a copy, but Ray 2.56 removed it ("The experimental `_owner`
    argument to `ray.put` has been removed"), so the owner puts the objects itself: the
    arguments reach it zero-copy from the object store and its ``ray.put`` makes the one
    long-lived copy. With ``owner=None`` this process owns the objects.
    """
    if owner is None:
        return [ray.put(v) for v in values]
    # Imported here: actors imports the tiers. Bounded like every call to a tier manager.
    from hybrid_ray.actors import DATA_CALL_TIMEOUT_S, answer_of

    return answer_of(owner.put_objects.remote(list(values)),
                     f"the tier manager storing {len(values)} memory-tier segment(s)",
                     DATA_CALL_TIMEOUT_S,
                     hint="If the node's object store is full and Ray cannot spill fast "
                          "enough, lower ShuffleConfig.memory_fraction (or "
                          "memory_capacity_bytes) to leave it room")
