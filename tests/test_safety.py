"""Issue 14 items 2, 3 (unsafe dirs), 14: hostile ids, unsafe spill dirs, leaked secrets.

Every traversal test puts a victim next to the spill dir or remote prefix and asserts that
it is still there after hybrid_ray refused the id.
"""

from __future__ import annotations

import os
import stat
import tempfile
import traceback
from typing import Any

import pyarrow as pa
import pytest

from conftest import files_under
from hybrid_ray import MiB, SegmentId, SegmentMeta, ShuffleConfig, TierManager, TierName, WriteClient
from hybrid_ray.errors import (
    ConfigError, InvalidIdError, RemoteTierError, SpillDirError, UnsafePathError,
)
from hybrid_ray.master import ShuffleRegistry
from hybrid_ray.segment import encode_segment
from hybrid_ray.tiers import DiskTier, RemoteTier
from hybrid_ray.tiers.disk import unsafe_spill_dir

PAYLOAD = encode_segment(pa.table({"k": list(range(100))}), SegmentId("shf-payload", 0, 0, 0), "none")
OTHER_UID = 54321  # no such user: "another user" for ownership checks (needs root to chown)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def victim(path) -> str:
    """A user's file that hybrid_ray must never touch."""
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, "precious.txt")
    with open(name, "w") as f:
        f.write("user data")
    return name


def assert_intact(name: str) -> None:
    with open(name) as f:
        assert f.read() == "user data"


# ---- path traversal (item 2) -----------------------------------------------------------------
def test_dotted_shuffle_id_cannot_write_outside_the_spill_dir(tmp_path):
    spill = tmp_path / "spill"
    tier = DiskTier(MiB, [str(spill)])
    grant = tier.try_reserve("shf-ok", len(PAYLOAD))
    with pytest.raises(InvalidIdError, match=r"shuffle_id '\.\./\.\./x' is not a valid id"):
        tier.write(SegmentId("../../x", 0, 0, 0), PAYLOAD, grant)
    assert not (tmp_path / "x").exists()
    assert files_under(str(tmp_path)) == []


def test_release_of_a_dotted_shuffle_id_deletes_nothing(tmp_path):
    mine = victim(tmp_path / "x")                   # spill/hybrid_ray/../../x
    sibling = victim(tmp_path / "parent" / "sibling")  # parent/spill/hybrid_ray/../..
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill"), str(tmp_path / "parent" / "spill")])
    tm = TierManager("node-a", 0)
    tm.register_shuffle("shf-1", cfg)
    for bad in ("../../x", "../..", "..", "../"):
        with pytest.raises(InvalidIdError, match="shuffle_id"):
            tm.release_shuffle(bad)
        with pytest.raises(InvalidIdError, match="shuffle_id"):
            tm.register_shuffle(bad, cfg)
        for disk in tm._disks.values():
            with pytest.raises(InvalidIdError, match="A-Z a-z 0-9 _ . -"):
                disk.remove_shuffle_data(bad)
    assert_intact(mine)
    assert_intact(sibling)
    tm.release_shuffle("shf-1")


def test_remote_remove_of_a_dotted_id_stays_inside_the_prefix(tmp_path):
    other_job = victim(tmp_path / "remote" / "other-job" / "shf-9")
    outside = victim(tmp_path / "elsewhere")
    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1")
    for bad in ("../", "..", "../other-job", "../../elsewhere"):
        with pytest.raises(InvalidIdError, match="shuffle_id"):
            tier.remove_shuffle_data(bad)
        with pytest.raises(InvalidIdError, match="shuffle_id"):
            tier.write(SegmentId(bad, 0, 0, 0), PAYLOAD)
    assert_intact(other_job)
    assert_intact(outside)


@pytest.mark.parametrize("job_id", ["..", "../x", "a/b", ".", "", "-rf", "a b", "x" * 129])
def test_job_id_that_is_not_one_path_component_is_refused(job_id, tmp_path):
    with pytest.raises(InvalidIdError, match="job_id") as info:
        ShuffleConfig(job_id=job_id)
    assert "A-Z a-z 0-9 _ . -" in str(info.value)
    with pytest.raises(InvalidIdError, match="job_id"):
        RemoteTier(MiB, f"file://{tmp_path}/remote", job_id)
    assert not os.path.exists(tmp_path / "remote")


def test_ids_that_are_allowed(tmp_path):
    ray_node_id = "f4a1" * 14  # Ray node ids are 56 hex digits
    cfg = ShuffleConfig(job_id="job-2024.06_A", namespace="team_a.prod-1",
                        spill_dirs=[str(tmp_path / "{node_id}")])
    assert cfg.spill_dirs_for(ray_node_id) == (str(tmp_path / ray_node_id),)
    TierManager(ray_node_id, 0).register_shuffle("x" * 128, cfg)


def test_node_id_and_namespace_are_checked(tmp_path):
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill-{node_id}")])
    with pytest.raises(InvalidIdError, match="node_id '../victim'"):
        cfg.spill_dirs_for("../victim")
    with pytest.raises(InvalidIdError, match="node_id"):
        TierManager("../n", 0)
    with pytest.raises(InvalidIdError, match="namespace"):
        ShuffleConfig(namespace="../ns")


def test_long_bad_id_is_truncated_in_the_message():
    with pytest.raises(InvalidIdError) as info:
        ShuffleConfig(job_id="../" + "a" * 10_000)
    assert len(str(info.value)) < 400 and "..." in str(info.value)


def test_master_and_write_client_refuse_bad_shuffle_ids(tmp_path):
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")])
    with pytest.raises(InvalidIdError, match="shuffle_id"):
        ShuffleRegistry(lambda *a: None, lambda *a: None).register("../../x", 1, 1, cfg)
    with pytest.raises(InvalidIdError, match="shuffle_id"):
        WriteClient("../../x", 0, 1, cfg, TierManager("node-a", 0), {})


