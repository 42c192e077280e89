"""Remote tier: one object per segment in any fsspec filesystem (S3 through s3fs, local files).

Layout (FLIP-301): ``HomePath/JobID/ShuffleID/SubpartitionID/segment``. A segment is visible
only once complete: object stores publish a single PUT atomically; on filesystems with
partial writes (local files) the segment is written under a temporary name and moved.
On a local filesystem (``file://``) directories are created 0700 and files 0600, as in the
disk tier: shuffle data is private.

Credentials in ``storage_options`` (or in a URL's query or user part, which
``ShuffleConfig`` refuses for object stores: see ``config.credentials_in_url_problem``)
never appear in an error message (``hybrid_ray.redaction``), and nothing outside
``HomePath/JobID/`` is written or removed (ids are checked by ``hybrid_ray.ids``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import logging
import os
import posixpath
import re
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import fsspec
import fsspec.asyn

from hybrid_ray.config import TierName, require_count
from hybrid_ray.errors import (
    ConfigError, HybridRayError, RemoteTierError, SegmentNotFoundError, ShuffleStalledError,
    UnsafePathError,
)
from hybrid_ray.ids import (
    check_id, glob_characters_in, has_abnormal_component, require_inside_remote,
    require_normal_remote_path,
)
from hybrid_ray.redaction import Redactor, redact_url
from hybrid_ray.segment import SegmentId, SegmentMeta, segment_num_rows
from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME, Grant, Tier, shuffle_marker
from hybrid_ray.tiers.disk import (
    local_tree_problem, make_private_dir, temporary_name, unlink_quietly,
)

_LOG = logging.getLogger(__name__)

# Removing a released shuffle's tree is retried this often (see remove_shuffle_data).
REMOVE_ATTEMPTS = 5
# Background transfers of one process run on at most this many threads (see ``io_pool``).
DEFAULT_IO_THREADS = 4
# botocore computes a CRC32 of every PUT body and validates one on every GET (and moto or
# S3 checks it again). A segment already carries an XXH3-64 of its body, verified on every
# read (hybrid_ray.segment), and S3 is reached over TLS, so hybrid_ray asks for these
# checksums only where S3 requires them; storage_options["config_kwargs"] overrides this.
S3_CHECKSUM_DEFAULTS = {"request_checksum_calculation": "when_required",
                        "response_checksum_validation": "when_required"}
# Bounded waits on S3 (botocore's defaults: 60 s connect and read timeouts, 5 attempts, and
# s3fs retries each call 5 more times: an endpoint that accepts connections and never
# answers gave no error for over 6 minutes). s3fs itself retries a timed-out, refused or
# throttled (SlowDown) call S3FileSystem.retries = 5 times with backoff, but not a 500
# InternalError, 502 or 503 ServiceUnavailable, which S3 answers now and then and asks
# clients to retry: botocore's "standard" mode retries those, S3_ATTEMPTS attempts in all
# (with one attempt, a single 500 failed the whole shuffle). Each call has a deadline
# (below) bounding all of its attempts. Override any of these with
# storage_options={"config_kwargs": {"read_timeout": ..., ...}}.
# (botocore rewrites a "retries" dict in place: it is copied for every filesystem.)
S3_ATTEMPTS = 3
S3_TIMEOUT_DEFAULTS = {"connect_timeout": 5, "read_timeout": 5,
                       "retries": {"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}}
# botocore sends PUTs with "Expect: 100-continue", and aiohttp's read timeout does not run
# while it waits for the "100 Continue" an endpoint that never answers never sends: such a
# PUT hangs for good. So every call of an async filesystem (s3fs) also gets a deadline:
# CALL_DEADLINE_ATTEMPTS x (connect_timeout + read_timeout), 20 s by default, plus the
# transfer's bytes at REMOTE_MIN_BYTES_PER_S (a 16 MiB segment gets 16 s more).
CALL_DEADLINE_ATTEMPTS = 2
REMOTE_MIN_BYTES_PER_S = 1 << 20
# How long a reader or writer waits for a background remote call beyond its bytes' time
# (``RemoteTier.outcome``): far above an async call's deadline, which ends it first (it
# may also have queued behind a few others in the I/O pool); the only bound of a sync one.
RESULT_WAIT_S = 600.0
# Object stores whose single PUT is atomic: no temp-and-rename needed (and rename is a copy).
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "az", "memory"}
_LOCAL_PROTOCOLS = {"file", "local"}
# Stores of flat keys, where a key may also be the prefix of others (``job/shf-1`` beside
# ``job/shf-1/...``): removing a shuffle's tree deletes keys below its prefix by name, never
# the prefix (``remove_remote_tree``). Beyond the atomic-put ones: the same stores under
# their other fsspec names, and other clouds' object stores.
_FLAT_KEY_PROTOCOLS = _ATOMIC_PUT_PROTOCOLS | {
    "abfss", "adl", "s3n", "gcsfs", "oss", "oci", "cos", "cosn", "obs", "tos", "r2", "b2"}


class RemoteTier(Tier):
    """Unbounded tier backed by an fsspec URL; checked for reachability on construction."""

    name = TierName.REMOTE

    def __init__(self, segment_bytes: int, remote_path: str, job_id: str,
                 storage_options: Mapping[str, Any] | None = None,
                 check_reachable: bool = True, io_threads: int = DEFAULT_IO_THREADS) -> None:
        super().__init__(segment_bytes)
        self.remote_path = remote_path
        # The remote path as shown in messages, grants and reports: credentials hidden.
        self.display_path = redact_url(remote_path)
        self._redactor = Redactor(remote_path, storage_options)
        # Checked here: 0 failed inside the reachability probe, reported as a store that
        # is not writable ("check the endpoint and credentials").
        self.io_threads = require_count("remote tier io_threads (ShuffleConfig's "
                                        "remote_transfers)", io_threads)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self.job_id = check_id("job_id", job_id)
        if glob_characters_in(remote_path):
            raise ConfigError(f"remote_path {self.display_path!r} holds "
                              f"{glob_characters_in(remote_path)!r}, which fsspec expands as "
                              "a glob in deletes; use one without * ? [ ]")
        options = filesystem_options(remote_path, storage_options)
        self._config_kwargs = dict(options.get("config_kwargs") or {})
        self._endpoint = _endpoint_of(options)
        # Shuffles whose directory this process has marked (see _write_marker).
        self._marked: set[str] = set()
        try:
            self.fs, self.root = fsspec.core.url_to_fs(remote_path, **options)
        except Exception as exc:  # fsspec raises many types for bad options
            self._fail(RemoteTierError, f"cannot open remote_path {self.display_path!r}: "
                       f"{exc}; check the URL and storage_options", exc)
        if has_abnormal_component(self.root):
            # ShuffleConfig refuses such a remote_path; a tier built directly took it, wrote
            # its segments, and then refused every read and delete of them (their paths
            # fail ``require_normal_remote_path``).
            raise ConfigError(f"remote_path {self.display_path!r} has an empty, '.' or '..' "
                              "component ('//', '/./' or '/../'); write the path in its "
                              "normal form, e.g. s3://bucket/prefix")
        self._deadline_s = call_deadline_s(self.fs, self._config_kwargs)
        protocols = _protocols(self.fs)
        self._atomic_put = bool(protocols & _ATOMIC_PUT_PROTOCOLS)
        self._local = bool(protocols & _LOCAL_PROTOCOLS)
        self._s3 = bool(protocols & {"s3", "s3a"})
        # Everything this tier writes or removes lies below this directory.
        self.job_root = posixpath.join(self.root, self.job_id)
        if check_reachable:
            self.check_reachable()

    def _fail(self, cls: type[HybridRayError], message: str, exc: BaseException) -> NoReturn:
        """Raise ``cls(message)`` with every credential scrubbed from it. ``exc`` is kept as
        the cause only if its traceback shows no credential either (a library's message
        can quote the URL or a signed request); its type and text are in ``message``."""
        error = cls(self._redactor.scrub(message))
        cause_text = "".join(traceback.format_exception(exc))
        if self._redactor.is_clean(cause_text):
            raise error from exc
        raise error from None

    def scrub(self, text: Any) -> str:
        """``str(text)`` with this tier's credentials (of its remote_path and
        storage_options) hidden: for a library's error a caller reports itself."""
        return self._redactor.scrub(text)

    def check_reachable(self) -> None:
        """Fail now, with the fix, if the remote path cannot be written."""
        # Unique per call: every shuffle of a driver probes the same tier, and with one
        # shared name a probe removed under another failed as "not writable".
        probe = posixpath.join(self.job_root, f".hybrid_ray_probe-{uuid.uuid4().hex[:12]}")

        def write_probe() -> None:
            if self._local:
                self._put_local(probe, b"ok")
            else:
                if not self._atomic_put:
                    self.fs.makedirs(posixpath.dirname(probe), exist_ok=True)
                self.fs.pipe_file(probe, b"ok", **self.deadline())
        try:
            # On the transfer threads, within a bound: a sync filesystem (NFS through
            # file://, HDFS, sftp) has no per-call deadline, and a hung one held the
            # driver here, before any task ran, forever (found by a review).
            self.outcome(self.io_pool().submit(write_probe), "writing a reachability probe")
        except UnsafePathError:  # its own reason and fix; not an unreachable store
            raise
        except Exception as exc:  # botocore/aiohttp/OS errors all mean "unreachable" here
            self._fail(
                RemoteTierError,
                f"remote tier {self.display_path!r} is not writable: {_describe(exc)}. "
                f"{self._timeout_hint(exc)}Check that the bucket/directory exists, "
                "the endpoint is reachable (storage_options={'endpoint_url': ...}) and "
                "credentials are set (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, "
                "or an instance role).",
                exc)
        listing_error = self._list_error()
        self._remove_probe(probe)
        if listing_error is not None:
            self._fail(
                RemoteTierError,
                f"remote tier {self.display_path!r} took a write but refused to list it: "
                f"{_describe(listing_error)}. {self._timeout_hint(listing_error)}A "
                "shuffle's objects are found by listing them when it is released, so "
                "without that permission what is left of every shuffle (its marker; all "
                "of its data if it failed) would stay there: allow listing the remote "
                "path (for S3: s3:ListBucket on the bucket, for this prefix).",
                listing_error)

    def _list_error(self) -> Exception | None:
        """The error of listing the job directory (as the release of a shuffle does, to
        find its objects), or None. Credentials allowed to put, get and delete objects
        but not to list them (S3 without s3:ListBucket, a common policy slip) passed the
        check; every shuffle then ran, and its release failed for good (the master
        retrying it forever), leaving its marker, and all of its data if it failed."""
        def list_job_dir() -> None:
            self.fs.invalidate_cache(self.job_root)  # asked of the store, not a cache
            try:
                self.fs.ls(self.job_root, detail=False, **self.deadline())
            finally:
                self.fs.invalidate_cache(self.job_root)
        try:
            self.outcome(self.io_pool().submit(list_job_dir), "listing the job directory")
        except FileNotFoundError:  # nothing there (a store without directories): listed
            return None
        except Exception as exc:  # noqa: BLE001 - botocore/aiohttp/OS errors
            return exc
        return None

    def _remove_probe(self, probe: str) -> None:
        """Delete the reachability probe, tried twice. A store that takes writes but
        refuses deletes would keep every segment of every shuffle, so it fails the check
        too, naming the probe left behind: it was reported as "not writable" before, and
        the probe stayed unmentioned."""
        for attempt in range(2):
            try:
                self.outcome(self.io_pool().submit(self.fs.rm_file, probe, **self.deadline()),
                             "deleting the reachability probe")
                return
            except FileNotFoundError:
                return
            except Exception as exc:  # noqa: BLE001 - botocore/aiohttp/OS errors
                if attempt == 1:
                    self._fail(
                        RemoteTierError,
                        f"remote tier {self.display_path!r} took a write but refused to "
                        f"delete it: {_describe(exc)}. hybrid_ray deletes every segment "
                        "it writes, so it needs permission to delete there (for S3: "
                        "s3:DeleteObject). The probe object "
                        f"{redact_url(probe)!r} is left behind; remove it once deletes "
                        "work.", exc)

    def deadline(self, nbytes: int = 0) -> dict[str, float]:
        """The ``timeout`` keyword bounding one call of an async filesystem (fsspec cancels
        the call when it expires and raises ``FSTimeoutError``); {} for sync ones."""
        if self._deadline_s is None:
            return {}
        return {"timeout": self._deadline_s + nbytes / REMOTE_MIN_BYTES_PER_S}

    def _timeout_hint(self, exc: BaseException) -> str:
        """For a timed-out call: what waited how long, and the setting that bounds it."""
        if not _is_timeout(exc):
            return ""
        kw = self._config_kwargs
        where = f"endpoint {self._endpoint}" if self._endpoint else "the remote endpoint"
        deadline = f" (deadline {self._deadline_s:.0f} s)" if self._deadline_s else ""
        return (f"{where} did not answer in time{deadline}: connect_timeout="
                f"{kw.get('connect_timeout')} s, read_timeout={kw.get('read_timeout')} s; if "
                "it is only slow, raise them with storage_options={'config_kwargs': "
                "{'connect_timeout': ..., 'read_timeout': ...}}. ")

    @property
    def capacity_bytes(self) -> None:
        return None

    def _room_for(self, shuffle_id: str, nbytes: int) -> str:
        return self.display_path  # a grant travels between processes and into messages

    def shuffle_path(self, shuffle_id: str) -> str:
        """``HomePath/JobID/ShuffleID`` (the shuffle id is checked first)."""
        return posixpath.join(self.job_root, check_id("shuffle_id", shuffle_id))

    def segment_path(self, segment: SegmentId) -> str:
        return posixpath.join(self.shuffle_path(segment.shuffle_id), segment.relative_path)

    def _put_local(self, path: str, payload: bytes) -> None:
        """A local file, private like the disk tier's: its directories are created 0700
        (so the file is unreachable by others from its first byte) and it is made 0600
        before it is renamed into place (readers never see half a file)."""
        # Unique per writer: the transfer threads of a process may write the same shuffle's
        # marker at once, and a shared temporary name was renamed away under one of them.
        tmp = temporary_name(path)
        for last_try in (False, True):
            try:
                # Checked before anything is created in an untrusted root, and again after
                # (the directories created or found on the way).
                self._require_trusted_tree(posixpath.dirname(path))
                make_private_dir(posixpath.dirname(path))
                self._require_trusted_tree(posixpath.dirname(path))
                self.fs.pipe_file(tmp, payload)
                os.chmod(tmp, 0o600)
                self.fs.mv(tmp, path)
                return
            except FileNotFoundError:
                # A directory on the way went meanwhile (between its check and the mkdir
                # below it, or before the write): the job directory is removed once empty
                # (``remove_empty_job_dir``), also under another process of the same job
                # id that is about to write. Created again, once.
                unlink_quietly(tmp)
                if last_try:
                    raise
            except BaseException:
                # Not left behind: a failed probe's temporary file sat in the job directory,
                # which no release or cleanup removes (one per shuffle on a full disk).
                unlink_quietly(tmp)
                raise

    def _require_trusted_tree(self, directory: str) -> None:
        """On a local filesystem: refuse (``UnsafePathError``) to write or remove below
        ``directory`` unless the remote root is trusted and every directory from the job
        directory down to ``directory`` is this user's alone (``local_tree_problem``).
        ``make_private_dir`` keeps a directory that exists already: one another user
        created first (a predictable job id) or can write could be swapped for a symlink,
        and the release's removal would follow it to their choice of files."""
        if not self._local:
            return
        chain = []
        current = posixpath.normpath(directory)
        job_root = posixpath.normpath(self.job_root)
        while current.startswith(job_root.rstrip("/") + "/") or current == job_root:
            chain.append(current)
            if current == job_root:
                break
            current = posixpath.dirname(current)
        problem = local_tree_problem(self.root, list(reversed(chain)))
        if problem is not None:
            raise UnsafePathError(
                f"refusing to use the remote tier's directory {self._redactor.scrub(directory)}"
                f": {problem}. Another user could redirect hybrid_ray's writes and deletes "
                "there; use a remote_path (or job_id) whose directories are yours alone")

    def write(self, segment: SegmentId, payload: bytes, grant: Grant | None = None,
              node_id: str = "") -> SegmentMeta:
        path = self.write_frame(segment, payload)
        return SegmentMeta(segment, self.name, len(payload), segment_num_rows(payload),
                           node_id=node_id, location=path)

    def write_frame(self, segment: SegmentId, payload: bytes | memoryview) -> str:
        """Store ``payload`` (an encoded segment of any producer: the Python writers' or the
        JVM shuffle manager's) at ``segment``'s path below the job directory; returns the
        path. The shuffle's directory is marked first (see ``_write_marker``)."""
        path = self.segment_path(segment)
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # fsspec backends expect bytes (botocore hashes them)
        marked_before = segment.shuffle_id in self._marked
        try:
            if not marked_before:
                self._write_marker(segment.shuffle_id)
            if self._local:
                self._put_local(path, payload)
            elif self._atomic_put:
                self.fs.pipe_file(path, payload, **self._single_put(len(payload)),
                                  **self.deadline(len(payload)))
            else:
                self._put_then_move(path, payload)
            if marked_before:
                self._mark_again_or_delete(segment.shuffle_id, path)
        except UnsafePathError:
            raise
        except Exception as exc:
            self._fail(RemoteTierError, f"writing {segment} to the remote tier at {path} "
                       f"failed: {_describe(exc)}. {self._timeout_hint(exc)}", exc)
        return path

    def _single_put(self, nbytes: int) -> dict[str, int]:
        """Keywords making s3fs send a body of ``nbytes`` as one PUT (a segment: far below
        S3's 5 GiB limit for one). s3fs splits one of 100 MiB or more (twice its chunksize)
        into a multipart upload, and one cut off by its deadline (a cancellation, which
        s3fs's abort does not catch) or by the writer's death stays in the bucket as an
        incomplete upload: invisible to listings, so no release or cleanup removes it, and
        billed until a lifecycle rule does."""
        return {"chunksize": max(nbytes, 1)} if self._s3 else {}

    def _put_then_move(self, path: str, payload: bytes) -> None:
        """Write ``path`` on a store whose PUT is not atomic (sftp, HDFS, WebDAV): under a
        temporary name of this writer's own, moved into place when complete; the temporary
        object goes if anything fails. (One name shared by every writer of the segment, and
        never removed on failure, was left behind for cleanup to find: found by a review.)"""
        tmp = temporary_name(path)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            self.fs.pipe_file(tmp, payload, **self.deadline(len(payload)))
            self.fs.mv(tmp, path)
        except BaseException:
            # (If this fails too, the shuffle's release or `hybrid-ray cleanup` removes it:
            # its directory is marked.)
            self._delete_quietly(tmp)
            raise

    def _mark_again_or_delete(self, shuffle_id: str, path: str) -> None:
        """``_mark_again_if_removed``; if that fails, the segment just written at ``path``
        is deleted before the error goes on: its shuffle was released meanwhile (its
        marker gone), so nothing will read or delete it, and unmarked it is invisible to
        `hybrid-ray cleanup` (the object stayed for good: found by a review)."""
        try:
            self._mark_again_if_removed(shuffle_id)
        except BaseException:
            self._delete_quietly(path)
            raise

    def _delete_quietly(self, path: str) -> None:
        """Delete an object this writer just made, within the usual deadline, on the way
        out of a failed write: the write's error is the one raised, not this one's, which
        is logged (credentials scrubbed) so the object left behind is named somewhere."""
        try:
            self.fs.rm_file(path, **self.deadline())
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - the store is down or refuses
            _LOG.warning(self._redactor.scrub(
                f"hybrid_ray: could not delete {path} after a failed write "
                f"({_describe(exc)}); it is left in the remote tier"))

    def _mark_again_if_removed(self, shuffle_id: str) -> None:
        """After a segment of a shuffle this process marked before: mark it again if its
        marker is gone. The shuffle was released (by the master, another process) since,
        and this segment landed after the removal: unmarked, `hybrid-ray cleanup` never
        saw it, and a writer that died before its refused commit deleted it left it for
        good. Looked for after the write, so either the marker is there once this returns
        or the removal came later and took the segment with it. One existence check per
        segment (a HEAD on S3)."""
        marker = posixpath.join(self.shuffle_path(shuffle_id), SHUFFLE_MARKER_NAME)
        self.fs.invalidate_cache(posixpath.dirname(marker))  # a listing cached here is stale
        try:
            there = self.fs.exists(marker, **self.deadline())
        except Exception:  # noqa: BLE001 - a throttled or failed check: written again
            # (the existence check is one more request, without the retries of a PUT:
            # under S3 throttling it failed writes that would have gone through).
            there = False
        if not there:
            self._write_marker(shuffle_id)

    def _write_marker(self, shuffle_id: str) -> None:
        """Mark the shuffle's directory (``SHUFFLE_MARKER_NAME``) before its first segment
        from this process: cleanup removes only marked directories. Once per process and
        shuffle (a PUT); concurrent writers write the same small object, harmlessly."""
        marker = posixpath.join(self.shuffle_path(shuffle_id), SHUFFLE_MARKER_NAME)
        if self._local:
            self._put_local(marker, shuffle_marker(shuffle_id, self.job_id))
        else:
            if not self._atomic_put:
                self.fs.makedirs(posixpath.dirname(marker), exist_ok=True)
            self.fs.pipe_file(marker, shuffle_marker(shuffle_id, self.job_id),
                              **self.deadline())
        self._marked.add(shuffle_id)

    # ---- background transfers ---------------------------------------------------------------
    # An object store answers one request at a time per connection, with a round trip of
    # milliseconds (S3) and a per-connection bandwidth far below the node's. Writers and
    # readers therefore keep a few transfers in flight and go on partitioning or decoding
    # meanwhile, as S3A's fast upload and Flink's remote tier do.
    def io_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """This process's transfer threads (created on first use, again after a fork)."""
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.io_threads, thread_name_prefix="hybrid-ray-remote")
                self._pool_pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Stop this tier's transfer threads once their queued transfers are done (a
        cache evicting the tier). A later transfer starts a new pool: closing never
        breaks a holder that still uses the tier."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def write_async(self, segment: SegmentId, payload: bytes | memoryview,
                    node_id: str = "") -> concurrent.futures.Future[SegmentMeta]:
        """Start ``write`` in the background; the payload is copied first, so the caller
        may reuse its buffer at once. The future raises what ``write`` would."""
        data = bytes(payload)
        return self.io_pool().submit(self.write, segment, data, None, node_id)

    def read_async(self, meta: SegmentMeta) -> concurrent.futures.Future[bytes]:
        """Start ``read`` in the background (a reader's read-ahead)."""
        return self.io_pool().submit(self.read, meta)

    def result_bound_s(self, nbytes: int = 0) -> float:
        """How long to wait for a background call of ``nbytes`` (``outcome``): at least
        ``RESULT_WAIT_S``, and twice an async filesystem's own call deadline (a user who
        raised its timeouts allows slower transfers), plus the bytes at
        ``REMOTE_MIN_BYTES_PER_S``."""
        base = max(RESULT_WAIT_S, 2 * (self._deadline_s or 0.0))
        return base + nbytes / REMOTE_MIN_BYTES_PER_S

    def outcome(self, future: concurrent.futures.Future[Any], what: str,
                nbytes: int = 0, bound_s: float | None = None) -> Any:
        """The result of a background ``read_async``/``write_async`` of ``nbytes``, waited
        for at most ``bound_s`` (default ``result_bound_s(nbytes)``). A call of an async
        filesystem ends by its own deadline; a sync one's (NFS through ``file://``, HDFS,
        sftp) has none, and a hung server held the waiting reader or writer forever.
        ``ShuffleStalledError`` naming ``what`` then (the call itself cannot be cancelled;
        its thread is left to end)."""
        bound = self.result_bound_s(nbytes) if bound_s is None else max(0.0, bound_s)
        try:
            return future.result(timeout=bound)
        except concurrent.futures.TimeoutError as exc:
            if future.done() and not future.cancelled() and future.exception() is exc:
                # The call's own error: fsspec's FSTimeoutError (its deadline) is a
                # TimeoutError too, and was reported as this wait running out ("did not
                # finish within 600 s" after the call's 20 s deadline).
                raise
            raise ShuffleStalledError(
                f"{what} on remote tier {self.display_path!r} did not finish within "
                f"{bound:.0f} s: the store is hung or far too slow. Check its health; "
                "run the job again once it answers") from None

    def read(self, meta: SegmentMeta) -> bytes:
        return self.read_frame(meta.location, meta.nbytes, str(meta.id))

    def read_frame(self, path: str, nbytes: int, what: str) -> bytes:
        """The ``nbytes`` stored at ``path``, which must lie below the job directory
        (paths also come from other processes, e.g. a JVM reader's request)."""
        shown = self._redactor.scrub(self.job_root)
        require_inside_remote(self.job_root, path, "read", shown)
        require_normal_remote_path(path, "read", shown)
        try:
            # The size is known: a ranged read is one GET (s3fs otherwise sends a HEAD
            # first to decide whether to split the download).
            return self.fs.cat_file(path, start=0, end=nbytes, **self.deadline(nbytes))
        except FileNotFoundError as exc:
            self._fail(SegmentNotFoundError, f"{what} is gone from the remote tier ({path})",
                       exc)
        except Exception as exc:
            self._fail(RemoteTierError, f"reading {what} from the remote tier at {path} "
                       f"failed: {_describe(exc)}. {self._timeout_hint(exc)}", exc)

    def has(self, segment: SegmentId) -> bool:
        # Bounded like every other call: an endpoint that accepts and never answers held
        # the caller for good.
        return bool(self.fs.exists(self.segment_path(segment), **self.deadline()))

    def delete(self, meta: SegmentMeta) -> None:
        """Delete one segment's object. Its location comes from another process (the
        master's books, a JVM's commit): it must be a segment of that very shuffle
        (``<shuffle>/sub-NNNNN/<file>``, not its marker), never another shuffle's object
        or anything else under the job directory, which hybrid_ray does not own alone."""
        shuffle_dir = self.shuffle_path(meta.id.shuffle_id)
        require_inside_remote(shuffle_dir, meta.location, "delete",
                              self._redactor.scrub(shuffle_dir))
        location = posixpath.normpath(meta.location)
        parts = posixpath.relpath(location, posixpath.normpath(shuffle_dir)).split("/")
        if len(parts) != 2 or not re.fullmatch(r"sub-\d+", parts[0]) \
                or parts[1] == SHUFFLE_MARKER_NAME:
            raise UnsafePathError(
                f"refusing to delete {self._redactor.scrub(location)!r}: it is not a segment "
                f"object of shuffle {meta.id.shuffle_id} (<shuffle>/sub-NNNNN/<file>). This "
                "is a bug in the caller; please report it")
        require_normal_remote_path(meta.location, "delete", self._redactor.scrub(shuffle_dir))
        try:
            self.fs.rm_file(meta.location, **self.deadline())
        except FileNotFoundError:
            pass
        except Exception as exc:  # a library's error may quote a signed URL: scrubbed
            self._fail(RemoteTierError, f"deleting {meta.id} from the remote tier at "
                       f"{location} failed: {_describe(exc)}", exc)

    def remove_shuffle_data(self, shuffle_id: str) -> None:
        path = require_inside_remote(self.job_root, self.shuffle_path(shuffle_id), "remove",
                                     self._redactor.scrub(self.job_root))
        # A map still running when its shuffle is released (a failed shuffle's other maps)
        # may land one more segment while the tree is removed ("Directory not empty" on a
        # local path); its refused commit deletes that segment, so removing again suffices.
        self._require_trusted_tree(path)
        for attempt in range(REMOVE_ATTEMPTS):
            try:
                remove_remote_tree(self.fs, path)  # verifies that nothing is left
                break
            except OSError as exc:  # a tree still changing (a late segment): again, soon
                if attempt == REMOVE_ATTEMPTS - 1:
                    self._fail(RemoteTierError, f"removing shuffle {shuffle_id} from the "
                               f"remote tier at {path} failed: {type(exc).__name__}: {exc}",
                               exc)
                self.fs.invalidate_cache()
                time.sleep(0.2 * (attempt + 1))
            except Exception as exc:  # the store unreachable: the master retries later
                # (at once: retried here, a store that is down held the release for all
                # attempts' timeouts). Scrubbed: a library's error may quote a signed URL.
                self._fail(RemoteTierError, f"removing shuffle {shuffle_id} from the remote "
                           f"tier at {path} failed: {type(exc).__name__}: {exc}", exc)
        self.fs.invalidate_cache()
        self._marked.discard(shuffle_id)  # a write after this marks the directory again
        if self._local:
            remove_empty_job_dir(path)


