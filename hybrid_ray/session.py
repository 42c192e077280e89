"""Start-up: ``hybrid_ray.init`` starts the actors shuffles need before the first shuffle.

A shuffle runs in long-lived, detached actors (``hybrid_ray.actors``): the namespace's
master, a tier manager per node, a writer per CPU and the readers. Each is a process that
imports Ray, pyarrow and hybrid_ray, so a cluster's first shuffle used to pay for starting
all of them (a 1,000-row shuffle took 13.7 s the first time and 0.33 s after).
``init`` starts them side by side and waits until each has answered, so that cost is paid
where the caller chooses (say, while it loads its data) and the first shuffle runs warm.
``run_shuffle`` starts whatever is missing the same way, so ``init`` is optional.
"""

from __future__ import annotations

import math

import ray

from hybrid_ray.actors import START_TIMEOUT_S, ShuffleActors, reader_count, start_actors
from hybrid_ray.config import Compression, ShuffleConfig
from hybrid_ray.errors import ConfigError

# The most memory init has each writer and reader allocate ahead (one map chunk's worth,
# see ``actors.warm_up_worker``); the allocator keeps it for the first shuffle.
WARM_UP_HEAP_BYTES = 64 * 1024 * 1024


def init(config: ShuffleConfig | None = None, *, wait: bool = True,
         timeout_s: float = START_TIMEOUT_S) -> ShuffleActors:
    """Start every actor the shuffles of ``config.namespace`` use, all at once: the master
    on the head node, a tier manager and one writer per CPU on each alive node with CPUs,
    and ``config.max_concurrent_reducers`` readers (default: one per CPU of the cluster).

    Call it after ``ray.init`` (it calls ``ray.init()`` itself if Ray is not running, as a
    shuffle would) and with the config your shuffles use: its namespace, reader count,
    compression and remote tier decide what is started and warmed up. Actors already
    running are reused, so calling it again starts nothing; after nodes joined the
    cluster, it starts their actors.

    ``wait``: return once every actor answered (its process started and, for writers and
    readers, ran a tiny map and read of the data path; see ``actors.warm_up_worker``);
    with ``wait=False`` the actors start in the background and ``init`` returns at once.
    ``timeout_s``: bound on that wait; ``ActorStartError`` names the actors that did not
    answer in time or failed to start.

    Returns the actors (names, nodes, handles), e.g. for ``ray.kill``-ing them.
    """
    if config is None:
        config = ShuffleConfig()
    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"hybrid_ray.init(config=...) takes a hybrid_ray.ShuffleConfig (or "
                          f"None for the defaults), got {type(config).__name__}")
    if not isinstance(wait, bool):
        raise ConfigError(f"hybrid_ray.init(wait=...) must be True or False, got {wait!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"hybrid_ray.init(timeout_s=...) must be a positive number of "
                          f"seconds, got {timeout_s!r}")
    if not ray.is_initialized():
        ray.init()
    return start_actors(config.namespace, reader_count(config), wait=wait,
                        timeout_s=float(timeout_s),
                        compression=Compression(config.compression).value,
                        remote_protocol=_protocol(config.remote_path),
                        heap_bytes=min(config.map_chunk_bytes, WARM_UP_HEAP_BYTES))


def _protocol(remote_path: str | None) -> str | None:
    """The fsspec protocol of ``remote_path`` (``s3``, ``gs``...; ``file`` for a path)."""
    if not remote_path:
        return None
    return remote_path.split("://", 1)[0] if "://" in remote_path else "file"


__all__ = ["init"]