# ---- confinement: the second line of defence ----------------------------------------------------
def test_disk_deletes_and_writes_stay_in_the_data_dir(tmp_path):
    outside = victim(tmp_path / "outside")
    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    forged = SegmentMeta(SegmentId("shf-1", 0, 0, 0), TierName.DISK, 9, 1, "node-a", outside)
    with pytest.raises(UnsafePathError, match="not a hybrid_ray segment file"):
        tier.delete(forged)
    tm = TierManager("node-a", 0)
    # Refused, not raised: the deletion's other segments go, and retrying it would never
    # make the file ours. The refusal is counted (``hybrid-ray status``).
    [refusal] = tm.free_segments("shf-1", [forged])
    assert "refusing to delete" in refusal and "not a hybrid_ray segment file" in refusal
    assert tm.usage().refused_deletions == 1
    with pytest.raises(UnsafePathError, match="refusing to serve"):
        tm.read_disk_segment(forged)
    # A segment-shaped path in someone else's directory is not this tier's either.
    other = tmp_path / "other" / "hybrid_ray" / "shf-1" / "sub-00000"
    other_file = victim(other)
    shaped = SegmentMeta(forged.id, TierName.DISK, 9, 1, "node-a", other_file)
    with pytest.raises(UnsafePathError, match="not in this disk tier's data dirs"):
        tier.delete(shaped)
    # A grant naming a directory that is not one of the tier's spill dirs.
    from hybrid_ray.tiers import Grant
    with pytest.raises(UnsafePathError, match="not one of this disk tier's spill dirs"):
        tier.write(SegmentId("shf-1", 0, 0, 0), PAYLOAD,
                   Grant(TierName.DISK, len(PAYLOAD), str(tmp_path / "outside")))
    assert_intact(outside)
    assert_intact(other_file)


def test_shuffle_dir_symlinked_outside_is_not_followed_by_remove(tmp_path):
    outside = victim(tmp_path / "outside")
    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    os.symlink(tmp_path / "outside", tmp_path / "spill" / "hybrid_ray" / "shf-1")
    with pytest.raises(UnsafePathError, match="not inside hybrid_ray's data directory"):
        tier.remove_shuffle_data("shf-1")
    assert_intact(outside)


def test_a_shuffle_dir_symlinked_to_another_shuffle_s_is_not_followed(tmp_path):
    """A link named as one shuffle's directory and pointing at another's, inside the data
    dir, passed the resolved-path check: releasing the first shuffle listed the link's
    target and deleted the other shuffle's segments (and again at every retry, the late
    sweep seeing a "directory" through the link). Refused now; nothing is touched."""
    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    other = SegmentId("shf-other", 0, 0, 0)
    kept = tier.write(other, encode_segment(pa.table({"k": [1, 2]}), other, "none"))
    link = tmp_path / "spill" / "hybrid_ray" / "shf-1"
    os.symlink("shf-other", link)
    with pytest.raises(UnsafePathError, match="is a symlink .*nothing was followed or removed"):
        tier.remove_shuffle_data("shf-1")
    assert os.path.exists(kept.location) and os.path.islink(link)
    assert not tier.has_shuffle_data("shf-1")  # the late sweep does not come back to it
    assert tier.has_shuffle_data("shf-other")
    # Swapped in after a directory was found (cleanup's removal): the same, no follow.
    from hybrid_ray.tiers.disk import remove_marked_tree
    [failure] = remove_marked_tree(str(link))
    assert "a symlink" in failure and os.path.exists(kept.location)
    tier.remove_shuffle_data("shf-other")
    assert not os.path.exists(kept.location)


def test_a_segment_with_a_negative_number_is_refused_before_any_file_is_made(tmp_path):
    """The disk and remote tiers wrote a segment with a negative subpartition to
    ``sub--0001/...``, a path every per-segment delete refused: its file stayed until the
    shuffle's release. (Python writers are stopped earlier by encode_segment; a direct
    caller of the tiers was not.)"""
    from hybrid_ray.errors import InvalidIdError

    disk = DiskTier(MiB, [str(tmp_path / "spill")])
    remote = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1")
    for bad in (SegmentId("shf-1", 0, -1, 0), SegmentId("shf-1", -2, 0, 0),
                SegmentId("shf-1", 0, 0, -3), SegmentId("shf-1", 0, 0, 0, -1)):
        for tier in (disk, remote):
            with pytest.raises(InvalidIdError, match="must be an int >= 0 to name a file"):
                tier.write(bad, PAYLOAD)
    assert [f for f in files_under(str(tmp_path)) if f.endswith(".seg")] == []


def test_disk_delete_of_another_shuffle_s_file_is_refused(tmp_path):
    """DiskTier.delete checked only that a location lies in its data dirs, not that it is
    a file of the segment's own shuffle (RemoteTier.delete and the tier manager do)."""
    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    other = tier.write(SegmentId("shf-2", 0, 0, 0), PAYLOAD)
    forged = SegmentMeta(SegmentId("shf-1", 0, 0, 0), TierName.DISK, 9, 1, "",
                         other.location)
    with pytest.raises(UnsafePathError, match="not a file of shuffle shf-1"):
        tier.delete(forged)
    assert os.path.exists(other.location)
    tier.delete(other)  # its own shuffle's segment still goes
    assert not os.path.exists(other.location)


