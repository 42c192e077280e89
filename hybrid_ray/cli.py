"""``hybrid-ray``: the demo job, cluster status and orphan cleanup.

The benchmark suite is not part of the library: it lives in the source checkout
(``benchmarks/``) and runs as ``./dev bench`` or ``python -m benchmarks`` from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any


def _parse_timeout(text: str) -> float:
    """A duration above 0 (a 0 s timeout made every connection attempt fail at once, and
    the user was told no cluster was reachable)."""
    from hybrid_ray.config import MAX_DURATION_S

    value = _parse_duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: it must be above 0, "
                                         "e.g. 30s")
    if value > MAX_DURATION_S:
        # Python's waits refuse more (socket timeouts and Event.wait raised OverflowError
        # with a traceback after the connection was made).
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: it must be at most "
                                         f"{MAX_DURATION_S:g} s")
    return value


def _parse_namespace(text: str) -> str:
    """A Ray namespace a shuffle master can live in (``ShuffleConfig`` refuses any other,
    ``hybrid_ray.ids``): asked about one that cannot hold a master, a typo ("hybrid ray")
    or a shell-mangled value, ``status`` answered "no shuffle has run on this cluster
    yet" with exit code 0, as if the cluster were idle."""
    from hybrid_ray.errors import InvalidIdError
    from hybrid_ray.ids import check_id

    try:
        return check_id("namespace", text)
    except InvalidIdError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; give the namespace of the ShuffleConfig "
                                         "the shuffles ran with (default hybrid_ray)"
                                         ) from None


