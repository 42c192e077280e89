"""The Ray actors: a per-node tier manager, the namespace's shuffle master, and the
long-lived worker processes that run maps (writers) and reducers (readers).

The first two are thin shells over plain classes (``TierManager``, ``ShuffleRegistry``), so
the logic is tested without a cluster. All are named and detached: a tier manager must
outlive the Spark executors' processes whose memory-tier objects it owns, a writer the
shuffles whose objects it owns, and the master a crashed driver, to remove that driver's
orphaned data after the TTL.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybrid_ray.config import ShuffleConfig, TierName
from hybrid_ray.master import PollResult, ShuffleRegistry, ShuffleState, metas_by_node
from hybrid_ray.segment import SegmentMeta
from hybrid_ray.tier_manager import NodeUsage, Placement, TierManager
from hybrid_ray.tiers import Grant, RemoteTier

MASTER_NAME = "hybrid_ray_shuffle_master"
TIER_MANAGER_PREFIX = "hybrid_ray_tier_manager_"
READER_PREFIX = "hybrid_ray_reader_"
WRITER_PREFIX = "hybrid_ray_writer_"
# A reader or writer process killed mid-partition is restarted and the call run again.
WORKER_MAX_RETRIES = 3
# Environment of the writer and reader processes. pyarrow's allocator (mimalloc) hands
# freed memory back to the OS 10 ms after a free by default, so every map chunk's take and
# hash buffers were faulted in afresh, and on VMs whose host backs guest memory lazily a
# fresh page costs more than the copy into it. One second keeps the buffers of consecutive
# chunks warm and still returns an idle worker's memory. Measured on a 1 GB shuffle
# (/tmp/prof/run4.py, warm round): 262-268 MB/s with the default, 296-346 with purging
# off, 299 with 1 s.
WORKER_ENV = {"MIMALLOC_PURGE_DELAY": "1000"}
# How often the master looks for shuffles whose driver stopped heartbeating.
EXPIRY_CHECK_INTERVAL_S = 30.0


def _node_object_store_bytes(node_id: str) -> int:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return 0


@ray.remote(num_cpus=0, max_restarts=0)
class TierManagerActor:
    """Owns one node's memory-tier objects and disk-tier accounting; serves its disk
    segments to readers on other nodes."""

    def __init__(self, node_id: str) -> None:
        self.tm = TierManager(node_id, _node_object_store_bytes(node_id))

    def put_objects(self, values: list[Any]) -> list[ray.ObjectRef]:
        """Put each value as an object this actor owns (memory-tier segments). The refs
        come back inside a list, so Ray hands back the refs, not the values."""
        return [ray.put(v) for v in values]

    def register_shuffle(self, shuffle_id: str, config: ShuffleConfig) -> int:
        return self.tm.register_shuffle(shuffle_id, config)

    def reserve(self, shuffle_id: str, sizes: Sequence[int],
                settled: Sequence[tuple[Grant, int | None]] = ()) -> list[Placement]:
        return self.tm.reserve(shuffle_id, sizes, settled)

    def settle(self, shuffle_id: str, settled: Sequence[tuple[Grant, int | None]]) -> None:
        self.tm.settle(shuffle_id, settled)

    def free_segments(self, shuffle_id: str, metas: Sequence[SegmentMeta]) -> None:
        self.tm.free_segments(shuffle_id, metas)

    def release_shuffle(self, shuffle_id: str) -> None:
        self.tm.release_shuffle(shuffle_id)

    def read_disk_segment(self, meta: SegmentMeta) -> bytes:
        return self.tm.read_disk_segment(meta)

    def usage(self) -> NodeUsage:
        return self.tm.usage()


class ActorNodeStorage:
    """``NodeStorage`` for a write client: forwards space decisions to a tier-manager actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def reserve(self, shuffle_id, sizes, settled=()):
        return ray.get(self.actor.reserve.remote(shuffle_id, list(sizes), list(settled)))

    def settle(self, shuffle_id, settled):
        ray.get(self.actor.settle.remote(shuffle_id, list(settled)))

    def free_segments(self, shuffle_id, metas):
        ray.get(self.actor.free_segments.remote(shuffle_id, list(metas)))


