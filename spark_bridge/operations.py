"""DataFrame operations whose exchange goes through hybrid_ray.

Each operation runs its map stage now (one Spark job writing through the tiers) and returns
a lazy DataFrame whose partition i is subpartition i, finished by a reducer in the
executors' Python workers:

- ``repartition``: hash partitioning by columns (rows with equal keys share a partition);
- ``sort``: range partitioning on sampled boundaries, each partition sorted, so the
  partitions in order are the globally sorted DataFrame (Spark's nulls-first/last rules);
- ``aggregate``: group-by aggregation with map-side partial aggregation;
- ``join``: both sides hash-partitioned alike, each partition pair joined.

Call ``release(df)`` when a result is no longer needed (``stop_spark`` releases all).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import ConfigError
from hybrid_ray.partitioning import HashPartitioner, Partitioner, range_boundaries
from hybrid_ray.shuffle import check_num_partitions
from spark_bridge import exchange
from spark_bridge.exchange import concat_or_empty

SAMPLES_PER_PARTITION_FACTOR = 20  # samples per map partition, per output partition
MAX_SAMPLES_PER_PARTITION = 10_000


# ---- validation -----------------------------------------------------------------------------------
def _check_dataframe(df: Any) -> None:
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        raise TypeError(f"expected a pyspark.sql.DataFrame, got {type(df).__name__}")


def _default_partitions(df: Any, num_partitions: int | None) -> int:
    if num_partitions is None:
        return int(df.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    check_num_partitions(num_partitions)
    return num_partitions


def _check_columns(df: Any, cols: Sequence[Any], what: str) -> list[str]:
    names = []
    for col in cols:
        if not isinstance(col, str):
            raise ConfigError(f"{what}: columns must be given by name (str), got {col!r}")
        names.append(col)
    missing = [c for c in names if c not in df.columns]
    if missing:
        raise ConfigError(f"{what}: unknown column(s) {missing}; the DataFrame has columns "
                          f"{df.columns}")
    return names


def release(df: Any) -> int:
    """Delete the hybrid_ray data behind a DataFrame returned by this module (it cannot be
    computed again afterwards). Returns how many shuffles were released."""
    return sum(exchange.release(s) for s in getattr(df, "_hybrid_ray_shuffles", []))


# ---- repartition ------------------------------------------------------------------------------------
def repartition(df: Any, num_partitions: int, *cols: str,
                config: ShuffleConfig | None = None, direct_scan: bool = True) -> Any:
    """``df.repartition(num_partitions, *cols)`` with the exchange done by hybrid_ray.

    Returns a DataFrame with ``df``'s schema and exactly its rows, in ``num_partitions``
    partitions; rows with equal values of ``cols`` are in the same partition. The shuffle's
    report is ``spark_bridge.last_report()``.

    ``direct_scan``: if ``df`` is a plain scan of local parquet files, hybrid_ray's writers
    read the files instead of Spark's executors handing the rows over (same rows, less
    CPU; see ``spark_bridge.parquet_scan``). The report's ``map_input`` says which ran.
    The other operations take it too.
    """
    _check_dataframe(df)
    check_num_partitions(num_partitions)
    if not cols:
        raise ConfigError("repartition needs at least one column to partition by")
    keys = _check_columns(df, cols, "repartition")
    config = exchange.check_config(config)
    shuffle = exchange.run_map_stage(df, num_partitions, HashPartitioner(keys), config,
                                     "repartition", direct_scan=direct_scan)

    def passthrough(inputs: list[list[pa.Table]], _sub: int) -> Iterator[pa.Table]:
        for table in inputs[0]:
            yield table
    return exchange.reduce_frame(df.sparkSession, [shuffle], passthrough, df.schema)


# ---- sort -----------------------------------------------------------------------------------------------
class SortPartitioner(Partitioner):
    """Range partitions on the first sort column, from sampled boundaries; each reducer
    sorts its partition by all sort columns. Nulls follow Spark: first when ascending,
    last when descending."""

    def __init__(self, keys: Sequence[str], ascending: Sequence[bool],
                 boundaries: pa.Array) -> None:
        self.keys = list(keys)
        self.ascending = list(ascending)
        self.boundaries = boundaries
        self._bounds_np: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_bounds_np": None}

    def assign(self, table: pa.Table, map_index: int, num_partitions: int) -> np.ndarray:
        if self._bounds_np is None:
            self._bounds_np = self.boundaries.to_numpy(zero_copy_only=False)
        column = table.column(self.keys[0]).combine_chunks()
        idx = np.zeros(table.num_rows, dtype=np.int64)  # nulls: partition 0 (before flip)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        values = column.filter(column.is_valid()).to_numpy(zero_copy_only=False)
        idx[valid] = np.searchsorted(self._bounds_np, values, side="right")
        if not self.ascending[0]:
            idx = (num_partitions - 1) - idx
            idx[~valid] = num_partitions - 1  # descending: nulls last
        return idx

    def finalize(self, table: pa.Table, subpartition: int) -> pa.Table:
        return sort_table(table, self.keys, self.ascending)


def sort_table(table: pa.Table, keys: Sequence[str], ascending: Sequence[bool]) -> pa.Table:
    """Sort like Spark's ``orderBy``: per column, nulls first if ascending, last if not."""
    sort_keys, helpers = [], []
    for i, (key, asc) in enumerate(zip(keys, ascending)):
        helper = f"__hybrid_ray_null_{i}"
        table = table.append_column(helper, pc.is_null(table.column(key)))
        helpers.append(helper)
        sort_keys.append((helper, "descending" if asc else "ascending"))
        sort_keys.append((key, "ascending" if asc else "descending"))
    return table.sort_by(sort_keys).drop(helpers)


