"""spark_bridge on real RayDP Spark (executors as Ray actors) on a local Ray: exact rows
against Spark's own shuffle, tiers (moto S3 over HTTP for the remote tier), retries,
cleanup and bad input. One Spark session for the module: starting it costs ~40 s."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import ray

import spark_bridge
from conftest import assert_no_leftovers, base_config
from hybrid_ray import (
    ConfigError, HashPartitioner, MiB, RemoteTierError, ShuffleFailedError,
)

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.fixture(autouse=True, scope="module")
def _ship_this_module_by_value():
    """Spark's Python workers cannot import this test module: its partitioners go by value
    (whichever test runs first, alone or with -k)."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def orders(spark):
    """400k rows with string and nullable keys, over 4 input partitions."""
    return spark.range(0, 400_000, numPartitions=4).selectExpr(
        "id",
        "cast(id % 997 as int) as customer_id",
        "if(id % 13 = 0, null, concat('sku-', cast(id % 101 as string))) as sku",
        "cast((id * 7919) % 100000 as long) as amount",
        "repeat('x', 40) as note")


def _new_manager_reports(before: int) -> list:
    return spark_bridge.spark_shuffle_reports()[before:]


def test_the_session_s_driver_was_told_the_running_ray_session_s_logs_dir(spark):
    from spark_bridge.session import ray_logs_dir

    logs = ray_logs_dir()
    assert logs and os.path.isdir(logs)
    options = spark.sparkContext.getConf().get("spark.driver.extraJavaOptions")
    assert f"-Dray.logging.dir={logs}" in options


def test_repartition_matches_spark_and_partitions_by_key(spark, orders, tmp_path):
    """Not a parquet scan: Spark's repartition, its exchange carried by the manager."""
    from pyspark.sql import functions as F

    before = len(spark_bridge.spark_shuffle_reports())
    out = spark_bridge.repartition(orders, 6, "sku")
    assert out.schema == orders.schema
    assert out.rdd.getNumPartitions() == 6
    assert sorted(out.collect()) == sorted(orders.collect())
    # Rows with equal keys (nulls included) share a partition.
    per_key = (out.withColumn("pid", F.spark_partition_id()).groupBy("sku")
               .agg(F.countDistinct("pid").alias("n")).where("n > 1").count())
    assert per_key == 0
    reports = _new_manager_reports(before)
    # (The manager's reports count bytes and segments per tier; Spark counts the rows.)
    assert any(r.num_partitions == 6 and sum(r.bytes_per_tier().values()) > 0
               for r in reports), [(r.num_partitions, r.bytes_per_tier()) for r in reports]
    assert spark_bridge.release(out) == 0  # nothing of the bridge's own: Spark releases it


def test_sort_matches_orderby_with_nulls_and_mixed_directions(spark, orders, tmp_path):
    from pyspark.sql import functions as F

    out = spark_bridge.sort(orders, "sku", "amount", "id", ascending=[False, True, True],
                            num_partitions=5)
    expected = orders.orderBy(F.desc("sku"), "amount", "id").collect()
    assert out.collect() == expected
    assert out.rdd.getNumPartitions() == 5
    asc = spark_bridge.sort(orders, "sku", "id", num_partitions=3)
    assert asc.collect() == orders.orderBy("sku", "id").collect()  # nulls first
    assert spark_bridge.sort(orders, "id", ascending=False).collect() == \
        orders.orderBy(F.desc("id")).collect()


def test_pipeline_parquet_csv_join_aggregate_matches_spark(spark, tmp_path):
    """What a Spark user writes: read parquet and CSV, join, group and aggregate, write
    parquet; every exchange through hybrid_ray, compared row for row with Spark's own."""
    from pyspark.sql import functions as F

    spark.range(0, 300_000, numPartitions=3).selectExpr(
        "id as order_id", "cast(id % 5003 as long) as customer_id",
        "cast((id * 31) % 10007 as long) as cents", "cast(id % 17 as double) / 4 as weight",
    ).write.parquet(str(tmp_path / "orders"))
    spark.range(0, 5000, numPartitions=2).selectExpr(
        "id as customer_id", "concat('country-', cast(id % 23 as string)) as country",
    ).write.option("header", True).csv(str(tmp_path / "customers"))
    orders = spark.read.parquet(str(tmp_path / "orders"))
    customers = spark.read.option("header", True).schema(
        "customer_id long, country string").csv(str(tmp_path / "customers"))
    before = len(spark_bridge.spark_shuffle_reports())
    joined = spark_bridge.join(orders, customers, "customer_id", num_partitions=4)
    summary = spark_bridge.aggregate(
        joined, "country", {"orders": ("*", "count"), "revenue": ("cents", "sum"),
                            "max_weight": ("weight", "max"), "mean_cents": ("cents", "mean"),
                            "customers": ("customer_id", "count_distinct")},
        num_partitions=3)
    summary.write.parquet(str(tmp_path / "out_bridge"))

    expected = (orders.join(customers, "customer_id").groupBy("country").agg(
        F.count("*").alias("orders"), F.sum("cents").alias("revenue"),
        F.max("weight").alias("max_weight"), F.mean("cents").alias("mean_cents"),
        F.countDistinct("customer_id").alias("customers")))
    expected.write.parquet(str(tmp_path / "out_spark"))

    got = sorted(spark.read.parquet(str(tmp_path / "out_bridge")).collect())
    want = sorted(spark.read.parquet(str(tmp_path / "out_spark")).collect())
    assert len(got) == 23 and [r.asDict() for r in got] == [r.asDict() for r in want]
    # Customers 5000..5002 have orders but no row in the CSV: the inner join drops them.
    assert sum(r.orders for r in got) == orders.join(customers, "customer_id").count()
    # Both join sides and the aggregation's exchange went through the shuffle manager.
    assert len({r.num_partitions for r in _new_manager_reports(before)} & {3, 4}) == 2