def _get_or_start(actor_class: Any, name: str, namespace: str, *args: Any,
                  **options: Any) -> Any:
    """The named actor, started (detached) if it is not running yet."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    return actor_class.options(name=name, namespace=namespace, lifetime="detached",
                               get_if_exists=True, **options).remote(*args)


def get_tier_manager(node_id: str, namespace: str) -> Any:
    """The tier manager of ``node_id``, started (pinned to that node) if not running yet."""
    return _get_or_start(
        TierManagerActor, TIER_MANAGER_PREFIX + node_id, namespace, node_id,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def existing_tier_manager(node_id: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(TIER_MANAGER_PREFIX + node_id, namespace=namespace)
    except ValueError:
        return None


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)
class ShuffleMasterActor:
    """One per namespace. Calls are serialised by a lock (a thread also expires orphans)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lock = threading.RLock()
        self.registry = ShuffleRegistry(self._delete_segments, self._release_data)
        threading.Thread(target=self._expiry_loop, daemon=True).start()

    # ---- deletion I/O ----------------------------------------------------------------------
    def _delete_segments(self, state: ShuffleState, metas: Sequence[SegmentMeta]) -> None:
        for node_id, local in metas_by_node(metas).items():
            tm = existing_tier_manager(node_id, self.namespace)
            if tm is not None:
                tm.free_segments.remote(state.shuffle_id, local)
        remote = [m for m in metas if m.tier == TierName.REMOTE]
        if remote:
            tier = self._remote_tier(state.config)
            for meta in remote:
                tier.delete(meta)

    def _release_data(self, state: ShuffleState) -> None:
        waits = []
        for node_id in state.nodes:
            tm = existing_tier_manager(node_id, self.namespace)
            if tm is not None:
                waits.append(tm.release_shuffle.remote(state.shuffle_id))
        if state.config.remote_path:
            self._remote_tier(state.config).remove_shuffle_data(state.shuffle_id)
        ray.wait(waits, num_returns=len(waits), timeout=60)

    def _remote_tier(self, config: ShuffleConfig) -> RemoteTier:
        return RemoteTier(config.segment_bytes[TierName.REMOTE], config.remote_path,
                          config.job_id, config.storage_options, check_reachable=False)

    def _expiry_loop(self) -> None:
        while True:
            time.sleep(EXPIRY_CHECK_INTERVAL_S)
            with self._lock:
                self.registry.expire()

    # ---- the API (each a locked call into the registry) --------------------------------------
    def register(self, shuffle_id: str, num_maps: int | None, num_subpartitions: int,
                 config: ShuffleConfig, recoverable: bool = False) -> None:
        with self._lock:
            self.registry.expire()
            self.registry.register(shuffle_id, num_maps, num_subpartitions, config,
                                   recoverable)

    def seal(self, shuffle_id: str, num_maps: int,
             attempts: dict[int, int] | None = None) -> None:
        with self._lock:
            self.registry.seal(shuffle_id, num_maps, attempts)

    def heartbeat(self, shuffle_id: str) -> None:
        with self._lock:
            self.registry.heartbeat(shuffle_id)

    def begin_map(self, shuffle_id: str, map_index: int, node_id: str, pid: int) -> int | None:
        with self._lock:
            return self.registry.begin_map(shuffle_id, map_index, node_id, pid)

    def commit(self, shuffle_id: str, map_index: int, attempt: int,
               metas: list[SegmentMeta]) -> bool:
        with self._lock:
            return self.registry.commit(shuffle_id, map_index, attempt, metas)

    def finish_map(self, shuffle_id: str, map_index: int, attempt: int, stats: Any) -> bool:
        with self._lock:
            return self.registry.finish_map(shuffle_id, map_index, attempt, stats)

    def report_lost(self, shuffle_id: str, map_index: int, attempt: int) -> bool:
        with self._lock:
            return self.registry.report_lost(shuffle_id, map_index, attempt)

    def take_lost(self, shuffle_id: str) -> list[int]:
        with self._lock:
            return self.registry.take_lost(shuffle_id)

    def poll(self, shuffle_id: str, subpartition: int, cursors: dict, pid: int) -> PollResult:
        with self._lock:
            return self.registry.poll(shuffle_id, subpartition, cursors, pid)

    def free_subpartition(self, shuffle_id: str, subpartition: int) -> int:
        with self._lock:
            return self.registry.free_subpartition(shuffle_id, subpartition)

    def consumed(self, shuffle_id: str, subpartition: int) -> bool:
        with self._lock:
            return self.registry.consumed(shuffle_id, subpartition)

    def release(self, shuffle_id: str, reason: str = "", failed: bool = False) -> bool:
        with self._lock:
            return self.registry.release(shuffle_id, reason, failed)

    def expire(self) -> list[str]:
        with self._lock:
            return self.registry.expire()

    def summary(self, shuffle_id: str) -> dict[str, Any]:
        with self._lock:
            return self.registry.summary(shuffle_id)

    def segments(self, shuffle_id: str) -> list[SegmentMeta]:
        with self._lock:
            return self.registry.segments(shuffle_id)

    def live_shuffles(self) -> dict[str, str]:
        """Shuffle id -> job id of every live shuffle (read-only; ``hybrid-ray cleanup``)."""
        with self._lock:
            return self.registry.live_shuffles()

    def progress(self, shuffle_id: str) -> dict[str, Any]:
        """Producers and readers of a shuffle (pids, segments): for status and fault tests."""
        with self._lock:
            state = self.registry.state(shuffle_id)
            return {
                "maps": [{"attempt": m.current_attempt, "finished": m.finished_attempt,
                          "pid": m.pid, "node_id": m.node_id,
                          "segments": sum(len(v) for v in m.segments.get(m.current_attempt, {}).values())}
                         for m in state.maps],
                "readers": {s: dataclasses.asdict(r) for s, r in state.readers.items()},
            }

    def status(self) -> dict[str, Any]:
        with self._lock:
            shuffles = [self.registry.summary(s) for s in self.registry.shuffle_ids()]
            nodes = {n for s in self.registry.shuffle_ids() for n in self.registry.state(s).nodes}
        usage = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            tm = existing_tier_manager(node["NodeID"], self.namespace)
            if tm is not None:
                usage.append(ray.get(tm.usage.remote(), timeout=30))
        return {"shuffles": shuffles, "nodes": usage, "active_nodes": sorted(nodes)}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=WORKER_MAX_RETRIES)
