"""Start-up (issue 17): ``hybrid_ray.init`` starts every actor a shuffle needs, once, on the
right nodes, and a shuffle after it starts no process of its own."""

from __future__ import annotations

import os
import time
import uuid

import pyarrow as pa
import pytest

import hybrid_ray
from conftest import base_config, row_fingerprint, start_local_ray
from hybrid_ray import ActorStartError, ConfigError, RemoteTierError, ShuffleConfig
from hybrid_ray.actors import (
    MASTER_NAME, READER_PREFIX, TIER_MANAGER_PREFIX, WRITER_PREFIX, worker_name,
    writers_per_node,
)


def _actor_processes(namespace: str) -> dict[str, tuple[int, str, str]]:
    """Every named actor of ``namespace``: name -> (pid, node id, state), from the GCS's
    actor table (``ray.util.state`` needs the dashboard, which the tests' Ray does not
    run)."""
    import ray

    table = ray._private.state.actors()
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace:
            continue
        actor_id = ray.get_actor(entry["name"], namespace=namespace)._actor_id.hex()
        info = table[actor_id]
        out[entry["name"]] = (info["Pid"], (info.get("Address") or {}).get("NodeID"),
                              info["State"])
    return out


def _expected(head: str, cpus_per_node: dict[str, int], readers: int
              ) -> dict[str, str]:
    """Name -> node of the actors a namespace's shuffles use: the master on the head node,
    a tier manager and one writer per CPU on each node with CPUs (and a spare on a node with
    two or more), readers spread evenly."""
    nodes = sorted(cpus_per_node)
    expected = {MASTER_NAME: head}
    for node in nodes:
        expected[TIER_MANAGER_PREFIX + node] = node
        for k in range(writers_per_node(cpus_per_node[node])):
            expected[worker_name(WRITER_PREFIX, node, k)] = node
    for i in range(readers):
        node = nodes[i % len(nodes)]
        expected[worker_name(READER_PREFIX, node, i // len(nodes))] = node
    return expected


def _kill(namespace: str) -> None:
    """Stop a namespace's actors: they are detached, and the session's Ray is shared by
    every test module of the run (2 CPUs)."""
    import ray

    for name in _actor_processes(namespace):
        ray.kill(ray.get_actor(name, namespace=namespace))


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A fresh namespace, started with ``hybrid_ray.init``: (ray, config, what init returned,
    the actors' processes right after it)."""
    ray = start_local_ray()
    namespace = f"startup-{uuid.uuid4().hex[:8]}"
    cfg = base_config(tmp_path_factory.mktemp("startup"), namespace=namespace)
    assert _actor_processes(namespace) == {}
    actors = hybrid_ray.init(cfg)
    yield ray, cfg, actors, _actor_processes(namespace)
    # The cluster test shuts the module's Ray down (its actors went with it).
    if ray.is_initialized():
        _kill(namespace)


def test_init_starts_exactly_the_actors_a_shuffle_needs_on_their_nodes(started):
    ray, cfg, actors, processes = started
    node = ray.get_runtime_context().get_node_id()
    expected = _expected(node, {node: 2}, readers=2)  # the tests' Ray has 2 CPUs
    assert {name: where for name, (_, where, _) in processes.items()} == expected
    # init waited for every one of them: all alive, each in a process of its own.
    assert {state for _, _, state in processes.values()} == {"ALIVE"}
    assert len({pid for pid, _, _ in processes.values()}) == len(expected)
    # What init returned says the same (names, nodes), in the roles a shuffle uses.
    assert {s.name: s.node_id for s in actors.all()} == expected
    assert actors.master.name == MASTER_NAME
    assert [s.name for s in actors.tier_managers] == [TIER_MANAGER_PREFIX + node]
    # Two CPUs: a writer per CPU and a spare (actors.SPARE_WRITERS_PER_NODE).
    # (Named for this job: the tests' Ray has a runtime environment, see _job_worker_tag.)
    assert [s.name for s in actors.writers] == [worker_name(WRITER_PREFIX, node, k)
                                                for k in (0, 1, 2)]
    assert [s.name for s in actors.readers] == [worker_name(READER_PREFIX, node, k)
                                                for k in (0, 1)]
    # The writers and readers ran the warm-up: their answers are their own processes.
    pids = ray.get([s.handle.run.remote(os.getpid) for s in actors.writers + actors.readers])
    assert pids == [processes[s.name][0] for s in actors.writers + actors.readers]


def test_init_again_starts_nothing(started):
    ray, cfg, actors, processes = started
    again = hybrid_ray.init(cfg)
    assert [s.name for s in again.all()] == [s.name for s in actors.all()]
    assert _actor_processes(cfg.namespace) == processes


def test_shuffle_after_init_starts_no_process(started):
    """Every actor the shuffle uses was started by init: the same actors in the same
    processes afterwards, and no other actor anywhere in the cluster."""
    ray, cfg, _actors, processes = started
    table = pa.table({"key": list(range(5000)), "v": [i * 7 for i in range(5000)]})
    ds = ray.data.from_arrow([table.slice(0, 2500), table.slice(2500)]).materialize()
    all_actors_before = set(ray._private.state.actors())
    out = hybrid_ray.repartition(ds, 4, keys=["key"], config=cfg)
    parts = ray.get(out.to_arrow_refs())
    assert row_fingerprint(parts) == row_fingerprint([table])
    assert hybrid_ray.last_report().rows == 5000
    assert _actor_processes(cfg.namespace) == processes
    assert set(ray._private.state.actors()) == all_actors_before


def test_init_warms_each_node_s_object_store_in_the_background(started):
    """Each tier manager allocated the default share of its node's object store (half of
    it, at most 4 GiB) after init, without init waiting for it; a second init starts no
    second warm-up."""
    ray, cfg, actors, _ = started
    from hybrid_ray.object_store import default_warm_up_bytes

    store = {n["NodeID"]: int(n["Resources"]["object_store_memory"]) for n in ray.nodes()
             if n["Alive"]}
    for tm in actors.tier_managers:
        deadline = time.monotonic() + 60
        state = ray.get(tm.handle.object_store_warm_up.remote())
        while not state["done"] and time.monotonic() < deadline:
            time.sleep(0.2)
            state = ray.get(tm.handle.object_store_warm_up.remote())
        expected = default_warm_up_bytes(store[tm.node_id])
        assert expected > 0
        assert state["error"] == ""
        assert state["done"] and state["requested_bytes"] == state["warmed_bytes"] == expected
        assert ray.get(tm.handle.warm_object_store.remote(None)) == 0  # once per process


def test_a_first_shuffle_without_init_starts_the_same_actors(ray_local, tmp_path):
    """run_shuffle starts what is missing itself (all at once): the same set as init."""
    cfg = base_config(tmp_path, namespace=f"startup-{uuid.uuid4().hex[:8]}")
    table = pa.table({"key": list(range(1000)), "v": list(range(1000))})
    try:
        out = hybrid_ray.repartition(ray_local.data.from_arrow(table), 3, keys=["key"],
                                     config=cfg)
        assert row_fingerprint(ray_local.get(out.to_arrow_refs())) == row_fingerprint([table])
        node = ray_local.get_runtime_context().get_node_id()
        processes = _actor_processes(cfg.namespace)
        assert {name: where for name, (_, where, _) in processes.items()} == \
            _expected(node, {node: 2}, readers=2)
    finally:
        _kill(cfg.namespace)


@pytest.mark.parametrize("kwargs, words", [
    ({"config": "default"}, "takes a hybrid_ray.ShuffleConfig"),
    ({"config": {"namespace": "x"}}, "takes a hybrid_ray.ShuffleConfig"),
    ({"wait": "yes"}, "wait=...) must be True or False"),
    ({"wait": None}, "wait=...) must be True or False"),
    ({"timeout_s": 0}, "timeout_s=...) must be a positive number"),
    ({"timeout_s": -5.0}, "timeout_s=...) must be a positive number"),
    ({"timeout_s": float("nan")}, "timeout_s=...) must be a positive number"),
    ({"timeout_s": float("inf")}, "timeout_s=...) must be a positive number"),
    ({"timeout_s": True}, "timeout_s=...) must be a positive number"),
    # Accepted before, and failed inside ray.wait (OverflowError) after every actor had
    # been started (found by a review).
    ({"timeout_s": 1e300}, "timeout_s=...) must be at most 1e.09 s, got 1e.300"),
    ({"timeout_s": 10 ** 400}, "timeout_s=...) must be at most 1e.09 s, got 1000"),
    ({"timeout_s": "30"}, "timeout_s=...) must be a positive number"),
    ({"warm_object_store_bytes": -1}, "warm_object_store_bytes=...) must be a number of bytes"),
    ({"warm_object_store_bytes": 1.5}, "warm_object_store_bytes=...) must be a number of bytes"),
    ({"warm_object_store_bytes": True}, "warm_object_store_bytes=...) must be a number of bytes"),
    ({"warm_object_store_bytes": "1GiB"},
     "warm_object_store_bytes=...) must be a number of bytes"),
])
def test_init_refuses_bad_arguments_and_starts_nothing(ray_local, kwargs, words):
    namespace = f"startup-bad-{uuid.uuid4().hex[:8]}"
    kwargs = {"config": ShuffleConfig(namespace=namespace, progress=False), **kwargs}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        hybrid_ray.init(**kwargs)
    assert _actor_processes(namespace) == {}


@pytest.mark.parametrize("changes, error, words", [
    ({"max_concurrent_reducers": 10_000}, ConfigError,
     "max_concurrent_reducers=10000 is more than this cluster can run"),
    ({"remote_path": "file://{tmp}/a-file/remote"}, RemoteTierError, "is not writable"),
])
def test_init_refuses_a_config_its_shuffles_would_refuse_and_starts_nothing(
        ray_local, tmp_path, changes, error, words):
    """init took these (after seconds of starting every actor) and the first shuffle
    refused them: a user who called init to be ready learned only then (found by a
    review)."""
    (tmp_path / "a-file").write_text("not a directory")
    namespace = f"startup-refused-{uuid.uuid4().hex[:8]}"
    changes = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v
               for k, v in changes.items()}
    config = ShuffleConfig(namespace=namespace, progress=False, **changes)
    with pytest.raises(error, match=words):
        hybrid_ray.init(config)
    assert _actor_processes(namespace) == {}


def test_init_refuses_spill_dirs_a_node_cannot_create_naming_the_dir_node_and_fix(
        ray_local, tmp_path):
    """init took spill dirs that cannot be created (under /proc, below a regular file) and
    the first shuffle failed on them. Each node's tier manager checks them (they are the
    node's own, the driver cannot); dirs that can be created are, 0700, as on first use."""
    from hybrid_ray.errors import SpillDirError

    (tmp_path / "a-file").write_text("not a directory")
    node = ray_local.get_runtime_context().get_node_id()
    namespace = f"startup-spill-{uuid.uuid4().hex[:8]}"
    try:
        for spill_dir in (tmp_path / "a-file" / "spill", "/proc/hybrid_ray_spill"):
            config = ShuffleConfig(namespace=namespace, progress=False,
                                   spill_dirs=[str(spill_dir)])
            with pytest.raises(SpillDirError) as info:
                hybrid_ray.init(config, warm_object_store_bytes=0)
            message = str(info.value)
            assert f"cannot be used on 1 of 1 node(s): node {node}: spill dir {spill_dir} " \
                "cannot be used" in message
            assert "give directories every node can create and write" in message
        fresh = tmp_path / "not-yet" / "spill"
        hybrid_ray.init(config.replace(spill_dirs=[str(fresh)]), warm_object_store_bytes=0)
        assert os.stat(fresh).st_mode & 0o777 == 0o700
    finally:
        _kill(namespace)


def test_init_takes_a_numpy_integer_for_the_object_store_warm_up(ray_local):
    """A byte count computed with NumPy was refused as not "a number of bytes" (every byte
    count of the config takes one); the tier managers get it as a Python int."""
    import numpy as np

    namespace = f"startup-np-{uuid.uuid4().hex[:8]}"
    try:
        actors = hybrid_ray.init(ShuffleConfig(namespace=namespace, progress=False),
                                 warm_object_store_bytes=np.int64(4096))
        assert actors.tier_managers
    finally:
        _kill(namespace)


def test_init_that_cannot_wait_long_enough_names_the_actors(ray_local):
    """A process takes far more than a millisecond to start: every actor is reported, by
    name and node, with the fix; they go on starting in the background."""
    namespace = f"startup-slow-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(ActorStartError) as info:
            hybrid_ray.init(ShuffleConfig(namespace=namespace, progress=False),
                            timeout_s=0.001)
        message = str(info.value)
        node = ray_local.get_runtime_context().get_node_id()
        for name in _expected(node, {node: 2}, readers=2):
            assert f"{name} on node {node}: no answer in 0.001 s" in message
        assert "timeout_s" in message
    finally:
        _kill(namespace)
    # wait=False returns at once (nothing to wait for), with the same actors.
    namespace = f"startup-nowait-{uuid.uuid4().hex[:8]}"
    try:
        actors = hybrid_ray.init(ShuffleConfig(namespace=namespace, progress=False),
                                 wait=False)
        assert set(_actor_processes(namespace)) == {s.name for s in actors.all()}
    finally:
        _kill(namespace)


@pytest.mark.slow
def test_init_on_a_cluster_puts_each_actor_on_its_node():
    """A head node without CPUs and two 1-CPU nodes: the master on the head, a tier manager,
    a writer and a reader on each node with CPUs, nothing else."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the single-node session of the other tests
    cluster = Cluster()
    try:
        head = cluster.add_node(num_cpus=0)
        workers = [cluster.add_node(num_cpus=1, object_store_memory=200 * 1024**2)
                   for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        namespace = f"startup-{uuid.uuid4().hex[:8]}"
        actors = hybrid_ray.init(ShuffleConfig(namespace=namespace, progress=False))
        expected = _expected(head.node_id, {w.node_id: 1 for w in workers}, readers=2)
        processes = _actor_processes(namespace)
        assert {name: where for name, (_, where, _) in processes.items()} == expected
        assert {s.name: s.node_id for s in actors.all()} == expected
        assert {state for _, _, state in processes.values()} == {"ALIVE"}
    finally:
        ray.shutdown()
        cluster.shutdown()



def test_init_waits_for_the_object_store_warm_ups_within_its_bound_in_all(ray_local):
    """Each tier manager's warm-up call was waited for with init's whole ``timeout_s``,
    one after the other: N silent tier managers held init N times its bound (found by a
    review). They now share what is left of it."""
    import types

    from hybrid_ray.session import _check_warm_up_calls

    @ray_local.remote(num_cpus=0)
    class Silent:
        def warm_object_store(self):
            time.sleep(30)

    silent = [Silent.remote() for _ in range(3)]
    actors = types.SimpleNamespace(tier_managers=[
        types.SimpleNamespace(node_id=f"node-{i}") for i in range(3)])
    started = time.monotonic()
    _check_warm_up_calls(actors, [a.warm_object_store.remote() for a in silent], 1.0)
    assert time.monotonic() - started < 2.5
    for actor in silent:
        ray_local.kill(actor)


def test_a_node_with_two_or_more_cpus_gets_a_spare_writer_and_a_one_cpu_node_none():
    """One writer per CPU left a core idle whenever every writer of its node waited at
    once (object store, tier manager, master); a spare fills those waits. A one-CPU node
    (usually small) keeps one writer."""
    assert [writers_per_node(cpus) for cpus in (0, 1, 2, 3, 16)] == [1, 1, 3, 4, 17]


def test_a_job_s_own_workers_outlive_the_task_or_actor_that_asked_for_them_first(ray_local):
    """The tests' Ray has a runtime environment, so this job has workers of its own (see
    ``actors._job_worker_tag``). Owned by whichever process asked first (an actor here),
    they died with it under the driver (found by a review); they are detached, and the
    master ends them only once the job itself ended."""
    from hybrid_ray.actors import end_workers_of_ended_jobs, get_writers

    namespace = f"startup-owner-{uuid.uuid4().hex[:8]}"

    @ray_local.remote
    class Asker:
        def ask(self, namespace):
            from hybrid_ray.actors import get_writers
            return [name for name, _ in get_writers(namespace)]

    try:
        asker = Asker.remote()
        assert ray_local.get(asker.ask.remote(namespace), timeout=120)
        ray_local.kill(asker)
        time.sleep(1)
        pids = ray_local.get([w.run.remote(os.getpid) for _, w in get_writers(namespace)],
                             timeout=120)
        assert len(pids) == writers_per_node(2) and all(pids)
        assert end_workers_of_ended_jobs(namespace) == []  # this job still runs
        assert ray_local.get([w.run.remote(os.getpid) for _, w in get_writers(namespace)],
                             timeout=60) == pids
    finally:
        _kill(namespace)
