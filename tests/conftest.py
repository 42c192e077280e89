"""Shared fixtures: one local Ray per session, a moto S3 server over real HTTP, tmpfs disks."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import uuid

import pytest

S3_KEY, S3_SECRET = "testing", "testing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray():
    """A local single-node Ray shared by the session (start-up costs ~5 s); started again
    only if a multi-node module shut it down. Every module starts it this way, so which
    module runs first does not matter."""
    import ray

    if not ray.is_initialized():
        # Workers must import test modules (remote functions defined in them) and this
        # checkout's hybrid_ray (not another checkout's editable install: a git worktree).
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        repo_dir = os.path.dirname(tests_dir)
        # address="local": always a fresh local Ray, never the last cluster a multi-node
        # module recorded in /tmp/ray (ray.init() with no address would join it).
        ray.init(address="local", num_cpus=2, object_store_memory=2 * 1024**3,
                 include_dashboard=False,
                 log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": f"{repo_dir}:{tests_dir}"}})
    return ray  # left running for later tests; Ray shuts down at interpreter exit


def multinode_cluster(nodes: int):
    """A ``ray.cluster_utils.Cluster`` of ``nodes`` 1-CPU nodes (the first is the head) with
    this process connected to it, for a module fixture to yield and then pass to
    ``stop_cluster``. The single-node session of other modules is shut down first."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    cluster = Cluster()
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, object_store_memory=300 * 1024**2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{os.path.dirname(tests_dir)}:{tests_dir}"}})
    return cluster


def stop_cluster(cluster) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def ray_local():
    """The session's local Ray (``start_local_ray``)."""
    return start_local_ray()


# Namespace of the Spark sessions' own exchanges in the modules using the ``spark``
# fixture: apart from the bridge's shuffles, whose tier accounting those tests check.
SPARK_EXCHANGE_NAMESPACE = "hr_spark_exchanges"


@pytest.fixture(scope="module")
def spark(request):
    """One RayDP Spark session per module (~30 s to start), its exchanges through
    hybrid_ray's shuffle manager (the default) in ``SPARK_EXCHANGE_NAMESPACE``."""
    import spark_bridge
    from hybrid_ray import ShuffleConfig

    start_local_ray()
    module = request.module.__name__.rsplit(".", 1)[-1]
    session = spark_bridge.init_spark(
        f"hybrid_ray-{module}", num_executors=2, executor_cores=1, executor_memory="1GB",
        configs={"spark.sql.shuffle.partitions": "4"},
        shuffle_config=ShuffleConfig(namespace=SPARK_EXCHANGE_NAMESPACE, progress=False))
    session.sparkContext.setLogLevel("ERROR")
    yield session
    spark_bridge.stop_spark()
    assert spark_bridge.held_shuffles() == []


@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto S3 server on 127.0.0.1: real HTTP, real S3 API (as s3fs tests itself)."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint):
    """A fresh bucket; returns (remote_path, storage_options)."""
    import s3fs

    options = {"endpoint_url": moto_endpoint, "key": S3_KEY, "secret": S3_SECRET}
    bucket = f"hr-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    yield f"s3://{bucket}/shuffle", options
    try:
        fs.rm(bucket, recursive=True)
    except FileNotFoundError:
        pass


def mounted_tmpfs(size_mib: int, skip_reason: str):
    """Yield a fresh tmpfs of ``size_mib`` MiB (a real filesystem that fills up), unmounted
    and removed afterwards; the test is skipped, with ``skip_reason``, where mounting is
    refused. For generator fixtures: ``yield from mounted_tmpfs(...)``."""
    path = tempfile.mkdtemp(prefix="hr-tmpfs-")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", path],
                            capture_output=True, text=True)
    if result.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); {skip_reason}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)
    os.rmdir(path)


@pytest.fixture
def small_disk():
    """A 64 MiB tmpfs; skipped where mounting is refused."""
    yield from mounted_tmpfs(64, "disk-full behaviour is covered with disk_capacity_bytes "
                                 "instead")


def files_under(path: str) -> list[str]:
    """Every regular file below ``path`` (empty list if it does not exist)."""
    out = []
    for root, _dirs, files in os.walk(path):
        out.extend(os.path.join(root, f) for f in files)
    return out


def segment_files_under(path: str) -> list[str]:
    """``files_under`` without shuffle-directory markers: what a writer's abort must leave
    (the marker stays until the shuffle is released, which removes its directory)."""
    from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME

    return [f for f in files_under(path) if os.path.basename(f) != SHUFFLE_MARKER_NAME]


def row_fingerprint(tables) -> tuple[int, int]:
    """Order-independent fingerprint of a row multiset: (rows, sum of 64-bit row hashes)."""
    import numpy as np
    import pandas as pd

    rows, total = 0, 0
    for t in tables:
        if t.num_rows:
            h = pd.util.hash_pandas_object(t.to_pandas(), index=False).to_numpy()
            total = (total + int(h.astype(np.uint64).sum(dtype=np.uint64))) % (1 << 64)
            rows += t.num_rows
    return rows, total


def base_config(tmp_path, **kw):
    """A ShuffleConfig for tests: spill dir under tmp_path, no progress bar, small
    segments (so a few MB of data makes many segments and crosses tiers)."""
    from hybrid_ray import MiB, ShuffleConfig

    kw.setdefault("spill_dirs", [str(tmp_path / "spill")])
    kw.setdefault("progress", False)
    kw.setdefault("segment_bytes", {"memory": 256 * 1024, "disk": 512 * 1024,
                                    "remote": 1 * MiB})
    return ShuffleConfig(**kw)


