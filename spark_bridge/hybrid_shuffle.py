"""Spark's own exchanges through hybrid_ray: the JVM shuffle manager's jar and settings.

``init_spark(..., hybrid_shuffle=True)`` plugs ``HybridRayShuffleManager`` (built from
``jvm/`` by ``./dev setup``) into Spark through ``spark.shuffle.manager``; every ordinary
exchange of every query (SQL joins, aggregations, windows, AQE's coalesced and skew-split
reads, RDD ``reduceByKey``/``sortByKey``) then stores its map output in hybrid_ray's memory
and disk tiers under the same shuffle master as the Ray shuffles.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from typing import Any

from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.errors import HybridRayError
from hybrid_ray.report import ShuffleReport

MANAGER_CLASS = "org.apache.spark.shuffle.hybridray.HybridRayShuffleManager"
JAR_GLOB = "hybrid-ray-spark-*.jar"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Where the jar is looked for: this checkout's Maven build first (rebuilt by hand with mvn,
# the copy below is stale until ./dev runs), then the copy packaged beside the bridge (what
# an installed wheel has; ./dev's build puts it there).
JAR_DIRS = (os.path.join(os.path.dirname(_PACKAGE_DIR), "jvm", "target"),
            os.path.join(_PACKAGE_DIR, "jars"))


class ShuffleJarMissingError(HybridRayError, RuntimeError):
    """The shuffle manager's jar was not built; the message says how to build it."""


def shuffle_manager_jar() -> str:
    """Path of the built ``hybrid-ray-spark`` jar (``HYBRID_RAY_SPARK_JAR`` overrides)."""
    override = os.environ.get("HYBRID_RAY_SPARK_JAR")
    if override:
        if not os.path.isfile(override):
            raise ShuffleJarMissingError(f"HYBRID_RAY_SPARK_JAR={override} is not a file")
        # Absolute: Spark's executors resolve a relative class path in their own directory.
        return os.path.abspath(override)
    for directory in JAR_DIRS:
        found = glob.glob(os.path.join(directory, JAR_GLOB))
        if found:
            # The newest build: a version bump leaves the old jar in jvm/target (and in a
            # wheel's build dir), and by name 0.9.0 sorts after 0.10.0.
            return max(found, key=lambda path: (os.path.getmtime(path), path))
    raise ShuffleJarMissingError(
        "hybrid_ray's Spark shuffle manager jar is not built (looked for "
        f"{JAR_GLOB} in {', '.join(JAR_DIRS)}): run `./dev setup` in a checkout (Maven and "
        "a JDK 17 build it from jvm/; a wheel built after that ships it), set "
        "HYBRID_RAY_SPARK_JAR to a built jar, or start Spark with hybrid_shuffle=False")


