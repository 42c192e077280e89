"""A Spark map task whose write fails part-way gives back the tier space of what it
wrote: the batch's files are deleted by its abort, so space still counted for them would
refuse later segments while the disk is empty. Real RayDP Spark on a local Ray."""

from __future__ import annotations

import os
import uuid

import pytest

import spark_bridge
from conftest import start_local_ray
from hybrid_ray import MiB, ShuffleConfig, TierName

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_a_map_task_that_runs_out_of_space_gives_back_what_it_wrote(tmp_path):
    """Memory tier off, no remote tier, a disk tier of 3 MiB: the map task's one batch
    (about 12 MB in 8 partitions) gets a few disk grants, writes those segments, and is
    refused the rest. The task fails, Spark retries it once, the job fails naming the
    full tier; then the node's books must hold none of it. Before the fix each attempt
    left its written segments counted (settled as written, then deleted by the abort)."""
    import ray
    from pyspark.sql import functions as F

    from hybrid_ray.actors import existing_tier_manager

    start_local_ray()
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], memory_capacity_bytes=0,
                           disk_capacity_bytes=3 * MiB, segment_bytes={"disk": 1 * MiB},
                           namespace=f"failed-writes-{uuid.uuid4().hex[:6]}", progress=False)
    spark = spark_bridge.init_spark(
        "failed-writes-tests", num_executors=1, executor_cores=1, executor_memory="1GB",
        configs={"spark.sql.adaptive.enabled": "false", "spark.task.maxFailures": "2"},
        shuffle_config=config)
    spark.sparkContext.setLogLevel("OFF")
    try:
        df = spark.range(0, 200_000, numPartitions=1).selectExpr(
            "id % 1000 as k",
            "concat(sha2(cast(id as string), 256), sha2(cast(id + 7 as string), 256)) as v")
        with pytest.raises(Exception, match="no tier can take a segment"):
            df.repartition(8, "k").groupBy("k").agg(F.max("v")).collect()
        tm = existing_tier_manager(ray.get_runtime_context().get_node_id(), config.namespace)
        assert tm is not None
        usage = ray.get(tm.usage.remote(), timeout=60)
        used = {t.tier: t.used_bytes for t in usage.tiers}
        assert used.get(TierName.DISK) == 0, usage
        assert used.get(TierName.MEMORY) == 0, usage
        files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "spill") for f in fs
                 if f.endswith(".seg")]
        assert files == []  # the aborts deleted what the attempts wrote
    finally:
        spark_bridge.stop_spark()



def _start_tier_manager(actor_class: type, prefix: str):
    """A new namespace (``prefix``-<random>) whose tier manager on this node is an
    ``actor_class`` (a ``TierManagerActor`` subclass that injects a fault) started here
    first, so the Spark session's shuffle manager finds it; returns (namespace, actor)."""
    import ray

    from hybrid_ray.actors import TIER_MANAGER_PREFIX

    start_local_ray()
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    node_id = ray.get_runtime_context().get_node_id()
    tm = ray.remote(num_cpus=0)(actor_class).options(
        name=TIER_MANAGER_PREFIX + node_id, namespace=namespace, lifetime="detached"
    ).remote(node_id, namespace)
    return namespace, tm


def test_a_reservation_whose_answer_never_came_is_given_back_by_the_abort(tmp_path):
    """The node's tier manager answers every JVM reservation after 3 s, past the JVM's
    1.5 s call bound: each map attempt's reservation fails while the tier manager still
    runs it and grants space the writer never hears of. The job fails; the attempts'
    aborts cancel those reservations by their tokens, so the node's books come back to
    nothing (before: the grants stayed counted, in flight on the disk, until the
    shuffle's release)."""
    import time

    import ray

    from hybrid_ray.actors import TierManagerActor

    class SlowReservations(TierManagerActor.__ray_metadata__.modified_class):
        def spark_reserve(self, request: str) -> str:
            time.sleep(3)
            return super().spark_reserve(request)

    namespace, tm = _start_tier_manager(SlowReservations, "lost-reserve")
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], memory_capacity_bytes=0,
                           namespace=namespace, progress=False)
    try:
        spark = spark_bridge.init_spark(
            "lost-reserve-tests", num_executors=1, executor_cores=1, executor_memory="1GB",
            configs={"spark.sql.adaptive.enabled": "false", "spark.task.maxFailures": "2",
                     "spark.hybridray.callTimeoutMs": "1500ms"},
            shuffle_config=config)
        spark.sparkContext.setLogLevel("OFF")
        df = spark.range(0, 50_000, numPartitions=1).selectExpr("id % 100 as k", "id as v")
        with pytest.raises(Exception, match="spark_reserve failed"):
            df.repartition(4, "k").groupBy("k").count().collect()
        deadline = time.monotonic() + 30  # the cancels travel from the executor's sender
        while True:
            usage = ray.get(tm.usage.remote(), timeout=60)
            used = {t.tier: t.used_bytes for t in usage.tiers}
            if not any(used.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert used.get(TierName.DISK) == 0, usage
        assert used.get(TierName.MEMORY) == 0, usage
    finally:
        spark_bridge.stop_spark()
        ray.kill(tm)


def test_remote_segments_of_a_failed_batch_are_deleted_by_the_abort(tmp_path):
    """Memory and disk tiers off: every segment goes to the remote tier (``file://``),
    written by the node's tier manager, which fails every second remote write. Each map
    attempt stores a segment remotely, then fails on the next one; its batch is never
    committed, so only the attempt itself knows that segment. Its abort deleted the
    batch's disk files and dropped its objects, but not its remote segments: they stayed
    in the remote store until the shuffle's release (found by a review)."""
    import time

    import ray

    from hybrid_ray.actors import TierManagerActor

    class FailingRemoteWrites(TierManagerActor.__ray_metadata__.modified_class):
        def spark_write_remote(self, request: str, frame: bytes) -> str:
            self.remote_writes = getattr(self, "remote_writes", 0) + 1
            if self.remote_writes % 2 == 0:
                raise OSError("injected: the remote store refused the write")
            return super().spark_write_remote(request, frame)

    namespace, tm = _start_tier_manager(FailingRemoteWrites, "failed-remote")
    remote = tmp_path / "remote"
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], memory_capacity_bytes=0,
                           disk_capacity_bytes=0, remote_path=f"file://{remote}",
                           namespace=namespace, progress=False)
    try:
        spark = spark_bridge.init_spark(
            "failed-remote-tests", num_executors=1, executor_cores=1, executor_memory="1GB",
            configs={"spark.sql.adaptive.enabled": "false", "spark.task.maxFailures": "2"},
            shuffle_config=config)
        spark.sparkContext.setLogLevel("OFF")
        df = spark.range(0, 50_000, numPartitions=1).selectExpr("id % 100 as k", "id as v")
        with pytest.raises(Exception, match="injected"):
            df.repartition(4, "k").groupBy("k").count().collect()
        attempts = ray.get(tm.__ray_call__.remote(lambda self: self.remote_writes),
                           timeout=60)
        assert attempts >= 2  # each attempt stored one segment before its write failed
        deadline = time.monotonic() + 30  # the deletes travel from the executor's sender
        while True:
            files = [os.path.join(d, f) for d, _, fs in os.walk(remote) for f in fs
                     if f.endswith(".seg")]
            if not files or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert files == []  # the aborts deleted what the attempts stored remotely
    finally:
        spark_bridge.stop_spark()
        ray.kill(tm)
