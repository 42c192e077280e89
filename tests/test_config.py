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
    # One tier named twice (was: the last spelling silently won, 4 KiB disk segments).
    with pytest.raises(ConfigError, match=r"segment_bytes names the disk tier twice \('disk' "
                                          r"and 'DISK'\); give each tier once"):
        ShuffleConfig(segment_bytes={"disk": 8 * MiB, "DISK": 4096})


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
    ("remote_transfers", 10**9, "remote_transfers must be at most 64, got 1000000000: "
                                "each is an upload thread"),
    ("memory_pack_bytes", -1, "memory_pack_bytes must be an integer number of bytes >= 0"),
    ("memory_pack_bytes", 2.0, "memory_pack_bytes must be an integer number of bytes"),
    ("memory_pack_bytes", 2 << 30, "memory_pack_bytes must be at most 1 GiB (1073741824 "
                                   "bytes), got 2147483648: a reader fetches a segment's "
                                   "whole pack"),
    ("max_concurrent_reducers", 2.5, "max_concurrent_reducers must be an integer >= 1"),
    ("stall_timeout_s", 0.5, "stall_timeout_s must be in [1.0, inf)"),
    ("stall_timeout_s", float("inf"), "stall_timeout_s must be in [1.0, inf)"),
    ("stall_timeout_s", "600", "stall_timeout_s must be a number"),
    # Issue 14 item 15: accepted before, each failing late or silently wrong.
    ("orphan_ttl_s", 1, "orphan_ttl_s must be >= 15 s (3 driver heartbeats of 5 s)"),
    ("orphan_ttl_s", 14.9, "releases live shuffles"),
    ("memory_weight", float("inf"), "memory_weight must be in [1e-09, inf)"),
    ("memory_weight", float("nan"), "memory_weight"),
    ("remote_path", "s3://", "names no bucket"),
    ("remote_path", "s3:///", "names no bucket"),
    ("remote_path", "s3://user:pw@", "carries credentials"),
    ("remote_path", "file://", "names no path"),
    ("remote_path", "file://relative/dir", "relative local path"),
    ("remote_path", "s3:", "has no protocol"),
    ("remote_path", "s3:/bucket/x", "has no protocol"),
    ("remote_path", "bucket/prefix", "has no protocol"),
    ("job_id", 123, "job_id must be a string"),
    ("namespace", None, "namespace must be a string"),
    ("spill_dirs", [None], "spill_dirs[0] must be a directory path (str or os.PathLike of str), got NoneType"),
    ("spill_dirs", ["/tmp/ok", 123], "spill_dirs[1] must be a directory path (str or os.PathLike of str), got int"),
    ("spill_dirs", [b"/tmp/x"], "spill_dirs[0] must be a directory path (str or os.PathLike of str), got bytes"),
    ("spill_dirs", ["  "], "spill_dirs[0] is an empty path"),
    ("spill_dirs", 5, "spill_dirs must be a list of directories"),
    # Accepted before, each failing late, hanging or landing somewhere unexpected.
    ("segment_bytes", {"disk": 8}, "segment_bytes['disk'] must be an integer number of "
                                   "bytes >= 4096"),
    ("segment_bytes", {"memory": 4 * 1024**3}, "segment_bytes['memory'] must be at most 1 GiB"),
    # The tier name first: a misspelt tier with a small value was told only its size.
    ("segment_bytes", {"mem": 1}, "unknown tier 'mem'"),
    ("map_chunk_bytes", 32, "map_chunk_bytes must be an integer number of bytes >= 4096"),
    ("orphan_ttl_s", float("inf"), "orphan_ttl_s must be at most 1e+09"),
    ("stall_timeout_s", 1e17, "stall_timeout_s must be at most 1e+09"),
    ("memory_weight", 1e308, "memory_weight must be at most 1e+09"),
    # Ints beyond a float's range: OverflowError from the range check before (found by a
    # review of the README's "every bad value raises ConfigError").
    ("stall_timeout_s", 10 ** 400, "stall_timeout_s must be at most 1e+09"),
    ("orphan_ttl_s", 10 ** 400, "orphan_ttl_s must be at most 1e+09"),
    ("memory_weight", 10 ** 400, "memory_weight must be at most 1e+09"),
    ("spill_dirs", ["~/spill"], "starts with '~', which is not expanded"),
    ("spill_dirs", ["spill"], "'spill' is relative"),
    ("spill_dirs", ["/d/{node_id}/.."], "loses its {node_id}"),
    ("remote_path", "memory://bkt/x", "cannot be a remote tier: it lives inside one process"),
    # fsspec reads '::' as URL chaining: the first wrote to /tmp/hr, the second to bucket/p.
    ("remote_path", "file:///tmp/hr::/tmp/other", "holds '::', which fsspec reads as a chain"),
    ("remote_path", "s3://bucket/p::x", "holds '::', which fsspec reads as a chain"),
    ("storage_options", {1: "x"}, "with string keys"),
    ("progress", "no", "progress must be True or False"),
])
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=None) as info:
        ShuffleConfig(**{field: value})
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_limits_that_are_allowed(tmp_path):
    from hybrid_ray.config import DRIVER_HEARTBEAT_S, MIN_ORPHAN_TTL_S
    from hybrid_ray.shuffle import HEARTBEAT_S

    assert HEARTBEAT_S == DRIVER_HEARTBEAT_S and MIN_ORPHAN_TTL_S == 3 * DRIVER_HEARTBEAT_S
    assert ShuffleConfig(orphan_ttl_s=MIN_ORPHAN_TTL_S).orphan_ttl_s == MIN_ORPHAN_TTL_S
    assert ShuffleConfig(memory_weight=1e6).memory_weight == 1e6
    assert ShuffleConfig(remote_path=str(tmp_path)).remote_path == str(tmp_path)
    assert ShuffleConfig(remote_path="s3://bucket").remote_path == "s3://bucket"
    assert ShuffleConfig(spill_dirs=[tmp_path / "a"]).spill_dirs == (str(tmp_path / "a"),)


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