@pytest.mark.parametrize("how", ["left", "full", "left_anti"])
def test_outer_and_anti_joins_match_spark(spark, tmp_path, how):
    left = spark.range(0, 20_000, numPartitions=2).selectExpr(
        "if(id % 50 = 0, null, id % 3000) as k", "id as a")
    right = spark.range(0, 5000, numPartitions=2).selectExpr("id * 2 as k", "id as b")
    out = spark_bridge.join(left, right, "k", how, num_partitions=3)
    want = left.join(right, "k", how)
    assert out.columns == want.columns
    assert sorted(out.collect(), key=repr) == sorted(want.collect(), key=repr)


def test_columns_named_with_a_dot_are_the_columns_of_that_name(spark):
    """A column literally named "a.b" passed the name check, then Spark parsed it as field b
    of a struct a: refused as unresolved, or, with such a struct beside it, the struct's
    field used instead. The operations quote the names now."""
    df = spark.range(0, 300, numPartitions=3).selectExpr(
        "cast(id % 7 as int) as `a.b`", "named_struct('b', cast(id % 2 as int)) as a",
        "id as v")
    ordered = spark_bridge.sort(df, "a.b", num_partitions=3).collect()
    assert [r["a.b"] for r in ordered] == sorted(i % 7 for i in range(300))
    by_key = {r["a.b"]: r["n"] for r in spark_bridge.aggregate(
        df, "a.b", {"n": ("v", "count")}, num_partitions=2).collect()}
    assert by_key == {k: sum(1 for i in range(300) if i % 7 == k) for k in range(7)}
    split = spark_bridge.repartition(df, 4, "a.b", direct_scan=False)
    assert sorted(r["v"] for r in split.collect()) == list(range(300))
    joined = spark_bridge.join(df, df.selectExpr("`a.b`").distinct().selectExpr(
        "`a.b`", "`a.b` * 10 as w"), "a.b", num_partitions=2)
    assert joined.count() == 300


def test_aggregate_without_combine_matches_spark_on_sums_and_means(spark, orders, tmp_path):
    from pyspark.sql import functions as F

    out = spark_bridge.aggregate(orders, ["customer_id", "sku"],
                                 {"n": ("amount", "count"), "lo": ("amount", "min"),
                                  "avg": ("amount", "avg")})
    want = orders.groupBy("customer_id", "sku").agg(
        F.count("amount").alias("n"), F.min("amount").alias("lo"),
        F.avg("amount").alias("avg"))
    got, exp = sorted(out.collect(), key=repr), sorted(want.collect(), key=repr)
    assert [r[:4] for r in got] == [r[:4] for r in exp]
    assert all(abs(a.avg - b.avg) < 1e-9 * max(1.0, abs(b.avg)) for a, b in zip(got, exp))


def test_disk_capped_below_data_overflows_to_s3_and_stays_exact(spark, orders, tmp_path,
                                                                 s3_bucket):
    import s3fs

    remote, options = s3_bucket
    scan = _as_parquet_scan(spark, orders, tmp_path / "orders")
    cfg = base_config(tmp_path, memory_capacity_bytes=1 * MiB, disk_capacity_bytes=2 * MiB,
                 remote_path=remote, storage_options=options, compression="none")
    out = spark_bridge.repartition(scan, 4, "customer_id", config=cfg)
    report = spark_bridge.last_report()
    tiers = report.bytes_per_tier()
    assert report.map_input == "parquet files"
    assert tiers["disk"] <= 2 * MiB and tiers["remote"] > tiers["disk"], tiers
    assert sorted(out.collect()) == sorted(orders.collect())
    fs = s3fs.S3FileSystem(**options)
    assert fs.find(remote)  # segments really are objects in the (moto) bucket
    spark_bridge.release(out)
    fs.invalidate_cache()
    assert fs.find(remote) == []
    assert_no_leftovers(cfg, ray)


