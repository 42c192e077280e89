"""Removal of orphaned shuffle data: shuffle directories in spill dirs and under a remote
path that no live shuffle owns any more (their driver and master died before releasing
them, or their node was removed).

Only what hybrid_ray wrote is ever a candidate: a directory ``spill_dir/hybrid_ray/<id>``
or ``remote_path/<job>/<id>`` whose names match ``ID_PATTERN`` and that holds a shuffle
marker (``hybrid_ray.tiers.base.SHUFFLE_MARKER_NAME``, written before a shuffle's first
segment) naming that very shuffle (and job). Anything else under those paths, a user's
data included, is never read beyond its name and never removed. A candidate is removed if
its newest file is older than the cut-off and the running shuffle masters do not list it
as live (``live_shuffles``): ``find_orphans`` lists candidates first, the caller asks the
masters next, ``remove`` deletes last, so a shuffle registered in between has no
directory in the list yet.
"""

from __future__ import annotations

import dataclasses
import glob
import numbers
import os
import posixpath
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import fsspec

from hybrid_ray import ids
from hybrid_ray.config import (
    refuse_single_spill_dir, validate_remote_path, validate_storage_options,
)
from hybrid_ray.errors import ConfigError
from hybrid_ray.ids import require_inside_remote
from hybrid_ray.redaction import Redactor, redact_url
from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME, parse_shuffle_marker
from hybrid_ray.tiers.disk import (
    DATA_DIR_NAME, MAX_MARKER_BYTES, local_tree_problem, read_shuffle_marker,
    remove_marked_tree, unsafe_spill_dir,
)
from hybrid_ray.tiers.remote import (
    call_deadline_s, filesystem_options, remove_empty_job_dir, remove_remote_tree,
)

