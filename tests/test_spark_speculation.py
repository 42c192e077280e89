"""Spark speculation through HybridRayShuffleManager on real RayDP Spark: a map task made slow
in its first attempt gets a speculative copy, the copy wins, the slow attempt is killed
mid-write, and the exchange still yields exactly the input rows, from one attempt per map.

Spark never launches a speculative copy on a host that already runs an attempt of the task
(``TaskSetManager.dequeueTaskFromList``: ``!(speculative && hasAttemptOnHost(index, host))``),
and RayDP names an executor's host by its Ray node's IP. On the single-node Ray of the other
Spark modules both executors share one host, so Spark marks the slow task speculatable and
never starts the copy. This module therefore runs a two-node Ray cluster whose second node
has its own loopback address (127.0.0.2), one executor per node (~1 min)."""

from __future__ import annotations

import glob
import os
import re
import sys
import threading
import time

import pytest
import ray

import spark_bridge
from hybrid_ray import KiB, ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SECOND_NODE_IP = "127.0.0.2"
ROWS, MAPS, SLOW_MAP = 80_000, 4, 1
# The slow first attempt of SLOW_MAP sleeps this long after half its rows: far longer than
# the speculative copy needs (the job must not wait for it), so only a kill ends it.
SLOW_S = 60
SPECULATION_CONFIGS = {
    "spark.speculation": "true",
    "spark.speculation.multiplier": "1",
    "spark.speculation.quantile": "0.1",
    "spark.speculation.interval": "100ms",
    # Speculate the slow task only once it ran this long: by then its first attempt has
    # stored segments (its executor's Python workers are warm), so the kill hits a writer
    # with output in hybrid_ray.
    "spark.speculation.minTaskRuntime": "3s",
    "spark.task.maxFailures": "4",
}
SEGMENT_FILE = re.compile(r"m(\d+)-a(\d+)-s(\d+)\.seg$")


@pytest.fixture(scope="module")
def two_host_cluster():
    """A Ray cluster of two 1-CPU nodes on different IPs (Spark hosts), this process
    connected; the session's single-node Ray is shut down first and comes back for later
    modules through ``start_local_ray``."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    cluster = Cluster()
    cluster.add_node(num_cpus=1, object_store_memory=300 * 1024**2)
    try:
        cluster.add_node(num_cpus=1, object_store_memory=300 * 1024**2,
                         node_ip_address=SECOND_NODE_IP)
    except Exception as exc:  # noqa: BLE001 - no second loopback address on this host
        cluster.shutdown()
        pytest.skip(f"cannot start a Ray node on {SECOND_NODE_IP} ({exc}); Spark speculates "
                    "only onto another host")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {
                 "PYTHONPATH": f"{os.path.dirname(tests_dir)}:{tests_dir}"}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _slow_first_attempt(index, rows):
    """Map ``SLOW_MAP``'s first attempt emits half its rows (the shuffle writer stores
    some of them), then stalls; every other attempt runs at full speed."""
    from pyspark import TaskContext

    attempt = TaskContext.get().attemptNumber()
    for i, row in enumerate(rows):
        if index == SLOW_MAP and attempt == 0 and i == ROWS // MAPS // 2:
            time.sleep(SLOW_S)
        yield row


def _payload(x):
    """A row's value: barely compressible, so the stalled attempt's first half (~1 MB)
    fills several flushes of its writer, however well Spark's codec compresses."""
    import hashlib

    return (x, hashlib.sha256(str(x).encode()).hexdigest())


def _map_stage_tasks(spark, job_group):
    """(index, task id, attempt, speculative, status) of each task of the job's map stage,
    from Spark's status store."""
    sc = spark.sparkContext
    (job_id,) = sc.statusTracker().getJobIdsForGroup(job_group)
    map_stage = min(sc.statusTracker().getJobInfo(job_id).stageIds)
    tasks = sc._jsc.sc().statusStore().taskList(map_stage, 0, 1000)
    out, it = [], tasks.iterator()
    while it.hasNext():
        t = it.next()
        out.append((t.index(), t.taskId(), t.attempt(), t.speculative(), t.status()))
    return sorted(out)


def _segment_files(spill_root):
    """(map index, Spark map attempt id) of each disk segment file of a Spark shuffle."""
    out = []
    for path in glob.glob(os.path.join(spill_root, "spill-*", "hybrid_ray", "spark-*",
                                       "sub-*", "*.seg")):
        m = SEGMENT_FILE.search(path)
        out.append((int(m.group(1)), int(m.group(2))))
    return out


