"""A multi-query SQL workload on PySpark (RayDP): hybrid_ray's shuffle manager against
Spark's own shuffle, in one run, plus the capped-disk contrast.

    python -m benchmarks.spark_sql                      # scale 0.1, 2 rounds
    python -m benchmarks.spark_sql --scale 0.3 --rounds 3 --capped-disk-mib 48

Data: a TPC-H-like generator (``generate``: the eight TPC-H tables' shapes and key
relations at ``--scale``, values drawn with numpy from ``--seed``), written once as parquet.
Queries: nine TPC-H-like queries (``QUERIES``: pricing summary, shipping priority, local
supplier volume, returned items, ship modes, customer distribution, large-volume customers,
a window, a distinct count) with broadcast joins off, so every join shuffles both sides.

Each mode runs in a Python process of its own with its own local Ray, so neither inherits
the other's warm JVM: the first round of each query is its first call (JIT, executors'
first tasks), later rounds are warm. The two processes stay up side by side and take turns
query by query (which mode goes first alternates), so both modes' runs of a query meet the
same moment of a shared, noisy machine; the mode not running is stopped (SIGSTOP of its
whole process tree: no JIT, GC or heartbeats of its own meanwhile). Warm times are the
median of the warm rounds. A first call is one sample: single first calls of one query
moved by 30% between runs here, so ``--sessions N`` repeats the whole run with fresh
sessions and takes the median of each query's N first calls.
Both modes must return the same rows for every query (a row-multiset fingerprint), or the
run fails. The capped-disk case puts Spark's local dir
and hybrid_ray's spill dir on one small tmpfs (root only): a wide repartition fails there
with Spark's own shuffle and finishes through hybrid_ray with its remote tier (an S3 API
over HTTP: ``--remote`` or a moto server started here).

Results go to ``benchmarks/results/spark-sql/`` (markdown and JSON) and to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "spark-sql")
SPARK_CONFIGS = {
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.autoBroadcastJoinThreshold": "-1",   # every join shuffles both sides
    "spark.sql.adaptive.enabled": "true",
}
MODES = ("spark", "hybrid_ray")
# Each mode's local Ray gets this much object store (two run side by side).
OBJECT_STORE_BYTES = 3 << 30
EPOCH_1992 = 8035  # days from 1970-01-01 to 1992-01-01


# ---- data ---------------------------------------------------------------------------------
def generate(out_dir: str, scale: float, seed: int) -> dict[str, str]:
    """Write the TPC-H-like tables at ``scale`` (1.0 = 6M lineitems) as parquet files;
    returns table name -> path."""
    rng = np.random.default_rng(seed)
    n_cust, n_supp = max(150, int(150_000 * scale)), max(10, int(10_000 * scale))
    n_part, n_orders = max(200, int(200_000 * scale)), max(1500, int(1_500_000 * scale))
    words = np.array(["furious", "sly", "careful", "blithe", "quick", "fluffy", "slow",
                      "quiet", "ruthless", "thin", "close", "dogged", "daring", "brave"])

    def comments(n: int) -> pa.Array:
        picks = rng.integers(0, len(words), size=(n, 4))
        return pa.array([" ".join(row) for row in words[picks]])

    tables: dict[str, pa.Table] = {
        "nation": pa.table({"n_nationkey": np.arange(25, dtype=np.int32),
                            "n_name": [f"NATION{i:02d}" for i in range(25)],
                            "n_regionkey": (np.arange(25) % 5).astype(np.int32)}),
        "customer": pa.table({
            "c_custkey": np.arange(1, n_cust + 1, dtype=np.int64),
            "c_name": [f"Customer#{i:09d}" for i in range(1, n_cust + 1)],
            "c_nationkey": rng.integers(0, 25, n_cust, dtype=np.int32),
            "c_acctbal": np.round(rng.uniform(-999.99, 9999.99, n_cust), 2),
            "c_mktsegment": np.array(["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD",
                                      "MACHINERY"])[rng.integers(0, 5, n_cust)]}),
        "supplier": pa.table({
            "s_suppkey": np.arange(1, n_supp + 1, dtype=np.int64),
            "s_nationkey": rng.integers(0, 25, n_supp, dtype=np.int32),
            "s_acctbal": np.round(rng.uniform(-999.99, 9999.99, n_supp), 2)}),
        "part": pa.table({
            "p_partkey": np.arange(1, n_part + 1, dtype=np.int64),
            "p_brand": [f"Brand#{a}{b}" for a, b in rng.integers(1, 6, (n_part, 2))],
            "p_size": rng.integers(1, 51, n_part, dtype=np.int32),
            "p_retailprice": np.round(rng.uniform(900, 2000, n_part), 2)}),
    }
    orderdate = EPOCH_1992 + rng.integers(0, 2400, n_orders)
    tables["orders"] = pa.table({
        "o_orderkey": np.arange(1, n_orders + 1, dtype=np.int64),
        "o_custkey": rng.integers(1, n_cust + 1, n_orders),
        "o_orderstatus": np.array(["F", "O", "P"])[rng.integers(0, 3, n_orders)],
        "o_totalprice": np.round(rng.uniform(800, 500_000, n_orders), 2),
        "o_orderdate": pa.array(orderdate.astype(np.int32), pa.date32()),
        "o_orderpriority": np.array(["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED",
                                     "5-LOW"])[rng.integers(0, 5, n_orders)],
        "o_shippriority": np.zeros(n_orders, dtype=np.int32)})
    lines_per_order = rng.integers(1, 8, n_orders)
    n_lines = int(lines_per_order.sum())
    l_orderkey = np.repeat(np.arange(1, n_orders + 1, dtype=np.int64), lines_per_order)
    shipdate = np.repeat(orderdate, lines_per_order) + rng.integers(1, 122, n_lines)
    tables["lineitem"] = pa.table({
        "l_orderkey": l_orderkey,
        "l_partkey": rng.integers(1, n_part + 1, n_lines),
        "l_suppkey": rng.integers(1, n_supp + 1, n_lines),
        "l_linenumber": np.concatenate([np.arange(1, k + 1) for k in lines_per_order])
                          .astype(np.int32),
        "l_quantity": rng.integers(1, 51, n_lines).astype(np.float64),
        "l_extendedprice": np.round(rng.uniform(900, 100_000, n_lines), 2),
        "l_discount": np.round(rng.integers(0, 11, n_lines) / 100, 2),
        "l_tax": np.round(rng.integers(0, 9, n_lines) / 100, 2),
        "l_returnflag": np.array(["A", "N", "R"])[rng.integers(0, 3, n_lines)],
        "l_linestatus": np.array(["F", "O"])[rng.integers(0, 2, n_lines)],
        "l_shipdate": pa.array(shipdate.astype(np.int32), pa.date32()),
        "l_receiptdate": pa.array((shipdate + rng.integers(1, 31, n_lines)).astype(np.int32),
                                  pa.date32()),
        "l_shipmode": np.array(["AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"])[
            rng.integers(0, 7, n_lines)],
        "l_comment": comments(n_lines)})
    paths = {}
    for name, table in tables.items():
        paths[name] = os.path.join(out_dir, f"{name}.parquet")
        pq.write_table(table, paths[name], row_group_size=256 * 1024)
    return paths


QUERIES: dict[str, str] = {
    "q1_pricing_summary": """
        select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty,
               sum(l_extendedprice) as sum_base, sum(l_extendedprice * (1 - l_discount)) as disc,
               avg(l_discount) as avg_disc, count(*) as n
        from lineitem where l_shipdate <= date '1998-09-02'
        group by l_returnflag, l_linestatus""",
    "q3_shipping_priority": """
        select l_orderkey, o_orderdate, o_shippriority,
               sum(l_extendedprice * (1 - l_discount)) as revenue
        from customer join orders on c_custkey = o_custkey
             join lineitem on l_orderkey = o_orderkey
        where c_mktsegment = 'BUILDING' and o_orderdate < date '1995-03-15'
              and l_shipdate > date '1995-03-15'
        group by l_orderkey, o_orderdate, o_shippriority
        order by revenue desc, l_orderkey limit 20""",
    "q5_local_supplier": """
        select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
        from customer join orders on c_custkey = o_custkey
             join lineitem on l_orderkey = o_orderkey
             join supplier on l_suppkey = s_suppkey and c_nationkey = s_nationkey
             join nation on s_nationkey = n_nationkey
        where o_orderdate >= date '1994-01-01' and o_orderdate < date '1995-01-01'
        group by n_name""",
    "q10_returned_items": """
        select c_custkey, c_name, n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
        from customer join orders on c_custkey = o_custkey
             join lineitem on l_orderkey = o_orderkey
             join nation on c_nationkey = n_nationkey
        where l_returnflag = 'R' and o_orderdate >= date '1993-10-01'
              and o_orderdate < date '1994-01-01'
        group by c_custkey, c_name, n_name order by revenue desc, c_custkey limit 20""",
    "q12_ship_modes": """
        select l_shipmode,
               sum(case when o_orderpriority in ('1-URGENT', '2-HIGH') then 1 else 0 end) as high,
               sum(case when o_orderpriority not in ('1-URGENT', '2-HIGH') then 1 else 0 end)
                   as low
        from orders join lineitem on o_orderkey = l_orderkey
        where l_receiptdate >= date '1994-01-01' and l_receiptdate < date '1995-01-01'
        group by l_shipmode""",
    "q13_customer_distribution": """
        select c_count, count(*) as custdist from (
            select c_custkey, count(o_orderkey) as c_count
            from customer left join orders on c_custkey = o_custkey
            group by c_custkey) group by c_count""",
    "q18_large_volume": """
        select c_name, c_custkey, o_orderkey, o_totalprice, sum(l_quantity) as qty
        from customer join orders on c_custkey = o_custkey
             join lineitem on o_orderkey = l_orderkey
        where o_orderkey in (select l_orderkey from lineitem group by l_orderkey
                             having sum(l_quantity) > 250)
        group by c_name, c_custkey, o_orderkey, o_totalprice""",
    "window_top_orders": """
        select o_custkey, o_orderkey, o_totalprice from (
            select o_custkey, o_orderkey, o_totalprice,
                   row_number() over (partition by o_custkey
                                      order by o_totalprice desc, o_orderkey) as r
            from orders) where r <= 2""",
    "distinct_parts_per_supplier": """
        select l_suppkey, count(distinct l_partkey) as parts
        from lineitem join part on l_partkey = p_partkey where p_size < 25
        group by l_suppkey""",
}


def _canonical(value: Any) -> Any:
    """Floats to 10 significant digits: a sum of doubles depends on the order its terms
    arrive in, which no shuffle fixes (Spark's own differs between runs in the last bits)."""
    return float(f"{value:.10g}") if isinstance(value, float) else value


def fingerprint(rows: list[Any]) -> str:
    """Digest of a result's row multiset (order-free: rows are sorted by their repr),
    floats compared to 10 significant digits."""
    h = hashlib.sha256()
    for text in sorted(repr(tuple(_canonical(v) for v in r)) for r in rows):
        h.update(text.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


# ---- one mode, in its own process ---------------------------------------------------------
def start_mode(mode: str, paths: dict[str, str], extra: dict[str, str],
               shuffle_config: Any = None) -> tuple[Any, float]:
    """A local Ray and Spark (``mode``: "hybrid_ray" or "spark") with the tables as views;
    returns the session and its start-up seconds."""
    import ray

    import spark_bridge

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             object_store_memory=OBJECT_STORE_BYTES)
    started = time.perf_counter()
    spark = spark_bridge.init_spark(f"sql-bench-{mode}", num_executors=2, executor_cores=1,
                                    executor_memory="2GB", configs={**SPARK_CONFIGS, **extra},
                                    shuffle_config=shuffle_config,
                                    hybrid_shuffle=(mode == "hybrid_ray"))
    spark.sparkContext.setLogLevel("ERROR")
    startup = time.perf_counter() - started
    for name, path in paths.items():
        spark.read.parquet(path).createOrReplaceTempView(name)
    return spark, startup


def run_query(spark: Any, sql: str, entry: dict[str, Any]) -> bool:
    """Run ``sql`` once, adding its seconds, row count and fingerprint to ``entry`` (or
    its error); returns whether it ran."""
    t = time.perf_counter()
    try:
        rows = spark.sql(sql).collect()
    except Exception as exc:  # noqa: BLE001 - recorded, compared, reported
        text = str(exc)
        entry["error"] = text.strip().splitlines()[0][:300] + (
            " (No space left on device)" if "No space left on device" in text else "")
        return False
    entry.setdefault("seconds", []).append(time.perf_counter() - t)
    entry["rows"], entry["fingerprint"] = len(rows), fingerprint(rows)
    entry.setdefault("fingerprints", []).append(entry["fingerprint"])  # every round's
    if len(rows) <= 30:  # small results kept whole, to diff a mismatch
        entry["result"] = sorted(repr(tuple(_canonical(v) for v in r)) for r in rows)
    return True


def stop_mode(mode: str, out: dict[str, Any]) -> None:
    """Stop Spark; hybrid_ray's bytes per tier and any stop error go into ``out``."""
    import spark_bridge

    try:
        spark_bridge.stop_spark()
    except Exception as exc:  # noqa: BLE001 - the measurements stand; say what failed
        out["stop_error"] = str(exc).strip().splitlines()[0][:300]
    if mode == "hybrid_ray":
        out["tier_bytes"] = _tier_bytes(spark_bridge.spark_shuffle_reports())


def run_mode(mode: str, paths: dict[str, str], rounds: int, extra: dict[str, str],
             shuffle_config: Any = None, queries: dict[str, str] | None = None) -> dict:
    """Start Spark (``mode``), run every query ``rounds`` times in a row; per query:
    seconds per round, row count and fingerprint (or the error)."""
    spark, startup = start_mode(mode, paths, extra, shuffle_config)
    out: dict[str, Any] = {"mode": mode, "startup_s": startup, "queries": {}}
    try:
        for name, sql in (queries or QUERIES).items():
            entry: dict[str, Any] = {"seconds": []}
            for _ in range(rounds):
                if not run_query(spark, sql, entry):
                    break
            out["queries"][name] = entry
    finally:
        stop_mode(mode, out)
    return out


def serve_mode(mode: str, paths: dict[str, str], answers: Any) -> None:
    """A mode's process for the interleaved run: start Spark, then run the query named by
    each line on stdin, answering one JSON line each on ``answers``; "stop" ends it."""
    def answer(value: dict[str, Any]) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    spark, startup = start_mode(mode, paths, {})
    answer({"startup_s": startup})
    out: dict[str, Any] = {}
    for line in sys.stdin:
        name = line.strip()
        if name == "stop":
            break
        entry: dict[str, Any] = {}
        run_query(spark, QUERIES[name], entry)
        answer(entry)
    stop_mode(mode, out)
    answer(out)


def _tier_bytes(reports: list[Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for report in reports:
        for tier, nbytes in report.bytes_per_tier().items():
            totals[tier] = totals.get(tier, 0) + nbytes
    return totals


CAPPED_QUERY = {"capped_wide_repartition": """
    select l_shipmode, count(*) as n, max(wide) as m from (
        select l_shipmode, concat(l_comment, sha2(cast(l_orderkey * 10 + l_linenumber
               as string), 512)) as wide
        from lineitem distribute by l_orderkey) group by l_shipmode"""}


def run_capped(mode: str, paths: dict[str, str], disk: str, remote: str,
               storage_options: dict[str, Any]) -> dict:
    from hybrid_ray import MiB, ShuffleConfig

    local_dir = os.path.join(disk, f"local-{mode}")
    os.makedirs(local_dir, exist_ok=True)
    config = ShuffleConfig(spill_dirs=[os.path.join(disk, "spill")],
                           memory_capacity_bytes=16 * MiB, remote_path=remote,
                           storage_options=storage_options, progress=False)
    return run_mode(mode, {"lineitem": paths["lineitem"]}, 1,
                    {"spark.local.dir": local_dir, "spark.task.maxFailures": "2"},
                    shuffle_config=config, queries=CAPPED_QUERY)


def _child(args: argparse.Namespace) -> int:
    paths = json.loads(args.paths)
    if args.serve:
        with os.fdopen(args.answer_fd, "w") as answers:
            serve_mode(args.child, paths, answers)
        return 0
    if args.capped_disk:
        result = run_capped(args.child, paths, args.capped_disk, args.remote,
                            json.loads(args.storage_options or "{}"))
    else:
        result = run_mode(args.child, paths, args.rounds, {})
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


class _ServedMode:
    """The parent's handle on a ``serve_mode`` process: one query at a time, each answer
    waited for at most ``timeout`` seconds."""

    def __init__(self, mode: str, paths: dict[str, str], timeout: float) -> None:
        self.mode, self.timeout = mode, timeout
        read_fd, write_fd = os.pipe()
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.spark_sql", "--child", mode, "--serve",
             "--answer-fd", str(write_fd), "--paths", json.dumps(paths)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            pass_fds=(write_fd,))
        os.close(write_fd)
        self.answers = os.fdopen(read_fd)

    def _answer(self) -> dict[str, Any]:
        import select

        ready, _, _ = select.select([self.answers], [], [], self.timeout)
        line = self.answers.readline() if ready else ""
        if not line:
            self.kill()
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace").strip()[-1500:]
            raise RuntimeError(f"{self.mode}: no answer within {self.timeout:.0f} s "
                               f"(exit code {self.proc.poll()}): {tail}")
        return json.loads(line)

    def started(self) -> dict[str, Any]:
        return self._answer()

    def _signal_tree(self, signum: int) -> None:
        from benchmarks.cpu_by_process import process_tree

        for pid in process_tree(self.proc.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # ended meanwhile
                pass

    def kill(self) -> None:
        """Kill the mode's whole process tree (its local Ray and JVMs too: killed alone,
        the driver's children would be re-parented out of reach), paused or not."""
        import signal

        self._signal_tree(signal.SIGCONT)
        self._signal_tree(signal.SIGKILL)

    def pause(self) -> None:
        """Stop the mode's whole process tree (its driver, local Ray and Spark JVMs), so
        it uses no CPU (JIT, GC, heartbeats) while the other mode runs. A pause lasts one
        query of the other mode: far below Spark's executor heartbeat timeout
        (``spark.network.timeout``, 120 s), which a longer one could trip on resume."""
        self._signal_tree(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_tree(signal.SIGCONT)

    def run(self, name: str) -> dict[str, Any]:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> dict[str, Any]:
        self.resume()
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
            return self._answer()
        finally:
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()
            self.answers.close()
            self.log.close()


def run_interleaved(paths: dict[str, str], rounds: int, timeout: float) -> dict[str, dict]:
    """Both modes side by side, taking turns query by query (the first to go alternates;
    the other one paused); results per mode as ``run_mode`` gives them."""
    served: dict[str, _ServedMode] = {}
    results: dict[str, dict] = {}
    try:
        for mode in MODES:  # one at a time: start-ups are not measured against each other
            served[mode] = _ServedMode(mode, paths, timeout)
            results[mode] = {"mode": mode, "queries": {},
                             "startup_s": served[mode].started()["startup_s"]}
            served[mode].pause()
        for r in range(rounds):
            print(f"round {r + 1} of {rounds} ...", flush=True)
            for i, name in enumerate(QUERIES):
                order = MODES if (r + i) % 2 == 0 else MODES[::-1]
                for mode in order:
                    entry = results[mode]["queries"].setdefault(name, {"seconds": []})
                    if "error" in entry:
                        continue
                    served[mode].resume()
                    try:
                        answer = served[mode].run(name)
                    finally:
                        served[mode].pause()
                    seconds = answer.pop("seconds", [])
                    entry["seconds"] += seconds
                    entry.setdefault("fingerprints", []).extend(answer.pop("fingerprints", []))
                    entry.update(answer)
    finally:
        for mode, handle in served.items():
            entry = results.setdefault(mode, {"mode": mode, "queries": {}})
            try:
                entry.update(handle.stop())
            except (OSError, RuntimeError, ValueError) as exc:
                entry["stop_error"] = str(exc)[:300]
    return results


def run_sessions(paths: dict[str, str], rounds: int, timeout: float,
                 sessions: int) -> dict[str, dict]:
    """``run_interleaved`` ``sessions`` times, each pair of modes started fresh; per mode
    and query, ``runs`` holds each session's seconds (its first is that session's first
    call), ``seconds`` all of them in order; ``startup_s`` is the median start-up. Any
    session's error or fingerprints stay with the query."""
    merged: dict[str, dict] = {}
    for k in range(sessions):
        if sessions > 1:
            print(f"session {k + 1} of {sessions} ...", flush=True)
        one = run_interleaved(paths, rounds, timeout)
        for mode, result in one.items():
            into = merged.setdefault(mode, {"mode": mode, "queries": {}, "startups": []})
            if "startup_s" in result:
                into["startups"].append(result["startup_s"])
            for key, value in result.items():
                if key not in ("mode", "queries", "startup_s"):
                    into[key] = value  # the last session's tier bytes, stop errors
            for name, entry in result["queries"].items():
                q = into["queries"].setdefault(name, {"seconds": [], "runs": [],
                                                      "fingerprints": []})
                if entry.get("seconds"):
                    q["runs"].append(list(entry["seconds"]))
                q["seconds"] += entry.get("seconds", [])
                q["fingerprints"] += entry.get("fingerprints", [])
                q.update({k2: v for k2, v in entry.items()
                          if k2 not in ("seconds", "fingerprints")})
    for result in merged.values():
        result["startup_s"] = (statistics.median(result["startups"])
                               if result["startups"] else 0.0)
    return merged


def _spawn(mode: str, args: argparse.Namespace, paths: dict[str, str], **capped: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-m", "benchmarks.spark_sql", "--child", mode,
           "--paths", json.dumps(paths), "--rounds", str(args.rounds), "--result", result_path]
    for key, value in capped.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    from benchmarks.procs import run_own_group

    try:
        # In a session of its own: a timeout kills the child's whole process group (its
        # local Ray and JVMs too), and is this mode's failure, not the run's end.
        try:
            proc = run_own_group(cmd, args.timeout)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "queries": {},
                    "error": f"the {mode} child took over {args.timeout:.0f} s (killed "
                             "with its process group)"}
        try:
            with open(result_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"mode": mode, "error": (proc.stderr or proc.stdout).strip()[-1500:],
                    "queries": {}}
    finally:
        os.unlink(result_path)


# ---- report ---------------------------------------------------------------------------------
def summarize(own: dict, ours: dict) -> dict[str, Any]:
    """Per query: first-call and warm seconds (the median of the warm rounds) of both
    modes, speed-up (Spark's time / hybrid_ray's), and whether the rows agree; totals; the
    issue's goals. A query that failed in either mode (``failed``: query -> which mode and
    why) is left out of the totals and the worst speed-up, so it makes both speed goals
    not met (they had read "met" while hybrid_ray failed a query)."""
    rows, mismatches, failed = [], [], {}
    totals = {"spark_first": 0.0, "ours_first": 0.0, "spark_warm": 0.0, "ours_warm": 0.0}
    for name in QUERIES:
        a, b = own["queries"].get(name, {}), ours["queries"].get(name, {})
        if "error" in a or "error" in b or not a.get("seconds") or not b.get("seconds"):
            mismatches.append(name)
            failed[name] = "; ".join(
                f"{mode}: {(q.get('error') or 'no result')[:200]}"
                for mode, q in (("spark", a), ("hybrid_ray", b))
                if "error" in q or not q.get("seconds"))
            rows.append({"query": name, "error": a.get("error") or b.get("error") or "missing"})
            continue
        # Every round of both modes must give the same rows: a wrong result in any round
        # counts (the last round's fingerprint alone hid the others).
        prints = set(a.get("fingerprints") or [a["fingerprint"]]) | \
            set(b.get("fingerprints") or [b["fingerprint"]])
        same = len(prints) == 1
        if not same:
            mismatches.append(name)
        # Per session (``runs``; one session: ``seconds``), the first round is the first
        # call: the median of the sessions' first calls, and of all their warm rounds.
        runs_a, runs_b = a.get("runs") or [a["seconds"]], b.get("runs") or [b["seconds"]]
        first_a = statistics.median(r[0] for r in runs_a)
        first_b = statistics.median(r[0] for r in runs_b)
        warm_runs_a = [x for r in runs_a for x in r[1:]]
        warm_runs_b = [x for r in runs_b for x in r[1:]]
        # With one round there is no warm round: warm is not measured (it read the first).
        warm_a = statistics.median(warm_runs_a) if warm_runs_a else None
        warm_b = statistics.median(warm_runs_b) if warm_runs_b else None
        for key, value in (("spark_first", first_a), ("ours_first", first_b),
                           ("spark_warm", warm_a), ("ours_warm", warm_b)):
            totals[key] += value or 0.0
        rows.append({"query": name, "rows": b["rows"], "same_rows": same,
                     "spark_first_s": first_a, "ours_first_s": first_b,
                     "spark_warm_s": warm_a, "ours_warm_s": warm_b,
                     "speedup_first": first_a / first_b,
                     "speedup_warm": warm_a / warm_b if warm_a and warm_b else None})
    ok_rows = [r for r in rows if "error" not in r]
    warm_measured = bool(ok_rows) and all(r["speedup_warm"] is not None for r in ok_rows)
    if not warm_measured:  # no warm round (--rounds 1): no warm total either (it read 0.00)
        totals["spark_warm"] = totals["ours_warm"] = None
    worst = min((min(x for x in (r["speedup_first"], r["speedup_warm"]) if x is not None)
                 for r in ok_rows), default=0.0)
    # A goal with nothing behind it is not measured (None), never met: with every query
    # failed both totals were 0 and "at least as fast" read met. A failed query with
    # others measured is a goal not met: the totals and the worst leave it out.
    some_failed = bool(failed) and bool(ok_rows)
    return {
        "queries": rows, "totals": totals, "mismatches": mismatches, "failed": failed,
        "speedup_total_first": totals["spark_first"] / max(totals["ours_first"], 1e-9),
        "speedup_total_warm": totals["spark_warm"] / max(totals["ours_warm"], 1e-9)
        if warm_measured else None,
        "worst_query_speedup": worst,
        "goals": {"total at least as fast as Spark's own shuffle (warm)":
                  False if some_failed else
                  totals["ours_warm"] <= totals["spark_warm"] if warm_measured else None,
                  "no query slower than 0.8x (first calls and warm)":
                  False if some_failed else worst >= 0.8 if ok_rows else None,
                  "same rows for every query": not mismatches},
    }


def markdown(summary: dict, meta: dict, capped: dict | None) -> str:
    lines = ["# Spark SQL workload: hybrid_ray's shuffle manager vs Spark's own shuffle",
             "", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: "
             f"{meta['cpus']} cores; scale {meta['scale']} ({meta['lineitems']:,} lineitems); "
             f"{meta['rounds']} rounds per query (the first call, then the median of the warm "
             "rounds)"
             + (f" in each of {meta['sessions']} fresh sessions per mode (first call: the "
                "median of the sessions' first calls)" if meta.get("sessions", 1) > 1 else "")
             + "; both modes side by side, taking turns query by query.", "",
             "| query | rows | same rows | Spark first s | hybrid_ray first s | speed-up first "
             "| Spark warm s | hybrid_ray warm s | speed-up warm |",
             "|---|---:|:-:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["queries"]:
        if "error" in r:
            lines.append(f"| {r['query']} | error: {r['error']} |||||||| ")
            continue
        lines.append(f"| {r['query']} | {r['rows']} | {'yes' if r['same_rows'] else 'NO'} "
                     f"| {r['spark_first_s']:.2f} | {r['ours_first_s']:.2f} "
                     f"| {r['speedup_first']:.2f}x | {_num(r['spark_warm_s'], 's')} "
                     f"| {_num(r['ours_warm_s'], 's')} | {_num(r['speedup_warm'], 'x')} |")
    t = summary["totals"]
    lines += [f"| **total** | | | {t['spark_first']:.2f} | {t['ours_first']:.2f} "
              f"| {summary['speedup_total_first']:.2f}x | {_num(t['spark_warm'], 's')} "
              f"| {_num(t['ours_warm'], 's')} | {_num(summary['speedup_total_warm'], 'x')} |",
              "",
              f"Spark start-up: own shuffle {meta['startup_spark_s']:.1f} s, hybrid_ray "
              f"{meta['startup_ours_s']:.1f} s. hybrid_ray's bytes per tier: "
              f"{meta.get('tier_bytes')}.", "", "Goals:"]
    failed = summary.get("failed") or {}
    because = ("; failed queries, left out of the totals: "
               + ", ".join(f"{q} ({why})" for q, why in failed.items())) if failed else ""
    lines += [f"- {goal}: {({True: 'met', False: 'NOT met'}).get(met, 'not measured')}"
              + (because if met is False and goal != "same rows for every query" else "")
              for goal, met in summary["goals"].items()]
    if capped is not None:
        lines += ["", f"Capped disk ({capped['mib']} MiB tmpfs for Spark's local dir and the "
                  "disk tier; remote tier on an S3 API over HTTP):",
                  f"- Spark's own shuffle: {capped['spark']}",
                  f"- hybrid_ray: {capped['ours']}"]
    return "\n".join(lines) + "\n"


def _num(value: float | None, unit: str) -> str:
    """A table cell: ``value`` to two decimals with its unit ("s", "x"), "-" for none."""
    return "-" if value is None else f"{value:.2f}{'x' if unit == 'x' else ''}"


def _capped_outcome(result: dict) -> str:
    entry = result.get("queries", {}).get("capped_wide_repartition", {})
    if "error" in entry or "error" in result:
        return f"failed: {entry.get('error') or result.get('error', '')[:300]}"
    return (f"finished in {entry['seconds'][0]:.1f} s, {entry['rows']} rows "
            f"(fingerprint {entry['fingerprint']}); bytes per tier {result.get('tier_bytes')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spark_sql", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=0.1, help="1.0 = 6M lineitems (default 0.1)")
    p.add_argument("--rounds", type=int, default=2, help="runs per query (first + warm)")
    p.add_argument("--sessions", type=int, default=1,
                   help="fresh Spark sessions per mode, one after another: a query's first "
                        "call is the median of its first calls in them (one first call is "
                        "one sample on a noisy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capped-disk-mib", type=int, default=0,
                   help="also run the capped-disk contrast on a tmpfs of this size (root)")
    p.add_argument("--remote", default=None, help="remote tier URL for the capped run "
                   "(default: a moto S3 server started here)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds a mode may take to start, or to run one query")
    p.add_argument("--out", default=RESULTS_DIR)
    # Internal: one mode in a child process.
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--capped-disk", default="", help=argparse.SUPPRESS)
    p.add_argument("--storage-options", default="", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--answer-fd", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    if args.scale <= 0 or args.rounds < 1 or args.sessions < 1:
        p.error("--scale must be > 0, --rounds >= 1 and --sessions >= 1")
    if args.timeout <= 0 or args.capped_disk_mib < 0:
        # Found only after the data was made and a mode had started: a timeout of 0 gave
        # up on the mode at once, a negative one ended in select()'s ValueError, and a
        # negative tmpfs size in a failed mount.
        p.error(f"--timeout must be > 0 and --capped-disk-mib >= 0 (0: no capped run), "
                f"got {args.timeout:g} and {args.capped_disk_mib}")
    from benchmarks.suite import out_dir_problem

    problem = out_dir_problem(args.out)
    if problem:  # found before the run: afterwards it cost the whole run's results
        p.error(f"--out: {problem}")
    with tempfile.TemporaryDirectory(prefix="hr-sql-bench-") as data_dir:
        print(f"generating TPC-H-like data at scale {args.scale} ...", flush=True)
        paths = generate(data_dir, args.scale, args.seed)
        lineitems = pq.ParquetFile(paths["lineitem"]).metadata.num_rows
        print(f"running {len(QUERIES)} queries x {args.rounds}, Spark's shuffle and "
              "hybrid_ray's taking turns ...", flush=True)
        # A TERM (a timeout's kill) unwinds through run_interleaved's cleanup, which
        # resumes and stops the paused modes instead of leaving them stopped for good.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            results = run_sessions(paths, args.rounds, args.timeout, args.sessions)
        except RuntimeError as exc:
            print(f"failed: {exc}", file=sys.stderr)
            return 1
        capped = _run_capped_contrast(args, paths) if args.capped_disk_mib else None
    summary = summarize(results["spark"], results["hybrid_ray"])
    meta = {"command": "python -m benchmarks.spark_sql " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "scale": args.scale, "lineitems": lineitems, "rounds": args.rounds,
            "sessions": args.sessions,
            "startup_spark_s": results["spark"]["startup_s"],
            "startup_ours_s": results["hybrid_ray"]["startup_s"],
            "tier_bytes": results["hybrid_ray"].get("tier_bytes")}
    text = markdown(summary, meta, capped)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "capped": capped, "raw": results}, f,
                  indent=1)
    print(text)
    return 0 if not summary["mismatches"] else 1


def _run_capped_contrast(args: argparse.Namespace, paths: dict[str, str]) -> dict:
    disk = tempfile.mkdtemp(prefix="hr-sql-capped-")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.capped_disk_mib}m",
                            "tmpfs", disk], capture_output=True, text=True)
    if mount.returncode != 0:
        os.rmdir(disk)
        return {"mib": args.capped_disk_mib, "spark": "not run (cannot mount a tmpfs: "
                f"{mount.stderr.strip()})", "ours": "not run"}
    server = None
    try:
        remote, options = args.remote, {}
        if remote is None:
            import socket

            import s3fs
            from moto.server import ThreadedMotoServer

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench",
                       "secret": "bench"}
            s3fs.S3FileSystem(**options).mkdir("hr-bench")
            remote = "s3://hr-bench/shuffle"
        out = {"mib": args.capped_disk_mib}
        for mode, key in (("spark", "spark"), ("hybrid_ray", "ours")):
            print(f"capped disk: {mode} ...", flush=True)
            out[key] = _capped_outcome(_spawn(mode, args, paths, capped_disk=disk,
                                              remote=remote,
                                              storage_options=json.dumps(options)))
        return out
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", "-l", disk], check=False)
        os.rmdir(disk)


if __name__ == "__main__":
    sys.exit(main())
