"""Repartition by key: hybrid_ray vs Ray Data's own shuffle strategies, same data, same run.

Data: gensort-style 100-byte records (10-byte key, 90-byte payload), generated from a seed.
Every result is verified (row count and order-independent checksum) before it counts.
Prints a Markdown table of MB/s and the ratio of hybrid_ray to each baseline.

    .venv/bin/python benchmarks/compare_repartition.py --mb 256 --partitions 16
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import ray

import hybrid_ray
from hybrid_ray import ShuffleConfig


def gensort_table(num_rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 256, (num_rows, 10), dtype=np.uint8)
    payload = rng.integers(0, 256, (num_rows, 90), dtype=np.uint8)
    return pa.table({
        "key": pa.FixedSizeBinaryArray.from_buffers(pa.binary(10), num_rows,
                                                    [None, pa.py_buffer(keys.tobytes())]),
        "payload": pa.FixedSizeBinaryArray.from_buffers(pa.binary(90), num_rows,
                                                        [None, pa.py_buffer(payload.tobytes())]),
    })


def fingerprint(tables) -> tuple[int, int]:
    rows, total = 0, 0
    for t in tables:
        h = pd.util.hash_pandas_object(t.to_pandas(), index=False).to_numpy()
        total = (total + int(h.sum(dtype=np.uint64))) % (1 << 64)
        rows += t.num_rows
    return rows, total


def run_ray_data(ds, n: int, strategy: str, disk: bool = False):
    ctx = ray.data.DataContext.get_current()
    ctx.shuffle_strategy = strategy
    if hasattr(ctx, "use_disk_based_hash_shuffle"):
        ctx.use_disk_based_hash_shuffle = disk
    out = ds.repartition(n, keys=["key"]).materialize()
    return ray.get(out.to_arrow_refs())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows = args.mb * 1_000_000 // 100
    table = gensort_table(rows, args.seed)
    expected = fingerprint([table])
    ds = ray.data.from_arrow(table).repartition(args.blocks).materialize()
    spill = tempfile.mkdtemp(prefix="hr-bench-")
    cases = {
        "hybrid_ray (memory+disk)": lambda: ray.get(hybrid_ray.repartition(
            ds, args.partitions, keys=["key"],
            config=ShuffleConfig(spill_dirs=[spill], progress=False)).to_arrow_refs()),
        "ray_data SHUFFLE_V2 (default)": lambda: run_ray_data(ds, args.partitions, "shuffle_v2"),
        "ray_data HASH_SHUFFLE": lambda: run_ray_data(ds, args.partitions, "hash_shuffle"),
        "ray_data SORT_SHUFFLE_PULL_BASED": lambda: run_ray_data(
            ds, args.partitions, "sort_shuffle_pull_based"),
    }
    results = {}
    for name, fn in cases.items():
        try:
            start = time.monotonic()
            parts = fn()
            elapsed = time.monotonic() - start
            ok = fingerprint(parts) == expected
            results[name] = (args.mb / elapsed if ok else None, elapsed, ok)
        except Exception as exc:  # a failed case is recorded, not fatal
            results[name] = (None, 0.0, f"failed: {type(exc).__name__}: {exc}"[:120])
    ours = results["hybrid_ray (memory+disk)"][0]
    print(f"\n{args.mb} MB of 100-byte records, {args.partitions} partitions, "
          f"{os.cpu_count()} CPUs\n")
    print("| case | MB/s | seconds | verified | hybrid_ray / case |")
    print("|---|---:|---:|---|---:|")
    for name, (mbs, secs, ok) in results.items():
        ratio = f"{ours / mbs:.2f}x" if ours and mbs else "-"
        print(f"| {name} | {mbs or 0:.1f} | {secs:.2f} | {ok} | {ratio} |")


if __name__ == "__main__":
    main()