class FailFirstAttempt(HashPartitioner):
    """Fails map task 1's first attempt after it committed a chunk, as a crash would."""

    def __init__(self, keys):
        super().__init__(keys)
        self.calls = 0

    def assign(self, table, map_index, num_partitions):
        from pyspark import TaskContext

        self.calls += 1
        ctx = TaskContext.get()
        if map_index == 1 and ctx.attemptNumber() == 0 and self.calls > 1:
            raise RuntimeError("injected failure after a committed chunk")
        return super().assign(table, map_index, num_partitions)


def test_retried_spark_task_leaves_output_exact(spark, orders, tmp_path):
    from spark_bridge import exchange

    cfg = base_config(tmp_path, map_chunk_bytes=1 * MiB)
    shuffle = exchange.run_map_stage(orders, 3, FailFirstAttempt(["id"]), cfg, "retry-test")
    assert shuffle.report.superseded_attempts >= 1
    assert shuffle.report.rows == 400_000  # the dead attempt's rows do not count

    def passthrough(inputs, _sub):
        yield from inputs[0]
    out = exchange.reduce_frame(spark, [shuffle], passthrough, orders.schema)
    assert sorted(out.collect()) == sorted(orders.collect())
    spark_bridge.release(out)
    assert_no_leftovers(cfg, ray)


def _as_parquet_scan(spark, df, path):
    """``df`` written as parquet files and read back: a plain scan (the direct path)."""
    df.write.parquet(str(path))
    return spark.read.parquet(str(path))


def test_full_disk_without_remote_fails_loudly_and_cleans_up(spark, orders, tmp_path):
    scan = _as_parquet_scan(spark, orders, tmp_path / "orders")
    cfg = base_config(tmp_path, memory_fraction=0.0, disk_capacity_bytes=1 * MiB)
    # The direct path returns once its maps have read every file (f4c3f16): their
    # failure is raised by the call itself.
    with pytest.raises(ShuffleFailedError, match="OutOfSpaceError.*remote_path"):
        spark_bridge.repartition(scan, 4, "id", config=cfg)
    assert spark_bridge.held_shuffles() == []
    assert_no_leftovers(cfg, ray)


def test_column_names_resolve_as_spark_resolves_them_and_ascending_takes_ints(spark):
    """``repartition(df, 4, "id")`` of a column "ID" was refused, though Spark (case
    insensitive by default) takes it; ``sort(..., ascending=0)``, which PySpark's orderBy
    takes, failed with a raw TypeError (found by a review). Two columns equal but for
    case are named as ambiguous."""
    df = spark.createDataFrame([(i, f"v{i}") for i in range(20)], "ID long, Name string")
    out = spark_bridge.repartition(df, 4, "id")
    assert sorted(out.collect()) == sorted(df.collect())
    assert out.columns == ["ID", "Name"]
    ordered = spark_bridge.sort(df, "id", ascending=0)
    assert [r.ID for r in ordered.collect()] == list(range(19, -1, -1))
    ordered = spark_bridge.sort(df, "name", "ID", ascending=[1, 0])
    assert [r.Name for r in ordered.collect()] == sorted(f"v{i}" for i in range(20))
    with pytest.raises(ConfigError, match="one bool per sort column"):
        spark_bridge.sort(df, "id", ascending=2)
    twins = spark.createDataFrame([(1, 2)], "a long, A long")
    with pytest.raises(ConfigError, match=r"column 'a' is ambiguous: .*\['a', 'A'\]"):
        spark_bridge.repartition(twins, 2, "a")
    # An aggregate's output named as a key but for case (or as another output) was taken,
    # and the result's columns could not be told apart (found by a review).
    with pytest.raises(ConfigError, match="aggs output 'id' collides with key column 'ID'"):
        spark_bridge.aggregate(df, "ID", {"id": ("Name", "count")})
    with pytest.raises(ConfigError, match="aggs output 'N' collides with output 'n'"):
        spark_bridge.aggregate(df, "ID", {"n": ("Name", "count"), "N": ("ID", "sum")})
    # A key named twice (here but for case) gave two columns of one name; NumPy's bools
    # were refused as sort directions.
    with pytest.raises(ConfigError, match=r"aggregate keys name column\(s\) \['ID'\] more "
                       "than once"):
        spark_bridge.aggregate(df, ["ID", "id"], {"n": ("Name", "count")})
    ordered = spark_bridge.sort(df, "id", ascending=np.bool_(False))
    assert [r.ID for r in ordered.collect()] == list(range(19, -1, -1))
    ordered = spark_bridge.sort(df, "name", "ID", ascending=[np.True_, np.int64(0)])
    assert [r.Name for r in ordered.collect()] == sorted(f"v{i}" for i in range(20))


