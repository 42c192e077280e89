"""When, within a warm hybrid_ray repartition, the machine's cores sit idle, and what ran
beside them: the scheduler's own record, not sampled shares.

``cpu_by_process`` says how much of a round the cores were idle (the lifecycle issue's
goal: at most 5%); this says *when*. It records every context switch and wakeup on every
core with ``perf record -e sched:sched_switch -e sched:sched_wakeup`` (clock: CLOCK_MONOTONIC, the one
``time.monotonic`` reads, so the rounds' start and end line up with the events) around
``--rounds`` warm repartitions (memory budget half the data, the rest on disk, as in
``cpu_by_process``), and prints for each round:

- the cores' idle time, and how much of it passed while some thread had been woken (or
  preempted) within ``WAITING_FRESH_S`` and waited for a busy core: idle the scheduler's
  placement left, not a lack of work; and how many wakeups while a core idled the
  scheduler queued on a busy core rather than on the idle one,
- the CPU seconds of each role (writers and readers are both ``ShuffleWorkerActor``;
  threads that ended within the round are shown by their thread name),
- per ``--bucket-ms`` slice the idle share in tenths of the cores (``0``: busy, ``9``:
  all idle), with ``|`` where the map phase ended,
- the longest idle stretches on one core and what ran on the others meanwhile.

    python -m benchmarks.idle_timeline --size 1 --rounds 3

Found with it on 2026-11-27 (1 GiB, 2 cores, warm rounds of 1.2-1.9 s, 0.21-0.32
core-s idle each): the idle is not a tail after the last reducer (the release's unlinks
end within a few ms). It is 2-6 ms gaps on one core spread over the round while one
worker runs on the other, and in some rounds the last map running alone for up to a map's
time (40-60 ms). In five rounds 0.12-0.21 core-s of it (59-70%) passed while a thread
woken or preempted within the last 5 ms was queued on the busy core, and while a core
idled the scheduler queued more wakeups on the busy core than on the idle one (617-916
against 551-753): this VM's guest kernel (booted with ``sched_vcpu_pack=15`` and the
haltpoll cpuidle driver) leaves a core idle beside runnable work, which no change in
hybrid_ray can use. Splitting the tail maps finer (``TAIL_PIECES`` 4) removed the lone
map and spread about the same idle over the reduce phase.

Needs Linux ``perf`` with permission to trace every core (root, or
``kernel.perf_event_paranoid`` at most 0): it says so and exits otherwise.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

# One sched_switch or sched_wakeup line of ``perf script -F tid,cpu,time,event,trace``
# (the event's name and the tid before the core are optional).
_SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+(?:sched:sched_switch:\s+)?prev_comm=(.*?) "
                     r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) "
                     r"next_pid=(\d+)")
_WAKEUP = re.compile(r"\[(\d+)\]\s+([\d.]+):\s+(?:sched:sched_wakeup:\s+)?comm=(.*?) "
                     r"pid=(\d+) prio=\d+ target_cpu=(\d+)")
# A thread woken this recently and not running yet counts as waiting for a core (older
# wakeups whose switch-in perf did not record must not count for ever).
WAITING_FRESH_S = 0.005
# Roles by a process's command line (first match wins), as in cpu_by_process.
ROLE_MARKS = ("ShuffleWorkerActor", "ShuffleMasterActor", "TierManagerActor", "raylet",
              "gcs_server", "DashboardAgent")
IDLE = "idle"
PERF_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Run:
    """Thread ``tid`` (0: the core was idle) on core ``cpu`` from ``start`` to ``end``
    (seconds, CLOCK_MONOTONIC)."""

    start: float
    end: float
    cpu: int
    tid: int
    comm: str


@dataclasses.dataclass(frozen=True)
class Switch:
    """Core ``cpu`` switched at ``time`` from ``prev_tid`` (still runnable: it was
    preempted, not asleep) to ``next_tid`` (0: idle)."""

    time: float
    cpu: int
    prev_tid: int
    prev_runnable: bool
    next_tid: int
    next_comm: str


@dataclasses.dataclass(frozen=True)
class Wakeup:
    """Thread ``tid`` became runnable at ``time``, queued on core ``target_cpu``."""

    time: float
    tid: int
    target_cpu: int


def parse_events(text: str) -> list[Switch | Wakeup]:
    """The sched_switch and sched_wakeup events of ``perf script`` output, in time order."""
    out: list[Switch | Wakeup] = []
    for line in text.splitlines():
        m = _SWITCH.search(line)
        if m:
            out.append(Switch(float(m[2]), int(m[1]), int(m[4]), m[5].startswith("R"),
                              int(m[7]), m[6]))
            continue
        m = _WAKEUP.search(line)
        if m:
            out.append(Wakeup(float(m[2]), int(m[4]), int(m[5])))
    # Stable: events with equal times keep perf's order (it prints them in time order).
    return sorted(out, key=lambda e: e.time)


def _waiting_overlap(since: Sequence[float], a: float, b: float, idle_cores: int,
                     fresh_s: float) -> float:
    """Core-seconds within [a, b] that ``idle_cores`` idle cores could have spent on
    threads waiting since the times ``since``, each counted for ``fresh_s`` after it."""
    cuts = sorted({a, b} | {t + fresh_s for t in since if a < t + fresh_s < b})
    total = 0.0
    for p, q in zip(cuts, cuts[1:]):
        fresh = sum(1 for t in since if t <= p and t + fresh_s >= q)
        total += min(idle_cores, fresh) * (q - p)
    return total


def idle_while_waiting(events: Sequence[Switch | Wakeup], start: float, end: float,
                       fresh_s: float = WAITING_FRESH_S) -> tuple[float, float, int, int]:
    """(idle core-seconds, those of them while some thread was queued on a busy core,
    wakeups while a core idled queued on a busy core, wakeups queued on an idle one)
    between ``start`` and ``end``.

    A thread waits from its wakeup (on its target core) or its preemption (on the core it
    ran on) until it runs or sleeps, counted for at most ``fresh_s``. Idle while threads
    wait behind a busy core is the scheduler's placement, not a lack of work: each idle
    core could have run one of them. (A thread queued on the idle core itself is not
    counted: that wait is the idle core's wake-up latency.)"""
    on_cpu: dict[int, int] = {}  # core -> tid running (0: idle)
    waiting: dict[int, tuple[float, int]] = {}  # tid -> (since when, core queued on)
    idle = idle_waiting = 0.0
    to_busy = to_idle = 0

    def account(a: float, b: float) -> float:
        idle_cores = sum(1 for tid in on_cpu.values() if tid == 0)
        if b <= a or not idle_cores:
            return 0.0
        behind_busy = [t for t, cpu in waiting.values() if on_cpu.get(cpu, 0) != 0]
        nonlocal idle_waiting
        idle_waiting += _waiting_overlap(behind_busy, a, b, idle_cores, fresh_s)
        return idle_cores * (b - a)

    last: float | None = None
    for e in events:
        if e.time > end:
            break
        if last is not None and e.time > start:
            idle += account(max(last, start), e.time)
        for tid in [t for t, (since, _) in waiting.items() if e.time - since >= fresh_s]:
            del waiting[tid]
        last = e.time
        if isinstance(e, Wakeup):
            if e.tid != 0 and e.tid not in on_cpu.values():
                waiting.setdefault(e.tid, (e.time, e.target_cpu))
                idle_now = [c for c, tid in on_cpu.items() if tid == 0]
                if idle_now and e.time >= start:
                    if e.target_cpu in idle_now:
                        to_idle += 1
                    else:
                        to_busy += 1
            continue
        if e.prev_tid != 0:
            if e.prev_runnable:
                waiting.setdefault(e.prev_tid, (e.time, e.cpu))
            else:
                waiting.pop(e.prev_tid, None)  # asleep: waits for nothing
        on_cpu[e.cpu] = e.next_tid
        waiting.pop(e.next_tid, None)
    if last is not None and last < end:  # the window's last stretch, up to its end
        idle += account(max(last, start), end)
    return idle, idle_waiting, to_busy, to_idle


def runs_of(events: Iterable[Switch | Wakeup]) -> list[Run]:
    """What ran on each core between consecutive switches (a core's first switch only
    starts its first run: what ran before it is unknown); wakeups are skipped."""
    current: dict[int, tuple[float, int, str]] = {}
    runs = []
    for e in events:
        if not isinstance(e, Switch):
            continue
        if e.cpu in current:
            start, prev_tid, prev_comm = current[e.cpu]
            runs.append(Run(start, e.time, e.cpu, prev_tid, prev_comm))
        current[e.cpu] = (e.time, e.next_tid, e.next_comm)
    return runs


def overlap(run: Run, start: float, end: float) -> float:
    return max(0.0, min(run.end, end) - max(run.start, start))


def cpu_by_role(runs: Sequence[Run], start: float, end: float,
                role_of: Callable[[Run], str]) -> collections.Counter[str]:
    """Seconds of each role (``role_of``; tid 0 is ``IDLE``) between ``start`` and ``end``."""
    out: collections.Counter[str] = collections.Counter()
    for run in runs:
        seconds = overlap(run, start, end)
        if seconds > 0:
            out[IDLE if run.tid == 0 else role_of(run)] += seconds
    return out


def idle_per_bucket(runs: Sequence[Run], start: float, end: float,
                    bucket_s: float) -> list[float]:
    """Idle core-seconds in each ``bucket_s`` slice from ``start`` to ``end``."""
    n = max(1, int((end - start) / bucket_s + 0.999999))
    idle = [0.0] * n
    for run in runs:
        if run.tid != 0 or run.end <= start or run.start >= end:
            continue
        first = max(0, int((run.start - start) / bucket_s))
        for k in range(first, min(n, int((run.end - start) / bucket_s) + 1)):
            idle[k] += overlap(run, start + k * bucket_s, start + (k + 1) * bucket_s)
    return idle


def idle_line(idle: Sequence[float], bucket_s: float, cores: int,
              mark_at: int | None = None) -> str:
    """One digit per bucket: its idle share in tenths of ``cores`` (9 caps it), with ``|``
    before bucket ``mark_at``."""
    # (+1e-9: a slice exactly 30% idle is 2.9999... in floating point)
    digits = [str(min(9, int(10 * x / (cores * bucket_s) + 1e-9))) for x in idle]
    if mark_at is not None and 0 <= mark_at <= len(digits):
        digits.insert(mark_at, "|")
    return "".join(digits)


def idle_stretches(runs: Sequence[Run], start: float, end: float, min_s: float,
                   role_of: Callable[[Run], str]) -> list[tuple[Run, dict[str, float]]]:
    """Idle runs of at least ``min_s`` within the window, longest first, each with the
    seconds each role ran on the other cores meanwhile."""
    window = [r for r in runs if r.end > start and r.start < end]
    out = []
    for run in window:
        if run.tid != 0 or min(run.end, end) - max(run.start, start) < min_s:
            continue
        gap = dataclasses.replace(run, start=max(run.start, start), end=min(run.end, end))
        beside: collections.Counter[str] = collections.Counter()
        for other in window:
            if other.cpu != gap.cpu and other.tid != 0:
                seconds = overlap(other, gap.start, gap.end)
                if seconds > 0:
                    beside[role_of(other)] += seconds
        out.append((gap, dict(beside.most_common())))
    return sorted(out, key=lambda x: x[0].start - x[0].end)


def thread_roles(proc: str = "/proc") -> dict[int, str]:
    """tid -> role (``ROLE_MARKS``, else the command's first 40 characters) of every
    thread alive now."""
    out = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            tids = os.listdir(os.path.join(proc, name, "task"))
        except OSError:
            continue
        role = next((m for m in ROLE_MARKS if m in cmd), cmd[:40] or "kernel")
        for tid in tids:
            out[int(tid)] = role
    return out


class PerfFailed(Exception):
    """perf could not record (no tracefs, events unavailable): its own message."""


def perf_problem() -> str | None:
    """Why ``perf`` cannot trace every core here, with the fix; None if it can."""
    if shutil.which("perf") is None:
        return "perf is not installed: install it (Debian: apt-get install linux-perf)"
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            paranoid = int(f.read())
    except (OSError, ValueError):
        paranoid = 2
    if os.geteuid() != 0 and paranoid > 0:
        return (f"kernel.perf_event_paranoid is {paranoid}: tracing every core needs root "
                "or `sysctl kernel.perf_event_paranoid=0`")
    return None


def _trace_rounds(args: argparse.Namespace, work: str
                  ) -> tuple[str, list[tuple[float, float, float]], dict[int, str]]:
    """Warm a local Ray and hybrid_ray up, then run ``args.rounds`` repartitions under
    ``perf record`` (files in ``work``). Returns perf's text, each round's (start, end,
    map phase end) and the roles of the threads alive after the rounds."""
    import ray

    import hybrid_ray
    from benchmarks.workloads import generate

    size = int(args.size * (1 << 30))
    trace = os.path.join(work, "sched.data")
    try:
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 log_to_driver=False)
        config = hybrid_ray.ShuffleConfig(spill_dirs=[os.path.join(work, "spill")],
                                          progress=False, memory_capacity_bytes=size // 2)
        hybrid_ray.init(config)
        ds = ray.data.from_arrow(generate("gensort", size, 0)).materialize()
        for _ in range(2):  # warm: the actors' first calls are not what is looked at
            warmup = hybrid_ray.repartition(ds, 16, keys=["key"], config=config)
            del warmup
        rounds = []
        with open(os.path.join(work, "perf.log"), "w+") as perf_log:
            perf = subprocess.Popen(["perf", "record", "-q", "-e", "sched:sched_switch",
                                     "-e", "sched:sched_wakeup", "-a",
                                     "-k", "CLOCK_MONOTONIC", "-o", trace],
                                    stdout=subprocess.DEVNULL, stderr=perf_log)
            try:
                time.sleep(1.0)  # perf is tracing by then, or has failed
                if perf.poll() is not None:
                    perf_log.seek(0)
                    raise PerfFailed(f"perf record ended at once (exit {perf.returncode}): "
                                     f"{perf_log.read().strip()[:1000]}")
                for _ in range(args.rounds):
                    start = time.monotonic()
                    out = hybrid_ray.repartition(ds, 16, keys=["key"], config=config)
                    end = time.monotonic()
                    phases = hybrid_ray.last_report().phases
                    rounds.append((start, end, phases.startup + phases.map))
                    del out
                    time.sleep(0.3)
            finally:
                if perf.poll() is None:
                    perf.send_signal(signal.SIGINT)
                    try:
                        perf.wait(timeout=PERF_WAIT_S)
                    except subprocess.TimeoutExpired:
                        perf.kill()
                        perf.wait(timeout=PERF_WAIT_S)
        roles = thread_roles()  # before the session's processes go
    finally:
        ray.shutdown()
    text = subprocess.run(["perf", "script", "--ns", "-i", trace, "-F",
                           "tid,cpu,time,event,trace"],
                          capture_output=True, text=True, check=True, timeout=600).stdout
    return text, rounds, roles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="GiB of data (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="warm rounds traced")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--bucket-ms", type=float, default=25.0)
    p.add_argument("--stretches", type=int, default=8, help="longest idle stretches shown")
    args = p.parse_args(argv)
    if args.size <= 0 or args.rounds < 1 or args.bucket_ms <= 0:
        p.error("--size and --bucket-ms must be > 0 and --rounds >= 1")
    if args.cpus < 1:  # with 0 the warm-up waited for a CPU for ever
        p.error(f"--cpus must be 1 or more, got {args.cpus}")
    problem = perf_problem()
    if problem:
        print(f"idle_timeline: {problem}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="hr-idle-")
    try:  # the work dir goes whatever fails in there (Ray's start, a round, perf)
        traced = _trace_rounds(args, work)
    except PerfFailed as exc:
        print(f"idle_timeline: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text, rounds, roles = traced
    events = parse_events(text)
    runs = runs_of(events)

    def role_of(run: Run) -> str:
        return roles.get(run.tid, f"thread {run.comm}")

    bucket = args.bucket_ms / 1000
    cores = os.cpu_count() or args.cpus  # perf traced every core of the machine
    for i, (start, end, map_end) in enumerate(rounds):
        wall = end - start
        by_role = cpu_by_role(runs, start, end, role_of)
        idle = idle_per_bucket(runs, start, end, bucket)
        print(f"round {i}: {wall:.3f} s, map phase ended at {map_end:.3f} s; idle "
              f"{by_role[IDLE]:.3f} core-s ({by_role[IDLE] / (cores * wall):.1%})")
        _, waiting_s, to_busy, to_idle = idle_while_waiting(events, start, end)
        print(f"  of the idle, {waiting_s:.3f} core-s while a woken or preempted thread was "
              f"queued on a busy core; wakeups while a core idled: {to_busy} placed on a "
              f"busy core, {to_idle} on the idle one")
        for role, seconds in by_role.most_common():
            if role != IDLE and seconds >= 0.005:
                print(f"  {seconds:6.3f} {role}")
        print(f"  idle per {args.bucket_ms:g} ms, tenths of the cores ('|': map end): "
              + idle_line(idle, bucket, cores, int(map_end / bucket)))
        for gap, beside in idle_stretches(runs, start, end, 0.002, role_of)[:args.stretches]:
            print(f"  core {gap.cpu} idle {1000 * (gap.start - start):7.1f}-"
                  f"{1000 * (gap.end - start):7.1f} ms; beside it: " + ", ".join(
                      f"{role} {1000 * s:.1f} ms" for role, s in list(beside.items())[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
