"""Disk tier: segment files in the node's local spill directories.

Before granting a segment it checks the real filesystem (``statvfs``): free space after the
segment, minus what other writers were granted but have not written yet, must stay above
``min_reserve_fraction`` of the filesystem (FLIP-301's reserve), and the optional byte cap
must hold. Files are written under a temporary name and renamed when complete, so a reader
never sees half a segment. Directories are 0700 and files 0600: shuffle data is private.

Safety: a spill dir is checked before use (``check_spill_dir``): it must be a directory owned
by this user or root, not writable by others (world, or a group with other members) without
the sticky bit, and hybrid_ray's data dir in it (``spill_dir/hybrid_ray``) must be a real
directory (not a symlink) owned by this user, mode 0700. Otherwise another local user could
read the shuffle's rows or redirect its writes and deletes. Shuffle ids are checked
(``hybrid_ray.ids``) before they become directory names, and nothing outside the data dirs
is ever written or removed.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import stat
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from hybrid_ray.config import (
    TierName, refuse_single_spill_dir, require_bytes, require_number,
)
from hybrid_ray.errors import (
    ConfigError, OutOfSpaceError, SegmentNotFoundError, SpillDirError, UnsafePathError,
)
from hybrid_ray.ids import check_id, require_inside
from hybrid_ray.segment import SegmentId, SegmentMeta, segment_num_rows
from hybrid_ray.tiers.base import (
    SHUFFLE_MARKER_NAME, Grant, Tier, parse_shuffle_marker, shuffle_marker,
)

# All of hybrid_ray's files live under this subdirectory of a spill dir, so cleanup never
# touches anything else a user keeps there.
DATA_DIR_NAME = "hybrid_ray"
# A shuffle marker is a small JSON document; anything larger by that name is not ours.
MAX_MARKER_BYTES = 4096
# The shape of every segment file's path: .../hybrid_ray/<shuffle id>/sub-<n>/<file>.
# Deleting or serving a file by a location received from another process requires it.
_SEGMENT_FILE = re.compile(
    r"(?:/.*)?/" + DATA_DIR_NAME + r"/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}/sub-\d+/"
    r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def shuffle_dir(spill_dir: str, shuffle_id: str) -> str:
    """The directory of one shuffle's files in a spill dir (the id is checked first)."""
    return os.path.join(spill_dir, DATA_DIR_NAME, check_id("shuffle_id", shuffle_id))


def require_segment_file(location: str, action: str) -> str:
    """Raise ``UnsafePathError`` unless ``location`` has the shape of a disk-tier segment
    file (``.../hybrid_ray/<shuffle>/sub-<n>/<file>``, normalised, absolute): a location
    comes from another process (the master's metadata) and is unlinked or served here.
    A NUL or a lone surrogate anywhere in it (not printable) is refused here too: the
    checks after it (``os.path.realpath``) raised ``ValueError`` for them, not this error,
    and one such location failed a whole batch of deletions on every retry."""
    if not location.isprintable() or _SEGMENT_FILE.fullmatch(location) is None \
            or os.path.normpath(location) != location:
        raise UnsafePathError(
            f"refusing to {action} {location!r}: not a hybrid_ray segment file "
            f"(.../{DATA_DIR_NAME}/<shuffle id>/sub-<n>/<file>). This is a bug in the "
            "caller; please report it")
    return location


def shuffle_dir_of(location: str) -> str:
    """The shuffle directory a segment file lies in (``<shuffle dir>/sub-<n>/<file>``,
    as ``require_segment_file`` checks): its name is the shuffle id the path names."""
    return os.path.dirname(os.path.dirname(location))