def _parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            value = float(text[:-1]) * units[text[-1]]
        else:
            value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):  # NaN, negative, infinite
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use seconds or a number with s/m/h/d, e.g. 6h")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    """Shuffle generated rows through all three tiers on a local Ray and verify them."""
    import numpy as np
    import pyarrow as pa
    import ray

    import hybrid_ray
    from hybrid_ray import MiB, ShuffleConfig

    workdir = tempfile.mkdtemp(prefix="hybrid_ray_demo_")
    spill, remote = os.path.join(workdir, "spill"), os.path.join(workdir, "remote")
    try:
        rng = np.random.default_rng(args.seed)
        table = pa.table({"key": rng.integers(0, 1 << 40, args.rows),
                          "payload": rng.integers(0, 1 << 62, (args.rows,)),
                          "value": rng.random(args.rows)})
        data_bytes = table.nbytes
        # A memory budget and disk cap of a quarter of the data each: segments land in all
        # three tiers, as they would on a small node with a big job.
        config = ShuffleConfig(memory_capacity_bytes=data_bytes // 4, spill_dirs=[spill],
                               disk_capacity_bytes=data_bytes // 4,
                               remote_path=f"file://{remote}", compression="lz4",
                               segment_bytes={"memory": MiB, "disk": 2 * MiB,
                                              "remote": 4 * MiB})
        # Always a Ray of its own ("local"): the demo is self-contained, and without it
        # ray.init() would join any cluster `ray start` left on this machine (or
        # RAY_ADDRESS) and fail there, as num_cpus cannot be given to an existing one.
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
        ds = ray.data.from_arrow(table).repartition(args.blocks).materialize()
        print(f"hybrid_ray demo: {args.rows:,} rows ({data_bytes / 1e6:.1f} MB) in "
              f"{args.blocks} blocks -> {args.partitions} partitions by 'key'")
        print(f"  memory tier budget {config.memory_capacity_bytes / 1e6:.1f} MB, disk tier "
              f"{spill} capped at {config.disk_capacity_bytes / 1e6:.1f} MB, remote tier "
              f"{config.remote_path}")
        started = time.monotonic()
        out = hybrid_ray.repartition(ds, args.partitions, keys=["key"], config=config)
        parts = ray.get(out.to_arrow_refs())
        elapsed = time.monotonic() - started
        report = hybrid_ray.last_report()
        print(report.table())
        result = pa.concat_tables(parts)
        ok = _same_rows(result, table)
        # Each key lives in exactly one partition: per-partition distinct keys add up.
        distinct = [np.unique(p["key"].to_numpy()) for p in parts if p.num_rows]
        if distinct and sum(len(d) for d in distinct) != len(np.unique(np.concatenate(distinct))):
            ok = False
        leftovers = [os.path.join(r, f) for d in (spill, remote)
                     for r, _, fs in os.walk(d) for f in fs]
        print(f"rows in {table.num_rows:,} out {result.num_rows:,}; multiset identical: {ok}")
        print(f"end-to-end {elapsed:.2f} s, {data_bytes / 1e6 / elapsed:.1f} MB/s; "
              f"files left in spill and remote dirs: {len(leftovers)}")
        return 0 if ok and not leftovers else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _same_rows(a: Any, b: Any) -> bool:
    import pandas as pd

    def fingerprint(t):
        h = pd.util.hash_pandas_object(t.to_pandas(), index=False).to_numpy()
        return t.num_rows, int(h.sum(dtype="uint64"))

    return fingerprint(a) == fingerprint(b)


# Bound on reaching a cluster and on each call to its shuffle master (--timeout).
DEFAULT_TIMEOUT_S = 15.0


class CliError(Exception):
    """A failure the command reports in one message and a nonzero exit code.

    ``abandon``: something of Ray's did not answer in time (a connection, the GCS, an
    actor). Ray's exit hook (``ray.shutdown``) would wait for it as long as it stays
    silent, so ``main`` leaves the process at once once the message is out."""

    def __init__(self, message: str, code: int = 1, abandon: bool | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.abandon = code == 3 if abandon is None else abandon


def _connect(address: str | None, timeout_s: float) -> None:
    """Connect to a running Ray cluster within ``timeout_s`` or raise ``CliError``.

    ``ray.init`` alone retried a dead address for minutes: the GCS port is probed first
    (refused or silent: fail now), then ``ray.init`` runs under the same bound.
    """
    from hybrid_ray.redaction import Redactor

    try:
        _connect_unscrubbed(address, timeout_s)
    except CliError as exc:
        # Every message names the address: credentials in it (a user or token in a
        # ray:// or http:// URL, from --address or RAY_ADDRESS, which Ray resolves for
        # "auto", given or not) are never shown. (Scrubbed for the given address alone,
        # `--address auto` printed RAY_ADDRESS's password: found by a review.)
        message = str(exc)
        for url in (address, os.environ.get("RAY_ADDRESS")):
            message = Redactor(url).scrub(message)
        raise CliError(message, exc.code, abandon=exc.abandon) from None


def _connect_unscrubbed(address: str | None, timeout_s: float) -> None:
    """``_connect``'s work; its caller scrubs the messages."""
    import socket

    import ray
    from ray._private.services import canonicalize_bootstrap_address_or_die

    from hybrid_ray.cleanup import CallTimedOut, within
    from hybrid_ray.redaction import redact_url

    shown = redact_url(address) if address else "auto"
    advice = ("Start one with `ray start --head` or `ray up cluster.yaml`, or pass "
              "--address HOST:PORT of its head (the GCS port, 6379 by default)")
    if address and address.startswith("ray://"):
        target = address
        # host:port after any user part, before any query
        hostport = address.removeprefix("ray://").rsplit("@", 1)[-1].split("?", 1)[0]
        host, port = _host_and_port(hostport)
    else:
        try:
            target = canonicalize_bootstrap_address_or_die(address or "auto")
        except (ConnectionError, ValueError) as exc:
            raise CliError(f"hybrid-ray: no Ray cluster reachable at {shown}: {exc}. {advice}.",
                           2) from None
        host, port = _host_and_port(target)

    def probe() -> None:
        socket.create_connection((host, int(port or 10001)), timeout=timeout_s).close()

    try:
        # Within the bound as a whole: the connection's timeout does not cover the lookup
        # of the host name before it, and a DNS server that does not answer held
        # `status --timeout 3s` for 12 s (glibc's 2 x 5 s; minutes with other settings).
        within(timeout_s, f"the lookup of {host} and a connection to it", probe)
    except CallTimedOut:
        raise CliError(f"hybrid-ray: no Ray cluster reachable at {shown} ({target}): its "
                       "host name did not resolve, or the connection did not complete, "
                       f"within {timeout_s:.0f} s (--timeout). Check the name and this "
                       f"machine's DNS. {advice}.", 2) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"hybrid-ray: no Ray cluster reachable at {shown} ({target}): "
                       f"{exc}. {advice}.", 2) from None
    try:
        within(timeout_s, f"the Ray cluster at {shown}", lambda: ray.init(
            address=target, include_dashboard=False, log_to_driver=False,
            configure_logging=False))
    except CallTimedOut:
        raise CliError(f"hybrid-ray: the Ray cluster at {shown} ({target}) accepted a "
                       f"connection but did not complete the handshake within {timeout_s:.0f} s "
                       "(--timeout). Is that port a Ray head's GCS port?", 3) from None
    except BaseException as exc:  # ray.init's own failure, whatever its type
        raise CliError(f"hybrid-ray: cannot connect to the Ray cluster at {shown} ({target}): "
                       f"{type(exc).__name__}: {exc}. {advice}.", 2) from None


