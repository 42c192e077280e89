"""``hybrid-ray status`` and ``cleanup`` as a user runs them: a subprocess, a time bound,
a real local Ray (the session's) or a dead address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from test_cleanup import _write_disk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def test_credentials_in_the_address_are_never_shown():
    """The address was quoted whole in every connection error: a password or token in a
    ray:// or http:// URL (from --address or RAY_ADDRESS) was printed."""
    port = _closed_port()
    for address in (f"ray://admin:S3cretPw99@127.0.0.1:{port}",
                    f"ray://127.0.0.1:{port}?token=S3cretTok99",
                    f"http://admin:S3cretPw99@127.0.0.1:{port}"):
        proc, _ = _cli("status", "--address", address, "--timeout", "5s", timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "no Ray cluster reachable" in proc.stderr or "cannot connect" in proc.stderr
        assert "S3cret" not in proc.stderr + proc.stdout, proc.stderr
    # The same address from RAY_ADDRESS (Ray resolves it for "auto"): it was quoted whole,
    # and with `--address auto` (the default, given) still was (found by a review).
    for address in (f"ray://admin:S3cretPw99@127.0.0.1:{port}",
                    f"127.0.0.1:{port}?token=S3cretTok99"):
        env = {**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": address}
        for command in (["status"], ["status", "--address", "auto"],
                        ["cleanup", "--address", "auto"]):
            proc = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", *command,
                                   "--timeout", "5s"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2, (command, proc.stderr)
            assert "S3cret" not in proc.stderr + proc.stdout, (command, proc.stderr)


def test_bad_timeouts_and_demo_arguments_are_refused_before_anything_runs():
    """``--timeout 1e10`` passed and crashed with OverflowError after the connection was
    made; ``demo --seed -1`` and ``--partitions 100001`` started Ray, made the data and
    failed with a traceback."""
    address = f"127.0.0.1:{_closed_port()}"
    proc, _ = _cli("status", "--address", address, "--timeout", "1e10", timeout=60)
    assert proc.returncode == 2 and "must be at most 1e+09 s" in proc.stderr, proc.stderr
    for args, message in ((("--seed", "-1"), "--seed must be 0 or more"),
                          (("--partitions", "100001"), "--partitions must be at most 100000"),
                          # A MemoryError traceback in NumPy (a review's probe):
                          (("--rows", "10000000000000"), "--rows must be at most 100000000"),
                          (("--rows", "10", "--blocks", "11"), "--blocks must be at most 10"),
                          (("--cpus", "100000"), "--cpus must be at most 256")):
        proc, elapsed = _cli("demo", *args, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and elapsed < 30


def test_status_refuses_a_namespace_no_shuffle_master_can_have():
    """``status --namespace 'hybrid ray'`` (or any name ShuffleConfig refuses) asked the
    cluster for a master that cannot exist and answered "no shuffle has run on this
    cluster yet" with exit code 0 (found by a review): refused before connecting, naming
    the option and the rule. (A dead address: the connection is never tried.)"""
    address = f"127.0.0.1:{_closed_port()}"
    for namespace in ("hybrid ray", "../etc", ""):
        proc, _ = _cli("status", "--address", address, "--namespace", namespace, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "argument --namespace: namespace" in proc.stderr, proc.stderr
        assert "no Ray cluster reachable" not in proc.stderr
    proc, _ = _cli("status", "--address", address, "--namespace", "etl.daily-2", timeout=60)
    assert "no Ray cluster reachable" in proc.stderr, proc.stderr  # a valid one is asked

def test_status_of_a_dead_address_fails_fast_naming_it():
    """Was: no answer after 150 s (ray.init retrying the dead GCS)."""
    address = f"127.0.0.1:{_closed_port()}"
    proc, elapsed = _cli("status", "--address", address, timeout=60)
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert proc.returncode != 0
    assert f"no Ray cluster reachable at {address}" in proc.stderr
    assert "--address" in proc.stderr


def test_status_of_a_live_cluster_lists_its_shuffle(ray_local, tmp_path):
    import ray

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master

    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                           namespace=f"hr-cli-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    shuffle = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle, 3, 5, config, False))
    try:
        proc, _ = _cli("status", "--address", ray.get_runtime_context().gcs_address,
                       "--namespace", config.namespace)
    finally:
        ray.get(master.release.remote(shuffle))
    assert proc.returncode == 0, proc.stderr
    assert "1 active shuffle(s)" in proc.stdout
    assert f"{shuffle}: 0/3 maps finished, 5 partitions" in proc.stdout


def test_status_of_another_namespace_names_the_namespaces_that_have_a_master(ray_local):
    """A cluster whose shuffles ran with ``ShuffleConfig(namespace="etl")``: plain
    ``hybrid-ray status`` (namespace hybrid_ray) said "no shuffle has run on this cluster
    yet". It names the namespaces that have a master and ``--namespace``."""
    import ray

    from hybrid_ray.actors import get_master

    namespace = f"hr-cli-{uuid.uuid4().hex[:6]}"
    ray.get(get_master(namespace).status.remote())
    proc, _ = _cli("status", "--address", ray.get_runtime_context().gcs_address,
                   "--namespace", f"hr-cli-none-{uuid.uuid4().hex[:6]}")
    assert proc.returncode == 0, proc.stderr
    assert "no shuffle has run on this cluster yet" not in proc.stdout, proc.stdout
    assert repr(namespace) in proc.stdout and "pass --namespace" in proc.stdout, proc.stdout


def test_status_json_gives_each_node_s_tiers_as_json(ray_local, tmp_path):
    """``status --json`` printed every node as its Python repr string ("NodeUsage(node_id=
    ..., tiers=(TierUsage(tier=<TierName.MEMORY...") : its tier usage was unusable."""
    import json

    import ray

    from hybrid_ray.actors import get_master, get_tier_manager

    namespace = f"hr-cli-{uuid.uuid4().hex[:6]}"
    get_master(namespace)
    tm = get_tier_manager(ray.get_runtime_context().get_node_id(), namespace)
    ray.get(tm.usage.remote())
    try:
        proc, _ = _cli("status", "--address", ray.get_runtime_context().gcs_address,
                       "--namespace", namespace, "--json")
    finally:
        ray.kill(tm)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["nodes"], status
    for node in status["nodes"]:
        assert isinstance(node, dict) and node["node_id"]
        assert "memory" in {t["tier"] for t in node["tiers"]}
        assert all(isinstance(t["capacity_bytes"], int) for t in node["tiers"])


def test_cleanup_keeps_a_live_shuffle_and_removes_an_orphan(ray_local, tmp_path):
    """Was: ``cleanup --older-than 0s`` on a live cluster deleted a running shuffle's data."""
    import ray

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master

    spill = str(tmp_path / "spill")
    config = ShuffleConfig(spill_dirs=[spill], progress=False,
                           namespace=f"hr-cli-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    live, orphan = f"shf-{uuid.uuid4().hex[:12]}", f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(live, 1, 2, config, False))
    try:
        _write_disk(spill, live)
        _write_disk(spill, orphan)
        proc, _ = _cli("cleanup", "--spill-dir", spill, "--older-than", "0s",
                       "--address", ray.get_runtime_context().gcs_address)
        assert proc.returncode == 0, proc.stderr
        assert os.path.isdir(os.path.join(spill, "hybrid_ray", live, "sub-00000"))
        assert not os.path.exists(os.path.join(spill, "hybrid_ray", orphan))
        assert "1 orphaned shuffle directory removed, 1 live" in proc.stdout
    finally:
        ray.get(master.release.remote(live))


def test_cleanup_without_a_cluster_removes_nothing_unless_told(tmp_path):
    spill = str(tmp_path / "spill")
    orphan = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, orphan)
    address = f"127.0.0.1:{_closed_port()}"
    proc, elapsed = _cli("cleanup", "--spill-dir", spill, "--older-than", "0s",
                         "--address", address, timeout=60)
    assert proc.returncode == 2 and elapsed < 30
    assert "removed nothing" in proc.stderr and "--no-cluster" in proc.stderr
    assert os.path.isdir(os.path.join(spill, "hybrid_ray", orphan))
    proc, _ = _cli("cleanup", "--spill-dir", spill, "--older-than", "0s", "--no-cluster")
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(os.path.join(spill, "hybrid_ray", orphan))


def test_demo_runs_on_a_ray_of_its_own_and_leaves_nothing(tmp_path):
    """The README's first command: the demo shuffles through all three tiers, checks the
    multiset and counts leftover files. It starts its own Ray even where RAY_ADDRESS (or a
    `ray start` cluster) names another one: it used to try to join it and fail."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "demo", "--rows", "20000",
                           "--blocks", "4", "--partitions", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows in 20,000 out 20,000; multiset identical: True" in proc.stdout
    assert "files left in spill and remote dirs: 0" in proc.stdout
    tiers = {line.split()[1] for line in proc.stdout.splitlines()
             if len(line.split()) == 4 and line.split()[1] in ("memory", "disk", "remote")}
    assert tiers == {"memory", "disk", "remote"}, proc.stdout


def test_cleanup_refuses_an_address_together_with_no_cluster(tmp_path):
    """--no-cluster silently won over a given --address: the cluster named was never
    asked which shuffles are live."""
    proc, _ = _cli("cleanup", "--spill-dir", str(tmp_path), "--address", "127.0.0.1:1",
                   "--no-cluster")
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr and "--address" in proc.stderr


def test_cleanup_refuses_arguments_that_would_examine_nothing_or_the_wrong_place(tmp_path,
                                                                                 capsys):
    """Each was accepted: a typo'd spill dir (or a {node_id} pattern matching nothing)
    examined nothing and exited 0; an empty one swept ./hybrid_ray of the current
    directory; an empty remote path skipped the remote tier; a 0 s timeout made every
    connection fail at once and told the user no cluster was reachable."""
    from hybrid_ray.cli import main

    def refused(*argv: str) -> str:
        capsys.readouterr()
        try:
            code = main(["cleanup", *argv])
        except SystemExit as exc:  # argparse's refusal
            code = exc.code
        assert code == 2, f"accepted {argv}: exit {code}"
        return capsys.readouterr().err

    missing = str(tmp_path / "no-such-dir")
    assert f"--spill-dir {missing} is not a directory" in refused(
        "--spill-dir", missing, "--no-cluster")
    assert "matches no directory" in refused(
        "--spill-dir", str(tmp_path / "spill-{node_id}"), "--no-cluster")
    assert "--spill-dir is empty" in refused("--spill-dir", "", "--no-cluster")
    assert "--remote-path is empty" in refused(
        "--spill-dir", str(tmp_path), "--remote-path", " ", "--no-cluster")
    assert "invalid timeout '0': it must be above 0" in refused(
        "--spill-dir", str(tmp_path), "--timeout", "0")
    # One missing beside one that exists (the same command on every node; a node that
    # never spilled has no spill dir): skipped with a warning, the rest swept.
    spill = str(tmp_path / "spill")
    orphan = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, orphan)
    capsys.readouterr()
    assert main(["cleanup", "--spill-dir", missing, "--spill-dir", spill, "--older-than", "0s",
                 "--no-cluster"]) == 0
    assert f"skipped --spill-dir {missing}: it is not a directory here" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(spill, "hybrid_ray", orphan))



def test_cleanup_refuses_a_local_remote_path_that_is_no_directory(tmp_path, capsys):
    """Was: ``cleanup --remote-path file:///typo --no-cluster`` (or a file's path) listed
    nothing and reported "0 orphaned shuffle directories removed", exit 0, as a typo'd
    --spill-dir once did. Alone it is refused; beside a spill dir that exists it is
    skipped with a warning and the spill dir swept."""
    from hybrid_ray.cli import main

    missing = str(tmp_path / "no-such-remote")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for given, why in ((f"file://{missing}", "does not exist"), (missing, "does not exist"),
                       (f"file://{a_file}", "is not a directory")):
        capsys.readouterr()
        assert main(["cleanup", "--remote-path", given, "--no-cluster"]) == 2, given
        assert f"--remote-path {given} {why}; check the path (nothing was removed)" \
            in capsys.readouterr().err
    spill = str(tmp_path / "spill")
    orphan = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, orphan)
    capsys.readouterr()
    assert main(["cleanup", "--remote-path", f"file://{missing}", "--spill-dir", spill,
                 "--older-than", "0s", "--no-cluster"]) == 0
    assert f"skipped --remote-path file://{missing}: it does not exist here" \
        in capsys.readouterr().err
    assert not os.path.exists(os.path.join(spill, "hybrid_ray", orphan))


def test_cleanup_of_a_remote_path_leaves_the_default_spill_dir_alone(tmp_path, capsys,
                                                                    monkeypatch):
    """``cleanup --remote-path URL --no-cluster`` swept the default spill dir as well,
    which the command did not name: a review's run removed a marked shuffle directory of
    another job from the machine's shared default spill dir. Without --spill-dir, the
    default spill dir is swept only when no --remote-path is given either."""
    import hybrid_ray.config
    from hybrid_ray.cli import main

    default = str(tmp_path / "default-spill")
    monkeypatch.setattr(hybrid_ray.config, "default_spill_dir", lambda: default)
    orphan = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(default, orphan)
    remote = tmp_path / "remote"
    remote.mkdir()
    capsys.readouterr()
    assert main(["cleanup", "--no-cluster", "--older-than", "0",
                 "--remote-path", f"file://{remote}"]) == 0
    assert os.path.isdir(os.path.join(default, "hybrid_ray", orphan))
    assert "0 orphaned shuffle directories removed" in capsys.readouterr().out
    # Named nothing: the default spill dir is what it sweeps.
    assert main(["cleanup", "--no-cluster", "--older-than", "0"]) == 0
    assert not os.path.exists(os.path.join(default, "hybrid_ray", orphan))


def test_cleanup_refuses_the_data_dir_given_as_the_spill_dir(tmp_path, capsys):
    """Was: ``--spill-dir <spill>/hybrid_ray`` (the directory the shuffle directories are
    seen in) was searched for a ``hybrid_ray`` dir of its own, found none, removed nothing
    and exited 0, the orphan kept."""
    from hybrid_ray.cli import main

    spill = str(tmp_path / "spill")
    orphan = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, orphan)
    data_dir = os.path.join(spill, "hybrid_ray")
    capsys.readouterr()
    assert main(["cleanup", "--no-cluster", "--older-than", "0",
                 "--spill-dir", data_dir]) == 2
    assert (f"--spill-dir {data_dir} is the hybrid_ray directory inside a spill dir, not a "
            f"spill dir; give the spill dir itself: --spill-dir {spill} (nothing was "
            "removed)") in capsys.readouterr().err
    assert os.path.isdir(os.path.join(data_dir, orphan))
    # A spill dir that happens to be named hybrid_ray (its own data dir inside) is fine.
    named = str(tmp_path / "hybrid_ray")
    _write_disk(named, orphan)
    assert main(["cleanup", "--no-cluster", "--older-than", "0", "--spill-dir", named]) == 0
    assert not os.path.exists(os.path.join(named, "hybrid_ray", orphan))


@pytest.mark.parametrize("address, host, port", [
    ("ray://[::1]:10001", "::1", "10001"), ("ray://[::1]", "::1", ""),
    ("ray://user@[fe80::2]:10002?x=1", "fe80::2", "10002"),
    ("ray://headnode:10003", "headnode", "10003"), ("ray://headnode", "headnode", "")])
def test_a_ray_client_address_s_host_and_port_are_found_also_for_ipv6(monkeypatch, address,
                                                                      host, port):
    """Was: ``[::1]:10001`` split at its first colon: host ``[``, port ``:1]:10001``, and
    "no Ray cluster reachable ... invalid literal for int()"."""
    from hybrid_ray import cli

    asked = []

    def refuse(target, timeout):
        asked.append(target)
        raise OSError("refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(cli.CliError, match="no Ray cluster reachable"):
        cli._connect(address, 1)
    assert asked == [(host, int(port or 10001))]

def test_a_host_name_that_does_not_resolve_in_time_ends_within_the_timeout(monkeypatch):
    """Was: the GCS port was probed with ``socket.create_connection``, whose timeout bounds
    the connection but not the lookup of the host name before it: with a DNS server that
    does not answer, ``status --address ray-head.example.com:6379 --timeout 3s`` took
    12 s (glibc's default 2 x 5 s; up to minutes with resolv.conf's ``timeout``/``attempts``)."""
    import threading

    from hybrid_ray import cli

    released = threading.Event()
    real_getaddrinfo = socket.getaddrinfo

    def silent_dns(host, *args, **kwargs):
        if host == "ray-head.example.com":
            released.wait(60)  # a resolver that never answers
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", silent_dns)
    started = time.monotonic()
    try:
        with pytest.raises(cli.CliError, match="within 1 s") as caught:
            cli._connect("ray-head.example.com:6379", 1)
        elapsed = time.monotonic() - started
    finally:
        released.set()
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert caught.value.code == 2 and "--timeout" in str(caught.value), caught.value


def test_cleanup_reads_storage_options_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """Credentials in --storage-options were readable by every local user (``ps``): the
    options also come from @FILE or $HYBRID_RAY_STORAGE_OPTIONS, and a malformed one is
    named without its content being quoted."""
    from hybrid_ray.cli import CliError, _storage_options

    secret = '{"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}'
    (tmp_path / "opts.json").write_text(secret)
    assert _storage_options(f"@{tmp_path / 'opts.json'}") == {
        "key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}
    monkeypatch.setenv("HYBRID_RAY_STORAGE_OPTIONS", '{"anon": true}')
    assert _storage_options(None) == {"anon": True}
    assert _storage_options('{"anon": false}') == {"anon": False}  # given wins
    monkeypatch.delenv("HYBRID_RAY_STORAGE_OPTIONS")
    assert _storage_options(None) == {}
    (tmp_path / "bad.json").write_text('{"secret": "s3cr3t-value",}')
    with pytest.raises(CliError) as err:
        _storage_options(f"@{tmp_path / 'bad.json'}")
    assert f"--storage-options file {tmp_path / 'bad.json'} is not JSON (line 1" in str(err.value)
    assert "s3cr3t" not in str(err.value)
    with pytest.raises(CliError, match="cannot read the --storage-options file .*missing"):
        _storage_options(f"@{tmp_path / 'missing'}")
    # Not UTF-8: a UnicodeDecodeError traceback before (found by a review).
    (tmp_path / "latin.json").write_bytes(b'\xff{"secret": "s3cr3t-value"}')
    with pytest.raises(CliError, match="file .*latin.json is not UTF-8 text"):
        _storage_options(f"@{tmp_path / 'latin.json'}")
    monkeypatch.setenv("HYBRID_RAY_STORAGE_OPTIONS", '["not", "an", "object"]')
    with pytest.raises(CliError, match=r"\$HYBRID_RAY_STORAGE_OPTIONS must be a JSON object"):
        _storage_options(None)



@pytest.mark.parametrize("options", [{"config_kwargs": {"read_timeout": "x"}},
                                     {"config_kwargs": 5}, {"client_kwargs": 5}])
def test_cleanup_refuses_bad_storage_options_with_a_message_not_a_traceback(tmp_path,
                                                                            options):
    """``cleanup --remote-path`` took --storage-options unchecked: a config_kwargs that is
    no mapping, or a timeout that is no number, ended it in a TypeError or ValueError
    traceback (a client_kwargs that is none in an error per path) (found by a review).
    Refused as a ShuffleConfig refuses them: exit code 2, the option named, no value
    quoted, nothing examined."""
    import json

    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({**options, "secret": "s3cr3t-value"}))
    proc, _ = _cli("cleanup", "--no-cluster", "--spill-dir", str(tmp_path),
                   "--remote-path", "s3://bucket/prefix", "--storage-options", f"@{opts}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    name = next(iter(options))
    assert f"hybrid-ray cleanup: storage_options['{name}']" in proc.stderr
    assert "s3cr3t" not in proc.stdout + proc.stderr

_STOPPED_GCS_PARENT = r'''
import os, signal, subprocess, sys, tempfile, time
import ray

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
         configure_logging=False)
node = ray._private.worker._global_node
gcs_pid = node.all_processes["gcs_server"][0].process.pid
child_code = """
import os, signal, sys
from hybrid_ray import cleanup, cli
asked = cleanup.live_shuffles
def with_the_gcs_stopped(timeout_s):
    os.kill(int(os.environ["GCS_PID"]), signal.SIGSTOP)
    return asked(timeout_s)
cleanup.live_shuffles = with_the_gcs_stopped
sys.exit(cli.main(sys.argv[1:]))
"""
env = dict(os.environ, GCS_PID=str(gcs_pid))
env.pop("RAY_ADDRESS", None)
started = time.monotonic()
child = subprocess.Popen([sys.executable, "-c", child_code, "cleanup", "--spill-dir",
                          tempfile.mkdtemp(), "--address", node.gcs_address, "--timeout",
                          "3s"], env=env, stderr=subprocess.PIPE, text=True)
try:
    _, err = child.communicate(timeout=90)
    print(f"RC {child.returncode} AFTER {time.monotonic() - started:.1f}")
    print(err[-2000:])
except subprocess.TimeoutExpired:
    child.kill()
    child.communicate()
    print(f"STILL RUNNING AFTER {time.monotonic() - started:.1f}")
finally:
    os.kill(gcs_pid, signal.SIGCONT)
    ray.shutdown()
'''


def test_cleanup_ends_within_its_timeout_when_the_gcs_stops_answering(tmp_path):
    """`cleanup --timeout 3s` reported the silent GCS within its bound, then returned from
    main, and Ray's exit hook (ray.shutdown) waited on the GCS as long as it stayed
    stopped: over 240 s (found by a review). The CLI now leaves at once after a timeout."""
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", _STOPPED_GCS_PARENT], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert "RC 1 AFTER" in out, out + proc.stderr[-2000:]
    elapsed = float(out.split("RC 1 AFTER ")[1].split()[0])
    assert elapsed < 45, out  # (3 s bound; the rest is the child's start on 2 shared cores)
    assert "did not answer within 3 s" in out and "removed nothing" in out, out


def test_status_of_a_port_that_accepts_and_never_answers_ends_within_its_timeout():
    """A listener that accepts connections and never speaks (not a Ray GCS): the
    connection's handshake is bounded by --timeout, then the CLI leaves with exit 3."""
    silent = socket.socket()
    silent.bind(("0.0.0.0", 0))  # (Ray resolves 127.0.0.1 to the node's own address)
    silent.listen(16)  # the kernel accepts; nobody answers
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        proc, elapsed = _cli("status", "--address", address, "--timeout", "3s", timeout=120)
    finally:
        silent.close()
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "did not complete the handshake within 3 s" in proc.stderr
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_status_shows_the_master_s_failing_background_loop():
    """The master counts the failures of its expiry and deletion loop (kept for
    ``status``), but only ``status --json`` showed them: a master whose loop kept failing,
    so that orphans never expired and deletions never ran, looked healthy."""
    from hybrid_ray.cli import status_lines

    status = {"shuffles": [], "nodes": [], "unanswered_nodes": [], "pending_deletions": [],
              "background_errors": {"count": 3, "last": "KeyError: 'shf-1'"}}
    assert status_lines(status) == [
        "0 active shuffle(s)",
        "shuffle master's background loop failed 3 time(s) (last: KeyError: 'shf-1'): "
        "orphaned shuffles may not expire and deletions may not run; see the master's log"]
    status["background_errors"] = {"count": 0, "last": ""}
    assert status_lines(status) == ["0 active shuffle(s)"]


def test_status_tells_deletions_running_or_queued_from_failing_ones():
    """Deletions running now are listed since stop_spark waits for them; each line said
    "0 failed attempt(s), last: None" under "pending (retried until the data is gone)", so
    a healthy master's ordinary deletions read as failing ones."""
    from hybrid_ray.cli import status_lines

    def deletion(what, attempts, error, running):
        return {"shuffle_id": "shf-1", "what": what, "attempts": attempts,
                "last_error": error, "running": running}

    status = {"shuffles": [], "nodes": [], "unanswered_nodes": [], "pending_deletions": [
        deletion("shuffle shf-1", 0, None, True),
        deletion("3 segment(s) of shuffle shf-1", 0, None, False),
        deletion("shuffle shf-2", 2, "OSError: EBUSY", False)]}
    assert status_lines(status) == [
        "0 active shuffle(s)",
        "3 deletion(s) not done yet (a failed one is retried until the data is gone):",
        "  shuffle shf-1: running now",
        "  3 segment(s) of shuffle shf-1: queued",
        "  shuffle shf-2: queued; 2 failed attempt(s), last: OSError: EBUSY"]


def test_status_names_where_an_idle_node_s_memory_budget_comes_from():
    """A node with no shuffle writing has a memory budget of 0 (the shuffles' configs set
    it): status printed "memory used 0.0 MB of 0.0 MB", which read as a node without a
    memory tier (a review's note). A disk tier's line is unchanged."""
    from hybrid_ray import TierName
    from hybrid_ray.cli import status_lines
    from hybrid_ray.tier_manager import NodeUsage
    from hybrid_ray.tiers import TierUsage

    def lines(memory):
        node = NodeUsage("n1", (memory, TierUsage(TierName.DISK, 0, None, 0)), (), {})
        return status_lines({"shuffles": [], "nodes": [node], "unanswered_nodes": [],
                             "pending_deletions": []})

    assert lines(TierUsage(TierName.MEMORY, 0, 0, 0))[2:] == [
        "  memory  used        0.0 MB of a budget set by the shuffles that write here "
        "(none now)",
        "  disk    used        0.0 MB of unbounded"]
    assert lines(TierUsage(TierName.MEMORY, 2_000_000, 8_000_000, 1))[2] == \
        "  memory  used        2.0 MB of 8.0 MB"
