"""The benchmark suite: deterministic data, a checksum that catches lost or duplicated rows,
goal arithmetic, and a real (small) run of the command that writes every output."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pytest

from benchmarks.suite import CaseResult, best_round, goals, markdown, parse_size
from benchmarks.workloads import WORKLOADS, checksum, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_workloads_are_deterministic_and_sized(workload):
    a, b = generate(workload, 3_000_000, seed=7), generate(workload, 3_000_000, seed=7)
    assert checksum(a) == checksum(b)
    assert checksum(a) != checksum(generate(workload, 3_000_000, seed=8))
    assert 2_500_000 < sum(t.nbytes for t in a) < 3_600_000


def test_checksum_ignores_order_and_representation_but_not_rows():
    table = pa.concat_tables(generate("gensort", 2_000_000))
    reordered = table.take(pa.array(range(table.num_rows - 1, -1, -1)))
    as_binary = reordered.cast(pa.schema([("key", pa.binary()), ("payload", pa.binary())]))
    assert checksum([table]) == checksum(as_binary.to_batches(max_chunksize=777))
    assert checksum([table.slice(1)]) != checksum([table])          # a lost row
    assert checksum([table, table.slice(0, 1)]) != checksum([table])  # a duplicated row
    swapped = pa.table({"key": table["key"], "payload": table["payload"].take(
        pa.array([1, 0] + list(range(2, table.num_rows))))})
    assert checksum([swapped]) != checksum([table])                 # rows mixed up


def test_parse_size_and_its_errors():
    assert parse_size("2GiB") == 2 * 1024**3 and parse_size("256MB") == 256_000_000
    assert parse_size("0.25GiB") == 1024**3 // 4
    assert parse_size(".5GiB") == 1024**3 // 2 and parse_size("2.MB") == 2_000_000
    for bad in ("lots", "0MB", "-1GiB", "1..2GiB", ".", "1.2.3MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_goals_use_the_main_size_and_report_missing_sides():
    def case(name, family, mb_s, size=2 * 1024**3, verified=True):
        return CaseResult(name, family, "gensort", size, seconds=1.0, mb_s=mb_s,
                          verified=verified)
    results = [case("raydata_shuffle_v2", "ray_data", 50), case("raydata_hash", "ray_data", 80),
               case("hybrid_memory_disk", "hybrid_ray", 160),
               case("hybrid_memory_disk", "scaling", 999, size=1024**3 // 4),
               case("hybrid_disk_capped", "hybrid_ray", 70)]
    by_goal = {g["goal"].split(" (")[0]: g for g in goals(results)}
    assert by_goal["hybrid_memory_disk vs Ray Data default"]["ratio"] == pytest.approx(3.2)
    assert by_goal["hybrid_memory_disk vs Ray Data default"]["met"] is False  # 6x goal
    assert by_goal["hybrid_memory_disk vs fastest Ray Data"]["ratio"] == pytest.approx(2.0)
    assert by_goal["hybrid_disk_capped vs uncapped hybrid_memory_disk"]["met"] is False
    spark = next(g for g in goals(results) if "Spark's own shuffle" in g["goal"])
    assert spark["met"] is None and spark["target"] is None  # different inputs: not judged
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    assert "| hybrid_memory_disk vs Ray Data default (SHUFFLE_V2) | 6.00x | 3.20x | no |" in text


def test_best_round_keeps_the_fastest_verified_round_and_never_hides_a_failure():
    def case(mb_s, verified=True):
        return CaseResult("c", "hybrid_ray", "gensort", 10, 1, mb_s=mb_s, verified=verified,
                          error=None if verified else "checksum mismatch")

    best = best_round([case(50.0), case(80.0)])
    assert best.mb_s == 80.0 and "best of 2 rounds (50.0 / 80.0 MB/s)" in best.note
    mixed = best_round([case(90.0), case(None, verified=False)])
    assert not mixed.verified and mixed.error == "checksum mismatch"
    assert "(90.0 / failed MB/s)" in mixed.note
    single = best_round([case(70.0)])
    assert single.mb_s == 70.0 and single.note == ""


@pytest.mark.slow
def test_bench_command_runs_verifies_and_writes_outputs(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--size", "16MB", "--partitions", "4",
         "--scenario", "hybrid_memory_disk", "--scenario", "raydata_hash",
         "--scenario", "raydata_sort_pull", "--scenario", "hybrid_disk_capped",
         # A remote tier that cannot be written: that case must fail, recorded, not fatal.
         "--remote", "file:///proc/hybrid_ray_unwritable", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    by_case = {r["case"]: r for r in data["results"]}
    assert by_case["hybrid_memory_disk"]["verified"] and by_case["raydata_hash"]["verified"]
    assert by_case["hybrid_memory_disk"]["tier_bytes"]["disk"] > 0  # memory budget = data/2
    assert "best of 2 rounds" in by_case["hybrid_memory_disk"]["note"]  # --rounds default
    assert by_case["raydata_sort_pull"]["verified"]  # as a sort by key
    assert not by_case["hybrid_disk_capped"]["verified"]
    assert "RemoteTierError" in by_case["hybrid_disk_capped"]["error"]
    assert (out / "results.png").stat().st_size > 1000
    assert "hybrid_memory_disk vs Ray Data default" in (out / "results.md").read_text()
    assert data["meta"]["command"].startswith("python -m benchmarks --size 16MB --partitions 4")


def test_bench_rejects_unknown_scenarios():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--scenario", "warp_speed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown scenario(s) ['warp_speed']" in proc.stderr


# ---- machine limits and the shuffle floor -------------------------------------------------------
def test_machine_measurements_report_their_bytes_and_seconds(tmp_path):
    from benchmarks import machine

    disk = machine.disk_write(str(tmp_path), nbytes=2 << 20, chunk=1 << 20)
    assert disk.nbytes == 2 << 20 and disk.seconds > 0 and "fdatasync" in disk.note
    assert len(disk.rounds) == 2  # a first and a warm repeat, as every case has
    assert list(tmp_path.iterdir()) == []  # its file is gone
    fresh = machine.memcpy_fresh(1 << 20, repeats=2)
    assert fresh.seconds > 0 and len(fresh.rounds) == 2 and fresh.mb_s == max(fresh.rounds)


def test_shuffle_floor_adds_the_steps_cpu_seconds_and_divides_over_cores():
    from benchmarks.machine import GiB, MB, shuffle_floor

    gib_mb = GiB / MB
    rates = {"hash": 1000.0, "take": 500.0, "put": 1000.0, "concat": 1000.0,
             "memcpy_fresh": 2000.0, "memcpy_warm": 4000.0, "disk": 100.0}
    memory = shuffle_floor(rates, cores=2)
    cpu = gib_mb * (1 / 1000 + 1 / 500 + 1 / 1000 + 1 / 1000)
    assert memory["cpu_s_per_gib"] == pytest.approx(cpu)
    assert memory["wall_s_per_gib"] == pytest.approx(cpu / 2)
    assert memory["mb_s"] == pytest.approx(gib_mb / (cpu / 2))
    assert memory["device_s_per_gib"] == 0
    # Half on disk: half the puts become a page-cache write and read.
    half = shuffle_floor(rates, cores=2, disk_fraction=0.5)
    assert half["cpu_s_per_gib"] == pytest.approx(
        cpu - 0.5 * gib_mb / 1000 + 0.5 * gib_mb * (1 / 2000 + 1 / 4000))
    # Durable: the disk's write of the spilled half bounds the wall time when it is slower.
    durable = shuffle_floor(rates, cores=2, disk_fraction=0.5, durable=True)
    assert durable["device_s_per_gib"] == pytest.approx(0.5 * gib_mb / 100)
    assert durable["wall_s_per_gib"] == pytest.approx(0.5 * gib_mb / 100)
    assert shuffle_floor({**rates, "disk": 1e9}, 2, 0.5, True)["wall_s_per_gib"] == \
        pytest.approx(half["wall_s_per_gib"])
    # All on disk needs no put rate; a missing rate or bad argument is an error.
    assert shuffle_floor({k: v for k, v in rates.items() if k != "put"}, 1, 1.0)["mb_s"] > 0
    with pytest.raises(KeyError, match="put"):
        shuffle_floor({k: v for k, v in rates.items() if k != "put"}, 2)
    with pytest.raises(ValueError):
        shuffle_floor(rates, cores=0)
    with pytest.raises(ValueError):
        shuffle_floor(rates, cores=2, disk_fraction=1.5)


def _machine_rows():
    def row(case, mb_s):
        return CaseResult(case, "machine", "-", 10**9, seconds=10**3 / mb_s, mb_s=mb_s,
                          verified=True)
    return [row("machine_hash_key", 1000.0), row("machine_take", 500.0),
            row("machine_reducer_concat", 1000.0), row("machine_ray_put_4mib", 800.0),
            row("machine_ray_put_16mib", 1000.0), row("machine_memcpy_fresh", 2000.0),
            row("machine_memcpy_warm", 4000.0), row("machine_disk_write", 100.0)]


def test_floor_rows_use_the_machine_rows_and_report_hybrid_as_a_fraction():
    from benchmarks.machine import shuffle_floor
    from benchmarks.suite import floors, machine_rates

    rates = machine_rates(_machine_rows())
    assert rates["put"] == 1000.0 and rates["disk"] == 100.0  # the fastest put size
    floor = shuffle_floor(rates, 2)["mb_s"]
    hybrid = CaseResult("hybrid_memory", "hybrid_ray", "gensort", 2**31, seconds=1.0,
                        mb_s=floor / 4, verified=True)
    results = _machine_rows() + [hybrid]
    rows = {f["floor"]: f for f in floors(results, 2)}
    assert rows["memory tier"]["fraction"] == pytest.approx(0.25)
    assert rows["half on disk (page cache)"]["fraction"] is None  # no hybrid_memory_disk
    by_goal = {g["goal"].split(" (")[0]: g for g in goals(results, 2)}
    goal = by_goal["hybrid_memory as a fraction of the memory tier floor"]
    assert goal["ratio"] == pytest.approx(0.25) and goal["met"] is False  # goal: half
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    assert "## Shuffle floor" in text and "| 0.50x | 0.25x | no |" in text
    assert floors(results[:3], 2) == []  # without every rate: no floor, no error


def test_goals_judge_daft_the_first_call_and_simulated_nodes_against_their_targets():
    def case(name, family, mb_s, nodes=1, first=None, warm=None):
        return CaseResult(name, family, "gensort", 2**31, nodes, seconds=1.0, mb_s=mb_s,
                          verified=True, first_mb_s=first, warm_mb_s=warm)
    results = [case("hybrid_memory_disk", "hybrid_ray", 600, first=420, warm=600),
               case("daft_map_reduce", "daft", 500), case("daft_flight_shuffle", "daft", 300),
               case("polars_partition_by", "reference", 2400),
               case("hybrid_nodes_1", "hybrid_ray", 500),
               case("hybrid_nodes_2", "hybrid_ray", 450, nodes=2),
               case("hybrid_nodes_4", "hybrid_ray", 390, nodes=4)]
    by_goal = {g["goal"].split(" (")[0]: g for g in goals(results)}
    daft = by_goal["hybrid_memory_disk vs fastest Daft"]
    assert daft["ratio"] == pytest.approx(1.2) and daft["target"] == 1.5 and not daft["met"]
    ref = by_goal["hybrid_memory_disk vs the in-process reference"]
    assert ref["ratio"] == pytest.approx(0.25) and ref["met"] is None
    first = by_goal["hybrid_memory_disk first call vs warm"]
    assert first["ratio"] == pytest.approx(0.7) and first["met"] is True  # 1.43x in time
    nodes = by_goal["simulated nodes 1/2/4: slowest vs fastest"]
    assert nodes["ratio"] == pytest.approx(0.78) and nodes["met"] is False


def test_the_nodes_bound_adds_the_data_moved_between_nodes_at_the_machine_s_cpu_cost():
    from benchmarks.suite import nodes_transfer_bound

    def case(name, mb_s, nodes=1, size=2**31):
        return CaseResult(name, "hybrid_ray", "gensort", size, nodes, seconds=size / 1e6 / mb_s,
                          mb_s=mb_s, verified=True)
    cross = CaseResult("machine_ray_cross_node", "machine", "-", 2**29, seconds=1.0,
                       mb_s=500.0, verified=True)
    results = [cross, case("hybrid_nodes_1", 600), case("hybrid_nodes_2", 300, 2),
               case("hybrid_nodes_4", 150, 4)]
    bound = {b["nodes"]: b for b in nodes_transfer_bound(results, cores=2)}
    mb, one_s = 2**31 / 1e6, 2**31 / 1e6 / 600
    assert bound[1]["bound_mb_s"] == pytest.approx(600) and bound[1]["fraction"] == 1.0
    # N nodes move (N-1)/N of the data between them, at 500 MB per CPU-s, on 2 cores.
    assert bound[2]["bound_mb_s"] == pytest.approx(mb / (one_s + 0.5 * mb / 500 / 2))
    assert bound[4]["bound_mb_s"] == pytest.approx(mb / (one_s + 0.75 * mb / 500 / 2))
    assert bound[4]["fraction"] == pytest.approx(150 / bound[4]["bound_mb_s"])
    judged, unjudged = [g for g in goals(results, 2) if g["goal"].startswith("simulated")]
    assert judged["goal"] == "simulated nodes 1/2/4: slowest vs fastest (within 20%)"
    assert judged["target"] == 0.8 and judged["met"] is False
    assert judged["ratio"] == pytest.approx(150 / 600)
    assert "if moving data between nodes were the only extra cost" in unjudged["goal"]
    assert unjudged["target"] is None and unjudged["met"] is None
    assert unjudged["ratio"] == pytest.approx(bound[4]["bound_mb_s"] / 600)
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    assert "## Simulated nodes and the cost of moving data between them" in text
    assert f"| hybrid_nodes_4 | 150.0 | {bound[4]['bound_mb_s']:.1f} | " \
           f"{bound[4]['fraction']:.2f} |" in text
    # A 4-node run of another size is not compared with the one-node case.
    other_size = case("hybrid_nodes_4", 900, 4, size=2**30)
    assert nodes_transfer_bound(results + [other_size], 2) == list(bound.values())
    # Without the machine row (or the one-node case) there is no bound and no section.
    assert nodes_transfer_bound(results[1:], 2) == [] == nodes_transfer_bound(
        [cross] + results[2:], 2)
    assert "cost of moving data" not in markdown(results[1:], {
        "date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31, "partitions": 16,
        "command": "c"})


@pytest.mark.slow
def test_the_cross_node_row_measures_cpu_per_byte_moved_between_two_real_nodes():
    import ray

    from benchmarks import machine
    from conftest import multinode_cluster, stop_cluster

    cluster = multinode_cluster(2)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        limit = machine.ray_cross_node(nodes[0], nodes[1], total=16 << 20,
                                       object_bytes=4 << 20, repeats=2)
        assert limit.nbytes == 16 << 20 and len(limit.rounds) == 2
        # CPU-seconds of raylets and workers: more than nothing, less than minutes.
        assert 0 < limit.seconds < 60 and limit.mb_s == pytest.approx(max(limit.rounds))
        assert "4 x 4 MiB pulled between 2 Ray nodes" in limit.note
        assert "CPU-s per GiB" in limit.note and "wall" in limit.note
        with pytest.raises(ValueError, match="must differ"):
            machine.ray_cross_node(nodes[0], nodes[0])
    finally:
        stop_cluster(cluster)


def test_the_in_process_reference_partitions_every_row_once():
    from benchmarks.reference import polars_partition_by

    blocks = generate("gensort", 2_000_000, 3)
    rounds = polars_partition_by(blocks, 8, rounds=2)
    assert len(rounds.seconds) == 2 and all(s > 0 for s in rounds.seconds)
    assert rounds.verified and "polars" in rounds.note
    with pytest.raises(ValueError, match="num_partitions and rounds must be >= 1"):
        polars_partition_by(blocks, 0)


# ---- first call and warm rounds -----------------------------------------------------------------
def test_every_case_reports_its_first_call_and_best_warm_round():
    from benchmarks.suite import first_and_warm

    def case(mb_s, verified=True):
        return CaseResult("c", "hybrid_ray", "gensort", 10, 1, mb_s=mb_s, verified=verified)
    best = best_round([case(50.0), case(80.0), case(70.0)])
    assert (best.first_mb_s, best.warm_mb_s) == (50.0, 80.0)
    assert first_and_warm([case(50.0)]) == (50.0, None)
    assert first_and_warm([case(None, False), case(60.0)]) == (None, 60.0)
    text = markdown([best], {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 10,
                             "partitions": 16, "command": "c"})
    assert "| 80.0 | 0.00 | 50.0 | 80.0 | yes |" in text


# ---- Daft as a peer (no Daft installed: the subprocess's output and the venv are faked) --------
def _daft_result(**over):
    data = {"strategy": "flight_shuffle", "physical_shuffle": "FlightShuffle",
            "expected": [100, 12345], "error": None,
            "versions": {"daft": "0.7.26", "ray": "2.59.0", "pyarrow": "25.0.1"},
            "rounds": [{"seconds": 2.0, "rows": 100, "checksum": 12345, "partitions": 16},
                       {"seconds": 1.0, "rows": 100, "checksum": 12345, "partitions": 16}]}
    data.update(over)
    return data


def test_parse_daft_output_takes_the_last_result_line_among_other_output():
    from benchmarks import daft_child
    from benchmarks.daft_peer import RESULT_PREFIX, parse_daft_output

    assert daft_child.RESULT_PREFIX == RESULT_PREFIX  # the two sides agree
    stdout = "\n".join(["(raylet) some log", RESULT_PREFIX + json.dumps({"rounds": []}),
                        "Started a local Ray instance.",
                        RESULT_PREFIX + json.dumps(_daft_result()), ""])
    assert parse_daft_output(stdout) == _daft_result()
    with pytest.raises(ValueError, match="no result line.*Traceback"):
        parse_daft_output("hello\nTraceback (most recent call last):\n")
    with pytest.raises(ValueError, match="malformed"):
        parse_daft_output(RESULT_PREFIX + "{not json")
    with pytest.raises(ValueError, match="no rounds"):
        parse_daft_output(RESULT_PREFIX + json.dumps({"strategy": "x"}))


def test_daft_rounds_verify_rows_checksum_partitions_and_the_shuffle_that_ran():
    from benchmarks.daft_peer import rounds_from_result

    good = rounds_from_result(_daft_result(), (100, 12345), 16, 10**8)
    assert [r["verified"] for r in good] == [True, True]
    assert [r["mb_s"] for r in good] == [pytest.approx(50.0), pytest.approx(100.0)]
    bad_sum = _daft_result(rounds=[{"seconds": 1.0, "rows": 100, "checksum": 1,
                                    "partitions": 16}])
    assert "checksum mismatch" in rounds_from_result(bad_sum, (100, 12345), 16, 1)[0]["error"]
    bad_parts = _daft_result(rounds=[{"seconds": 1.0, "rows": 100, "checksum": 12345,
                                      "partitions": 15}])
    assert "15 output partitions" in rounds_from_result(bad_parts, (100, 12345), 16, 1)[0][
        "error"]
    # A partition handed back in pieces (Daft does at 2 GiB) is still the shuffle asked for.
    pieces = _daft_result(rounds=[{"seconds": 1.0, "rows": 100, "checksum": 12345,
                                   "partitions": 35}])
    assert rounds_from_result(pieces, (100, 12345), 16, 1)[0]["verified"]
    # The strategy asked for must be the one the plan ran.
    wrong = rounds_from_result(_daft_result(physical_shuffle="RayShuffle"), (100, 12345), 16, 1)
    assert not any(r["verified"] for r in wrong) and "ran RayShuffle" in wrong[0]["error"]
    other_input = rounds_from_result(_daft_result(expected=[100, 1]), (100, 12345), 16, 1)
    assert "different input" in other_input[0]["error"]
    # A failure after a round is a failed round, never dropped; no round at all fails too.
    crashed = rounds_from_result(_daft_result(error="ObjectStoreFullError: full"),
                                 (100, 12345), 16, 1)
    assert [r["verified"] for r in crashed] == [True, True, False]
    assert crashed[-1]["error"] == "Daft: ObjectStoreFullError: full"
    assert not rounds_from_result(_daft_result(rounds=[]), (100, 12345), 16, 1)[0]["verified"]


def test_daft_venv_that_cannot_be_made_says_why(tmp_path):
    from benchmarks.daft_peer import DaftUnavailable, ensure_daft_venv

    calls = []

    def no_network(cmd, **kwargs):
        calls.append(cmd)
        failed = "install" in cmd
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, "", (
            "WARNING: Retrying ...\nERROR: No matching distribution found for "
            "daft[ray]==0.7.26\n") if failed else "")

    venv = str(tmp_path / "venv-daft")
    with pytest.raises(DaftUnavailable, match=r"pip install daft\[ray\]==0.7.26 "
                       r"xxhash==4.1.0 \(exit 1\): ERROR: No matching distribution"):
        ensure_daft_venv(venv, run=no_network)
    assert len(calls) == 2 and not (tmp_path / "venv-daft" / ".hr-bench-ready").exists()
    # No python to make a venv with (the real subprocess.run).
    with pytest.raises(DaftUnavailable, match="cannot create the venv"):
        ensure_daft_venv(venv, base_python=str(tmp_path / "no-python"))


def test_a_ready_daft_venv_is_reused_and_one_for_another_spec_is_remade(tmp_path):
    from benchmarks.daft_peer import (
        CHILD_REQUIREMENTS, DAFT_SPEC, READY_MARKER, ensure_daft_venv,
    )

    ready = " ".join([DAFT_SPEC, *CHILD_REQUIREMENTS])
    venv = tmp_path / "venv-daft"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / READY_MARKER).write_text(ready + "\n")

    def must_not_run(cmd, **kwargs):
        raise AssertionError(f"ran {cmd}")
    assert ensure_daft_venv(str(venv), run=must_not_run) == str(venv / "bin" / "python")
    (venv / READY_MARKER).write_text("daft==0.1\n")
    ran = []

    def ok(cmd, **kwargs):
        ran.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            os.makedirs(cmd[3])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    assert ensure_daft_venv(str(venv), run=ok).endswith("bin/python") and len(ran) == 3
    assert ran[1][-2:] == [DAFT_SPEC, *CHILD_REQUIREMENTS]
    assert (venv / READY_MARKER).read_text().strip() == ready
    # A venv made for Daft alone (before the child needed xxhash) is made again.
    (venv / READY_MARKER).write_text(DAFT_SPEC + "\n")
    ran.clear()
    assert ensure_daft_venv(str(venv), run=ok).endswith("bin/python") and len(ran) == 3


def test_the_daft_venv_has_every_module_the_daft_child_imports():
    """The Daft child loads ``benchmarks.workloads`` and through it
    ``hybrid_ray.partitioning``; once that imported xxhash, which the Daft venv lacked,
    every Daft case failed with ModuleNotFoundError. Every third-party module they import
    must come with Daft or from ``CHILD_REQUIREMENTS``, pinned as pyproject.toml pins it."""
    import ast
    import tomllib

    from benchmarks.daft_peer import CHILD_REQUIREMENTS, ROOT

    with_daft = {"numpy", "pyarrow"}  # daft[ray] 0.7.26 depends on both
    extra = {r.split("==")[0] for r in CHILD_REQUIREMENTS}
    imported = set()
    for module in ("benchmarks/workloads.py", "hybrid_ray/partitioning.py",
                   "hybrid_ray/errors.py"):
        with open(os.path.join(ROOT, module)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:  # imports made on loading (lazy ones, e.g. pandas for
            # rare key types, the workloads never reach)
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names
                   and m not in ("hybrid_ray", "benchmarks")}
    assert third_party <= with_daft | extra, third_party - with_daft - extra
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pins = set(tomllib.load(f)["project"]["dependencies"])
    assert set(CHILD_REQUIREMENTS) <= pins


def test_daft_cases_without_a_venv_are_recorded_as_skipped(monkeypatch, tmp_path):
    from benchmarks import daft_peer
    from benchmarks.suite import Bench, add_arguments

    def unavailable(venv):
        raise daft_peer.DaftUnavailable("cannot pip install daft[ray]==0.7.26 (exit 1): "
                                        "no network")
    monkeypatch.setattr(daft_peer, "ensure_daft_venv", unavailable)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--size", "1MB", "--daft-venv", str(tmp_path / "v")])
    args.scaling, args.workload = [], ["gensort"]
    bench = Bench(args)
    try:
        results = bench.run(["daft_map_reduce", "daft_flight_shuffle"])
    finally:
        bench.close()
    assert [r.case for r in results] == ["daft_map_reduce", "daft_flight_shuffle"]
    assert all(r.skipped and not r.verified and "no network" in r.error for r in results)
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 10**6,
                              "partitions": 16, "command": "c"})
    assert "| skipped: cannot pip install daft[ray]==0.7.26 (exit 1): no network |" in text


def test_cpu_by_process_counts_cpu_between_snapshots(tmp_path):
    """The control-plane share is read off this: a process's CPU between two snapshots,
    new processes from zero, idle ones left out, most first; /proc parsed as Linux writes
    it (a command name with spaces and parentheses included)."""
    from benchmarks.cpu_by_process import _TICKS, cpu_between, cpu_snapshot

    def fake_proc(pid: int, ticks: tuple[int, int], cmd: bytes) -> None:
        d = tmp_path / str(pid)
        d.mkdir(exist_ok=True)
        rest = " ".join(["S"] + ["0"] * 10 + [str(ticks[0]), str(ticks[1])] + ["0"] * 5)
        (d / "stat").write_text(f"{pid} (ray::A b) c) {rest}\n")
        (d / "cmdline").write_bytes(cmd)

    fake_proc(10, (100, 50), b"ray::ShuffleWorkerActor\0")
    fake_proc(11, (7, 0), b"raylet\0--x\0")
    (tmp_path / "self").mkdir()  # not a pid: skipped
    before = cpu_snapshot(str(tmp_path))
    assert before[10] == ((150) / _TICKS, "ray::ShuffleWorkerActor")
    fake_proc(10, (130, 70), b"ray::ShuffleWorkerActor\0")
    fake_proc(12, (5, 5), b"new\0")
    rows = cpu_between(before, cpu_snapshot(str(tmp_path)))
    assert [(pid, cmd) for _, pid, cmd in rows] == [(10, "ray::ShuffleWorkerActor"),
                                                     (12, "new")]
    assert rows[0][0] == pytest.approx(50 / _TICKS) and rows[1][0] == pytest.approx(10 / _TICKS)


def test_cpu_by_process_reads_the_machines_idle_time_from_proc_stat(tmp_path):
    """Idle is what the cores really did not use (idle + iowait of /proc/stat's aggregate
    line), not the cores' time minus the session's processes: kernel threads (page-cache
    writeback of spilled files) used some of that."""
    from benchmarks.cpu_by_process import _TICKS, machine_cpu

    (tmp_path / "stat").write_text("cpu  100 5 40 300 20 1 2 3 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    total, idle = machine_cpu(str(tmp_path))
    assert total == pytest.approx(471 / _TICKS) and idle == pytest.approx(320 / _TICKS)


def test_cpu_by_process_counts_only_its_own_session_and_splits_it_by_role(tmp_path):
    """On a shared machine another job's processes must not count; the control-plane share
    is the master, tier managers and driver, the raylet is the object store, and idle is
    the cores' time nobody in the session used."""
    from benchmarks.cpu_by_process import cpu_shares, process_tree

    def fake_proc(pid: int, ppid: int) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (x (y)) S {ppid} " + "0 " * 20 + "\n")

    for pid, ppid in [(1, 0), (100, 1), (101, 100), (102, 101), (103, 101), (200, 1), (201, 200)]:
        fake_proc(pid, ppid)
    assert process_tree(100, str(tmp_path)) == {100, 101, 102, 103}
    rows = [(2.0, 102, "ray::ShuffleWorkerActor"), (0.5, 103, "ray::ShuffleMasterActor"),
            (0.25, 104, "ray::TierManagerActor"), (0.5, 101, "/x/raylet --y"),
            (0.25, 100, "python -m benchmarks.cpu_by_process"), (0.5, 105, "gcs_server")]
    shares = cpu_shares(rows, driver_pid=100, cpus=2, wall=2.5)
    assert shares == {"control plane": 1.0, "data plane": 2.0, "object store": 0.5,
                      "other": 0.5, "total": 4.0, "idle": 1.0}