def test_bad_input_is_explained(spark, orders, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown column\(s\) \['nope'\]"):
        spark_bridge.repartition(orders, 4, "nope")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="num_partitions must be a positive integer"):
            spark_bridge.repartition(orders, bad, "id")
    with pytest.raises(ConfigError, match="at least one column"):
        spark_bridge.repartition(orders, 4)
    for bad in ("no", 0, None):
        with pytest.raises(ConfigError, match="direct_scan must be True or False"):
            spark_bridge.repartition(orders, 4, "id", direct_scan=bad)
    with pytest.raises(ConfigError, match="unknown column"):
        spark_bridge.sort(orders, "id", "missing")
    with pytest.raises(ConfigError, match="one bool per sort column"):
        spark_bridge.sort(orders, "id", ascending=[True, False])
    with pytest.raises(ConfigError, match="unknown function 'median'"):
        spark_bridge.aggregate(orders, "sku", {"m": ("amount", "median")})
    with pytest.raises(ConfigError, match="unknown join type 'sideways'"):
        spark_bridge.join(orders, orders, "id", "sideways")
    with pytest.raises(ConfigError, match="config= applies only where hybrid_ray's writers "
                       "read a plain parquet scan"):
        spark_bridge.repartition(orders, 4, "id", config=base_config(tmp_path))
    for call in (lambda: spark_bridge.sort(orders, "id", config=base_config(tmp_path)),
                 lambda: spark_bridge.join(orders, orders, "id", config=base_config(tmp_path))):
        with pytest.raises(ConfigError, match="shuffle_config given to spark_bridge.init_spark"):
            call()
    with pytest.raises(ConfigError, match="ShuffleConfig"):
        spark_bridge.repartition(orders, 4, "id", config={"memory_fraction": 0.5})
    with pytest.raises(TypeError, match="pyspark.sql.DataFrame"):
        spark_bridge.repartition(pa.table({"a": [1]}), 4, "a")
    unreachable = base_config(tmp_path, remote_path="s3://bucket/x",
                         storage_options={"endpoint_url": "http://127.0.0.1:9",
                                          "key": "k", "secret": "s"})
    scan = _as_parquet_scan(spark, orders.limit(1000), tmp_path / "small")
    with pytest.raises(RemoteTierError):
        spark_bridge.repartition(scan, 4, "id", config=unreachable)
    assert spark_bridge.held_shuffles() == []


def test_numpy_partition_counts_are_taken_by_every_operation(spark):
    """Was: checked, then passed on as np.int64, which PySpark refused ("Argument
    `numPartitions` should be a Column or str, got int64") on the manager's path."""
    import numpy as np

    df = spark.range(0, 200, numPartitions=2).selectExpr("id", "id % 7 as k")
    n = np.int64(3)
    out = spark_bridge.repartition(df, n, "k")
    assert out.rdd.getNumPartitions() == 3 and sorted(out.collect()) == sorted(df.collect())
    assert spark_bridge.sort(df, "id", num_partitions=n).collect() == df.orderBy("id").collect()
    agg = spark_bridge.aggregate(df, "k", {"n": ("*", "count")}, num_partitions=n)
    assert sorted((r.k, r.n) for r in agg.collect()) == \
        sorted((k, sum(1 for i in range(200) if i % 7 == k)) for k in range(7))
    joined = spark_bridge.join(df, df.select("k").distinct(), "k", num_partitions=n)
    assert sorted(joined.collect()) == sorted(df.join(df.select("k").distinct(), "k").collect())


def test_init_spark_validates_and_explains(spark, monkeypatch):
    with pytest.raises(ConfigError, match="num_executors"):
        spark_bridge.init_spark("x", num_executors=0)
    with pytest.raises(ConfigError, match="executor_memory"):
        spark_bridge.init_spark("x", executor_memory="lots")
    with pytest.raises(spark_bridge.SparkSetupError, match="already running"):
        spark_bridge.init_spark("again")
    # Was dropped silently, Spark started on the cluster this process is connected to.
    with pytest.raises(ConfigError, match=r"init_spark\(ray_address='10.255.255.1:6379'\): "
                                          r"this process is connected to the Ray cluster at "
                                          + re.escape(ray.get_runtime_context().gcs_address)):
        spark_bridge.init_spark("x", ray_address="10.255.255.1:6379")
    with pytest.raises(ConfigError, match="ray_address must be a Ray address"):
        spark_bridge.init_spark("x", ray_address=6379)
    # Was taken, and won: every exchange went through Spark's sort shuffle, silently.
    with pytest.raises(ConfigError, match=r"configs sets spark.shuffle.manager='sort', which "
                                          r"replaces hybrid_ray's shuffle manager"):
        spark_bridge.init_spark("x", configs={"spark.shuffle.manager": "sort"})
    monkeypatch.setenv("JAVA_HOME", "/nonexistent-jdk")
    with pytest.raises(spark_bridge.SparkSetupError, match="JAVA_HOME"):
        spark_bridge.init_spark("x")
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(spark_bridge.SparkSetupError, match="apt-get install"):
        spark_bridge.init_spark("x")


