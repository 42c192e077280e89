"""A RayDP Spark session that works out of the box on this stack (Java 17, PySpark 3.5).

RayDP runs Spark's driver-side app master and executors as Ray actors. On Java 17 those
JVMs need ``--add-opens`` flags (Ray's serializer reflects into java.base), the executors'
Python workers must run the interpreter that has hybrid_ray installed, and Spark's defaults
(200 shuffle partitions, a console progress bar) are wrong for a small machine.
``init_spark`` sets all of that and explains a missing Java or a wrong PySpark version
instead of dumping a JVM trace.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from hybrid_ray.config import ShuffleConfig, as_int
from hybrid_ray.errors import ConfigError, HybridRayError

# Packages of java.base that Spark, Arrow and Ray's Java serializer reflect into.
JAVA_OPEN_PACKAGES = (
    "java.lang", "java.lang.invoke", "java.lang.reflect", "java.io", "java.net", "java.nio",
    "java.math", "java.text", "java.time", "java.util", "java.util.concurrent",
    "java.util.concurrent.atomic", "java.util.concurrent.locks", "java.util.regex",
    "java.security", "sun.nio.ch", "sun.nio.cs", "sun.security.action", "sun.util.calendar",
    "jdk.internal.misc", "jdk.internal.ref",
)
ADD_OPENS = " ".join(f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in JAVA_OPEN_PACKAGES)
# The three JVM kinds RayDP starts: the app master (and its py4j gateway), the driver, the
# executors. Spark's own defaults cover only the last two, and not enough for Ray.
JAVA_OPTION_KEYS = ("spark.ray.raydp_app_master.extraJavaOptions",
                    "spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions")
SUPPORTED_JAVA = (8, 11, 17, 21)
# The logical Ray CPUs RayDP has each executor actor claim; Spark's own task slots per
# executor (spark.executor.cores) do not depend on it.
EXECUTOR_ACTOR_CPU_KEY = "spark.ray.raydp_spark_executor.actor.resource.cpu"
SUPPORTED_PYSPARK = "3.5."
# Spark refuses executors with less memory (INVALID_EXECUTOR_MEMORY, raised in the driver's
# JVM after ~40 s of start-up and reported by Py4J only as "An error occurred while
# calling None.org.apache.spark.api.java.JavaSparkContext").
MIN_EXECUTOR_MEMORY = 450 * 1024 * 1024


class SparkSetupError(HybridRayError, RuntimeError):
    """Spark on Ray could not start; the message says what is missing and how to fix it."""


def java_major_version(java: str) -> int:
    """Major version of a ``java`` executable (8 for "1.8.0_392", 17 for "17.0.9")."""
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise SparkSetupError(f"cannot tell the version of {java} from `java -version`: "
                              f"{(out.stderr or out.stdout).strip()[:200]}")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 and match.group(2) else major


def find_java() -> str:
    """The java executable Spark will use (JAVA_HOME first, as spark-submit does)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = os.path.join(java_home, "bin", "java")
        if not os.access(java, os.X_OK):
            raise SparkSetupError(f"JAVA_HOME={java_home} has no executable bin/java; point "
                                  "JAVA_HOME at a JDK/JRE 17 or unset it")
        return java
    java = shutil.which("java")
    if java is None:
        raise SparkSetupError(
            "Java was not found: Spark needs a Java 17 runtime. Install one (Debian/Ubuntu: "
            "`apt-get install -y openjdk-17-jre-headless`) or set JAVA_HOME")
    return java


def check_environment() -> None:
    """Fail early, with the fix, if Java or PySpark cannot run RayDP here."""
    major = java_major_version(find_java())
    if major not in SUPPORTED_JAVA:
        raise SparkSetupError(f"Java {major} is not supported by Spark 3.5; install Java 17 "
                              "and point JAVA_HOME at it")
    try:
        import pyspark
    except ImportError as exc:
        raise SparkSetupError("PySpark is not installed: pip install 'pyspark==3.5.7'") from exc
    if not pyspark.__version__.startswith(SUPPORTED_PYSPARK):
        raise SparkSetupError(
            f"PySpark {pyspark.__version__} is installed, but RayDP 1.6 runs on PySpark 3.5 "
            "only: pip install 'pyspark==3.5.7'")


