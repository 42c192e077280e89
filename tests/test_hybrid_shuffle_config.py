"""spark_bridge.hybrid_shuffle's Spark settings and jar lookup, without starting Spark."""

from __future__ import annotations

import json
import uuid

import pytest

from hybrid_ray import ShuffleConfig
from hybrid_ray.spark_jvm import config_from_json, config_to_json
from spark_bridge import hybrid_shuffle
from spark_bridge.hybrid_shuffle import app_prefix


def test_spark_configs_wire_the_jar_and_the_settings(tmp_path):
    MANAGER_CLASS, shuffle_manager_configs = (hybrid_shuffle.MANAGER_CLASS,
                                              hybrid_shuffle.shuffle_manager_configs)
    config = ShuffleConfig(spill_dirs=[str(tmp_path)], namespace="ns1", progress=False)
    jar = tmp_path / "hybrid-ray-spark-0.1.0.jar"
    jar.write_bytes(b"")
    confs = shuffle_manager_configs(config, str(jar))
    assert confs["spark.shuffle.manager"] == MANAGER_CLASS
    assert confs["raydp.executor.extraClassPath"] == confs["spark.driver.extraClassPath"] \
        == str(jar)
    assert confs["spark.shuffle.service.enabled"] == "false"
    assert confs["spark.sql.adaptive.localShuffleReader.enabled"] == "false"
    assert confs["spark.hybridray.namespace"] == "ns1"
    assert json.loads(confs["spark.hybridray.config"])["spill_dirs"] == [str(tmp_path)]


def test_spark_configs_refuse_a_config_or_jar_spark_could_not_use(tmp_path, monkeypatch):
    """Starting RayDP by hand (README) goes through shuffle_manager_configs: a dict config
    failed with a bare AttributeError, and a jar of None or a relative path was taken (Spark
    made None the class path "None"; executors resolve a relative one in their own
    directory), failing only when Spark loaded the manager."""
    from hybrid_ray import ConfigError
    from spark_bridge.hybrid_shuffle import shuffle_manager_configs

    jar = tmp_path / "hybrid-ray-spark-0.1.0.jar"
    jar.write_bytes(b"")
    config = ShuffleConfig(spill_dirs=[str(tmp_path)], progress=False)
    with pytest.raises(ConfigError, match="config must be a ShuffleConfig, got dict"):
        shuffle_manager_configs({"spill_dirs": [str(tmp_path)]}, str(jar))
    monkeypatch.chdir(tmp_path)
    for bad in (None, "", jar.name, str(tmp_path / "missing.jar")):
        with pytest.raises(ConfigError, match=r"jar must be the absolute path .* pass "
                                              r"spark_bridge.hybrid_shuffle"):
            shuffle_manager_configs(config, bad)
    # init_spark's own lookup gives an absolute path for a relative HYBRID_RAY_SPARK_JAR.
    monkeypatch.setenv("HYBRID_RAY_SPARK_JAR", jar.name)
    assert hybrid_shuffle.shuffle_manager_jar() == str(jar)
    assert shuffle_manager_configs(config, str(jar))["spark.driver.extraClassPath"] == str(jar)


def test_config_round_trips_without_remote_tier_or_credentials(tmp_path):
    config = ShuffleConfig(spill_dirs=[str(tmp_path)], disk_capacity_bytes=5_000_000,
                           remote_path=f"file://{tmp_path}/remote",
                           storage_options={"secret": "s3cr3t"}, progress=False)
    text = config_to_json(config)
    assert "s3cr3t" not in text and "remote" not in json.loads(text)
    back = config_from_json(json.loads(text))
    assert back == config.replace(remote_path=None, storage_options={})


