"""``hybrid-ray``: the demo job, the benchmark suite, cluster status and orphan cleanup."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any


def _parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use seconds or a number with s/m/h/d, e.g. 6h")


def cmd_demo(args: argparse.Namespace) -> int:
    """Shuffle generated rows through all three tiers on a local Ray and verify them."""
    import numpy as np
    import pyarrow as pa
    import ray

    import hybrid_ray
    from hybrid_ray import MiB, ShuffleConfig

    workdir = tempfile.mkdtemp(prefix="hybrid_ray_demo_")
    spill, remote = os.path.join(workdir, "spill"), os.path.join(workdir, "remote")
    try:
        rng = np.random.default_rng(args.seed)
        table = pa.table({"key": rng.integers(0, 1 << 40, args.rows),
                          "payload": rng.integers(0, 1 << 62, (args.rows,)),
                          "value": rng.random(args.rows)})
        data_bytes = table.nbytes
        # A memory budget and disk cap of a quarter of the data each: segments land in all
        # three tiers, as they would on a small node with a big job.
        config = ShuffleConfig(memory_capacity_bytes=data_bytes // 4, spill_dirs=[spill],
                               disk_capacity_bytes=data_bytes // 4,
                               remote_path=f"file://{remote}", compression="lz4",
                               segment_bytes={"memory": MiB, "disk": 2 * MiB,
                                              "remote": 4 * MiB})
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        ds = ray.data.from_arrow(table).repartition(args.blocks).materialize()
        print(f"hybrid_ray demo: {args.rows:,} rows ({data_bytes / 1e6:.1f} MB) in "
              f"{args.blocks} blocks -> {args.partitions} partitions by 'key'")
        print(f"  memory tier budget {config.memory_capacity_bytes / 1e6:.1f} MB, disk tier "
              f"{spill} capped at {config.disk_capacity_bytes / 1e6:.1f} MB, remote tier "
              f"{config.remote_path}")
        started = time.monotonic()
        out = hybrid_ray.repartition(ds, args.partitions, keys=["key"], config=config)
        parts = ray.get(out.to_arrow_refs())
        elapsed = time.monotonic() - started
        report = hybrid_ray.last_report()
        print(report.table())
        result = pa.concat_tables(parts)
        ok = _same_rows(result, table)
        # Each key lives in exactly one partition: per-partition distinct keys add up.
        distinct = [np.unique(p["key"].to_numpy()) for p in parts if p.num_rows]
        if distinct and sum(len(d) for d in distinct) != len(np.unique(np.concatenate(distinct))):
            ok = False
        leftovers = [os.path.join(r, f) for d in (spill, remote)
                     for r, _, fs in os.walk(d) for f in fs]
        print(f"rows in {table.num_rows:,} out {result.num_rows:,}; multiset identical: {ok}")
        print(f"end-to-end {elapsed:.2f} s, {data_bytes / 1e6 / elapsed:.1f} MB/s; "
              f"files left in spill and remote dirs: {len(leftovers)}")
        return 0 if ok and not leftovers else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _same_rows(a: Any, b: Any) -> bool:
    import pandas as pd

    def fingerprint(t):
        h = pd.util.hash_pandas_object(t.to_pandas(), index=False).to_numpy()
        return t.num_rows, int(h.sum(dtype="uint64"))

    return fingerprint(a) == fingerprint(b)


def _connect(address: str | None) -> None:
    import ray

    try:
        ray.init(address=address or "auto", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise SystemExit(f"hybrid-ray: no Ray cluster reachable at {address or 'auto'} "
                         f"({exc}). Start one with `ray start --head` or `ray up cluster.yaml`, "
                         "or pass --address.") from None


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    from hybrid_ray.actors import MASTER_NAME

    _connect(args.address)
    try:
        master = ray.get_actor(MASTER_NAME, namespace=args.namespace)
    except ValueError:
        print(f"no hybrid_ray shuffle master in namespace {args.namespace!r}: no shuffle has "
              "run on this cluster yet")
        return 0
    status = ray.get(master.status.remote())
    if args.json:
        print(json.dumps(status, default=str, indent=2))
        return 0
    print(f"{len(status['shuffles'])} active shuffle(s)")
    for s in status["shuffles"]:
        print(f"  {s['shuffle_id']}: {s['maps_finished']}/{s['num_maps']} maps finished, "
              f"{s['num_subpartitions']} partitions, age {s['age_s']:.0f} s, mode {s['mode']}")
    for node in status["nodes"]:
        print(f"node {node.node_id}")
        for t in node.tiers:
            cap = "unbounded" if t.capacity_bytes is None else f"{t.capacity_bytes / 1e6:.1f} MB"
            print(f"  {t.tier.value:<7} used {t.used_bytes / 1e6:10.1f} MB of {cap}")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from hybrid_ray.cleanup import sweep_remote, sweep_spill_dirs
    from hybrid_ray.config import default_spill_dir

    spill_dirs = args.spill_dir or [default_spill_dir()]
    removed = sweep_spill_dirs(spill_dirs, args.older_than)
    if args.remote_path:
        options = json.loads(args.storage_options) if args.storage_options else {}
        removed += sweep_remote(args.remote_path, args.older_than, options)
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} orphaned shuffle director{'y' if len(removed) == 1 else 'ies'} removed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo shuffle on a local Ray")
    demo.add_argument("--rows", type=int, default=2_000_000)
    demo.add_argument("--blocks", type=int, default=8)
    demo.add_argument("--partitions", type=int, default=8)
    demo.add_argument("--cpus", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    status = sub.add_parser("status", help="shuffles and tier usage of a running cluster")
    status.add_argument("--address", default=None)
    status.add_argument("--namespace", default="hybrid_ray")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    cleanup = sub.add_parser("cleanup", help="remove orphaned spill files and remote data")
    cleanup.add_argument("--older-than", type=_parse_duration, default=6 * 3600.0)
    cleanup.add_argument("--spill-dir", action="append")
    cleanup.add_argument("--remote-path")
    cleanup.add_argument("--storage-options", help="JSON of fsspec options")
    cleanup.set_defaults(func=cmd_cleanup)
    bench = sub.add_parser("bench", help="benchmark suite vs Ray Data and Spark (see --list)")
    from benchmarks.suite import add_arguments, run_from_args

    add_arguments(bench)
    bench.set_defaults(func=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("rows", "blocks", "partitions", "cpus"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) <= 0:
            print(f"hybrid-ray: --{name} must be positive", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