def test_cpu_by_process_counts_the_driver_s_cpu_of_the_round_not_of_its_own_scans():
    """The /proc scans that measure a round run in the driver: its row is replaced by its
    CPU around the shuffle alone, so the measurement does not add to the control plane."""
    from benchmarks.cpu_by_process import cpu_shares, with_own_cpu

    rows = [(2.0, 102, "ray::ShuffleWorkerActor"), (0.3, 100, "python -m benchmarks.x"),
            (0.2, 103, "ray::ShuffleMasterActor")]
    fixed = with_own_cpu(rows, 100, 0.1)
    assert fixed == [(2.0, 102, "ray::ShuffleWorkerActor"), (0.2, 103, "ray::ShuffleMasterActor"),
                     (0.1, 100, "python -m benchmarks.x")]
    assert cpu_shares(fixed, 100, 2, 2.0)["control plane"] == pytest.approx(0.3)


def test_cpu_by_process_round_shares_are_the_goal_s_two_ratios(monkeypatch):
    """The control-plane share is of the session's CPU; idle is of the cores' time: the
    machine's (from /proc/stat) when the machine has exactly ``cpus`` cores, else the
    cores' time in the round that the session did not use."""
    from benchmarks import cpu_by_process

    rows = [(2.0, 102, "ray::ShuffleWorkerActor"), (0.5, 103, "ray::ShuffleMasterActor"),
            (0.5, 100, "python -m benchmarks.cpu_by_process"), (1.0, 101, "/x/raylet")]
    monkeypatch.setattr(cpu_by_process.os, "cpu_count", lambda: 8)
    shares = cpu_by_process.round_shares(rows, 100, 2, 2.5, ((0.0, 0.0), (0.0, 0.0)))
    assert (shares["control plane share"], shares["idle share"]) == (0.25, 0.2)
    monkeypatch.setattr(cpu_by_process.os, "cpu_count", lambda: 2)
    # The machine: 5.2 CPU-s in the round, 0.26 of them idle, 0.94 used by others.
    shares = cpu_by_process.round_shares(rows, 100, 2, 2.5, ((100.0, 10.0), (105.2, 10.26)))
    assert shares["control plane share"] == 0.25
    assert abs(shares["idle share"] - 0.05) < 1e-9
    assert "0.94 CPU-s used outside the session" in shares["idle note"]