def test_a_config_key_the_jvm_path_does_not_take_is_refused(tmp_path):
    """spark.hybridray.config may be written by hand (README): a misspelt key or a remote
    tier there was dropped silently, and the shuffles ran on the default spill dir."""
    from hybrid_ray import ConfigError

    with pytest.raises(ConfigError, match=r"spark.hybridray.config has key\(s\) "
                                          r"\['spill_dir'\] it does not take; it takes "
                                          r"\[.*'spill_dirs'"):
        config_from_json({"spill_dir": [str(tmp_path)]})
    with pytest.raises(ConfigError, match=r"\['remote_path'\].*a remote tier is given to "
                                          r"spark_bridge.init_spark\(shuffle_config=...\)"):
        config_from_json({"remote_path": "s3://bucket/x"})
    # What init_spark writes (and the session fields the JVM adds) is taken.
    sent = json.loads(config_to_json(ShuffleConfig(spill_dirs=[str(tmp_path)],
                                                   progress=False), "/tmp/token-file"))
    sent["session_token"] = "s0123"
    assert config_from_json(sent).spill_dirs == (str(tmp_path),)


def test_missing_jar_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRID_RAY_SPARK_JAR", raising=False)
    monkeypatch.setattr(hybrid_shuffle, "JAR_DIRS", (str(tmp_path),))
    with pytest.raises(hybrid_shuffle.ShuffleJarMissingError, match=r"\./dev setup"):
        hybrid_shuffle.shuffle_manager_jar()
    (tmp_path / "hybrid-ray-spark-0.1.0.jar").write_bytes(b"")
    assert hybrid_shuffle.shuffle_manager_jar() == str(tmp_path / "hybrid-ray-spark-0.1.0.jar")


def test_the_newest_jar_is_used_not_the_last_by_name(monkeypatch, tmp_path):
    """A version bump leaves the old jar beside the new one (Maven's jvm/target, a wheel's
    build dir): the last by name was used, and 0.9.0 sorts after 0.10.0, so Spark loaded
    the stale manager (found by a review)."""
    import os

    monkeypatch.delenv("HYBRID_RAY_SPARK_JAR", raising=False)
    monkeypatch.setattr(hybrid_shuffle, "JAR_DIRS", (str(tmp_path),))
    old, new = tmp_path / "hybrid-ray-spark-0.9.0.jar", tmp_path / "hybrid-ray-spark-0.10.0.jar"
    old.write_bytes(b"")
    new.write_bytes(b"")
    os.utime(old, (1_000_000, 1_000_000))
    assert hybrid_shuffle.shuffle_manager_jar() == str(new)


def test_app_prefix_matches_the_jvms_shuffle_ids():
    # HybridRayContext.appKey: characters outside [A-Za-z0-9_.-] become "_", last 80 kept;
    # sessionTag: the token's SHA-256, first 8 hex digits (HybridRayMapOutputWriterTest).
    token = "s0123456789abcdef0123456789abcdef"
    assert app_prefix("spark-application-17/95", token) == \
        "spark-spark-application-17_95-acbe04b0-"
    assert app_prefix("y" + "x" * 80, token) == "spark-" + "x" * 80 + "-acbe04b0-"


def test_two_sessions_of_one_application_id_get_apart_shuffle_ids():
    """Two drivers started in the same millisecond (RayDP's app ids are timestamps), or one
    restarted under its old id, shared every shuffle id: the second took over the first's
    shuffle state at the master and could be served its segments."""
    app = "app-20261125015300123"
    assert app_prefix(app, f"s{uuid.uuid4().hex}") != app_prefix(app, f"s{uuid.uuid4().hex}")
    with pytest.raises(ValueError, match="session token"):
        app_prefix("app-1", "")
    # No run of the token's characters in the id: it is the key to the session's config.
    token = f"s{uuid.uuid4().hex}"
    tag = app_prefix(app, token).split("-")[-2]
    assert len(tag) == 8 and tag not in token


