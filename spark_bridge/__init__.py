"""spark_bridge: PySpark DataFrame exchanges through hybrid_ray, with Spark on Ray (RayDP).

    import spark_bridge
    spark = spark_bridge.init_spark("etl", num_executors=2, executor_cores=1,
                                    executor_memory="2GB")
    out = spark_bridge.repartition(df, 16, "customer_id", config=ShuffleConfig(...))
    print(spark_bridge.last_report().table())
    spark_bridge.stop_spark()

The map stage of each operation writes into hybrid_ray's tiers: hybrid_ray's writers read a
plain parquet scan's files themselves (``parquet_scan``), else Spark's executors hand over
Arrow batches; the reduce stage reads them back in Spark tasks (see ``exchange``).
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