# Names of job and shuffle directories cleanup may remove: exactly the ids hybrid_ray
# writes under (``hybrid_ray.ids``: a job id such as "etl.daily" included). Its first
# character is a letter or digit, so never ``.`` or ``..``; no separators; bounded length.
ID_PATTERN = ids.ID_PATTERN


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A shuffle directory hybrid_ray wrote: where it is, whose it is, how old it is."""

    kind: str  # "spill" or "remote"
    root: str  # the directory every delete is confined to
    path: str
    shuffle_id: str
    newest: float  # newest modification time of anything in it (epoch seconds)
    fs: Any = None  # the fsspec filesystem of a remote candidate
    redactor: Redactor | None = None  # hides a remote candidate's credentials in errors


@dataclasses.dataclass
class SweepResult:
    """What a sweep did: removed paths, live or fresh ones kept, and failures per path."""

    removed: list[str] = dataclasses.field(default_factory=list)
    kept_live: list[str] = dataclasses.field(default_factory=list)
    kept_recent: list[str] = dataclasses.field(default_factory=list)
    errors: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def merge(self, other: "SweepResult") -> "SweepResult":
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))
        return self


@dataclasses.dataclass
class Plan:
    """Candidates found, and paths that could not be examined."""

    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    errors: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _inside(root: str, path: str, sep: str = os.sep) -> bool:
    """Whether ``path`` lies strictly below ``root`` (both already normalised)."""
    root = root.rstrip(sep)
    return path != root and path.startswith(root + sep)


def _is_id(name: str) -> bool:
    return ID_PATTERN.fullmatch(name) is not None


# ---- spill dirs ------------------------------------------------------------------------------
def expand_spill_dirs(patterns: Iterable[str]) -> list[str]:
    """Spill dirs to sweep: each pattern as is, and for a pattern with ``{node_id}`` every
    existing directory it matches, dead nodes' included (no live tier manager sees those).
    ``ConfigError`` for a single path instead of a list: taken one character at a time,
    "spill" swept "s", "p", "i", "l" below the working directory (and "/x" swept "/"),
    removing what was found there, and never the dir it named."""
    refuse_single_spill_dir(patterns)
    out: list[str] = []
    for pattern in patterns:
        if "{node_id}" in pattern:
            escaped = glob.escape(pattern).replace(glob.escape("{node_id}"), "*")
            matches = sorted(p for p in glob.glob(escaped) if os.path.isdir(p))
        else:
            matches = [pattern]
        out.extend(os.path.abspath(m) for m in matches if os.path.abspath(m) not in out)
    return out


def _newest_mtime(path: str) -> float:
    """Newest mtime of the files below ``path`` (its marker and segments), without
    following symlinks; the directory's own if it holds none. Directories do not count:
    a removal that failed part-way (a file it could not unlink) made the directory's
    mtime "now", so the next run, after the cause was fixed, kept the rest as recent for
    ``--older-than`` (6 h by default) and reported success."""
    newest = None
    for root, _dirs, files in os.walk(path):
        for n in files:
            try:
                mtime = os.lstat(os.path.join(root, n)).st_mtime
            except FileNotFoundError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
    return os.lstat(path).st_mtime if newest is None else newest


def find_spill_orphans(spill_dirs: Sequence[str], plan: Plan | None = None) -> Plan:
    """Marked shuffle directories under ``<spill dir>/hybrid_ray`` of every spill dir
    (``{node_id}`` patterns expanded)."""
    plan = plan or Plan()
    # One data dir reached under two names (a spill dir given twice, once through a
    # symlink or a bind mount's alias) is swept once: twice, each removal was reported
    # twice, the second one of a directory already gone.
    seen: set[str] = set()
    for spill_dir in expand_spill_dirs(spill_dirs):
        data_dir = os.path.join(spill_dir, DATA_DIR_NAME)
        if os.path.islink(data_dir) or not os.path.isdir(data_dir):
            continue  # not ours, or nothing there (a symlinked data dir is not followed)
        root = os.path.realpath(data_dir)
        if root in seen:
            continue
        seen.add(root)
        unsafe = unsafe_spill_dir(spill_dir)
        if unsafe is not None:
            # Another user could swap a shuffle directory for a symlink while it is being
            # removed (the removal then continues wherever the link points): a data dir
            # that is not this user's 0700 directory, in a spill dir held to the same
            # rules as a shuffle's own writes, is reported and left alone.
            plan.errors.append((data_dir, f"not swept: {unsafe} (run cleanup as the user "
                                          "that ran the shuffles)"))
            continue
        try:
            entries = list(os.scandir(data_dir))
        except OSError as exc:
            plan.errors.append((data_dir, f"cannot list: {exc}"))
            continue
        for entry in entries:
            if not _is_id(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            marker = read_shuffle_marker(entry.path)
            if marker is None or marker["shuffle_id"] != entry.name:
                continue
            path = os.path.join(root, entry.name)
            try:
                newest = _newest_mtime(path)
            except OSError as exc:
                plan.errors.append((path, f"cannot examine: {exc}"))
                continue
            plan.candidates.append(Candidate("spill", root, path, entry.name, newest))
    return plan


# ---- the remote tier -------------------------------------------------------------------------
def _info_mtime(info: Mapping[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        return float(value)
    return time.time()  # unknown age: treat as fresh, never delete by mistake


def _dir_names(fs: Any, path: str, call: Mapping[str, Any]) -> list[str]:
    """Names of the subdirectories of ``path`` (empty if it does not exist)."""
    try:
        listing = fs.ls(path, detail=True, **call)
    except FileNotFoundError:
        return []
    return [posixpath.basename(e["name"].rstrip("/")) for e in listing
            if e.get("type") == "directory"]


def _is_regular_file(path: str) -> bool:
    """Whether local ``path`` is a regular file itself (``lstat``: a symlink is not)."""
    import stat

    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _marker_names(fs: Any, marker_path: str, call: Mapping[str, Any], shuffle: str,
                  job: str) -> bool:
    """Whether the marker at ``marker_path`` is hybrid_ray's for ``job``/``shuffle``."""
    marker = parse_shuffle_marker(fs.cat_file(marker_path, **call))
    return marker is not None and marker["shuffle_id"] == shuffle \
        and marker.get("job_id") == job


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local"} & set(protocols))