def test_sql_summary_reads_warm_rounds_by_their_median_and_flags_goals():
    """The SQL workload's warm time is the median of the warm rounds (one lucky or unlucky
    round on a shared machine does not decide it); the first call counts for the worst
    query; a row mismatch is reported."""
    from benchmarks.spark_sql import QUERIES, summarize

    def mode(seconds, fingerprint="f"):
        return {"queries": {q: {"seconds": list(seconds), "rows": 1,
                                "fingerprint": fingerprint} for q in QUERIES}}

    own = mode([2.0, 1.0, 1.0, 9.0])         # median warm 1.0 (best 1.0)
    ours = mode([2.0, 0.1, 1.25, 1.25])      # median warm 1.25 (best 0.1)
    summary = summarize(own, ours)
    row = summary["queries"][0]
    assert row["spark_warm_s"] == 1.0 and row["ours_warm_s"] == 1.25
    assert summary["speedup_total_warm"] == pytest.approx(0.8)
    assert summary["worst_query_speedup"] == pytest.approx(0.8)
    assert summary["goals"] == {"total at least as fast as Spark's own shuffle (warm)": False,
                                "no query slower than 0.8x (first calls and warm)": True,
                                "same rows for every query": True}
    mismatched = summarize(own, mode([1.0, 1.0], fingerprint="g"))
    assert mismatched["mismatches"] == list(QUERIES)
    assert mismatched["goals"]["same rows for every query"] is False