def test_an_interrupted_disk_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write interrupted by something other than an OSError (KeyboardInterrupt, which
    ``ray.cancel`` raises in a task; a MemoryError) left its half-written temporary file
    until the shuffle's release: only OSError removed it."""
    from hybrid_ray.tiers import disk as disk_module

    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    real_write, calls = os.write, []

    def interrupted(fd, data):
        calls.append(1)
        if len(calls) == 1:
            return real_write(fd, bytes(data)[:100])
        raise KeyboardInterrupt
    monkeypatch.setattr(disk_module.os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.write(SegmentId("shf-1", 0, 0, 0), PAYLOAD)
    monkeypatch.undo()
    assert [f for f in files_under(str(tmp_path)) if ".inprogress" in f] == []


def _late_writer_whose_marker_write_fails(name: str, storage_options: Any = None
                                          ) -> tuple[str, RemoteTier, Any]:
    """(root, writer, patch): a remote tier in memory whose writer wrote into shuffle
    ``shf-1`` before the shuffle's release removed it (its marker gone), and a patch, to
    enter, under which the writer's marker writes fail (throttled) and others go through."""
    from unittest import mock

    root = f"memory://{name}-{os.getpid()}/sh"
    writer, master = (RemoteTier(MiB, root, "job-1", storage_options) for _ in range(2))
    writer.write(SegmentId("shf-1", 0, 0, 0), PAYLOAD)
    master.remove_shuffle_data("shf-1")
    real_pipe = writer.fs.pipe_file

    def throttled_marker(path, data, **kwargs):
        if path.endswith(".hybrid_ray_shuffle"):
            raise TimeoutError("throttled")
        return real_pipe(path, data, **kwargs)
    return root, writer, mock.patch.object(writer.fs, "pipe_file", throttled_marker)


def test_a_remote_segment_whose_marker_cannot_be_restored_is_deleted(tmp_path):
    """A segment landing after its shuffle's release (marker gone) has the marker written
    again; when that write failed (throttled), the segment stayed with no marker, invisible
    to `hybrid-ray cleanup` for good. It is deleted before the error is raised now."""
    from hybrid_ray import cleanup

    root, writer, throttled_marker = _late_writer_whose_marker_write_fails("s47-marker")
    with throttled_marker, pytest.raises(RemoteTierError, match="throttled"):
        writer.write(SegmentId("shf-1", 1, 0, 0), PAYLOAD)
    bucket = root.split("://")[1].split("/")[0]
    cleanup.remove(cleanup.find_remote_orphans(root), 0)
    assert writer.fs.find(bucket) == []


def test_a_late_remote_segment_that_cannot_be_deleted_either_is_named_in_a_warning(
        caplog):
    """The same late segment, when its deletion fails too (the store is down): the write
    still fails with the marker's error, and a warning names the object left behind."""
    from unittest import mock

    _, writer, throttled_marker = _late_writer_whose_marker_write_fails("s47-undeletable")

    def refused(*args, **kwargs):
        raise PermissionError("delete refused")
    segment = SegmentId("shf-1", 1, 0, 0)
    with throttled_marker, mock.patch.object(writer.fs, "rm_file", refused), \
            pytest.raises(RemoteTierError, match="throttled"):
        writer.write(segment, PAYLOAD)
    assert any("could not delete" in r.getMessage() and writer.segment_path(segment)
               in r.getMessage() and "delete refused" in r.getMessage()
               for r in caplog.records)
    writer.remove_shuffle_data("shf-1")  # (any RemoteTier of the root may)


def test_the_warning_naming_an_undeletable_late_segment_prints_no_secret(caplog):
    """The store's error in that warning may carry a credential of the remote tier's
    storage options (an endpoint echoing the request): it is scrubbed before it is
    logged."""
    from unittest import mock

    secret = "wJalrXUtnFEMIK7MDENGbPxRfiCYzz9"
    _, writer, throttled_marker = _late_writer_whose_marker_write_fails(
        "s48-undeletable-secret", {"secret": secret})

    def refused(*args, **kwargs):
        raise PermissionError(f"delete refused for secret={secret}")
    with throttled_marker, mock.patch.object(writer.fs, "rm_file", refused), \
            pytest.raises(RemoteTierError, match="throttled"):
        writer.write(SegmentId("shf-1", 1, 0, 0), PAYLOAD)
    warnings = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert warnings and all(secret not in w and "secret=***" in w for w in warnings)
    writer.remove_shuffle_data("shf-1")


def test_a_failed_remote_write_on_a_non_atomic_store_leaves_no_temporary_object(
        monkeypatch):
    """Stores without atomic PUTs (sftp, HDFS, WebDAV) are written under a temporary name
    and moved into place; a failed move left the temporary object (one name shared by all
    writers of the segment), which nothing removed until the shuffle's release."""
    root = f"memory://s47-inprogress-{os.getpid()}/sh"
    tier = RemoteTier(MiB, root, "job-1")
    tier._atomic_put = False

    def failing_move(*args, **kwargs):
        raise TimeoutError("the move timed out")
    monkeypatch.setattr(tier.fs, "mv", failing_move)  # (fsspec shares the instance)
    with pytest.raises(RemoteTierError, match="the move timed out"):
        tier.write(SegmentId("shf-1", 0, 0, 0), PAYLOAD)
    bucket = root.split("://")[1].split("/")[0]
    assert [p for p in tier.fs.find(bucket) if ".inprogress" in p] == []


def test_remote_delete_outside_the_job_dir_is_refused(tmp_path):
    outside = victim(tmp_path / "remote" / "other-job")
    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1")
    forged = SegmentMeta(SegmentId("shf-1", 0, 0, 0), TierName.REMOTE, 9, 1, "",
                         f"{tmp_path}/remote/job-1/../other-job/precious.txt")
    with pytest.raises(UnsafePathError, match="outside hybrid_ray's job directory"):
        tier.delete(forged)
    assert_intact(outside)


def test_remote_delete_of_another_shuffle_s_object_or_a_non_segment_is_refused(tmp_path):
    """Remote deletes were confined to the job directory only: a location naming another
    shuffle's object, or any object under the job directory (which hybrid_ray does not
    own alone), was deleted for a segment of this shuffle. Only this shuffle's segment
    objects (<shuffle>/sub-NNNNN/<file>) may go."""
    job = tmp_path / "remote" / "job-1"
    other_shuffle = victim(job / "shf-2" / "sub-00000")
    beside = victim(job / "shf-1")
    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1")
    for location, match in [
            (f"{job}/shf-2/sub-00000/precious.txt", "outside hybrid_ray's job directory"),
            (f"{job}/shf-1/precious.txt", "not a segment object of shuffle shf-1"),
            (f"{job}/shf-1/sub-00000/../precious.txt", "not a segment object of shuffle")]:
        forged = SegmentMeta(SegmentId("shf-1", 0, 0, 0), TierName.REMOTE, 9, 1, "", location)
        with pytest.raises(UnsafePathError, match=match):
            tier.delete(forged)
    assert_intact(other_shuffle)
    assert_intact(beside)
    # A segment of the shuffle itself still goes (and only it).
    segment = SegmentId("shf-1", 0, 0, 0)
    kept = tier.write(SegmentId("shf-1", 0, 0, 1), PAYLOAD)
    meta = tier.write(segment, PAYLOAD)
    assert meta.location == tier.segment_path(segment) and os.path.exists(meta.location)
    tier.delete(SegmentMeta(segment, TierName.REMOTE, 9, 1, "", tier.segment_path(segment)))
    assert not os.path.exists(meta.location) and not tier.has(segment)
    assert os.path.exists(kept.location)


# ---- unsafe spill dirs (item 3) ---------------------------------------------------------------
def test_symlinked_data_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    precious = victim(target)
    (tmp_path / "spill").mkdir()
    os.symlink(target, tmp_path / "spill" / "hybrid_ray")
    with pytest.raises(SpillDirError, match="is a symlink") as info:
        DiskTier(MiB, [str(tmp_path / "spill")])
    assert str(tmp_path / "spill" / "hybrid_ray") in str(info.value)
    # The fix, and that it is for a directory of hybrid_ray's files only: in a spill dir
    # like ~ a directory of that name may be the user's own.
    assert "holds only hybrid_ray's spill files" in str(info.value)
    assert "remove it and hybrid_ray recreates it; otherwise use another spill dir" in \
        str(info.value)
    assert_intact(precious)


def test_data_dir_open_to_others_is_refused(tmp_path):
    (tmp_path / "spill" / "hybrid_ray").mkdir(parents=True)
    os.chmod(tmp_path / "spill" / "hybrid_ray", 0o755)
    with pytest.raises(SpillDirError, match="mode 755.*must be 0700"):
        DiskTier(MiB, [str(tmp_path / "spill")])


@needs_root
def test_data_dir_owned_by_another_user_is_refused(tmp_path):
    (tmp_path / "spill" / "hybrid_ray").mkdir(parents=True, mode=0o700)
    os.chown(tmp_path / "spill" / "hybrid_ray", OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match=f"owned by uid {OTHER_UID}"):
        DiskTier(MiB, [str(tmp_path / "spill")])


@needs_root
def test_spill_dir_owned_by_another_user_is_refused(tmp_path):
    (tmp_path / "spill").mkdir()
    os.chown(tmp_path / "spill", OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match=f"is owned by uid {OTHER_UID}"):
        DiskTier(MiB, [str(tmp_path / "spill")])
    assert not (tmp_path / "spill" / "hybrid_ray").exists()


@needs_root
def test_spill_dir_symlink_of_another_user_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "spill")
    os.lchown(tmp_path / "spill", OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match="is a symlink owned by uid"):
        DiskTier(MiB, [str(tmp_path / "spill")])
    assert not (tmp_path / "real" / "hybrid_ray").exists()


