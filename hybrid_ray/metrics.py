"""Prometheus metrics of hybrid_ray's shuffles, exported through Ray's metrics agent.

Recorded on the driver when a shuffle ends, from its ``ShuffleReport`` (the numbers are
there already: nothing is counted twice, and no worker process pays for metrics). Ray
exports them from every node's metrics agent (``ray start --metrics-export-port=...``)
with its own ``ray_`` prefix, and Counters with a ``_total`` suffix: see the README's
"Metrics and phase times".

Metrics are a side channel: creating or recording one never fails a shuffle. The metric
objects are created on first use, in a process connected to Ray (``ray.util.metrics``
needs one), and again after Ray was restarted in this process; a backend that raises is
logged once, at debug level, and otherwise ignored.

``snapshot()`` returns what this process recorded, so that a test (or a user's own
exporter) can compare it with the reports without waiting for Ray's export.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_ray.report import ShuffleReport

_log = logging.getLogger(__name__)

# Upper bounds (seconds) of the wall-time histogram's buckets: from sub-second shuffles
# of small data to hour-long terabyte ones.
WALL_TIME_BUCKETS_S = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                       600.0, 1800.0, 3600.0]

# name -> (kind, description, tag keys). Names as this process registers them with Ray;
# Prometheus sees ``ray_<name>`` (and ``_total`` appended to Counters).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "hybrid_ray_bytes_written": (
        "counter", "Bytes of shuffle segments written, per tier (memory, disk, remote), "
        "counting the map attempts whose output was used", ("tier",)),
    "hybrid_ray_segments_written": (
        "counter", "Shuffle segments written, per tier (memory, disk, remote), counting "
        "the map attempts whose output was used", ("tier",)),
    "hybrid_ray_spill_events": (
        "counter", "Segments written to a lower tier than the highest the shuffle "
        "enables, because the higher ones were full", ()),
    "hybrid_ray_tier_switches": (
        "counter", "Times a map's subpartition moved to another tier", ()),
    "hybrid_ray_lost_maps_rerun": (
        "counter", "Finished maps run again because their memory-tier output died with "
        "its writer", ()),
    "hybrid_ray_shuffle_errors": (
        "counter", "Shuffles that failed, by the class name of the error behind the "
        "failure (kind)", ("kind",)),
    "hybrid_ray_shuffles_completed": (
        "counter", "Shuffles that completed, per operation", ("operation",)),
    "hybrid_ray_phase_seconds": (
        "counter", "Seconds of shuffles' phases (startup, map, reduce, waiting, "
        "control_plane; see hybrid_ray.report.PhaseTimes)", ("phase",)),
    "hybrid_ray_shuffle_wall_time_seconds": (
        "histogram", "Wall-clock seconds of completed shuffles, per operation",
        ("operation",)),
}

_lock = threading.Lock()
# The metric objects of the Ray session they were created in (a job id): Ray can be shut
# down and started again in one process (the multi-node tests do), and objects created
# before may not reach the new session's agent.
_objects: dict[str, Any] = {}
_objects_session: str | None = None
_logged_failure = False
# What this process recorded (see snapshot()): an untagged counter's total, a tagged
# one's tag value -> total, and the histogram's operation -> {"count": n, "sum": s}.
_totals: dict[str, Any] = {name: {} if kind == "histogram" or tags else 0
                           for name, (kind, _, tags) in METRICS.items()}


def _failed(what: str, exc: BaseException) -> None:
    """Log a metrics failure once per process (debug: metrics are optional), never raise."""
    global _logged_failure
    if not _logged_failure:
        _logged_failure = True
        _log.debug("hybrid_ray metrics are not exported: %s failed with %s: %s (logged "
                   "once; shuffles go on)", what, type(exc).__name__, exc)


def _session() -> str | None:
    """The id of the Ray job this process is connected as, or None if not connected."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_job_id()


def _metric_objects() -> dict[str, Any]:
    """The metric objects, created lazily for the current Ray session ({} if Ray is not
    connected or creating them raised)."""
    global _objects, _objects_session
    from ray.util import metrics as ray_metrics

    session = _session()
    if session is None:
        return {}
    if _objects_session == session:
        return _objects
    objects: dict[str, Any] = {}
    for name, (kind, description, tags) in METRICS.items():
        if kind == "histogram":
            objects[name] = ray_metrics.Histogram(name, description=description,
                                                  boundaries=WALL_TIME_BUCKETS_S,
                                                  tag_keys=tags)
        else:
            objects[name] = ray_metrics.Counter(name, description=description,
                                                tag_keys=tags)
    _objects, _objects_session = objects, session
    return objects