@pytest.fixture(scope="module")
def speculated(two_host_cluster, tmp_path_factory):
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    root = str(tmp_path_factory.mktemp("speculation"))
    # No memory tier: every segment is a file whose name says its map and attempt. Small
    # flushes: the slow attempt has stored segments before it stalls.
    config = ShuffleConfig(spill_dirs=[os.path.join(root, "spill-{node_id}")],
                           memory_capacity_bytes=0, segment_bytes={"memory": 16 * KiB},
                           map_chunk_bytes=32 * KiB, progress=False)
    spark = spark_bridge.init_spark("hybrid-speculation", num_executors=2, executor_cores=1,
                                    executor_memory="500MB", configs=SPECULATION_CONFIGS,
                                    shuffle_config=config)
    out: dict = {"config": config}
    try:
        sc = spark.sparkContext
        sc.setLogLevel("ERROR")
        # Warm both executors' Python workers, so the slow attempt writes at once.
        assert sc.parallelize(range(8), 8).map(lambda x: x + 1).sum() == 36
        sc.setJobGroup("speculation", "a slow map task gets a speculative copy")
        pairs = sc.parallelize(range(ROWS), MAPS).mapPartitionsWithIndex(
            _slow_first_attempt).map(lambda x: (x % 13, _payload(x)))
        # Every segment file seen while the job runs, the killed attempt's included.
        seen: set = set()
        running = threading.Event()
        running.set()

        def watch():
            while running.is_set():
                seen.update(_segment_files(root))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start = time.monotonic()
        try:
            out["rows"] = pairs.partitionBy(4).collect()
        finally:
            out["seconds"] = time.monotonic() - start
            running.clear()
            watcher.join()
        out["seen"] = seen
        # Spark kills the losing attempt after the job: wait (bounded) until it ended.
        deadline = time.monotonic() + 60
        out["tasks"] = _map_stage_tasks(spark, "speculation")
        while time.monotonic() < deadline and any(t[4] == "RUNNING" for t in out["tasks"]):
            time.sleep(0.2)
            out["tasks"] = _map_stage_tasks(spark, "speculation")
        # The loser's segments are deleted by the master's queue after its abort: wait
        # (bounded) until the files left are stable.
        deadline = time.monotonic() + 30
        files = _segment_files(root)
        while time.monotonic() < deadline:
            time.sleep(1.0)
            again = _segment_files(root)
            if again == files and len({a for _, a in files}) == MAPS:
                break
            files = again
        out["files"] = _segment_files(root)
        out["reports"] = spark_bridge.spark_shuffle_reports()
    finally:
        spark_bridge.stop_spark()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    out["files_after_stop"] = _segment_files(root)
    return out


def test_slow_map_got_a_speculative_copy_that_won(speculated):
    tasks = speculated["tasks"]
    slow = [t for t in tasks if t[0] == SLOW_MAP]
    assert [(t[2], t[3]) for t in slow] == [(0, False), (1, True)], tasks
    assert {t[4] for t in slow} == {"SUCCESS", "KILLED"}, tasks
    assert [t[4] for t in slow if t[3]] == ["SUCCESS"], "the speculative copy did not win"
    # The job did not wait for the stalled attempt.
    assert speculated["seconds"] < SLOW_S - 10, speculated["seconds"]


def test_exchange_rows_are_exactly_the_input(speculated):
    expected = sorted((x % 13, _payload(x)) for x in range(ROWS))
    assert sorted(speculated["rows"]) == expected


def test_only_the_accepted_attempt_of_each_map_keeps_segments(speculated):
    accepted = {t[0]: t[1] for t in speculated["tasks"] if t[4] == "SUCCESS"}
    assert len(accepted) == MAPS
    files = speculated["files"]
    assert files, "no disk segments: the test would prove nothing"
    # Every stored segment belongs to the attempt Spark accepted for its map (the task id
    # is Spark's map attempt id), and every map has some: the killed attempt's are gone.
    assert {(i, a) for i, a in files} == set(accepted.items()), (files, accepted)
    # The killed attempt had stored segments before it stalled (seen while the job ran);
    # none of them is left, and the master counts its output as dropped.
    (killed,) = [t[1] for t in speculated["tasks"] if t[0] == SLOW_MAP and t[4] == "KILLED"]
    assert (SLOW_MAP, killed) in speculated["seen"], sorted(speculated["seen"])
    (report,) = [r for r in speculated["reports"] if r.num_maps == MAPS]
    assert report.superseded_attempts == 1, report
    assert sum(n for tiers in report.per_node_tier.values()
               for _, n in tiers.values()) == len(files)


def test_nothing_left_after_stop(speculated):
    assert speculated["files_after_stop"] == []