def test_a_disk_tier_refuses_a_single_path_or_relative_spill_dirs(tmp_path, monkeypatch):
    """ShuffleConfig checks spill_dirs, but a DiskTier built directly did not: a single
    path (a string) became one spill dir per character ("/" among them, so a root process
    created /hybrid_ray), and a relative dir was created below the working directory,
    where every deletion of its segments was then refused (they are not absolute paths)."""
    from hybrid_ray.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="a single path 'spill'.*spill_dirs=\\['spill'\\]"):
        DiskTier(MiB, "spill")
    with pytest.raises(ConfigError, match="'rel/spill' is relative"):
        DiskTier(MiB, [str(tmp_path / "abs"), "rel/spill"])
    assert os.listdir(tmp_path) == []  # nothing created, in the working directory or else


@pytest.mark.parametrize("spelling", ["{d}//spill", "{d}/spill/../spill", "{d}/./spill/"])
def test_a_disk_tier_over_a_non_normal_spill_dir_deletes_what_it_wrote(tmp_path, spelling):
    """A DiskTier built directly over an absolute but non-normal spill dir ('/mnt//spill',
    '/mnt/x/../spill') wrote segments at locations spelt that way, and every deletion of
    them was then refused as "not a hybrid_ray segment file" (deletions take normal
    locations only): the files stayed until the shuffle's release (found by a review)."""
    from hybrid_ray.segment import encode_segment

    tier = DiskTier(MiB, [spelling.format(d=tmp_path)])
    segment = SegmentId("shf-1", 0, 0, 0)
    meta = tier.write(segment, bytes(encode_segment(pa.table({"x": [1]}), segment)))
    assert meta.location == os.path.join(str(tmp_path), "spill", "hybrid_ray", "shf-1",
                                         "sub-00000", segment.file_name)
    tier.delete(meta)  # refused before
    assert not os.path.exists(meta.location)
    tier.remove_shuffle_data("shf-1")
    assert os.listdir(tmp_path / "spill" / "hybrid_ray") == []

def test_own_symlink_to_a_spill_dir_and_a_sticky_shared_dir_are_fine(tmp_path):
    (tmp_path / "nvme").mkdir()
    os.symlink(tmp_path / "nvme", tmp_path / "spill")
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o1777)  # like /tmp
    tier = DiskTier(MiB, [str(tmp_path / "spill"), str(tmp_path / "shared")])
    for d in ("nvme", "shared"):
        assert stat.S_IMODE(os.lstat(tmp_path / d / "hybrid_ray").st_mode) == 0o700
    assert tier.try_reserve("shf-1", MiB) is not None


def test_world_writable_spill_dir_without_sticky_bit_is_refused(tmp_path):
    (tmp_path / "spill").mkdir()
    os.chmod(tmp_path / "spill", 0o777)
    with pytest.raises(SpillDirError, match="world-writable without the sticky bit") as info:
        DiskTier(MiB, [str(tmp_path / "spill")])
    assert "chmod" in str(info.value)


def test_a_group_writable_spill_dir_is_refused_when_its_group_has_others(tmp_path,
                                                                        monkeypatch):
    """A 0770/0775 spill dir passed: any other member of its group could rename the
    data dir away and put a symlink to a directory of theirs in its place (review of
    2026-11-27). Refused when the group has anyone besides the owner; a private group
    (one per user, group-writable through umask 002) is fine."""
    import collections
    import grp
    import pwd

    spill = tmp_path / "spill"
    spill.mkdir()
    os.chmod(spill, 0o775)
    st = os.stat(spill)
    Group = collections.namedtuple("Group", "gr_name gr_gid gr_mem")
    User = collections.namedtuple("User", "pw_name pw_uid pw_gid")
    owner = User("owner", st.st_uid, st.st_gid)
    members: list[str] = []
    users = [owner, User("elsewhere", st.st_uid + 1, st.st_gid + 1)]
    monkeypatch.setattr(grp, "getgrgid", lambda gid: Group("team", gid, members))
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: owner)
    monkeypatch.setattr(pwd, "getpwall", lambda: users)
    DiskTier(MiB, [str(spill)])  # a private group: accepted
    members.append("mallory")
    with pytest.raises(SpillDirError, match=r"group-writable without the sticky bit \(mode "
                                            r"775\) and its group has other members "
                                            r"\(mallory\).*chmod g-w"):
        DiskTier(MiB, [str(spill)])
    members.clear()
    users.append(User("bob", st.st_uid + 2, st.st_gid))  # bob's primary group
    with pytest.raises(SpillDirError, match=r"other members \(bob\)"):
        DiskTier(MiB, [str(spill)])
    os.chmod(spill, 0o1775)  # sticky: nobody can rename what is not theirs
    DiskTier(MiB, [str(spill)])

    def unknown(gid):
        raise KeyError(gid)

    os.chmod(spill, 0o770)
    monkeypatch.setattr(grp, "getgrgid", unknown)
    with pytest.raises(SpillDirError, match=rf"other members \(gid {st.st_gid}, unknown "):
        DiskTier(MiB, [str(spill)])


