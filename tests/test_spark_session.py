"""spark_bridge.session's config logic, without starting Spark."""

from __future__ import annotations

import pytest

from spark_bridge.session import (
    ADD_OPENS, EXECUTOR_ACTOR_CPU_KEY, executor_actor_cpus, spark_configs,
)


@pytest.mark.parametrize("executors, cores, cluster, claim", [
    (2, 1, 2.0, 0.5),    # this machine: the executors would hold both CPUs
    (1, 1, 8.0, 1.0),    # room to spare: each executor claims its cores
    (4, 2, 16.0, 2.0),
    (4, 2, 8.0, 1.0),    # 8 of 8 wanted: half the cluster over 4 executors
    (3, 1, 2.0, 0.3333),
])
def test_executors_leave_half_the_cpus_to_ray(executors, cores, cluster, claim):
    assert executor_actor_cpus(executors, cores, cluster) == claim


def test_spark_configs_keep_user_values_and_append_java_flags():
    configs = spark_configs(2, 1, {"spark.driver.extraJavaOptions": "-Xss4m",
                                   "spark.sql.shuffle.partitions": 7}, cluster_cpus=2.0)
    assert configs["spark.driver.extraJavaOptions"] == f"-Xss4m {ADD_OPENS}"
    assert configs["spark.executor.extraJavaOptions"] == ADD_OPENS
    assert configs["spark.sql.shuffle.partitions"] == "7"
    assert configs[EXECUTOR_ACTOR_CPU_KEY] == "0.5"
    # The caller's choice of the executors' Ray CPU claim wins.
    assert spark_configs(2, 1, {EXECUTOR_ACTOR_CPU_KEY: "1"}, 2.0)[EXECUTOR_ACTOR_CPU_KEY] == "1"
