"""HybridRayShuffleManager (jvm/) on real RayDP Spark: the same queries with hybrid_ray's
shuffle manager and with Spark's own shuffle give the same rows; segments really went
through hybrid_ray's memory and disk tiers; retried tasks and lost segments stay exact;
nothing is left after ``stop_spark``. Two Spark sessions for the module (~1 min each)."""

from __future__ import annotations

import glob
import os

import pytest
import ray

import spark_bridge
from conftest import files_under, start_local_ray
from hybrid_ray import MiB, ShuffleConfig

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SPARK_CONFIGS = {
    "spark.sql.shuffle.partitions": "6",
    "spark.sql.autoBroadcastJoinThreshold": "-1",   # joins shuffle both sides
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.adaptive.coalescePartitions.enabled": "true",
    "spark.sql.adaptive.advisoryPartitionSizeInBytes": "64k",
    "spark.sql.adaptive.skewJoin.enabled": "true",
    "spark.sql.adaptive.skewJoin.skewedPartitionFactor": "2",
    "spark.sql.adaptive.skewJoin.skewedPartitionThresholdInBytes": "32k",
    "spark.task.maxFailures": "4",
    # Map tasks lease memory when they start (a 4 MiB default would never fit the tests'
    # 1 MiB memory tier): a batch that fits goes to memory without a reservation call.
    "spark.hybridray.leaseBytes": "96k",
}


def _tables(spark):
    orders = spark.range(0, 120_000, numPartitions=4).selectExpr(
        "id", "cast(id % 499 as int) as customer", "cast((id * 7919) % 10007 as long) as cents",
        "if(id % 11 = 0, null, concat('sku-', cast(id % 37 as string))) as sku")
    customers = spark.range(0, 520, numPartitions=2).selectExpr(
        "cast(id as int) as customer", "concat('c-', cast(id % 23 as string)) as country")
    # 60% of the rows on key 0: AQE splits that partition into map ranges (skew join).
    skewed = spark.range(0, 100_000, numPartitions=4).selectExpr(
        "if(id % 10 < 6, 0, id % 1000) as k", "id as v")
    keys = spark.range(0, 1000, numPartitions=2).selectExpr("id as k", "id * 3 as w")
    return orders, customers, skewed, keys