def _memory_bytes(size: int | str) -> int:
    """``executor_memory`` in bytes, read as RayDP reads it (binary units)."""
    from raydp.utils import parse_memory_size

    return size if isinstance(size, int) else parse_memory_size(str(size))


def _check_executor_memory_fits(num_executors: int, executor_memory: int | str) -> None:
    """Refuse executors the cluster's Ray memory can never hold: RayDP's executor actors
    ask Ray for their memory, and with more than any node (or the cluster) has they wait
    for it forever; init_spark returned and every job then hung ("Initial job has not
    accepted any resources"; found by a review). Necessary, not sufficient: other actors
    may hold memory too."""
    import ray

    each = _memory_bytes(executor_memory)
    nodes = [n.get("Resources", {}).get("memory", 0) for n in ray.nodes() if n.get("Alive")]
    largest, total = max(nodes, default=0), sum(nodes)
    gib = 1024 ** 3
    if nodes and (each > largest or each * num_executors > total):
        raise ConfigError(
            f"executor_memory={executor_memory!r} x {num_executors} executor(s) needs "
            f"{each * num_executors / gib:.1f} GiB of Ray memory, {each / gib:.1f} GiB on one "
            f"node; this cluster has {total / gib:.1f} GiB, at most {largest / gib:.1f} GiB "
            "on a node (`ray status`). Ask for less, or add nodes")


def _check_positive_int(name: str, value: Any) -> int:
    """``value`` as a plain int above 0 (a NumPy integer too, as hybrid_ray's counts take
    one: ``np.int64(2)`` was refused as "must be a positive integer"), else ConfigError."""
    number = as_int(value)
    if number is None or number <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


def executor_actor_cpus(num_executors: int, executor_cores: int, cluster_cpus: float) -> float:
    """Logical Ray CPUs each executor actor claims: its cores, but all executors together
    at most half the cluster's CPUs.

    Why: by default each executor holds ``executor_cores`` of Ray's CPUs for its whole
    life. On a small cluster the executors then hold every CPU, and anything else that
    needs one waits forever with no error: Ray Data on the same cluster
    (``ray.data.from_spark``, a lazy Dataset's ``materialize``) and ``hybrid_ray.sort``'s
    sampling (seen: the benchmark's RayDP-conversion case hung). The claim is only Ray's
    bookkeeping; Spark still runs ``executor_cores`` tasks per executor.
    """
    wanted = float(num_executors * executor_cores)
    if cluster_cpus <= 0 or wanted <= cluster_cpus / 2:
        return float(executor_cores)
    return round(cluster_cpus / 2 / num_executors, 4)


def spark_configs(num_executors: int, executor_cores: int,
                  configs: Mapping[str, str] | None,
                  cluster_cpus: float = 0.0, ray_logs_dir: str | None = None) -> dict[str, str]:
    """Spark configs for RayDP: our defaults, the caller's configs over them, and the
    ``--add-opens`` flags appended to whatever Java options the caller gave.
    ``cluster_cpus`` sizes the executors' claim on Ray's CPUs (``executor_actor_cpus``).

    ``ray_logs_dir``: the running Ray session's logs directory, given to the Spark
    driver's JVM as ``ray.logging.dir``. RayDP's Java agent redirects that JVM's output
    into it and, without the property, uses ``/tmp/ray/session_latest/logs``: a link that
    ``ray.init`` does not move and that points nowhere once old sessions under /tmp/ray
    are removed (a tmp cleaner, an operator freeing disk). The driver then died at start
    ("Error create log dir.") and ``init_spark`` failed with JAVA_GATEWAY_EXITED."""
    merged = {
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # 200 partitions of a few MB each cost more in task overhead than they save.
        "spark.sql.shuffle.partitions": str(max(4, 4 * num_executors * executor_cores)),
        # Executors' Python daemon: PySpark's, minus a zip re-read per task and with the
        # bridge's modules preloaded (see spark_bridge/python_daemon.py).
        "spark.python.daemon.module": "spark_bridge.python_daemon",
        EXECUTOR_ACTOR_CPU_KEY: str(executor_actor_cpus(num_executors, executor_cores,
                                                        cluster_cpus)),
    }
    for key, value in (configs or {}).items():
        if not isinstance(key, str):
            raise ConfigError(f"Spark config keys must be strings, got {key!r}")
        merged[key] = str(value)
    for key in JAVA_OPTION_KEYS:
        merged[key] = f"{merged.get(key, '')} {ADD_OPENS}".strip()
    driver = "spark.driver.extraJavaOptions"
    if ray_logs_dir and "-Dray.logging.dir=" not in merged[driver]:
        merged[driver] += f" -Dray.logging.dir={ray_logs_dir}"
    return merged