def test_ray_tasks_and_ray_data_run_beside_the_executors(spark, tmp_path):
    """The executors hold every Spark core but only half of Ray's CPUs: a Ray task, a lazy
    Ray Dataset and hybrid_ray's sort (sampling tasks) all run instead of waiting forever."""
    import hybrid_ray

    assert ray.get(ray.remote(num_cpus=1)(lambda: 42).remote(), timeout=120) == 42
    lazy = ray.data.range(20_000).map_batches(lambda b: {"key": b["id"] % 97, "id": b["id"]})
    out = hybrid_ray.sort(lazy, "key", config=base_config(tmp_path))
    keys = [k for t in ray.get(out.to_arrow_refs()) for k in t["key"].to_pylist()]
    assert len(keys) == 20_000 and keys == sorted(keys)


def test_executors_run_the_bridge_python_daemon(spark):
    """init_spark's executors fork Python workers from spark_bridge.python_daemon: the zip
    re-read is lazy and the preloaded modules are frozen out of the cyclic collector."""
    import gc
    import zipimport

    def probe(_):
        return [(zipimport.zipimporter.invalidate_caches.__qualname__, gc.get_freeze_count(),
                 "hybrid_ray" in sys.modules)]

    got = set(spark.sparkContext.parallelize(range(4), 2).mapPartitions(probe).collect())
    patched = {g[0].startswith("_make_zip_invalidation_lazy.") for g in got}
    assert patched == {sys.version_info < (3, 12)}, got
    assert all(count > 10_000 and preloaded for _, count, preloaded in got), got


# ---- direct parquet scan ------------------------------------------------------------------------
def _typed_scan(spark, tmp_path):
    """A plain scan of ``_write_typed_parquet``'s files under tmp_path/typed, and their rows."""
    table = _write_typed_parquet(tmp_path / "typed")
    return spark.read.parquet(str(tmp_path / "typed")), table


def _write_typed_parquet(directory) -> pa.Table:
    """Three files, several row groups, the types the direct path reads itself (with the
    pyarrow-only spellings Spark maps onto them: unsigned, large, fixed-size, dictionary)."""
    import datetime

    import numpy as np
    import pyarrow.parquet as pq

    directory.mkdir()
    tables = []
    for f in range(3):
        n = 40_000 + 1000 * f
        rng = np.random.default_rng(f)
        ids = np.arange(n, dtype=np.int64) + 100_000 * f
        table = pa.table({
            "id": ids,
            "k8": pa.array(rng.integers(-100, 100, n), pa.int8()),
            "u16": pa.array(rng.integers(0, 1 << 16, n), pa.uint16()),
            "u32": pa.array(rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)),
            "f": pa.array(rng.random(n), pa.float32()),
            "flag": pa.array(ids % 3 == 0),
            "name": pa.array([None if i % 11 == 0 else f"n{i % 313}" for i in ids],
                             pa.large_string()),
            "tag": pa.array([f"t{i % 7}" for i in ids]).dictionary_encode(),
            "raw": pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(6), n, [None, pa.py_buffer(rng.bytes(6 * n))]),
            "day": pa.array([datetime.date(2020, 1, 1) + datetime.timedelta(days=int(i % 900))
                             for i in ids], pa.date32()),
        })
        pq.write_table(table, directory / f"part-{f}.parquet", row_group_size=15_000)
        tables.append(table)
    return pa.concat_tables(tables)


def test_plain_parquet_scan_is_read_by_writers_and_matches_spark(spark, tmp_path):
    df, _ = _typed_scan(spark, tmp_path)
    cfg = base_config(tmp_path, memory_capacity_bytes=2 * MiB)
    want = sorted(df.repartition(5, "name").collect())
    out = spark_bridge.repartition(df, 5, "name", config=cfg)
    report = spark_bridge.last_report()
    assert report.map_input == "parquet files", report.map_input
    assert report.num_maps == 3 and report.rows == len(want)
    assert out.schema == df.schema
    assert sorted(out.collect()) == want  # same values and types as Spark's own reader
    tiers = report.bytes_per_tier()
    assert tiers["memory"] > 0 and tiers["disk"] > 0, tiers
    # direct_scan=False: Spark's repartition through the shuffle manager, the same rows.
    via_spark = spark_bridge.repartition(df, 5, "name", direct_scan=False)
    assert sorted(via_spark.collect()) == want
    assert spark_bridge.release(out) == 1
    assert_no_leftovers(cfg, ray)
    with pytest.raises(Exception, match="released"):
        out.collect()


