"""The errors hybrid_ray raises.

A short hierarchy rooted in builtins, so callers can catch ``OSError`` or ``ValueError``
as they would for any storage code. Every message says what happened and what to do.
"""

from __future__ import annotations


class HybridRayError(Exception):
    """Base class of every error hybrid_ray raises on purpose."""


class ConfigError(HybridRayError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class InvalidIdError(ConfigError):
    """A job, shuffle, node id or namespace is not a safe path component
    (``hybrid_ray.ids.ID_PATTERN``); the message names the field, the value and the rule."""


class SpillDirError(ConfigError):
    """A spill directory cannot be used safely: not a directory, a symlink, owned by another
    user, world-writable without the sticky bit, or not private; the message says the fix."""


class UnknownTierError(ConfigError, KeyError):
    """A tier name is not one of ``memory``, ``disk``, ``remote``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnsafePathError(HybridRayError, PermissionError):
    """hybrid_ray refused to write or delete a path outside its own data directory."""


class CorruptSegmentError(HybridRayError, OSError):
    """A segment's bytes do not match its checksum or cannot be decoded."""


class OutOfSpaceError(HybridRayError, OSError):
    """No tier can take a segment: disk full (or capped) and no remote tier configured."""


class RemoteTierError(HybridRayError, OSError):
    """The remote tier (``remote_path``) is unreachable or refused an operation."""


class SegmentNotFoundError(HybridRayError, LookupError):
    """A segment the index names is gone from its tier (released, or its node died)."""


class SegmentLostWithNodeError(SegmentNotFoundError):
    """A segment's node died (its tier manager and files, or its object store, with it)."""


class ShuffleNotFoundError(HybridRayError, LookupError):
    """The shuffle master knows no shuffle with this id (never registered, or released)."""


class ShuffleStateError(HybridRayError, ValueError):
    """A call to the shuffle master does not fit the shuffle's state: registering an id
    twice, a map index outside the shuffle, sealing with maps that did not finish. A bug in
    the caller (hybrid_ray's drivers never make such calls), named with the values."""


class ShuffleFailedError(HybridRayError, RuntimeError):
    """A shuffle could not complete; its data has been cleaned up."""


class ShuffleStalledError(ShuffleFailedError):
    """No map and no reducer of a shuffle finished for ``ShuffleConfig.stall_timeout_s``
    (a hung or paused worker process, a store that stopped answering): the shuffle was
    failed and its data removed instead of waiting forever. The message names what still
    ran, where. Also raised in a map or reduce task whose call to the shuffle master or a
    tier manager went unanswered for its bound (``actors.answer_of``), naming the call."""


class ShuffleReleasedError(ShuffleNotFoundError, ShuffleFailedError):
    """The shuffle was released while a task of it still ran (it failed: another map's
    error, a stall; or its driver released it): its data is gone for good and the task's
    output is not needed. The message carries the release's reason where one was given.
    Both a ``ShuffleNotFoundError`` (the master or tier manager no longer knows it) and a
    ``ShuffleFailedError``."""


class ShuffleMasterLostError(ShuffleFailedError):
    """The namespace's shuffle master is gone (its node died or it was killed): the books
    of every shuffle in flight went with it."""


class ActorStartError(HybridRayError, RuntimeError):
    """Some of the actors a shuffle needs did not start (``hybrid_ray.init``); the message
    names them and their nodes."""


class InputChangedError(HybridRayError, RuntimeError):
    """A file a shuffle reads its input from was removed or replaced after the shuffle
    planned its maps (the direct parquet scan of ``spark_bridge.repartition``): its rows
    may no longer be the ones planned, so the map fails instead of reading them."""