def ray_logs_dir() -> str | None:
    """The logs directory of the Ray session this process is connected to, if it has one
    on this machine (the driver's node): where RayDP's agent should put the Spark driver's
    output."""
    import ray

    try:
        path = ray._private.worker._global_node.get_logs_dir_path()  # noqa: SLF001
    except AttributeError:  # a Ray without this private API, or a client connection
        return None
    return path if path and os.path.isdir(path) and " " not in path else None


# The running session's hybrid_ray Spark shuffles: (namespace, shuffle id prefix), or None.
_session_shuffles: tuple[str, str, str] | None = None
# The running session's ShuffleConfig, when its exchanges go through hybrid_ray's manager.
_session_config: ShuffleConfig | None = None
_last_session_shuffles: tuple[str, str, str] | None = None
# The ShuffleConfig given to init_spark, whichever the shuffle: with hybrid_shuffle=False
# the direct parquet path of spark_bridge.repartition is hybrid_ray's only use of it.
_given_config: ShuffleConfig | None = None


# Spark settings init_spark derives from shuffle_config (and the path of the file the
# driver's JVM reads its session token from).
SHUFFLE_CONFIG_KEYS = ("spark.hybridray.config", "spark.hybridray.namespace")


def init_spark(app_name: str = "hybrid_ray", num_executors: int = 2, executor_cores: int = 1,
               executor_memory: str | int = "2GB", configs: Mapping[str, str] | None = None,
               *, ray_address: str | None = None, shuffle_config: Any = None,
               hybrid_shuffle: bool = True) -> Any:
    """Start Spark on the Ray cluster through RayDP and return its ``SparkSession``.

    With ``hybrid_shuffle=True`` (the default) every ordinary exchange of the session
    (SQL, DataFrame and RDD shuffles, AQE's coalesced and skew-split reads) stores its map
    output in hybrid_ray's memory, disk and remote tiers through
    ``HybridRayShuffleManager`` (see ``spark_bridge.hybrid_shuffle``), with
    ``shuffle_config`` (a ``ShuffleConfig``; default ``ShuffleConfig()``) giving the spill
    dirs, budgets, remote tier and namespace. ``hybrid_shuffle=False`` gives Spark's own
    shuffle. The shuffle manager's jar is built from ``jvm/`` by ``./dev setup``.
    Settings in ``configs`` win over the ones this adds.

    Connects to (or starts) Ray first: ``ray_address`` or ``RAY_ADDRESS``, else a local Ray.
    The executors together claim at most half of the cluster's logical CPUs from Ray (see
    ``executor_actor_cpus``; set ``spark.ray.raydp_spark_executor.actor.resource.cpu`` in
    ``configs`` to choose), so Ray Data and hybrid_ray work in the same session; they would
    otherwise wait forever for a CPU on a small cluster. ``configs`` are Spark configs; Java
    options given there are kept and the required ``--add-opens`` flags appended.
    """
    if not isinstance(app_name, str) or not app_name.strip():
        raise ConfigError(f"app_name must be a non-empty string, got {app_name!r}")
    num_executors = _check_positive_int("num_executors", num_executors)
    executor_cores = _check_positive_int("executor_cores", executor_cores)
    if as_int(executor_memory) is not None:  # bytes; a NumPy integer as a plain int
        executor_memory = as_int(executor_memory)
    if isinstance(executor_memory, bool) or not (
            (isinstance(executor_memory, int) and executor_memory > 0)
            or (isinstance(executor_memory, str)
                and re.fullmatch(r"\d+\s*[kKmMgGtT]?[bB]?", executor_memory.strip()))):
        raise ConfigError(f"executor_memory must be bytes (int) or a size like '2GB', "
                          f"got {executor_memory!r}")
    if isinstance(executor_memory, str):
        # Spark's size parser takes no blanks: "2 GB" passed the check above and RayDP's
        # parser, then the driver's JVM refused it while Spark started, and init_spark
        # said only JAVA_GATEWAY_EXITED (found by a review). As Spark spells it: "2GB".
        executor_memory = re.sub(r"\s+", "", executor_memory)
    if _memory_bytes(executor_memory) <= 0:
        raise ConfigError(f"executor_memory must be above 0, got {executor_memory!r}")
    if _memory_bytes(executor_memory) < MIN_EXECUTOR_MEMORY and not (
            isinstance(configs, Mapping) and "spark.testing.reservedMemory" in configs):
        raise ConfigError(
            f"executor_memory={executor_memory!r} is below Spark's minimum of "
            f"{MIN_EXECUTOR_MEMORY // 2**20} MiB (1.5 x its 300 MiB reserved memory); "
            "ask for at least '450MB'")
    if configs is not None and not isinstance(configs, Mapping):
        raise ConfigError(f"configs must be a dict of Spark configs, got {type(configs).__name__}")
    if not isinstance(hybrid_shuffle, bool):
        raise ConfigError(f"hybrid_shuffle must be True or False, got {hybrid_shuffle!r}")
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address):
        raise ConfigError(f"ray_address must be a Ray address such as '10.0.0.5:6379' or "
                          f"'auto', got {ray_address!r}")
    from hybrid_ray.config import ShuffleConfig

    if shuffle_config is None:
        shuffle_config = ShuffleConfig()
    elif not isinstance(shuffle_config, ShuffleConfig):
        raise ConfigError("shuffle_config must be a hybrid_ray.ShuffleConfig, got "
                          f"{type(shuffle_config).__name__}")
    owned = sorted(k for k in (configs or {}) if k in SHUFFLE_CONFIG_KEYS)
    manager = (configs or {}).get("spark.shuffle.manager")
    if hybrid_shuffle and manager is not None:
        from spark_bridge.hybrid_shuffle import MANAGER_CLASS

        if str(manager) != MANAGER_CLASS:
            # It won over hybrid_ray's: every exchange went through it, the session's
            # shuffle_config (spill dirs, remote tier) unused, and no report said so.
            raise ConfigError(
                f"configs sets spark.shuffle.manager={manager!r}, which replaces hybrid_ray's "
                f"shuffle manager; leave it out, or pass hybrid_shuffle=False for another one")
    if hybrid_shuffle and owned:
        # They carry shuffle_config and the session token the driver and the JVM both
        # derive shuffle ids from: a copy of them from elsewhere would split the two, and
        # the session's heartbeats, reports and release at stop_spark miss its shuffles.
        raise ConfigError(
            f"configs sets {', '.join(owned)}, which init_spark derives from shuffle_config; "
            "pass a hybrid_ray.ShuffleConfig as shuffle_config instead")
    check_environment()
    session_token = ""
    if hybrid_shuffle:
        from spark_bridge.hybrid_shuffle import shuffle_manager_configs, shuffle_manager_jar

        _check_driver_jvm_has_the_manager()
        session_token = f"s{uuid.uuid4().hex}"
        # Without the token: Spark's configs are on spark-submit's command line. The
        # driver's JVM reads it from a file while Spark starts (see _session_token_file).
        extra = shuffle_manager_configs(shuffle_config, shuffle_manager_jar())
        for key in ("raydp.executor.extraClassPath", "spark.driver.extraClassPath"):
            if configs and configs.get(key):
                extra[key] = f"{extra[key]}:{configs[key]}"
        extra.update({k: str(v) for k, v in (configs or {}).items()
                      if k not in ("raydp.executor.extraClassPath",
                                   "spark.driver.extraClassPath")})
    else:
        # Spark's own shuffle, said explicitly: PySpark keeps one driver JVM per Python
        # process, and an earlier session's --conf (hybrid_ray's manager) would otherwise
        # carry over to executors that lack its jar (ClassNotFoundException, then a hang).
        extra = {"spark.shuffle.manager": "sort",
                 **{k: str(v) for k, v in (configs or {}).items()}}
        # The jar on the driver's classpath all the same: that driver JVM is the one a
        # later init_spark(hybrid_shuffle=True) of this process gets, and without the jar
        # its start failed with ClassNotFoundException (found by a review).
        from spark_bridge.hybrid_shuffle import ShuffleJarMissingError, shuffle_manager_jar

        try:
            jar = shuffle_manager_jar()
        except ShuffleJarMissingError:
            jar = ""
        if jar:
            driver_path = "spark.driver.extraClassPath"
            extra[driver_path] = f"{jar}:{extra[driver_path]}" if extra.get(driver_path) \
                else jar
    configs = extra
    # Executors' Python workers (mapInArrow) must import hybrid_ray: use this interpreter.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    import ray
    import raydp

    global _session_shuffles, _session_config, _given_config, _last_session_shuffles
    if hybrid_shuffle:
        # A wrong endpoint or credentials surfaced only inside Spark tasks, once data
        # spilled to the remote tier, after Spark's retries: probe it now, as a Ray
        # shuffle does before it runs.
        from hybrid_ray.shuffle import check_remote_tier

        check_remote_tier(shuffle_config)
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    elif ray_address not in (None, "auto"):
        # Connected already: the address given was silently dropped, and Spark started on
        # the cluster this process happened to be connected to.
        connected = ray.get_runtime_context().gcs_address
        if ray_address != connected:
            raise ConfigError(
                f"init_spark(ray_address={ray_address!r}): this process is connected to the "
                f"Ray cluster at {connected} already; leave ray_address out to use that "
                "cluster, or call ray.shutdown() first to connect to another")
    _check_executor_memory_fits(num_executors, executor_memory)
    if hybrid_shuffle:
        from hybrid_ray.actors import get_master

        # The JVM finds the master by name (it cannot start it); the master holds the
        # session's whole config, remote tier included, for the actors serving the JVM.
        ray.get(get_master(shuffle_config.namespace).spark_open_session.remote(
            session_token, shuffle_config), timeout=120)
    token_dir = ""
    try:
        if hybrid_shuffle:
            from hybrid_ray.spark_jvm import config_to_json

            token_dir, token_file = _session_token_file(session_token)
            configs["spark.hybridray.config"] = config_to_json(shuffle_config, token_file)
        cluster_cpus = float(ray.cluster_resources().get("CPU", 0))
        session = raydp.init_spark(app_name, num_executors, executor_cores, executor_memory,
                                   configs=spark_configs(num_executors, executor_cores,
                                                         configs, cluster_cpus,
                                                         ray_logs_dir()))
    except BaseException as exc:  # RayDP raises bare Exceptions and Py4J errors
        # Also on a Ctrl-C (or SystemExit) during Spark's ~40 s start: nothing else would
        # ever close the session, whose config (credentials included) the master holds.
        if hybrid_shuffle:
            _close_master_session(shuffle_config.namespace, session_token)
        if not isinstance(exc, Exception):
            raise
        text = str(exc)
        if "has inited" in text:
            raise SparkSetupError("a Spark session is already running on this Ray cluster; "
                                  "call spark_bridge.stop_spark() before starting another") from exc
        raise SparkSetupError(f"RayDP could not start Spark: {_failure_summary(text)}"
                              " (check the executor settings against the cluster's free CPUs "
                              "and memory: `ray status`)") from exc
    finally:
        # The driver's JVM read it while Spark started (its shuffle manager is made then).
        if token_dir:
            shutil.rmtree(token_dir, ignore_errors=True)
    # This session is the current one now: spark_shuffle_reports() gave a session started
    # with hybrid_shuffle=False the reports of the last stopped one, exchanges it never ran.
    _last_session_shuffles = None
    if hybrid_shuffle:
        from spark_bridge.hybrid_shuffle import app_prefix

        _session_shuffles = (shuffle_config.namespace,
                             app_prefix(session.sparkContext.applicationId, session_token),
                             session_token)
        _session_config = shuffle_config
        threading.Thread(target=_heartbeat_spark_shuffles, args=(_session_shuffles,),
                         daemon=True, name="hybrid-ray-spark-heartbeat").start()
    _given_config = shuffle_config
    return session