def test_a_spill_dir_below_a_directory_anyone_can_change_is_refused_before_any_write(
        tmp_path):
    """Only the spill dir itself was checked: below a 0777 directory without the sticky
    bit, anyone could rename the spill dir away and put a symlink to a victim's directory
    in its place between a removal's path check and its deletion, and the removal then
    deleted the victim's files (a review reproduced it). Refused up front now, for every
    directory above the spill dir."""
    shared = tmp_path / "shared"
    (shared / "deeper").mkdir(parents=True)
    os.chmod(shared, 0o777)
    spill = shared / "deeper" / "spill"
    with pytest.raises(SpillDirError, match=rf"{spill} is inside {shared}, which is "
                                            r"world-writable without the sticky bit \(mode "
                                            r"777\), so anyone can replace the spill dir.*"
                                            rf"chmod o-w {shared}"):
        DiskTier(MiB, [str(spill)])
    assert not spill.exists()
    assert unsafe_spill_dir(str(shared / "deeper")) is not None  # `hybrid-ray cleanup` too
    os.chmod(shared, 0o1777)  # sticky, like /tmp: nobody renames what is not theirs
    DiskTier(MiB, [str(spill)])
    assert stat.S_IMODE(os.lstat(spill / "hybrid_ray").st_mode) == 0o700


@needs_root
def test_a_spill_dir_below_another_user_s_directory_or_symlink_is_refused(tmp_path):
    (tmp_path / "theirs" / "mine").mkdir(parents=True)
    os.chown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match=rf"is inside {tmp_path / 'theirs'}, owned by "
                                            rf"uid {OTHER_UID}"):
        DiskTier(MiB, [str(tmp_path / "theirs" / "mine" / "spill")])
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "via")
    os.lchown(tmp_path / "via", OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match=rf"is reached through {tmp_path / 'via'}, a "
                                            rf"symlink owned by uid {OTHER_UID}"):
        DiskTier(MiB, [str(tmp_path / "via" / "spill")])
    assert os.listdir(tmp_path / "real") == []


def _set_acl(path, entries):
    """Set a POSIX access ACL through its xattr (no setfacl needed): (tag, perm, id)."""
    import struct

    os.setxattr(path, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, who) for tag, perm, who in entries))


def test_a_spill_dir_another_user_may_write_through_an_acl_is_refused(tmp_path):
    """The mode of a directory with ACL entries shows their mask as its group bits: a 0770
    spill dir with ``user:<other>:rwx`` of the owner's own group looked private."""
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    no_id = 0xFFFFFFFF
    owner_obj, user, group_obj, mask, other = 0x01, 0x02, 0x04, 0x10, 0x20
    try:
        _set_acl(spill, [(owner_obj, 7, no_id), (user, 7, OTHER_UID), (group_obj, 0, no_id),
                         (mask, 7, no_id), (other, 0, no_id)])
    except OSError as exc:
        pytest.skip(f"this filesystem takes no POSIX ACLs ({exc})")
    with pytest.raises(SpillDirError, match=rf"is writable through its ACL by uid "
                                            rf"{OTHER_UID}, so they can replace"):
        DiskTier(MiB, [str(spill)])
    # The mask takes write away: nobody else can write it.
    _set_acl(spill, [(owner_obj, 7, no_id), (user, 7, OTHER_UID), (group_obj, 0, no_id),
                     (mask, 5, no_id), (other, 0, no_id)])
    DiskTier(MiB, [str(spill)])


@needs_root
def test_default_spill_dir_created_first_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = ShuffleConfig()
    (squatted,) = cfg.spill_dirs
    assert squatted == str(tmp_path / f"hybrid_ray_spill_{os.getuid()}")
    os.mkdir(squatted, 0o777)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    with pytest.raises(SpillDirError, match="another user created it first"):
        DiskTier(MiB, cfg.spill_dirs)
    assert os.listdir(squatted) == []


def test_default_spill_dir_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (spill,) = ShuffleConfig().spill_dirs
    DiskTier(MiB, [spill])
    assert stat.S_IMODE(os.stat(spill).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(spill, "hybrid_ray")).st_mode) == 0o700


def test_data_dir_swapped_for_a_symlink_later_is_refused_at_reservation(tmp_path):
    precious = victim(tmp_path / "elsewhere")
    tier = DiskTier(MiB, [str(tmp_path / "spill")])
    os.rmdir(tmp_path / "spill" / "hybrid_ray")
    os.symlink(tmp_path / "elsewhere", tmp_path / "spill" / "hybrid_ray")
    assert tier.try_reserve("shf-1", MiB) is None
    assert "is a symlink" in tier.describe_refusal(MiB)
    assert_intact(precious)
    assert os.listdir(tmp_path / "elsewhere") == ["precious.txt"]


def test_spill_dir_that_is_a_file_fails_before_any_write(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"spill_dirs\[0\] .* exists and is not a directory"):
        ShuffleConfig(spill_dirs=[str(tmp_path / "file")])
    # The config cannot see other nodes' disks ({node_id}); their disk tier refuses it
    # when the tier manager registers the shuffle, before a map writes a segment.
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "{node_id}")])
    with pytest.raises(SpillDirError, match="is not a directory"):
        TierManager("file", 0).register_shuffle("shf-1", cfg)
    assert (tmp_path / "file").read_text() == "x"


# ---- secrets (item 14) ----------------------------------------------------------------------------
URL_KEY, URL_SECRET = "AKIAURLKEYEXAMPLE", "urlSecret/With+Slash"
OPT_SECRET, OPT_TOKEN, SESSION, ENDPOINT_PW = ("optSecretValue1", "optTokenValue2",
                                                "nestedSessionToken3", "endpointPassw0rd")
SECRETS = [URL_KEY, URL_SECRET, OPT_SECRET, OPT_TOKEN, SESSION, ENDPOINT_PW, "AKIAOPTKEY"]


def secret_options(endpoint="http://127.0.0.1:9"):
    host = endpoint.split("://", 1)[1]
    return {"endpoint_url": f"http://admin:{ENDPOINT_PW}@{host}", "key": "AKIAOPTKEY",
            "secret": OPT_SECRET, "token": OPT_TOKEN, "region_name": "eu-west-1",
            "client_kwargs": {"aws_session_token": SESSION},
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert leaked == [], f"secrets {leaked} in: {text}"


def test_config_repr_hides_credentials():
    cfg = ShuffleConfig(remote_path="s3://bucket/prefix", storage_options=secret_options())
    for text in (repr(cfg), str(cfg), repr([cfg]), f"{cfg}"):
        assert_no_secret(text)
    # What is not a secret is still shown, so the repr stays useful.
    assert "bucket/prefix" in repr(cfg) and "127.0.0.1:9" in repr(cfg)
    assert "eu-west-1" in repr(cfg) and "'key': '***'" in repr(cfg)
    assert cfg.storage_options["secret"] == OPT_SECRET  # the config itself keeps them


def test_unreachable_remote_error_hides_credentials():
    with pytest.raises(RemoteTierError, match="is not writable") as info:
        RemoteTier(MiB, f"s3://{URL_KEY}:{URL_SECRET}@bucket/x", "job-1", secret_options())
    assert_no_secret(str(info.value))
    assert_no_secret("".join(traceback.format_exception(info.value)))
    assert "endpoint_url" in str(info.value)  # still says what to check


def test_remote_errors_on_io_hide_credentials(tmp_path, monkeypatch):
    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1",
                      {"auto_mkdir": True, "password": OPT_SECRET})

    def leaky(path, *a, **kw):
        raise OSError(f"backend said: bad signature for password {OPT_SECRET}")

    monkeypatch.setattr(tier.fs, "pipe_file", leaky)
    with pytest.raises(RemoteTierError, match="backend said") as info:
        tier.write(SegmentId("shf-1", 0, 0, 0), PAYLOAD)
    assert_no_secret("".join(traceback.format_exception(info.value)))


