"""A Spark shuffle's memory-tier objects leave Ray's object store when Spark unregisters
the shuffle, not whenever the executors' JVMs next collect garbage. Real RayDP Spark on a
local Ray."""

from __future__ import annotations

import re
import time
import uuid

import pytest

import spark_bridge
from conftest import start_local_ray
from hybrid_ray import MiB, ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _object_store_mib() -> float:
    """MiB the node's object store holds now (Ray's memory summary)."""
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray._private.worker.global_worker.node.address,
                          stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB", text)
    return float(found.group(1)) if found else 0.0


def _start_spark(tmp_path, app_name: str, **configs: str):
    """A two-executor RayDP Spark through hybrid_ray with a 256 MiB memory tier (a
    namespace of its own) and AQE off; returns the session and its ShuffleConfig."""
    start_local_ray()
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")],
                           memory_capacity_bytes=256 * MiB, progress=False,
                           namespace=f"{app_name}-{uuid.uuid4().hex[:6]}")
    spark = spark_bridge.init_spark(app_name, num_executors=2, executor_cores=1,
                                    executor_memory="1GB", shuffle_config=config,
                                    configs={"spark.sql.adaptive.enabled": "false",
                                             **configs})
    spark.sparkContext.setLogLevel("OFF")
    return spark, config


def _wide_rows(spark):
    """400,000 rows of a key of 8 values and a 128-character value, repartitioned by key."""
    return spark.range(0, 400_000, numPartitions=4).selectExpr(
        "id % 8 as k", "sha2(cast(id as string), 512) as v").repartition(8, "k")


def test_an_unregistered_shuffle_s_memory_objects_leave_the_object_store(tmp_path):
    """Was: unregisterShuffle dropped the executors' refs, but Ray's Java runtime lets go
    of an object only when its ObjectRefImpl is garbage collected: 39 MiB stayed in the
    store 10 s later (until a forced GC freed them at once), while the tier manager's books
    had already given that memory back to the next shuffles."""
    import ray

    spark, config = _start_spark(tmp_path, "object-cleanup")
    try:
        before = _object_store_mib()
        # v is read after the exchange, so it is shuffled (with count() alone it was not).
        total = _wide_rows(spark).selectExpr("sum(length(v)) as n").collect()[0].n
        assert total == 400_000 * 128
        written = _object_store_mib()
        reports = spark_bridge.spark_shuffle_reports()
        assert written - before >= 20, (before, written, [r.bytes_per_tier() for r in reports])
        master = ray.get_actor("hybrid_ray_shuffle_master", namespace=config.namespace)
        live = [s for s in ray.get(master.live_shuffles.remote(), timeout=30)
                if s.startswith("spark-")]
        assert live
        cleaner = spark.sparkContext._jsc.sc().cleaner().get()
        for shuffle in live:
            cleaner.doCleanupShuffle(int(shuffle.rsplit("-", 1)[1]), True)
        deadline = time.monotonic() + 15
        while _object_store_mib() - before >= 5 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _object_store_mib() - before < 5, (before, written, _object_store_mib())
    finally:
        spark_bridge.stop_spark()


def test_a_dead_executor_s_map_outputs_leave_the_node_s_books(tmp_path):
    """Was: an executor died, Ray freed its memory-tier objects and Spark recomputed its
    maps (before any reader asked for them), but the node's memory books kept counting
    the dead objects (60 MiB against 48 MiB in the store) until the shuffle's release,
    which Spark may not ask for while the lineage lives. The driver now tells the master
    which executor Spark removed, and the master drops the attempts it wrote."""
    import ray

    from hybrid_ray.actors import get_tier_manager

    spark, config = _start_spark(tmp_path, "dead-executor", **{"spark.task.maxFailures": "4"})
    tm = get_tier_manager(ray.get_runtime_context().get_node_id(), config.namespace)

    def books_mib() -> float:
        usage = ray.get(tm.usage.remote(), timeout=30)
        return sum(t.used_bytes for t in usage.tiers if t.tier.value == "memory") / MiB

    try:
        # One JVM RDD over one exchange, counted twice: the second count reuses the map
        # outputs of the first, the dead executor's recomputed.
        rows = _wide_rows(spark)._jdf.rdd()
        assert rows.count() == 400_000
        time.sleep(2)
        first = books_mib()
        assert first >= 20, first  # the map outputs are in the memory tier
        executors = sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"].startswith("raydp-executor-")),
                           key=lambda a: a["name"])
        victim = executors[-1]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
        assert rows.count() == 400_000
        deadline = time.monotonic() + 15
        while books_mib() > _object_store_mib() + 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert books_mib() <= _object_store_mib() + 4, (first, books_mib(),
                                                         _object_store_mib())
        # The driver named the last task it launched on the removed executor (a late
        # commit of one of its attempts is dropped: test_spark_jvm_books).
        from hybrid_ray.actors import get_master
        lost = ray.get(get_master(config.namespace).__ray_call__.remote(
            lambda master: dict(master.registry.spark_lost_executors)), timeout=30)
        assert len(lost) == 1 and min(lost.values()) >= 0, lost
    finally:
        spark_bridge.stop_spark()
