"""A Spark job whose shuffle does not fit the node's disk: with Spark's own shuffle it dies
with "No space left on device"; through hybrid_ray's shuffle manager it finishes exactly,
its segments spread over the memory tier, the capped disk tier and the remote tier (S3
over HTTP: moto), and nothing is left anywhere after ``stop_spark``.

Spark's local dir and hybrid_ray's spill dir share one 24 MiB tmpfs; the shuffle writes
about 70 MB (600,000 rows of 128 hex characters, compressed by Spark's lz4)."""

from __future__ import annotations

import hashlib
import os

import pytest

import spark_bridge
from conftest import files_under, mounted_tmpfs, start_local_ray
from hybrid_ray import MiB, ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]

ROWS = 600_000
KEYS = 1000


@pytest.fixture(scope="module")
def tiny_disk():
    yield from mounted_tmpfs(24, "the capped-disk contrast needs a disk that fills up")


@pytest.fixture(scope="module")
def bucket(moto_endpoint):
    import uuid

    import s3fs

    from conftest import S3_KEY, S3_SECRET

    options = {"endpoint_url": moto_endpoint, "key": S3_KEY, "secret": S3_SECRET}
    name = f"hr-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(name)
    yield f"s3://{name}/shuffle", options, fs, name
    fs.rm(name, recursive=True)


def _expected():
    """Per key: row count, and the largest value, computed without Spark."""
    out = {}
    for i in range(ROWS):
        v = (hashlib.sha256(str(i).encode()).hexdigest()
             + hashlib.sha256(str(i + 7).encode()).hexdigest())
        k = i % KEYS
        n, m = out.get(k, (0, ""))
        out[k] = (n + 1, max(m, v))
    return sorted((k, n, m) for k, (n, m) in out.items())


def _run(hybrid: bool, disk: str, config: ShuffleConfig):
    from pyspark.sql import functions as F

    start_local_ray()
    local_dir = os.path.join(disk, f"local-{'hybrid' if hybrid else 'own'}")
    os.makedirs(local_dir, exist_ok=True)
    spark = spark_bridge.init_spark(
        "capped-disk-tests", num_executors=2, executor_cores=1, executor_memory="1GB",
        configs={"spark.sql.shuffle.partitions": "4", "spark.local.dir": local_dir,
                 "spark.sql.adaptive.enabled": "false", "spark.task.maxFailures": "2"},
        shuffle_config=config, hybrid_shuffle=hybrid)
    spark.sparkContext.setLogLevel("ERROR")
    out: dict = {}
    try:
        df = spark.range(0, ROWS, numPartitions=4).selectExpr(
            f"id % {KEYS} as k",
            "concat(sha2(cast(id as string), 256), sha2(cast(id + 7 as string), 256)) as v")
        query = df.repartition(4, "k").groupBy("k").agg(F.count("*").alias("n"),
                                                        F.max("v").alias("m"))
        try:
            out["rows"] = sorted(tuple(r) for r in query.collect())
        except Exception as exc:  # noqa: BLE001 - Spark's own shuffle is expected to fail
            out["error"] = str(exc)
    finally:
        spark_bridge.stop_spark()
    out["reports"] = spark_bridge.spark_shuffle_reports() if hybrid else []
    return out


@pytest.fixture(scope="module")
def runs(tiny_disk, bucket):
    remote_path, options, fs, name = bucket
    config = ShuffleConfig(spill_dirs=[os.path.join(tiny_disk, "spill")],
                           memory_capacity_bytes=1 * MiB, remote_path=remote_path,
                           storage_options=options, progress=False)
    hybrid = _run(True, tiny_disk, config)
    hybrid["s3_left"] = fs.find(name)
    hybrid["spill_left"] = files_under(os.path.join(tiny_disk, "spill"))
    own = _run(False, tiny_disk, config)
    return hybrid, own


def test_sparks_own_shuffle_runs_out_of_disk(runs):
    _, own = runs
    assert "rows" not in own
    assert "No space left on device" in own["error"]


def test_hybrid_ray_finishes_exactly_through_the_remote_tier(runs):
    hybrid, _ = runs
    assert "error" not in hybrid, hybrid.get("error", "")[:2000]
    assert hybrid["rows"] == _expected()
    totals: dict[str, int] = {}
    for report in hybrid["reports"]:
        for tier, nbytes in report.bytes_per_tier().items():
            totals[tier] = totals.get(tier, 0) + nbytes
    assert totals.get("memory", 0) > 0, totals
    assert totals.get("disk", 0) > 0, totals
    assert totals.get("remote", 0) > 24 * MiB, totals  # more than the whole disk holds


def test_nothing_left_in_s3_or_the_spill_dir(runs):
    hybrid, _ = runs
    assert hybrid["s3_left"] == []
    assert hybrid["spill_left"] == []
