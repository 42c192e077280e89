"""The executors' Python daemon: zip re-reads deferred to a miss, never lost."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12+ is lazy already")
def test_zip_invalidation_is_deferred_until_a_lookup_misses(tmp_path):
    script = textwrap.dedent(f"""
        import importlib, sys, zipfile, zipimport
        from spark_bridge.python_daemon import _make_zip_invalidation_lazy

        archive = {str(tmp_path / "libs.zip")!r}
        with zipfile.ZipFile(archive, "w") as z:
            z.writestr("first_mod.py", "VALUE = 1")
        sys.path.insert(0, archive)
        import first_mod
        _make_zip_invalidation_lazy()

        reads = []
        original = zipimport._read_directory
        zipimport._read_directory = lambda path: reads.append(path) or original(path)
        for _ in range(5):  # what PySpark does at every task start
            importlib.invalidate_caches()
        assert reads == [], reads  # no eager re-read

        with zipfile.ZipFile(archive, "a") as z:  # the archive changes after all
            z.writestr("second_mod.py", "VALUE = 2")
        importlib.invalidate_caches()
        import second_mod  # the miss re-reads the directory once and finds it
        assert second_mod.VALUE == 2 and len(reads) == 1, reads
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
