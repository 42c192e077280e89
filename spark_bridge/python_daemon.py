"""The Python daemon of the Spark executors that ``init_spark`` starts.

Spark runs ``python -m <spark.python.daemon.module>`` on each executor and forks its Python
workers from it; ``init_spark`` points that setting at this module, which prepares the
process and then runs PySpark's own daemon unchanged:

- PySpark's worker calls ``importlib.invalidate_caches()`` at the start of every task. On
  CPython 3.10 and 3.11 that makes every ``zipimporter`` re-read its archive's directory
  at once, and the JVM puts ``pyspark.zip`` (about 800 files) on the workers' path: each
  package imported from it has its own importer, and measured here each re-read costs
  about 50 ms, about a quarter of the bridge's map-stage CPU on 2 cores. The archives
  never change while a worker lives (Spark refuses to replace an added file), so the
  re-read is deferred to the first lookup that misses, which is what CPython 3.12 does.
- The modules every bridge task needs (pyarrow, ray, hybrid_ray) are imported once in the
  daemon, so forked workers start with them loaded instead of importing them per worker.
  Ray is imported, not connected: a connection must not cross a fork.
- ``gc.freeze()`` then moves everything imported so far out of the cyclic collector's
  reach (as pre-fork servers do): the workers' full collections no longer walk the
  hundreds of thousands of objects of those modules (about 7% of the map stage's CPU in a
  perf profile), and forked workers do not copy their pages by touching them.
"""

from __future__ import annotations

import gc
import sys
import zipimport


def _make_zip_invalidation_lazy() -> None:
    """Defer ``zipimporter.invalidate_caches`` to the first miss (CPython < 3.12 only)."""
    if sys.version_info >= (3, 12):
        return  # already lazy
    original_find_spec = zipimport.zipimporter.find_spec
    original_invalidate = zipimport.zipimporter.invalidate_caches

    def invalidate_caches(self: zipimport.zipimporter) -> None:
        self._hybrid_ray_stale = True  # re-read only if a lookup misses

    def find_spec(self: zipimport.zipimporter, fullname: str, target=None):  # type: ignore[no-untyped-def]
        spec = original_find_spec(self, fullname, target)
        if spec is None and getattr(self, "_hybrid_ray_stale", False):
            self._hybrid_ray_stale = False
            original_invalidate(self)
            spec = original_find_spec(self, fullname, target)
        return spec

    zipimport.zipimporter.invalidate_caches = invalidate_caches  # type: ignore[method-assign]
    zipimport.zipimporter.find_spec = find_spec  # type: ignore[method-assign]


def _preload() -> None:
    import pyarrow  # noqa: F401
    import ray  # noqa: F401

    import hybrid_ray  # noqa: F401
    import spark_bridge.exchange  # noqa: F401


def main() -> None:
    _make_zip_invalidation_lazy()
    try:
        _preload()
    except Exception:  # a broken optional import must not take Spark's Python down
        pass
    gc.freeze()
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
