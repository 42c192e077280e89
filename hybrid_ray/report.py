"""The report every shuffle produces, and a small progress bar for long shuffles."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from hybrid_ray.config import TierName

_Call = TypeVar("_Call", bound=Callable[..., Any])


def forgets_last_report(forget: Callable[[], None]) -> Callable[[_Call], _Call]:
    """A decorator that calls ``forget`` (which makes a ``last_report()`` None) as the
    decorated call starts: a call that is refused, or fails, is the caller's most recent
    one, and kept returning the report of the one before it."""
    def decorate(fn: _Call) -> _Call:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            forget()
            return fn(*args, **kwargs)
        return cast(_Call, call)
    return decorate


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Where a shuffle's time went, in seconds.

    ``startup``, ``map`` and ``reduce`` are spans of the timeline, measured on the driver
    with ``time.perf_counter`` (one clock, so they compare with each other and with
    ``ShuffleReport.wall_time_s``, which starts at the same instant):

    - ``startup``: from the start of the shuffle's work (looking up, or starting, the
      actors) until the first map is dispatched: planning the maps and registering the
      shuffle with the master. A first shuffle's actor processes start here and in ``map``
      (the master answers the registration, the writers their first map, once started).
    - ``map``: first map dispatched to the last map seen finished by the driver (a lost
      map run again extends it).
    - ``reduce``: first reducer submitted to the last reducer seen finished. In hybrid
      mode reducers start with the maps, so ``map`` and ``reduce`` overlap; in blocking
      mode reducers start once every map finished, so ``map + reduce <= wall_time_s``.

    The other two are totals over processes, not spans, so they may exceed the wall time:

    - ``waiting``: seconds reducers slept because no new segment was committed yet (the
      pauses between their polls of the master, and waits for the new attempt of a lost
      map), **summed over all reducers**. 0 is normal in blocking mode: every segment is
      there when the reducers start.
    - ``control_plane``: seconds spent in bookkeeping calls to the shuffle master and the
      tier managers, summed over the driver (registration, polling for lost maps,
      heartbeats, freeing partitions, summary, release), the writers of the map attempts
      that counted (starting the attempt, registering with the node's tier manager, space
      reservations, commits) and the reducers (polls, loss reports). Data transfer is
      not counted.
    """

    startup: float = 0.0
    map: float = 0.0
    reduce: float = 0.0
    waiting: float = 0.0
    control_plane: float = 0.0

    def line(self) -> str:
        """The phases on one line, as ``ShuffleReport.table`` shows them."""
        return (f"phases: startup {self.startup:.2f} s  map {self.map:.2f} s  "
                f"reduce {self.reduce:.2f} s  waiting {self.waiting:.2f} s (sum over "
                f"reducers)  control plane {self.control_plane:.2f} s (sum over processes)")


@dataclasses.dataclass
class ReduceTimes:
    """What one reducer measured of itself (see ``PhaseTimes.waiting`` and
    ``PhaseTimes.control_plane``); the driver sums them over reducers."""

    waiting: float = 0.0
    control_plane: float = 0.0