def find_remote_orphans(remote_path: str, storage_options: Mapping[str, Any] | None = None,
                        plan: Plan | None = None) -> Plan:
    """Marked shuffle directories ``remote_path/<job>/<shuffle>``. Only two levels of
    names are listed, and only marked directories are read further.

    ``remote_path`` and ``storage_options`` are checked as a remote tier's are
    (``ConfigError`` for a bad one, a glob character or a bad timeout included); the
    filesystem gets the remote tier's bounded timeouts and every single-request call a
    deadline; credentials never appear in the plan's paths or errors."""
    remote_path = validate_remote_path(remote_path)
    # Checked as a ShuffleConfig's are: a bad config_kwargs failed below with a bare
    # TypeError or ValueError, outside every handler (a traceback from the CLI).
    storage_options = validate_storage_options(storage_options or {})
    redactor = Redactor(remote_path, storage_options)
    plan = plan or Plan()
    options = filesystem_options(remote_path, storage_options)
    try:
        fs, root = fsspec.core.url_to_fs(remote_path, **options)
    except Exception as exc:  # fsspec raises many types for bad options
        plan.errors.append((redact_url(remote_path), redactor.scrub(
            f"cannot open: {type(exc).__name__}: {exc}")))
        return plan
    deadline = call_deadline_s(fs, dict(options.get("config_kwargs") or {}))
    call = {} if deadline is None else {"timeout": deadline}
    fs.invalidate_cache()
    root = posixpath.normpath(root) if root else root

    def failed(path: str, what: str, exc: Exception) -> None:
        plan.errors.append((redactor.scrub(path),
                            redactor.scrub(f"{what}: {type(exc).__name__}: {exc}")))

    try:
        jobs = _dir_names(fs, root, call)
    except Exception as exc:  # fsspec backends raise many types
        failed(redact_url(remote_path), "cannot list", exc)
        return plan
    for job in jobs:
        if not _is_id(job):
            continue
        job_path = posixpath.join(root, job)
        try:
            shuffles = _dir_names(fs, job_path, call)
        except Exception as exc:
            failed(job_path, "cannot list", exc)
            continue
        for name in shuffles:
            if not _is_id(name):
                continue
            path = posixpath.join(job_path, name)
            try:
                marker_path = posixpath.join(path, SHUFFLE_MARKER_NAME)
                local = _is_local(fs)
                if local and not _is_regular_file(marker_path):
                    # Never opened unless a plain file: a FIFO or /dev/zero planted as the
                    # marker (or a symlink to one) blocked the sweep forever.
                    continue
                if not fs.exists(marker_path, **call) \
                        or fs.size(marker_path, **call) > MAX_MARKER_BYTES:
                    continue
                # The tree is checked before the marker is read: once its directories are
                # known to be this user's alone, nobody can swap the marker meanwhile.
                unsafe = local_tree_problem(root, [job_path, path]) if local else None
                if unsafe is not None:  # reported, its marker not even read (see above)
                    plan.errors.append((redactor.scrub(path), redactor.scrub(
                        f"not swept: {unsafe} (another user could redirect the removal; "
                        "run cleanup as the user that ran the shuffles)")))
                    continue
                if not _marker_names(fs, marker_path, call, name, job):
                    continue
                # A whole tree: no per-request deadline (see remove_remote_tree).
                infos = fs.find(path, detail=True)
                newest = max((_info_mtime(i) for i in infos.values()), default=time.time())
            except Exception as exc:
                failed(path, "cannot examine", exc)
                continue
            plan.candidates.append(Candidate("remote", root, path, name, newest, fs,
                                             redactor))
    return plan