def test_a_file_listed_twice_is_read_twice_as_spark_reads_it(spark, tmp_path):
    """Spark reads a file once per listing (``read.parquet(f, f)``, or a directory and a
    file in it), but the direct path read ``inputFiles()``, which lists it once: 1000 of
    2000 rows, no error (found by a review). Such a scan now goes through Spark's reader,
    and ``last_report()`` is None then (it returned the previous exchange's report)."""
    import pyarrow.parquet as pq

    directory = tmp_path / "twice"
    directory.mkdir()
    pq.write_table(pa.table({"k": list(range(1000)), "s": [f"v{i}" for i in range(1000)]}),
                   directory / "a.parquet")
    cfg = base_config(tmp_path)
    for paths in ((str(directory / "a.parquet"),) * 2,
                  (str(directory), str(directory / "a.parquet"))):
        df = spark.read.parquet(*paths)
        want = sorted(df.collect())
        assert len(want) == 2000
        out = spark_bridge.repartition(df, 4, "k")  # the session's config
        assert sorted(out.collect()) == want
        assert spark_bridge.last_report() is None  # Spark's repartition through the manager
    plain = spark_bridge.repartition(spark.read.parquet(str(directory)), 4, "k", config=cfg)
    assert spark_bridge.last_report().map_input == "parquet files"  # still direct otherwise
    assert plain.count() == 1000
    assert spark_bridge.release(plain) == 1
    assert_no_leftovers(cfg, ray)


def test_the_direct_path_without_a_config_uses_the_session_s(spark, tmp_path):
    """With config=None the direct parquet path ran with a default ShuffleConfig: a second
    set of actors in namespace hybrid_ray (their own memory budget), spilling to /tmp,
    without the session's remote tier. It uses the session's config now."""
    from conftest import SPARK_EXCHANGE_NAMESPACE
    from hybrid_ray.actors import get_master

    df, _ = _typed_scan(spark, tmp_path)
    out = spark_bridge.repartition(df, 3, "name")
    held = spark_bridge.held_shuffles()
    assert len(held) == 1
    live = ray.get(get_master(SPARK_EXCHANGE_NAMESPACE).live_shuffles.remote())
    assert held[0] in live
    assert sorted(out.collect()) == sorted(df.collect())
    assert spark_bridge.release(out) == 1


def test_scans_spark_must_read_itself_go_through_spark(spark, tmp_path):
    """Cached, projected, partitioned, option-carrying, timestamped or gap-filled scans are
    read by Spark; the report says why, and the rows are still Spark's."""
    import pyarrow.parquet as pq

    path = tmp_path / "typed"
    _write_typed_parquet(path)
    (tmp_path / "hive" / "year=2024").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2, 3]}), tmp_path / "hive" / "year=2024" / "a.parquet")
    (tmp_path / "ts").mkdir()
    pq.write_table(pa.table({"id": [1, 2], "at": pa.array([0, 10**9], pa.timestamp("us"))}),
                   tmp_path / "ts" / "a.parquet")
    cached = spark.read.parquet(str(path)).cache()
    cases = {
        "cached": (cached, "InMemoryRelation"),
        "projected": (spark.read.parquet(str(path)).select("id", "name"), "Project"),
        "partitioned": (spark.read.parquet(str(tmp_path / "hive")), "partitioned"),
        "option": (spark.read.option("mergeSchema", "true").parquet(str(path)), "mergeschema"),
        "timestamp": (spark.read.parquet(str(tmp_path / "ts")), "column 'at' is timestamp"),
        "gap": (spark.read.schema("id long, extra string").parquet(str(path)),
                "no column 'extra'"),
    }
    from spark_bridge.parquet_scan import plan_scan

    for name, (df, reason) in cases.items():
        scan, why_not = plan_scan(df, MiB)
        assert scan is None and reason in why_not, (name, why_not)
        out = spark_bridge.repartition(df, 3, "id")  # Spark's operator, through the manager
        assert sorted(out.collect()) == sorted(df.collect()), name
        assert spark_bridge.held_shuffles() == []
    cached.unpersist()
    # A session setting only Spark's reader honours.
    spark.conf.set("spark.sql.files.ignoreMissingFiles", "true")
    try:
        df = spark.read.parquet(str(path))
        scan, why_not = plan_scan(df, MiB)
        assert scan is None and "spark.sql.files.ignoreMissingFiles=true" in why_not, why_not
        assert sorted(spark_bridge.repartition(df, 3, "id").collect()) == sorted(df.collect())
    finally:
        spark.conf.unset("spark.sql.files.ignoreMissingFiles")


def test_direct_scan_map_failure_fails_loudly_and_cleans_up(spark, tmp_path):
    from spark_bridge import exchange

    class ExplodesOnSecondChunk(HashPartitioner):  # local: pickled by value to the writers
        calls = 0

        def assign(self, table, map_index, num_partitions):
            type(self).calls += 1
            if map_index == 2 and type(self).calls > 1:
                raise RuntimeError("injected map failure")
            return super().assign(table, map_index, num_partitions)

    df, _ = _typed_scan(spark, tmp_path)
    cfg = base_config(tmp_path, map_chunk_bytes=256 * 1024)
    shuffle = exchange.run_map_stage(df, 4, ExplodesOnSecondChunk(["id"]), cfg, "fail-test")
    out = exchange.reduce_frame(spark, [shuffle], _passthrough, df.schema)
    with pytest.raises(ShuffleFailedError, match="injected map failure"):
        shuffle.report  # noqa: B018 - waits for the background map stage
    with pytest.raises(ShuffleFailedError, match="injected map failure"):
        spark_bridge.last_report()
    assert spark_bridge.held_shuffles() == []
    assert_no_leftovers(cfg, ray)
    # Reduce tasks are told why the data is gone.
    with pytest.raises(Exception, match="map stage failed: RuntimeError: injected map failure"):
        out.collect()