def remove_empty_job_dir(shuffle_path: str) -> None:
    """On a local filesystem, remove the job directory above ``shuffle_path`` if nothing
    is left in it: a ``file://`` remote tier kept one empty directory per driver run (the
    default job id is new per process). Only an empty directory goes (``rmdir``); one
    still holding anything, a live shuffle of the job or a user's file, stays. A writer
    of the same job id that finds it gone creates it again (``RemoteTier._put_local``)."""
    try:
        os.rmdir(posixpath.dirname(posixpath.normpath(shuffle_path)))
    except OSError:
        pass  # not empty, gone already, or not ours to remove: left as it is


def remove_remote_tree(fs: Any, path: str) -> None:
    """Remove a shuffle's remote tree, its marker (``SHUFFLE_MARKER_NAME``) last: a removal
    cut short (an error, a timeout, a crash) leaves the marker beside what is left, so
    `hybrid-ray cleanup`, which only touches marked directories, still finds it. Whole-tree
    calls get no per-call deadline (``call_deadline_s`` is sized for one request; a tree
    of many objects takes longer to list and delete, and a cut-off delete left data
    behind); each request inside them is bounded by the filesystem's own timeouts.
    ``path`` must be literal (no glob characters: see ``require_inside_remote``). Only
    what lies strictly below ``path`` is removed (``_tree_below``)."""
    files = _tree_below(fs, path)
    data = [f for f in files if posixpath.basename(f) != SHUFFLE_MARKER_NAME]
    if data:
        try:
            _delete_keys(fs, data)
        except FileNotFoundError:  # one vanished meanwhile; the local rm stops there
            pass
        # S3's DeleteObjects answers 200 with per-key errors, which s3fs does not raise:
        # the data is looked for again before the marker goes, or the recursive removal
        # below took the marker beside keys that failed, and cleanup never saw them again.
        fs.invalidate_cache(path)
        still = [f for f in _tree_below(fs, path)
                 if posixpath.basename(f) != SHUFFLE_MARKER_NAME]
        if still:
            raise OSError(errno.ENOTEMPTY, f"{len(still)} object(s) still under the "
                          f"shuffle's remote directory after deleting them, first "
                          f"{still[0]}; its marker stays")
    try:
        if _is_object_store(fs):
            # The keys left below the prefix (the marker), by name: a recursive rm of the
            # prefix also deletes an object whose key is the prefix itself (fsspec's
            # expand_path adds the path), someone else's object hybrid_ray never wrote.
            left_keys = _tree_below(fs, path)
            if left_keys:
                _delete_keys(fs, left_keys)
        elif fs.isdir(path):  # a file by that name is not our directory: left alone
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    # Whatever each call said: a local rm stops at the first file that vanished, and S3's
    # DeleteObjects answers 200 with per-key errors, which s3fs does not raise. A tree
    # not gone raises, so the caller retries (and the master keeps the deletion queued).
    fs.invalidate_cache(path)
    left = _tree_below(fs, path)
    if left:
        raise OSError(errno.ENOTEMPTY, f"{len(left)} object(s) still under the shuffle's "
                      "remote directory after its removal")