def wait_for_a_delivery(namespace: str, bound_s: float) -> bool:
    """Run in a map: wait until the master of ``namespace`` counts segments delivered to a
    reader of a live shuffle, at most ``bound_s``; whether it did. A map that must still run
    while reducers consume (hybrid) waits on this instead of sleeping a fixed time that a
    reducer slow to start on a loaded machine outlasts."""
    import time

    import ray

    from hybrid_ray.actors import master_handle

    master = master_handle(namespace)
    deadline = time.monotonic() + bound_s
    while True:
        for shuffle_id in ray.get(master.live_shuffles.remote()):
            try:
                readers = ray.get(master.progress.remote(shuffle_id))["readers"]
            except ray.exceptions.RayTaskError:  # released meanwhile
                continue
            if any(r["delivered"] > 0 for r in readers.values()):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def redactor_failing_once(redactor_class: type) -> type:
    """A ``redactor_class`` whose first construction raises (an error whose text cannot
    be scrubbed), every later one as the original: for the deletion runner's tests."""

    class RedactorFailingOnce(redactor_class):
        failed = False

        def __init__(self, *args, **kwargs):
            if not RedactorFailingOnce.failed:
                RedactorFailingOnce.failed = True
                raise RuntimeError("injected: the error could not be scrubbed")
            super().__init__(*args, **kwargs)

    return RedactorFailingOnce


def assert_no_leftovers(config, ray_mod) -> None:
    """Nothing of a released shuffle remains: no spill files, no file:// remote objects
    (tests check S3 buckets themselves), no bytes in this node's tier accounting."""
    from hybrid_ray.actors import get_tier_manager

    for d in config.spill_dirs:
        assert files_under(d) == [], f"files left in {d}"
    if config.remote_path and config.remote_path.startswith("file://"):
        path = config.remote_path.removeprefix("file://")
        assert files_under(path) == [], "objects left under the remote path"
    tm = get_tier_manager(ray_mod.get_runtime_context().get_node_id(), config.namespace)
    usage = ray_mod.get(tm.usage.remote())
    assert all(t.used_bytes == 0 for t in usage.tiers), usage


class TcpProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target_port``, for storage faults over real
    sockets: ``down()`` resets every connection (the store is unreachable) until ``up()``."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self._down = threading.Event()
        self._conns: list = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        self._down.set()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    def up(self) -> None:
        self._down.clear()

    def close(self) -> None:
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass


class ThrottlingS3Proxy:
    """An HTTP proxy in front of an S3 endpoint that can throttle: after ``throttle(n)``
    the next ``n`` requests are answered with a real S3 ``503 SlowDown`` error (status,
    headers and XML body as S3 sends them) instead of being forwarded; every other request
    goes to the endpoint unchanged. ``throttled`` counts the errors served. ``fail(n, 500,
    "InternalError")`` answers the next ``n`` requests with another S3 error instead.
    ``deny_lists = True`` answers every listing with 403 AccessDenied (credentials without
    s3:ListBucket), not counted."""

    SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b'<Message>Please reduce your request rate.</Message>'
                 b'<RequestId>hr-throttle</RequestId><HostId>hr-throttle</HostId></Error>')

    def __init__(self, target_port: int) -> None:
        import http.client
        import http.server
        import threading

        proxy = self
        self.target_port = target_port
        self.throttled = 0
        self.forwarded = 0
        self._to_throttle = 0
        self._error = (503, "Slow Down", self.SLOW_DOWN)
        self.deny_lists = False
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    throttle = proxy._to_throttle > 0
                    status, reason, error_body = proxy._error
                    if proxy.deny_lists and self.command == "GET" and "list-type=" in self.path:
                        throttle, status, reason = True, 403, "AccessDenied"
                        error_body = proxy.SLOW_DOWN.replace(
                            b"<Code>SlowDown</Code>", b"<Code>AccessDenied</Code>").replace(
                            b"Please reduce your request rate.", b"Access Denied")
                    elif throttle:
                        proxy._to_throttle -= 1
                        proxy.throttled += 1
                    else:
                        proxy.forwarded += 1
                if throttle:
                    self.send_response(status, reason)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error_body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error_body)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port,
                                                      timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("connection", "expect")}
                    upstream.request(self.command, self.path, body=body or None,
                                     headers=headers)
                    resp = upstream.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("connection", "transfer-encoding",
                                             "content-length", "server", "date"):
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" \
                        else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def throttle(self, n: int) -> None:
        """Answer the next ``n`` requests with 503 SlowDown."""
        with self._lock:
            self._to_throttle = n
            self._error = (503, "Slow Down", self.SLOW_DOWN)

    def fail(self, n: int, status: int, code: str) -> None:
        """Answer the next ``n`` requests with S3 error ``code`` (e.g. 500 InternalError)."""
        body = self.SLOW_DOWN.replace(b"<Code>SlowDown</Code>", f"<Code>{code}</Code>".encode()
                                      ).replace(b"Please reduce your request rate.",
                                                b"We encountered an internal error.")
        with self._lock:
            self._to_throttle = n
            self._error = (status, code, body)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def record_fault_outcome(scenario: str, outcome: str, seconds: float, bytes_left: int) -> None:
    """Append a fault scenario's measured outcome to the JSON-lines file named by
    ``HYBRID_RAY_FAULT_LOG`` (if set): the README's reliability table is built from it."""
    import json

    path = os.environ.get("HYBRID_RAY_FAULT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, "outcome": outcome,
                                "seconds": round(seconds, 1), "bytes_left": bytes_left}) + "\n")