def _check_driver_jvm_has_the_manager() -> None:
    """Refuse, naming the fix, a Spark driver JVM this process started earlier without
    hybrid_ray's jar: PySpark keeps one driver JVM per process, with the classpath of its
    first session, and Spark's start then failed with ClassNotFoundException, which
    init_spark reported as a start failure to check against the cluster's CPUs."""
    from pyspark import SparkContext

    from spark_bridge.hybrid_shuffle import MANAGER_CLASS

    gateway = SparkContext._gateway  # noqa: SLF001 - the process's driver JVM, if any
    if gateway is None:
        return
    try:
        loader = gateway.jvm.java.lang.Thread.currentThread().getContextClassLoader()
        loader.loadClass(MANAGER_CLASS)
    except Exception as exc:  # noqa: BLE001 - Py4J's error for a missing class
        if "ClassNotFoundException" not in str(exc):
            return  # a JVM that cannot be asked: Spark's start says what is wrong
        raise SparkSetupError(
            "this process's Spark driver JVM was started (by an earlier Spark session) "
            "without hybrid_ray's shuffle manager jar on its classpath, and PySpark keeps "
            "that JVM for every later session: start Spark in a new Python process, or "
            "pass hybrid_shuffle=False") from None


def _session_token_file(token: str) -> tuple[str, str]:
    """A new directory (0700) holding one file (0600) with ``token``, for the driver's JVM
    to read while Spark starts; returns both paths. The token is the key the shuffle master
    hands the session's whole config (remote-tier credentials included) out under, and
    Spark's configs are on spark-submit's command line (PySpark's launch_gateway), which
    any local user can read: the config carries only the file's path. The driver's JVM runs
    on this node as this user (PySpark starts it); executors take the token from the shuffle
    handles of their tasks."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="hybrid-ray-session-")
    path = os.path.join(directory, "token")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, path


def _failure_summary(text: str) -> str:
    """The first line of a start failure and, for a Py4J error, the Java exception on the
    line after it ("An error occurred while calling ..." alone names no reason)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    summary = lines[0][:500]
    java = next((line for line in lines[1:] if line.startswith(": ")), None)
    if java is not None:
        summary += f" {java[2:][:500]}"
    return summary


