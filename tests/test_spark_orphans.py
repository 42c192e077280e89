"""A Spark driver that dies leaves its HybridRayShuffleManager shuffles to the shuffle
master's orphan TTL: once nothing heartbeats them for ``orphan_ttl_s`` (the smallest
allowed, ``MIN_ORPHAN_TTL_S``), their memory-tier objects, disk files and remote objects
are gone, and a live shuffle of the same namespace, spill dir and remote path keeps every
byte. The driver is a real RayDP Spark session in a child process, killed with SIGKILL
(process group: its Python, its Spark JVM). ~1.5 min."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
import ray

from conftest import files_under, row_fingerprint, start_local_ray
from hybrid_ray import HashPartitioner, KiB, ReadClient, ShuffleConfig, build_io_tiers
from hybrid_ray.actors import get_master, get_tier_manager
from hybrid_ray.config import DRIVER_HEARTBEAT_S, MIN_ORPHAN_TTL_S
from hybrid_ray.shuffle import write_map_partition

pytestmark = [pytest.mark.slow, pytest.mark.spark]

NS = f"hr-spark-orphans-{uuid.uuid4().hex[:8]}"
# Small memory and disk budgets: the Spark shuffle and the live one use all three tiers.
# (Different disk caps: each has a disk tier of its own over the same spill dir.)
MEMORY_BYTES, DISK_BYTES, LIVE_MEMORY_BYTES, LIVE_DISK_BYTES = (
    256 * KiB, 512 * KiB, 64 * KiB, 256 * KiB)

DRIVER = textwrap.dedent("""
    import sys, time
    import ray

    gcs, namespace, spill, remote, pythonpath, local_dir = sys.argv[1:]
    ray.init(address=gcs, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    import spark_bridge
    from hybrid_ray import KiB, ShuffleConfig
    from hybrid_ray.config import MIN_ORPHAN_TTL_S

    config = ShuffleConfig(namespace=namespace, spill_dirs=[spill], remote_path=remote,
                           memory_capacity_bytes=%(memory)d, disk_capacity_bytes=%(disk)d,
                           segment_bytes={"memory": 16 * KiB}, map_chunk_bytes=64 * KiB,
                           orphan_ttl_s=MIN_ORPHAN_TTL_S, progress=False)
    spark = spark_bridge.init_spark("dying-driver", num_executors=1, executor_cores=1,
                                    executor_memory="1GB", shuffle_config=config,
                                    # Killed, Spark removes none of its local dirs:
                                    # under the test's tmp_path, not /tmp.
                                    configs={"spark.local.dir": local_dir})
    sc = spark.sparkContext
    pairs = sc.parallelize(range(200_000), 4).map(lambda x: (x %% 997, "value-%%08d" %% x))
    grouped = pairs.groupByKey(numPartitions=4).mapValues(len).cache()
    assert grouped.count() == 997
    print("ready", sc.applicationId, flush=True)
    time.sleep(600)  # killed by the test long before
""") % {"memory": MEMORY_BYTES, "disk": DISK_BYTES}


def _spark_files(path):
    return sorted(f for f in files_under(path) if "/spark-" in f)


def _other_files(path):
    return sorted(f for f in files_under(path) if "/spark-" not in f)


def _tier_bytes(node_id):
    """Bytes the node's tier manager accounts per local tier (its disk tiers summed)."""
    usage = ray.get(get_tier_manager(node_id, NS).usage.remote())
    out = {"memory": 0, "disk": 0}
    for t in usage.tiers:
        out[t.tier.value] += t.used_bytes
    return out


def test_dead_spark_driver_shuffles_expire_and_live_shuffle_is_untouched(tmp_path):
    start_local_ray()
    spill, remote = str(tmp_path / "spill"), str(tmp_path / "remote")
    remote_url = f"file://{remote}"
    node = ray.get_runtime_context().get_node_id()
    master = get_master(NS)
    # A live shuffle of the same namespace, spill dir and remote path, heartbeated here.
    config = ShuffleConfig(namespace=NS, spill_dirs=[spill], remote_path=remote_url,
                           memory_capacity_bytes=LIVE_MEMORY_BYTES,
                           disk_capacity_bytes=LIVE_DISK_BYTES,
                           segment_bytes={"memory": 32 * KiB, "disk": 64 * KiB,
                                          "remote": 128 * KiB},
                           orphan_ttl_s=MIN_ORPHAN_TTL_S, progress=False)
    live = f"shf-live-{uuid.uuid4().hex[:8]}"
    ids = np.arange(120_000, dtype=np.int64)
    table = pa.table({"k": ids, "v": ids * 7 + 3})
    ray.get(master.register.remote(live, 1, 4, config))
    stop_beating = threading.Event()

    def beat():
        while not stop_beating.wait(1.0):
            ray.get(master.heartbeat.remote(live))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    proc = None
    try:
        write_map_partition(live, 0, [table], 4, HashPartitioner(["k"]), config, master)
        live_metas = ray.get(master.segments.remote(live))
        assert {m.tier.value for m in live_metas} == {"memory", "disk", "remote"}
        live_spill, live_remote = _other_files(spill), _other_files(remote)
        live_bytes = _tier_bytes(node)

        tests_dir = os.path.dirname(os.path.abspath(__file__))
        pythonpath = f"{os.path.dirname(tests_dir)}:{tests_dir}"
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        proc = subprocess.Popen(
            [sys.executable, str(script), ray.get_runtime_context().gcs_address, NS, spill,
             remote_url, pythonpath, str(tmp_path / "spark-local")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": pythonpath}, start_new_session=True)
        line = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not line.startswith("ready"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("ready"), f"the driver did not get ready: {line!r}"
        app_key = line.split()[1].replace(":", "_")
        spark_shuffles = [s for s in ray.get(master.live_shuffles.remote())
                          if s.startswith("spark-")]
        assert spark_shuffles and all(app_key in s for s in spark_shuffles), spark_shuffles
        # The Spark shuffle's data is in all three tiers.
        assert _spark_files(spill) and _spark_files(remote), "no Spark disk/remote segments"
        with_spark = _tier_bytes(node)
        assert all(with_spark[t] > live_bytes[t] for t in ("memory", "disk")), \
            (with_spark, live_bytes)

        os.killpg(proc.pid, signal.SIGKILL)  # the driver's Python and its Spark JVM
        killed = time.monotonic()
        proc.wait(30)
        # The master checks for orphans every EXPIRY_CHECK_INTERVAL_S (5 s).
        bound = MIN_ORPHAN_TTL_S + 20
        while time.monotonic() - killed < bound and (
                any(s.startswith("spark-") for s in ray.get(master.live_shuffles.remote()))
                or _spark_files(spill) or _spark_files(remote)
                or _tier_bytes(node) != live_bytes):
            time.sleep(0.5)
        to_clean = time.monotonic() - killed
        assert not [s for s in ray.get(master.live_shuffles.remote()) if s.startswith("spark-")]
        assert _spark_files(spill) == [] and _spark_files(remote) == []
        # Memory (the executor's objects), disk and remote bytes of the Spark shuffle are
        # all accounted back; the live shuffle's are all still there.
        assert _tier_bytes(node) == live_bytes
        assert to_clean < bound, to_clean
        # The last heartbeat came at most DRIVER_HEARTBEAT_S before the kill.
        assert to_clean > MIN_ORPHAN_TTL_S - DRIVER_HEARTBEAT_S - 1, "released before its TTL"

        # The live shuffle: still registered, same segments, same files, every row readable.
        assert live in ray.get(master.live_shuffles.remote())
        assert ray.get(master.segments.remote(live)) == live_metas
        assert _other_files(spill) == live_spill and _other_files(remote) == live_remote
        rows = list(ReadClient(build_io_tiers(config)).read_segments(live_metas))
        assert row_fingerprint(rows) == row_fingerprint([table])
    finally:
        stop_beating.set()
        beater.join()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        ray.get(master.release.remote(live))
    assert files_under(spill) == [] and files_under(remote) == []
    assert all(v == 0 for v in _tier_bytes(node).values())
