"""Which nodes of the Ray cluster are alive, and whether a failed call died with its node.

The driver (``shuffle.run_shuffle``, ``lifecycle.MapRunner``) and the readers
(``reduce_task``) both need to tell a worker that failed from a worker whose node is gone:
only the second is recovered (its maps run again elsewhere, its subpartition is reduced
again), the first fails the shuffle with its error.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray


def cluster_cpus() -> int:
    """The CPUs of the whole cluster (at least 1): the default number of reducers and the
    unit in which map sizes and reader windows are planned."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def alive_node_count() -> int:
    """How many nodes Ray counts as alive now (one call to the GCS)."""
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def node_alive(node_id: str | None) -> bool:
    """Whether Ray still counts ``node_id`` among its alive nodes (None: unknown, alive)."""
    if not node_id:
        return True
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())


# What a call to a worker on a node that died raises: the actor died with it, or (hard
# affinity to the gone node) it cannot be started again.
WORKER_LOST_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)
# Times the driver submits a map or reducer again after its worker process died with the
# node alive and Ray's own retries (actors.WORKER_MAX_RETRIES) were used up. A call queued
# behind another on a worker fails, and spends a retry, each time the running call kills
# the process: this gives such a call retries of its own.
RESUBMITS_AFTER_WORKER_LOSS = 1


# Ray's node table marks a removed node dead a moment after its actors' calls fail.
NODE_DEATH_WAIT_S = 15.0


def worker_process_lost(exc: BaseException) -> bool:
    """Whether a failed worker call (one of ``WORKER_LOST_ERRORS``) lost its worker
    process, as opposed to the task running and raising an actor error of its own: a
    map's call to its node's tier manager that died mid-call comes back as
    ``RayTaskError(ActorDiedError)``, which is also an ``ActorDiedError``. Only a lost
    process can mean a lost node: for the other the node is alive (its worker answered),
    and waiting up to ``NODE_DEATH_WAIT_S`` for Ray's node table to say so cost a shuffle
    15 s per such map (a harness killing a tier manager mid-shuffle: 16-46 s for a
    shuffle of 2 s)."""
    return not isinstance(exc, ray.exceptions.RayTaskError)


def lost_with_node(node_id: str | None, exc: BaseException,
                   keep_alive: Callable[[], None] | None = None) -> bool:
    """Whether a worker call failed because ``node_id`` died (waits, bounded, for Ray's
    node table to agree; an unschedulable hard-pinned actor means the node is gone).

    ``keep_alive`` is called on every turn of the wait: a driver's shuffle heartbeat. The
    wait (up to NODE_DEATH_WAIT_S) is as long as the shortest orphan TTL, so a driver
    that waited without beating could see its shuffle expired, and its data deleted, in
    the middle of a failure it recovers from."""
    if not node_id:
        return False
    if isinstance(exc, ray.exceptions.ActorUnschedulableError):
        return True
    deadline = time.monotonic() + NODE_DEATH_WAIT_S
    while time.monotonic() < deadline:
        if not node_alive(node_id):
            return True
        if keep_alive is not None:
            keep_alive()
        time.sleep(0.5)
    return False

