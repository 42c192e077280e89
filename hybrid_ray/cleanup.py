"""Removal of orphaned shuffle data: spill-dir entries and remote job directories that no
live shuffle owns any more (their driver and master died before releasing them)."""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec

from hybrid_ray.tiers.disk import DATA_DIR_NAME


def sweep_spill_dirs(spill_dirs: Sequence[str], older_than_s: float,
                     keep: Sequence[str] = ()) -> list[str]:
    """Remove shuffle directories under ``spill_dir/hybrid_ray`` untouched for
    ``older_than_s`` seconds, except shuffle ids in ``keep``. Returns the removed paths."""
    removed = []
    cutoff = time.time() - older_than_s
    for spill_dir in spill_dirs:
        root = os.path.join(spill_dir, DATA_DIR_NAME)
        if not os.path.isdir(root):
            continue
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name in keep or _newest_mtime(path) > cutoff:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _newest_mtime(path: str) -> float:
    newest = os.path.getmtime(path)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                newest = max(newest, os.path.getmtime(os.path.join(root, n)))
            except FileNotFoundError:
                pass
    return newest


def sweep_remote(remote_path: str, older_than_s: float,
                 storage_options: Mapping[str, Any] | None = None,
                 keep: Sequence[str] = ()) -> list[str]:
    """Remove shuffle directories ``HomePath/JobID/ShuffleID`` whose newest object is older
    than ``older_than_s``, except shuffle ids in ``keep``. Returns the removed paths."""
    fs, root = fsspec.core.url_to_fs(remote_path, **dict(storage_options or {}))
    cutoff = time.time() - older_than_s
    removed = []
    if not fs.exists(root):
        return removed
    newest: dict[str, float] = {}
    for path, info in fs.find(root, detail=True).items():
        rel = posixpath.relpath(path, root).split("/")
        if len(rel) < 3:
            continue
        shuffle_path = posixpath.join(root, rel[0], rel[1])
        newest[shuffle_path] = max(newest.get(shuffle_path, 0.0), _info_mtime(info))
    for shuffle_path, mtime in newest.items():
        if posixpath.basename(shuffle_path) in keep or mtime > cutoff:
            continue
        fs.rm(shuffle_path, recursive=True)
        removed.append(shuffle_path)
    fs.invalidate_cache()
    return removed


def _info_mtime(info: Mapping[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        return float(value)
    return time.time()  # unknown age: treat as fresh, never delete by mistake