@pytest.mark.parametrize("timeouts", [{"read_timeout": "x"}, {"connect_timeout": 0},
                                      {"read_timeout": float("inf")}, {"connect_timeout": True}])
def test_remote_transfer_timeouts_must_be_positive_seconds(timeouts):
    """Each remote call is bounded by config_kwargs' connect and read timeouts. A bad one
    was accepted and failed inside the first transfer, or ended ``hybrid-ray cleanup`` in a
    traceback, with a bare "could not convert string to float" (found by a review)."""
    name = next(iter(timeouts))
    with pytest.raises(ConfigError, match=rf"storage_options\['config_kwargs'\]\['{name}'\] "
                                          "must be a positive number of seconds"):
        ShuffleConfig(remote_path="s3://bucket/p", storage_options={"config_kwargs": timeouts})
    with pytest.raises(ConfigError, match="config_kwargs'\\] must be a mapping"):
        ShuffleConfig(storage_options={"config_kwargs": ["read_timeout", 5]})
    ok = ShuffleConfig(storage_options={"config_kwargs": {"read_timeout": 2.5}})
    assert ok.storage_options["config_kwargs"] == {"read_timeout": 2.5}


def test_storage_options_client_kwargs_must_be_a_mapping():
    """A client_kwargs that is no mapping passed ShuffleConfig and failed opening the
    remote tier with a bare "TypeError: 'int' object is not iterable" (found by a
    review); the error names the option and the fix, never the values."""
    from hybrid_ray.tiers.remote import open_remote_tier

    with pytest.raises(ConfigError, match=r"storage_options\['client_kwargs'\] must be a "
                                          "mapping .* got int"):
        config = ShuffleConfig(remote_path="s3://bucket/p",
                               storage_options={"client_kwargs": 5, "secret": "s3cr3t-value"})
        open_remote_tier(config)  # where it failed before
    ok = ShuffleConfig(storage_options={"client_kwargs": {"region_name": "eu-west-1"}})
    assert ok.storage_options["client_kwargs"] == {"region_name": "eu-west-1"}


