"""What an operator reads: the phase times in each report and the Prometheus metrics
recorded from the reports (issue 17)."""

from __future__ import annotations

import logging
import time
import urllib.request

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
from conftest import base_config, row_fingerprint
from hybrid_ray import HashPartitioner, MiB, ShuffleFailedError, metrics

# perf_counter readings of one process: the phases are spans inside the wall time, up to
# the rounding of a few clock reads.
TOLERANCE_S = 0.05


def make_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(7)
    return pa.table({"key": rng.integers(0, rows // 4 + 1, rows),
                     "payload": rng.integers(0, 1 << 62, rows)})


@pytest.fixture
def dataset(ray_local):
    table = make_table(200_000)
    return ray_local.data.from_arrow(table).repartition(4).materialize(), table


class LastMapSlowPartitioner(HashPartitioner):
    """Hash partitioning whose last map sleeps first and, in hybrid mode, goes on only once
    a reader was delivered segments: hybrid reducers then certainly consume while it runs
    and wait for its segments, whatever the machine's speed. (The sleep alone was outlasted
    by a reducer slow to start on a loaded machine: no overlap.)"""

    def __init__(self, keys, last_map: int, namespace: str | None = None) -> None:
        super().__init__(keys)
        self.last_map, self.namespace = last_map, namespace

    def assign(self, table, map_index, num_partitions):
        if map_index == self.last_map:
            time.sleep(1.0)
            if self.namespace is not None:
                from conftest import wait_for_a_delivery

                wait_for_a_delivery(self.namespace, 120.0)
        return super().assign(table, map_index, num_partitions)


def run_slow_last_map(ray, ds, table, cfg) -> hybrid_ray.ShuffleReport:
    refs = ds.to_arrow_refs()
    hybrid = cfg.mode.value == "hybrid"
    partitioner = LastMapSlowPartitioner(["key"], len(refs) - 1,
                                         cfg.namespace if hybrid else None)
    res = hybrid_ray.run_shuffle(refs, 3, partitioner, table.schema, cfg)
    assert row_fingerprint(ray.get(res.refs)) == row_fingerprint([table])
    return res.report


def test_blocking_phases_are_positive_and_follow_each_other(dataset, ray_local, tmp_path):
    ds, table = dataset
    report = run_slow_last_map(ray_local, ds, table, base_config(tmp_path, mode="blocking"))
    p = report.phases
    assert p is not None
    assert p.startup > 0 and p.map > 0 and p.reduce > 0 and p.control_plane > 0, p
    # Blocking reducers start when every segment is committed: nothing to wait for.
    assert p.waiting >= 0, p
    assert p.map >= 1.0, p  # the last map's sleep is inside the map phase
    # Blocking: startup, then the maps, then the reducers, all inside the wall time.
    assert p.startup + p.map + p.reduce <= report.wall_time_s + TOLERANCE_S, report.table()


def test_hybrid_phases_overlap_and_reducers_wait(dataset, ray_local, tmp_path):
    ds, table = dataset
    report = run_slow_last_map(ray_local, ds, table, base_config(tmp_path, mode="hybrid"))
    p = report.phases
    assert p is not None
    assert p.startup > 0 and p.map > 0 and p.reduce > 0 and p.control_plane > 0, p
    # Hybrid reducers start with the maps and poll through the last map's sleep.
    assert p.waiting > 0, p
    assert report.hybrid_overlap, report.table()
    # Map and reduce overlap: each, after startup, fits in the wall time (their sum need
    # not).
    assert p.startup + p.map <= report.wall_time_s + TOLERANCE_S, report.table()
    assert p.startup + p.reduce <= report.wall_time_s + TOLERANCE_S, report.table()


def test_phases_are_in_the_summary_and_the_dict(dataset, ray_local, tmp_path):
    ds, _ = dataset
    out = hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
    report = hybrid_ray.report_of(out)
    text = str(report)
    phases_line = next(line for line in text.splitlines() if "phases:" in line)
    for name in ("startup", "map", "reduce", "waiting", "control plane"):
        assert name in phases_line, text
    assert f"startup {report.phases.startup:.2f} s" in phases_line
    d = report.to_dict()
    assert set(d["phases"]) == {"startup", "map", "reduce", "waiting", "control_plane"}
    assert d["phases"]["map"] == report.phases.map


def _diff(after, before):
    """``after - before`` of two snapshot values (numbers or tag -> number dicts)."""
    if isinstance(after, dict):
        return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    return after - before


def test_metrics_record_exactly_the_reports_numbers(dataset, ray_local, tmp_path):
    ds, table = dataset
    # A small memory tier: the shuffle writes to memory and disk, so two tiers are checked.
    cfg = base_config(tmp_path, memory_capacity_bytes=MiB)
    before = metrics.snapshot()
    out = hybrid_ray.repartition(ds, 4, keys=["key"], config=cfg)
    after = metrics.snapshot()
    report = hybrid_ray.report_of(out)

    written = {t: b for t, b in report.bytes_per_tier().items() if b}
    assert written.get("memory") and written.get("disk"), report.table()
    assert _diff(after["hybrid_ray_bytes_written"], before["hybrid_ray_bytes_written"]) \
        == written
    assert _diff(after["hybrid_ray_segments_written"],
                 before["hybrid_ray_segments_written"]) \
        == {t: n for t, n in report.segments_per_tier().items() if n}
    for name, value in (("hybrid_ray_spill_events", report.spill_events),
                        ("hybrid_ray_tier_switches", report.tier_switches),
                        ("hybrid_ray_lost_maps_rerun", report.lost_maps_rerun)):
        assert _diff(after[name], before[name]) == value, name
    assert report.spill_events > 0
    assert _diff(after["hybrid_ray_shuffles_completed"],
                 before["hybrid_ray_shuffles_completed"]) == {"repartition": 1}
    wall_before = before["hybrid_ray_shuffle_wall_time_seconds"].get(
        "repartition", {"count": 0, "sum": 0.0})
    wall_after = after["hybrid_ray_shuffle_wall_time_seconds"]["repartition"]
    assert wall_after["count"] == wall_before["count"] + 1
    assert wall_after["sum"] - wall_before["sum"] == pytest.approx(report.wall_time_s)
    phases = _diff(after["hybrid_ray_phase_seconds"], before["hybrid_ray_phase_seconds"])
    assert phases["map"] == pytest.approx(report.phases.map)
    assert phases["control_plane"] == pytest.approx(report.phases.control_plane)
    assert after["hybrid_ray_shuffle_errors"] == before["hybrid_ray_shuffle_errors"]
    assert row_fingerprint(ray_local.get(out.to_arrow_refs())) == row_fingerprint([table])



def test_run_shuffle_names_count_under_a_bounded_label_and_read_as_not_measured(ray_local,
                                                                               tmp_path):
    """Was: each ``operation`` name given to run_shuffle became a label value of its own (a
    name per job grew Prometheus' series without bound), a number was taken (metrics
    tags must be strings), and the report said "input 0.0 MB ... throughput 0.0 MB/s"
    (run_shuffle is not given its blocks' sizes)."""
    from hybrid_ray import ConfigError

    table = pa.table({"key": np.arange(100)})
    cfg = base_config(tmp_path)
    before = metrics.snapshot()
    for i in range(3):
        result = hybrid_ray.run_shuffle([ray_local.put(table)], 2, HashPartitioner(["key"]),
                                        table.schema, cfg, f"nightly-{i}-run")
        assert result.report.operation == f"nightly-{i}-run"  # the report keeps its name
    after = metrics.snapshot()
    assert _diff(after["hybrid_ray_shuffles_completed"],
                 before["hybrid_ray_shuffles_completed"]) == {"custom": 3}
    assert set(after["hybrid_ray_shuffle_wall_time_seconds"]) <= metrics.OPERATION_LABELS
    text = result.report.table()
    assert "rows 100  input not measured (run_shuffle of blocks)" in text
    assert "throughput" not in text
    for bad in (123, "", "x" * 65):
        with pytest.raises(ConfigError, match="operation must be a short name"):
            hybrid_ray.run_shuffle([ray_local.put(table)], 2, HashPartitioner(["key"]),
                                   table.schema, cfg, bad)

class FailsInMapOne(HashPartitioner):
    def assign(self, table, map_index, num_partitions):
        if map_index == 1:
            raise ValueError("a value the job cannot handle")
        return super().assign(table, map_index, num_partitions)


def test_a_failed_shuffle_counts_one_error_of_its_kind(ray_local, tmp_path):
    table = pa.table({"key": np.arange(1000)})
    before = metrics.snapshot()
    with pytest.raises(ShuffleFailedError):
        hybrid_ray.run_shuffle([ray_local.put(table), ray_local.put(table)], 2,
                               FailsInMapOne(["key"]), table.schema, base_config(tmp_path))
    after = metrics.snapshot()
    assert _diff(after["hybrid_ray_shuffle_errors"], before["hybrid_ray_shuffle_errors"]) \
        == {"ValueError": 1}
    assert after["hybrid_ray_shuffles_completed"] == before["hybrid_ray_shuffles_completed"]


def test_a_failed_spark_bridge_map_stage_counts_one_error_of_its_kind(monkeypatch, tmp_path):
    """The bridge's map stages record their report in the metrics when they complete; a
    failed one is counted as an error too (it was not: an error-rate panel read 0%)."""
    import types

    from hybrid_ray.errors import OutOfSpaceError
    from spark_bridge import exchange

    monkeypatch.setattr(exchange, "_release_failed", lambda shuffle_id, why: "")
    shuffle = exchange.BridgeShuffle("shf-x", 2, base_config(tmp_path), pa.schema([]))
    life = types.SimpleNamespace(released=False, operation="spark_repartition")

    def run():
        raise OutOfSpaceError("no tier can take a segment")
    before = metrics.snapshot()
    exchange._map_stage(shuffle, life, run)
    after = metrics.snapshot()
    assert _diff(after["hybrid_ray_shuffle_errors"], before["hybrid_ray_shuffle_errors"]) \
        == {"OutOfSpaceError": 1}
    with pytest.raises(ShuffleFailedError, match="no tier can take a segment"):
        shuffle.report


class Refuses:
    """A metrics backend that fails every call, the way a broken exporter would."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("metrics backend unavailable")


class RecordingRefused:
    """A metric that is created but refuses every value."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def inc(self, *args, **kwargs) -> None:
        raise RuntimeError("cannot record")

    observe = inc


@pytest.mark.parametrize("backend", [Refuses, RecordingRefused])
def test_a_failing_metrics_backend_does_not_fail_the_shuffle(dataset, ray_local, tmp_path,
                                                             monkeypatch, caplog, backend):
    import ray.util.metrics

    ds, table = dataset
    monkeypatch.setattr(ray.util.metrics, "Counter", backend)
    monkeypatch.setattr(ray.util.metrics, "Histogram", backend)
    # Metric objects made before (by earlier tests) would bypass the broken backend.
    monkeypatch.setattr(metrics, "_objects_session", None)
    monkeypatch.setattr(metrics, "_objects", {})
    monkeypatch.setattr(metrics, "_logged_failure", False)
    caplog.set_level(logging.DEBUG, logger="hybrid_ray.metrics")
    before = metrics.snapshot()
    for _ in range(2):
        out = hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
        assert row_fingerprint(ray_local.get(out.to_arrow_refs())) \
            == row_fingerprint([table])
    metrics.record_error("ValueError")  # the error path is guarded the same way
    failures = [r for r in caplog.records if r.name == "hybrid_ray.metrics"]
    assert len(failures) == 1 and failures[0].levelno == logging.DEBUG, failures
    assert "RuntimeError" in failures[0].getMessage()
    # The process's own totals still count what the backend refused.
    after = metrics.snapshot()
    assert _diff(after["hybrid_ray_shuffles_completed"],
                 before["hybrid_ray_shuffles_completed"]) == {"repartition": 2}


def test_metrics_outside_ray_are_kept_and_not_exported(monkeypatch):
    """Not connected to Ray (a report recorded after ray.shutdown): nothing is created,
    nothing raises, the totals still count."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(metrics, "_objects_session", None)
    monkeypatch.setattr(metrics, "_objects", {})
    before = metrics.snapshot()
    metrics.record_error("OutOfSpaceError")
    assert metrics._objects == {}
    assert _diff(metrics.snapshot()["hybrid_ray_shuffle_errors"],
                 before["hybrid_ray_shuffle_errors"]) == {"OutOfSpaceError": 1}


def _metrics_export_port(ray) -> int:
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == node_id)


@pytest.mark.slow
def test_metrics_reach_rays_prometheus_endpoint(dataset, ray_local, tmp_path):
    """Ray's metrics agent exports the metrics within seconds, under ``ray_`` + name, a
    Counter with ``_total``. Bounded wait: the agent exports on a period of its own."""
    ds, _ = dataset
    hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
    url = f"http://127.0.0.1:{_metrics_export_port(ray_local)}/metrics"
    wanted = ("ray_hybrid_ray_bytes_written_total{", "ray_hybrid_ray_shuffles_completed_total{",
              "ray_hybrid_ray_shuffle_wall_time_seconds_bucket{")
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        if all(w in text for w in wanted):
            break
        time.sleep(1)
    missing = [w for w in wanted if w not in text]
    assert not missing, f"not exported within 60 s: {missing}"
    # One line per tier that saw bytes in this Ray session (earlier tests may add remote).
    lines = [line for line in text.splitlines()
             if line.startswith("ray_hybrid_ray_bytes_written_total{")]
    assert any('tier="memory"' in line or 'tier="disk"' in line for line in lines), lines