def _delete_keys(fs: Any, keys: Sequence[str]) -> None:
    """Delete exactly ``keys`` (as ``_tree_below`` lists them). A key ending in "/" (the
    "folder" placeholder the S3 console, s3fs-fuse, rclone or Hadoop's S3A write) goes on
    its own through ``rm_file``: in a batch ``rm``, s3fs strips the slash and deletes the
    key without it, which may be another object (``job/shf-1`` beside ``job/shf-1/``,
    someone else's), while the placeholder stayed and the removal never finished."""
    plain = [k for k in keys if not k.endswith("/")]
    if plain and _is_object_store(fs):
        fs.rm(plain)  # one request per 1,000 keys
        plain = []
    # Key by key elsewhere, every one tried: a local ``rm`` of a list stops at its first
    # failure (EPERM, EBUSY), and each retry stopped there again, keeping all the rest.
    errors: list[tuple[str, OSError]] = []
    for key in plain + [k for k in keys if k.endswith("/")]:
        try:
            fs.rm_file(key)
        except FileNotFoundError:
            pass  # gone meanwhile: what was wanted
        except OSError as exc:
            errors.append((key, exc))
    if errors:
        key, exc = errors[0]
        raise OSError(exc.errno or errno.EIO, f"{len(errors)} of {len(keys)} object(s) could "
                      f"not be deleted, first {key}: {type(exc).__name__}: {exc}")


