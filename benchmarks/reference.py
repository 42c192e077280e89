"""An in-process reference for the suite: the same repartition by key done by Polars inside
one process, with no cluster, no object store and no serialization between processes.

It is not a peer (it cannot spill, survive a process, or spread over nodes); it shows how
fast this machine moves the workload's rows into partitions when nothing else is paid,
beside the computed floor (``machine.shuffle_floor``) and the distributed shuffles.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import pyarrow as pa

from benchmarks.workloads import checksum

MB = 1_000_000


@dataclasses.dataclass
class ReferenceRounds:
    """Seconds of each timed round (the first is the first call), whether every round's
    partitions held exactly the input's rows, and a note for the report."""

    seconds: list[float]
    verified: bool
    note: str


def polars_partition_by(blocks: Sequence[pa.Table], num_partitions: int, key: str = "key",
                        rounds: int = 2) -> ReferenceRounds:
    """Repartition ``blocks`` by a hash of ``key`` into ``num_partitions`` DataFrames with
    Polars (``hash(key) % n``, then ``partition_by``), ``rounds`` times.

    Each round is timed from the DataFrame (Arrow data already converted once: the
    conversion is in the note) to the list of partitions, and checked afterwards against
    the input's order-independent checksum and for at most ``num_partitions`` partitions,
    so a round that lost or invented rows does not count (which partition a key went to is
    Polars's own hash, not checked). Raises ``ImportError`` naming the fix if Polars is
    not installed.
    """
    if num_partitions < 1 or rounds < 1:
        raise ValueError(f"num_partitions and rounds must be >= 1, got {num_partitions} "
                         f"and {rounds}")
    try:
        import polars as pl
    except ImportError as exc:
        raise ImportError("the in-process reference needs Polars: install the bench extra "
                          "(pip install -e '.[bench]', done by ./dev setup)") from exc
    expected = checksum(blocks)
    started = time.perf_counter()
    frame = pl.from_arrow(pa.concat_tables(blocks))
    converted = time.perf_counter() - started
    seconds, verified = [], True
    for _ in range(rounds):
        started = time.perf_counter()
        parts = frame.with_columns((pl.col(key).hash(seed=0) % num_partitions).alias("_part")
                                   ).partition_by("_part", include_key=False)
        seconds.append(time.perf_counter() - started)
        verified = verified and len(parts) <= num_partitions and \
            checksum(p.to_arrow() for p in parts) == expected
        del parts
    return ReferenceRounds(seconds, verified,
                           f"polars {pl.__version__}, one process; Arrow to Polars "
                           f"conversion before the rounds {converted:.2f} s (not timed)")
