"""Ids that become path components, and the confinement of every path hybrid_ray deletes.

A job id, shuffle id, namespace or node id ends up in a directory name (``spill_dir/
hybrid_ray/<shuffle_id>``, ``remote_path/<job_id>/<shuffle_id>``, ``{node_id}`` in a spill
dir) or an actor name. An id such as ``"../.."`` would make hybrid_ray write outside its
directories and delete its owner's data, so every id is checked against ``ID_PATTERN``
where it enters a public API (``check_id``). Paths are then also checked, before anything
is removed, to lie inside hybrid_ray's own data directory (``require_inside``): a second
line of defence against a future caller that forgets the first.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
from typing import Any

from hybrid_ray.errors import InvalidIdError, UnsafePathError

# 1 to 128 characters from [A-Za-z0-9_.-], the first a letter or digit. The first character
# rules out ".", ".." and names starting with "-" (read as options by shell tools) or "."
# (hidden files); "/" and "\\" are not in the set, so an id is always exactly one path
# component, on every filesystem and in every object store key. Ray node ids (56 hex
# digits), uuid-based ids (``shf-<hex>``, ``job-<hex>``) and Ray namespaces all fit.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
ID_RULE = ("1-128 characters from A-Z a-z 0-9 _ . - starting with a letter or digit "
           "(it becomes a directory name)")


def _show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, truncated: a hostile or huge value must not flood a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


@functools.lru_cache(maxsize=4096)
def _valid(value: str) -> bool:
    # Memoised: the write path checks each segment's shuffle id, and a shuffle has one id.
    return ID_PATTERN.fullmatch(value) is not None


def check_id(field: str, value: Any) -> str:
    """Return ``value`` if it is a valid id (``ID_PATTERN``), else raise ``InvalidIdError``
    naming the field, the bad value and the allowed characters. Cheap when repeated."""
    if type(value) is not str:
        raise InvalidIdError(
            f"{field} must be a string of {ID_RULE}; got {type(value).__name__} {_show(value)}")
    if not _valid(value):
        raise InvalidIdError(
            f"{field} {_show(value)} is not a valid id: use {ID_RULE}, e.g. 'job-42' or "
            "'shf-1a2b3c'")
    return value


def is_inside(root: str, path: str) -> bool:
    """Whether local ``path`` lies strictly below directory ``root``, both resolved
    (``..`` and symlinks followed): a path equal to ``root`` is not inside it."""
    return is_below_resolved(os.path.realpath(root), os.path.realpath(path))


def is_below_resolved(root_real: str, real: str) -> bool:
    """``is_inside`` for paths already resolved (``os.path.realpath``)."""
    return real != root_real and os.path.commonpath([root_real, real]) == root_real


def realpath_cached(path: str, resolved_dirs: dict[str, str]) -> str:
    """``os.path.realpath(path)``, resolving ``path``'s directory once per
    ``resolved_dirs`` (a cache the caller keeps for one batch of paths): a batch of
    segment files shares a few directories, and ``realpath`` checks every component of
    every path (about 40% of a tier manager's time deleting a shuffle's files). The file
    itself is still looked at: one that is a symlink is followed, as ``realpath`` would."""
    directory, name = os.path.split(path)
    joined = os.path.join(resolved_dir(directory, resolved_dirs), name)
    return os.path.realpath(joined) if os.path.islink(joined) else joined


def resolved_dir(directory: str, resolved_dirs: dict[str, str]) -> str:
    """``os.path.realpath(directory)``, once per ``resolved_dirs`` (see ``realpath_cached``)."""
    real = resolved_dirs.get(directory)
    if real is None:
        real = resolved_dirs[directory] = os.path.realpath(directory)
    return real


def require_inside(root: str, path: str, action: str) -> str:
    """Raise ``UnsafePathError`` unless local ``path`` lies strictly below ``root``."""
    if not is_inside(root, path):
        raise UnsafePathError(
            f"refusing to {action} {path}: it is not inside hybrid_ray's data directory "
            f"{root} (hybrid_ray only ever writes and deletes below it). This is a bug in "
            "the caller; please report it")
    return path


# fsspec reads these as wildcards in a path given to rm, find or expand_path: a remote path
# holding one can match, and delete, other data. hybrid_ray's remote paths are literal.
REMOTE_GLOB_CHARACTERS = "*?[]"


def glob_characters_in(path: str) -> str:
    """The characters of ``path`` fsspec would expand as a glob ('' if none)."""
    return "".join(sorted({c for c in path if c in REMOTE_GLOB_CHARACTERS}))


def require_inside_remote(root: str, path: str, action: str, shown_root: str = "") -> str:
    """``require_inside`` for object-store keys and remote paths: purely lexical ('/'
    separated, ``..`` collapsed), as object stores have no symlinks, and free of glob
    characters (``REMOTE_GLOB_CHARACTERS``). ``shown_root`` is the (redacted) name of
    ``root`` used in the message."""
    if glob_characters_in(path):
        raise UnsafePathError(
            f"refusing to {action} a remote path below {shown_root or root}: it holds "
            f"{glob_characters_in(path)!r}, which fsspec expands as a glob, so the call "
            "could reach other data. Use a remote_path without * ? [ ]")
    root_n = posixpath.normpath(root)
    path_n = posixpath.normpath(path)
    if not path_n.startswith(root_n.rstrip("/") + "/"):
        raise UnsafePathError(
            f"refusing to {action} a remote path outside hybrid_ray's job directory "
            f"{shown_root or root} (hybrid_ray only ever writes and deletes below it). This "
            "is a bug in the caller; please report it")
    return path


def has_abnormal_component(path: str) -> bool:
    """Whether '/'-separated ``path`` (one leading '/' allowed) has an empty, ``.`` or
    ``..`` component."""
    components = path[1:].split("/") if path.startswith("/") else path.split("/")
    return any(c in ("", ".", "..") for c in components)


def require_normal_remote_path(path: str, action: str, shown_root: str) -> str:
    """Raise ``UnsafePathError`` if remote ``path`` has an empty, ``.`` or ``..``
    component. ``require_inside_remote`` is lexical, but the call that follows acts on
    ``path`` as given: s3fs takes the first component of 'other/../bucket/key' for the
    bucket, and a local filesystem resolves 'link/..' through the link."""
    if has_abnormal_component(path):
        raise UnsafePathError(
            f"refusing to {action} a remote path below {shown_root}: it has an empty, '.' "
            "or '..' component, so the storage could resolve it elsewhere than it reads. "
            "This is a bug in the caller; please report it")
    return path
