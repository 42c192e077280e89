"""spark_bridge: PySpark on the Ray cluster (RayDP) with every exchange through hybrid_ray.

    import spark_bridge
    spark = spark_bridge.init_spark("etl", num_executors=2, executor_cores=1,
                                    executor_memory="2GB", shuffle_config=ShuffleConfig(...))
    ...  # any DataFrame / SQL code: its exchanges go through hybrid_ray's shuffle manager
    out = spark_bridge.repartition(spark.read.parquet("in/"), 16, "customer_id")
    print(spark_bridge.last_report().table())     # the direct parquet path's report
    print(spark_bridge.spark_shuffle_reports())   # the shuffle manager's, one per exchange
    spark_bridge.stop_spark()

``init_spark`` sets Spark's ``spark.shuffle.manager`` to hybrid_ray's JVM manager
(``hybrid_shuffle``). ``repartition`` of a plain parquet scan has hybrid_ray's writers read
the files themselves (``parquet_scan``) and the executors read the shuffled rows back
(``exchange``); ``sort``, ``aggregate``, ``join`` and every other ``repartition`` are Spark's
own operators through the manager (``operations``).
"""

from spark_bridge.exchange import BridgeShuffle, held_shuffles, last_report, release_all
from spark_bridge.operations import (
    AGG_FUNCTIONS, JOIN_TYPES, aggregate, join, release, repartition, sort,
)
from spark_bridge.session import SparkSetupError, init_spark, spark_shuffle_reports, stop_spark

__all__ = [
    "AGG_FUNCTIONS", "BridgeShuffle", "JOIN_TYPES", "SparkSetupError", "aggregate",
    "held_shuffles", "init_spark", "join", "last_report", "release", "release_all",
    "repartition", "sort", "spark_shuffle_reports", "stop_spark",
]