def test_a_reduce_stage_that_cannot_be_built_releases_its_shuffle(spark, orders, tmp_path):
    from spark_bridge import exchange

    cfg = base_config(tmp_path)
    shuffle = exchange.run_map_stage(orders, 3, HashPartitioner(["id"]), cfg, "bad-reduce",
                                     direct_scan=False)
    assert shuffle.shuffle_id in spark_bridge.held_shuffles()
    with pytest.raises(Exception):  # not a Spark schema
        exchange.reduce_frame(spark, [shuffle], _passthrough, "not a schema")
    assert spark_bridge.held_shuffles() == []
    assert_no_leftovers(cfg, ray)


def test_release_during_the_direct_map_stage_says_so(spark, tmp_path):
    from spark_bridge import exchange

    class Slow(HashPartitioner):  # local: pickled by value to the writers
        def assign(self, table, map_index, num_partitions):
            time.sleep(0.5)
            return super().assign(table, map_index, num_partitions)

    df, _ = _typed_scan(spark, tmp_path)
    cfg = base_config(tmp_path, map_chunk_bytes=64 * 1024)
    shuffle = exchange.run_map_stage(df, 4, Slow(["id"]), cfg, "release-test")
    assert not shuffle.map_stage_done
    assert spark_bridge.release_all() == 1
    with pytest.raises(ShuffleFailedError, match=r"it was released \(spark_bridge.release"):
        shuffle.report  # noqa: B018 - waits for the background map stage
    # Maps that were running go on until their next commit fails; a writer runs one task
    # at a time, so a no-op on each waits for them (later tests then get idle writers).
    from hybrid_ray.actors import get_writers

    ray.get([writer.run.remote(len, ()) for _, writer in get_writers(cfg.namespace)])
    assert_no_leftovers(cfg, ray)


def test_direct_scan_maps_lost_with_their_writer_are_rerun_exactly(spark, tmp_path):
    """The writers own the direct path's memory-tier segments. Killing the writer of a
    finished map after the map stage loses them: readers report the loss, the bridge runs
    those maps again, and the reduce stage's rows are still exact.

    The victim is chosen by who owns memory-tier segments once every map finished (not
    by map 0's pid while maps may still run: that once killed a writer whose maps were
    all on disk, and lost nothing), and the shuffle is released even if the test fails.
    """
    from hybrid_ray.actors import get_master
    from spark_bridge import exchange

    df, _ = _typed_scan(spark, tmp_path)
    cfg = base_config(tmp_path, map_chunk_bytes=256 * 1024)
    shuffle = exchange.run_map_stage(df, 4, HashPartitioner(["id"]), cfg, "lost-test")
    try:
        assert shuffle.report.map_input == "parquet files"
        master = get_master(cfg.namespace)
        deadline = time.monotonic() + 120
        while not shuffle.map_stage_done and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shuffle.map_stage_done
        before = ray.get(master.progress.remote(shuffle.shuffle_id))["maps"]
        holders = [m["pid"] for m in before if m["segments_per_tier"].get("memory", 0) > 0]
        assert holders, before  # the memory tier has room: some map put segments there
        victim = holders[0]
        victim_maps = {i for i, m in enumerate(before)
                       if m["pid"] == victim and m["segments_per_tier"].get("memory", 0)}
        victim_refs = [meta.object_ref[0]
                       for meta in ray.get(master.segments.remote(shuffle.shuffle_id))
                       if meta.tier.value == "memory" and meta.id.map_partition in victim_maps]
        os.kill(victim, signal.SIGKILL)
        # The raylet frees a dead owner's objects asynchronously: a reader that came first
        # could still read them, lose nothing, and re-run nothing. Reduce only once they
        # are really gone, so the loss (and its recovery) is what this test exercises.
        _wait_until_lost(victim_refs, timeout_s=60)
        del victim_refs
        out = exchange.reduce_frame(spark, [shuffle], _passthrough, df.schema)
        assert sorted(out.collect()) == sorted(df.collect())
        after = ray.get(master.progress.remote(shuffle.shuffle_id))["maps"]
        rerun = {i for i, (b, a) in enumerate(zip(before, after))
                 if a["attempt"] > b["attempt"]}
        # Exactly the maps whose memory segments died with the victim ran again.
        assert rerun == victim_maps, (before, after)
    finally:
        released = spark_bridge.release_all()
    assert released == 1
    assert_no_leftovers(cfg, ray)


