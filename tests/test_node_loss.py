"""A worker node removed mid-shuffle (``ray.cluster_utils.Cluster``): the shuffle finishes with
exact output, re-running the maps whose segments died with the node, in both modes and both
spilling settings; the master lives on the head node; a shuffle whose master is gone fails
with a hybrid_ray error naming the cause."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from conftest import files_under, multinode_cluster, row_fingerprint, stop_cluster
from hybrid_ray import HashPartitioner, MiB, ShuffleConfig, ShuffleMasterLostError
from hybrid_ray.actors import (
    HEAD_NODE_RESOURCE, existing_tier_manager, get_master, get_reader_slots, get_writers,
)

pytestmark = pytest.mark.slow

ROWS = 240_000


class SlowHash(HashPartitioner):
    """Hash partitioning that takes a while per chunk, so a node dies with maps in flight
    and maps finished on it."""

    def assign(self, table, map_index, num_partitions):
        time.sleep(0.15)
        return super().assign(table, map_index, num_partitions)


@pytest.fixture(scope="module")
def cluster():
    c = multinode_cluster(1)  # node 0 is the head
    yield c
    stop_cluster(c)


def _add_workers(cluster, count):
    import ray

    nodes = [cluster.add_node(num_cpus=1, object_store_memory=300 * 1024**2)
             for _ in range(count)]
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) < 1 + count:
        assert time.monotonic() < deadline, "worker nodes did not join"
        time.sleep(0.2)
    return nodes


def _warm_workers(namespace):
    """Start every node's writers and readers before the shuffle: a node whose writer is
    still starting gets no maps, and then its loss proves nothing."""
    import ray

    writers = get_writers(namespace)
    readers = get_reader_slots(namespace, len(writers))
    ray.get([w.run.remote(len, ()) for _, w in writers] +
            [r.run.remote(len, ()) for _, r in readers])


def _segments_on(node, maps) -> int:
    return sum(m["segments"] for m in maps if m["node_id"] == node.node_id)


def _kill_when_it_holds_finished_maps(cluster, victim, namespace, killed):
    """Remove ``victim`` once it has finished at least one map and the map stage is still
    running: deterministic by who holds the segments, not by timing."""
    import ray

    master = get_master(namespace)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for shuffle_id in ray.get(master.live_shuffles.remote()):
            maps = ray.get(master.progress.remote(shuffle_id))["maps"]
            done_on_victim = [m for m in maps
                              if m["node_id"] == victim.node_id and m["finished"] is not None]
            unfinished = [m for m in maps if m["finished"] is None]
            if done_on_victim and unfinished:
                killed["maps_done_on_victim"] = len(done_on_victim)
                before = _segments_on(victim, maps)
                cluster.remove_node(victim)
                killed["at"] = time.monotonic()
                # Counted again once the node is gone (nothing more commits there); the
                # first count stands in if a re-run moved a map off it already.
                after = _segments_on(victim, ray.get(master.progress.remote(shuffle_id))["maps"])
                killed["segments_on_victim"] = max(before, after)
                return
        time.sleep(0.05)


@pytest.mark.parametrize("mode,spilling", [("hybrid", "selective"), ("blocking", "full")])
def test_shuffle_survives_losing_a_worker_node_with_exact_output(cluster, tmp_path, mode,
                                                                 spilling):
    import ray

    from hybrid_ray.shuffle import run_shuffle

    victim, survivor = _add_workers(cluster, 2)
    namespace = f"nodeloss-{mode}"
    spill = str(tmp_path / "spill-{node_id}")
    cfg = ShuffleConfig(spill_dirs=[spill], memory_capacity_bytes=2 * MiB, progress=False,
                        mode=mode, spilling=spilling, namespace=namespace,
                        map_chunk_bytes=128 * 1024,
                        segment_bytes={"memory": 128 * 1024, "disk": 256 * 1024})
    _warm_workers(namespace)
    rng = np.random.default_rng(5)
    table = pa.table({"key": rng.integers(0, 10_000, ROWS),
                      "v": rng.integers(0, 1 << 62, ROWS)})
    refs = [ray.put(table.slice(i * ROWS // 12, ROWS // 12)) for i in range(12)]
    killed: dict = {}
    killer = threading.Thread(target=_kill_when_it_holds_finished_maps,
                              args=(cluster, victim, namespace, killed), daemon=True)
    killer.start()
    result = run_shuffle(refs, 4, SlowHash(["key"]), table.schema, cfg, "repartition")
    killer.join(timeout=5)
    assert "at" in killed, "the victim node never held a finished map: nothing was tested"
    parts = ray.get(result.refs, timeout=120)
    assert row_fingerprint(parts) == row_fingerprint([table])
    key_sets = [set(p["key"].to_pylist()) for p in parts]  # equal keys in one partition
    assert sum(map(len, key_sets)) == len(set().union(*key_sets))
    report = result.report
    # The victim's finished maps ran again (lost), or its running map did (superseded).
    assert report.lost_maps_rerun + report.superseded_attempts >= 1, report.table()
    # The victim's segments count only where a reducer read them before the loss and its
    # subpartition was freed (the re-run's segments of it were not kept). A map lost there
    # had a subpartition not yet freed: its segments of it no longer count.
    victim_segments = sum(count for _, count in report.per_node_tier.get(
        victim.node_id, {}).values())
    if report.lost_maps_rerun:
        assert victim_segments < killed["segments_on_victim"], report.table()
    else:
        assert victim_segments <= killed["segments_on_victim"], report.table()
    # Nothing left on the nodes that survived.
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert victim.node_id not in alive
    for node in alive:
        assert files_under(spill.replace("{node_id}", node)) == []
        tm = existing_tier_manager(node, namespace)
        if tm is not None:
            usage = ray.get(tm.usage.remote())
            assert all(t.used_bytes == 0 for t in usage.tiers), usage
    cluster.remove_node(survivor)


def test_master_runs_on_the_head_node_and_its_loss_is_named(cluster, tmp_path):
    import ray

    namespace = "master-loss"
    master = get_master(namespace)
    where = ray.get(master.run_deletions.remote())  # started and answering
    assert where == []
    head = [n for n in ray.nodes() if n["Alive"] and HEAD_NODE_RESOURCE in n["Resources"]]
    assert ray.get(master.node_id.remote()) == head[0]["NodeID"]

    from hybrid_ray.shuffle import run_shuffle

    class KillsTheMaster(HashPartitioner):
        def assign(self, table, map_index, num_partitions):
            import ray as r

            from hybrid_ray.actors import MASTER_NAME

            r.kill(r.get_actor(MASTER_NAME, namespace="master-loss"))
            time.sleep(1.0)
            return super().assign(table, map_index, num_partitions)

    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        namespace=namespace)
    table = pa.table({"key": list(range(100))})
    started = time.monotonic()
    with pytest.raises(ShuffleMasterLostError, match="shuffle master of namespace "
                                                     "'master-loss' is gone"):
        run_shuffle([ray.put(table)], 2, KillsTheMaster(["key"]), table.schema, cfg)
    assert time.monotonic() - started < 60
