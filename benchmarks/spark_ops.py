"""spark_bridge's direct parquet repartition against Spark's operator through the manager.

The Spark shuffle-manager issue keeps a ``spark_bridge`` operation only where it beats
Spark's own operator with hybrid_ray's shuffle manager on (every exchange already goes
through hybrid_ray then). This runs both in one RayDP session, alternating, on TPC-H-like
``lineitem``/``orders`` parquet files: once on a plain parquet scan (the bridge's writers
read the files themselves) and once on a filtered scan (where ``spark_bridge.repartition``
is Spark's operator too, so both sides should match). Every result is written to Spark's
``noop`` sink and both sides' outputs are checked to hold the same row multiset.

``sort``, ``aggregate`` and ``join`` were measured the same way while they were Arrow
re-implementations (``results/spark-ops/results-5c85bd8.md``): slower than Spark's
operators through the manager on every input, so they became those operators.

    python -m benchmarks.spark_ops --scale 0.2 --rounds 2

Results: ``benchmarks/results/spark-ops/results.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.spark_sql import SPARK_CONFIGS, generate

PARTITIONS = 8


def _operations(bridge: Any) -> dict[str, tuple[Callable, Callable]]:
    """name -> (bridge call, Spark call), each taking (lineitem, orders) DataFrames."""
    return {
        "repartition": (lambda li, o: bridge.repartition(li, PARTITIONS, "l_orderkey"),
                        lambda li, o: li.repartition(PARTITIONS, "l_orderkey")),
    }


def _rounded(df: Any, F: Any) -> Any:
    """``df`` with doubles rounded to 6 decimals and columns in name order (Arrow's and
    Spark's sums of the same doubles may differ in the last bits; column order may too)."""
    cols = [F.round(df[c], 6).alias(c) if t == "double" else df[c]
            for c, t in sorted(df.dtypes)]
    return df.select(*cols)


def _same_rows(a: Any, b: Any, F: Any) -> bool:
    a, b = _rounded(a, F), _rounded(b, F)
    return a.count() == b.count() and a.exceptAll(b).count() == 0 \
        and b.exceptAll(a).count() == 0


def run(scale: float, rounds: int, workdir: str) -> dict[str, Any]:
    """Both sides of every operation on both inputs, ``rounds`` alternating rounds each."""
    import ray
    from pyspark.sql import functions as F

    import spark_bridge

    os.makedirs(os.path.join(workdir, "data"))
    paths = generate(os.path.join(workdir, "data"), scale, seed=7)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    spark = spark_bridge.init_spark("ops-bench", num_executors=2, executor_cores=1,
                                    executor_memory="2GB",
                                    configs={**SPARK_CONFIGS,
                                             "spark.sql.shuffle.partitions": str(PARTITIONS)},
                                    hybrid_shuffle=True)
    spark.sparkContext.setLogLevel("ERROR")
    results: list[dict[str, Any]] = []
    try:
        lineitem = spark.read.parquet(paths["lineitem"])
        orders = spark.read.parquet(paths["orders"])
        inputs = {"parquet scan": (lineitem, orders),
                  "filtered scan": (lineitem.filter("l_quantity > 0"),
                                    orders.filter("o_totalprice > 0"))}
        for op, (bridge_call, spark_call) in _operations(spark_bridge).items():
            for input_name, (li, o) in inputs.items():
                times: dict[str, list[float]] = {"bridge": [], "spark": []}
                for _ in range(rounds):
                    for side, call in (("bridge", bridge_call), ("spark", spark_call)):
                        start = time.perf_counter()
                        out = call(li, o)
                        out.write.format("noop").mode("overwrite").save()
                        times[side].append(time.perf_counter() - start)
                        if side == "bridge":
                            spark_bridge.release(out)
                same = _same_rows(bridge_call(li, o), spark_call(li, o), F)
                spark_bridge.release_all()
                results.append({"operation": op, "input": input_name, "same_rows": same,
                                "bridge_s": times["bridge"], "spark_s": times["spark"]})
                print(f"{op:12s} {input_name:14s} bridge {min(times['bridge']):6.2f} s  "
                      f"spark+manager {min(times['spark']):6.2f} s  same rows: {same}",
                      flush=True)
    finally:
        spark_bridge.stop_spark()
    return {"scale": scale, "rounds": rounds, "results": results}


def markdown(data: dict[str, Any], command: str) -> str:
    lines = ["# spark_bridge operations vs Spark's operators through the shuffle manager",
             "", f"command: `{command}`; scale {data['scale']}, {PARTITIONS} partitions, "
             "2 executors x 1 core; best of the rounds (all rounds listed)", "",
             "| operation | input | bridge s | Spark + manager s | bridge speed-up | "
             "same rows | rounds (bridge / Spark) |", "|---|---|---:|---:|---:|---|---|"]
    for r in data["results"]:
        b, s = min(r["bridge_s"]), min(r["spark_s"])
        rounds = " ".join(f"{x:.2f}" for x in r["bridge_s"]) + " / " + \
            " ".join(f"{x:.2f}" for x in r["spark_s"])
        lines.append(f"| {r['operation']} | {r['input']} | {b:.2f} | {s:.2f} | "
                     f"{s / b:.2f}x | {'yes' if r['same_rows'] else 'NO'} | {rounds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.2, help="TPC-H-like scale (1.0 = 6M lines)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "spark-ops"))
    args = p.parse_args(argv)
    if args.scale <= 0 or args.rounds < 1:
        p.error("--scale must be > 0 and --rounds >= 1")
    from benchmarks.suite import out_dir_problem

    problem = out_dir_problem(args.out)
    if problem:  # found before the run: afterwards it cost the whole run's results
        p.error(f"--out: {problem}")
    with tempfile.TemporaryDirectory(prefix="hr-ops-bench-") as workdir:
        data = run(args.scale, args.rounds, workdir)
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks.spark_ops " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(data, command))
    print(markdown(data, command))
    return 0 if all(r["same_rows"] for r in data["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