def test_sql_summary_checks_every_round_s_rows_and_never_judges_what_it_did_not_measure():
    """A wrong result in any round is a mismatch (the last round's fingerprint alone hid
    the others); one round has no warm round; nothing measured is never "met"."""
    from benchmarks.spark_sql import QUERIES, markdown, summarize

    def mode(seconds, prints=None, error=None):
        if error:
            return {"queries": {q: {"seconds": [], "error": error} for q in QUERIES}}
        return {"queries": {q: {"seconds": list(seconds), "rows": 1,
                                "fingerprint": (prints or ["f"])[-1],
                                "fingerprints": list(prints or ["f"] * len(seconds))}
                            for q in QUERIES}}
    # hybrid_ray wrong in its first round only, right in the last.
    wrong_once = summarize(mode([1.0, 1.0]), mode([1.0, 1.0], prints=["g", "f"]))
    assert wrong_once["mismatches"] == list(QUERIES)
    one_round = summarize(mode([1.0]), mode([2.0]))
    assert one_round["queries"][0]["spark_warm_s"] is None
    assert one_round["speedup_total_warm"] is None
    assert one_round["goals"]["total at least as fast as Spark's own shuffle (warm)"] is None
    assert one_round["goals"]["no query slower than 0.8x (first calls and warm)"] is False
    all_failed = summarize(mode([], error="boom"), mode([], error="boom"))
    assert all_failed["goals"] == {
        "total at least as fast as Spark's own shuffle (warm)": None,
        "no query slower than 0.8x (first calls and warm)": None,
        "same rows for every query": False}
    text = markdown(one_round, {"command": "c", "date": "d", "cpus": 2, "scale": 0.1,
                                "lineitems": 1, "rounds": 1, "startup_spark_s": 1.0,
                                "startup_ours_s": 1.0}, None)
    assert "- total at least as fast as Spark's own shuffle (warm): not measured" in text
    assert "| 1.00 | 2.00 | 0.50x | - | - | - |" in text


