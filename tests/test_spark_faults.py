"""Faults under the Spark bridge (executor path): an executor's Python worker killed with
SIGKILL mid-map and mid-reduce. Spark retries the task; the output is still exact and
nothing is left after release. The victim is chosen deterministically: the task kills its
own process at a chosen map (or reduce) index, on its first attempt only (a marker file).

One RayDP session for the module (starting it costs ~40 s), as in test_spark_bridge."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray

import spark_bridge
from conftest import assert_no_leftovers, base_config, record_fault_outcome
from hybrid_ray import HashPartitioner, MiB

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.fixture(autouse=True, scope="module")
def _ship_this_module_by_value():
    """Spark's Python workers cannot import this test module: its partitioners and
    reducers go by value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def orders(spark):
    """100k rows over 4 input partitions; not a parquet scan, so the executors write."""
    return spark.range(0, 100_000, numPartitions=4).selectExpr(
        "id", "cast(id % 97 as int) as customer_id", "repeat('x', 40) as note")


class KillsItsWorkerOnce(HashPartitioner):
    """Map ``victim`` kills its own Python worker (SIGKILL) after its first chunk was
    committed, on the first attempt only (``marker`` records that it died once)."""

    def __init__(self, keys, victim: int, marker: str):
        super().__init__(keys)
        self.victim, self.marker = victim, marker
        self.calls = 0

    def assign(self, table, map_index, num_partitions):
        self.calls += 1
        if map_index == self.victim and self.calls > 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().assign(table, map_index, num_partitions)


def _killing_reducer(victim: int, marker: str):
    """A pass-through reducer whose task for subpartition ``victim`` kills its own Python
    worker once, after it read the subpartition's segments."""

    def reduce(inputs, subpartition):
        if subpartition == victim and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        yield from inputs[0]

    return reduce


def _passthrough(inputs, _sub):
    yield from inputs[0]


@pytest.mark.parametrize("stage", ["map", "reduce"])
def test_executor_python_worker_killed_output_exact_nothing_left(spark, orders, tmp_path,
                                                                 stage):
    from spark_bridge import exchange

    marker = str(tmp_path / f"killed-{stage}")
    cfg = base_config(tmp_path, memory_capacity_bytes=1 * MiB, map_chunk_bytes=256 * 1024)
    partitioner = KillsItsWorkerOnce(["id"], 1, marker) if stage == "map" \
        else HashPartitioner(["id"])
    reducer = _killing_reducer(1, marker) if stage == "reduce" else _passthrough
    started = time.monotonic()
    shuffle = exchange.run_map_stage(orders, 3, partitioner, cfg, f"kill-{stage}",
                                     direct_scan=False)
    try:
        assert shuffle.report.map_input.startswith("spark executors")
        out = exchange.reduce_frame(spark, [shuffle], reducer, orders.schema)
        got = sorted(out.collect())
        elapsed = time.monotonic() - started
        assert os.path.exists(marker), f"no {stage} task killed its worker"
        assert got == sorted(orders.collect())
        if stage == "map":
            # The killed attempt's segments do not count; the retried attempt's do.
            assert shuffle.report.superseded_attempts >= 1
            assert shuffle.report.rows == 100_000
    finally:
        released = spark_bridge.release_all()
    assert released == 1
    assert spark_bridge.held_shuffles() == []
    assert_no_leftovers(cfg, ray)
    record_fault_outcome(f"Spark executor's Python worker killed mid-{stage}",
                         "exact rows (Spark retried the task)", elapsed, 0)
