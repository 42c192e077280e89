"""Storage tiers in priority order: memory (Ray object store) > disk (spill dirs) > remote."""

from hybrid_ray.tiers.base import Grant, Tier, TierUsage
from hybrid_ray.tiers.disk import DiskTier
from hybrid_ray.tiers.memory import MemoryTier
from hybrid_ray.tiers.remote import RemoteTier

__all__ = ["DiskTier", "Grant", "MemoryTier", "RemoteTier", "Tier", "TierUsage"]
