import pytest

from hybrid_ray import (
    ConfigError, GiB, MiB, ShuffleConfig, Spilling, TierName, UnknownTierError,
)


def test_defaults_are_valid_and_normalised():
    cfg = ShuffleConfig()
    assert cfg.min_reserve_fraction == 0.05
    assert len(cfg.spill_dirs) == 1
    assert cfg.segment_bytes[TierName.DISK] == 8 * MiB
    assert cfg.enabled_tiers == (TierName.MEMORY, TierName.DISK)


def test_tier_keys_accept_strings_and_merge_defaults():
    cfg = ShuffleConfig(segment_bytes={"memory": 1 * MiB})
    assert cfg.segment_bytes[TierName.MEMORY] == MiB
    assert cfg.segment_bytes[TierName.REMOTE] == 16 * MiB


@pytest.mark.parametrize("field,value,needle", [
    ("memory_fraction", 1.5, "memory_fraction"),
    ("memory_fraction", "half", "memory_fraction"),
    ("min_reserve_fraction", 1.0, "min_reserve_fraction"),
    ("min_reserve_fraction", -0.1, "min_reserve_fraction"),
    ("disk_capacity_bytes", -1, "disk_capacity_bytes"),
    ("disk_capacity_bytes", 1.5, "disk_capacity_bytes"),
    ("compression", "snappy", "compression must be one of none, lz4, zstd"),
    ("mode", "streaming", "mode must be one of hybrid, blocking"),
    ("spilling", "some", "spilling"),
    ("spill_dirs", "/tmp/x", "list of directories"),
    ("remote_path", "nosuchproto://bucket/x", "fsspec knows no protocol"),
    ("segment_bytes", {"disk": 0}, "segment_bytes['disk']"),
    ("memory_weight", 0, "memory_weight"),
    ("job_id", "a/b", "job_id"),
    ("remote_transfers", 0, "remote_transfers must be an integer >= 1"),
    ("max_concurrent_reducers", 2.5, "max_concurrent_reducers must be an integer >= 1"),
])
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=None) as info:
        ShuffleConfig(**{field: value})
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_tier_lists_valid_ones():
    with pytest.raises(UnknownTierError) as info:
        ShuffleConfig(segment_bytes={"ssd": MiB})
    assert "unknown tier 'ssd'" in str(info.value)
    assert "memory, disk, remote" in str(info.value)


def test_full_spilling_disables_memory_tier(tmp_path):
    cfg = ShuffleConfig(spilling="full", remote_path=f"file://{tmp_path}")
    assert cfg.spilling is Spilling.FULL
    assert cfg.enabled_tiers == (TierName.DISK, TierName.REMOTE)


def test_memory_budget_absolute_overrides_fraction():
    assert ShuffleConfig(memory_fraction=0.5).memory_budget(2 * GiB) == GiB
    assert ShuffleConfig(memory_capacity_bytes=123).memory_budget(2 * GiB) == 123
    assert ShuffleConfig(memory_capacity_bytes=0).enabled_tiers == (TierName.DISK,)


def test_config_is_frozen():
    cfg = ShuffleConfig()
    with pytest.raises(AttributeError):
        cfg.memory_fraction = 0.9  # type: ignore[misc]
    assert cfg.replace(memory_fraction=0.9).memory_fraction == 0.9
