"""The session token of a Spark session started by ``spark_bridge.init_spark`` (the key the
shuffle master hands the session's whole config, remote-tier credentials included, out
under) is on no process's command line and in none of Spark's configuration, while the
driver's JVM and its executors still present it: the exchanges' segments reach the
session's remote tier, which only the master's copy of the config knows. ~1 min."""

from __future__ import annotations

import os
import uuid

import pytest

import spark_bridge
from conftest import files_under, start_local_ray
from hybrid_ray import KiB, ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _command_lines() -> dict[int, str]:
    """Every process's argv as ``ps -eo args -ww`` shows it to any local user."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                pass
    return out


def test_the_token_is_on_no_command_line_and_the_jvms_still_reach_the_remote_tier(tmp_path):
    from spark_bridge import session as bridge

    start_local_ray()
    remote = tmp_path / "remote"
    config = ShuffleConfig(namespace=f"hr-token-{uuid.uuid4().hex[:8]}",
                           spill_dirs=[str(tmp_path / "spill")], remote_path=f"file://{remote}",
                           memory_capacity_bytes=256 * KiB, disk_capacity_bytes=512 * KiB,
                           segment_bytes={"memory": 16 * KiB}, map_chunk_bytes=64 * KiB,
                           progress=False)
    spark = spark_bridge.init_spark("token-argv", num_executors=1, executor_cores=1,
                                    executor_memory="1GB", shuffle_config=config)
    try:
        token = bridge._session_shuffles[2]
        assert token
        leaks = {pid: args[:200] for pid, args in _command_lines().items() if token in args}
        assert not leaks, leaks
        sc = spark.sparkContext
        assert all(token not in v for _, v in sc.getConf().getAll())
        assert token not in sc._jvm.java.lang.System.getProperties().toString()
        pairs = sc.parallelize(range(200_000), 4).map(lambda x: (x % 997, f"value-{x:08d}"))
        counts = dict(pairs.groupByKey(numPartitions=4).mapValues(len).collect())
        assert counts == {k: len(range(k, 200_000, 997)) for k in range(997)}
        # Only the master's copy of the session's config has the remote tier: the driver
        # registered the shuffle with the token, the executors wrote with it.
        assert any("/spark-" in f for f in files_under(str(remote))), "no remote segments"
    finally:
        spark_bridge.stop_spark()
    totals: dict[str, int] = {}
    for report in spark_bridge.spark_shuffle_reports():
        for tier, nbytes in report.bytes_per_tier().items():
            totals[tier] = totals.get(tier, 0) + nbytes
    assert totals.get("remote", 0) > 0, totals