class ShuffleWorkerActor:
    """A long-lived process that runs map or reduce functions, one at a time.

    Why not Ray tasks: hybrid reducers hold no CPU (they mostly wait for data), so each
    one needs a worker process beyond Ray's pool of one per CPU, and Ray kills such extra
    idle workers after a second. Every shuffle then paid for new processes importing Ray,
    pyarrow and hybrid_ray: ~1.3 CPU-s each, a fifth of the CPU of a 1 GiB shuffle on two
    cores (profiled with py-spy). Detached workers stay warm across shuffles.

    Writers (map side) also own the memory-tier objects they put: being long-lived, they
    can, and each segment is then written to the object store once. A map task instead had
    to hand its segments to the tier manager to own, as task arguments the manager put
    again (Ray 2.56 removed ``ray.put(_owner=...)``): two object-store writes per segment,
    and on this VM every fresh object-store page costs more than the copy itself. If a
    writer dies, so do its objects; readers report the loss and the driver re-runs those
    maps (``ShuffleRegistry.report_lost``).
    """

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def _alive_cpu_nodes() -> list[dict]:
    nodes = [n for n in ray.nodes()
             if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(nodes, key=lambda n: n["NodeID"])


def _worker(prefix: str, node: str, k: int, namespace: str) -> Any:
    # Hard affinity: with soft affinity Ray placed a new node's writer on the driver's node
    # about half the time on a fresh two-node cluster (its view of the new node lagging),
    # leaving that node's CPUs idle and its tier manager unused. If the node dies, the
    # worker dies with it, as does the node's tier manager and every segment on it: the
    # shuffle in flight fails loudly, and later ones use only the alive nodes.
    return _get_or_start(ShuffleWorkerActor, f"{prefix}{node}_{k}", namespace,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                         runtime_env={"env_vars": WORKER_ENV})


def get_readers(namespace: str, count: int) -> list[Any]:
    """``count`` reader actors spread evenly over the alive nodes with CPUs, started (and
    kept) on first use. Reader ``k`` of a node keeps its name across shuffles."""
    nodes = [n["NodeID"] for n in _alive_cpu_nodes()] or \
        [ray.get_runtime_context().get_node_id()]
    slots = [(node, k) for k in range(-(-count // len(nodes))) for node in nodes][:count]
    return [_worker(READER_PREFIX, node, k, namespace) for node, k in slots]


def get_writers(namespace: str) -> list[tuple[str, Any]]:
    """One writer actor per CPU of every alive node, as (node id, actor): maps run on
    the node that holds their input block, as many at once as the node has CPUs."""
    nodes = _alive_cpu_nodes()
    if not nodes:
        return [(ray.get_runtime_context().get_node_id(),
                 _worker(WRITER_PREFIX, ray.get_runtime_context().get_node_id(), 0,
                         namespace))]
    return [(n["NodeID"], _worker(WRITER_PREFIX, n["NodeID"], k, namespace))
            for n in nodes for k in range(max(1, int(n["Resources"]["CPU"])))]


def get_master(namespace: str) -> Any:
    """The namespace's shuffle master, started on first use."""
    return _get_or_start(ShuffleMasterActor, MASTER_NAME, namespace, namespace)