def _close_master_session(namespace: str, token: str) -> None:
    """Best effort: have the shuffle master forget the config (credentials included) it
    holds for a session whose Spark did not start; nothing else would ever close it."""
    import json

    import ray

    from hybrid_ray.actors import master_handle

    try:
        ray.get(master_handle(namespace).spark_release.remote(
            json.dumps({"close_session": token})), timeout=60)
    except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
        import logging

        logging.getLogger(__name__).warning(
            "could not close the failed Spark session at the shuffle master: %s", exc)


def _heartbeat_spark_shuffles(session: tuple[str, str, str]) -> None:
    """Keep the session's Spark shuffles from the master's orphan TTL while it runs (the
    driver's JVM heartbeats too where it is connected to Ray; RayDP's often is not)."""
    import json

    import ray

    from hybrid_ray.actors import master_handle
    from hybrid_ray.config import DRIVER_HEARTBEAT_S

    namespace, prefix, _ = session
    failing_since: float | None = None  # when the current run of failed beats began
    while _session_shuffles == session:
        try:
            ray.get(master_handle(namespace).spark_heartbeat.remote(
                json.dumps({"prefix": prefix})), timeout=30)
            if failing_since is not None:
                logging.getLogger(__name__).warning(
                    "hybrid_ray: the shuffle master answers the Spark session's heartbeat "
                    "again, after %.0f s without", time.monotonic() - failing_since)
                failing_since = None
        except Exception as exc:  # noqa: BLE001 - the next beat tries again
            if failing_since is None:
                # Said once per run of failures, not per beat: the master releases shuffles
                # left without any heartbeat for its orphan TTL (ShuffleConfig.orphan_ttl_s),
                # and the jobs reading them then fail with that reason.
                failing_since = time.monotonic()
                logging.getLogger(__name__).warning(
                    "hybrid_ray: the Spark session's heartbeat to its shuffle master failed "
                    "(%s: %s); it is tried again every %s s, and shuffles left without one "
                    "for the master's orphan TTL are released", type(exc).__name__,
                    str(exc)[:300], DRIVER_HEARTBEAT_S)
        time.sleep(DRIVER_HEARTBEAT_S)


