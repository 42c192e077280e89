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
