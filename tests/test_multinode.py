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
