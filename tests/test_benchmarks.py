"""The benchmark suite: deterministic data, a checksum that catches lost or duplicated rows,
goal arithmetic, and a real (small) run of the command that writes every output."""

from __future__ import annotations

import argparse
import json
import os
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
    for bad in ("lots", "0MB", "-1GiB"):
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
    assert by_goal["hybrid_memory_disk vs Ray Data default"]["met"] is True
    assert by_goal["hybrid_memory_disk vs fastest Ray Data"]["ratio"] == pytest.approx(2.0)
    assert by_goal["hybrid_disk_capped vs uncapped hybrid_memory_disk"]["met"] is False
    assert by_goal["hybrid_memory_disk vs Spark's own shuffle"]["met"] is None
    text = markdown(results, {"date": "d", "cpus": 2, "memory_gib": 24, "size_bytes": 2**31,
                              "partitions": 16, "command": "c"})
    assert "| hybrid_memory_disk vs Ray Data default (SHUFFLE_V2) | 3.00x | 3.20x | yes |" in text


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