def _late_jvm_write(tmp_path, released: bool):
    """(a stand-in tier manager whose shuffle ``shf-1`` was released or not, the finished
    future of a JVM remote write that landed after ``write_remote`` gave up on it): the
    arguments ``spark_jvm._drop_late_write`` gets besides the tier and the shuffle id."""
    import concurrent.futures

    class TierManagerStandIn:
        @staticmethod
        def was_released(shuffle_id: str) -> bool:
            return released

    landed: concurrent.futures.Future[str] = concurrent.futures.Future()
    landed.set_result(f"{tmp_path}/remote/job-1/shf-1/sub-00000/x.seg")
    return TierManagerStandIn(), landed


def test_a_late_jvm_write_s_failed_removal_logs_no_credentials(tmp_path, monkeypatch, caplog):
    """A JVM remote write that landed after ``write_remote`` gave up is removed in the
    background; its failure was logged with the raw library exception and its traceback
    (``exc_info``), and s3fs/botocore quote the endpoint URL whole ('Could not connect to
    the endpoint URL: "http://user:pass@host/..."') (found by a review)."""
    import logging

    from hybrid_ray.spark_jvm import _drop_late_write

    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1",
                      {"auto_mkdir": True, "password": OPT_SECRET}, check_reachable=False)

    def leaky(path, *a, **kw):
        raise OSError(f"backend said: bad signature for password {OPT_SECRET}")

    monkeypatch.setattr(tier.fs, "rm_file", leaky)
    tier_manager, landed = _late_jvm_write(tmp_path, released=True)
    with caplog.at_level(logging.WARNING, logger="hybrid_ray.spark_jvm"):
        _drop_late_write(tier_manager, tier, "shf-1", landed)
    assert "backend said" in caplog.text  # the failure is still said
    assert_no_secret(caplog.text)


def test_a_late_jvm_write_is_removed_within_the_tier_s_call_deadline(tmp_path, monkeypatch):
    """The removal of a JVM write that landed late ran without the per-call deadline every
    other remote call has (an endpoint that never answers held a transfer thread)."""
    from hybrid_ray.spark_jvm import _drop_late_write

    tier = RemoteTier(MiB, f"file://{tmp_path}/remote", "job-1", check_reachable=False)
    monkeypatch.setattr(tier, "deadline", lambda nbytes=0: {"timeout": 7.0})
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(tier.fs, "rm_file", lambda path, **kw: calls.append((path, kw)))
    tier_manager, landed = _late_jvm_write(tmp_path, released=False)
    _drop_late_write(tier_manager, tier, "shf-1", landed)
    assert calls == [(f"{tmp_path}/remote/job-1/shf-1/sub-00000/x.seg", {"timeout": 7.0})]


def test_bad_remote_path_message_hides_credentials():
    with pytest.raises(ConfigError, match="knows no protocol") as info:
        ShuffleConfig(remote_path=f"nosuch://bucket/x?sig={URL_SECRET}")
    assert_no_secret(str(info.value))


@pytest.mark.parametrize("url", [
    f"s3://{URL_KEY}:{URL_SECRET}@bucket/prefix", f"s3a://{URL_KEY}@bucket/x",
    f"gs://{URL_KEY}:{URL_SECRET}@bucket", f"abfs://{URL_KEY}:{URL_SECRET}@account/c"])
def test_credentials_in_the_remote_url_are_refused_without_showing_them(url):
    """s3fs took ``KEY:SECRET@bucket`` for a bucket name: the config was accepted, every
    write failed, and the storage's errors quoted the secret."""
    with pytest.raises(ConfigError, match="fsspec does not read credentials from the URL")\
            as info:
        ShuffleConfig(remote_path=url)
    assert_no_secret(str(info.value))
    assert "storage_options" in str(info.value)


def test_a_password_holding_a_question_mark_is_refused_and_never_shown():
    """A '?' inside the user:password part hid it from the rule (the URL was cut at the
    query first) and from redaction (whose user part stopped at '?'): the key id and the
    start of the secret were shown in reprs and messages (found by a review)."""
    from hybrid_ray.redaction import Redactor, redact_url

    url = "s3://AKIAIOSFODNN7EXAMPLE:wJalr?XUtnFEMI@bucket/prefix"
    with pytest.raises(ConfigError, match="carries credentials") as info:
        ShuffleConfig(remote_path=url)
    for text in (str(info.value), redact_url(url),
                 Redactor(url).scrub(f"writing failed at {url}")):
        assert "AKIAIOSFODNN7EXAMPLE" not in text and "wJalr" not in text, text
    assert redact_url("https://bob:hunt?er2@host/x") == "https://***@host/x"
    assert redact_url("s3://bucket/pre@fix") == "s3://bucket/pre@fix"  # a key, not a user
    assert redact_url("file:///home/me@corp/x") == "file:///home/me@corp/x"


def test_a_passphrase_option_is_a_credential():
    """paramiko/sftp's ``passphrase`` was printed by the config's repr: the secret words
    named 'password' and 'passwd' only (found by a review)."""
    cfg = ShuffleConfig(storage_options={"passphrase": "correct-horse-battery", "pwd": "x1",
                                         "region_name": "eu-west-1"})
    assert "correct-horse-battery" not in repr(cfg) and "'pwd': '***'" in repr(cfg)
    assert "eu-west-1" in repr(cfg)


def test_azure_container_at_account_is_not_taken_for_credentials():
    from hybrid_ray.config import credentials_in_url_problem

    assert credentials_in_url_problem("abfs", "container@account.dfs.core.windows.net/p") \
        == ""
    assert credentials_in_url_problem("s3", "bucket/pre@fix") == ""
    assert credentials_in_url_problem("s3", "bucket/a:b@c") == ""
    assert credentials_in_url_problem("s3", "KEY@bucket/p") != ""