def test_numpy_integers_are_taken_as_plain_ints_for_sizes_and_counts():
    # Was: every byte size refused a NumPy integer ("must be an integer number of bytes"),
    # while num_partitions took one; counts kept the NumPy type, which json.dumps refuses
    # when the config goes to the JVM shuffle manager.
    import json

    import numpy as np

    from hybrid_ray.spark_jvm import config_to_json

    cfg = ShuffleConfig(memory_capacity_bytes=np.int64(64 * MiB),
                        disk_capacity_bytes=np.uint32(GiB),
                        map_chunk_bytes=np.int64(8 * MiB),
                        memory_pack_bytes=np.int32(MiB),
                        segment_bytes={"disk": np.int64(4 * MiB)},
                        remote_transfers=np.int8(2),
                        max_concurrent_reducers=np.int64(3))
    values = (cfg.memory_capacity_bytes, cfg.disk_capacity_bytes, cfg.map_chunk_bytes,
              cfg.memory_pack_bytes, cfg.segment_bytes[TierName.DISK], cfg.remote_transfers,
              cfg.max_concurrent_reducers)
    assert values == (64 * MiB, GiB, 8 * MiB, MiB, 4 * MiB, 2, 3)
    assert all(type(v) is int for v in values)
    sent = json.loads(config_to_json(cfg))
    assert (sent["memory_capacity_bytes"], sent["segment_bytes"]["disk"]) == (64 * MiB, 4 * MiB)
    # Still refused: floats, bools and negative NumPy integers.
    for field, value in (("map_chunk_bytes", np.float64(8 * MiB)),
                         ("memory_capacity_bytes", np.bool_(True)),
                         ("disk_capacity_bytes", np.int64(-1))):
        with pytest.raises(ConfigError, match=f"{field} must be an integer number of bytes"):
            ShuffleConfig(**{field: value})


def test_numpy_numbers_are_taken_as_plain_numbers_for_fractions_weights_and_seconds():
    # Was: np.float32(0.3) and np.int64(100) were refused as "must be a number, got
    # np.float32(0.3)" for the fractions, the weight and the durations (and init's
    # timeout_s), while the byte sizes and counts took NumPy integers; a NumPy float left
    # in the config would fail json.dumps for the JVM shuffle manager.
    import json

    import numpy as np

    from hybrid_ray.config import require_seconds
    from hybrid_ray.spark_jvm import config_to_json

    cfg = ShuffleConfig(memory_fraction=np.float32(0.25), min_reserve_fraction=np.float16(0.5),
                        memory_weight=np.int64(2), orphan_ttl_s=np.int64(3600),
                        stall_timeout_s=np.float32(60),
                        storage_options={"config_kwargs": {"connect_timeout": np.int64(5)}})
    values = (cfg.memory_fraction, cfg.min_reserve_fraction, cfg.memory_weight,
              cfg.orphan_ttl_s, cfg.stall_timeout_s)
    assert values == (0.25, 0.5, 2, 3600, 60.0)
    assert all(type(v) in (int, float) for v in values)
    sent = json.loads(config_to_json(cfg))
    assert (sent["memory_fraction"], sent["orphan_ttl_s"]) == (0.25, 3600)
    assert require_seconds("timeout_s", np.int64(30)) == 30.0
    # Still refused, naming the field: bools, NumPy bools, out-of-range NumPy numbers.
    for field, value in (("memory_fraction", np.bool_(True)),
                         ("memory_fraction", np.float32(1.5)),
                         ("stall_timeout_s", np.float64("nan")),
                         ("orphan_ttl_s", np.int64(10))):
        with pytest.raises(ConfigError, match=f"{field} must be"):
            ShuffleConfig(**{field: value})
    with pytest.raises(ConfigError, match="timeout_s must be a positive number of seconds"):
        require_seconds("timeout_s", np.bool_(True))
