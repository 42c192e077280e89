"""Two Ray nodes on one machine (ray.cluster_utils.Cluster): separate object stores, separate
spill dirs, a tier manager per node, reducers reading segments written on the other node."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
from conftest import files_under, multinode_cluster, row_fingerprint, stop_cluster
from hybrid_ray import MiB, ShuffleConfig
from hybrid_ray.actors import existing_tier_manager, get_writers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = multinode_cluster(2)  # node 0 is the head
    yield c
    stop_cluster(c)


def test_two_nodes_cross_node_reads_exact_on_a_million_rows(cluster, tmp_path):
    import ray

    rng = np.random.default_rng(11)
    rows = 1_000_000
    table = pa.table({"key": rng.integers(0, 50_000, rows), "v": rng.integers(0, 1 << 62, rows)})
    ds = ray.data.from_arrow(table).repartition(8).materialize()
    spill = str(tmp_path / "spill-{node_id}")
    cfg = ShuffleConfig(spill_dirs=[spill], memory_capacity_bytes=1 * MiB, progress=False,
                        segment_bytes={"memory": 256 * 1024, "disk": 512 * 1024})
    # Writers started: a node whose writer is still starting would get fewer maps (the
    # other node's writer takes them), maybe too few to reach its disk tier. Each writer
    # runs on the node it is named for (soft affinity once put both on one node).
    writers = get_writers(cfg.namespace)
    placed = ray.get([w.run.remote(lambda: ray.get_runtime_context().get_node_id())
                      for _, w in writers])
    assert placed == [node for node, _ in writers]
    parts = ray.get(hybrid_ray.repartition(ds, 4, keys=["key"], config=cfg).to_arrow_refs())
    assert row_fingerprint(parts) == row_fingerprint([table])
    report = hybrid_ray.last_report()
    node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    # Both nodes wrote segments, into their own tiers.
    assert set(report.per_node_tier) == set(node_ids), report.table()
    for node in node_ids:
        assert report.per_node_tier[node].get("disk", (0, 0))[1] > 0
        assert existing_tier_manager(node, cfg.namespace) is not None
    # Each reducer needs segments of every map, so some reads crossed nodes; the
    # segments lived in two separate directories, now empty.
    spill_dirs = [spill.replace("{node_id}", n) for n in node_ids]
    for d in spill_dirs:
        assert files_under(d) == []
    tm_usage = [ray.get(existing_tier_manager(n, cfg.namespace).usage.remote())
                for n in node_ids]
    assert all(t.used_bytes == 0 for u in tm_usage for t in u.tiers)


def test_a_disk_segment_is_served_after_its_node_s_tier_manager_died(cluster, tmp_path):
    """A reader on one node reads a disk segment of another through that node's tier
    manager. When the tier manager died and the node lived (the memory monitor, a crash),
    the reader failed with the raw ActorDiedError after waiting for a node death that
    never came, with the file intact. It now asks a tier manager started again there,
    which serves files of shuffle directories marked as ours."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hybrid_ray import SegmentId, TierName
    from hybrid_ray.actors import get_tier_manager
    from hybrid_ray.reduce_task import fetch_from_node, start_fetch_from_node
    from hybrid_ray.segment import encode_segment
    from hybrid_ray.tiers.disk import DiskTier

    head = ray.get_runtime_context().get_node_id()
    [other] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill-{node_id}")], progress=False)
    sid = SegmentId("served-after-restart", 0, 0, 0, 0)
    payload = bytes(encode_segment(pa.table({"v": [1, 2, 3]}), sid))

    def on(node):
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    @ray.remote(num_cpus=0)
    def write_on_other_node():
        tier = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for(other))
        return tier.write(sid, payload, node_id=other)

    meta = ray.get(write_on_other_node.options(**on(other)).remote())
    tm = get_tier_manager(other, cfg.namespace)
    ray.get(tm.usage.remote())
    ray.kill(tm, no_restart=True)

    @ray.remote(num_cpus=0)
    def read_from_head():
        return fetch_from_node(meta, cfg.namespace)

    assert ray.get(read_from_head.options(**on(head)).remote(), timeout=120) == payload
    # The read-ahead path (start_fetch_from_node) falls back to the same recovery.
    ray.kill(get_tier_manager(other, cfg.namespace), no_restart=True)

    @ray.remote(num_cpus=0)
    def read_ahead_from_head():
        return start_fetch_from_node(meta, cfg.namespace)()

    assert ray.get(read_ahead_from_head.options(**on(head)).remote(), timeout=120) == payload
    ray.kill(get_tier_manager(other, cfg.namespace), no_restart=True)  # it knows no shuffle


_JOB_B = '''
import json, sys
import numpy as np, pyarrow as pa, ray
import hybrid_ray
from hybrid_ray import ShuffleConfig
address, wd, namespace, spill = sys.argv[1:5]
sys.path.insert(0, wd)
import jobpart  # noqa: E402  (only in this job's working_dir)
ray.init(address=address, log_to_driver=False,
         runtime_env={"working_dir": wd, "env_vars": {"HR_JOB_MARK": "job-b"}})
table = pa.table({"key": np.arange(5000, dtype=np.int64)})
result = hybrid_ray.run_shuffle([ray.put(table)], 4, jobpart.ModPartitioner(), table.schema,
                                ShuffleConfig(namespace=namespace, spill_dirs=[spill],
                                              progress=False))
keys = sorted(k for ref in result.refs for k in ray.get(ref).column("key").to_pylist())
marks = ray.get([w.run.remote(lambda: __import__("os").environ.get("HR_JOB_MARK"))
                 for _, w in hybrid_ray.actors.get_writers(namespace)])
print("RESULT " + json.dumps({"exact": keys == list(range(5000)), "marks": marks,
                              "job": ray.get_runtime_context().get_job_id()}))
'''


def test_a_job_with_its_own_runtime_env_runs_its_maps_in_workers_of_its_own(cluster, tmp_path):
    """Was: the namespace's kept writers were started by the first job and served every
    later one: a job's partitioner from its working_dir was not found ("No module named
    'jobpart'"), and its env_vars (credentials too) were the first job's. A job with a
    runtime environment of its own gets workers of its own, ended with it."""
    import json
    import os
    import subprocess
    import sys
    import time

    import ray

    namespace = "hr_job_envs"
    get_writers(namespace)  # this job's workers exist first (before: the namespace's)
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "jobpart.py").write_text(
        "import numpy as np\nfrom hybrid_ray import Partitioner\n\n\n"
        "class ModPartitioner(Partitioner):\n"
        "    def assign(self, table, map_index, num_partitions):\n"
        "        return (table['key'].to_numpy() % num_partitions).astype(np.int64)\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    out = subprocess.run([sys.executable, "-c", _JOB_B, cluster.address, str(wd), namespace,
                          str(tmp_path / "spill")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # Ray's raylet writes warnings (worker start-up concurrency) to the job's stdout, also
    # after its answer: taking the last line failed the test on a busy machine.
    [answer] = [json.loads(line.removeprefix("RESULT ")) for line in out.stdout.splitlines()
                if line.startswith("RESULT ")]
    assert answer["exact"] and answer["marks"] and set(answer["marks"]) == {"job-b"}, answer
    # Its workers ended with it; this job's never saw its environment.
    deadline = time.monotonic() + 30
    while any(f"job{answer['job']}_" in a["name"]
              for a in ray.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "job B's workers outlived it"
        time.sleep(0.5)
    assert {ray.get(w.run.remote(lambda: os.environ.get("HR_JOB_MARK")))
            for _, w in get_writers(namespace)} == {None}