# ---- deciding and removing -------------------------------------------------------------------
def find_orphans(spill_dirs: Sequence[str] = (), remote_path: str | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> Plan:
    """Every candidate of ``spill_dirs`` and ``remote_path``."""
    plan = find_spill_orphans(spill_dirs)
    if remote_path:
        find_remote_orphans(remote_path, storage_options, plan)
    return plan


def remove(plan: Plan, older_than_s: float, keep: Collection[str] = (),
           now: float | None = None) -> SweepResult:
    """Remove the candidates untouched for ``older_than_s`` seconds whose shuffle id is not
    in ``keep`` (the live shuffles). Every failure is reported per path, none swallowed.
    ``ConfigError`` for an ``older_than_s`` that is not a number of seconds >= 0."""
    if isinstance(older_than_s, bool) or not isinstance(older_than_s, numbers.Real) \
            or not 0 <= older_than_s < float("inf"):
        # Compared with the cut-off as given, a NaN or negative age removed every
        # candidate, one written a moment ago included, and "6h" failed with a bare
        # TypeError after the candidates were found.
        raise ConfigError(f"older_than_s must be a number of seconds >= 0 (e.g. 6 * 3600 "
                          f"for 6 h), got {older_than_s!r}; nothing was removed")
    result = SweepResult(errors=list(plan.errors))
    cutoff = (time.time() if now is None else now) - older_than_s
    for c in plan.candidates:
        # Paths as reported: a remote one with its credentials hidden.
        scrub = c.redactor.scrub if c.redactor is not None else str
        shown = scrub(c.path)
        if c.shuffle_id in keep:
            result.kept_live.append(shown)
            continue
        if c.newest > cutoff:
            result.kept_recent.append(shown)
            continue
        try:
            if c.kind == "spill":
                if not _inside(c.root, os.path.realpath(c.path)):
                    raise RuntimeError(f"refused: resolves outside {c.root}")
                # The marker last, as a release does: a removal that fails part-way
                # leaves what is left recognisable as ours for the next run.
                failures = remove_marked_tree(c.path)
                if failures:
                    raise OSError("; ".join(failures))
            else:
                # Lexically inside the root and free of glob characters (fsspec's rm
                # expands them): nothing else can be reached.
                require_inside_remote(c.root, c.path, "remove")
                remove_remote_tree(c.fs, c.path)
                c.fs.invalidate_cache()
                if _is_local(c.fs):
                    remove_empty_job_dir(c.path)
        except FileNotFoundError:
            continue  # gone meanwhile (released by its master): nothing left to remove
        except Exception as exc:
            result.errors.append((shown, scrub(f"{type(exc).__name__}: {exc}")))
            continue
        result.removed.append(shown)
    return result


def sweep_spill_dirs(spill_dirs: Sequence[str], older_than_s: float,
                     keep: Collection[str] = ()) -> SweepResult:
    """Remove marked shuffle directories of ``spill_dirs`` untouched for ``older_than_s``
    seconds, except shuffle ids in ``keep``."""
    return remove(find_spill_orphans(spill_dirs), older_than_s, keep)


def sweep_remote(remote_path: str, older_than_s: float,
                 storage_options: Mapping[str, Any] | None = None,
                 keep: Collection[str] = ()) -> SweepResult:
    """Remove marked shuffle directories ``remote_path/<job>/<shuffle>`` whose newest
    object is older than ``older_than_s``, except shuffle ids in ``keep``."""
    return remove(find_remote_orphans(remote_path, storage_options), older_than_s, keep)


# ---- asking the cluster ----------------------------------------------------------------------
class CallTimedOut(TimeoutError):
    """``within``'s bound passed (not a ``TimeoutError`` the call raised itself)."""


def within(timeout_s: float, what: str, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or its exception, if it returns within ``timeout_s``; else
    ``CallTimedOut`` naming ``what``. The call runs on a daemon thread, which is left
    behind if it never returns (it cannot keep the process from exiting)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))
        done.set()

    threading.Thread(target=run, name="hybrid-ray-bounded-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise CallTimedOut(f"{what} did not answer within {timeout_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def live_shuffles(timeout_s: float = 30.0) -> dict[str, str]:
    """Shuffle id -> job id of every shuffle a running shuffle master knows, in every
    namespace of the connected Ray cluster. Raises if a master does not answer within
    ``timeout_s``: without its answer no shuffle of its namespace may be removed."""
    import ray

    from hybrid_ray.actors import MASTER_NAME

    live: dict[str, str] = {}
    # The GCS lookups are bounded too: Ray retries a GCS that accepts and does not answer
    # for much longer than the caller's timeout.
    entries = within(timeout_s, "the cluster's GCS listing its named actors",
                     lambda: ray.util.list_named_actors(all_namespaces=True))
    for entry in entries:
        if entry["name"] != MASTER_NAME:
            continue
        master = within(timeout_s, f"the GCS looking up the shuffle master of namespace "
                        f"{entry['namespace']!r}",
                        lambda e=entry: ray.get_actor(MASTER_NAME, namespace=e["namespace"]))
        try:
            method: Callable[..., Any] = master.live_shuffles
        except AttributeError:  # a master started by an older hybrid_ray
            status = ray.get(master.status.remote(), timeout=timeout_s)
            live.update({s["shuffle_id"]: "" for s in status["shuffles"]})
            continue
        live.update(ray.get(method.remote(), timeout=timeout_s))
    return live