class Stopwatch:
    """Sums the seconds spent inside ``with stopwatch:`` blocks (not reentrant).

    Cheap enough to wrap every control-plane call: two ``perf_counter`` reads each.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start


@dataclasses.dataclass
class ShuffleReport:
    """What a shuffle did: where its bytes went, how it switched tiers, how fast it ran.

    ``per_node_tier`` maps node id -> tier -> (bytes, segments) of the segments that counted
    (the winning attempt of every map). ``hybrid_overlap`` is True when a reducer received a
    segment before the last mapper finished.
    """

    shuffle_id: str
    operation: str
    mode: str
    spilling: str
    num_maps: int
    num_partitions: int
    rows: int
    input_bytes: int
    wall_time_s: float
    per_node_tier: dict[str, dict[str, tuple[int, int]]]
    tier_switches: int
    spill_events: int
    superseded_attempts: int
    hybrid_overlap: bool
    # Segments written uncompressed because compression was not shrinking them.
    uncompressed_segments: int = 0
    # Finished maps run again because their memory-tier output died with its writer.
    lost_maps_rerun: int = 0
    # Where the maps read their rows, if not from Ray objects: "spark executors" (rows
    # handed over by Spark's Python workers) or "parquet files" (read by the writers).
    map_input: str = ""
    # Where the time went (see PhaseTimes); None where it was not measured (the reports
    # of the Spark bridge, whose maps run in Spark's tasks).
    phases: PhaseTimes | None = None
    # How the shuffle ran other than its config asked (e.g. a Spark shuffle without the
    # remote tier its session configured, because the master no longer knew the session).
    notes: tuple[str, ...] = ()
    # The shuffle's output is complete, but its master died with its books as it ended
    # (``lifecycle.report_without_books``): only what the driver measured is known, and
    # the master's counts above (per_node_tier, tier switches, spill events, retried
    # attempts, uncompressed segments, overlap) read empty or 0 for "not known".
    books_lost: bool = False

    @property
    def throughput_mb_s(self) -> float:
        return self.input_bytes / 1e6 / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def _sum_per_tier(self, field: int) -> dict[str, int]:
        out = {t.value: 0 for t in TierName}
        for tiers in self.per_node_tier.values():
            for tier, pair in tiers.items():
                out[tier] += pair[field]
        return out

    def bytes_per_tier(self) -> dict[str, int]:
        return self._sum_per_tier(0)

    def segments_per_tier(self) -> dict[str, int]:
        return self._sum_per_tier(1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["throughput_mb_s"] = self.throughput_mb_s
        return d

    def table(self) -> str:
        """The report as a printable table."""
        lines = [
            f"shuffle {self.shuffle_id} ({self.operation}, mode={self.mode}, "
            f"spilling={self.spilling}): {self.num_maps} maps -> {self.num_partitions} partitions"
            + (f", maps read {self.map_input}" if self.map_input else ""),
            # A Spark exchange's rows, input and wall time are Spark's (they read 0 here:
            # spark_bridge.hybrid_shuffle._report); printed as 0 they read as facts.
            "  rows, input and wall time: in Spark's UI (not known to hybrid_ray)"
            if self.operation == "spark exchange" else
            f"  rows {self.rows:,}  input not measured (run_shuffle of blocks)  "
            f"wall {self.wall_time_s:.2f} s"
            # run_shuffle is given block refs, not their sizes (the Dataset API fills them
            # in): "input 0.0 MB, throughput 0.0 MB/s" read as facts.
            if self.input_bytes == 0 and self.rows > 0 else
            f"  rows {self.rows:,}  input {self.input_bytes / 1e6:,.1f} MB  "
            f"wall {self.wall_time_s:.2f} s  throughput {self.throughput_mb_s:,.1f} MB/s",
            # Printed as 0, the counts of books that went with the master read as facts.
            "  tier switches, spill events, retried map attempts, overlap, uncompressed "
            "segments and bytes per tier: not known (the shuffle master's books were lost)"
            if self.books_lost else
            f"  tier switches {self.tier_switches}  spill events {self.spill_events}  "
            f"retried map attempts {self.superseded_attempts} (lost and re-run "
            f"{self.lost_maps_rerun})  "
            f"reducers overlapped mappers: {'yes' if self.hybrid_overlap else 'no'}  "
            f"uncompressed (compression not paying) segments {self.uncompressed_segments}",
        ]
        lines.extend(f"  note: {note}" for note in self.notes)
        if self.phases is not None:
            lines.append("  " + self.phases.line())
        if self.books_lost:
            return "\n".join(lines)
        lines.append(f"  {'node':<16} {'tier':<8} {'segments':>9} {'MB':>10}")
        for node, tiers in sorted(self.per_node_tier.items()):
            for tier in TierName:
                if tier.value in tiers:
                    nbytes, count = tiers[tier.value]
                    lines.append(f"  {node[:16]:<16} {tier.value:<8} {count:>9} "
                                 f"{nbytes / 1e6:>10.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every ``interval`` seconds."""

    def __init__(self, title: str, enabled: bool, interval: float = 0.5) -> None:
        self.title = title
        self.enabled = enabled
        # On a terminal the line is redrawn in place; in a log, a line every few seconds.
        self.tty = sys.stderr.isatty()
        self.interval = interval if self.tty else 5.0
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, maps_done: int, maps: int, reduces_done: int, reduces: int,
               force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        total = maps + reduces
        done = maps_done + reduces_done
        width = 30
        filled = int(width * done / total) if total else width
        bar = "#" * filled + "-" * (width - filled)
        line = (f"{self.title} [{bar}] map {maps_done}/{maps} "
                f"reduce {reduces_done}/{reduces} {now - self._start:5.1f}s")
        sys.stderr.write("\r" + line if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
