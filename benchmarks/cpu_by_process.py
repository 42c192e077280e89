"""Where a warm hybrid_ray repartition's CPU goes, process by process.

Starts a local Ray, ``hybrid_ray.init``, generates ``--size`` of gensort rows and
repartitions them ``--rounds`` times by key (memory budget half the data, the rest on
disk), verifying every output. For the last round it prints each process's CPU seconds
(user + system, from /proc, Linux only) and the round's phase times: the writers, readers,
master, tier manager and raylet side by side. Only this process and its descendants (the
local Ray it started) count: other jobs on a shared machine are left out.

The shares it ends with are those of the lifecycle issue's goal (control plane at most 10%
of the shuffle's CPU, idle at most 5% of the cores' time):

- control plane: the shuffle master, the tier managers and the driver (this process);
- object store: the raylet (plasma: creating, sealing and freeing memory-tier objects);
- data plane: the writer and reader actors;
- idle: the time the machine's cores were idle during the round (``/proc/stat``), and
  beside it the CPU used outside the session (kernel threads such as page-cache
  writeback of the disk tier's files, other jobs on a shared machine). On a machine with
  more cores than ``--cpus``, idle is the cores' time in the round (cores x wall) that no
  process of the session used instead.

    python -m benchmarks.cpu_by_process --size 1 --rounds 5

Each round prints its two shares; the run ends with their median over the warm rounds
(every round but the first), the figure the goal is read from: one round on a shared,
noisy machine moves by a few points.

Every round's time and map/reduce phases are printed too, so the first call (round 0,
the first shuffle after ``hybrid_ray.init``) reads against the warm ones; with
``--preallocate-plasma`` Ray starts with its object store pre-faulted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.workloads import checksum, generate

# Ticks per second of /proc/<pid>/stat's utime and stime.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_snapshot(proc: str = "/proc") -> dict[int, tuple[float, str]]:
    """pid -> (CPU seconds so far, command line) of every process readable now."""
    out: dict[int, tuple[float, str]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / _TICKS, cmd)
    return out


def cpu_between(before: dict[int, tuple[float, str]],
                after: dict[int, tuple[float, str]]) -> list[tuple[float, int, str]]:
    """(CPU seconds, pid, command) of every process that used CPU between two snapshots,
    most first (a process started in between counts from zero)."""
    rows = [(t - before.get(pid, (0.0, ""))[0], pid, cmd) for pid, (t, cmd) in after.items()]
    return sorted((r for r in rows if r[0] > 0), reverse=True)


def with_own_cpu(rows: list[tuple[float, int, str]], pid: int,
                 seconds: float) -> list[tuple[float, int, str]]:
    """``rows`` with process ``pid``'s CPU replaced by ``seconds``: the driver's CPU in the
    round itself (``time.process_time`` around the shuffle), without the /proc scans that
    measure it, which ran in the driver and were counted as control plane (about 12 ms a
    round here with ~100 processes, more on a busy machine)."""
    out = [(seconds, p, cmd) if p == pid else (t, p, cmd) for t, p, cmd in rows]
    return sorted(out, reverse=True)


def machine_cpu(proc: str = "/proc") -> tuple[float, float]:
    """(all CPU seconds so far, idle CPU seconds so far) of the machine's cores, from the
    aggregate line of /proc/stat (idle counts idle and iowait)."""
    with open(os.path.join(proc, "stat")) as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]) / _TICKS, (fields[3] + fields[4]) / _TICKS


def process_tree(root: int, proc: str = "/proc") -> set[int]:
    """``root`` and every process descending from it (by the parent pid in /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


# Command-line markers of each role (first match wins); anything else is "other" (GCS,
# dashboard and runtime-env agents).
ROLES = (("control plane", ("ShuffleMasterActor", "TierManagerActor")),
         ("data plane", ("ShuffleWorkerActor",)),
         ("object store", ("raylet",)))


def cpu_shares(rows: list[tuple[float, int, str]], driver_pid: int, cpus: int,
               wall: float) -> dict[str, float]:
    """CPU seconds per role (see ``ROLES``; the driver is control plane), their total, and
    the idle core time (``cpus * wall`` minus the total, at least 0)."""
    out = {"control plane": 0.0, "data plane": 0.0, "object store": 0.0, "other": 0.0}
    for seconds, pid, cmd in rows:
        role = "control plane" if pid == driver_pid else next(
            (name for name, marks in ROLES if any(m in cmd for m in marks)), "other")
        out[role] += seconds
    out["total"] = sum(out.values())
    out["idle"] = max(0.0, cpus * wall - out["total"])
    return out


def round_shares(rows: list[tuple[float, int, str]], driver_pid: int, cpus: int,
                 wall: float, machine: tuple[tuple[float, float], tuple[float, float]]
                 ) -> dict[str, Any]:
    """``cpu_shares`` of one round plus the goal's two ratios: ``control plane share`` (of
    the session's CPU) and ``idle share`` (of the cores' time). On a machine with exactly
    ``cpus`` cores idle is the machine's (``machine``: ``machine_cpu`` before and after),
    and ``idle note`` says how much CPU was used outside the session meanwhile."""
    shares: dict[str, Any] = cpu_shares(rows, driver_pid, cpus, wall)
    shares["idle note"] = f"{cpus} cores x {wall:.2f} s"
    wall_cores = cpus * wall
    if os.cpu_count() == cpus:  # the machine's idle time is the session's
        (all_before, idle_before), (all_after, idle_after) = machine
        machine_total = all_after - all_before
        shares["idle"] = idle_after - idle_before
        outside = max(0.0, machine_total - shares["idle"] - shares["total"])
        shares["idle note"] = (f"the machine's {cpus} cores, /proc/stat; {outside:.2f} "
                               "CPU-s used outside the session: kernel threads, other jobs")
        wall_cores = machine_total or 1.0
    shares["control plane share"] = shares["control plane"] / (shares["total"] or 1.0)
    shares["idle share"] = shares["idle"] / (wall_cores or 1.0)
    return shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="GiB of data (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="processes listed")
    p.add_argument("--object-store-gib", type=float, default=0.0,
                   help="Ray's object store size (default: Ray's own choice)")
    p.add_argument("--preallocate-plasma", action="store_true",
                   help="start Ray with its object store pre-faulted "
                        "(preallocate_plasma_memory): a first call without fresh pages")
    args = p.parse_args(argv)
    if args.size <= 0 or args.rounds < 1:
        p.error("--size must be > 0 and --rounds >= 1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    if not 1 <= args.cpus <= cores:
        # With 0 the round waited for a CPU for ever; above the cores, the idle share
        # counted cores that are not there as idle.
        p.error(f"--cpus must be from 1 to the {cores} cores this process may run on, "
                f"got {args.cpus}")
    if args.object_store_gib < 0:
        p.error(f"--object-store-gib must be 0 (Ray's choice) or more, got "
                f"{args.object_store_gib}")
    import ray

    import hybrid_ray

    size = int(args.size * (1 << 30))
    work = tempfile.mkdtemp(prefix="hr-cpu-")
    try:
        started = time.perf_counter()
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 log_to_driver=False,
                 object_store_memory=int(args.object_store_gib * (1 << 30)) or None,
                 _system_config={"preallocate_plasma_memory": True}
                 if args.preallocate_plasma else None)
        print(f"ray.init {time.perf_counter() - started:.2f} s")
        config = hybrid_ray.ShuffleConfig(spill_dirs=[os.path.join(work, "spill")],
                                          progress=False, memory_capacity_bytes=size // 2)
        hybrid_ray.init(config)
        blocks = generate("gensort", size, 0)
        expected = checksum(blocks)
        ds = ray.data.from_arrow(blocks).materialize()
        del blocks
        warm: list[dict[str, Any]] = []  # the goal's shares of every warm round
        for r in range(args.rounds):
            before, machine_before = cpu_snapshot(), machine_cpu()
            own_before, start = time.process_time(), time.perf_counter()
            out = hybrid_ray.repartition(ds, 16, keys=["key"], config=config)
            wall, own = time.perf_counter() - start, time.process_time() - own_before
            machine_after = machine_cpu()
            tree = process_tree(os.getpid())
            rows = with_own_cpu([r for r in cpu_between(before, cpu_snapshot())
                                 if r[1] in tree], os.getpid(), own)
            report = hybrid_ray.last_report()
            if checksum(ray.get(b) for b in out.to_arrow_refs()) != expected:
                print(f"round {r}: output differs from the input", file=sys.stderr)
                return 1
            phases = report.phases
            shares = round_shares(rows, os.getpid(), args.cpus, wall,
                                  (machine_before, machine_after))
            if r > 0:
                warm.append(shares)
            print(f"round {r}: {wall:.2f} s, {size / 1e6 / wall:.0f} MB/s, "
                  f"tiers {report.bytes_per_tier()}; map {phases.map:.2f} s, "
                  f"reduce {phases.reduce:.2f} s; control plane "
                  f"{shares['control plane share']:.1%} of its CPU, idle "
                  f"{shares['idle share']:.1%} of the cores")
            del out
        print(f"last round: {sum(x[0] for x in rows):.2f} CPU-s in {wall:.2f} s on "
              f"{args.cpus} cores; {report.phases}")
        for seconds, pid, cmd in rows[:args.top]:
            print(f"  {seconds:6.2f} {pid:>7} {cmd[:80]}")
        total = shares["total"] or 1.0
        print("shares of the round's CPU: " + ", ".join(
            f"{role} {shares[role]:.2f} CPU-s ({shares[role] / total:.0%})"
            for role in ("data plane", "control plane", "object store", "other"))
              + f"; idle {shares['idle']:.2f} core-s "
              f"({shares['idle share']:.0%} of {shares['idle note']})")
        if warm:
            print(f"median of the {len(warm)} warm rounds: control plane "
                  f"{statistics.median(w['control plane share'] for w in warm):.1%} of the "
                  f"CPU (goal at most 10%), idle "
                  f"{statistics.median(w['idle share'] for w in warm):.1%} of the cores "
                  "(goal at most 5%)")
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
