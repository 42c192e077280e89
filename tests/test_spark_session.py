"""spark_bridge.session's config logic, without starting Spark."""

from __future__ import annotations

import pytest

from spark_bridge.session import (
    ADD_OPENS, EXECUTOR_ACTOR_CPU_KEY, executor_actor_cpus, spark_configs,
)


@pytest.mark.parametrize("executors, cores, cluster, claim", [
    (2, 1, 2.0, 0.5),    # this machine: the executors would hold both CPUs
    (1, 1, 8.0, 1.0),    # room to spare: each executor claims its cores
    (4, 2, 16.0, 2.0),
    (4, 2, 8.0, 1.0),    # 8 of 8 wanted: half the cluster over 4 executors
    (3, 1, 2.0, 0.3333),
])
def test_executors_leave_half_the_cpus_to_ray(executors, cores, cluster, claim):
    assert executor_actor_cpus(executors, cores, cluster) == claim


def test_spark_configs_keep_user_values_and_append_java_flags():
    configs = spark_configs(2, 1, {"spark.driver.extraJavaOptions": "-Xss4m",
                                   "spark.sql.shuffle.partitions": 7}, cluster_cpus=2.0)
    assert configs["spark.driver.extraJavaOptions"] == f"-Xss4m {ADD_OPENS}"
    assert configs["spark.executor.extraJavaOptions"] == ADD_OPENS
    assert configs["spark.sql.shuffle.partitions"] == "7"
    assert configs[EXECUTOR_ACTOR_CPU_KEY] == "0.5"
    # The caller's choice of the executors' Ray CPU claim wins.
    assert spark_configs(2, 1, {EXECUTOR_ACTOR_CPU_KEY: "1"}, 2.0)[EXECUTOR_ACTOR_CPU_KEY] == "1"


def test_the_spark_driver_logs_into_the_running_ray_session_not_session_latest():
    """RayDP's agent sends the Spark driver JVM's output to ``ray.logging.dir``, else to
    /tmp/ray/session_latest/logs, which ray.init does not move: once old sessions were
    removed from /tmp/ray the link pointed nowhere, the driver died at start ("Error create
    log dir.") and init_spark failed with JAVA_GATEWAY_EXITED (seen here). The running
    session's logs dir is now given to the driver; a caller's own value is kept."""
    configs = spark_configs(2, 1, None, 2.0, ray_logs_dir="/tmp/ray/session_x/logs")
    assert configs["spark.driver.extraJavaOptions"].endswith(
        " -Dray.logging.dir=/tmp/ray/session_x/logs")
    assert "ray.logging.dir" not in configs["spark.executor.extraJavaOptions"]
    own = spark_configs(2, 1, {"spark.driver.extraJavaOptions": "-Dray.logging.dir=/mine"},
                        2.0, ray_logs_dir="/tmp/ray/session_x/logs")
    assert own["spark.driver.extraJavaOptions"].count("ray.logging.dir") == 1
    assert "ray.logging.dir" not in spark_configs(2, 1, None, 2.0)["spark.driver.extraJavaOptions"]


@pytest.mark.parametrize("key", ["spark.hybridray.config", "spark.hybridray.namespace"])
def test_init_spark_refuses_configs_that_it_derives_from_shuffle_config(key):
    """A user's own spark.hybridray.config (say, copied from another session) carried no
    session token or another one: the JVM's shuffle ids then had a session tag the driver
    did not know, and heartbeats, reports and the release at stop_spark missed them.
    Refused before anything starts, naming the fix."""
    from hybrid_ray.errors import ConfigError
    from spark_bridge.session import init_spark

    with pytest.raises(ConfigError, match=f"configs sets {key}.*pass a hybrid_ray.ShuffleConfig"):
        init_spark(configs={key: "{}"})


def test_init_spark_probes_the_remote_tier_before_starting_anything(tmp_path):
    """A wrong remote tier surfaced only inside Spark tasks, once data spilled there,
    after Spark's retries; it is refused before Ray or Spark starts."""
    from hybrid_ray import ShuffleConfig
    from hybrid_ray.errors import RemoteTierError

    config = ShuffleConfig(spill_dirs=[str(tmp_path)],
                           remote_path="file:///proc/hybrid_ray_unwritable")
    from spark_bridge import init_spark

    with pytest.raises(RemoteTierError, match="hybrid_ray_unwritable"):
        init_spark(shuffle_config=config)


