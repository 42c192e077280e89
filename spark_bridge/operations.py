"""DataFrame operations whose exchanges go through hybrid_ray.

- ``repartition``: hash partitioning by columns (rows with equal keys share a partition).
  On a plain scan of local parquet files, hybrid_ray's writers read the files themselves
  (``parquet_scan``) and the executors only read the shuffled rows back: measured faster
  than Spark's operator through the shuffle manager (``benchmarks/spark_ops.py``). Any
  other input is ``df.repartition(...)`` through the session's shuffle manager.
- ``sort``, ``aggregate``, ``join``: Spark's own operators (``repartitionByRange`` +
  ``sortWithinPartitions``, ``groupBy().agg()``, ``join``), whose exchanges hybrid_ray's
  shuffle manager carries. They used to be Arrow re-implementations through the bridge;
  Spark's operators through the manager were faster on every input measured (same
  benchmark) and keep Spark's semantics (NaN ordering, time zones, decimals) exactly.

The operations that run through the shuffle manager need a session started by
``init_spark(..., hybrid_shuffle=True)`` (the default); the manager uses the session's
``shuffle_config``. A ``config`` given to a call applies to the direct parquet path (None:
the session's); on the manager's path it must be the session's (or None), as one session
has one manager.

Call ``release(df)`` when a direct-path result is no longer needed (``stop_spark`` releases
all); the manager's shuffles are released by Spark (its ContextCleaner, or ``stop_spark``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from hybrid_ray.config import ShuffleConfig
from hybrid_ray.errors import ConfigError
from hybrid_ray.partitioning import HashPartitioner
from hybrid_ray.report import forgets_last_report
from hybrid_ray.shuffle import check_config, check_num_partitions
from spark_bridge import exchange, parquet_scan

_LOG = logging.getLogger(__name__)

# Every public operation is its thread's most recent as it starts: until an exchange of it
# runs, ``last_report()`` is None.
_most_recent_call = forgets_last_report(exchange.forget_last)


# ---- validation -----------------------------------------------------------------------------------
def _check_dataframe(df: Any) -> None:
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        raise TypeError(f"expected a pyspark.sql.DataFrame, got {type(df).__name__}")


def _check_partitions(num_partitions: Any) -> int | None:
    """``num_partitions`` checked, as a plain int (None stays None): a NumPy integer passed
    on as given was refused by PySpark ("should be a Column or str, got int64")."""
    return None if num_partitions is None else check_num_partitions(num_partitions)


def _case_sensitive(df: Any) -> bool:
    """Whether ``df``'s session tells column names apart by case (spark.sql.caseSensitive)."""
    return str(df.sparkSession.conf.get("spark.sql.caseSensitive", "false")
               ).strip().lower() == "true"