def stop_spark() -> None:
    """Release every hybrid_ray shuffle the bridge still holds, then stop RayDP's Spark.
    The session's Spark shuffles are released by the shuffle manager as Spark stops, and
    here again in case the driver could not reach the master, also when RayDP's own stop
    fails (its error is raised after the release). A bridge shuffle whose release fails
    does not keep Spark running: Spark is stopped, then that error is raised."""
    from spark_bridge.exchange import release_all

    release_error: Exception | None = None
    try:
        release_all()
    except Exception as exc:  # noqa: BLE001 - raised once Spark is stopped
        release_error = exc
    try:
        _stop_raydp()
    except BaseException as exc:
        if release_error is not None:
            exc.add_note(f"releasing the bridge's shuffles failed too: {release_error!r}")
        raise
    if release_error is not None:
        raise release_error


def _stop_raydp() -> None:
    """Stop RayDP's Spark, then release the session's Spark shuffles (also when the stop
    fails)."""
    import raydp

    global _session_config, _given_config
    _session_config = _given_config = None
    if _session_shuffles is not None:
        _quiesce_driver_shuffle_manager()
    try:
        raydp.stop_spark(cleanup_data=True)
        _wait_for_spark_masters_to_exit()
    except BaseException as stop_error:
        # RayDP's error is the one to raise: a failing release as well (Ray going down
        # with Spark) used to replace it, and the user saw only the release's timeout.
        try:
            _release_session_shuffles()
        except Exception as exc:  # noqa: BLE001 - said on the stop's error
            stop_error.add_note(f"releasing the session's Spark shuffles failed too: {exc!r}")
        raise
    _release_session_shuffles()


