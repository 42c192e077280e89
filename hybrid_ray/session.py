"""Start-up: ``hybrid_ray.init`` starts the actors shuffles need before the first shuffle.

A shuffle runs in long-lived, detached actors (``hybrid_ray.actors``): the namespace's
master, a tier manager per node, the writers (one per CPU of each node, and a spare on
nodes with two or more) and the readers. Each is a process that imports Ray, pyarrow and
hybrid_ray, so a cluster's first shuffle used to pay for starting all of them (a 1,000-row
shuffle took 13.7 s the first time and 0.33 s after).
``init`` starts them side by side and waits until each has answered, so that cost is paid
where the caller chooses (say, while it loads its data) and the first shuffle runs warm.
``run_shuffle`` starts whatever is missing the same way, so ``init`` is optional.
"""

from __future__ import annotations

import logging
import time

import ray

from hybrid_ray.actors import START_TIMEOUT_S, ShuffleActors, reader_count, start_actors
from hybrid_ray.config import Compression, ShuffleConfig, as_int, require_seconds
from hybrid_ray.errors import ConfigError, SpillDirError
from hybrid_ray.lifecycle import describe_cause

# The most memory init has each writer and reader allocate ahead (one map chunk's worth,
# see ``actors.warm_up_worker``); the allocator keeps it for the first shuffle.
WARM_UP_HEAP_BYTES = 64 * 1024 * 1024

LOG = logging.getLogger(__name__)


def init(config: ShuffleConfig | None = None, *, wait: bool = True,
         timeout_s: float = START_TIMEOUT_S,
         warm_object_store_bytes: int | None = None) -> ShuffleActors:
    """Start every actor the shuffles of ``config.namespace`` use, all at once: the master
    on the head node, a tier manager and the writers (one per CPU, and a spare
    with two or more: ``actors.writers_per_node``) on each alive node with CPUs, and
    ``config.max_concurrent_reducers`` readers (default: one per CPU of the cluster).

    Call it after ``ray.init`` (it calls ``ray.init()`` itself if Ray is not running, as a
    shuffle would) and with the config your shuffles use: its namespace, reader count,
    compression and remote tier decide what is started and warmed up. Actors already
    running are reused, so calling it again starts nothing; after nodes joined the
    cluster, it starts their actors. A config its shuffles would refuse (more
    ``max_concurrent_reducers`` than the cluster can run, an unreachable ``remote_path``)
    is refused here as they would refuse it, before any actor starts. With ``wait``, so
    are spill dirs that cannot be created or written on a node: each node's tier manager
    creates (0700, where missing) and checks them, and ``SpillDirError`` names the dir,
    the node and the fix (with ``wait=False``, the first shuffle does).

    ``wait``: return once every actor answered (its process started and, for writers and
    readers, ran a tiny map and read of the data path; see ``actors.warm_up_worker``);
    with ``wait=False`` the actors start in the background and ``init`` returns at once.
    ``timeout_s``: bound on that wait; ``ActorStartError`` names the actors that did not
    answer in time or failed to start.

    ``warm_object_store_bytes``: how much of each node's Ray object store its tier
    manager allocates ahead, in the background, once (``hybrid_ray.object_store``): a
    store's pages are allocated when first written, and paying for that during the first
    shuffle made it up to twice as slow as the next (on a 2-core VM, three A/B pairs: a
    first 1 GiB repartition 3.3-3.8 s without, 2.6-3.0 s with 3.5 GiB warmed while the
    driver loaded its data; warm rounds 1.5-1.9 s). ``None`` (default): half the node's
    object store, at most 4 GiB; ``0``: none. The memory warmed is the store's own (Ray
    reserved it) and stays with it; it costs one core about 0.8 s per GiB on that VM,
    overlapping what the driver does next. ``object_store_warm_up()`` of a tier manager
    says how far it got.

    Returns the actors (names, nodes, handles), e.g. for ``ray.kill``-ing them.
    """
    if config is None:
        config = ShuffleConfig()
    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"hybrid_ray.init(config=...) takes a hybrid_ray.ShuffleConfig (or "
                          f"None for the defaults), got {type(config).__name__}")
    if not isinstance(wait, bool):
        raise ConfigError(f"hybrid_ray.init(wait=...) must be True or False, got {wait!r}")
    # Checked before any actor starts: Ray's millisecond timeouts overflow beyond
    # MAX_DURATION_S.
    require_seconds("hybrid_ray.init(timeout_s=...)", timeout_s)
    if warm_object_store_bytes is not None:
        # NumPy integers too (a size computed with NumPy), as every byte count of the
        # config: np.int64(2**30) was refused as not "a number of bytes".
        number = as_int(warm_object_store_bytes)
        if number is None or number < 0:
            raise ConfigError(f"hybrid_ray.init(warm_object_store_bytes=...) must be a number "
                              f"of bytes >= 0 (0: warm nothing) or None for the default, got "
                              f"{warm_object_store_bytes!r}")
        warm_object_store_bytes = number
    if not ray.is_initialized():
        ray.init()
    # Refused as the first shuffle would refuse them, before any actor starts: a reader
    # count beyond the cluster or an unreachable remote tier was taken here (after seconds
    # of starting every actor), and only the first shuffle said what was wrong.
    from hybrid_ray.shuffle import _reducer_window, check_remote_tier

    _reducer_window(config)
    check_remote_tier(config)
    actors = start_actors(config.namespace, reader_count(config), wait=wait,
                          timeout_s=float(timeout_s),
                          compression=Compression(config.compression).value,
                          remote_protocol=_protocol(config.remote_path),
                          heap_bytes=min(config.map_chunk_bytes, WARM_UP_HEAP_BYTES))
    if wait:  # the tier managers answered: each checks its node's spill dirs
        _check_spill_dirs(actors, config, float(timeout_s))
    if warm_object_store_bytes != 0:
        calls = [tm.handle.warm_object_store.remote(warm_object_store_bytes)
                 for tm in actors.tier_managers]
        if wait:  # each call only starts a background thread: it answers at once
            _check_warm_up_calls(actors, calls, min(timeout_s, WARM_UP_ANSWER_S))
    return actors