def check_spill_dir(spill_dir: str) -> str:
    """Create ``spill_dir`` (0700) if missing, check that it is safe, and create or check
    hybrid_ray's data dir in it; returns the data dir. Raises ``SpillDirError`` naming the
    path, the problem and the fix.

    Rules (users point spill_dirs at e.g. a root-owned 0755 /mnt/nvme0, so the spill dir
    itself may be anyone's that is trusted; the data dir must be private):

    * the spill dir is a directory (a symlink to one is fine if the link is owned by this
      user or root), owned by this user or root: another owner could swap the data dir
      for a symlink to somewhere else at any time;
    * it is not world-writable unless sticky (/tmp is fine; a 0777 dir is not): anyone
      could otherwise rename the data dir away and put their own in its place; nor
      group-writable unless sticky where its group has other members
      (``group_members_besides``); nor writable by another user or group through a POSIX
      ACL (``acl_write_grants``);
    * every directory above it is held to the same rules, and no symlink on its path is
      another user's: whoever can rename entries in a parent can swap the spill dir itself
      for a symlink, and a removal that checked its path first would then follow it;
    * ``spill_dir/hybrid_ray`` is a real directory, not a symlink, owned by this user and
      mode 0700 (no group or other access): shuffle rows are private.
    """
    uid = os.geteuid()

    def refuse(path: str, problem: str, fix: str) -> SpillDirError:
        return SpillDirError(f"spill dir {spill_dir} cannot be used: {path} {problem}; {fix}")

    try:
        if not os.path.lexists(spill_dir):
            # Nothing is created below a directory someone else could swap it in.
            problem = _parents_problem(spill_dir, (uid, 0))
            if problem is not None:
                raise refuse(spill_dir, *problem)
            make_private_dir(spill_dir)
        problem = trusted_dir_problem(spill_dir, uid)
    except OSError as exc:
        raise refuse(spill_dir, f"cannot be created or read ({exc.strerror or exc})",
                     "point spill_dirs at a writable directory") from None
    if problem is not None:
        raise refuse(spill_dir, *problem)
    data_dir = os.path.join(spill_dir, DATA_DIR_NAME)
    try:
        os.mkdir(data_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise refuse(data_dir, f"cannot be created ({exc.strerror or exc})",
                     "point spill_dirs at a writable directory") from None
    problem = _private_dir_problem(data_dir, uid)
    if problem is not None:
        # Not simply "remove it": in a spill dir like ~ the directory of that name may be
        # the user's own (a checkout of hybrid_ray), not one hybrid_ray made.
        raise refuse(data_dir, problem, f"if {data_dir} holds only hybrid_ray's spill "
                     "files (shuffle directories with a .hybrid_ray_shuffle marker), remove "
                     "it and hybrid_ray recreates it; otherwise use another spill dir")
    return data_dir


def check_spill_dir_writable(spill_dir: str) -> str:
    """``check_spill_dir``, then a file created and removed in the data dir: a dir that
    exists and passes the checks can still refuse writes (a read-only filesystem, a full
    quota). Returns the data dir; raises ``SpillDirError`` naming the path and the fix.
    For ``hybrid_ray.init``'s check of each node (``TierManager.check_spill_dirs``): a
    shuffle found out only at its first spilled segment, as a failed map."""
    data_dir = check_spill_dir(spill_dir)
    probe = os.path.join(data_dir, f".write-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        write_private_file(probe, b"")
        unlink_quietly(probe)
    except OSError as exc:
        raise SpillDirError(f"spill dir {spill_dir} cannot be used: {data_dir} cannot be "
                            f"written ({exc.strerror or exc}); point spill_dirs at a "
                            "writable directory") from None
    return data_dir


def trusted_dir_problem(spill_dir: str, uid: int) -> tuple[str, str] | None:
    """(problem, fix) if the existing ``spill_dir`` is not safe for ``uid``'s data dir (see
    ``check_spill_dir``'s rules: a directory of ``uid`` or root that nobody else can swap
    entries in, below directories nobody else can swap it in), else None; ``OSError`` if
    it cannot be read. Also the rule for the root of a local remote tier
    (``hybrid_ray.cleanup``)."""
    trusted = (uid, 0)
    link = os.lstat(spill_dir)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        return (f"is a symlink owned by uid {link.st_uid} (another user, who could point it "
                "elsewhere)", "use the directory it points to, or a directory of your own")
    st = os.stat(spill_dir)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", "point spill_dirs at a directory (it is created if missing)"
    if st.st_uid not in trusted:
        return (f"is owned by uid {st.st_uid}, another user who could replace hybrid_ray's "
                "data dir in it", "use a directory you own (if this is the default spill dir, "
                "another user created it first: set ShuffleConfig(spill_dirs=[...]))")
    problem = _swappable_entries(spill_dir, st)
    if problem is not None:
        return (f"{problem[0]}, so {problem[1]} can replace hybrid_ray's data dir in it",
                f"{problem[2]}, or use another directory")
    return _parents_problem(spill_dir, trusted)


def _swappable_entries(path: str, st: os.stat_result) -> tuple[str, str, str] | None:
    """(what lets others rename entries in directory ``path``, who, the fix) or None: it
    is world-writable or group-writable (with other members in its group) without the
    sticky bit, or a POSIX ACL lets another user or group write it."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"is world-writable without the sticky bit (mode {mode:o})", "anyone",
                f"run 'chmod o-w {path}' or 'chmod +t {path}'")
    if st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX:
        others = group_members_besides(st.st_gid, st.st_uid)
        if others:
            return (f"is group-writable without the sticky bit (mode {mode:o}) and its group "
                    f"has other members ({others})", "they",
                    f"run 'chmod g-w {path}' or 'chmod +t {path}'")
    grants = acl_write_grants(path, st.st_uid)
    if grants and not st.st_mode & stat.S_ISVTX:
        return (f"is writable through its ACL by {grants}", "they",
                f"remove those entries ('setfacl -x ... {path}') or run 'chmod +t {path}'")
    return None


def _parents_problem(spill_dir: str, trusted: tuple[int, int]) -> tuple[str, str] | None:
    """(problem, fix) if someone else could swap ``spill_dir`` itself: a symlink on its
    path (as written) owned by another user, or a directory above it (as resolved) that
    another user owns or may rename entries in (``_swappable_entries``); else None."""
    path = os.path.abspath(spill_dir)
    prefix = os.sep
    for part in [p for p in path.split(os.sep) if p][:-1]:
        prefix = os.path.join(prefix, part)
        try:
            link = os.lstat(prefix)
        except FileNotFoundError:  # not created yet: nothing below it to check
            break
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
            return (f"is reached through {prefix}, a symlink owned by uid {link.st_uid} "
                    "(another user, who could point it elsewhere)",
                    "use a path without it, or a directory of your own")
    parent = os.path.realpath(path)
    while parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
        try:
            st = os.stat(parent)
        except FileNotFoundError:  # created by check_spill_dir, as a private directory
            continue
        if st.st_uid not in trusted:
            return (f"is inside {parent}, owned by uid {st.st_uid} (another user, who could "
                    "replace the spill dir with a symlink to elsewhere)",
                    "use a spill dir whose every parent directory is yours or root's")
        problem = _swappable_entries(parent, st)
        if problem is not None:
            return (f"is inside {parent}, which {problem[0]}, so {problem[1]} can replace "
                    "the spill dir with a symlink to elsewhere",
                    f"{problem[2]}, or use a spill dir whose every parent directory only "
                    "you or root can change")
    return None


# POSIX ACL xattr layout (linux/posix_acl_xattr.h): a u32 version, then (u16 tag, u16 perm,
# u32 id) entries, little-endian.
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10
_ACL_WRITE = 0x02


def acl_write_grants(path: str, owner_uid: int) -> str:
    """Who besides the owner may write directory ``path`` through a POSIX ACL entry
    (named users and groups, as the mask lets them), named for an error message; "" if
    nobody or the filesystem has no ACLs. The mode's group bits show only the ACL's mask,
    so a 0770 directory with ``user:bob:rwx`` looked like a private group's."""
    try:
        raw = os.getxattr(path, _ACL_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return ""
        raise
    entries = [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw) - 7, 8)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    names = [f"uid {who}" for tag, perm, who in entries
             if tag == _ACL_USER and who != owner_uid and perm & mask & _ACL_WRITE]
    names += [f"gid {who}" for tag, perm, who in entries
              if tag == _ACL_GROUP and perm & mask & _ACL_WRITE]
    return ", ".join(names)


def group_members_besides(gid: int, owner_uid: int) -> str:
    """Who else than ``owner_uid`` belongs to group ``gid`` (listed in it, or with it as
    their primary group), named for an error message; "" if nobody. A group this machine
    cannot resolve (a numeric gid from a container image) counts as having others: who
    is in it cannot be known. A private group (Debian's one group per user, often made
    group-writable by umask 002) has nobody else."""
    import grp
    import pwd

    try:
        group = grp.getgrgid(gid)
    except KeyError:
        return f"gid {gid}, unknown here"
    try:
        owner = pwd.getpwuid(owner_uid).pw_name
    except KeyError:
        owner = None
    others = {name for name in group.gr_mem if name != owner}
    others |= {user.pw_name for user in pwd.getpwall()
               if user.pw_gid == gid and user.pw_uid != owner_uid}
    return ", ".join(sorted(others)[:5]) + (" ..." if len(others) > 5 else "")


def local_tree_problem(root: str, directories: Sequence[str]) -> str | None:
    """For a remote tier on the local filesystem (``file://``, a shared mount): why
    hybrid_ray must not write or remove below ``directories`` (its job, shuffle and
    subpartition directories under ``root``), or None. Removals go file by file and follow
    a directory another user swapped for a symlink meanwhile; only someone who can write a
    directory on the way can swap what is in it, so ``root`` is held to a spill dir's rule
    (``trusted_dir_problem``) and each of ``directories`` that exists must be a real
    directory of this user that nobody else can write. ``OSError`` if one cannot be read."""
    uid = os.geteuid()
    try:
        problem = trusted_dir_problem(root, uid)
    except FileNotFoundError:
        return None  # no root: nothing below it to write into or remove yet
    if problem is not None:
        return f"{root} {problem[0]}"
    for path in directories:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a real directory"
        if st.st_uid != uid:
            return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
        if st.st_mode & 0o022:
            return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def unsafe_spill_dir(spill_dir: str) -> str | None:
    """Why hybrid_ray must not delete under the existing ``spill_dir`` (its data dir, or
    the dir itself, could be swapped by another user while a removal runs, sending the
    removal elsewhere), or None; nothing is created. For ``hybrid-ray cleanup``, which
    must hold a directory to the rules a shuffle's own writes are held to."""
    uid = os.geteuid()
    try:
        problem = trusted_dir_problem(spill_dir, uid)
    except OSError as exc:
        return f"{spill_dir} cannot be read ({exc.strerror or exc})"
    if problem is not None:
        return f"{spill_dir} {problem[0]}"
    data_dir = os.path.join(spill_dir, DATA_DIR_NAME)
    problem_of_data = _private_dir_problem(data_dir, uid)
    return None if problem_of_data is None else f"{data_dir} {problem_of_data}"


def marked_shuffle_dir_problem(shuffle_directory: str, shuffle_id: str) -> str | None:
    """Why ``shuffle_directory`` (``<spill dir>/hybrid_ray/<shuffle_id>``, of a data dir no
    disk tier of this process registered) is not to be trusted as one of ours, or None:
    a tier manager started again serves and deletes segment files there. The spill dir
    must pass a spill dir's rule, the data dir be a private (0700) directory of this user,
    the shuffle directory a real one of this user holding our marker for ``shuffle_id``,
    a file of this user. Nobody else can then swap anything below the data dir between
    the check and the use. (A marker alone was planted by anyone who could write a
    directory named ``hybrid_ray`` anywhere.)"""
    uid = os.geteuid()
    data_dir = os.path.dirname(shuffle_directory)
    if os.path.basename(data_dir) != DATA_DIR_NAME:
        return f"{shuffle_directory} is not in a directory named {DATA_DIR_NAME}"
    spill_dir = os.path.dirname(data_dir)
    try:
        problem = trusted_dir_problem(spill_dir, uid)
    except OSError as exc:
        return f"{spill_dir} cannot be read ({exc.strerror or exc})"
    if problem is not None:
        return f"{spill_dir} {problem[0]}"
    problem_of_data = _private_dir_problem(data_dir, uid)
    if problem_of_data is not None:
        return f"{data_dir} {problem_of_data}"
    try:
        st = os.lstat(shuffle_directory)
        marker_st = os.lstat(os.path.join(shuffle_directory, SHUFFLE_MARKER_NAME))
    except OSError as exc:
        return f"{shuffle_directory} or its marker cannot be read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return f"{shuffle_directory} is not a real directory of this user"
    if marker_st.st_uid != uid:
        return f"the marker in {shuffle_directory} is owned by uid {marker_st.st_uid}"
    marker = read_shuffle_marker(shuffle_directory)
    if marker is None or marker.get("shuffle_id") != shuffle_id:
        return f"{shuffle_directory} carries no marker of hybrid_ray's for shuffle {shuffle_id}"
    return None


def _private_dir_problem(path: str, uid: int) -> str | None:
    """Why ``path`` is not a private directory of ``uid`` (one ``lstat``), or None."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink (it could send hybrid_ray's writes and deletes elsewhere)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o077:
        return (f"has mode {stat.S_IMODE(st.st_mode):o}: other users can reach shuffle data "
                "(it must be 0700)")
    return None


# The filesystem (st_dev) of each spill dir a disk tier of this process checked, so a
# reservation sums the grants in flight per filesystem, not per directory name.
_DEVICES: dict[str, Any] = {}
_DEVICES_KEPT = 4096


def _device_of(directory: str, refresh: bool = False) -> Any:
    """The device id of the filesystem holding ``directory`` (looked up again with
    ``refresh``; else as last seen); a directory that cannot be looked at counts as a
    filesystem of its own."""
    if refresh or directory not in _DEVICES:
        if len(_DEVICES) >= _DEVICES_KEPT:
            _DEVICES.clear()  # looked up again as needed
        try:
            _DEVICES[directory] = os.stat(directory).st_dev
        except OSError:
            _DEVICES[directory] = ("unreadable", directory)
    return _DEVICES[directory]


def segment_path(spill_dir: str, segment: SegmentId) -> str:
    return os.path.join(shuffle_dir(spill_dir, segment.shuffle_id), segment.relative_path)


class DiskTier(Tier):
    """Local spill directories with a statvfs-checked reserve and an optional byte cap."""

    name = TierName.DISK
    SETTLES_EVERY_GRANT = True  # in flight until settled (``settle_changes_books``)

    def __init__(self, segment_bytes: int, spill_dirs: Sequence[str],
                 min_reserve_fraction: float = 0.05, capacity_bytes: int | None = None,
                 in_flight: dict[tuple[str, str], int] | None = None,
                 node_used: Callable[[], int] | None = None) -> None:
        super().__init__(segment_bytes)
        # ShuffleConfig checks its spill_dirs; a tier built directly is checked here: a
        # single path was taken as one spill dir per character ("/" among them), and a
        # relative dir created below the working directory (its segments' locations are
        # then never accepted for deletion: ``require_segment_file`` wants them absolute).
        refuse_single_spill_dir(spill_dirs)
        if not spill_dirs:
            raise ValueError("spill_dirs must name at least one directory")
        relative = [d for d in spill_dirs if not os.path.isabs(d)]
        if relative:
            raise ConfigError(f"spill dir {relative[0]!r} is relative: give absolute paths "
                              "(os.path.abspath(...))")
        # Normalised (not resolved: a symlinked spill dir stays as given, as ShuffleConfig
        # keeps it): a segment's location is this path joined with its name, and
        # deletions accept only normal locations (``require_segment_file``), so a tier over
        # '/mnt//spill' or '/mnt/x/../spill' wrote segments whose every deletion was refused.
        # (ShuffleConfig normalises its spill_dirs; a tier built directly did not.)
        self.spill_dirs = tuple(dict.fromkeys(os.path.normpath(d) for d in spill_dirs))
        # Checked as ShuffleConfig checks them: 1.5 (or a negative cap) made every grant
        # fail, the disk "full"; -1 granted until the disk was full; "0.05" multiplied
        # the disk's size into a string.
        self.min_reserve_fraction = require_number("min_reserve_fraction",
                                                   min_reserve_fraction, 0.0, 1.0, False)
        self._capacity = (None if capacity_bytes is None
                          else require_bytes("disk capacity_bytes", capacity_bytes))
        # Bytes granted but not yet written, per (directory, shuffle): statvfs cannot see
        # them yet. Per shuffle so a dead writer's grants are dropped with its shuffle.
        # ``in_flight``: a node's book shared by all its disk tiers (one per config), so
        # tiers over the same directory see each other's grants (each saw only its own,
        # and two configs differing only in their reserve granted 29 MiB on 20 MiB free).
        self._in_flight: dict[tuple[str, str], int] = {} if in_flight is None else in_flight
        # ``node_used``: the bytes all of the node's disk tiers hold, which the byte cap
        # (per node) bounds. Checked against this tier's own, two configs differing only
        # in their reserve each got the whole cap (16 MiB granted under a 10 MiB cap).
        self._node_used = node_used
        self._next_dir = itertools.cycle(range(len(self.spill_dirs)))
        self._uid = os.geteuid()
        # Checked once, here (before any shuffle writes); reservations re-check with one
        # lstat of the data dir (a dir removed or replaced under a long-lived tier).
        self._data_dirs = {d: check_spill_dir(d) for d in self.spill_dirs}

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    def mark_shuffle(self, shuffle_id: str, spill_dir: str) -> None:
        """Create the shuffle's directory in ``spill_dir`` (0700) with hybrid_ray's marker,
        for a writer in another process that writes no marker itself (the JVM's): cleanup
        and a restarted tier manager delete only marked directories."""
        if spill_dir not in self._data_dirs:
            raise UnsafePathError(f"refusing to mark {spill_dir} for shuffle {shuffle_id}: "
                                  f"not one of this disk tier's spill dirs "
                                  f"{list(self.spill_dirs)}")
        directory = shuffle_dir(spill_dir, shuffle_id)  # the shuffle id is checked here
        make_private_dir(directory)
        write_shuffle_marker(directory, shuffle_id)

    def data_dirs(self) -> list[str]:
        """hybrid_ray's data dir in each spill dir: every segment file of this tier is in
        one of them."""
        return list(self._data_dirs.values())

    def _unusable(self, spill_dir: str) -> str | None:
        """Why ``spill_dir`` cannot take files, or None. A missing directory is recreated
        (0700): the tier lives as long as its node's tier manager, and a spill dir can be
        removed under it between shuffles (a tmp cleaner, a user's ``rm -rf``). One that
        was replaced by something unsafe meanwhile is refused with the reason."""
        if _private_dir_problem(self._data_dirs[spill_dir], self._uid) is None:
            return None
        try:
            check_spill_dir(spill_dir)
        except SpillDirError as exc:
            return str(exc)
        return None

    def _free_after(self, spill_dir: str, nbytes: int) -> tuple[int, int, int]:
        st = os.statvfs(spill_dir)
        free = st.f_bavail * st.f_frsize
        total = st.f_blocks * st.f_frsize
        reserve = int(self.min_reserve_fraction * total)
        # Grants not yet written anywhere on this filesystem take its free space: two spill
        # dirs on one disk (or two configs' dirs) each saw the whole free space, and were
        # granted twice the room above the reserve between them.
        device = _device_of(spill_dir, refresh=True)
        in_flight = sum(v for (d, _), v in self._in_flight.items()
                        if _device_of(d) == device)
        return free - in_flight - nbytes, reserve, free

    def _capped_bytes(self) -> int:
        """The bytes the cap bounds: the node's disk tiers' (see ``node_used``)."""
        return self._node_used() if self._node_used is not None else self.used_bytes

    def _room_for(self, shuffle_id: str, nbytes: int) -> str | None:
        if self._capacity is not None and self._capped_bytes() + nbytes > self._capacity:
            return None
        # Round-robin over the directories that can take the segment.
        start = next(self._next_dir)
        n = len(self.spill_dirs)
        for i in range(n):
            spill_dir = self.spill_dirs[(start + i) % n]
            if self._unusable(spill_dir) is not None:
                continue
            free_after, reserve, _ = self._free_after(spill_dir, nbytes)
            if free_after >= reserve:
                key = (spill_dir, shuffle_id)
                self._in_flight[key] = self._in_flight.get(key, 0) + nbytes
                return spill_dir
        return None

    def settle_changes_books(self, grant: Grant, written_bytes: int | None) -> bool:
        return True  # every grant is in flight until settled (``_on_settled``)

    def _on_settled(self, shuffle_id: str, grant: Grant, written_bytes: int | None) -> None:
        key = (grant.target, shuffle_id)
        left = self._in_flight.get(key, 0) - grant.nbytes
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    def describe_refusal(self, nbytes: int) -> str:
        if self._capacity is not None and self._capped_bytes() + nbytes > self._capacity:
            return (f"disk tier cap reached: {self._capped_bytes()} of disk_capacity_bytes="
                    f"{self._capacity} used on this node, segment needs {nbytes} bytes")
        parts = []
        unusable = False
        for d in self.spill_dirs:
            problem = self._unusable(d)
            if problem is not None:
                parts.append(problem)
                unusable = True
                continue
            _, reserve, free = self._free_after(d, nbytes)
            parts.append(f"{d}: {free} bytes free, reserve {reserve} bytes "
                         f"(min_reserve_fraction={self.min_reserve_fraction})")
        what = "disk tier unavailable" if unusable else "disk tier full"
        return f"{what}: {'; '.join(parts)}; segment needs {nbytes} bytes"

    # ---- I/O ------------------------------------------------------------------------------
    def write(self, segment: SegmentId, payload: bytes, grant: Grant | None = None,
              node_id: str = "") -> SegmentMeta:
        spill_dir = grant.target if grant is not None and grant.target else self.spill_dirs[0]
        if spill_dir not in self._data_dirs:  # a grant comes from another process
            raise UnsafePathError(f"refusing to write {segment} to {spill_dir}: not one of "
                                  f"this disk tier's spill dirs {list(self.spill_dirs)}")
        path = segment_path(spill_dir, segment)  # the shuffle id is checked here
        try:
            # (Inside: a full disk refusing the directory is out of space too, for the
            # writer to place the segment in the next tier, not a failed map.)
            make_private_dir(os.path.dirname(path))
            write_shuffle_marker(shuffle_dir(spill_dir, segment.shuffle_id),
                                 segment.shuffle_id)
            write_private_file(path, payload)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(
                    f"no space left in spill dir {spill_dir} while writing {segment} "
                    f"({len(payload)} bytes)") from exc
            raise
        return SegmentMeta(segment, self.name, len(payload), segment_num_rows(payload),
                           node_id=node_id, location=path,
                           granted_by=grant.granted_by if grant is not None else "")

    def read(self, meta: SegmentMeta) -> bytes:
        return read_segment_file(meta)

    def has(self, segment: SegmentId) -> bool:
        return any(os.path.exists(segment_path(d, segment)) for d in self.spill_dirs)

    def delete(self, meta: SegmentMeta) -> None:
        location = require_segment_file(meta.location, "delete")
        if os.path.basename(shuffle_dir_of(location)) != meta.id.shuffle_id:
            # (As RemoteTier.delete and the tier manager: a segment of one shuffle never
            # names another shuffle's file.)
            raise UnsafePathError(f"refusing to delete {location}: not a file of shuffle "
                                  f"{meta.id.shuffle_id}, whose segment {meta.id} it is "
                                  "said to be. This is a bug in the caller; please report it")
        if not any(location.startswith(data_dir + os.sep)
                   for data_dir in self._data_dirs.values()):
            raise UnsafePathError(f"refusing to delete {location}: not in this disk tier's "
                                  f"data dirs {sorted(self._data_dirs.values())}")
        unlink_quietly(location)

    def has_shuffle_data(self, shuffle_id: str) -> bool:
        """Whether a directory of the shuffle exists in one of this tier's spill dirs (a
        symlink by its name is not one: never followed, see ``remove_shuffle_data``)."""
        check_id("shuffle_id", shuffle_id)
        return any(os.path.isdir(path) and not os.path.islink(path)
                   for path in (shuffle_dir(d, shuffle_id) for d in self._data_dirs))

    def remove_shuffle_data(self, shuffle_id: str) -> None:
        check_id("shuffle_id", shuffle_id)
        for key in [k for k in self._in_flight if k[1] == shuffle_id]:
            del self._in_flight[key]
        failures: list[str] = []
        refused: UnsafePathError | None = None
        for d, data_dir in self._data_dirs.items():
            # Every spill dir is tried: one refused raised here and kept the shuffle's
            # files in the other spill dirs through every retry.
            try:
                path = require_inside(data_dir, shuffle_dir(d, shuffle_id), "remove")
                if os.path.islink(path):
                    # hybrid_ray never makes one. Followed, a link named as this shuffle's
                    # directory and pointing at another shuffle's deleted that shuffle's
                    # segments at this one's release (found by a review).
                    raise UnsafePathError(
                        f"refusing to remove {path}: it is a symlink (to "
                        f"{os.readlink(path)!r}), not a shuffle directory hybrid_ray made; "
                        "nothing was followed or removed. Remove the link yourself")
            except UnsafePathError as exc:
                refused = refused or exc
                continue
            failures += remove_marked_tree(path)
        if refused is not None:
            if failures:
                refused.add_note(f"{len(failures)} path(s) elsewhere were left too: "
                                 + "; ".join(failures[:5]))
            raise refused
        if failures:
            # Raised, so the caller retries (the master's deletion queue, the tier
            # manager's late-files sweep); the marker stays until the rest is gone, so
            # `hybrid-ray cleanup` still recognises what is left as ours.
            raise OSError(f"removing shuffle {shuffle_id} from the disk tier left "
                          f"{len(failures)} path(s): " + "; ".join(failures[:5]))


def remove_tree(path: str, dir_fd: int | None = None) -> list[str]:
    """Remove a directory tree (symlinks in it are removed, never followed; a symlink at
    ``path`` itself is refused, not followed); returns what could not be removed, each
    with its error. Already gone counts as removed. ``dir_fd``: ``path`` is relative to
    that open directory (``shutil.rmtree``'s)."""
    failures: list[str] = []

    def record(_fn: Any, failed: str, exc: Any) -> None:
        error = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(error, FileNotFoundError):  # gone meanwhile: not a failure
            failures.append(f"{failed}: {error}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=record, dir_fd=dir_fd)
    else:
        shutil.rmtree(path, onerror=record, dir_fd=dir_fd)
    return failures


def remove_marked_tree(path: str) -> list[str]:
    """Remove a shuffle directory, its ``SHUFFLE_MARKER_NAME`` last: a removal that fails
    part-way leaves the marker beside what is left (cleanup only touches marked
    directories). Returns what could not be removed; a missing directory is no failure.

    ``path`` is never followed: its entries are listed and removed through the directory
    opened without following a symlink, and a symlink at ``path`` (a directory swapped
    for one since it was found) is a failure, not removed. (Listed by path, a link named
    as one shuffle's directory and pointing at another's deleted that other shuffle's
    segments: found by a review.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if os.path.islink(path):  # (ELOOP, or ENOTDIR with O_DIRECTORY)
            return [f"{path}: a symlink, not a directory hybrid_ray made: not followed"]
        return [f"{path}: {exc}"]
    failures: list[str] = []
    try:
        for name in os.listdir(fd):
            if name == SHUFFLE_MARKER_NAME:
                continue
            try:
                is_dir = stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode)
                if is_dir:
                    failures += [f"{path}/{failed}" for failed in remove_tree(name, dir_fd=fd)]
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass  # gone meanwhile
            except OSError as exc:
                failures.append(f"{os.path.join(path, name)}: {exc}")
    except OSError as exc:
        failures.append(f"{path}: {exc}")
    finally:
        os.close(fd)
    if failures:
        return failures
    return remove_tree(path)


def read_segment_file(meta: SegmentMeta) -> bytes:
    """Read a disk-tier segment file (any process on its node may do this)."""
    try:
        with open(meta.location, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise SegmentNotFoundError(
            f"{meta.id} is gone from the disk tier ({meta.location}): released or "
            "removed by cleanup") from exc


def map_segment_file(meta: SegmentMeta) -> pa.Buffer:
    """A disk-tier segment file of this node, memory-mapped: decoded without copying it
    out of the page cache. Safe to keep while the shuffle is released: segment files are
    only ever renamed into place whole and unlinked, never truncated, so the mapping stays
    valid until its last reader drops it."""
    try:
        with pa.memory_map(meta.location, "r") as mapped:
            return mapped.read_buffer()
    except FileNotFoundError as exc:
        raise SegmentNotFoundError(
            f"{meta.id} is gone from the disk tier ({meta.location}): released or "
            "removed by cleanup") from exc


def temporary_name(path: str) -> str:
    """Where a file or object for ``path`` is written before it is renamed into place: a
    name of the writing thread's own, so two writers of one path never share it."""
    return f"{path}.{os.getpid()}-{threading.get_ident()}.inprogress"


def write_private_file(path: str, payload: bytes | memoryview) -> None:
    """Write ``payload`` to ``path`` as a 0600 file, under a temporary name renamed into
    place when complete (a reader never sees half a file). Raises ``OSError``.

    The temporary name is the writing thread's own: two threads of one process writing
    the same file (a shuffle's marker) shared one per process, and the second truncated
    the first's half-written file, renamed it into place, and failed the first's rename."""
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # Any error, not only OSError: KeyboardInterrupt (what ``ray.cancel`` raises in a
        # task) or a MemoryError left the half-written file until the shuffle's release.
        unlink_quietly(tmp)
        raise


def write_shuffle_marker(directory: str, shuffle_id: str) -> None:
    """Mark ``directory`` as a hybrid_ray shuffle directory (``SHUFFLE_MARKER_NAME``), once:
    cleanup removes only marked directories. A stat per segment checks it, so a directory
    removed and recreated under a late writer is marked again. Written whole and renamed."""
    marker = os.path.join(directory, SHUFFLE_MARKER_NAME)
    if not os.path.exists(marker):
        write_private_file(marker, shuffle_marker(shuffle_id))


def read_shuffle_marker(directory: str) -> dict[str, Any] | None:
    """The parsed marker of a local shuffle directory (``write_shuffle_marker``); None if
    it has none, or something else by that name (a symlink, a large file, garbage)."""
    marker = os.path.join(directory, SHUFFLE_MARKER_NAME)
    try:
        st = os.lstat(marker)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MARKER_BYTES:
            return None
        with open(marker, "rb") as f:
            return parse_shuffle_marker(f.read())
    except OSError:
        return None


def make_private_dir(path: str) -> None:
    """Create ``path`` and any missing parents as 0700 (``os.makedirs`` only sets the leaf)."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        make_private_dir(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_all(paths: Sequence[str]) -> dict[str, OSError]:
    """Unlink every path (already gone counts as unlinked); returns path -> error of those
    that could not be. One that fails does not stop the others."""
    errors: dict[str, OSError] = {}
    for path in paths:
        try:
            unlink_quietly(path)
        except OSError as exc:
            errors[path] = exc
    return errors
