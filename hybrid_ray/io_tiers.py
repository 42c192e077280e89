"""The tiers a worker process writes and reads through, opened once per config.

A writer or reader actor serves shuffle after shuffle, often each with a new config (a job
id per run). Opening tiers costs (a remote tier starts a transfer pool and an fsspec
client), so a process keeps the tier sets of its last ``IO_CACHE_SIZE`` configs and closes
the ones it evicts.
"""

from __future__ import annotations

from typing import Any

from hybrid_ray.actors import get_tier_manager
from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.tiers.cache import LruCache
from hybrid_ray.tiers.remote import remote_tier_key


def io_tiers_for(config: ShuffleConfig, node_id: str,
                 own_memory_segments: bool = False, owner: Any = None) -> dict:
    """This process's I/O tiers for ``config`` on ``node_id``, opened once and kept in a
    bounded cache (``IO_CACHE``).

    ``own_memory_segments``: memory-tier objects are owned by this process (a writer
    actor that outlives the shuffle); otherwise by the node's tier manager: ``owner``, its
    handle as the caller just got it (looked up by name if None, when the tiers are
    opened). The cached memory tier is given a handle passed on every call: a tier manager
    started again after the last one died is another actor, and a tier set kept with the
    dead one's handle failed every later map of the process (a reused Spark Python
    worker) putting its segments. Writers pass it; readers never put."""
    # ShuffleConfig holds dicts (unhashable): cache on its repr, which is deterministic,
    # plus the remote tier's real settings. The repr masks credentials, so on its own two
    # configs differing only in them (refreshed STS tokens, or another job under the same
    # job id) shared one remote tier: the old credentials, or another job's.
    key = (repr(config), remote_tier_key(config), node_id, own_memory_segments)

    if own_memory_segments:
        owner = None  # this process puts and owns its objects itself

    def open_tiers() -> dict:
        from hybrid_ray.tier_manager import build_io_tiers

        # Looked up only here when not given: a reader (which never puts) would otherwise
        # pay a lookup by name at the GCS on every reduce call.
        return build_io_tiers(config, check_remote=False, node_id=node_id,
                              owner=None if own_memory_segments else
                              owner or get_tier_manager(node_id, config.namespace))
    tiers = IO_CACHE.get_or_create(key, open_tiers)
    memory = tiers.get(TierName.MEMORY)
    if memory is not None and owner is not None:
        memory.owner = owner
    return tiers


def _close_io_tiers(tiers: dict) -> None:
    remote = tiers.get(TierName.REMOTE)
    if remote is not None:
        remote.close()


# The tiers of the last IO_CACHE_SIZE configs this process wrote or read with: a
# long-lived writer or reader serves shuffle after shuffle, often each with a new config
# (a job id per run), and kept every tier set it ever opened.
IO_CACHE_SIZE = 8
IO_CACHE: LruCache[dict] = LruCache(IO_CACHE_SIZE, on_evict=_close_io_tiers)