def test_session_token_resolves_the_whole_config_outside_sparks_conf(tmp_path):
    from hybrid_ray.spark_jvm import SPARK_SESSIONS, SparkSessions, resolve_config

    config = ShuffleConfig(spill_dirs=[str(tmp_path)], remote_path=f"file://{tmp_path}/r",
                           storage_options={"secret": "s3cr3t"}, progress=False)
    sessions = SparkSessions()
    sessions.open("s1", config)
    # What the JVM sends: the carried fields, and the token it read from the session file.
    carried = {**json.loads(config_to_json(config, "/tmp/d/token")), "session_token": "s1"}
    assert "s3cr3t" not in config_to_json(config, "/tmp/d/token")
    # The master's copy, remote tier and credentials included, wins over the carried part.
    assert resolve_config(carried, sessions.get) == config
    # An unknown (or closed) session falls back to what Spark's conf carries: no remote.
    sessions.close("s1")
    assert resolve_config(carried, sessions.get).remote_path is None
    # Bounded: the oldest sessions are forgotten first.
    for i in range(SPARK_SESSIONS + 5):
        sessions.open(f"t{i}", config)
    assert sessions.get("t0") is None and sessions.get(f"t{SPARK_SESSIONS + 4}") == config


def test_a_spark_session_with_a_live_shuffle_is_never_forgotten(tmp_path):
    """The master keeps SPARK_SESSIONS sessions' configs; the oldest was forgotten even
    with a live shuffle: the session's next shuffles fell back to Spark's carried fields
    (no remote tier), so their remote segments were never deleted and reads failed (found
    by a review)."""
    from hybrid_ray.spark_jvm import SPARK_SESSIONS, SparkSessions, resolve_config

    def config(i):
        return ShuffleConfig(spill_dirs=[str(tmp_path)], remote_path=f"file://{tmp_path}/r{i}",
                             progress=False)
    live = config("live")
    sessions = SparkSessions(in_use=lambda c: c is live)
    sessions.open("long-lived", live)
    for i in range(2 * SPARK_SESSIONS):
        sessions.open(f"t{i}", config(i))
    carried = {**json.loads(config_to_json(live)), "session_token": "long-lived"}
    assert resolve_config(carried, sessions.get).remote_path == live.remote_path
    # The others are still bounded: the newest kept, the oldest idle ones forgotten.
    assert sessions.get("t0") is None and sessions.get(f"t{2 * SPARK_SESSIONS - 1}") is not None
    assert len(sessions._configs) == SPARK_SESSIONS


def test_sparks_conf_carries_the_session_file_s_path_never_the_token(tmp_path):
    """PySpark's launch_gateway passes every Spark config as ``--conf`` on spark-submit's
    command line, which any local user reads with ``ps``; Spark's redaction covers only
    its UI and event logs. The carried config held the session token, the key to the
    session's whole config (remote-tier credentials included; found by a review). It holds
    the path of the file the driver's JVM reads the token from."""
    from spark_bridge.hybrid_shuffle import shuffle_manager_configs

    token = "s0123456789abcdef0123456789abcdef"
    config = ShuffleConfig(spill_dirs=[str(tmp_path)], remote_path=f"file://{tmp_path}/r",
                           storage_options={"secret": "s3cr3t"}, progress=False)
    jar = tmp_path / "hybrid-ray-spark.jar"
    jar.write_bytes(b"")
    confs = shuffle_manager_configs(config, str(jar), "/tmp/d/token")
    assert json.loads(confs["spark.hybridray.config"])["session_file"] == "/tmp/d/token"
    for value in confs.values():
        assert token not in value and "session_token" not in value and "s3cr3t" not in value
    # Without a session (RayDP started by hand) there is no session field at all.
    assert "session" not in config_to_json(config)


def test_session_token_and_config_are_checked():
    from hybrid_ray.errors import ConfigError, InvalidIdError
    from hybrid_ray.spark_jvm import SparkSessions

    sessions = SparkSessions()
    with pytest.raises(InvalidIdError, match="session token"):
        sessions.open("../x", ShuffleConfig(progress=False))
    with pytest.raises(ConfigError, match="must be a ShuffleConfig"):
        sessions.open("s1", {"remote_path": "s3://b"})


