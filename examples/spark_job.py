"""A PySpark job on a running Ray cluster whose exchanges go through hybrid_ray.

Run it on a cluster started with `ray up` (see README), e.g.
    ray exec cluster-local.yaml 'cd ~/hybrid_ray && .venv/bin/python examples/spark_job.py'
or against any Ray cluster: `python examples/spark_job.py --address auto`.

It builds an orders table, repartitions it by customer and aggregates revenue per country
through spark_bridge (memory budget and disk cap small enough that segments also go to the
remote tier), runs the same pipeline on Spark's own shuffle, and exits non-zero unless the
two results are identical row for row.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="Ray cluster address")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--remote", default=None,
                        help="remote tier URL (default: file:// under the temp dir)")
    args = parser.parse_args()

    import spark_bridge
    from hybrid_ray import MiB, ShuffleConfig
    from pyspark.sql import functions as F

    work = tempfile.mkdtemp(prefix="hybrid_ray_spark_job_")
    config = ShuffleConfig(memory_capacity_bytes=4 * MiB, disk_capacity_bytes=4 * MiB,
                           spill_dirs=[os.path.join(work, "spill")],
                           remote_path=args.remote or f"file://{work}/remote", progress=False)
    started = time.monotonic()
    spark = spark_bridge.init_spark("hybrid_ray-example", num_executors=2, executor_cores=1,
                                    executor_memory="1GB", ray_address=args.address)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        orders = spark.range(0, args.rows, numPartitions=4).selectExpr(
            "id as order_id", "cast(id % 9973 as long) as customer_id",
            "cast((id * 7919) % 100000 as long) as cents")
        customers = spark.range(0, 9973, numPartitions=2).selectExpr(
            "id as customer_id", "concat('country-', cast(id % 31 as string)) as country")

        by_customer = spark_bridge.repartition(orders, 8, "customer_id", config=config)
        print(spark_bridge.last_report().table())
        joined = spark_bridge.join(by_customer, customers, "customer_id", config=config)
        revenue = spark_bridge.aggregate(joined, "country", {
            "orders": ("*", "count"), "revenue": ("cents", "sum")}, config=config)
        got = sorted(revenue.collect())
        want = sorted(orders.join(customers, "customer_id").groupBy("country").agg(
            F.count("*").alias("orders"), F.sum("cents").alias("revenue")).collect())
        exact = got == want
        for row in got[:5]:
            print(f"  {row.country}: {row.orders} orders, {row.revenue} cents")
        print(f"{len(got)} countries; identical to Spark's own shuffle: {exact}; "
              f"{time.monotonic() - started:.1f} s including Spark start-up")
        for df in (by_customer, joined, revenue):
            spark_bridge.release(df)
        return 0 if exact else 1
    finally:
        spark_bridge.stop_spark()


if __name__ == "__main__":
    sys.exit(main())