def _release_session_shuffles() -> None:
    """Release every Spark shuffle of the session at the master and close the session
    there (its config and credentials); once: the session is forgotten first."""
    global _session_shuffles, _last_session_shuffles
    if _session_shuffles is None:
        return
    import json

    import ray

    from hybrid_ray.actors import master_handle

    namespace, prefix, token = _session_shuffles
    _last_session_shuffles, _session_shuffles = _session_shuffles, None
    master = master_handle(namespace)
    ray.get(master.spark_release.remote(
        json.dumps({"prefix": prefix, "close_session": token})), timeout=120)
    # The release answers after at most the master's release_wait_s (20 s); a session's
    # files can take longer to go (80,000 segment files on a loaded node took minutes),
    # and a script ending right after its stop took its local Ray, and with it the tier
    # manager mid-deletion, down: the rest stayed (found by a review). Waited for, bounded.
    wait_until_deleted(lambda: ray.get(master.deletions_left.remote(prefix), timeout=60),
                       f"the Spark session's shuffles ({prefix}*)")


# How long stop_spark waits for the session's shuffle data to be deleted after the release
# answered (the release itself waits the master's release_wait_s first).
STOP_DELETION_WAIT_S = 300.0
_DELETION_POLL_S = 0.25


def wait_until_deleted(count_left: Callable[[], int], what: str,
                       bound_s: float | None = None) -> int:
    """Wait until ``count_left()`` (deletions not done yet) is 0, at most ``bound_s``
    (``STOP_DELETION_WAIT_S``); returns what is left then, having warned (with the fix)
    if anything is."""
    bound_s = STOP_DELETION_WAIT_S if bound_s is None else bound_s
    deadline = time.monotonic() + bound_s
    left = count_left()
    while left and time.monotonic() < deadline:
        time.sleep(min(_DELETION_POLL_S, max(0.0, deadline - time.monotonic())))
        left = count_left()
    if left:
        logging.getLogger(__name__).warning(
            "hybrid_ray: %d deletion(s) of %s were not done within %g s; they go on in "
            "the shuffle master while Ray runs (`hybrid-ray status` lists them). If Ray "
            "stops first, remove what is left with `hybrid-ray cleanup --older-than 0s "
            "--no-cluster --spill-dir DIR`", left, what, bound_s)
    return left