def _flaky_on_first_attempt(rows):
    """Fail the first attempt of partition 1 after it consumed most of its input."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    out = []
    for i, row in enumerate(rows):
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0 and i == 20_000:
            raise RuntimeError("injected failure of a first attempt")
        out.append(row)
    return iter(out)


def _queries(spark):
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    orders, customers, skewed, keys = _tables(spark)
    sc = spark.sparkContext
    pairs = sc.parallelize(range(50_000), 5).map(lambda x: (x % 101, x))
    return {
        "group_by_agg": lambda: orders.groupBy("customer").agg(
            F.count("*").alias("n"), F.sum("cents").alias("s"), F.max("sku").alias("m")),
        "group_by_nullable_string": lambda: orders.groupBy("sku").agg(F.avg("cents")),
        "inner_join_agg": lambda: orders.join(customers, "customer").groupBy("country").agg(
            F.sum("cents").alias("revenue"), F.countDistinct("customer").alias("c")),
        "left_join": lambda: customers.join(
            orders.where("id % 7 = 0"), "customer", "left").select("customer", "country", "id"),
        "window_rank": lambda: orders.withColumn("r", F.row_number().over(
            Window.partitionBy("customer").orderBy(F.desc("cents"), "id"))).where("r <= 3"),
        "distinct": lambda: orders.select("sku", (F.col("cents") % 13).alias("b")).distinct(),
        "order_by": lambda: orders.orderBy(F.desc("cents"), "id").limit(500),
        "skew_join": lambda: skewed.join(keys, "k").groupBy((F.col("v") % 17).alias("g")).agg(
            F.count("*").alias("n"), F.sum("w").alias("sw")),
        "rdd_reduce_by_key": lambda: pairs.reduceByKey(lambda a, b: a + b),
        "rdd_sort_by_key": lambda: pairs.sortByKey(ascending=False, numPartitions=3),
        "rdd_group_by_key": lambda: pairs.groupByKey().mapValues(sorted),
        "retried_map_task": lambda: orders.rdd.mapPartitions(_flaky_on_first_attempt).map(
            lambda r: (r.customer, r.cents)).reduceByKey(lambda a, b: a + b),
    }


def _collect(result):
    rows = result.collect()
    return [tuple(r) for r in rows] if rows and hasattr(rows[0], "__fields__") else rows


def _direct_path_takes_the_given_config(spark, config: ShuffleConfig) -> dict:
    """``repartition``'s direct parquet path in a session of Spark's own shuffle: it must
    use the ``shuffle_config`` given to init_spark (here a 1 MiB memory tier, so the rows
    reach the disk tier), not the defaults it took before (all in memory, spill to /tmp)."""
    path = os.path.join(os.path.dirname(config.spill_dirs[0]), "direct-input")
    spark.range(0, 200_000, numPartitions=4).selectExpr(
        "id", "id % 97 as k", "repeat('x', 40) as pad").write.parquet(path)
    out = spark_bridge.repartition(spark.read.parquet(path), 4, "k")
    rows = sorted(tuple(r) for r in out.select("id", "k").collect())
    report = spark_bridge.last_report()
    tiers = {tier for node in report.per_node_tier.values()
             for tier, (nbytes, _) in node.items() if nbytes}
    spark_bridge.release(out)
    return {"exact": rows == [(i, i % 97) for i in range(200_000)], "tiers": tiers}


def _run_session(hybrid: bool, config: ShuffleConfig) -> dict:
    start_local_ray()
    spark = spark_bridge.init_spark("hybrid-shuffle-tests", num_executors=2, executor_cores=1,
                                    executor_memory="1GB", configs=SPARK_CONFIGS,
                                    shuffle_config=config, hybrid_shuffle=hybrid)
    spark.sparkContext.setLogLevel("ERROR")
    out: dict = {"rows": {}}
    try:
        for name, query in _queries(spark).items():
            rows = _collect(query())
            # Sorted rows, except where the query's own order is the result. sortByKey
            # orders by key only: rows of equal keys come in fetch order, which no shuffle
            # fixes, so its keys' order and its rows' multiset are compared.
            if name == "order_by":
                out["rows"][name] = rows
            elif name == "rdd_sort_by_key":
                out["rows"][name] = ([k for k, _ in rows], sorted(rows, key=repr))
            else:
                out["rows"][name] = sorted(rows, key=repr)
        out["shuffle_metrics"] = _shuffle_metrics(spark)
        if hybrid:
            out["books"] = _memory_books(config)
            out["plans"] = spark.sparkContext.getConf().get("spark.shuffle.manager")
            out["lost"] = _lost_segment_recovers(spark, config)
            out["unregistered"] = _unregistered_shuffles_are_released(spark, config)
            out["known_early"] = _shuffle_known_before_its_maps_commit(spark, config)
            out["barrier"] = _barrier_stage_falls_back(spark)  # needs both executors
            out["killed"] = _killed_executor_recovers(spark)
            out["tier_manager_restarted"] = _tier_manager_started_again_recovers(
                spark, config)
            out["reports_live"] = spark_bridge.spark_shuffle_reports()
        else:
            out["direct"] = _direct_path_takes_the_given_config(spark, config)
        jvm = spark.sparkContext._jvm
        manager = jvm.org.apache.spark.SparkEnv.get().shuffleManager()
    finally:
        spark_bridge.stop_spark()
    if hybrid:
        # Spark's cleaner may unregister a shuffle after the manager stopped: that built
        # a new context (and its sender thread) nothing would stop.
        manager.unregisterShuffle(123_456)
        out["context_after_stop"] = \
            jvm.org.apache.spark.shuffle.hybridray.HybridRayContext.exists()
        out["reports"] = spark_bridge.spark_shuffle_reports()
        out["leftover_files"] = [f for d in config.spill_dirs for f in files_under(d)]
        from hybrid_ray.actors import get_tier_manager
        usage = ray.get(get_tier_manager(ray.get_runtime_context().get_node_id(),
                                         config.namespace).usage.remote())
        out["tier_bytes"] = {t.tier.value: t.used_bytes for t in usage.tiers}
        out["live"] = [s for s in ray.get(
            ray.get_actor("hybrid_ray_shuffle_master", namespace=config.namespace)
            .live_shuffles.remote()) if s.startswith("spark-")]
    return out


def _shuffle_metrics(spark) -> dict:
    """Shuffle bytes and records written and read, summed over the application's stages,
    from Spark's own status store (what its UI, REST API and event log show)."""
    store = spark.sparkContext._jsc.sc().statusStore()
    # stageList(statuses, details, withSummaries, quantiles, taskStatus): all stages, plain.
    quantiles = getattr(store, "stageList$default$4")()  # Scala's default: an empty array
    stages = store.stageList(None, False, False, quantiles, None)
    totals = {"write_bytes": 0, "write_records": 0, "read_bytes": 0, "read_records": 0}
    for i in range(stages.size()):
        stage = stages.apply(i)
        totals["write_bytes"] += stage.shuffleWriteBytes()
        totals["write_records"] += stage.shuffleWriteRecords()
        totals["read_bytes"] += stage.shuffleReadBytes()
        totals["read_records"] += stage.shuffleReadRecords()
    return totals


