"""The tier interface: a small core every storage tier implements.

A tier has two halves, because on a Ray cluster they run in different processes:

* space accounting (``try_reserve`` / ``settle`` / ``release_shuffle``): "can this tier start a
  new segment of about N bytes?". It runs where the node's state lives, the node's tier
  manager, so concurrent writers on a node never overshoot a budget together.
* data I/O (``write`` / ``read`` / ``has`` / ``delete`` / ``remove_shuffle_data``): runs in any
  process on the node (a map task writes its own disk files; a reader on the node reads them).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from hybrid_ray.config import TierName
from hybrid_ray.segment import SegmentId, SegmentMeta

# Every shuffle directory the disk and remote tiers write (``spill_dir/hybrid_ray/<shuffle>``,
# ``HomePath/JobID/<shuffle>``) holds this small JSON file, written before its first
# segment and removed with the directory. ``hybrid-ray cleanup`` removes only directories
# that carry it (``hybrid_ray.cleanup``): a user's data next to ours is never a candidate.
SHUFFLE_MARKER_NAME = ".hybrid_ray_shuffle"
SHUFFLE_MARKER_FORMAT = 1


def shuffle_marker(shuffle_id: str, job_id: str = "") -> bytes:
    """The marker of a shuffle directory: format version, ids, creation time."""
    return json.dumps({"format": SHUFFLE_MARKER_FORMAT, "writer": "hybrid_ray",
                       "shuffle_id": shuffle_id, "job_id": job_id,
                       "created": time.time()}).encode()


def parse_shuffle_marker(data: bytes) -> dict[str, Any] | None:
    """The marker's fields, or None if ``data`` is not a hybrid_ray shuffle marker."""
    try:
        fields = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(fields, dict) or fields.get("writer") != "hybrid_ray" \
            or not isinstance(fields.get("shuffle_id"), str):
        return None
    return fields


def new_grant_ids() -> Iterator[int]:
    """The grant ids of one process (a tier manager): counted from a random 62-bit start.
    A tier manager started again is a new process; counted from 1 again, it reissued the
    ids of grants its predecessor made, which writers still settle (``Tier.settle``): such
    a stale settlement then closed another writer's grant of the same shuffle and moved
    its bytes, and the real settlement was ignored (disk space counted until release)."""
    return itertools.count(secrets.randbits(62) + 1)


# Ids of grants, unique within a process, and across its restarts: see ``Grant.grant_id``.
_grant_ids = new_grant_ids()


@dataclasses.dataclass(frozen=True)
class Grant:
    """A tier's promise to take a segment of ``nbytes``; ``target`` says where (a directory)."""

    tier: TierName
    nbytes: int
    target: str = ""
    # Unique within the tier manager that granted it (0: untracked, e.g. a JVM writer's):
    # settling a grant twice changes the books once (``Tier.settle``), so a writer whose
    # call carrying settlements failed may send them again without knowing whether the
    # failed call ran.
    grant_id: int = 0
    # The tier manager instance whose books count the grant (``TierManager.books_id``),
    # copied into the segment's meta: a tier manager started again after one died frees
    # its predecessor's segments without giving back bytes it never counted. "" (a JVM
    # writer's grant): counted by whichever tier manager frees it.
    granted_by: str = ""


@dataclasses.dataclass(frozen=True)
class TierUsage:
    """Bytes and segments a tier holds; ``capacity_bytes`` is None when unbounded."""

    tier: TierName
    used_bytes: int
    capacity_bytes: int | None
    shuffles: int


