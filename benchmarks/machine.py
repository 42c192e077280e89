"""The machine's own limits, measured by the suite so ratios can be read against them."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np


def disk_write_mb_s(directory: str | None = None, nbytes: int = 512 * 1024 * 1024) -> float:
    """Sequential write bandwidth to ``directory`` (1 MiB writes, fsync'd), in MB/s."""
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    fd, path = tempfile.mkstemp(prefix="hr-bench-disk-", dir=directory)
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb", buffering=0) as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        return nbytes / 1e6 / (time.perf_counter() - start)
    finally:
        os.unlink(path)


def memory_copy_mb_s(nbytes: int = 512 * 1024 * 1024, repeats: int = 3) -> float:
    """Single-threaded memory copy bandwidth (bytes copied per second), best of ``repeats``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / 1e6 / best