def _host_and_port(hostport: str) -> tuple[str, str]:
    """``host:port`` split, an IPv6 host in brackets (``[::1]:10001``) without them: its
    colons split by the first (or last) one gave host ``[`` and port ``:1]:10001``."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host, rest.removeprefix(":")
    if ":" not in hostport:
        return hostport, ""
    host, _, port = hostport.rpartition(":")
    return host, port


def _get(ref: Any, what: str, timeout_s: float) -> Any:
    """``ray.get`` bounded by ``timeout_s``; a silent actor becomes a ``CliError``."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CliError(f"hybrid-ray: {what} did not answer within {timeout_s:.0f} s "
                       "(--timeout); the cluster may be overloaded or the actor hung", 1,
                       abandon=True) from None
    except ray.exceptions.RayError as exc:
        raise CliError(f"hybrid-ray: {what} failed: {type(exc).__name__}: {exc}", 1) from None


def _jsonable(value: Any) -> Any:
    """JSON for what ``status`` holds besides plain values: the nodes' usage records
    (dataclasses, field by field; they were printed as their Python repr strings) and
    enums (their value)."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    from hybrid_ray.actors import MASTER_NAME

    from hybrid_ray.cleanup import within

    _connect(args.address, args.timeout)
    try:
        master = within(args.timeout, "the cluster's GCS looking up the shuffle master",
                        lambda: ray.get_actor(MASTER_NAME, namespace=args.namespace))
    except TimeoutError as exc:
        raise CliError(f"hybrid-ray: {exc} (--timeout); the cluster may be overloaded",
                       1, abandon=True) from None
    except ValueError:
        # Shuffles of a ShuffleConfig(namespace=...) have their master there: "no shuffle
        # has run on this cluster yet" was printed while they ran (found by a review).
        try:
            others = sorted(e["namespace"] for e in within(
                args.timeout, "the cluster's GCS listing its named actors",
                lambda: ray.util.list_named_actors(all_namespaces=True))
                if e["name"] == MASTER_NAME)
        except TimeoutError as exc:
            raise CliError(f"hybrid-ray: {exc} (--timeout); the cluster may be overloaded",
                           1, abandon=True) from None
        if others:
            print(f"no hybrid_ray shuffle master in namespace {args.namespace!r}; this "
                  f"cluster has one in namespace(s) {others}: pass --namespace NAME (the "
                  "ShuffleConfig's namespace)")
        else:
            print(f"no hybrid_ray shuffle master in namespace {args.namespace!r}: no shuffle "
                  "has run on this cluster yet")
        return 0
    status = _get(master.status.remote(), f"the shuffle master of namespace "
                  f"{args.namespace!r}", args.timeout)
    if args.json:
        print(json.dumps(status, default=_jsonable, indent=2))
        return 0
    print("\n".join(status_lines(status)))
    return 0


def status_lines(status: dict[str, Any]) -> list[str]:
    """The lines ``hybrid-ray status`` prints for the shuffle master's ``status()``."""
    out = [f"{len(status['shuffles'])} active shuffle(s)"]
    for s in status["shuffles"]:
        out.append(f"  {s['shuffle_id']}: {s['maps_finished']}/{s['num_maps']} maps "
                   f"finished, {s['num_subpartitions']} partitions, age {s['age_s']:.0f} s, "
                   f"mode {s['mode']}")
    for node in status["nodes"]:
        out.append(f"node {node.node_id}")
        for t in node.tiers:
            cap = "unbounded" if t.capacity_bytes is None else f"{t.capacity_bytes / 1e6:.1f} MB"
            if t.tier.value == "memory" and not t.shuffles and not t.used_bytes:
                # The node's memory budget comes from the configs of the shuffles writing
                # there: "used 0.0 MB of 0.0 MB" read as a node with no memory tier.
                cap = "a budget set by the shuffles that write here (none now)"
            out.append(f"  {t.tier.value:<7} used {t.used_bytes / 1e6:10.1f} MB of {cap}")
        if getattr(node, "sweep_errors", 0):
            out.append(f"  orphan sweeps failed: {node.sweep_errors} "
                       f"(last: {node.last_sweep_error})")
        if getattr(node, "refused_deletions", 0):
            out.append(f"  segment files refused for deletion (not provably hybrid_ray's): "
                       f"{node.refused_deletions} (last: {node.last_refused_deletion})")
    for node in status.get("unanswered_nodes", []):
        out.append(f"node {node['node_id']}: its tier manager did not report "
                   f"({node['error']})")
    pending = status.get("pending_deletions", [])
    if pending:
        out.append(f"{len(pending)} deletion(s) not done yet (a failed one is retried until "
                   "the data is gone):")
        for d in pending:
            # A deletion running or queued for the first time has not failed: "0 failed
            # attempt(s), last: None" read as a failing deletion on a healthy master.
            state = "running now" if d.get("running") else "queued"
            failed = f"; {d['attempts']} failed attempt(s), last: {d['last_error']}" \
                if d["attempts"] else ""
            out.append(f"  {d['what']}: {state}{failed}")
    errors = status.get("background_errors") or {}
    if errors.get("count"):
        # Shown only by --json before: a master whose expiry/deletion loop kept failing
        # (so orphans stayed and deletions never ran) looked healthy.
        out.append(f"shuffle master's background loop failed {errors['count']} time(s) "
                   f"(last: {errors.get('last', '')}): orphaned shuffles may not expire and "
                   "deletions may not run; see the master's log")
    return out