def test_a_spark_exchange_report_gives_what_was_stored_and_no_made_up_throughput():
    """The master knows the stored bytes per node and tier, not the input or the wall time:
    those read 0 (the stored bytes as input and the shuffle's age as wall time gave a
    throughput that fell the longer one waited)."""
    summary = {"shuffle_id": "spark-app-1-2", "spilling": "selective", "num_maps": 3,
               "num_partitions": 4, "age_s": 120.0, "superseded_attempts": 0,
               "per_node_tier": {"n1": {"memory": [1000, 2], "disk": [500, 1]},
                                 "n2": {"remote": [250, 1]}}}
    report = hybrid_shuffle._report(summary)
    assert report.bytes_per_tier() == {"memory": 1000, "disk": 500, "remote": 250}
    assert (report.input_bytes, report.wall_time_s, report.throughput_mb_s) == (0, 0.0, 0.0)
    assert report.map_input == "spark executors (JVM shuffle manager)"
    # Printed, those zeros read as facts: "rows 0  input 0.0 MB  wall 0.00 s  throughput
    # 0.0 MB/s" for an exchange of 20,000 rows (found by a review of the README's Spark part).
    table = report.table()
    assert "rows 0" not in table and "throughput" not in table, table
    assert "Spark's UI" in table


_LOCAL_SPARK = '''
import os, sys
import ray
from pyspark import SparkConf, SparkContext
from spark_bridge.hybrid_shuffle import MANAGER_CLASS, shuffle_manager_jar
ray_jar = os.path.join(os.path.dirname(ray.__file__), "jars", "ray_dist.jar")
conf = (SparkConf().setMaster("local[1]").setAppName("bad-setting")
        .set("spark.shuffle.manager", MANAGER_CLASS)
        .set("spark.driver.extraClassPath", shuffle_manager_jar() + ":" + ray_jar)
        .set("spark.local.dir", sys.argv[1])
        .set("spark.hybridray.segmentBytes", sys.argv[2]))
try:
    sc = SparkContext(conf=conf)
except Exception as exc:
    print("START FAILED:", str(exc).replace(chr(10), " ")[:3000])
    sys.exit(0)
env = sc._jvm.org.apache.spark.SparkEnv.get()
manager = env.shuffleManager()
sc.stop()
manager.stop()  # again: must not throw either
rpc = env.rpcEnv()
field = rpc.getClass().getDeclaredField("stopped")
field.setAccessible(True)
print("STOPPED:", field.get(rpc).get())
'''


@pytest.mark.spark
def test_a_bad_manager_setting_fails_spark_s_start_and_stop_never_throws(tmp_path):
    """Was: spark.hybridray.segmentBytes=2g was accepted at start; the first shuffle failed
    (naming it), and then the manager's stop threw, so Spark's shutdown skipped its block
    manager and RPC env. Local-mode Spark, no Ray: a process of its own."""
    import subprocess
    import sys

    def run(segment_bytes: str) -> str:
        out = subprocess.run([sys.executable, "-c", _LOCAL_SPARK, str(tmp_path), segment_bytes],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    assert "START FAILED:" in (bad := run("2g"))
    assert "spark.hybridray.segmentBytes=2g is 2147483648 bytes" in bad, bad
    assert "STOPPED: True" in run("4m")


def test_a_wheel_built_from_the_checkout_ships_the_jar_and_finds_it(tmp_path):
    """Was: the wheel held no jar, so init_spark() (hybrid_shuffle=True by default) failed
    after `pip install .` with advice (./dev setup) a wheel user cannot follow."""
    import glob
    import os
    import subprocess
    import sys
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not glob.glob(os.path.join(root, "spark_bridge", "jars", "hybrid-ray-spark-*.jar")):
        pytest.skip("the jar was not built by ./dev here (it copies it into spark_bridge/jars)")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path / "dist"), root], check=True, timeout=300,
                   capture_output=True)
    [wheel] = glob.glob(str(tmp_path / "dist" / "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert any(n.startswith("spark_bridge/jars/hybrid-ray-spark-") for n in names), names
    assert not any(n.startswith("benchmarks/") for n in names)
    found = subprocess.run(
        [sys.executable, "-c", "from spark_bridge.hybrid_shuffle import shuffle_manager_jar;"
                               "print(shuffle_manager_jar())"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, cwd=str(tmp_path),
        capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert found.startswith(str(tmp_path / "site" / "spark_bridge" / "jars")), found
