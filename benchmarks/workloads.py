"""Deterministic benchmark data (same seed, same bytes) and an order-independent checksum.

- ``gensort``: 100-byte records, a 10-byte random key and a 90-byte payload (sort benchmark
  format).
- ``zipf``: 100-byte records whose int64 key follows a Zipf law (a few hot keys hold most
  rows: one reducer gets far more than its share).
- ``wide``: 32 numeric columns plus a string, ~300 bytes per row, keyed by an int64.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from hybrid_ray.partitioning import _mix64, hash_column

WORKLOADS = ("gensort", "zipf", "wide")
ROW_BYTES = {"gensort": 100, "zipf": 100, "wide": 32 * 8 + 40}
BLOCK_BYTES = 64 * 1024 * 1024


def _fixed(data: np.ndarray, width: int) -> pa.Array:
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(data),
                                                [None, pa.py_buffer(data.tobytes())])


def make_block(workload: str, rows: int, seed: int, index: int) -> pa.Table:
    """Block ``index`` of a workload; every block has its own seeded stream."""
    rng = np.random.default_rng([seed, index])
    if workload == "gensort":
        return pa.table({
            "key": _fixed(rng.integers(0, 256, (rows, 10), dtype=np.uint8), 10),
            "payload": _fixed(rng.integers(0, 256, (rows, 90), dtype=np.uint8), 90)})
    if workload == "zipf":
        return pa.table({
            "key": pa.array(rng.zipf(1.3, rows).astype(np.int64)),
            "payload": _fixed(rng.integers(0, 256, (rows, 92), dtype=np.uint8), 92)})
    if workload == "wide":
        cols = {"key": pa.array(rng.integers(0, 1 << 40, rows))}
        for i in range(31):
            cols[f"c{i:02d}"] = pa.array(rng.random(rows) if i % 2 else
                                         rng.integers(0, 1 << 60, rows))
        cols["text"] = _fixed(rng.integers(97, 123, (rows, 40), dtype=np.uint8), 40) \
            .cast(pa.binary()).cast(pa.string())
        return pa.table(cols)
    raise ValueError(f"unknown workload {workload!r}; choose one of {WORKLOADS}")


def generate(workload: str, size_bytes: int, seed: int = 0) -> list[pa.Table]:
    """About ``size_bytes`` of a workload, in ~64 MiB blocks."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {WORKLOADS}")
    total_rows = max(1, size_bytes // ROW_BYTES[workload])
    per_block = max(1, BLOCK_BYTES // ROW_BYTES[workload])
    blocks, start, index = [], 0, 0
    while start < total_rows:
        rows = min(per_block, total_rows - start)
        blocks.append(make_block(workload, rows, seed, index))
        start, index = start + rows, index + 1
    return blocks


def checksum(tables: Iterable[pa.Table | pa.RecordBatch]) -> tuple[int, int]:
    """(rows, sum of 64-bit row hashes mod 2^64): equal for equal row multisets, whatever
    the order, block boundaries or binary vs fixed-size-binary representation."""
    rows, total = 0, np.uint64(0)
    for t in tables:
        if t.num_rows == 0:
            continue
        h = np.zeros(t.num_rows, dtype=np.uint64)
        for name in sorted(t.schema.names):
            h = _mix64(h ^ hash_column(t.column(name)))
        with np.errstate(over="ignore"):
            total = total + h.sum(dtype=np.uint64)
        rows += t.num_rows
    return rows, int(total)
