"""One Daft case, run by the suite as a subprocess with the Daft virtualenv's python
(``daft_peer.py``): Daft pins ray<2.60 and pyarrow<26, so it cannot share this project's
environment. Not imported by the suite itself.

It starts its own local Ray (the suite has none running meanwhile), generates the
workload's rows with ``benchmarks.workloads`` (the same function, seed and sizes as every
other case), puts them in the object store as a Daft DataFrame (``daft.from_arrow``, as
Ray Data's cases start from a materialized Dataset), selects the shuffle with
``daft.set_execution_config(shuffle_algorithm=...)`` and runs ``--rounds`` timed
``df.repartition(n, col("key")).collect()``, the first of them Daft's first shuffle on
its fresh Ray (no warm-up shuffle: the suite's first calls are every system's real
first call); each round's output is checksummed outside the timing. The result is one
line on stdout: ``HR_DAFT_RESULT <json>`` (parsed by ``daft_peer.parse_daft_output``).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import re
import sys
import time
import traceback
import types

RESULT_PREFIX = "HR_DAFT_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_workloads():
    """``benchmarks.workloads`` needs only ``hybrid_ray.partitioning`` (numpy, pyarrow):
    load that module alone, not ``hybrid_ray/__init__`` (written for this project's Ray
    and pyarrow, not the Daft venv's)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if "hybrid_ray" not in sys.modules:
        stub = types.ModuleType("hybrid_ray")
        stub.__path__ = [os.path.join(ROOT, "hybrid_ray")]
        sys.modules["hybrid_ray"] = stub
    from benchmarks import workloads
    return workloads


def physical_shuffle(df) -> str:
    """The shuffle node of ``df``'s physical plan (``RayShuffle``, ``FlightShuffle``, ...):
    proof of what the configured algorithm made Daft run."""
    buf = io.StringIO()
    df.explain(show_all=True, file=buf)
    plan = buf.getvalue().split("== Physical Plan ==")[-1]
    match = re.search(r"\*\s*(\w*Shuffle\w*)", plan)
    return match.group(1) if match else "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--workload", default="gensort")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--object-store-bytes", type=int, default=2 * 1024**3)
    p.add_argument("--shuffle-dir", required=True)
    args = p.parse_args(argv)

    out: dict = {"strategy": args.strategy, "rounds": [], "error": None}
    try:
        import daft
        import ray
        from daft import col

        workloads = _import_workloads()
        out["versions"] = {"daft": daft.__version__, "ray": ray.__version__,
                           "pyarrow": __import__("pyarrow").__version__}
        ray.init(address="local", num_cpus=args.cpus,
                 object_store_memory=args.object_store_bytes, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
        daft.set_runner_ray()
        os.makedirs(args.shuffle_dir, exist_ok=True)
        daft.set_execution_config(shuffle_algorithm=args.strategy,
                                  flight_shuffle_dirs=[args.shuffle_dir])

        def shuffle(df):
            return df.repartition(args.partitions, col("key"))

        blocks = workloads.generate(args.workload, args.size, args.seed)
        out["expected"] = list(workloads.checksum(blocks))
        df = daft.from_arrow(blocks)  # ray.put of every block (RayRunner's partition cache)
        del blocks
        out["physical_shuffle"] = physical_shuffle(shuffle(df))
        config = daft.context.get_context().daft_execution_config
        out["config"] = {k: getattr(config, k, None) for k in
                         ("shuffle_algorithm", "flight_shuffle_compression")}
        for _ in range(args.rounds):
            start = time.perf_counter()
            result = shuffle(df).collect()
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            parts = [ray.get(p) if isinstance(p, ray.ObjectRef) else p
                     for p in result.iter_partitions()]
            rows, total = workloads.checksum(p.to_arrow() for p in parts)
            # Fetching and checksumming the output is not timed (nor is it for the other
            # cases); its seconds are kept to show collect() had really finished the work.
            out["rounds"].append({"seconds": seconds, "rows": rows, "checksum": total,
                                  "partitions": len(parts),
                                  "verify_seconds": time.perf_counter() - start})
            del result, parts
            gc.collect()
    except BaseException as exc:  # reported to the suite, which records the case as failed
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}" \
            if str(exc).strip() else type(exc).__name__
        traceback.print_exc(file=sys.stderr)
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
