"""Spark's I/O encryption (``spark.io.encryption.enabled``) through HybridRayShuffleManager
on real RayDP Spark: records then cannot stay serialized between flushes, so up to Spark's
bypass threshold the direct writer keeps a serializer and cipher stream per partition, and
above it Spark's serialized writer writes into hybrid_ray's tiers. Both must give exactly
the input rows, with the bytes in the tiers, also with thousands of partitions in a small
executor. One session for the module (~1.5 min).

SQL's exchanges hand the writer one reused row object when Spark would take its serialized
path (``ShuffleExchangeExec`` copies rows only for writers that buffer objects): serving
such a shuffle with Spark's sort writer instead, to save those streams' memory, returned
each map's last row 20,000 times here. Any such change must keep this module green."""

from __future__ import annotations

import uuid

import pytest

import spark_bridge
from conftest import start_local_ray
from hybrid_ray import ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    start_local_ray()
    config = ShuffleConfig(spill_dirs=[str(tmp_path_factory.mktemp("spill"))],
                           namespace=f"io-encryption-{uuid.uuid4().hex[:6]}", progress=False)
    session = spark_bridge.init_spark(
        "io-encryption-tests", num_executors=1, executor_cores=2, executor_memory="512MB",
        configs={"spark.io.encryption.enabled": "true",
                 "spark.sql.adaptive.enabled": "false"},
        shuffle_config=config)
    session.sparkContext.setLogLevel("OFF")
    yield session
    spark_bridge.stop_spark()


@pytest.mark.parametrize("partitions", [8, 300])
def test_an_encrypted_exchange_gives_exactly_the_input_rows(spark, partitions):
    """8 partitions, and 300 (above Spark's bypass threshold of 200: Spark's serialized
    path, which hybrid_ray's direct writer takes over)."""
    before = len(spark_bridge.spark_shuffle_reports())
    df = spark.range(0, 60_000, numPartitions=3).selectExpr(
        "id", "cast(id % 101 as int) as k", "concat('v-', cast(id as string)) as v")
    out = df.repartition(partitions, "k")
    assert out.rdd.getNumPartitions() == partitions
    rows = sorted((r.id, r.k, r.v) for r in out.collect())
    assert rows == [(i, i % 101, f"v-{i}") for i in range(60_000)]
    reports = spark_bridge.spark_shuffle_reports()[before:]
    assert [r.num_partitions for r in reports] == [partitions]
    assert sum(reports[0].bytes_per_tier().values()) > 0, reports[0].bytes_per_tier()


def test_thousands_of_encrypted_partitions_fit_a_small_executor(spark):
    """4,000 partitions in a 512 MB executor. A cipher and codec stream per partition kept
    open for a whole map task (~100 KiB each) ran this executor out of heap at 2,500
    partitions; the serialized writer's memory does not grow with the partition count.
    AQE coalesces the 4,000 reduce partitions into a few tasks (the test stays quick)."""
    before = len(spark_bridge.spark_shuffle_reports())
    spark.conf.set("spark.sql.adaptive.enabled", "true")
    spark.conf.set("spark.sql.shuffle.partitions", "4000")
    try:
        df = spark.range(0, 200_000, numPartitions=2).selectExpr(
            "id", "cast(id % 9973 as int) as k", "concat('v-', cast(id as string)) as v")
        rows = sorted((r.id, r.k, r.v) for r in df.repartition("k").collect())
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", "false")
        spark.conf.unset("spark.sql.shuffle.partitions")
    assert rows == [(i, i % 9973, f"v-{i}") for i in range(200_000)]
    reports = spark_bridge.spark_shuffle_reports()[before:]
    assert [r.num_partitions for r in reports] == [4000]
    assert sum(reports[0].bytes_per_tier().values()) > 0, reports[0].bytes_per_tier()