# Where cleanup's fsspec options come from when --storage-options is not given: an
# argument shows in every local user's process list, an environment variable does not.
STORAGE_OPTIONS_ENV = "HYBRID_RAY_STORAGE_OPTIONS"


def _storage_options(given: str | None) -> dict[str, Any]:
    """The fsspec options of ``--storage-options``: JSON, ``@path`` of a file holding it,
    or, not given, the JSON in ``$HYBRID_RAY_STORAGE_OPTIONS`` ({} without either).
    Credentials belong in the file or the variable (or s3fs's own credential chain): an
    argument is readable by every local user (``ps``). A file that cannot be read or
    JSON that is not an object is a ``CliError`` naming it, never quoting its content."""
    source = "--storage-options"
    text = given
    if given is None:
        text, source = os.environ.get(STORAGE_OPTIONS_ENV), f"${STORAGE_OPTIONS_ENV}"
    elif given.startswith("@"):
        source = f"--storage-options file {given[1:]}"
        try:
            with open(given[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise CliError(f"hybrid-ray: cannot read the {source}: {exc.strerror or exc}",
                           2) from None
        except UnicodeDecodeError as exc:  # its position only, as for JSON errors below
            raise CliError(f"hybrid-ray: the {source} is not UTF-8 text (byte "
                           f"{exc.start}); write it as UTF-8 JSON", 2) from None
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:  # its position only: the text may hold credentials
        raise CliError(f"hybrid-ray: {source} is not JSON (line {exc.lineno}, column "
                       f"{exc.colno}: {exc.msg})", 2) from None
    if not isinstance(options, dict):
        raise CliError(f"hybrid-ray: {source} must be a JSON object", 2)
    return options


def _missing_local_remote_path(remote_path: str) -> str:
    """Why a local ``--remote-path`` (``file://``, ``local://`` or an absolute path) holds
    no shuffle directories here ("does not exist", "is not a directory"), or "" if it is
    a directory or not local (an object store's prefix exists once written to; a relative
    path is refused by ``find_orphans``)."""
    protocol, path = remote_path.split("://", 1) if "://" in remote_path \
        else ("file", remote_path)
    if protocol not in ("file", "local") or not path.startswith("/") or os.path.isdir(path):
        return ""
    return "is not a directory" if os.path.lexists(path) else "does not exist"


def cmd_cleanup(args: argparse.Namespace) -> int:
    """Remove orphaned shuffle directories: only marked ones hybrid_ray wrote, only those
    no running shuffle master lists as live (see ``hybrid_ray.cleanup``)."""
    from hybrid_ray import cleanup
    from hybrid_ray.config import default_spill_dir
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.tiers.disk import DATA_DIR_NAME

    options = _storage_options(args.storage_options)
    if args.remote_path is not None and not args.remote_path.strip():
        raise CliError("hybrid-ray cleanup: --remote-path is empty; give the remote tier's "
                       "URL (e.g. s3://bucket/prefix) or leave the option out", 2)
    # A typo'd spill dir (or a {node_id} pattern matching nothing) examined nothing and
    # reported success; an empty one swept ./hybrid_ray of the current directory. One
    # missing beside others (the same command run on every node; a node that never spilled
    # has no spill dir) is skipped with a warning; all missing, with no remote path to
    # sweep either, is an error.
    missing: dict[str, str] = {}  # spill dir as given -> why it is skipped
    for given in args.spill_dir or ():
        if not given.strip():
            raise CliError("hybrid-ray cleanup: --spill-dir is empty; give a spill dir", 2)
        if not any(os.path.isdir(d) for d in cleanup.expand_spill_dirs([given])):
            missing[given] = "matches no directory" if "{node_id}" in given \
                else "is not a directory"
    # The same for a local remote path: a typo'd file:///... (or a file) listed nothing
    # and the cleanup reported "0 orphaned shuffle directories removed", exit 0.
    remote_missing = _missing_local_remote_path(args.remote_path) if args.remote_path else ""
    problems = [f"--spill-dir {d} {why}" for d, why in missing.items()]
    if remote_missing:
        problems.append(f"--remote-path {args.remote_path} {remote_missing}")
    spill_all_missing = bool(args.spill_dir) and len(missing) == len(set(args.spill_dir))
    if problems and (not args.spill_dir or spill_all_missing) \
            and (not args.remote_path or remote_missing):
        raise CliError("hybrid-ray cleanup: " + "; ".join(problems)
                       + "; check the path (nothing was removed)", 2)
    for given in args.spill_dir or ():
        for d in cleanup.expand_spill_dirs([given]):
            # The directory a user sees the shuffle directories in is the data dir inside
            # the spill dir: given as the spill dir, it was searched for a data dir of its
            # own, nothing was found, and the cleanup reported success.
            if os.path.basename(os.path.normpath(d)) == DATA_DIR_NAME \
                    and not os.path.isdir(os.path.join(d, DATA_DIR_NAME)):
                raise CliError(
                    f"hybrid-ray cleanup: --spill-dir {given} is the {DATA_DIR_NAME} "
                    "directory inside a spill dir, not a spill dir; give the spill dir "
                    f"itself: --spill-dir {os.path.dirname(os.path.normpath(d))} "
                    "(nothing was removed)", 2)
    for given, why in missing.items():
        print(f"hybrid-ray cleanup: skipped --spill-dir {given}: it {why} here",
              file=sys.stderr)
    if remote_missing:
        print(f"hybrid-ray cleanup: skipped --remote-path {args.remote_path}: it "
              f"{remote_missing} here", file=sys.stderr)
        args.remote_path = None
    # The default spill dir only when no path is named at all: `cleanup --remote-path URL
    # --no-cluster` swept this machine's default spill dir too, which the user had not
    # named (and the shuffles of another job or cluster there with it).
    if args.spill_dir:
        spill_dirs = [d for d in args.spill_dir if d not in missing]
    else:
        spill_dirs = [] if args.remote_path else [default_spill_dir()]
    # Candidates first, live shuffles next: a shuffle registered after the question has
    # no directory in the list, so it cannot be removed by mistake.
    try:
        plan = cleanup.find_orphans(spill_dirs, args.remote_path, options)
    except ConfigError as exc:
        raise CliError(f"hybrid-ray cleanup: {exc}", 2) from None
    if args.no_cluster:
        print("--no-cluster: no shuffle master asked; every marked shuffle directory older "
              "than --older-than is removed")
        live: dict[str, str] = {}
    else:
        try:
            _connect(args.address, args.timeout)
        except CliError as exc:
            raise CliError(f"{exc}\nhybrid-ray cleanup: without a cluster it cannot tell "
                           "which shuffles are live, so it removed nothing. If no running "
                           "cluster uses these spill dirs or this remote path, run it again "
                           "with --no-cluster.", exc.code) from None
        try:
            live = cleanup.live_shuffles(args.timeout)
        except Exception as exc:
            # (Ray's GetTimeoutError is a TimeoutError too.)
            timed_out = isinstance(exc, TimeoutError)
            raise CliError(f"hybrid-ray cleanup: could not ask the shuffle masters which "
                           f"shuffles are live ({type(exc).__name__}: {exc}); removed "
                           "nothing", 1, abandon=timed_out) from None
    result = cleanup.remove(plan, args.older_than, keep=live)
    for path in result.removed:
        print(f"removed {path}")
    for path in result.kept_live:
        print(f"kept {path}: its shuffle is live")
    for path, why in result.errors:
        print(f"hybrid-ray cleanup: could not remove {path}: {why}", file=sys.stderr)
    n = len(result.removed)
    print(f"{n} orphaned shuffle director{'y' if n == 1 else 'ies'} removed, "
          f"{len(result.kept_live)} live and {len(result.kept_recent)} recent kept, "
          f"{len(result.errors)} failed")
    return 1 if result.errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo shuffle on a local Ray")
    demo.add_argument("--rows", type=int, default=2_000_000)
    demo.add_argument("--blocks", type=int, default=8)
    demo.add_argument("--partitions", type=int, default=8)
    demo.add_argument("--cpus", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    status = sub.add_parser("status", help="shuffles and tier usage of a running cluster")
    status.add_argument("--address", default=None)
    status.add_argument("--namespace", type=_parse_namespace, default="hybrid_ray",
                        help="the ShuffleConfig's namespace (default hybrid_ray)")
    status.add_argument("--json", action="store_true")
    status.add_argument("--timeout", type=_parse_timeout, default=DEFAULT_TIMEOUT_S,
                        help="bound on connecting and on each call (default 15s)")
    status.set_defaults(func=cmd_status)
    cleanup = sub.add_parser(
        "cleanup", help="remove orphaned spill files and remote data",
        description="Remove shuffle directories hybrid_ray wrote (marked ones only) that "
                    "are older than --older-than and that no running shuffle master lists "
                    "as live. Only the cluster it connects to is asked: a shuffle of "
                    "another cluster sharing these paths is kept by --older-than alone, so "
                    "make it longer than any such shuffle lives. Spill dirs with {node_id} "
                    "are expanded to every matching directory, removed nodes' included.")
    cleanup.add_argument("--older-than", type=_parse_duration, default=6 * 3600.0)
    cleanup.add_argument("--spill-dir", action="append",
                         help="a spill dir (repeatable); {node_id} matches every node's "
                              "(default: the default spill dir, unless --remote-path is "
                              "given)")
    cleanup.add_argument("--remote-path")
    cleanup.add_argument("--storage-options",
                         help="fsspec options as JSON, or @FILE holding it (default: "
                              f"${STORAGE_OPTIONS_ENV}); keep credentials out of the "
                              "command line, where every local user can read them")
    # One or the other: --no-cluster silently won over a given --address before.
    cluster = cleanup.add_mutually_exclusive_group()
    cluster.add_argument("--address", default=None,
                         help="the Ray cluster whose masters say which shuffles are live "
                              "(default: auto)")
    cluster.add_argument("--no-cluster", action="store_true",
                         help="no cluster uses these paths: remove without asking one")
    cleanup.add_argument("--timeout", type=_parse_timeout, default=DEFAULT_TIMEOUT_S,
                         help="bound on connecting and on each call (default 15s)")
    cleanup.set_defaults(func=cmd_cleanup)
    return parser


# Upper bounds of the demo's arguments (see ``main``).
MAX_DEMO_ROWS = 100_000_000
MAX_DEMO_BLOCKS = 10_000
MAX_DEMO_CPUS = 256


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("rows", "blocks", "partitions", "cpus"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) <= 0:
            print(f"hybrid-ray: --{name} must be positive", file=sys.stderr)
            return 2
    # Checked before Ray starts and the data is made: both failed after, with a traceback.
    if getattr(args, "partitions", None) is not None:
        from hybrid_ray.shuffle import MAX_PARTITIONS

        if args.partitions > MAX_PARTITIONS:
            print(f"hybrid-ray: --partitions must be at most {MAX_PARTITIONS}",
                  file=sys.stderr)
            return 2
    if getattr(args, "seed", 0) < 0:
        print("hybrid-ray: --seed must be 0 or more", file=sys.stderr)
        return 2
    if args.command == "demo":
        # Upper bounds, checked before Ray starts: --rows 10000000000000 died in NumPy
        # with a MemoryError traceback (a review's probe), and --blocks or --cpus beyond
        # these only make the demo crawl (a block per row, a worker process per CPU).
        for name, limit, why in (
                ("rows", MAX_DEMO_ROWS, "the demo holds its data several times in memory; "
                                        "for more, run the benchmark suite: python -m "
                                        "benchmarks --size 4GiB"),
                ("blocks", min(MAX_DEMO_BLOCKS, args.rows),
                 f"a block holds at least one row, and at most {MAX_DEMO_BLOCKS} are made"),
                ("cpus", MAX_DEMO_CPUS, "the demo's local Ray starts a worker per CPU")):
            if getattr(args, name) > limit:
                print(f"hybrid-ray: --{name} must be at most {limit} ({why}), got "
                      f"{getattr(args, name)}", file=sys.stderr)
                return 2
    try:
        return args.func(args)
    except CliError as exc:
        print(exc, file=sys.stderr)
        sys.stderr.flush()
        if exc.abandon:
            # Ray (ray.init in its thread, a GCS or actor that stopped answering) would
            # hold Ray's exit hook as long as it stays silent: leave now, the message is
            # out. (Measured: a stopped GCS held `cleanup --timeout 3s` for over 240 s.)
            sys.stdout.flush()
            os._exit(exc.code)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