def _names(value: Any, what: str) -> list[Any]:
    """``value`` (one column name, or a sequence of them) as a list. Anything else failed
    with a bare TypeError naming no fix (None: "'NoneType' object is not iterable", a
    Column: "Column is not iterable"), and bytes were taken as their byte values."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return list(value)
    raise ConfigError(f"{what} must be a column name or a list of column names, got "
                      f"{value!r}")


def _check_columns(df: Any, cols: Sequence[Any], what: str) -> list[str]:
    """The DataFrame's names of columns ``cols``: as Spark resolves them, ignoring case
    unless ``spark.sql.caseSensitive`` is on (``repartition(df, 4, "id")`` of a column
    "ID" was refused, which Spark's own operator takes)."""
    case_sensitive = _case_sensitive(df)
    names, missing = [], []
    for col in cols:
        if not isinstance(col, str):
            raise ConfigError(f"{what}: columns must be given by name (str), got {col!r}")
        matches = [c for c in df.columns
                   if c == col or (not case_sensitive and c.lower() == col.lower())]
        if len(matches) == 1:
            names.append(matches[0])
        elif matches:  # Spark refuses it too (AMBIGUOUS_REFERENCE), after the plan is made
            raise ConfigError(f"{what}: column {col!r} is ambiguous: the DataFrame has "
                              f"{matches}; rename them apart or set spark.sql.caseSensitive")
        else:
            missing.append(col)
    if missing:
        raise ConfigError(f"{what}: unknown column(s) {missing}; the DataFrame has columns "
                          f"{df.columns}")
    return names


def _column(name: str) -> Any:
    """The column named exactly ``name``: quoted, as Spark parses a bare "a.b" as field b of
    a struct column a (a column literally named "a.b" was refused as unresolved, or, beside
    a struct a with a field b, the wrong column was used)."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def _through_manager(df: Any, config: Any, what: str) -> None:
    """Check that ``df``'s session sends its exchanges through hybrid_ray's shuffle
    manager, with ``config`` (if given) being the manager's; else a ConfigError with the fix."""
    from spark_bridge.hybrid_shuffle import MANAGER_CLASS
    from spark_bridge.session import session_shuffle_config

    manager = df.sparkSession.conf.get("spark.shuffle.manager", "sort")
    session_config = session_shuffle_config()
    if manager == MANAGER_CLASS and session_config is None:
        # The manager is on, but its session is not init_spark's, running: a stopped
        # session's DataFrame still reads it (told to turn the manager on, it had it).
        raise ConfigError(
            f"spark_bridge.{what}: this DataFrame's session has hybrid_ray's shuffle "
            "manager, but no Spark session started by spark_bridge.init_spark is running "
            "(stopped with stop_spark, or started without init_spark): start one with "
            "spark_bridge.init_spark and build the DataFrame from it")
    if manager != MANAGER_CLASS:
        raise ConfigError(
            f"spark_bridge.{what} runs Spark's operator with hybrid_ray's shuffle manager, but "
            f"this session uses spark.shuffle.manager={manager}: start it with "
            "spark_bridge.init_spark(..., hybrid_shuffle=True) (the default)")
    exchange.forget_last()
    if config is not None and check_config(config) != session_config:
        raise ConfigError(
            f"spark_bridge.{what}: config= applies only where hybrid_ray's writers read a "
            "plain parquet scan themselves; this DataFrame's exchanges go through the "
            "session's shuffle manager, which uses the shuffle_config given to "
            "spark_bridge.init_spark. Pass that config (or none), or start the session with "
            "the one you want")


def release(df: Any) -> int:
    """Delete the hybrid_ray data behind a DataFrame returned by ``repartition``'s direct
    parquet path (it cannot be computed again afterwards). Returns how many shuffles were
    released (0 for results of the shuffle manager's path: Spark releases those).
    Anything but a DataFrame is refused: a shuffle id (``release("spk-...")``, meaning
    ``release_all``'s kind) returned 0, as if nothing were held, and its data stayed."""
    _check_dataframe(df)
    return sum(exchange.release(s) for s in getattr(df, "_hybrid_ray_shuffles", []))


# ---- repartition ------------------------------------------------------------------------------------
@_most_recent_call
def repartition(df: Any, num_partitions: int, *cols: str,
                config: ShuffleConfig | None = None, direct_scan: bool = True) -> Any:
    """``df.repartition(num_partitions, *cols)`` with the exchange done by hybrid_ray.

    Returns a DataFrame with ``df``'s schema and exactly its rows, in ``num_partitions``
    partitions; rows with equal values of ``cols`` are in the same partition.

    If ``df`` is a plain scan of local parquet files (and ``direct_scan``), hybrid_ray's
    writers read the files instead of Spark's executors handing the rows over, with
    ``config`` (same rows, less CPU; see ``spark_bridge.parquet_scan``), and this returns
    once they have; its report is ``spark_bridge.last_report()``. Write the result to a
    new path, not over its own input: a map whose writer dies before the result is
    consumed runs again from its input file, and fails with ``InputChangedError`` if that
    file was removed or written over (Spark, which refuses such an overwrite for its own
    plans, cannot see this input behind the result). Otherwise this is ``df.repartition`` through the
    session's shuffle manager (its report in ``spark_shuffle_reports()``).
    """
    _check_dataframe(df)
    num_partitions = check_num_partitions(num_partitions)
    if not cols:
        raise ConfigError("repartition needs at least one column to partition by")
    if not isinstance(direct_scan, bool):  # "no", 0.0, a column name: taken as truthy
        raise ConfigError(f"direct_scan must be True or False, got {direct_scan!r}")
    keys = _check_columns(df, cols, "repartition")
    if config is None:
        # The session's config (its namespace, spill dirs, remote tier), not the defaults:
        # with those the direct path started a second set of actors, with their own
        # memory budget, in the default namespace and spilled to /tmp.
        # (The config init_spark was given also with hybrid_shuffle=False: this path is
        # then its only use, and the defaults were taken instead.)
        from spark_bridge.session import given_shuffle_config

        config = given_shuffle_config()
    checked = check_config(config)
    if direct_scan:
        scan, why_not = parquet_scan.plan_scan(df, checked.map_chunk_bytes)
        if scan is None:
            _LOG.info("spark_bridge.repartition: Spark's executors read the input (%s)",
                      why_not)
        else:
            shuffle = exchange.run_map_stage(df, num_partitions, HashPartitioner(keys),
                                             checked, "repartition", scan=scan)
            # Returned only once the writers have read every file (raising if they
            # failed): Spark does not refuse an overwrite of a path the result is read
            # from, and ``out.write.mode("overwrite").parquet(path)`` deleted the files
            # under maps still reading them: every input row was lost (found by a
            # review). Spark's own plan holds no such reader running behind its back.
            shuffle.report  # noqa: B018 - waits for the map stage

            def passthrough(inputs: list[list[pa.Table]], _sub: int) -> Iterator[pa.Table]:
                for table in inputs[0]:
                    yield table
            return exchange.reduce_frame(df.sparkSession, [shuffle], passthrough, df.schema)
    _through_manager(df, config, "repartition")
    return df.repartition(num_partitions, *[_column(k) for k in keys])


# ---- sort -----------------------------------------------------------------------------------------------
@_most_recent_call
def sort(df: Any, *cols: str, ascending: bool | Sequence[bool] = True,
         num_partitions: int | None = None, config: ShuffleConfig | None = None) -> Any:
    """``df.orderBy(*cols, ascending=...)`` through hybrid_ray's shuffle manager.

    Partitions of the result, in order, hold the globally sorted rows (collect() returns
    them sorted); nulls first when ascending, last when descending, as in Spark. With
    ``num_partitions`` the result has at most that many partitions (Spark's
    ``repartitionByRange`` then ``sortWithinPartitions``: fewer where the sort keys have
    fewer distinct values than that), else Spark picks them.
    """

    _check_dataframe(df)
    if not cols:
        raise ConfigError("sort needs at least one column to sort by")
    keys = _check_columns(df, cols, "sort")
    # A bool or 0/1 for every column, or one per column, as PySpark's orderBy takes them
    # (ascending=0 failed with a raw TypeError: 'int' object is not iterable).
    # NumPy's bools and ints count as bools and ints (np.bool_ is no int: a flag read from
    # an array was refused).
    given = ascending
    if isinstance(ascending, (int, np.bool_, np.integer)):
        ascending = [ascending] * len(keys)
    if not isinstance(ascending, (list, tuple)) or len(ascending) != len(keys) or not all(
            isinstance(a, (int, np.bool_, np.integer)) and a in (0, 1) for a in ascending):
        raise ConfigError(f"ascending must be a bool or one bool per sort column "
                          f"({len(keys)}), got {given!r}")
    ascending = [bool(a) for a in ascending]
    num_partitions = _check_partitions(num_partitions)
    _through_manager(df, config, "sort")
    order = [_column(k).asc() if a else _column(k).desc() for k, a in zip(keys, ascending)]
    if num_partitions is None:
        return df.orderBy(*order)
    return df.repartitionByRange(num_partitions, *order).sortWithinPartitions(*order)


# ---- aggregate ---------------------------------------------------------------------------------------
AGG_FUNCTIONS = ("sum", "count", "min", "max", "mean", "avg", "count_distinct")


def _agg_column(col: str, fn: str) -> Any:
    from pyspark.sql import functions as F

    if col == "*":
        return F.count(F.lit(1))
    return {"sum": F.sum, "count": F.count, "min": F.min, "max": F.max, "mean": F.avg,
            "avg": F.avg, "count_distinct": F.count_distinct}[fn](_column(col))


@_most_recent_call
def aggregate(df: Any, by: str | Sequence[str], aggs: Mapping[str, tuple[str, str]],
              num_partitions: int | None = None, config: ShuffleConfig | None = None) -> Any:
    """``df.groupBy(*by).agg(...)`` through hybrid_ray's shuffle manager.

    ``aggs`` maps each output column to ``(input column, function)``; functions are
    sum, count, min, max, mean (avg) and count_distinct, and ``("*", "count")`` counts rows.
    Result columns: the keys, then the aggregates in the given order. Spark aggregates
    partially before its exchange. ``num_partitions``, if given, first repartitions ``df``
    by the keys into that many partitions (Spark then aggregates after that exchange only).
    """
    _check_dataframe(df)
    keys = _names(by, "aggregate's by")
    if not keys:
        raise ConfigError("aggregate needs at least one key column; for a global aggregate "
                          "use df.agg(...)")
    keys = _check_columns(df, keys, "aggregate keys")
    # A key named twice made a result with two columns of that name, which no later
    # reference could tell apart (AMBIGUOUS_REFERENCE).
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"aggregate keys name column(s) {twice} more than once; give each "
                          "key once")
    if not isinstance(aggs, Mapping) or not aggs:
        raise ConfigError("aggs must be a non-empty dict {output: (column, function)}")
    # Output names as Spark resolves them: "Country" beside a key "country" gave a result
    # whose columns no later reference could tell apart (AMBIGUOUS_REFERENCE).
    fold = (lambda name: name) if _case_sensitive(df) else (lambda name: name.lower())
    taken = {fold(k): k for k in keys}
    columns = []
    for alias, spec in aggs.items():
        if not isinstance(alias, str) or not alias:
            raise ConfigError(f"aggs outputs must be column names (str), got {alias!r}")
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
        if fold(alias) in taken:
            raise ConfigError(f"aggs output {alias!r} collides with "
                              f"{'key column' if taken[fold(alias)] in keys else 'output'} "
                              f"{taken[fold(alias)]!r} (Spark resolves names ignoring case "
                              "unless spark.sql.caseSensitive is on); rename it")
        taken[fold(alias)] = alias
        columns.append(_agg_column(col, fn).alias(alias))
    num_partitions = _check_partitions(num_partitions)
    _through_manager(df, config, "aggregate")
    by = [_column(k) for k in keys]
    if num_partitions is not None:
        df = df.repartition(num_partitions, *by)
    return df.groupBy(*by).agg(*columns)