def _wait_until_lost(refs: list, timeout_s: float) -> None:
    """Return once every ref's object is unreadable (its owner died); fail after timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        try:
            ray.get(pending[0], timeout=5)
        except ray.exceptions.ObjectLostError:  # OwnerDiedError is one
            pending.pop(0)
            continue
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, f"{len(pending)} objects of a dead writer still readable"
        time.sleep(0.2)


def _passthrough(inputs, _sub):
    yield from inputs[0]


def test_direct_scan_reducers_consume_while_maps_still_write(spark, tmp_path):
    from spark_bridge import exchange

    df, table = _typed_scan(spark, tmp_path)
    cfg = base_config(tmp_path)
    namespace = cfg.namespace

    class LastMapSlow(HashPartitioner):  # local: pickled by value to the writers
        """The last map goes on only once a reducer was delivered segments (a 3 s sleep was
        outlasted by Spark starting the reduce tasks on a loaded machine: no overlap)."""

        def assign(self, table, map_index, num_partitions):
            if map_index == 2:
                from conftest import wait_for_a_delivery

                wait_for_a_delivery(namespace, 120.0)
            return super().assign(table, map_index, num_partitions)

    shuffle = exchange.run_map_stage(df, 4, LastMapSlow(["id"]), cfg, "overlap-test")
    assert not shuffle.map_stage_done  # returned while the maps run
    out = exchange.reduce_frame(spark, [shuffle], _passthrough, df.schema)
    assert out.count() == table.num_rows
    assert sorted(out.collect()) == sorted(df.collect())
    assert shuffle.report.hybrid_overlap, shuffle.report.table()
    spark_bridge.release(out)
    assert_no_leftovers(cfg, ray)


def test_keys_that_are_no_column_names_are_explained(spark):
    """``aggregate``'s ``by`` and ``join``'s ``on`` take a name or a list of names.
    Anything else failed with a bare TypeError naming no fix (None or a number: "'NoneType'
    object is not iterable"; a Column: "Column is not iterable"), and bytes were taken as
    their byte values ("got 105"; found by a review)."""
    from pyspark.sql import functions as F

    df = spark.range(10).selectExpr("id", "id % 3 as k")
    for bad in (None, 5, F.col("k"), b"k"):
        with pytest.raises(ConfigError, match=r"aggregate's by must be a column name or a "
                                              r"list of column names, got"):
            spark_bridge.aggregate(df, bad, {"n": ("*", "count")})
        with pytest.raises(ConfigError, match=r"join's on must be a column name or a list "
                                              r"of column names, got"):
            spark_bridge.join(df, df, bad)
    # Names, as one string or any sequence of them, still work.
    assert spark_bridge.aggregate(df, ("k",), {"n": ("*", "count")}).count() == 3
    assert spark_bridge.join(df, df, ["id", "k"]).count() == 10


def test_an_overwrite_of_the_direct_path_s_input_does_not_race_its_maps(spark, tmp_path,
                                                                        monkeypatch):
    """``out = repartition(spark.read.parquet(p), ...)`` then
    ``out.write.mode("overwrite").parquet(p)``: Spark does not refuse an overwrite of a
    path the result is read from (its own repartition keeps every row), and it deletes the
    files before its tasks run. The direct path returned while its maps still read them:
    the maps failed with FileNotFoundError, the write failed and every input row was gone
    (found by a review). It returns once the writers have read every file. (Still not
    what a user should do: a writer dying before the result is consumed needs the input
    again; see test_parquet_scan's lost-input test and the README.)"""
    from spark_bridge import operations

    class Slow(HashPartitioner):  # local: pickled by value to the writers
        def assign(self, table, map_index, num_partitions):
            time.sleep(1.0)
            return super().assign(table, map_index, num_partitions)

    monkeypatch.setattr(operations, "HashPartitioner", Slow)
    path = str(tmp_path / "data")
    # Twelve files, one map each, on two writers: most maps start reading their file
    # seconds after the call.
    spark.range(6000).selectExpr("id", "id % 13 as k").repartition(12).write.parquet(path)
    df = spark.read.parquet(path)
    want = sorted(df.collect())
    cfg = base_config(tmp_path, map_chunk_bytes=16 * 1024)
    out = spark_bridge.repartition(df, 4, "k", config=cfg)
    out.write.mode("overwrite").parquet(path)  # (last_report() first would wait for maps)
    assert spark_bridge.last_report().map_input == "parquet files"
    assert sorted(spark.read.parquet(path).collect()) == want
    spark_bridge.release(out)
    assert_no_leftovers(cfg, ray)


@pytest.mark.parametrize("given", ["spk-0123456789ab", None, 3])
def test_release_refuses_anything_but_a_dataframe(given):
    """Was: ``spark_bridge.release("spk-...")`` (a shuffle id, not the DataFrame that
    ``repartition`` returned) returned 0, as if nothing were held, and the data stayed."""
    with pytest.raises(TypeError, match="expected a pyspark.sql.DataFrame, got "
                                        f"{type(given).__name__}"):
        spark_bridge.release(given)