def _tree_below(fs: Any, path: str) -> list[str]:
    """The files strictly below directory ``path`` ([] if there are none). Never ``path``
    itself: on an object store, ``find`` of a prefix with nothing below it answers the
    object whose key is the prefix, if one exists, and such an object (``job/shf-1``
    beside the tree ``job/shf-1/...``) is not hybrid_ray's: it never writes one there."""
    below = fs._strip_protocol(path).rstrip("/") + "/"
    try:
        return [f for f in fs.find(path) if f and f.startswith(below)]
    except FileNotFoundError:
        return []


def _protocols(fs: Any) -> set[str]:
    """The names of ``fs``'s protocol (fsspec gives one name or a tuple of them)."""
    return set(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else {fs.protocol}


def _is_object_store(fs: Any) -> bool:
    """Whether ``fs`` stores flat keys (S3, GCS, Azure and others: ``_FLAT_KEY_PROTOCOLS``),
    with no directories to remove."""
    return bool(_protocols(fs) & _FLAT_KEY_PROTOCOLS)


def filesystem_options(remote_path: str, storage_options: Mapping[str, Any] | None
                       ) -> dict[str, Any]:
    """``storage_options`` for fsspec with hybrid_ray's defaults for S3 (bounded timeouts,
    checksums only where required: see ``S3_TIMEOUT_DEFAULTS``); the caller's own
    ``config_kwargs`` win."""
    options = dict(storage_options or {})
    if remote_path.split("://", 1)[0] in ("s3", "s3a"):
        options["config_kwargs"] = copy.deepcopy(
            {**S3_CHECKSUM_DEFAULTS, **S3_TIMEOUT_DEFAULTS,
             **dict(options.get("config_kwargs") or {})})
    return options


def call_deadline_s(fs: Any, config_kwargs: Mapping[str, Any]) -> float | None:
    """The deadline of one call of ``fs`` (see ``CALL_DEADLINE_ATTEMPTS``): pass it as
    ``timeout=`` to each call. None for sync filesystems, which take no such keyword."""
    if not isinstance(fs, fsspec.asyn.AsyncFileSystem):
        return None
    return CALL_DEADLINE_ATTEMPTS * (float(config_kwargs.get("connect_timeout") or 5)
                                     + float(config_kwargs.get("read_timeout") or 15))


def _endpoint_of(options: Mapping[str, Any]) -> str:
    """The endpoint URL in fsspec options, without any user:password part ("" if none)."""
    endpoint = options.get("endpoint_url") or \
        dict(options.get("client_kwargs") or {}).get("endpoint_url") or ""
    parts = urllib.parse.urlsplit(str(endpoint))
    if parts.username is not None or parts.password is not None:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return str(endpoint)


def _describe(exc: BaseException) -> str:
    """``Type: message``, or just the type when the message is empty (FSTimeoutError)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _is_timeout(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a connect or read timeout."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)) or \
                "Timeout" in type(exc).__name__:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def remote_tier_key(config: Any) -> tuple | None:
    """What a ``ShuffleConfig``'s remote tier is built from, as a hashable cache key (None
    if the config has no remote tier). Kept in memory only: it holds the credentials."""
    if config.remote_path is None:
        return None
    return (config.remote_path, config.job_id, config.segment_bytes[TierName.REMOTE],
            config.remote_transfers,
            tuple(sorted((k, repr(v)) for k, v in config.storage_options.items())))


def open_remote_tier(config: Any, check_reachable: bool = False) -> RemoteTier:
    """The remote tier of a ``ShuffleConfig`` (which must have ``remote_path``): the one
    place it is built from a config."""
    return RemoteTier(config.segment_bytes[TierName.REMOTE], config.remote_path,
                      config.job_id, config.storage_options, check_reachable=check_reachable,
                      io_threads=config.remote_transfers)