def _memory_books(config, timeout_s: float = 10.0) -> dict:
    """The node's memory-tier books against the memory bytes the live Spark shuffles
    committed: equal once the writers' last settlements (sent without waiting) arrived. A
    lease not given back, or a grant settled twice, leaves them apart."""
    import time

    from hybrid_ray.actors import get_tier_manager

    tm = get_tier_manager(ray.get_runtime_context().get_node_id(), config.namespace)
    master = ray.get_actor("hybrid_ray_shuffle_master", namespace=config.namespace)
    deadline = time.monotonic() + timeout_s
    while True:
        usage = ray.get(tm.usage.remote())
        books = sum(t.used_bytes for t in usage.tiers if t.tier.value == "memory")
        stored = sum(nbytes for s in ray.get(master.spark_reports.remote("spark-"))
                     if not s["released"]
                     for tiers in s["per_node_tier"].values()
                     for tier, (nbytes, _) in tiers.items() if tier == "memory")
        if books == stored or time.monotonic() > deadline:
            return {"books": books, "stored": stored}
        time.sleep(0.2)


def _lost_segment_recovers(spark, config):
    """Materialise a shuffle, delete its disk segments, read it again: the readers raise
    FetchFailedException and Spark recomputes the maps; the rows stay exact."""
    pairs = spark.sparkContext.parallelize(range(40_000), 4).map(lambda x: (x % 53, 1))
    reduced = pairs.reduceByKey(lambda a, b: a + b, numPartitions=4)
    first = sorted(reduced.collect())
    files = [f for d in config.spill_dirs
             for f in glob.glob(os.path.join(d, "hybrid_ray", "spark-*", "*", "*.seg"))]
    for f in files:
        os.unlink(f)
    second = sorted(reduced.collect())
    return {"first": first, "second": second, "deleted": len(files)}


def _live_spark_shuffles(config):
    master = ray.get_actor("hybrid_ray_shuffle_master", namespace=config.namespace)
    return sorted(s for s in ray.get(master.live_shuffles.remote()) if s.startswith("spark-"))


def _unregistered_shuffles_are_released(spark, config):
    """Spark's ContextCleaner unregisters a shuffle (here forced, as after a GC): the
    driver's shuffle manager releases it in the master, and its files go."""
    pairs = spark.sparkContext.parallelize(range(20_000), 3).map(lambda x: (x % 31, x))
    assert sorted(pairs.groupByKey().mapValues(len).collect()) == [
        (k, sum(1 for x in range(20_000) if x % 31 == k)) for k in range(31)]
    live_before = _live_spark_shuffles(config)
    cleaner = spark.sparkContext._jsc.sc().cleaner().get()
    for shuffle in live_before:
        cleaner.doCleanupShuffle(int(shuffle.rsplit("-", 1)[1]), True)
    live_after = _live_spark_shuffles(config)
    files = [f for d in config.spill_dirs for f in files_under(d) if "/spark-" in f]
    return {"before": live_before, "after": live_after, "files": files}


