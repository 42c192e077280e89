"""Spark's I/O encryption (``spark.io.encryption.enabled``) through HybridRayShuffleManager
on real RayDP Spark: records then cannot stay serialized between flushes, so the direct
writer keeps a serializer and cipher stream per partition; a few partitions and more than
Spark's bypass threshold must both give exactly the input rows, with the bytes in
hybrid_ray's tiers. One session for the module (~1 min).

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
        "io-encryption-tests", num_executors=1, executor_cores=2, executor_memory="1GB",
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