# ---- join --------------------------------------------------------------------------------------------------
# The join types Spark's DataFrame.join accepts (case-insensitive), checked up front so a
# typo gets the list rather than a Py4J trace.
JOIN_TYPES = (
    "inner", "cross", "outer", "full", "fullouter", "full_outer", "left", "leftouter",
    "left_outer", "right", "rightouter", "right_outer", "semi", "leftsemi", "left_semi",
    "anti", "leftanti", "left_anti",
)


@_most_recent_call
def join(left: Any, right: Any, on: str | Sequence[str], how: str = "inner",
         num_partitions: int | None = None, config: ShuffleConfig | None = None) -> Any:
    """``left.join(right, on, how)`` (an equi-join on same-named columns) through
    hybrid_ray's shuffle manager; Spark's columns, order and semantics.

    ``num_partitions``, if given, hash-partitions both sides by the keys into that many
    partitions first (the join then needs no other exchange).
    """
    _check_dataframe(left)
    _check_dataframe(right)
    keys = _names(on, "join's on")
    if not keys:
        raise ConfigError("join needs at least one key column in `on`")
    keys = _check_columns(left, keys, "join keys (left side)")
    _check_columns(right, keys, "join keys (right side)")
    if not isinstance(how, str) or how.lower() not in JOIN_TYPES:
        raise ConfigError(f"unknown join type {how!r}; use one of {list(JOIN_TYPES)}")
    num_partitions = _check_partitions(num_partitions)
    _through_manager(left, config, "join")
    if num_partitions is not None:
        left = left.repartition(num_partitions, *[_column(k) for k in keys])
        right = right.repartition(num_partitions, *[_column(k) for k in keys])
    return left.join(right, keys, how.lower())