def _shuffle_known_before_its_maps_commit(spark, config):
    """While a stage's map tasks still compute (nothing committed), the master already
    holds their shuffle: the driver's shuffle manager registered it when Spark planned it.
    Registered only at its first commit, a shuffle whose tasks computed for longer than two
    tier-manager sweeps was released on their nodes under them."""
    import shutil
    import tempfile
    import threading
    import time

    # The map tasks write nothing until the test has looked (a flag file, bounded): with
    # an 8 s sleep instead, the look had to come within 6 s of the job's start, which
    # Spark planning the job on a loaded machine could exceed (nothing seen).
    flag_dir = tempfile.mkdtemp(prefix="hr-known-early-")  # removed below
    go = os.path.join(flag_dir, "go")

    def held(x):
        import os
        import time

        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
        return (x, x)

    before = set(_live_spark_shuffles(config))
    pairs = spark.sparkContext.parallelize(range(2), 2).map(held)
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(
        rows=sorted(pairs.groupByKey().mapValues(len).collect())))
    job.start()
    seen, reported = [], None
    deadline = time.monotonic() + 100  # (inside the map tasks' own 120 s bound)
    try:
        while not seen and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = sorted(set(_live_spark_shuffles(config)) - before)
            reported = {r.shuffle_id for r in spark_bridge.spark_shuffle_reports()}
    finally:
        open(go, "w").close()
    job.join(timeout=120)
    shutil.rmtree(flag_dir, ignore_errors=True)  # one was left per run
    return {"seen": seen, "reported": sorted(reported & set(seen)) if reported else [],
            "rows": result.get("rows")}


def _killed_executor_recovers(spark):
    """Kill an executor after a shuffle's map stage: its memory-tier objects die with it
    (Ray objects are owned by their executor, as Spark's own shuffle files without an
    external shuffle service), the reread raises FetchFailedException, Spark recomputes
    the lost maps on the executor left, and the rows stay exact."""
    pairs = spark.sparkContext.parallelize(range(60_000), 6).map(lambda x: (x % 71, 1))
    reduced = pairs.reduceByKey(lambda a, b: a + b, numPartitions=4)
    first = sorted(reduced.collect())
    executors = sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith("raydp-executor-")), key=lambda a: a["name"])
    victim = executors[-1]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
    second = sorted(reduced.collect())
    return {"first": first, "second": second, "killed": victim["name"]}


def _tier_manager_started_again_recovers(spark, config):
    """Kill the node's tier manager once the executors hold its handle (as Ray's memory
    monitor may): the master starts a new one on the next request, under the same name.
    Executors kept the dead handle, so every retry of a task failed the same way and Spark
    gave up on the stage; a call that finds its actor dead now drops the cached handles."""
    from hybrid_ray.actors import get_tier_manager

    def query():
        pairs = spark.sparkContext.parallelize(range(30_000), 3).map(lambda x: (x % 61, x))
        return sorted(pairs.reduceByKey(lambda a, b: a + b, numPartitions=3).collect())
    first = query()  # the executors' handles are warm
    node = ray.get_runtime_context().get_node_id()
    old = get_tier_manager(node, config.namespace)
    old_id = old._actor_id.hex()
    ray.kill(old, no_restart=True)
    second = query()
    new_id = get_tier_manager(node, config.namespace)._actor_id.hex()
    return {"first": first, "second": second, "replaced": new_id != old_id}


def _barrier_stage_falls_back(spark):
    """A barrier map stage is served by Spark's own shuffle; the reports say so."""
    pairs = spark.sparkContext.parallelize(range(1000), 2).barrier().mapPartitions(
        lambda it: it).map(lambda x: (x % 3, 1))
    return sorted(pairs.reduceByKey(lambda a, b: a + b).collect())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # Spark's Python workers cannot import this module: its functions go by value.
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spill = tmp_path_factory.mktemp("hybrid-shuffle") / "spill"
    # A small memory tier: segments land in memory and on disk.
    config = ShuffleConfig(spill_dirs=[str(spill)], memory_capacity_bytes=1 * MiB,
                           segment_bytes={"memory": 64 * 1024}, progress=False)
    try:
        hybrid = _run_session(True, config)
        own = _run_session(False, config)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    return hybrid, own, config


QUERY_NAMES = ["group_by_agg", "group_by_nullable_string", "inner_join_agg", "left_join",
               "window_rank", "distinct", "order_by", "skew_join", "rdd_reduce_by_key",
               "rdd_sort_by_key", "rdd_group_by_key", "retried_map_task"]


def test_direct_path_of_a_session_of_spark_s_own_shuffle_takes_its_shuffle_config(runs):
    _, own, _ = runs
    assert own["direct"]["exact"] and "disk" in own["direct"]["tiers"], own["direct"]


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_query_matches_sparks_own_shuffle(runs, name):
    hybrid, own, _ = runs
    assert hybrid["rows"][name], f"{name} returned no rows"
    assert hybrid["rows"][name] == own["rows"][name]