def test_init_spark_refuses_executors_the_cluster_s_memory_cannot_hold(ray_local, tmp_path):
    """``executor_memory="500GB"`` on a ~20 GiB node was accepted: init_spark returned and
    every job then hung, Spark logging only "Initial job has not accepted any resources"
    (found by a review). Refused before Spark starts, with what the cluster has; "0GB"
    too."""
    import ray

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.errors import ConfigError
    from spark_bridge import init_spark

    config = ShuffleConfig(spill_dirs=[str(tmp_path)], progress=False)
    node_gib = max(n["Resources"].get("memory", 0) for n in ray.nodes()
                   if n["Alive"]) / 1024 ** 3
    with pytest.raises(ConfigError, match=r"executor_memory='500GB' x 2 executor\(s\) needs "
                                          r"1000.0 GiB of Ray memory.*`ray status`"):
        init_spark("too-big", 2, 1, "500GB", shuffle_config=config)
    with pytest.raises(ConfigError, match="executor_memory must be above 0"):
        init_spark("zero", 1, 1, "0GB", shuffle_config=config)
    # One executor fits a node, but not as many as asked for.
    many = int(node_gib // 2) + 1
    with pytest.raises(ConfigError, match=f"x {2 * 4} executor"):
        init_spark("many", 2 * 4, 1, f"{many}GB", shuffle_config=config)


def test_stop_spark_stops_spark_and_releases_the_rest_when_a_release_fails(monkeypatch):
    """A bridge shuffle whose release failed (its master gone, Ray going down) made
    stop_spark raise before RayDP's stop: Spark kept running, and the other held shuffles
    stayed held (heartbeated, so never expired by the master). Every release is tried,
    Spark is stopped, then the release's error is raised (found by a review)."""
    import sys
    import types

    from spark_bridge import exchange, session

    calls: list[str] = []
    fake_raydp = types.ModuleType("raydp")
    fake_raydp.stop_spark = lambda cleanup_data=True: calls.append("raydp.stop_spark")
    monkeypatch.setitem(sys.modules, "raydp", fake_raydp)
    monkeypatch.setattr(session, "_wait_for_spark_masters_to_exit", lambda: None)
    monkeypatch.setattr(session, "_session_shuffles", None)
    monkeypatch.setattr(exchange, "held_shuffles", lambda: ["spk-a", "spk-b"])

    def release(shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
        calls.append(f"release {shuffle_id}")
        if shuffle_id == "spk-a":
            raise RuntimeError("the shuffle master is gone")
        return True
    monkeypatch.setattr(exchange, "release", release)
    with pytest.raises(RuntimeError, match="master is gone"):
        session.stop_spark()
    assert calls == ["release spk-a", "release spk-b", "raydp.stop_spark"]


def test_init_spark_that_fails_closes_the_session_it_opened_at_the_master(
        ray_local, tmp_path, monkeypatch):
    """init_spark hands the shuffle master the session's whole config (remote-tier
    credentials included) before RayDP starts Spark. When RayDP failed (a session already
    running, executors the cluster cannot place) the master kept it under a token nothing
    would ever close (found by a review). It is closed again."""
    import uuid

    import raydp

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master
    from spark_bridge.session import SparkSetupError, init_spark

    token = uuid.UUID(int=0x1234)
    monkeypatch.setattr(uuid, "uuid4", lambda: token)

    def fail(*args, **kwargs):
        raise Exception("Spark has inited.")
    monkeypatch.setattr(raydp, "init_spark", fail)
    config = ShuffleConfig(namespace="hr_failed_init", spill_dirs=[str(tmp_path)],
                           progress=False)
    with pytest.raises(SparkSetupError, match="already running"):
        init_spark(executor_memory="512MB", shuffle_config=config)
    master = get_master("hr_failed_init")
    assert ray_local.get(master.spark_session_config.remote(f"s{token.hex}")) is None


@pytest.mark.parametrize("memory", ["256MB", "2", 400 * 1024 * 1024])
def test_init_spark_refuses_executor_memory_below_spark_s_minimum(memory):
    """Spark refuses executors under 450 MiB, but only in the driver's JVM after ~40 s of
    start-up, and init_spark then said only "An error occurred while calling
    None.org.apache.spark.api.java.JavaSparkContext" (found by a review; "2" is 2 bytes,
    as RayDP reads it). Refused at once, saying the minimum."""
    from hybrid_ray.errors import ConfigError
    from spark_bridge.session import init_spark

    with pytest.raises(ConfigError, match="below Spark's minimum of 450 MiB"):
        init_spark(executor_memory=memory)


def test_init_spark_gives_raydp_the_executor_memory_as_spark_spells_it(ray_local, monkeypatch):
    """Spark's size parser takes no blanks: "1 GB" passed init_spark's check and RayDP's
    parser, then the driver's JVM refused it while Spark started, and init_spark said only
    "[JAVA_GATEWAY_EXITED] Java gateway process exited" (found by a review). RayDP is
    given "1GB"."""
    import raydp

    from spark_bridge.session import SparkSetupError, init_spark

    seen = []

    def fake_init_spark(app_name, num_executors, executor_cores, executor_memory, configs):
        seen.append(executor_memory)
        raise Exception("no Spark in this test")
    monkeypatch.setattr(raydp, "init_spark", fake_init_spark)
    for given in ("1 GB", " 1024 m ", "1GB"):
        with pytest.raises(SparkSetupError, match="no Spark in this test"):
            init_spark(executor_memory=given, hybrid_shuffle=False)
    assert seen == ["1GB", "1024m", "1GB"]


def test_init_spark_takes_numpy_integers_as_plain_ints(ray_local, monkeypatch):
    """``num_executors=np.int64(2)`` was refused as "must be a positive integer, got
    np.int64(2)" (and a NumPy executor_memory as not "bytes (int)"), while hybrid_ray's
    own counts and spark_bridge's partition counts take NumPy integers. RayDP gets
    plain ints."""
    import numpy as np
    import raydp

    from hybrid_ray.errors import ConfigError
    from spark_bridge.session import SparkSetupError, init_spark

    seen = []

    def fake_init_spark(app_name, num_executors, executor_cores, executor_memory, configs):
        seen.append((num_executors, executor_cores, executor_memory))
        raise Exception("no Spark in this test")
    monkeypatch.setattr(raydp, "init_spark", fake_init_spark)
    with pytest.raises(SparkSetupError, match="no Spark in this test"):
        init_spark(num_executors=np.int64(1), executor_cores=np.int32(1),
                   executor_memory=np.int64(512 * 2**20), hybrid_shuffle=False)
    assert seen == [(1, 1, 512 * 2**20)]
    assert all(type(v) is int for v in seen[0])
    for name, value in (("num_executors", np.int64(0)), ("executor_cores", np.bool_(True))):
        with pytest.raises(ConfigError, match=f"{name} must be a positive integer"):
            init_spark(**{name: value}, executor_memory="512MB", hybrid_shuffle=False)


def test_a_new_session_does_not_report_the_last_stopped_session_s_exchanges(
        ray_local, monkeypatch):
    """spark_shuffle_reports() gives the current session's reports, or the last stopped
    one's while none runs. A session started with hybrid_shuffle=False after a stopped
    hybrid one got the stopped one's reports: exchanges it never ran (found by a review)."""
    import raydp

    import spark_bridge.hybrid_shuffle as hybrid_shuffle
    from spark_bridge import session

    monkeypatch.setattr(session, "_session_shuffles", None)
    monkeypatch.setattr(session, "_session_config", None)
    monkeypatch.setattr(session, "_given_config", None)
    monkeypatch.setattr(session, "_last_session_shuffles", ("hr_old", "spark-old-1-", "s1"))
    monkeypatch.setattr(hybrid_shuffle, "reports", lambda namespace, prefix: [prefix])
    assert session.spark_shuffle_reports() == ["spark-old-1-"]  # no session runs
    monkeypatch.setattr(raydp, "init_spark", lambda *args, **kwargs: object())
    session.init_spark(executor_memory="512MB", hybrid_shuffle=False)
    assert session.spark_shuffle_reports() == []


def test_a_session_with_spark_s_own_shuffle_puts_the_jar_on_the_driver_s_classpath(
        ray_local, monkeypatch):
    """PySpark keeps one driver JVM per process, with its first session's classpath: after
    an init_spark(hybrid_shuffle=False), a hybrid session's start failed with
    ClassNotFoundException for the shuffle manager, reported as a start failure to check
    against the cluster's CPUs and memory (found by a review). The jar goes on the
    driver's classpath in every session (the caller's entries kept); a driver JVM started
    without it is refused up front, naming the fix."""
    import types

    import raydp

    import spark_bridge.hybrid_shuffle as hybrid_shuffle
    from pyspark import SparkContext

    from hybrid_ray import ShuffleConfig
    from spark_bridge.session import SparkSetupError, init_spark

    seen = {}

    def fake_init_spark(app_name, num_executors, executor_cores, executor_memory, configs):
        seen.update(configs)
        raise Exception("no Spark in this test")
    monkeypatch.setattr(raydp, "init_spark", fake_init_spark)
    monkeypatch.setattr(hybrid_shuffle, "shuffle_manager_jar", lambda: "/x/hybrid-ray-spark.jar")
    with pytest.raises(SparkSetupError, match="no Spark in this test"):
        init_spark(executor_memory="512MB", hybrid_shuffle=False,
                   configs={"spark.driver.extraClassPath": "/mine.jar"})
    assert seen["spark.driver.extraClassPath"] == "/x/hybrid-ray-spark.jar:/mine.jar"
    assert seen["spark.shuffle.manager"] == "sort"

    class _Loader:
        def loadClass(self, name):  # noqa: N802 - the Java method's name
            raise Exception(f"An error occurred while calling o1.loadClass.\n: "
                            f"java.lang.ClassNotFoundException: {name}")

    class _Gateway:  # a driver JVM started without the jar, as Py4J shows it
        class jvm:  # noqa: N801
            class java:  # noqa: N801
                class lang:  # noqa: N801
                    class Thread:  # noqa: N801
                        @staticmethod
                        def currentThread():  # noqa: N802
                            return types.SimpleNamespace(
                                getContextClassLoader=lambda: _Loader())

    monkeypatch.setattr(SparkContext, "_gateway", _Gateway())
    with pytest.raises(SparkSetupError, match="without hybrid_ray's shuffle manager jar.*"
                                              "new Python process"):
        init_spark(executor_memory="512MB", shuffle_config=ShuffleConfig(
            namespace="hr_driver_jar", progress=False))


def test_init_spark_s_error_names_the_java_exception_behind_a_py4j_failure(
        ray_local, monkeypatch):
    """A Py4J failure's first line is only "An error occurred while calling
    None.org.apache.spark.api.java.JavaSparkContext."; the reason (a Spark config Spark
    refused) is on the line after, which init_spark dropped (found by a review)."""
    import raydp

    from spark_bridge.session import SparkSetupError, init_spark

    def fail(*args, **kwargs):
        raise Exception(
            "An error occurred while calling None.org.apache.spark.api.java.JavaSparkContext."
            "\n: org.apache.spark.SparkIllegalArgumentException: [INVALID_EXECUTOR_MEMORY] "
            "Executor memory 1 must be at least 471859200.\n\tat org.apache.spark.x(X.scala:1)")
    monkeypatch.setattr(raydp, "init_spark", fail)
    with pytest.raises(SparkSetupError, match=r"JavaSparkContext.*INVALID_EXECUTOR_MEMORY"):
        init_spark(executor_memory="512MB", hybrid_shuffle=False)


def test_init_spark_keeps_the_session_token_off_spark_s_conf_and_command_line(
        ray_local, tmp_path, monkeypatch):
    """PySpark's launch_gateway passes every Spark config as ``--conf`` on spark-submit's
    command line, readable by any local user (``ps -eo args``); the session token, the key
    the master hands the session's whole config (remote-tier credentials included) out
    under, was among them (found by a review). RayDP is given none of it: the driver's JVM
    reads the token from a 0600 file in a 0700 directory, gone once Spark has started."""
    import json
    import os
    import stat
    import uuid

    import raydp

    from hybrid_ray import ShuffleConfig
    from spark_bridge import session as bridge

    token = uuid.UUID(int=0x5678)
    monkeypatch.setattr(uuid, "uuid4", lambda: token)
    seen = {}

    def fake_init_spark(app_name, num_executors, executor_cores, executor_memory, configs):
        seen["configs"] = dict(configs)
        path = json.loads(configs["spark.hybridray.config"])["session_file"]
        seen["path"] = path
        with open(path, encoding="ascii") as f:
            seen["token"] = f.read()
        seen["file_mode"] = stat.S_IMODE(os.stat(path).st_mode)
        seen["dir_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        raise Exception("Spark has inited.")  # stop here: no Spark in this test
    monkeypatch.setattr(raydp, "init_spark", fake_init_spark)
    import spark_bridge.hybrid_shuffle as hybrid_shuffle
    jar = tmp_path / "hybrid-ray-spark.jar"  # a file: shuffle_manager_configs checks it
    jar.write_bytes(b"")
    monkeypatch.setattr(hybrid_shuffle, "shuffle_manager_jar", lambda: str(jar))
    config = ShuffleConfig(namespace="hr_token_conf", spill_dirs=[str(tmp_path)],
                           progress=False)
    with pytest.raises(bridge.SparkSetupError):
        bridge.init_spark(executor_memory="512MB", shuffle_config=config)
    assert seen["token"] == f"s{token.hex}"
    for key, value in seen["configs"].items():
        assert token.hex not in key and token.hex not in str(value), key
    assert seen["file_mode"] == 0o600 and seen["dir_mode"] == 0o700
    assert not os.path.exists(os.path.dirname(seen["path"]))


def test_stop_spark_raises_raydp_s_error_when_the_session_release_fails_too(monkeypatch):
    """When RayDP's stop failed and the release of the session's Spark shuffles then failed
    as well (Ray going down with Spark), the release's error replaced RayDP's: the user saw
    a timeout at the master instead of why Spark did not stop. RayDP's error is raised,
    with the release's failure noted on it; the session is forgotten either way."""
    import sys
    import types

    from hybrid_ray import actors
    from spark_bridge import exchange, session

    def raydp_stop(cleanup_data: bool = True) -> None:
        raise RuntimeError("RayDP could not stop its Spark master")

    class _Master:
        class spark_release:  # noqa: N801 - the shape of an actor method
            @staticmethod
            def remote(request: str) -> None:
                raise TimeoutError("the shuffle master did not answer")

    fake_raydp = types.ModuleType("raydp")
    fake_raydp.stop_spark = raydp_stop
    monkeypatch.setitem(sys.modules, "raydp", fake_raydp)
    monkeypatch.setattr(session, "_quiesce_driver_shuffle_manager", lambda: None)
    monkeypatch.setattr(session, "_session_shuffles", ("hybrid_ray", "spark-app-x", "s1"))
    monkeypatch.setattr(actors, "master_handle", lambda namespace: _Master)
    monkeypatch.setattr(exchange, "held_shuffles", lambda: [])
    with pytest.raises(RuntimeError, match="RayDP could not stop") as raised:
        session.stop_spark()
    assert any("releasing the session's Spark shuffles failed too" in note
               and "did not answer" in note for note in raised.value.__notes__)
    assert session._session_shuffles is None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_init_spark_interrupted_while_spark_starts_closes_its_master_session(
        ray_local, tmp_path, monkeypatch, interrupt):
    """Spark takes ~40 s to start, long enough for a Ctrl-C. Only ``Exception`` closed the
    session init_spark had opened at the shuffle master, so an interrupt (or a SystemExit)
    left the session's whole config, remote-tier credentials included, held there under a
    token nothing would ever close (found by a review). It is closed, and the interrupt
    itself is raised unchanged."""
    import uuid

    import raydp

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master
    from spark_bridge.session import init_spark

    token = uuid.UUID(int=0x5678)
    monkeypatch.setattr(uuid, "uuid4", lambda: token)

    def interrupted(*args, **kwargs):
        raise interrupt()
    monkeypatch.setattr(raydp, "init_spark", interrupted)
    config = ShuffleConfig(namespace="hr_interrupted_init", spill_dirs=[str(tmp_path)],
                           progress=False)
    with pytest.raises(interrupt):
        init_spark(executor_memory="512MB", shuffle_config=config)
    master = get_master("hr_interrupted_init")
    assert ray_local.get(master.spark_session_config.remote(f"s{token.hex}")) is None


def test_an_operation_on_a_stopped_session_says_so_not_to_turn_the_manager_on(monkeypatch):
    """A DataFrame of a session stopped with stop_spark still reads hybrid_ray's manager in
    its conf: the operations told the user to start the session with hybrid_shuffle=True,
    which it had (found by a review). They now say no session of init_spark runs."""
    import types

    from hybrid_ray.errors import ConfigError
    from spark_bridge import operations
    from spark_bridge import session as session_module
    from spark_bridge.hybrid_shuffle import MANAGER_CLASS

    conf = types.SimpleNamespace(get=lambda key, default=None: MANAGER_CLASS)
    df = types.SimpleNamespace(sparkSession=types.SimpleNamespace(conf=conf))
    monkeypatch.setattr(session_module, "_session_config", None)
    with pytest.raises(ConfigError) as info:
        operations._through_manager(df, None, "sort")
    assert "no Spark session started by spark_bridge.init_spark is running" in str(info.value)
    assert "hybrid_shuffle=True" not in str(info.value)
    # A session with Spark's own manager is still told to turn hybrid_ray's on.
    conf.get = lambda key, default=None: "sort"
    with pytest.raises(ConfigError, match=r"spark.shuffle.manager=sort: start it with "):
        operations._through_manager(df, None, "sort")


def test_failing_heartbeats_of_the_spark_session_are_said_once_and_so_is_recovery(
        monkeypatch, caplog):
    """The thread keeping the session's Spark shuffles from the master's orphan TTL
    swallowed every error: heartbeats failing for the whole TTL released the shuffles
    under running jobs with nothing said before (found by a review). A run of failures is
    now logged once, and so is the master answering again."""
    import logging
    import threading
    import time

    import ray

    import hybrid_ray.actors
    import hybrid_ray.config
    from spark_bridge import session as session_module

    answers = iter([False, False, False, True, True])

    class Master:
        class spark_heartbeat:  # noqa: N801 - mimics an actor method
            @staticmethod
            def remote(request):
                if not next(answers, True):
                    raise ConnectionError("the master is down")
                return "ref"

    monkeypatch.setattr(hybrid_ray.actors, "master_handle", lambda namespace: Master)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(hybrid_ray.config, "DRIVER_HEARTBEAT_S", 0.05)
    session = ("ns", "spark-app-x-", "token")
    monkeypatch.setattr(session_module, "_session_shuffles", session)
    caplog.set_level(logging.WARNING, logger="spark_bridge.session")
    beats = threading.Thread(target=session_module._heartbeat_spark_shuffles, args=(session,))
    beats.start()
    time.sleep(0.6)  # about 12 beats: 3 failed, then answered
    session_module._session_shuffles = None
    beats.join(timeout=5)
    assert not beats.is_alive()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "heartbeat to its shuffle master failed (ConnectionError: the master is down)" \
        in said[0] and "orphan TTL" in said[0]
    assert "answers the Spark session's heartbeat again" in said[1]


def test_stop_waits_for_the_sessions_deletions_and_warns_with_the_fix_if_they_outlast_it(
        caplog):
    """``stop_spark`` returned once the master's release answered (after at most its
    release_wait_s), while a large session's files were still going; a script that then
    ended took its local Ray down and the rest stayed (found by a review). The stop waits
    for the deletions, bounded, and says what to do if they outlast the wait."""
    import logging

    from spark_bridge.session import wait_until_deleted

    counts = iter([3, 2, 1, 0])
    assert wait_until_deleted(lambda: next(counts), "the session's shuffles", 10) == 0
    assert next(counts, "used up") == "used up"  # asked until none was left, not after
    with caplog.at_level(logging.WARNING):
        assert wait_until_deleted(lambda: 2, "the session's shuffles (spark-x-*)", 0.3) == 2
    assert "2 deletion(s) of the session's shuffles (spark-x-*) were not done within 0.3 s" \
        in caplog.text
    assert "hybrid-ray cleanup" in caplog.text