def _quiesce_driver_shuffle_manager() -> None:
    """Stop the driver JVM's shuffle manager from calling Ray: RayDP's stop shuts the
    driver's Ray down before it stops Spark, and a call in flight then crashed the JVM.
    Best effort: a JVM that is gone has nothing left to stop."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        return
    try:
        sc._jvm.org.apache.spark.shuffle.hybridray.HybridRayShuffleManager.quiesceDriver()
    except Exception as exc:  # noqa: BLE001 - Py4J errors; stop goes on regardless
        import logging

        logging.getLogger(__name__).warning(
            "could not quiesce hybrid_ray's driver shuffle manager: %s", exc)


# How long stop_spark waits for RayDP's Spark master actor to exit.
SPARK_MASTER_EXIT_TIMEOUT_S = 60.0


def _wait_for_spark_masters_to_exit(timeout_s: float = SPARK_MASTER_EXIT_TIMEOUT_S) -> None:
    """RayDP's stop only *asks* its Spark master actor to exit (a fire-and-forget call);
    until it has, its name is taken and the next ``init_spark`` of the process fails with
    "The name ..._SPARK_MASTER is already taken". Wait, bounded, until it is gone."""
    import ray

    if not ray.is_initialized():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors()]
        if not any(n.endswith("_SPARK_MASTER") or n == "RAY_APP_MASTER" for n in names):
            return
        time.sleep(0.2)
    raise SparkSetupError(f"RayDP's Spark master actor did not exit within {timeout_s:.0f} s "
                          "of stop_spark(); `ray list actors` shows it")


def spark_shuffle_reports() -> list[Any]:
    """One ``ShuffleReport`` per Spark exchange of the current (or last stopped) session
    that went through hybrid_ray's shuffle manager: bytes and segments per node and tier."""
    from spark_bridge.hybrid_shuffle import reports

    current = _session_shuffles or _last_session_shuffles
    if current is None:
        return []
    return reports(*current[:2])


def session_shuffle_config() -> ShuffleConfig | None:
    """The ShuffleConfig of the running Spark session's shuffle manager (given to
    ``init_spark(shuffle_config=...)``), or None if no session runs hybrid_ray's manager."""
    return _session_config


def given_shuffle_config() -> ShuffleConfig | None:
    """The ShuffleConfig the running session was started with (``init_spark``'s
    ``shuffle_config``, or its default), whether or not its shuffle manager is hybrid_ray's;
    None if no session started by ``init_spark`` runs."""
    return _given_config