def test_spark_shows_the_shuffle_reads_of_hybrid_ray_exchanges(runs):
    """Spark's task metrics (its UI, REST API, event log) count what hybrid_ray's readers
    read, as they count Spark's own: the reader folds its metrics into the task's at its
    end. Before, every hybrid_ray exchange showed 0 bytes and 0 records read."""
    hybrid, own, _ = runs
    ours = hybrid["shuffle_metrics"]
    assert ours["write_records"] > 0, ours
    # Every record written is read (no query here stops reading early); the skew join's
    # splits read their other side's partition once each, so a few are read twice.
    assert ours["write_records"] <= ours["read_records"] <= 1.1 * ours["write_records"], ours
    assert 0.5 * ours["write_bytes"] <= ours["read_bytes"] <= 2 * ours["write_bytes"], ours
    # The same plans read the same records as with Spark's own shuffle.
    assert ours["read_records"] == own["shuffle_metrics"]["read_records"], \
        (ours, own["shuffle_metrics"])


def test_exchanges_went_through_hybrid_ray_memory_and_disk(runs):
    hybrid, _, _ = runs
    assert hybrid["plans"] == "org.apache.spark.shuffle.hybridray.HybridRayShuffleManager"
    reports = hybrid["reports"]
    assert len(reports) >= 12, [r.shuffle_id for r in reports]
    assert all(r.shuffle_id.startswith("spark-") for r in reports)
    totals = {"memory": 0, "disk": 0}
    for report in reports:
        for tier, nbytes in report.bytes_per_tier().items():
            totals[tier] = totals.get(tier, 0) + nbytes
    assert totals["memory"] > 0 and totals["disk"] > 0, totals
    assert totals.get("remote", 0) == 0
    # Live reports (before stop) and released ones (after) name the same shuffles.
    assert {r.shuffle_id for r in hybrid["reports_live"]} <= {r.shuffle_id for r in reports}


def test_memory_books_match_what_live_spark_shuffles_stored(runs):
    books = runs[0]["books"]
    assert books["stored"] > 0
    assert books["books"] == books["stored"], books


def test_lost_disk_segments_are_recomputed_exactly(runs):
    lost = runs[0]["lost"]
    assert lost["deleted"] > 0
    assert lost["first"] == lost["second"] == sorted(
        (k, sum(1 for x in range(40_000) if x % 53 == k)) for k in range(53))


def test_nothing_left_after_stop_spark(runs):
    hybrid, _, _ = runs
    assert hybrid["context_after_stop"] is False
    assert hybrid["leftover_files"] == []
    assert hybrid["live"] == []
    assert all(v == 0 for v in hybrid["tier_bytes"].values()), hybrid["tier_bytes"]


def test_unregistered_shuffle_is_released_with_its_files(runs):
    unregistered = runs[0]["unregistered"]
    assert unregistered["before"], "the session had no live Spark shuffle to unregister"
    assert unregistered["after"] == []
    assert unregistered["files"] == []


def test_a_shuffle_is_known_to_the_master_while_its_first_map_tasks_compute(runs):
    early = runs[0]["known_early"]
    assert len(early["seen"]) == 1, early  # registered before any task committed...
    assert early["reported"] == []  # ...with nothing committed yet (no report)
    assert early["rows"] == [(0, 1), (1, 1)]


def test_killed_executor_gives_exact_rows(runs):
    killed = runs[0]["killed"]
    expected = sorted((k, sum(1 for x in range(60_000) if x % 71 == k)) for k in range(71))
    assert killed["first"] == expected
    assert killed["second"] == expected


def test_a_tier_manager_started_again_mid_session_is_found_by_the_executors(runs):
    hybrid, _, _ = runs
    outcome = hybrid["tier_manager_restarted"]
    expected = sorted((k, sum(x for x in range(30_000) if x % 61 == k)) for k in range(61))
    assert outcome["replaced"]
    assert outcome["first"] == outcome["second"] == expected


def test_barrier_stage_uses_sparks_own_shuffle_and_the_report_says_so(runs):
    hybrid = runs[0]
    assert hybrid["barrier"] == [(0, 334), (1, 333), (2, 333)]
    fallbacks = [r for r in hybrid["reports"] if r.map_input.startswith("Spark's own shuffle")]
    assert len(fallbacks) == 1, [r.map_input for r in hybrid["reports"]]
    assert "barrier stage" in fallbacks[0].map_input
    assert fallbacks[0].per_node_tier == {}