def _make_sampler(key: str, per_partition: int):
    def sample(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        values = [b.column(0) for b in batches if b.num_rows]
        if not values:
            return
        column = pa.chunked_array(values).combine_chunks()
        column = column.filter(column.is_valid())
        rng = np.random.default_rng(TaskContext.get().partitionId())
        if len(column) > per_partition:
            column = column.take(pa.array(np.sort(rng.choice(len(column), per_partition,
                                                             replace=False))))
        data = exchange.ipc_bytes(pa.table({key: column}))
        yield pa.RecordBatch.from_pydict({"sample": [data]},
                                         schema=pa.schema([("sample", pa.binary())]))
    return sample


def sort(df: Any, *cols: str, ascending: bool | Sequence[bool] = True,
         num_partitions: int | None = None, config: ShuffleConfig | None = None,
         direct_scan: bool = True) -> Any:
    """``df.orderBy(*cols, ascending=...)`` with the exchange done by hybrid_ray.

    Partitions of the result, in order, hold the globally sorted rows (collect() returns
    them sorted). ``num_partitions`` defaults to ``spark.sql.shuffle.partitions``.
    """
    _check_dataframe(df)
    if not cols:
        raise ConfigError("sort needs at least one column to sort by")
    keys = _check_columns(df, cols, "sort")
    if isinstance(ascending, bool):
        ascending = [ascending] * len(keys)
    ascending = list(ascending)
    if len(ascending) != len(keys) or not all(isinstance(a, bool) for a in ascending):
        raise ConfigError(f"ascending must be a bool or one bool per sort column "
                          f"({len(keys)}), got {ascending!r}")
    n = _default_partitions(df, num_partitions)
    config = exchange.check_config(config)
    per_partition = min(MAX_SAMPLES_PER_PARTITION, SAMPLES_PER_PARTITION_FACTOR * n)
    rows = df.select(keys[0]).mapInArrow(_make_sampler(keys[0], per_partition),
                                         "sample binary").collect()
    samples = [exchange.read_ipc(r.sample).column(0) for r in rows]
    boundaries = _boundaries(samples, n, df, keys[0])
    partitioner = SortPartitioner(keys, ascending, boundaries)
    shuffle = exchange.run_map_stage(df, n, partitioner, config, "sort",
                                     direct_scan=direct_scan)

    schema = shuffle.schema  # not the BridgeShuffle itself: it holds a thread Event

    def sort_partition(inputs: list[list[pa.Table]], sub: int) -> Iterator[pa.Table]:
        yield partitioner.finalize(concat_or_empty(inputs[0], schema), sub)
    return exchange.reduce_frame(df.sparkSession, [shuffle], sort_partition, df.schema)


def _boundaries(samples: list[pa.ChunkedArray], n: int, df: Any, key: str) -> pa.Array:
    from pyspark.sql.pandas.types import to_arrow_schema

    key_type = to_arrow_schema(df.select(key).schema).field(0).type
    chunks = [c for s in samples for c in s.chunks if len(c)]
    if not chunks:
        return pa.array([], key_type)
    column = pa.chunked_array(chunks).combine_chunks()
    order = pc.sort_indices(column)
    picks = range_boundaries(np.arange(len(column)), n)  # quantile positions
    return column.take(order.take(pa.array(picks, pa.int64()))) if len(picks) \
        else column.slice(0, 0)


# ---- aggregate ---------------------------------------------------------------------------------------------
AGG_FUNCTIONS = ("sum", "count", "min", "max", "mean", "avg", "count_distinct")
# Functions that combine: a partial per map chunk, then a final over partials.
_COMBINABLE = {"sum", "count", "min", "max", "mean", "avg"}


def _group_aggregate(table: pa.Table, keys: list[str],
                     specs: Sequence[tuple[str | None, str]]) -> dict[Any, pa.ChunkedArray]:
    """Run pyarrow group-by with de-duplicated ``(column, function)`` specs ("count_all"
    takes no column); returns the key columns by name and each spec's result column."""
    unique = list(dict.fromkeys(specs))
    aggs = [([], "count_all") if fn == "count_all" else (col, fn) for col, fn in unique]
    out = table.group_by(keys, use_threads=False).aggregate(aggs)
    result: dict[Any, pa.ChunkedArray] = {k: out.column(k) for k in keys}
    for col, fn in unique:
        result[(col, fn)] = out.column("count_all" if fn == "count_all" else f"{col}_{fn}")
    return result


class _AggregationPlan:
    """Partial (map side) and final (reduce side) aggregation of ``aggs`` by ``keys``."""

    def __init__(self, keys: list[str], aggs: list[tuple[str, str, str]]) -> None:
        self.keys = keys
        self.aggs = aggs  # (alias, column or "*", function)
        self.combine = all(fn in _COMBINABLE for _, _, fn in aggs)
        self.inputs = list(dict.fromkeys(c for _, c, _ in aggs if c != "*"))

    def _partials(self, col: str, fn: str) -> list[tuple[str | None, str]]:
        if col == "*":
            return [(None, "count_all")]
        if fn in ("mean", "avg"):
            return [(col, "sum"), (col, "count")]
        return [(col, fn)]

    def map_side(self, table: pa.Table) -> pa.Table:
        """Project to the columns needed; with combinable functions, pre-aggregate."""
        table = table.select(self.keys + [c for c in self.inputs if c not in self.keys])
        if not self.combine:
            return table
        specs = [s for _, col, fn in self.aggs for s in self._partials(col, fn)]
        cols = _group_aggregate(table, self.keys, specs)
        names = self.keys + [self._partial_name(s) for s in dict.fromkeys(specs)]
        return pa.table([cols[k] for k in self.keys] + [cols[s] for s in dict.fromkeys(specs)],
                        names=names)

    @staticmethod
    def _partial_name(spec: tuple[str | None, str]) -> str:
        return f"__p_{spec[1]}_{spec[0] or ''}"

    def reduce_side(self, table: pa.Table) -> pa.Table:
        columns = [None] * len(self.aggs)
        if self.combine:
            # Final aggregation over partials: sums and counts add up, min/max of min/max.
            final_of = {"sum": "sum", "count": "sum", "count_all": "sum", "min": "min",
                        "max": "max"}
            specs = []
            for _, col, fn in self.aggs:
                specs += [(self._partial_name(p), final_of[p[1]]) for p in self._partials(col, fn)]
            got = _group_aggregate(table, self.keys, specs)
            for i, (_, col, fn) in enumerate(self.aggs):
                parts = [got[(self._partial_name(p), final_of[p[1]])]
                         for p in self._partials(col, fn)]
                columns[i] = _mean(*parts) if fn in ("mean", "avg") else parts[0]
        else:
            specs = [(None, "count_all") if col == "*" else
                     (col, "mean" if fn == "avg" else fn) for _, col, fn in self.aggs]
            got = _group_aggregate(table, self.keys, specs)
            columns = [got[s] for s in specs]
        names = self.keys + [alias for alias, _, _ in self.aggs]
        return pa.table([got[k] for k in self.keys] + columns, names=names)


def _mean(total: pa.ChunkedArray, count: pa.ChunkedArray) -> pa.ChunkedArray:
    zero = pc.equal(count, 0)
    value = pc.divide(pc.cast(total, pa.float64()), pc.cast(count, pa.float64()))
    return pc.if_else(zero, pa.scalar(None, pa.float64()), value)


def aggregate(df: Any, by: str | Sequence[str], aggs: Mapping[str, tuple[str, str]],
              num_partitions: int | None = None, config: ShuffleConfig | None = None,
              direct_scan: bool = True) -> Any:
    """``df.groupBy(*by).agg(...)`` with the exchange done by hybrid_ray.

    ``aggs`` maps each output column to ``(input column, function)``; functions are
    sum, count, min, max, mean (avg) and count_distinct, and ``("*", "count")`` counts rows.
    Result columns: the keys, then the aggregates in the given order. Sums and counts are
    pre-aggregated per map chunk (like Spark's partial aggregation) unless count_distinct
    is asked for.
    """
    _check_dataframe(df)
    keys = [by] if isinstance(by, str) else list(by)
    if not keys:
        raise ConfigError("aggregate needs at least one key column; for a global aggregate "
                          "use df.agg(...)")
    keys = _check_columns(df, keys, "aggregate keys")
    if not isinstance(aggs, Mapping) or not aggs:
        raise ConfigError("aggs must be a non-empty dict {output: (column, function)}")
    plan_aggs = []
    for alias, spec in aggs.items():
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ConfigError(f"aggs[{alias!r}] must be (column, function), got {spec!r}")
        col, fn = spec
        if fn not in AGG_FUNCTIONS:
            raise ConfigError(f"aggs[{alias!r}]: unknown function {fn!r}; use one of "
                              f"{list(AGG_FUNCTIONS)}")
        if col == "*":
            if fn != "count":
                raise ConfigError(f"aggs[{alias!r}]: '*' works only with count")
        else:
            _check_columns(df, [col], f"aggs[{alias!r}]")
        if alias in keys:
            raise ConfigError(f"aggs output {alias!r} collides with a key column")
        plan_aggs.append((alias, col, fn))
    n = _default_partitions(df, num_partitions)
    config = exchange.check_config(config)
    plan = _AggregationPlan(keys, plan_aggs)
    input_schema = _arrow_schema(df)
    shuffled_schema = plan.map_side(input_schema.empty_table()).schema
    out_schema = _spark_schema(plan.reduce_side(shuffled_schema.empty_table()).schema)
    shuffle = exchange.run_map_stage(df, n, HashPartitioner(keys), config, "aggregate",
                                     transform=plan.map_side, shuffled_schema=shuffled_schema,
                                     direct_scan=direct_scan)

    def reduce(inputs: list[list[pa.Table]], _sub: int) -> Iterator[pa.Table]:
        yield plan.reduce_side(concat_or_empty(inputs[0], shuffled_schema))
    return exchange.reduce_frame(df.sparkSession, [shuffle], reduce, out_schema)


# ---- join --------------------------------------------------------------------------------------------------
JOIN_TYPES = {
    "inner": "inner",
    "left": "left outer", "leftouter": "left outer", "left_outer": "left outer",
    "right": "right outer", "rightouter": "right outer", "right_outer": "right outer",
    "outer": "full outer", "full": "full outer", "fullouter": "full outer",
    "full_outer": "full outer",
    "semi": "left semi", "leftsemi": "left semi", "left_semi": "left semi",
    "anti": "left anti", "leftanti": "left anti", "left_anti": "left anti",
}


def join(left: Any, right: Any, on: str | Sequence[str], how: str = "inner",
         num_partitions: int | None = None, config: ShuffleConfig | None = None,
         direct_scan: bool = True) -> Any:
    """``left.join(right, on, how)`` (an equi-join on same-named columns) with both sides
    exchanged through hybrid_ray and each partition pair joined in the executors.

    Columns come out as Spark orders them: the join keys, then the left side's other
    columns, then the right side's (semi and anti joins: the left side's columns).
    """
    _check_dataframe(left)
    _check_dataframe(right)
    keys = [on] if isinstance(on, str) else list(on)
    if not keys:
        raise ConfigError("join needs at least one key column in `on`")
    keys = _check_columns(left, keys, "join keys (left side)")
    _check_columns(right, keys, "join keys (right side)")
    if not isinstance(how, str) or how.lower() not in JOIN_TYPES:
        raise ConfigError(f"unknown join type {how!r}; use one of {sorted(JOIN_TYPES)}")
    join_type = JOIN_TYPES[how.lower()]
    for key in keys:
        lt, rt = left.schema[key].dataType, right.schema[key].dataType
        if lt != rt:
            raise ConfigError(f"join key {key!r} is {lt.simpleString()} on the left and "
                              f"{rt.simpleString()} on the right; cast one side first")
    clash = (set(left.columns) & set(right.columns)) - set(keys)
    if clash and join_type not in ("left semi", "left anti"):
        raise ConfigError(f"columns {sorted(clash)} exist on both sides; rename them "
                          "(withColumnRenamed) before joining")
    n = _default_partitions(left, num_partitions)
    config = exchange.check_config(config)
    left_schema, right_schema = _arrow_schema(left), _arrow_schema(right)
    if join_type in ("left semi", "left anti"):
        out_names = left.columns
    else:
        out_names = keys + [c for c in left.columns if c not in keys] \
            + [c for c in right.columns if c not in keys]

    def join_tables(lt: pa.Table, rt: pa.Table) -> pa.Table:
        if join_type in ("left semi", "left anti"):
            rt = rt.select(keys)
        joined = lt.join(rt, keys=keys, join_type=join_type, coalesce_keys=True,
                         use_threads=False)
        return joined.select(out_names)

    out_schema = _spark_schema(join_tables(left_schema.empty_table(),
                                           right_schema.empty_table()).schema)
    partitioner = HashPartitioner(keys)
    shuffles = [exchange.run_map_stage(left, n, partitioner, config, "join_left",
                                       direct_scan=direct_scan)]
    try:
        shuffles.append(exchange.run_map_stage(right, n, partitioner, config, "join_right",
                                               direct_scan=direct_scan))
    except BaseException:
        exchange.release(shuffles[0].shuffle_id)
        raise

    def reduce(inputs: list[list[pa.Table]], _sub: int) -> Iterator[pa.Table]:
        yield join_tables(concat_or_empty(inputs[0], left_schema),
                          concat_or_empty(inputs[1], right_schema))
    return exchange.reduce_frame(left.sparkSession, shuffles, reduce, out_schema)


def _arrow_schema(df: Any) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema)


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)