def _check_spill_dirs(actors: ShuffleActors, config: ShuffleConfig, timeout_s: float) -> None:
    """Have every node's tier manager create and check ``config``'s spill dirs there
    (``TierManager.check_spill_dirs``), all at once, within ``timeout_s`` in all; raise
    ``SpillDirError`` naming each node whose dirs cannot be used and the fix. Spill dirs
    are each node's own, so only its tier manager can tell: one that could not be created
    or written was taken by init, and the first shuffle failed on it instead."""
    calls = [(slot, slot.handle.check_spill_dirs.remote(config))
             for slot in actors.tier_managers]
    deadline = time.monotonic() + timeout_s
    problems = []
    for slot, ref in calls:
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            problems.append(f"node {slot.node_id}: no answer in {timeout_s:g} s (a hung "
                            "filesystem under a spill dir?)")
        except Exception as exc:  # noqa: BLE001 - collected and raised together below
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            problems.append(str(cause) if isinstance(cause, SpillDirError)
                            else f"node {slot.node_id}: {describe_cause(exc)}")
    if problems:
        raise SpillDirError(
            f"hybrid_ray.init: spill_dirs {list(config.spill_dirs)} cannot be used on "
            f"{len(problems)} of {len(calls)} node(s): " + "; ".join(problems) + ". Each "
            "node creates its spill dirs itself (0700, where missing): give directories "
            "every node can create and write, e.g. ShuffleConfig(spill_dirs=['/mnt/nvme0/"
            "spill']). The actors started stay up for init with the corrected config")


# How long init waits for the warm-up calls, all together: each only starts a background
# thread and answers at once.
WARM_UP_ANSWER_S = 10.0


def _check_warm_up_calls(actors: ShuffleActors, calls: list, timeout_s: float) -> None:
    """Log (not raise: a warm-up is only a head start) the warm-up calls that failed or
    did not answer within ``timeout_s`` in all (each was waited for with ``init``'s whole
    bound, one after the other, so N silent tier managers held ``init`` N times as
    long)."""
    deadline = time.monotonic() + timeout_s
    for slot, ref in zip(actors.tier_managers, calls):
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported, init still succeeds
            LOG.warning("hybrid_ray: the object-store warm-up of node %s did not start "
                        "(%s: %s); its first shuffle allocates the store's pages itself",
                        slot.node_id, type(exc).__name__, str(exc).strip()[:300])


def _protocol(remote_path: str | None) -> str | None:
    """The fsspec protocol of ``remote_path`` (``s3``, ``gs``...; ``file`` for a path)."""
    if not remote_path:
        return None
    return remote_path.split("://", 1)[0] if "://" in remote_path else "file"


__all__ = ["init"]