def test_sql_summary_takes_the_median_first_call_over_fresh_sessions():
    """With several sessions each query has one first call per session: the median of
    them counts, and the warm time is the median of every session's warm rounds."""
    from benchmarks.spark_sql import QUERIES, summarize

    def mode(runs):
        return {"queries": {q: {"seconds": [x for r in runs for x in r], "runs": runs,
                                "rows": 1, "fingerprint": "f", "fingerprints": ["f"]}
                            for q in QUERIES}}
    own = mode([[3.0, 1.0], [5.0, 1.0], [4.0, 1.0]])
    ours = mode([[9.0, 1.0], [4.0, 2.0], [4.0, 2.0]])  # one bad first call of three
    row = summarize(own, ours)["queries"][0]
    assert (row["spark_first_s"], row["ours_first_s"]) == (4.0, 4.0)
    assert (row["spark_warm_s"], row["ours_warm_s"]) == (1.0, 2.0)


def test_sql_sessions_are_merged_per_query_with_their_first_calls_apart(monkeypatch):
    from benchmarks import spark_sql

    calls = iter([
        {"spark": {"mode": "spark", "startup_s": 10.0, "queries": {
            "q": {"seconds": [3.0, 1.0], "fingerprint": "f", "fingerprints": ["f", "f"],
                  "rows": 1}}}},
        {"spark": {"mode": "spark", "startup_s": 14.0, "tier_bytes": {"memory": 1},
                   "queries": {"q": {"seconds": [5.0, 2.0], "fingerprint": "g",
                                     "fingerprints": ["g", "f"], "rows": 1}}}}])
    monkeypatch.setattr(spark_sql, "run_interleaved", lambda *a: next(calls))
    merged = spark_sql.run_sessions({}, 2, 60.0, 2)["spark"]
    assert merged["startup_s"] == 12.0 and merged["tier_bytes"] == {"memory": 1}
    q = merged["queries"]["q"]
    assert q["runs"] == [[3.0, 1.0], [5.0, 2.0]] and q["seconds"] == [3.0, 1.0, 5.0, 2.0]
    assert q["fingerprints"] == ["f", "f", "g", "f"]  # a wrong round stays visible


# ---- what the suite verifies and how it judges ------------------------------------------------
def _results_table(blocks):
    return [pa.table({"key": pa.array(k, pa.int64()), "payload": pa.array(k, pa.int64())})
            for k in blocks]


def test_partition_check_refuses_an_operation_that_did_not_partition_by_key():
    """The rows alone cannot tell a repartition from handing the input back or coalescing
    it: the check also counts the blocks and, where keys repeat, keeps each key in one."""
    from benchmarks.suite import VerificationError, verify_partitions

    good = _results_table([[1, 1, 3], [2, 2, 4]])
    expected = checksum(good)
    assert verify_partitions(iter(good), 2, expected, keys_repeat=True)
    with pytest.raises(VerificationError, match="3 output blocks, not the 2 partitions"):
        verify_partitions(iter(_results_table([[1, 1], [3], [2, 2, 4]])), 2, expected, True)
    split_key = _results_table([[1, 3], [1, 2, 2, 4]])  # key 1 in both partitions
    with pytest.raises(VerificationError, match="a key is in more than one output partition"):
        verify_partitions(iter(split_key), 2, expected, keys_repeat=True)
    assert verify_partitions(iter(split_key), 2, expected, keys_repeat=False)  # gensort
    with pytest.raises(VerificationError, match="checksum mismatch"):
        verify_partitions(iter(_results_table([[1, 1], [2, 2, 4]])), 2, expected, True)


def _case(name, family, mb_s=None, error=None, workload="gensort", size=2**31):
    return CaseResult(name, family, workload, size, 1, seconds=1.0 if mb_s else None,
                      mb_s=mb_s, verified=error is None, error=error)


def test_a_goal_whose_hybrid_side_failed_is_not_met_and_says_why():
    results = [_case("raydata_shuffle_v2", "ray_data", 100),
               _case("hybrid_memory_disk", "hybrid_ray", 500),
               _case("hybrid_disk_capped", "hybrid_ray", error="RemoteTierError: down")]
    capped = next(g for g in goals(results) if g["goal"].startswith("hybrid_disk_capped"))
    assert capped["met"] is False
    assert capped["detail"] == "hybrid_disk_capped failed: RemoteTierError: down"
    main_failed = [_case("raydata_shuffle_v2", "ray_data", 100),
                   _case("hybrid_memory_disk", "hybrid_ray", error="boom")]
    default = next(g for g in goals(main_failed) if "Ray Data default" in g["goal"])
    assert default["met"] is False and "hybrid_memory_disk failed: boom" in default["detail"]


def test_the_capped_contrast_needs_spark_to_fail_for_lack_of_space():
    def contrast(native_error):
        results = [_case("spark_native_capped", "spark", error=native_error),
                   _case("spark_bridge_capped", "spark_bridge", 100)]
        return next(g for g in goals(results) if g["goal"].startswith("disk capped"))
    assert contrast("SparkException: java.io.IOException: No space left on device")["met"]
    assert not contrast("SparkException: ExecutorLostFailure (OOM)")["met"]
    assert not contrast(None)["met"]  # Spark finished


def test_ratio_columns_compare_rows_with_baselines_of_their_own_workload_and_size():
    results = [_case("raydata_shuffle_v2", "ray_data", 100),
               _case("raydata_shuffle_v2", "ray_data", 50, workload="zipf"),
               _case("hybrid_memory_disk", "hybrid_ray", 400),
               _case("hybrid_memory_disk", "hybrid_ray", 300, workload="zipf"),
               _case("hybrid_memory_disk", "scaling", 200, size=2**30)]
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    rows = {(line.split(" | ")[1], line.split(" | ")[2], line.split(" | ")[3]):
            line.split(" | ")[11] for line in text.splitlines()
            if line.startswith("| hybrid_memory_disk |")}
    assert rows == {("gensort", "2147", "1"): "4.00x", ("zipf", "2147", "1"): "6.00x",
                    ("gensort", "1074", "1"): "-"}  # (MB: 10^6 bytes)