def shuffle_manager_configs(config: ShuffleConfig, jar: str,
                            session_file: str = "") -> dict[str, str]:
    """Spark configs that route every ordinary exchange through hybrid_ray.

    The jar goes on RayDP's executor classpath (``raydp.executor.extraClassPath``, which
    RayDP puts first on the executor actor's ``-cp``; ``spark.executor.extraClassPath``
    alone gives ClassNotFoundException and a hung query) and the driver's. No external
    shuffle service, no AQE local shuffle reader and no reduce locality: map output is not
    in Spark's block manager, so those would read files that do not exist.
    ``session_file`` is the path of the file holding the token under which the shuffle
    master holds ``config`` whole (its remote tier and credentials stay out of Spark's
    configuration, and so does the token: see ``hybrid_ray.spark_jvm.SESSION_FIELD``).
    A ``config`` that is not a ``ShuffleConfig``, or a ``jar`` that is not the absolute
    path of a file, is a ``ConfigError`` here: Spark took ``None`` as the class path
    "None", and a relative path resolved in each executor's own directory.
    """
    from hybrid_ray.errors import ConfigError
    from hybrid_ray.spark_jvm import config_to_json

    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"config must be a ShuffleConfig, got {type(config).__name__}: "
                          "pass hybrid_ray.ShuffleConfig(...)")
    if not isinstance(jar, str) or not os.path.isabs(jar) or not os.path.isfile(jar):
        raise ConfigError(f"jar must be the absolute path of the built shuffle manager jar, "
                          f"got {jar!r} (not an absolute path of a file): pass "
                          "spark_bridge.hybrid_shuffle.shuffle_manager_jar()")
    return {
        "spark.shuffle.manager": MANAGER_CLASS,
        "spark.shuffle.service.enabled": "false",
        "spark.sql.adaptive.localShuffleReader.enabled": "false",
        "spark.shuffle.reduceLocality.enabled": "false",
        "spark.hybridray.namespace": config.namespace,
        "spark.hybridray.config": config_to_json(config, session_file),
        # One segment size for every tier: a segment's tier is chosen after it is cut.
        "spark.hybridray.segmentBytes": str(config.segment_bytes[TierName.MEMORY]),
        "spark.hybridray.flushBytes": str(config.map_chunk_bytes),
        "raydp.executor.extraClassPath": jar,
        "spark.driver.extraClassPath": jar,
    }


def app_key(app_id: str) -> str:
    """The application part of a Spark shuffle's hybrid_ray id (as the JVM derives it in
    ``HybridRayContext.appKey``)."""
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", app_id)
    return key[-80:]


def session_tag(session: str) -> str:
    """The part of a Spark shuffle's id that tells sessions under one application id apart
    (as the JVM derives it in ``HybridRayContext.sessionTag``): the first 8 hex digits of
    the SHA-256 of the session token. Not the token's own characters: it is the key the
    master hands the session's whole config (credentials included) out under, and shuffle
    ids are shown and logged."""
    if not isinstance(session, str) or not session:
        raise ValueError(f"a session token is a non-empty string, got {session!r}")
    return hashlib.sha256(session.encode("utf-8")).hexdigest()[:8]


def app_prefix(app_id: str, session: str) -> str:
    """The start of every hybrid_ray id of the Spark session ``session`` (its token) of
    application ``app_id``: ``spark-<app>-<session tag>-``."""
    return f"spark-{app_key(app_id)}-{session_tag(session)}-"


def reports(namespace: str, prefix: str) -> list[ShuffleReport]:
    """One ``ShuffleReport`` per Spark shuffle whose id starts with ``prefix``."""
    import ray

    from hybrid_ray.actors import answer_of, master_handle

    summaries = answer_of(master_handle(namespace).spark_reports.remote(prefix),
                          "the shuffle master's spark_reports", error=HybridRayError)
    return [_report(s) for s in summaries]


def _report(summary: dict[str, Any]) -> ShuffleReport:
    """A Spark exchange's report from the master's summary. What the master knows is what
    was stored: bytes and segments per node and tier. Rows, input bytes and wall time are
    Spark's (its UI has them) and read 0 here: the stored (compressed) bytes as input and
    the shuffle's age as wall time gave a throughput that fell the longer one waited."""
    per_node = {node: {tier: (int(v[0]), int(v[1])) for tier, v in tiers.items()}
                for node, tiers in summary["per_node_tier"].items()}
    return ShuffleReport(
        shuffle_id=summary["shuffle_id"], operation="spark exchange", mode="blocking",
        spilling=summary["spilling"], num_maps=summary["num_maps"],
        num_partitions=summary["num_partitions"], rows=0, input_bytes=0,
        wall_time_s=0.0, per_node_tier=per_node, tier_switches=0,
        spill_events=0, superseded_attempts=summary["superseded_attempts"],
        hybrid_overlap=False,
        map_input=(f"Spark's own shuffle (fallback: {summary['fallback']})"
                   if summary.get("fallback") else "spark executors (JVM shuffle manager)"),
        notes=tuple(summary.get("notes", ())))