class Tier(abc.ABC):
    """Base class: byte accounting per shuffle; subclasses decide room and do the I/O."""

    name: ClassVar[TierName]
    # Whether a writer settles every grant of this tier, even one written in full
    # (``settle_changes_books`` always true): only then are grants tracked by id.
    SETTLES_EVERY_GRANT: ClassVar[bool] = False

    def __init__(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self._used: dict[str, int] = collections.defaultdict(int)
        # Per shuffle, the ids of grants not settled yet (see ``Grant.grant_id``).
        self._open_grants: dict[str, set[int]] = collections.defaultdict(set)

    # ---- space accounting (on the node's tier manager) ----------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def used_by(self, shuffle_id: str) -> int:
        return self._used.get(shuffle_id, 0)

    def try_reserve(self, shuffle_id: str, nbytes: int, tracked: bool = True) -> Grant | None:
        """Reserve room for a new segment of ``nbytes``; None when the tier cannot take it.
        ``tracked``: give the grant an id, so settling it twice changes the books once
        (``Grant.grant_id``), where every grant is settled (``SETTLES_EVERY_GRANT``): an id
        left open until the shuffle's release would be a record per segment. A JVM
        writer's grants are untracked (its settlements carry no id)."""
        target = self._room_for(shuffle_id, nbytes)
        if target is None:
            return None
        self._used[shuffle_id] += nbytes
        if not (tracked and self.SETTLES_EVERY_GRANT):
            return Grant(self.name, nbytes, target)
        grant = Grant(self.name, nbytes, target, next(_grant_ids))
        self._open_grants[shuffle_id].add(grant.grant_id)
        return grant

    def settle(self, shuffle_id: str, grant: Grant, written_bytes: int | None) -> None:
        """Report what became of a grant: ``None`` means nothing was written (give it back).
        A tracked grant (``grant_id``) settled before, or not granted here (a tier manager
        started again since), changes nothing."""
        if grant.grant_id:
            open_grants = self._open_grants.get(shuffle_id)
            if open_grants is None or grant.grant_id not in open_grants:
                return
            open_grants.discard(grant.grant_id)
        delta = (written_bytes or 0) - grant.nbytes
        self._adjust(shuffle_id, delta)
        self._on_settled(shuffle_id, grant, written_bytes)

    def settle_changes_books(self, grant: Grant, written_bytes: int | None) -> bool:
        """Whether ``settle(grant, written_bytes)`` would change this tier's books (a write
        client skips the call otherwise). A grant counts as used when reserved, so one
        written in full changes nothing here; a tier that tracks more until the grant is
        settled (``_on_settled``) says so."""
        return written_bytes != grant.nbytes

    def free(self, shuffle_id: str, nbytes: int) -> None:
        """Return ``nbytes`` of a shuffle's space (segments deleted before release)."""
        self._adjust(shuffle_id, -nbytes)

    def count(self, shuffle_id: str, nbytes: int) -> None:
        """Count ``nbytes`` more of a shuffle's space without a grant: segments another
        tier manager granted, taken over (``TierManager.adopt_memory_segments``)."""
        self._adjust(shuffle_id, nbytes)

    def release_shuffle(self, shuffle_id: str) -> int:
        """Forget a shuffle's accounting and remove its data; returns the bytes freed."""
        freed = self._used.pop(shuffle_id, 0)
        self._open_grants.pop(shuffle_id, None)
        self.remove_shuffle_data(shuffle_id)
        return freed

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self.used_bytes, self.capacity_bytes,
                         sum(1 for v in self._used.values() if v > 0))

    def describe_refusal(self, nbytes: int) -> str:
        """Why the tier refuses ``nbytes`` now; used in out-of-space errors."""
        return f"{self.name.value} tier is full ({self.used_bytes} bytes used)"

    def _adjust(self, shuffle_id: str, delta: int) -> None:
        left = self._used.get(shuffle_id, 0) + delta
        if left > 0:
            self._used[shuffle_id] = left
        else:
            self._used.pop(shuffle_id, None)

    def _on_settled(self, shuffle_id: str, grant: Grant, written_bytes: int | None) -> None:
        """Hook: a tier tracking in-flight writes updates it here."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int | None:
        """Byte budget of the tier, or None when unbounded."""

    @abc.abstractmethod
    def _room_for(self, shuffle_id: str, nbytes: int) -> str | None:
        """Return the grant target when a segment of ``nbytes`` fits, else None."""

    # ---- data I/O (any process on the node) -----------------------------------------------
    @abc.abstractmethod
    def write(self, segment: SegmentId, payload: bytes, grant: Grant | None = None,
              node_id: str = "") -> SegmentMeta:
        """Store an encoded segment; it becomes visible to readers only once complete."""

    @abc.abstractmethod
    def read(self, meta: SegmentMeta) -> Any:
        """Return the encoded bytes (a buffer-protocol object) of a committed segment."""

    @abc.abstractmethod
    def has(self, segment: SegmentId) -> bool:
        """Whether this tier holds the complete segment."""

    @abc.abstractmethod
    def delete(self, meta: SegmentMeta) -> None:
        """Remove one segment (e.g. of an abandoned map attempt); missing is not an error."""

    @abc.abstractmethod
    def remove_shuffle_data(self, shuffle_id: str) -> None:
        """Remove every segment of a shuffle this tier holds (in this process/node)."""
