"""Where a warm hybrid_ray repartition's CPU goes, process by process.

Starts a local Ray, ``hybrid_ray.init``, generates ``--size`` of gensort rows and
repartitions them ``--rounds`` times by key (memory budget half the data, the rest on
disk), verifying every output. For the last round it prints each process's CPU seconds
(user + system, from /proc, Linux only) and the round's phase times: the writers, readers,
master, tier manager and raylet side by side, for the control-plane share.

    python -m benchmarks.cpu_by_process --size 1GiB --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="GiB of data (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="processes listed")
    args = p.parse_args(argv)
    if args.size <= 0 or args.rounds < 1:
        p.error("--size must be > 0 and --rounds >= 1")
    import ray

    import hybrid_ray

    size = int(args.size * (1 << 30))
    work = tempfile.mkdtemp(prefix="hr-cpu-")
    try:
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 log_to_driver=False)
        config = hybrid_ray.ShuffleConfig(spill_dirs=[os.path.join(work, "spill")],
                                          progress=False, memory_capacity_bytes=size // 2)
        hybrid_ray.init(config)
        blocks = generate("gensort", size, 0)
        expected = checksum(blocks)
        ds = ray.data.from_arrow(blocks).materialize()
        del blocks
        for r in range(args.rounds):
            before = cpu_snapshot()
            start = time.perf_counter()
            out = hybrid_ray.repartition(ds, 16, keys=["key"], config=config)
            wall = time.perf_counter() - start
            rows = cpu_between(before, cpu_snapshot())
            report = hybrid_ray.last_report()
            if checksum(ray.get(b) for b in out.to_arrow_refs()) != expected:
                print(f"round {r}: output differs from the input", file=sys.stderr)
                return 1
            print(f"round {r}: {wall:.2f} s, {size / 1e6 / wall:.0f} MB/s, "
                  f"tiers {report.bytes_per_tier()}")
            del out
        print(f"last round: {sum(x[0] for x in rows):.2f} CPU-s in {wall:.2f} s on "
              f"{args.cpus} cores; {report.phases}")
        for seconds, pid, cmd in rows[:args.top]:
            print(f"  {seconds:6.2f} {pid:>7} {cmd[:80]}")
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