def test_public_entry_point_error_hides_credentials(tmp_path, ray_local):
    import hybrid_ray

    ds = ray_local.data.from_arrow(pa.table({"key": list(range(10))}))
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], progress=False,
                        remote_path="s3://bucket/x", storage_options=secret_options())
    with pytest.raises(RemoteTierError) as info:
        hybrid_ray.repartition(ds, 2, keys=["key"], config=cfg)
    assert_no_secret("".join(traceback.format_exception(info.value)))


def test_redaction_rule():
    from hybrid_ray.redaction import Redactor, redact_url, redacted_options

    assert redact_url("s3://k:s@bucket/p") == "s3://***@bucket/p"
    assert redact_url("https://acct.blob/c?sv=1&sig=abcd") == "https://acct.blob/c?***"
    assert redact_url("s3://bucket/p") == "s3://bucket/p"
    assert redacted_options({"endpoint_url": "http://u:p@h:1", "anon": False,
                             "SecretAccessKey": "x", "sas_token": "y", "profile": "dev"}) \
        == {"endpoint_url": "http://***@h:1", "anon": False, "SecretAccessKey": "***",
            "sas_token": "***", "profile": "dev"}
    scrub = Redactor(f"s3://{URL_KEY}:{URL_SECRET}@b", {"secret": OPT_SECRET}).scrub
    assert scrub(f"{URL_KEY}:{URL_SECRET}@b/x {OPT_SECRET}") == "***@b/x ***"
    # An "@" in a local path is not a credential: messages keep their paths.
    assert Redactor("file:///home/me@corp/x").scrub("/home/me/y") == "/home/me/y"
    assert Redactor(None, {"secret": "ab"}).scrub("a b ab") == "a b ab"  # too short to scrub


def test_connection_strings_and_passwords_with_an_at_sign_are_hidden():
    """adlfs's connection_string (AccountKey=...) matched no secret word and was printed
    whole by the config's repr; a password holding an "@" was cut at it, showing its
    rest (urllib and fsspec read the user part up to the last "@")."""
    from hybrid_ray.redaction import Redactor, redact_url

    connection = ("DefaultEndpointsProtocol=https;AccountName=acct;"
                  "AccountKey=c2VjcmV0LWtleS0xMjM0NTY3OA==;EndpointSuffix=core.windows.net")
    cfg = ShuffleConfig(remote_path="s3://container/prefix",
                        storage_options={"connection_string": connection,
                                         "extra": {"sas": "sv=2024&sig=SIGNATURE123456"}})
    assert "c2VjcmV0" not in repr(cfg) and "SIGNATURE123456" not in repr(cfg)
    assert "container/prefix" in repr(cfg)
    assert redact_url("sftp://user:p@ssw0rd@host/x") == "sftp://***@host/x"
    scrub = Redactor("sftp://user:p@ssw0rd@host/x", cfg.storage_options).scrub
    assert scrub("login p@ssw0rd failed; key c2VjcmV0LWtleS0xMjM0NTY3OA== sig "
                 "sv=2024&sig=SIGNATURE123456") == "login *** failed; key *** sig ***"



@pytest.mark.parametrize("url", [
    f"simplecache::s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x",  # fsspec's URL chaining
    f"s3//AKIAEXAMPLE:{URL_SECRET}@bucket/x",  # a typo: no ":"
    f" s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x",  # pasted with a leading space
    f"s3_x://AKIAEXAMPLE:{URL_SECRET}@bucket/x",  # no protocol of that name
    f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x".encode()])  # bytes
def test_a_remote_path_that_is_refused_is_never_quoted_with_its_secret(url, tmp_path, capsys):
    """Was: the redaction knew only well-formed URLs and returned anything else whole, so
    the errors refusing exactly these quoted key and secret (and `hybrid-ray cleanup`
    printed them)."""
    from hybrid_ray.cli import main
    from hybrid_ray.redaction import Redactor, redact_url

    with pytest.raises(ConfigError) as info:
        ShuffleConfig(remote_path=url)
    assert URL_SECRET not in str(info.value) and "***@bucket/x" in str(info.value)
    text = url.decode() if isinstance(url, bytes) else url
    assert URL_SECRET not in redact_url(url)
    assert Redactor(text).scrub(f"cannot open {text}") == f"cannot open {redact_url(text)}"
    if isinstance(url, str):
        assert main(["cleanup", "--no-cluster", "--spill-dir", str(tmp_path),
                     "--remote-path", url]) == 2
        assert URL_SECRET not in capsys.readouterr().err
    # A key holding "@" in a well-formed URL, and a local path, stay as they are.
    assert redact_url("s3://bucket/pre@fix") == "s3://bucket/pre@fix"
    assert redact_url("/home/me@corp/x") == "/home/me@corp/x"

def test_tier_manager_serves_only_files_inside_its_own_data_dirs(tmp_path):
    """A reader on another node (Python or a Spark JVM) names the file to serve. A
    segment-shaped path outside this node's spill dirs, or a symlink in the data dir
    pointing out of it, is refused; before, only the path's shape was checked."""
    tm = TierManager("node-a", 0)
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")])
    tm.register_shuffle("shf-1", cfg)
    elsewhere = victim(tmp_path / "other" / "hybrid_ray" / "shf-1" / "sub-00000")
    shaped = SegmentMeta(SegmentId("shf-1", 0, 0, 0), TierName.DISK, 9, 1, "node-a", elsewhere)
    with pytest.raises(UnsafePathError, match="not inside the data dir"):
        tm.read_disk_segment(shaped)
    with pytest.raises(UnsafePathError, match="not inside the data dir"):
        tm.require_own_segment_file(elsewhere, "serve")
    inside_dir = tmp_path / "spill" / "hybrid_ray" / "shf-1" / "sub-00000"
    inside_dir.mkdir(parents=True)
    link = inside_dir / "m00000-a0000-s00000.seg"
    link.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="not inside the data dir"):
        tm.require_own_segment_file(str(link), "serve")
    real = inside_dir / "m00001-a0000-s00000.seg"
    real.write_bytes(b"x")
    assert tm.require_own_segment_file(str(real), "serve") == str(real)


def test_realpath_cached_resolves_as_realpath_does(tmp_path):
    """The batch deletion resolves each directory once (``realpath_cached``): it must
    give ``os.path.realpath``'s answer for a symlinked directory, a symlinked file and a
    file that does not exist, and keep the directory in the caller's cache."""
    from hybrid_ray.ids import realpath_cached

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f.seg").write_bytes(b"x")
    (tmp_path / "linkdir").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "link.seg").symlink_to(tmp_path / "outside.txt")
    cache: dict[str, str] = {}
    for path in (tmp_path / "linkdir" / "f.seg", tmp_path / "linkdir" / "link.seg",
                 tmp_path / "linkdir" / "missing.seg", tmp_path / "real" / "f.seg"):
        assert realpath_cached(str(path), cache) == os.path.realpath(path), path
    assert cache[str(tmp_path / "linkdir")] == str(tmp_path / "real")