def _count(name: str, value: float, tag: str | None = None) -> list[tuple[str, float,
                                                                          dict[str, str]]]:
    """Add ``value`` to the totals of counter ``name`` (under ``tag``, for a tagged one);
    returns the backend call to make: none for 0 (Ray's Counter refuses increments <= 0,
    and an absent series reads as 0 in Prometheus)."""
    if value <= 0:
        return []
    tags: dict[str, str] = {}
    if tag is None:
        _totals[name] += value
    else:
        key = METRICS[name][2][0]
        tags = {key: tag}
        _totals[name][tag] = _totals[name].get(tag, 0) + value
    return [(name, value, tags)]


def _send(calls: list[tuple[str, float, dict[str, str]]]) -> None:
    """Hand the recorded values to Ray's metrics; failures are logged once, not raised."""
    try:
        objects = _metric_objects()
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a shuffle
        _failed("creating the metrics", exc)
        return
    for name, value, tags in calls:
        metric = objects.get(name)
        if metric is None:
            continue
        try:
            if METRICS[name][0] == "histogram":
                metric.observe(value, tags=tags)
            else:
                metric.inc(value, tags=tags)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a shuffle
            _failed(f"recording {name}", exc)


# The ``operation`` label's values: the operations hybrid_ray and spark_bridge run. Any other
# name a caller gives ``run_shuffle`` is counted as "custom" (it stays in the report): a
# label taken as given made a series per name, and a name per job or per request grew
# Prometheus' series without bound (the histogram 15 of them per name).
OPERATION_LABELS = frozenset({"repartition", "sort", "random_shuffle", "custom",
                              "spark_repartition"})


def operation_label(operation: Any) -> str:
    """The ``operation`` label a shuffle named ``operation`` is counted under."""
    return operation if operation in OPERATION_LABELS else "custom"


def record_shuffle(report: ShuffleReport) -> None:
    """Record a completed shuffle from its report: bytes and segments per tier (of the
    attempts that counted), spill events, tier switches, lost maps re-run, phase seconds,
    one completion and its wall time. Never raises."""
    try:
        with _lock:
            calls = []
            for tier, nbytes in report.bytes_per_tier().items():
                calls += _count("hybrid_ray_bytes_written", nbytes, tier)
            for tier, count in report.segments_per_tier().items():
                calls += _count("hybrid_ray_segments_written", count, tier)
            calls += _count("hybrid_ray_spill_events", report.spill_events)
            calls += _count("hybrid_ray_tier_switches", report.tier_switches)
            calls += _count("hybrid_ray_lost_maps_rerun", report.lost_maps_rerun)
            if report.phases is not None:
                for phase, seconds in dataclasses.asdict(report.phases).items():
                    calls += _count("hybrid_ray_phase_seconds", seconds, phase)
            label = operation_label(report.operation)
            calls += _count("hybrid_ray_shuffles_completed", 1, label)
            wall = _totals["hybrid_ray_shuffle_wall_time_seconds"].setdefault(
                label, {"count": 0, "sum": 0.0})
            wall["count"] += 1
            wall["sum"] += report.wall_time_s
            calls.append(("hybrid_ray_shuffle_wall_time_seconds", report.wall_time_s,
                          {"operation": label}))
            _send(calls)
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a shuffle
        _failed("recording a shuffle", exc)


def record_error(kind: str) -> None:
    """Record a failed shuffle; ``kind`` is the class name of the error behind it.
    Never raises."""
    try:
        with _lock:
            _send(_count("hybrid_ray_shuffle_errors", 1, kind))
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a shuffle
        _failed("recording a shuffle error", exc)


def snapshot() -> dict[str, Any]:
    """A copy of everything this process recorded since it started, by metric name.

    Counters without tags are numbers; tagged ones are dicts tag value -> total (e.g.
    ``snapshot()["hybrid_ray_bytes_written"]["disk"]``); the wall-time histogram is
    operation -> ``{"count": n, "sum": seconds}``. The totals are kept whether or not
    Ray's metrics backend accepted the values, so they equal the sums of the reports of
    the shuffles this process ran (and the differences of two snapshots, those of the
    shuffles run between them).
    """
    with _lock:
        return copy.deepcopy(_totals)