def test_spill_dirs_between_rounds_are_removed_also_per_node(tmp_path):
    from benchmarks.suite import remove_spill_dirs

    for name in ("spill-node1", "spill-node2", "keep"):
        (tmp_path / name / "hybrid_ray").mkdir(parents=True)
    remove_spill_dirs(str(tmp_path / "spill-{node_id}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    remove_spill_dirs(str(tmp_path / "keep"))
    assert list(tmp_path.iterdir()) == []


def test_first_calls_follow_only_the_documented_start_up(monkeypatch, tmp_path):
    """No shuffle runs before a case's timed rounds: a hybrid_ray case gets
    ``hybrid_ray.init`` with its own config (per-node memory budget included), a Ray Data
    case nothing."""
    import hybrid_ray
    from benchmarks.suite import Bench, add_arguments

    calls = []
    monkeypatch.setattr(hybrid_ray, "init", lambda config, wait: calls.append(
        ("init", config.memory_capacity_bytes, wait)))
    monkeypatch.setattr(hybrid_ray, "repartition", lambda *a, **k: calls.append("shuffle"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bench = Bench(parser.parse_args(["--size", "1MB"]))
    try:
        bench._start_up("hybrid_memory_disk", 8_000_000, str(tmp_path / "s"))
        bench._start_up("hybrid_nodes_4", 8_000_000, str(tmp_path / "s"), nodes=4)
        bench._start_up("raydata_hash", 8_000_000, str(tmp_path / "s"))
    finally:
        bench.close()
    assert calls == [("init", 4_000_000, True), ("init", 1_000_000, True)]


_SCHED = """\
[000] 10.000: prev_comm=a prev_pid=7 prev_prio=120 prev_state=S ==> next_comm=w next_pid=11 next_prio=120
[001] 10.000: prev_comm=a prev_pid=8 prev_prio=120 prev_state=S ==> next_comm=r next_pid=12 next_prio=120
[000] 10.030: prev_comm=w prev_pid=11 prev_prio=120 prev_state=S ==> next_comm=swapper/0 next_pid=0 next_prio=120
[001] 10.040: prev_comm=r prev_pid=12 prev_prio=120 prev_state=S ==> next_comm=m next_pid=13 next_prio=120
[000] 10.031: comm=w pid=11 prio=120 target_cpu=001
[000] 10.045: comm=w pid=11 prio=120 target_cpu=000
[000] 10.050: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=w next_pid=11 next_prio=120
[001] 10.100: prev_comm=m prev_pid=13 prev_prio=120 prev_state=S ==> next_comm=r next_pid=12 next_prio=120
[000] 10.100: prev_comm=w prev_pid=11 prev_prio=120 prev_state=S ==> next_comm=swapper/0 next_pid=0 next_prio=120
"""


def test_idle_timeline_finds_when_a_core_idled_and_what_ran_beside_it():
    """From perf's context switches: each core's runs, the CPU of each role, the idle
    time per slice (split across slice boundaries) and the idle stretch with what ran on
    the other core meanwhile."""
    from benchmarks.idle_timeline import (
        IDLE, Run, cpu_by_role, idle_line, idle_per_bucket, idle_stretches, parse_events,
        runs_of,
    )

    runs = runs_of(parse_events(_SCHED + "not a switch line\n"))
    assert runs == [Run(10.0, 10.03, 0, 11, "w"), Run(10.0, 10.04, 1, 12, "r"),
                    Run(10.03, 10.05, 0, 0, "swapper/0"), Run(10.04, 10.1, 1, 13, "m"),
                    Run(10.05, 10.1, 0, 11, "w")]  # equal times: in perf's order
    roles = {11: "writer", 12: "reader", 13: "master"}

    def role_of(run):
        return roles[run.tid]

    by_role = cpu_by_role(runs, 10.0, 10.1, role_of)
    assert {k: round(v, 6) for k, v in by_role.items()} == {
        "writer": 0.08, "reader": 0.04, "master": 0.06, IDLE: 0.02}
    idle = idle_per_bucket(runs, 10.0, 10.1, 0.025)
    assert [round(x, 6) for x in idle] == [0.0, 0.02, 0.0, 0.0]
    assert idle_line(idle, 0.025, 2, mark_at=2) == "04|00"
    [(gap, beside)] = idle_stretches(runs, 10.0, 10.1, 0.002, role_of)
    assert (gap.cpu, gap.start, gap.end) == (0, 10.03, 10.05)
    assert {k: round(v, 6) for k, v in beside.items()} == {"reader": 0.01, "master": 0.01}
    assert idle_stretches(runs, 10.0, 10.1, 0.03, role_of) == []


def test_idle_timeline_counts_the_idle_a_thread_queued_on_a_busy_core_could_have_used():
    """Core 0 idles from 10.030 to 10.050. The writer woken at 10.031 is queued on the busy
    core 1 and counts as waiting for 5 ms (an older wakeup may have lost its switch-in);
    woken at 10.045 onto the idle core itself it does not count (that wait is the idle
    core's wake-up latency). Core 0 idles again from 10.100: a window past the last event
    counts that stretch up to its end."""
    from benchmarks.idle_timeline import Switch, Wakeup, idle_while_waiting, parse_events

    events = parse_events(_SCHED)
    assert Wakeup(10.031, 11, 1) in events
    assert Switch(10.1, 1, 13, False, 12, "r") in events
    idle, waiting, to_busy, to_idle = idle_while_waiting(events, 10.0, 10.1)
    assert (round(idle, 6), round(waiting, 6), to_busy, to_idle) == (0.02, 0.005, 1, 1)
    # Counted until it ran (the wakeup at 10.045 finds it queued on core 1 already).
    idle, waiting, _, _ = idle_while_waiting(events, 10.0, 10.1, fresh_s=0.1)
    assert (round(idle, 6), round(waiting, 6)) == (0.02, 0.019)
    idle, waiting, _, _ = idle_while_waiting(events, 10.0, 10.12)
    assert (round(idle, 6), round(waiting, 6)) == (0.04, 0.005)


def test_idle_timeline_says_what_is_missing_when_perf_cannot_trace(monkeypatch, capsys):
    from benchmarks import idle_timeline

    monkeypatch.setattr(idle_timeline.shutil, "which", lambda name: None)
    assert idle_timeline.main(["--rounds", "1"]) == 2
    assert capsys.readouterr().err == (
        "idle_timeline: perf is not installed: install it (Debian: apt-get install "
        "linux-perf)\n")


def test_idle_timeline_removes_its_work_dir_when_tracing_fails(monkeypatch, capsys, tmp_path):
    """perf that ends at once (no tracefs, say) is reported with its own message, and the
    trace directory the tool made goes with the failure (as with any other)."""
    from benchmarks import idle_timeline

    work = tmp_path / "hr-idle-x"

    def make_dir(prefix):
        work.mkdir()
        return str(work)

    def fails(args, directory):
        (work / "perf.log").write_text("no tracefs")
        raise idle_timeline.PerfFailed("perf record ended at once (exit 1): no tracefs")

    monkeypatch.setattr(idle_timeline, "perf_problem", lambda: None)
    monkeypatch.setattr(idle_timeline.tempfile, "mkdtemp", make_dir)
    monkeypatch.setattr(idle_timeline, "_trace_rounds", fails)
    assert idle_timeline.main(["--rounds", "1"]) == 2
    assert capsys.readouterr().err == (
        "idle_timeline: perf record ended at once (exit 1): no tracefs\n")
    assert not work.exists()


# ---- review fixes ----------------------------------------------------------------------------
def test_a_daft_venv_path_holding_something_else_is_refused_untouched(tmp_path):
    """``--daft-venv .venv`` deleted the project's own virtualenv (no marker: removed
    before pip ran). Only a directory the suite made (its marker, any version) or an empty
    one may be removed; anything else is refused, named, with the fix."""
    from benchmarks.daft_peer import READY_MARKER, DaftUnavailable, ensure_daft_venv
    from benchmarks.suite import main

    theirs = tmp_path / ".venv"
    (theirs / "bin").mkdir(parents=True)
    (theirs / "bin" / "python").write_text("")
    (theirs / "pyvenv.cfg").write_text("home = /usr/bin\n")
    ran = []

    def no_network(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")
    with pytest.raises(DaftUnavailable, match=rf"refusing to replace {re.escape(str(theirs))}"
                       r": .*choose another --daft-venv"):
        ensure_daft_venv(str(theirs), run=no_network)
    assert ran == [] and (theirs / "pyvenv.cfg").read_text() == "home = /usr/bin\n"
    # Refused before any case runs, too.
    assert main(["--scenario", "daft_map_reduce", "--daft-venv", str(theirs),
                 "--out", str(tmp_path / "out")]) == 2
    assert (theirs / "bin" / "python").exists() and not (tmp_path / "out").exists()
    # Ours (a marker, even of another version or not yet ready) and empty dirs are remade.
    ours, empty = tmp_path / "ours", tmp_path / "empty"
    (ours / "lib").mkdir(parents=True)
    (ours / READY_MARKER).write_text("daft==0.1\n")
    empty.mkdir()
    for venv in (ours, empty):
        ran.clear()
        with pytest.raises(DaftUnavailable, match="cannot create the venv"):
            ensure_daft_venv(str(venv), run=no_network)
        assert len(ran) == 1 and not venv.exists()  # nothing half-made is left behind

    def pip_fails(cmd, **kwargs):
        if cmd[1:3] == ["-m", "venv"]:
            os.makedirs(cmd[3], exist_ok=True)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")
    with pytest.raises(DaftUnavailable, match="cannot pip install"):
        ensure_daft_venv(str(ours), run=pip_fails)
    # Marked as ours before pip ran (not as ready), so the next run may make it again.
    from benchmarks.daft_peer import MADE_MARKER
    assert (ours / MADE_MARKER).exists() and not (ours / READY_MARKER).exists()
    with pytest.raises(DaftUnavailable, match="cannot pip install"):
        ensure_daft_venv(str(ours), run=pip_fails)


def _group_leaver(tmp_path, sleep_s):
    """A fake child: starts a grandchild (as a child's Ray would, its output elsewhere),
    writes its pid, then sleeps ``sleep_s``. Returns (script, pid file)."""
    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "child.sh"
    script.write_text(f"#!/bin/sh\nsleep 120 >/dev/null 2>&1 </dev/null &\n"
                      f"echo $! > {pid_file}\nsleep {sleep_s}\n")
    script.chmod(0o755)
    return str(script), pid_file


def _alive(pid):
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_soon(pid, within=5.0):
    import time

    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)  # not left behind by a failing test either
    return not alive


def test_a_daft_child_that_times_out_is_killed_with_everything_it_started(monkeypatch,
                                                                          tmp_path):
    """A timed-out Daft child left its Ray (re-parented to PID 1) running: the child runs
    in a session of its own and a timeout kills its whole process group."""
    from benchmarks import suite
    from benchmarks.suite import Bench, add_arguments

    python, pid_file = _group_leaver(tmp_path, sleep_s=8)
    monkeypatch.setattr(suite, "DAFT_TIMEOUT_BASE_S", 1, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--size", "1MB", "--rounds", "1"])
    args.scaling, args.workload = [], ["gensort"]
    bench = Bench(args)
    try:
        result = bench._daft_case(python, "daft_map_reduce", "gensort", 1_000_000)
    finally:
        bench.close()
        gone = _gone_soon(int(pid_file.read_text()))  # (and killed if not)
    assert gone
    assert not result.verified and "took over 2 s (killed with its process group)" in \
        result.error


def test_a_sql_child_that_times_out_is_a_failed_mode_and_is_killed_with_its_group(
        monkeypatch, tmp_path):
    """``spark_sql._spawn`` let TimeoutExpired end the whole run, and left the child's
    Ray and JVMs running: a timeout is that mode's failure, its process group killed."""
    from benchmarks import spark_sql

    python, pid_file = _group_leaver(tmp_path, sleep_s=60)
    monkeypatch.setattr(sys, "executable", python)
    args = argparse.Namespace(rounds=1, timeout=1.0)
    try:
        result = spark_sql._spawn("hybrid_ray", args, {}, capped_disk=str(tmp_path))
    finally:
        gone = _gone_soon(int(pid_file.read_text()))  # (and killed if not)
    assert gone
    assert result == {"mode": "hybrid_ray", "queries": {},
                      "error": "the hybrid_ray child took over 1 s (killed with its process "
                               "group)"}
    assert spark_sql._capped_outcome(result).startswith("failed: the hybrid_ray child took")


def test_sql_goals_are_not_met_when_either_mode_failed_a_query():
    """A failed query was left out of the totals and the worst speed-up, so both speed
    goals read "met" while hybrid_ray had failed a query: they are not met, and the
    report says which queries failed in which mode."""
    from benchmarks.spark_sql import QUERIES, markdown, summarize

    def mode(seconds):
        return {"queries": {q: {"seconds": list(seconds), "rows": 3, "fingerprint": "x",
                                "fingerprints": ["x"] * len(seconds)} for q in QUERIES}}
    first, *_ = QUERIES
    for failing in ("hybrid_ray", "spark"):
        own, ours = mode([10.0, 5.0]), mode([9.0, 4.0])
        (ours if failing == "hybrid_ray" else own)["queries"][first] = {
            "seconds": [], "error": "ShuffleFailedError: boom"}
        summary = summarize(own, ours)
        assert summary["goals"] == {
            "total at least as fast as Spark's own shuffle (warm)": False,
            "no query slower than 0.8x (first calls and warm)": False,
            "same rows for every query": False}
        assert summary["failed"] == {first: f"{failing}: ShuffleFailedError: boom"}
    text = markdown(summary, {"command": "c", "date": "d", "cpus": 2, "scale": 0.1,
                              "lineitems": 1, "rounds": 2, "startup_spark_s": 1.0,
                              "startup_ours_s": 1.0}, None)
    assert (f"- no query slower than 0.8x (first calls and warm): NOT met; failed queries, "
            f"left out of the totals: {first} (spark: ShuffleFailedError: boom)") in text


def test_the_simulated_nodes_goal_is_not_met_when_a_node_count_failed():
    """A failed hybrid_nodes_N row was dropped and the others judged alone ("met");
    the goal is not met and names the failed case, also with one node count left."""
    def node_case(n, mb_s=None, error=None):
        return CaseResult(f"hybrid_nodes_{n}", "hybrid_ray", "gensort", 2**31, n,
                          seconds=1.0 if mb_s else None, mb_s=mb_s, verified=error is None,
                          error=error)
    for results in ([node_case(1, 100), node_case(2, 95), node_case(4, error="boom")],
                    [node_case(1, 100), node_case(2, error="boom")]):
        judged = [g for g in goals(results) if g["goal"].startswith("simulated nodes")]
        assert len(judged) == 1 and judged[0]["met"] is False
        assert judged[0]["detail"] == f"{results[-1].case} failed: boom"
        assert judged[0]["goal"].startswith(
            "simulated nodes " + "/".join(str(r.nodes) for r in results) + ": ")
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    assert "| simulated nodes 1/2: slowest vs fastest (within 20%) | 0.80x | " \
           "hybrid_nodes_2 failed: boom | no |" in text


def test_bench_refuses_more_cpus_than_usable_cores_before_any_case_runs(monkeypatch, capsys,
                                                                        tmp_path):
    """--cpus above the cores this process may run on was accepted and divided the floor
    over cores that are not there: it is refused before anything runs."""
    from benchmarks import suite

    ran = []
    monkeypatch.setattr(suite.Bench, "run", lambda self, selected: ran.append(selected) or [])
    cores = len(os.sched_getaffinity(0))
    assert suite.main(["--cpus", str(cores + 1), "--scenario", "machine_hash_key",
                       "--out", str(tmp_path / "out")]) == 2
    assert ran == [] and f"--cpus {cores + 1} is more than the {cores} cores" in \
        capsys.readouterr().err


# /proc/self: a directory that exists and that no one, root included, can write to.
@pytest.mark.parametrize("out", ["a_file", "a_file/results", "/proc/self"])
def test_a_bad_out_dir_is_refused_before_any_case_runs(monkeypatch, capsys, tmp_path, out):
    """A bad --out (a file, under a file, not writable) was found only when every case had
    run, losing the run: it is checked, with a write, before."""
    from benchmarks import suite

    ran = []
    monkeypatch.setattr(suite.Bench, "run", lambda self, selected: ran.append(selected) or [])
    (tmp_path / "a_file").write_text("")
    assert suite.main(["--scenario", "machine_hash_key", "--out", str(tmp_path / out)]) == 2
    assert ran == []
    assert f"--out: cannot write the results to {tmp_path / out}: " in capsys.readouterr().err


def test_a_failed_case_shows_no_speed_or_time():
    """A case whose second round failed showed the first round's MB/s as first call and
    its seconds (in results.json and the table): a row that did not verify has none."""
    import dataclasses

    def case(mb_s, verified=True):
        return CaseResult("c", "hybrid_ray", "gensort", 2**31, 1, seconds=1.0,
                          mb_s=mb_s if verified else None, verified=verified,
                          error=None if verified else "checksum mismatch")
    for rounds in ([case(2147.5), case(None, False)], [case(None, False), case(2147.5)],
                   [case(None, False), case(100.0), case(2147.5)]):
        failed = best_round(rounds)
        row = dataclasses.asdict(failed)
        assert not row["verified"] and row["error"] == "checksum mismatch"
        assert [row[k] for k in ("mb_s", "seconds", "first_mb_s", "warm_mb_s")] == [None] * 4
    text = markdown([failed], {"date": "d", "cpus": 2, "memory_gib": 24,
                               "size_bytes": 2**31, "partitions": 16, "command": "c"})
    assert "| c | gensort | 2147 | 1 | - | - | - | - | NO: checksum mismatch |" in text
    # Whatever a row that did not verify holds, the table shows no speed for it.
    odd = CaseResult("d", "daft", "gensort", 2**31, 1, seconds=3.0, mb_s=9.0,
                     first_mb_s=9.0, warm_mb_s=9.0, error="boom")
    assert "| d | gensort | 2147 | 1 | - | - | - | - | NO: boom |" in markdown(
        [odd], {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                "partitions": 16, "command": "c"})


def test_the_fastest_ray_data_goal_names_the_strategies_it_is_the_fastest_of():
    """"vs fastest Ray Data" read met when one Ray Data strategy had run: the goal names
    the strategies that verified, and is not measured when none did."""
    results = [_case("raydata_shuffle_v2", "ray_data", 100),
               _case("raydata_hash", "ray_data", error="boom"),
               _case("hybrid_memory_disk", "hybrid_ray", 200)]
    fastest = next(g for g in goals(results) if "fastest Ray Data" in g["goal"])
    assert fastest["goal"] == ("hybrid_memory_disk vs fastest Ray Data (raydata_shuffle_v2, "
                               "fastest of 1: raydata_shuffle_v2)")
    assert fastest["met"] is True  # 2.0x, judged against what ran
    results.append(_case("raydata_sort_pull", "ray_data", 150))
    fastest = next(g for g in goals(results) if "fastest Ray Data" in g["goal"])
    assert fastest["goal"].endswith("(raydata_sort_pull, fastest of 2: raydata_shuffle_v2, "
                                    "raydata_sort_pull)")
    none = next(g for g in goals(results[1:2] + results[2:3])
                if "fastest Ray Data" in g["goal"])
    assert none["goal"].endswith("(no Ray Data case verified)") and none["met"] is None
    text = markdown(results[1:3], {"date": "d", "cpus": 2, "memory_gib": 24,
                                   "size_bytes": 2**31, "partitions": 16, "command": "c"})
    assert "| hybrid_memory_disk vs fastest Ray Data (no Ray Data case verified) | 1.50x | - " \
           "| not measured |" in text


def test_hybrid_ray_output_is_checked_row_by_row_against_its_own_partitioner():
    """For gensort (distinct keys) a coalesce in input order kept the rows and the block
    count and passed: with hybrid_ray's partitioner every row must be in the block its
    key's hash names."""
    import numpy as np

    from benchmarks.suite import VerificationError, verify_partitions
    from hybrid_ray.partitioning import HashPartitioner

    table = pa.concat_tables(generate("gensort", 2_000_000))
    expected, partitioner = checksum([table]), HashPartitioner(["key"])
    parts = partitioner.assign(table, 0, 4)
    shuffled = [table.filter(pa.array(parts == i)) for i in range(4)]
    assert verify_partitions(iter(shuffled), 4, expected, False, partitioner=partitioner)
    # A zipf output partitioned as hybrid_ray does passes too (keys repeat).
    zipf = pa.concat_tables(generate("zipf", 1_000_000))
    zparts = partitioner.assign(zipf, 0, 3)
    assert verify_partitions([zipf.filter(pa.array(zparts == i)) for i in range(3)], 3,
                             checksum([zipf]), True, partitioner=partitioner)
    rows = np.array_split(np.arange(table.num_rows), 4)
    coalesced = [table.take(pa.array(r)) for r in rows]  # the rows, 4 blocks, no key order
    with pytest.raises(VerificationError, match=r"output block 0 holds \d+ rows the "
                       r"partitioner puts in other partitions .*not partitioned by 'key'"):
        verify_partitions(iter(coalesced), 4, expected, False, partitioner=partitioner)
    swapped = [shuffled[1], shuffled[0], *shuffled[2:]]  # right groups, wrong blocks
    with pytest.raises(VerificationError, match="output block 0 holds"):
        verify_partitions(iter(swapped), 4, expected, False, partitioner=partitioner)
    # Rows still come first: a lost row is a checksum mismatch, however it is placed.
    with pytest.raises(VerificationError, match="checksum mismatch"):
        verify_partitions(iter([shuffled[0].slice(1), *shuffled[1:]]), 4, expected, False,
                          partitioner=partitioner)


def test_a_ray_or_cluster_that_does_not_start_is_a_failed_case_not_the_end_of_the_run(
        monkeypatch):
    """ray.init and Cluster(...) ran outside the cases' try: one that failed ended the
    run and lost the results of the cases before it."""
    import ray
    import ray.cluster_utils

    from benchmarks.suite import Bench, add_arguments

    def fails(*args, **kwargs):
        raise RuntimeError("no Ray today")
    monkeypatch.setattr(ray, "init", fails)
    monkeypatch.setattr(ray.cluster_utils, "Cluster", fails)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--size", "1MB"])
    args.scaling, args.workload = [], ["gensort"]
    bench = Bench(args)
    try:
        results = bench.run(["raydata_hash", "hybrid_memory", "hybrid_nodes_2"])
    finally:
        bench.close()
    assert [(r.case, r.verified, r.error) for r in results] == [
        ("raydata_hash", False, "set-up: RuntimeError: no Ray today"),
        ("hybrid_memory", False, "set-up: RuntimeError: no Ray today"),
        ("hybrid_nodes_2", False, "cluster: RuntimeError: no Ray today")]


def test_spark_cases_of_two_workloads_keep_their_own_rounds(monkeypatch):
    """With --workload given twice, the Spark cases' rounds were kept by case name alone:
    both workloads' rounds made one row, recorded twice under one workload, and the other
    workload's row was lost."""
    import spark_bridge

    from benchmarks.suite import Bench, add_arguments

    def fake_case(self, spark, name, workload, size, capped_dir):
        def run():
            return None, lambda: True, None, f"{workload} run"
        return "spark", size, run
    monkeypatch.setattr(Bench, "_spark_case", fake_case)
    monkeypatch.setattr(spark_bridge, "release_all", lambda: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--size", "1MB"])
    args.scaling, args.workload = [], ["gensort", "zipf"]
    bench = Bench(args)
    try:
        bench._spark_cases(None, [("spark_native", w, 10**6) for w in ("gensort", "zipf")],
                           None, rounds=2)
    finally:
        bench.close()
    assert [(r.case, r.workload) for r in bench.results] == [("spark_native", "gensort"),
                                                             ("spark_native", "zipf")]
    for r in bench.results:
        assert r.note.startswith(f"{r.workload} run; best of 2 alternating rounds (")
        assert r.note.count("best of") == 1


def test_bench_refuses_a_negative_seed_before_any_case_runs(monkeypatch, capsys, tmp_path):
    """--seed -1 was accepted: the machine rows ran, then numpy's generator refused the
    seed with its own traceback and the run wrote no results."""
    from benchmarks import suite

    ran = []
    monkeypatch.setattr(suite.Bench, "run", lambda self, selected: ran.append(selected) or [])
    assert suite.main(["--seed", "-1", "--scenario", "polars_partition_by",
                       "--out", str(tmp_path / "out")]) == 2
    assert ran == [] and "--seed must be 0 or more, got -1" in capsys.readouterr().err


def test_bench_refuses_a_malformed_scaling_size_with_its_message(capsys):
    """--scaling 1..2GiB ended in a ValueError traceback from float()."""
    from benchmarks import suite

    assert suite.main(["--scaling", "1..2GiB", "--scenario", "machine_hash_key"]) == 2
    assert "--scaling: invalid size '1..2GiB': use e.g. 256MB or 2GiB" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--cpus", "0"], ["--cpus", "999"],
                                  ["--object-store-gib", "-1"]])
def test_cpu_by_process_refuses_bad_cpus_or_store_before_ray_starts(monkeypatch, capsys,
                                                                      argv):
    """--cpus 0 started Ray and then waited for a CPU for ever; more CPUs than cores counted
    cores that are not there as idle; a negative store size failed inside Ray."""
    import ray

    from benchmarks import cpu_by_process

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")
    monkeypatch.setattr(ray, "init", no_ray)
    with pytest.raises(SystemExit) as exit_:
        cpu_by_process.main(["--size", "0.001", "--rounds", "1", *argv])
    assert exit_.value.code == 2
    assert f"{argv[0]} must be" in capsys.readouterr().err


def test_idle_timeline_refuses_zero_cpus_before_ray_starts(monkeypatch, capsys):
    """--cpus 0 started Ray and then waited for a CPU for ever in the warm-up."""
    import ray

    from benchmarks import idle_timeline

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(idle_timeline, "perf_problem", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        idle_timeline.main(["--size", "0.001", "--rounds", "1", "--cpus", "0"])
    assert exit_.value.code == 2 and "--cpus must be 1 or more, got 0" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--timeout", "0"], ["--timeout", "-1"],
                                  ["--capped-disk-mib", "-5"]])
def test_sql_refuses_a_bad_timeout_or_tmpfs_size_before_making_data(monkeypatch, capsys,
                                                                     argv):
    """A --timeout of 0 or less and a negative --capped-disk-mib were taken: the data was
    made and a mode started before select() or mount refused them."""
    from benchmarks import spark_sql

    def no_data(*args, **kwargs):
        raise AssertionError("data generated")
    monkeypatch.setattr(spark_sql, "generate", no_data)
    with pytest.raises(SystemExit) as exit_:
        spark_sql.main(argv)
    assert exit_.value.code == 2
    assert "--timeout must be > 0 and --capped-disk-mib >= 0" in capsys.readouterr().err


def test_sql_total_shows_no_warm_time_when_no_warm_round_ran():
    """With --rounds 1 every query's warm time read "-" but the total row read 0.00 s for
    both modes (and 0.0 in results.json): a warm total that was never measured."""
    from benchmarks.spark_sql import QUERIES, markdown, summarize

    def mode(seconds):
        return {"queries": {q: {"seconds": list(seconds), "rows": 1, "fingerprint": "f"}
                            for q in QUERIES}}
    summary = summarize(mode([2.0]), mode([1.0]))
    assert summary["totals"]["spark_warm"] is None and summary["totals"]["ours_warm"] is None
    assert summary["speedup_total_warm"] is None
    text = markdown(summary, {"command": "c", "date": "d", "cpus": 2, "scale": 0.1,
                              "lineitems": 1, "rounds": 1, "startup_spark_s": 1.0,
                              "startup_ours_s": 1.0}, None)
    assert f"| **total** | | | {2.0 * len(QUERIES):.2f} | {1.0 * len(QUERIES):.2f} | 2.00x " \
           "| - | - | - |" in text


@pytest.mark.parametrize("module", ["spark_sql", "spark_ops"])
def test_spark_benchmarks_refuse_a_bad_out_dir_before_they_run(monkeypatch, capsys, tmp_path,
                                                               module):
    """A --out that cannot be written (here: a file) was found by os.makedirs after the
    whole Spark run, which ended in a traceback without its results."""
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(bench, "generate" if module == "spark_sql" else "run", no_run)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--out", str(tmp_path / "a_file")])
    assert exit_.value.code == 2
    assert f"--out: cannot write the results to {tmp_path / 'a_file'}: " in \
        capsys.readouterr().err