def test_batch_deletion_through_a_symlinked_subpartition_dir_touches_nothing_outside(
        tmp_path):
    """free_segments checks a batch of files with each directory resolved once: files in a
    subpartition directory swapped for a symlink to elsewhere are all refused (the user's
    files stay), those in a real one of the same batch are deleted."""
    tm = TierManager("node-a", 0)
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")])
    tm.register_shuffle("shf-1", cfg)
    shuffle_dir = tmp_path / "spill" / "hybrid_ray" / "shf-1"
    real_dir = shuffle_dir / "sub-00001"
    real_dir.mkdir(parents=True)
    outside = tmp_path / "user"
    kept = [victim(outside)]
    (shuffle_dir / "sub-00000").symlink_to(outside)
    metas = []
    for m in range(2):
        name = f"m{m:05d}-a0000-s00000.seg"
        (outside / name).write_bytes(b"user's")
        kept.append(str(outside / name))
        metas.append(SegmentMeta(SegmentId("shf-1", m, 0, 0), TierName.DISK, 6, 1, "node-a",
                                 str(shuffle_dir / "sub-00000" / name)))
        (real_dir / name).write_bytes(b"ours")
        metas.append(SegmentMeta(SegmentId("shf-1", m, 1, 0), TierName.DISK, 4, 1, "node-a",
                                 str(real_dir / name)))
    refused = tm.free_segments("shf-1", metas)
    assert len(refused) == 2 and all("refusing to delete" in r for r in refused)
    for name in kept:
        assert os.path.exists(name), name
    assert os.listdir(real_dir) == []


def _remote_segment(tier: RemoteTier, shuffle: str, m: int = 0) -> SegmentId:
    sid = SegmentId(shuffle, m, 0, 0, 0, tier.job_id)
    tier.write(sid, bytes(encode_segment(pa.table({"x": [1]}), sid)))
    return sid


def test_local_remote_tier_refuses_a_job_dir_others_can_write(tmp_path):
    """A file:// remote tier kept a job directory another user created first (a
    predictable job id) or could write: they swapped the shuffle directory for a symlink
    and the release removed every file behind it. Such a directory is now refused for
    writes, and the release refuses to follow a swapped shuffle directory."""
    root = tmp_path / "remote"
    (root / "job-etl").mkdir(parents=True)
    os.chmod(root / "job-etl", 0o777)
    tier = RemoteTier(MiB, f"file://{root}", "job-etl", check_reachable=False)
    with pytest.raises(UnsafePathError, match=r"job-etl is writable by other users \(mode 777\)"):
        _remote_segment(tier, "shf-a")
    assert files_under(str(root)) == []
    # A job dir of our own, then its shuffle directory swapped for a symlink.
    os.chmod(root / "job-etl", 0o700)
    _remote_segment(tier, "shf-a")
    precious = victim(tmp_path / "user")
    os.rename(root / "job-etl" / "shf-a", root / "job-etl" / "moved")
    os.symlink(tmp_path / "user", root / "job-etl" / "shf-a")
    with pytest.raises(UnsafePathError, match="shf-a is not a real directory"):
        tier.remove_shuffle_data("shf-a")
    assert_intact(precious)


def test_remote_paths_with_dot_components_are_refused_before_any_call(tmp_path):
    """delete and read_frame checked the normalised path but handed the raw one to the
    storage: 'lnk/../store/...' resolved through a symlink on a local filesystem (and
    s3fs takes 'other/../bucket/key' as bucket 'other'), reaching another user's files."""
    root = tmp_path / "remote"
    tier = RemoteTier(MiB, f"file://{root}", "job-1", check_reachable=False)
    sid = _remote_segment(tier, "shf-a")
    elsewhere = tmp_path / "elsewhere" / "store" / "job-1" / "shf-a" / "sub-00000"
    elsewhere.mkdir(parents=True)
    theirs = elsewhere / sid.file_name
    theirs.write_bytes(b"not ours")
    os.symlink(tmp_path / "elsewhere", root / "job-1" / "shf-a" / "lnk")
    forged = f"{root}/job-1/shf-a/lnk/../sub-00000/{sid.file_name}"
    meta = SegmentMeta(sid, TierName.REMOTE, 8, 1, "", forged)
    with pytest.raises(UnsafePathError, match=r"empty, '\.' or '\.\.' component"):
        tier.delete(meta)
    with pytest.raises(UnsafePathError, match=r"empty, '\.' or '\.\.' component"):
        tier.read_frame(forged, 8, "x")
    assert theirs.read_bytes() == b"not ours"


def test_cleanup_never_opens_a_marker_that_is_not_a_plain_file(tmp_path):
    """A FIFO planted as a shuffle's marker in a file:// remote blocked `hybrid-ray
    cleanup` forever (the marker was read before anything else was checked)."""
    import threading

    from hybrid_ray.cleanup import find_remote_orphans
    from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME

    shuffle_dir = tmp_path / "remote" / "job-x" / "shf-x"
    shuffle_dir.mkdir(parents=True)
    os.mkfifo(shuffle_dir / SHUFFLE_MARKER_NAME)
    result = []
    sweep = threading.Thread(target=lambda: result.append(
        find_remote_orphans(f"file://{tmp_path}/remote")), daemon=True)
    sweep.start()
    sweep.join(20)
    assert result, "cleanup blocked on a FIFO marker"
    assert result[0].candidates == []


def _literal_start(node) -> str | None:
    """The text an argument starts with when it is a literal (or an f-string's leading
    literal part); None otherwise."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values \
            and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def test_the_library_opens_no_path_written_into_its_code():
    """Every file hybrid_ray opens comes from the user's config or its own data dirs,
    never a path written into the code: a session-local profiling hook that opened
    ``/tmp/exp/...`` once from inside the shuffle master reached a commit (6872189),
    writing outside anything hybrid_ray owns. Scans every ``open(...)`` of the library."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for package in ("hybrid_ray", "spark_bridge"):
        for source in sorted((root / package).rglob("*.py")):
            tree = ast.parse(source.read_text(), str(source))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name not in ("open", "Path", "makedirs", "mkdir"):
                    continue
                start = _literal_start(node.args[0])
                if start is not None and (start.startswith("/") or start.startswith("~")):
                    offenders.append(f"{source.relative_to(root)}:{node.lineno}: {start!r}")
    assert offenders == []
