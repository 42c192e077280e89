"""Bounded caches of opened tiers.

A long-lived process (a writer or reader actor, a tier manager, the master) serves shuffle
after shuffle, each with its own config: opening a tier per shuffle costs a filesystem
client (and a thread pool for remote transfers), and keeping every one ever opened grew
without bound (a job id per run makes every config new).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LruCache(Generic[V]):
    """At most ``maxsize`` values by key, least recently used evicted first; ``on_evict``
    is told each evicted value (to release what it holds). Thread-safe."""

    def __init__(self, maxsize: int, on_evict: Callable[[V], None] | None = None) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self._on_evict = on_evict
        self._items: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_or_create(self, key: Hashable, create: Callable[[], V]) -> V:
        """The value of ``key``, created with ``create()`` if missing (outside the lock:
        opening a tier may do I/O)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = create()
        evicted = []
        with self._lock:
            if key in self._items:  # another thread created it meanwhile: keep theirs
                evicted.append(value)
                value = self._items[key]
                self._items.move_to_end(key)
            else:
                self._items[key] = value
                while len(self._items) > self.maxsize:
                    evicted.append(self._items.popitem(last=False)[1])
        for old in evicted:
            if self._on_evict is not None:
                self._on_evict(old)
        return value

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if present (its value is not passed to ``on_evict``: the caller
        drops it because it is no longer usable)."""
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items
