"""The tier manager of one node (plain class, no cluster): FLIP-53 memory quotas, space
given back once, released shuffles, the remote tiers it keeps open."""

from __future__ import annotations

import os

import pytest

from hybrid_ray import (
    ConfigError, MiB, SegmentId, SegmentMeta, ShuffleConfig, ShuffleNotFoundError,
    ShuffleReleasedError, TierName,
)
from hybrid_ray.tier_manager import DISK_TIERS_KEPT, REMOTE_TIERS_KEPT, TierManager


def test_memory_quotas_by_weight_never_exceed_budget(ray_local, tmp_path):
    tm = TierManager("n1", object_store_bytes=1000)
    base = ShuffleConfig(memory_fraction=0.5, spill_dirs=[str(tmp_path)])
    assert tm.register_shuffle("a", base) == 500
    tm.register_shuffle("b", base.replace(memory_weight=3.0))
    assert (tm.quota("a"), tm.quota("b")) == (125, 375)
    assert tm.reserve("a", [125])[0].grant.tier == TierName.MEMORY
    assert tm.reserve("a", [1])[0].grant.tier == TierName.DISK  # over its quota
    assert tm.reserve("b", [376])[0].grant.tier == TierName.DISK
    tm.release_shuffle("b")
    assert tm.quota("a") == 500  # quota returns when a shuffle ends
    assert tm.memory.used_bytes == 125
    tm.release_shuffle("a")
    assert tm.memory.used_bytes == 0


def test_tier_manager_gives_back_a_segment_s_space_once(tmp_path):
    """A failed attempt's segments are freed by its writer's abort and again when the
    master drops the attempt: the space must come back once, not twice."""
    tm = TierManager("n1", object_store_bytes=1000)
    tm.register_shuffle("a", ShuffleConfig(memory_fraction=0.5, spill_dirs=[str(tmp_path)]))
    grants = [p.grant for p in tm.reserve("a", [100, 100])]
    assert all(g.tier == TierName.DISK or g.tier == TierName.MEMORY for g in grants)
    tm.settle("a", [(g, 100) for g in grants])
    used = {g.tier: 0 for g in grants}
    for g in grants:
        used[g.tier] += 100
    first = SegmentMeta(SegmentId("a", 0, 0, 0, 0), grants[0].tier, 100, 1, "n1",
                        str(tmp_path / "seg0"))
    tm.free_segments("a", [first])
    tm.free_segments("a", [first])  # the master's drop of the same attempt
    tier = tm.memory if grants[0].tier == TierName.MEMORY else tm._tier("a", TierName.DISK)
    assert tier.used_by("a") == used[grants[0].tier] - 100


def test_a_released_shuffle_cannot_register_again_on_a_node(tmp_path):
    """A map that began just before its shuffle was released must not register it on its
    node's tier manager again: the registration, and its space, would stay for good."""
    tm = TierManager("n1", object_store_bytes=1000)
    cfg = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")])
    tm.register_shuffle("s", cfg)
    tm.release_shuffle("s")
    with pytest.raises(ShuffleNotFoundError, match="was released on node n1"):
        tm.register_shuffle("s", cfg)
    assert tm.usage().shuffles == ()


def test_tier_manager_closes_remote_tiers_no_registered_shuffle_uses(tmp_path):
    tm = TierManager("node-a", 0)
    configs = {f"shf-{i:03d}": ShuffleConfig(spill_dirs=[str(tmp_path / "spill")],
                                              job_id=f"job{i}",
                                              remote_path=f"file://{tmp_path}/remote")
               for i in range(REMOTE_TIERS_KEPT + 3)}
    for shuffle_id, cfg in configs.items():
        tm.register_shuffle(shuffle_id, cfg)
    # Every registered shuffle keeps its own remote tier, however many there are.
    tiers = {s: tm.remote_tier(s) for s in configs}
    assert len({id(t) for t in tiers.values()}) == len(configs)
    assert {t.job_id for t in tiers.values()} == {c.job_id for c in configs.values()}
    pools = {s: t.io_pool() for s, t in tiers.items()}  # each with transfer threads
    for shuffle_id in configs:
        tm.release_shuffle(shuffle_id)
    # The newest REMOTE_TIERS_KEPT stay open; the older ones were closed: their transfer
    # threads stopped, and they are no longer held.
    kept = list(configs)[-REMOTE_TIERS_KEPT:]
    assert sorted(id(t) for t in tm._remotes.values()) == sorted(id(tiers[s]) for s in kept)
    for shuffle_id, pool in pools.items():
        assert pool._shutdown == (shuffle_id not in kept), shuffle_id



def test_a_tier_manager_forgets_disk_tiers_no_shuffle_needs_any_more(tmp_path, monkeypatch):
    """A tier manager outlives jobs; each job with its own spill dirs (a temporary dir per
    run) opened a disk tier kept for good, and every release and status went through all
    of them. Idle ones go, oldest first, past DISK_TIERS_KEPT; never one a registered
    shuffle uses, one holding bytes, or one whose shuffle's late files may still come."""
    from hybrid_ray import tier_manager

    tm = TierManager("n1", object_store_bytes=1000)
    def config(i):
        return ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(tmp_path / f"spill{i}")])
    tm.reserve("held", [100], register=config("held"))  # registered, its bytes counted
    runs = 3 * DISK_TIERS_KEPT
    for i in range(runs):
        tm.reserve(f"s{i}", [100], register=config(i))
        tm.release_shuffle(f"s{i}")
    # Released within the late-files window: every one kept for the sweep.
    assert len(tm._disks) == runs + 1
    clock = [tier_manager.time.monotonic() + tier_manager.LATE_FILES_WINDOW_S + 1]
    monkeypatch.setattr(tier_manager.time, "monotonic", lambda: clock[0])
    tm.reserve("new", [100], register=config("new"))
    spills = {key[0][0].rsplit("/", 1)[-1] for key in tm._disks}
    assert len(tm._disks) == DISK_TIERS_KEPT
    assert {"spillheld", "spillnew"} <= spills
    # The newest idle ones stayed, the oldest went.
    assert f"spill{runs - 1}" in spills and "spill0" not in spills
    # A forgotten tier's shuffle still releases and frees through its config.
    tm.release_shuffle("s0", config=config(0))
    assert not (tmp_path / "spill0" / "hybrid_ray" / "s0").exists()
    assert tm.usage().shuffles == ("held", "new")
    disk_bytes = sorted(t.used_bytes for t in tm.usage().tiers if t.tier == TierName.DISK)
    assert disk_bytes == [0] * (DISK_TIERS_KEPT - 2) + [100, 100]

def test_a_reservation_registers_the_shuffle_it_carries_the_config_of(tmp_path):
    """A map's first reservation carries its shuffle's config: one call instead of a
    registration and a reservation. Without it, an unknown or released shuffle gets a
    ShuffleNotFoundError naming it and the node, not a KeyError."""
    tm = TierManager("n1", object_store_bytes=1000)
    cfg = ShuffleConfig(memory_fraction=0.5, spill_dirs=[str(tmp_path)])
    with pytest.raises(ShuffleNotFoundError,
                       match="shuffle 'a' is not registered on node n1: reserve space with"):
        tm.reserve("a", [10])
    [placement] = tm.reserve("a", [10], register=cfg)
    assert placement.grant.tier == TierName.MEMORY and tm.usage().shuffles == ("a",)
    assert tm.reserve("a", [10], register=cfg)[0].grant is not None  # again: a no-op
    tm.release_shuffle("a")
    with pytest.raises(ShuffleReleasedError, match="'a' was released on node n1"):
        tm.reserve("a", [10])
    with pytest.raises(ShuffleReleasedError, match="'a' was released on node n1"):
        tm.reserve("a", [10], register=cfg)


def test_a_late_writer_s_files_go_with_its_abort_directory_and_marker_too(tmp_path):
    """A map that reserved space before its shuffle was released and wrote after the
    release creates the shuffle's directory and marker again; its abort (freeing its
    segments) must leave nothing of the shuffle on the node."""
    from hybrid_ray.tiers.disk import DiskTier

    spill = tmp_path / "spill"
    tm = TierManager("n1", object_store_bytes=1000)
    cfg = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(spill)])
    grant = tm.reserve("s", [100], register=cfg)[0].grant
    assert grant.tier == TierName.DISK
    tm.release_shuffle("s")
    # The writer's own disk tier (another process) writes the granted segment now.
    writer_disk = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    meta = writer_disk.write(SegmentId("s", 0, 0, 0, 0), b"x" * 100, grant)
    assert [p.name for p in spill.rglob("*") if p.is_file()] != []
    tm.free_segments("s", [meta])
    assert [str(p) for p in spill.rglob("*") if p.is_file()] == []
    assert not (spill / "hybrid_ray" / "s").exists()


def test_files_a_killed_late_writer_left_go_with_the_next_sweep(tmp_path, monkeypatch):
    """A writer killed after writing, past its shuffle's release, never aborts: the node's
    periodic sweep (``remove_late_files``) removes the shuffle's directory again while the
    release is recent, and touches nothing else in the spill dir."""
    from hybrid_ray import tier_manager
    from hybrid_ray.tiers.disk import DiskTier

    spill = tmp_path / "spill"
    tm = TierManager("n1", object_store_bytes=1000)
    cfg = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(spill)])
    grant = tm.reserve("s", [100], register=cfg)[0].grant
    tm.reserve("t", [100], register=cfg)  # a live shuffle: left alone
    tm.release_shuffle("s")
    writer_disk = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    writer_disk.write(SegmentId("s", 0, 0, 0, 0), b"x" * 100, grant)  # then killed
    other = writer_disk.write(SegmentId("t", 0, 0, 0, 0), b"y" * 100,
                              tm.reserve("t", [100])[0].grant)
    assert tm.remove_late_files() == ["s"]
    assert [p for p in spill.rglob("*") if p.is_file() and "/s/" in str(p)] == []
    assert (spill / "hybrid_ray" / "t").is_dir() and os.path.exists(other.location)
    assert tm.remove_late_files() == []
    # Past the window, a release is not looked at again.
    writer_disk.write(SegmentId("s", 0, 0, 1, 0), b"x" * 100, grant)
    clock = [tier_manager.time.monotonic() + tier_manager.LATE_FILES_WINDOW_S + 1]
    monkeypatch.setattr(tier_manager.time, "monotonic", lambda: clock[0])
    assert tm.remove_late_files() == []


def test_a_delete_never_reaches_a_file_outside_the_shuffle_s_own_directories(tmp_path):
    """A segment location comes from another process (the master's books, a JVM commit).
    One shaped like ours but elsewhere on the node, or one of another shuffle, is refused
    (counted, shown by ``hybrid-ray status``) and its file stays; the shuffle's own
    segments in the same call are deleted."""
    from hybrid_ray.tiers.disk import DiskTier

    spill = tmp_path / "spill"
    tm = TierManager("n1", object_store_bytes=1000)
    cfg = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(spill)])
    grants = [p.grant for p in tm.reserve("s", [100, 100], register=cfg)]
    tm.reserve("t", [100], register=cfg)
    writer = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    own = writer.write(SegmentId("s", 0, 0, 0, 0), b"x" * 100, grants[0])
    other_shuffle = writer.write(SegmentId("t", 0, 0, 0, 0), b"y" * 100, grants[1])
    # Shaped like a segment file of "s", but not in any spill dir of this node.
    stranger = tmp_path / "user" / "hybrid_ray" / "s" / "sub-00000" / "m000000-a000-s000001.seg"
    stranger.parent.mkdir(parents=True)
    stranger.write_bytes(b"a user's file")
    metas = [own,
             SegmentMeta(SegmentId("s", 0, 0, 1, 0), TierName.DISK, 100, 1, "n1", str(stranger)),
             SegmentMeta(SegmentId("s", 0, 1, 0, 0), TierName.DISK, 100, 1, "n1",
                         other_shuffle.location)]
    refused = tm.free_segments("s", metas)
    assert len(refused) == 2 and "neither inside the data dir" in refused[0]
    assert "names another shuffle" in refused[1]
    assert (tm.usage().refused_deletions, tm.usage().last_refused_deletion) == (2, refused[1])
    assert not os.path.exists(own.location)
    assert stranger.read_bytes() == b"a user's file"
    assert os.path.exists(other_shuffle.location)


def test_a_restarted_tier_manager_deletes_only_files_in_marked_shuffle_directories(tmp_path):
    """A tier manager started again knows no spill dir yet: it deletes a segment whose
    shuffle directory carries hybrid_ray's marker for that shuffle (a Python writer's, or
    a JVM writer's, marked when its disk reservation was granted), also through a
    symlinked spill dir; nothing else."""
    from hybrid_ray.spark_jvm import reserve
    from hybrid_ray.tiers.disk import DiskTier

    real = tmp_path / "real-spill"
    real.mkdir()
    linked = tmp_path / "spill"
    linked.symlink_to(real)  # spill dirs may be symlinks (check_spill_dir allows them)
    cfg = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(linked)])
    writer = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    meta = writer.write(SegmentId("s", 0, 0, 0, 0), b"x" * 100)
    # A JVM writer's file: the tier manager granting its reservation marked the directory.
    granting = TierManager("n1", object_store_bytes=1000)
    [placement] = reserve(granting, {"shuffle": "j", "sizes": [100], "config": {"session_token": "t"}},
                          {"t": cfg}.get)["placements"]
    assert placement["tier"] == "disk"
    jvm_file = linked / "hybrid_ray" / "j" / "sub-00000" / "m000000-a000-s000000.seg"
    jvm_file.parent.mkdir()
    jvm_file.write_bytes(b"y" * 100)
    unmarked = tmp_path / "elsewhere" / "hybrid_ray" / "s" / "sub-00000" / meta.id.file_name
    unmarked.parent.mkdir(parents=True)
    unmarked.write_bytes(b"not ours")
    restarted = TierManager("n1", object_store_bytes=1000)
    assert restarted.free_segments("s", [meta]) == []
    assert not os.path.exists(meta.location)
    assert restarted.free_segments("j", [SegmentMeta(SegmentId("j", 0, 0, 0, 0),
                                                     TierName.DISK, 100, 1, "n1",
                                                     str(jvm_file))]) == []
    assert not jvm_file.exists()
    [refusal] = restarted.free_segments("s", [SegmentMeta(meta.id, TierName.DISK, 100, 1,
                                                          "n1", str(unmarked))])
    assert "neither inside the data dir" in refusal
    assert unmarked.read_bytes() == b"not ours"


def test_a_release_that_cannot_remove_a_file_says_so_and_keeps_the_marker(tmp_path,
                                                                          monkeypatch):
    """A segment file that cannot be unlinked (EBUSY, EIO) must fail the release, so the
    master retries it, and leave the shuffle's marker, so `hybrid-ray cleanup` still knows
    the directory as ours. It was dropped silently: the marker went first, the file
    stayed, and nothing would ever remove it."""
    from hybrid_ray import cleanup
    from hybrid_ray.tiers.disk import read_shuffle_marker, shuffle_dir

    spill = str(tmp_path / "spill")
    tm = TierManager("n1", 0)
    tm.register_shuffle("shf-1", ShuffleConfig(spill_dirs=[spill], memory_capacity_bytes=0))
    assert tm.reserve("shf-1", [100])[0].grant.tier == TierName.DISK
    path, real_unlink = _busy_segment_file_of_shf_1(spill, monkeypatch)
    with pytest.raises(OSError, match=r"removing shuffle shf-1 from the disk tier left \d+ "
                                      r"path\(s\): .*Device or resource busy"):
        tm.release_shuffle("shf-1")
    assert os.path.exists(path)
    assert read_shuffle_marker(shuffle_dir(spill, "shf-1")) is not None
    assert [c.shuffle_id for c in cleanup.find_spill_orphans([spill]).candidates] == ["shf-1"]
    with pytest.raises(OSError, match="Device or resource busy"):
        tm.remove_late_files()  # the sweep tries again, and says why it could not
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert tm.remove_late_files() == ["shf-1"]
    assert not os.path.exists(shuffle_dir(spill, "shf-1"))
    tm.release_shuffle("shf-1")  # the master's retry: nothing left, no error


def test_a_deletion_that_failed_before_freeing_its_bytes_is_done_again(tmp_path, monkeypatch):
    """A segment was marked freed before its tier freed its bytes: a deletion that raised
    in between was skipped as done by the master's retry, and the bytes stayed counted
    until the shuffle's release."""
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("a", ShuffleConfig(memory_capacity_bytes=0, spill_dirs=[str(tmp_path)]))
    [placement] = tm.reserve("a", [100])
    disk = tm._tier("a", TierName.DISK)
    tm.settle("a", [(placement.grant, 100)])
    meta = SegmentMeta(SegmentId("a", 0, 0, 0, 0), TierName.DISK, 100, 1, "n1",
                       os.path.join(str(tmp_path), "hybrid_ray", "a", "sub-00000", "x.seg"))
    real_free, calls = disk.free, []

    def fails_once(shuffle_id, nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise OSError("injected: the tier failed mid-deletion")
        return real_free(shuffle_id, nbytes)
    monkeypatch.setattr(disk, "free", fails_once)
    with pytest.raises(OSError, match="injected"):
        tm.free_segments("a", [meta])
    assert disk.used_by("a") == 100
    tm.free_segments("a", [meta])  # the master's retry
    assert disk.used_by("a") == 0


def test_a_reservation_refuses_sizes_that_are_not_positive_and_gives_back_a_failed_call_s_grants(
        tmp_path, monkeypatch):
    """A negative size lowered the books (and let a segment in over the cap); a tier that
    raised part-way through a call kept the grants it had made, unknown to any writer."""
    from hybrid_ray import ConfigError

    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("a", ShuffleConfig(memory_capacity_bytes=0, spill_dirs=[str(tmp_path)],
                                           disk_capacity_bytes=10 * MiB))
    for bad in ([-8 * MiB], [0], [1.5]):
        with pytest.raises(ConfigError, match="must be positive integers"):
            tm.reserve("a", bad)
    disk = tm._tier("a", TierName.DISK)
    real = os.statvfs
    calls = []

    def fails_on_second(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("injected: statvfs failed")
        return real(path)
    monkeypatch.setattr(os, "statvfs", fails_on_second)
    with pytest.raises(OSError, match="injected"):
        tm.reserve("a", [MiB, MiB])
    monkeypatch.setattr(os, "statvfs", real)
    assert disk.used_by("a") == 0 and disk.usage().used_bytes == 0


def test_disk_tiers_of_different_configs_on_one_directory_see_each_other_s_grants(
        tmp_path, monkeypatch):
    """Each config gets a disk tier of its own; each counted only its own grants not yet
    written against the directory's free space: two configs differing only in their
    reserve were granted 29 MiB on 20 MiB free, and the writes then met ENOSPC."""
    import collections

    fs = collections.namedtuple("fs", "f_bavail f_frsize f_blocks")
    monkeypatch.setattr(os, "statvfs", lambda path: fs(20 * MiB // 4096, 4096, 100 * MiB // 4096))
    tm = TierManager("n1", object_store_bytes=0)
    granted = 0
    for shuffle, reserve in (("c", 0.05), ("d", 0.06)):
        tm.register_shuffle(shuffle, ShuffleConfig(memory_capacity_bytes=0,
                                                   spill_dirs=[str(tmp_path)],
                                                   min_reserve_fraction=reserve))
        granted += sum(p.grant is not None for p in tm.reserve(shuffle, [MiB] * 20))
    assert granted == 15  # 20 MiB free less the first config's 5 MiB reserve; none left for d


def test_grants_in_flight_count_per_filesystem_not_per_spill_dir(tmp_path, monkeypatch):
    """Two spill dirs on one filesystem each saw its whole free space: with 20 MiB free
    and a 5 MiB reserve, 20 of 20 one-MiB segments were granted (up to 30 could have
    been), and the writes would fill the disk past the reserve or meet ENOSPC."""
    import collections

    fs = collections.namedtuple("fs", "f_bavail f_frsize f_blocks")
    monkeypatch.setattr(os, "statvfs", lambda path: fs(20 * MiB // 4096, 4096, 100 * MiB // 4096))
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("e", ShuffleConfig(memory_capacity_bytes=0,
                                           spill_dirs=[str(tmp_path / "a"), str(tmp_path / "b")]))
    placements = tm.reserve("e", [MiB] * 20)
    assert sum(p.grant is not None for p in placements) == 15
    assert {p.grant.target for p in placements if p.grant is not None} == {
        str(tmp_path / "a"), str(tmp_path / "b")}  # still spread over both


def test_a_restarted_tier_manager_serves_files_of_marked_shuffle_directories(tmp_path):
    """A reader on another node asks the writer node's tier manager for a disk segment. One
    started again there (the old one killed, the node alive) had registered none of the
    old shuffles' disks and refused every such file ("none registered"), so a Spark reader
    blamed the writer's executor (FetchFailed) and a Ray reducer failed, with the files
    intact. It serves what it may delete: files of marked shuffle directories; nothing
    else."""
    from hybrid_ray.errors import UnsafePathError
    from hybrid_ray.tiers.base import SHUFFLE_MARKER_NAME
    from hybrid_ray.tiers.disk import DiskTier, read_segment_file

    cfg = ShuffleConfig(memory_fraction=0.0, spill_dirs=[str(tmp_path / "spill")])
    writer = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    meta = writer.write(SegmentId("s", 0, 0, 0, 0), b"x" * 100)
    restarted = TierManager("n1", object_store_bytes=1000)
    assert restarted.read_disk_segment(meta) == read_segment_file(meta)
    assert restarted.serve_segment_file(meta.location) == meta.location
    # Unmarked, or marked for another shuffle than its path names: refused.
    unmarked = tmp_path / "elsewhere" / "hybrid_ray" / "s" / "sub-00000" / meta.id.file_name
    unmarked.parent.mkdir(parents=True)
    unmarked.write_bytes(b"not ours")
    os.chmod(unmarked.parents[2], 0o700)  # a private data dir: only the marker is missing
    with pytest.raises(UnsafePathError, match="its marker cannot be read"):
        restarted.serve_segment_file(str(unmarked))
    other = tmp_path / "spill" / "hybrid_ray" / "t" / "sub-00000" / meta.id.file_name
    other.parent.mkdir(parents=True)
    (other.parent.parent / SHUFFLE_MARKER_NAME).write_bytes(
        (tmp_path / "spill" / "hybrid_ray" / "s" / SHUFFLE_MARKER_NAME).read_bytes())
    other.write_bytes(b"x")
    with pytest.raises(UnsafePathError, match="neither inside the data dir"):
        restarted.serve_segment_file(str(other))
    # A segment file that is a symlink out of its marked directory: refused.
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret")
    link = tmp_path / "spill" / "hybrid_ray" / "s" / "sub-00000" / "m000001-a000-s000000.seg"
    link.symlink_to(secret)
    with pytest.raises(UnsafePathError, match="neither inside the data dir"):
        restarted.serve_segment_file(str(link))
    # A marked tree anyone could have planted (a data dir others can write, a marker of
    # another user): refused, although shaped like ours.
    planted = tmp_path / "planted" / "hybrid_ray" / "s"
    (planted / "sub-00000").mkdir(parents=True)
    (planted / SHUFFLE_MARKER_NAME).write_bytes(
        (tmp_path / "spill" / "hybrid_ray" / "s" / SHUFFLE_MARKER_NAME).read_bytes())
    (planted / "sub-00000" / meta.id.file_name).write_bytes(b"planted")
    os.chmod(planted.parent, 0o777)
    with pytest.raises(UnsafePathError, match="has mode 777"):
        restarted.serve_segment_file(str(planted / "sub-00000" / meta.id.file_name))
    os.chmod(planted.parent, 0o700)
    assert restarted.serve_segment_file(str(planted / "sub-00000" / meta.id.file_name))
    if os.geteuid() != 0:
        return  # giving a file away (the marker of another user) needs root
    os.chown(planted / SHUFFLE_MARKER_NAME, 12345, -1)
    with pytest.raises(UnsafePathError, match="owned by uid 12345"):
        restarted.serve_segment_file(str(planted / "sub-00000" / meta.id.file_name))


def test_only_grants_that_are_always_settled_are_kept_by_id(tmp_path):
    """Grant ids make a second settlement of a grant change nothing; an id stays recorded
    until its grant is settled. JVM writers' settlements carry no id, and memory grants
    written in full are never settled: recording theirs kept a record per segment for the
    shuffle's life (3,000 after 3,000 settled JVM grants, in a review's experiment)."""
    from hybrid_ray.spark_jvm import reserve, settle

    cfg = ShuffleConfig(memory_capacity_bytes=1000, spill_dirs=[str(tmp_path)])
    tm = TierManager("n1", object_store_bytes=1000)
    tm.register_shuffle("py", cfg)
    memory_grant, disk_grant = (p.grant for p in tm.reserve("py", [1000, 100]))
    assert (memory_grant.tier, memory_grant.grant_id) == (TierName.MEMORY, 0)
    assert disk_grant.tier == TierName.DISK and disk_grant.grant_id > 0
    disk = tm._tier("py", TierName.DISK)
    tm.settle("py", [(disk_grant, 100)])
    tm.settle("py", [(disk_grant, None)])  # again, as after a call that failed: no change
    assert disk.used_by("py") == 100 and not disk._open_grants.get("py")
    placements = reserve(tm, {"shuffle": "jvm", "sizes": [100] * 30, "config": {}},
                         {}.get)["placements"]
    settle(tm, "jvm", [[p["tier"], 100, p["target"], 100] for p in placements])
    assert not tm._tier("jvm", TierName.DISK)._open_grants.get("jvm")
    assert tm._disk_in_flight == {}


def test_a_restarted_tier_manager_ignores_a_settlement_of_its_predecessor_s_grant(
        tmp_path, monkeypatch):
    """Disk grants carry an id so a settlement sent twice counts once. A tier manager
    started again (a new process) counted its ids from 1 again: a writer's late settlement
    of a grant the old one made then closed another writer's grant of the same id, and
    that writer's real settlement was ignored (its bytes stayed counted until release)."""
    from hybrid_ray.tiers import base

    config = ShuffleConfig(memory_capacity_bytes=0, spill_dirs=[str(tmp_path / "spill")])
    old = TierManager("n1", object_store_bytes=1000)
    old.register_shuffle("s", config)
    [stale] = [p.grant for p in old.reserve("s", [100])]
    monkeypatch.setattr(base, "_grant_ids", base.new_grant_ids())  # a new process's
    restarted = TierManager("n1", object_store_bytes=1000)
    restarted.register_shuffle("s", config)
    [fresh] = [p.grant for p in restarted.reserve("s", [100])]
    assert stale.tier == fresh.tier == TierName.DISK
    disk = restarted._tier("s", TierName.DISK)
    restarted.settle("s", [(stale, 60)])  # the old grant's writer, late: changes nothing
    assert disk.used_by("s") == 100
    restarted.settle("s", [(fresh, 40)])  # the new grant's own settlement counts
    assert disk.used_by("s") == 40
    restarted.release_shuffle("s")
    old.release_shuffle("s")


def test_a_restarted_tier_manager_frees_its_predecessor_s_disk_segment_without_its_bytes(
        tmp_path):
    """A tier manager started again (Ray's memory monitor killed the old one) has empty
    books, and the master frees the old one's segments through it. Their bytes were given
    back all the same: the books fell below what it had granted since, and 16 MiB went to
    disk under a 10 MiB cap. The file goes; the books keep the new grant's bytes."""
    config = ShuffleConfig(memory_fraction=0, spill_dirs=[str(tmp_path / "spill")],
                           disk_capacity_bytes=10 * MiB)
    old = TierManager("n1", object_store_bytes=0)
    old.register_shuffle("s", config)
    [before] = old.reserve("s", [8 * MiB])
    stale = old._tier("s", TierName.DISK).write(SegmentId("s", 0, 0, 0, 0), b"x" * (8 * MiB),
                                                before.grant, "n1")
    old.settle("s", [(before.grant, 8 * MiB)])
    assert stale.granted_by == old.books_id

    restarted = TierManager("n1", object_store_bytes=0)
    restarted.register_shuffle("s", config)
    [after] = restarted.reserve("s", [8 * MiB])
    disk = restarted._tier("s", TierName.DISK)
    fresh = disk.write(SegmentId("s", 1, 0, 0, 0), b"y" * (8 * MiB), after.grant, "n1")
    restarted.settle("s", [(after.grant, 8 * MiB)])
    assert fresh.granted_by == restarted.books_id != old.books_id

    assert restarted.free_segments("s", [stale]) == []
    assert not os.path.exists(stale.location)  # the data goes all the same
    assert disk.used_by("s") == 8 * MiB  # the new segment's bytes are still counted
    [refused] = restarted.reserve("s", [8 * MiB])
    assert refused.grant is None  # 8 + 8 MiB does not fit the 10 MiB cap
    # Its own segment is given back as before.
    assert restarted.free_segments("s", [fresh]) == []
    assert disk.used_by("s") == 0
    restarted.release_shuffle("s")
    old.release_shuffle("s")


def test_a_restarted_tier_manager_keeps_its_memory_budget_after_freeing_old_segments(
        tmp_path):
    """The memory tier's version: a predecessor's segment (its object owned by a writer,
    which outlived the tier manager), freed or settled through the new one, must not
    lower its books, or a 900-byte grant went in beside 600 bytes under a 1,000 budget."""
    config = ShuffleConfig(memory_capacity_bytes=1000, spill_dirs=[str(tmp_path / "spill")])
    old = TierManager("n1", object_store_bytes=1000)
    old.register_shuffle("s", config)
    [old_placement] = old.reserve("s", [600])
    restarted = TierManager("n1", object_store_bytes=1000)
    restarted.register_shuffle("s", config)
    [held] = restarted.reserve("s", [600])
    assert held.grant.tier == TierName.MEMORY
    stale = SegmentMeta(SegmentId("s", 0, 0, 0, 0), TierName.MEMORY, 600, 1, "n1",
                        granted_by=old_placement.grant.granted_by)
    restarted.free_segments("s", [stale])
    restarted.settle("s", [(old_placement.grant, None)])  # a late writer's abort
    assert restarted.memory.used_by("s") == 600
    [second] = restarted.reserve("s", [900])
    assert second.grant is None or second.grant.tier != TierName.MEMORY
    # A meta without a stamp (a JVM writer's segment) is counted as before.
    unstamped = SegmentMeta(SegmentId("s", 2, 0, 0, 0), TierName.MEMORY, 600, 1, "n1")
    restarted.free_segments("s", [unstamped])
    assert restarted.memory.used_by("s") == 0
    restarted.release_shuffle("s")
    old.release_shuffle("s")


def test_a_restarted_tier_manager_takes_the_held_memory_segments_into_its_books(tmp_path):
    """A tier manager started in place of one that died began with empty books while the
    writers still owned the old one's memory-tier objects: it granted the whole budget again
    beside them (the shuffle's memory tier went 52-70% over its cap). It now takes the
    segments the master still holds on its node into its books, once, and gives their
    bytes back as they are freed (a pack's with its last member held)."""
    from hybrid_ray.segment import PackSlot

    config = ShuffleConfig(memory_capacity_bytes=1000, spill_dirs=[str(tmp_path / "spill")])
    old = TierManager("n1", object_store_bytes=1000)

    def meta(sub, node="n1", tier=TierName.MEMORY, pack=None):
        return SegmentMeta(SegmentId("s", 0, sub, 0, 0), tier, 200, 1, node,
                           granted_by=old.books_id, pack=pack)

    single = meta(0)
    pack = [meta(sub, pack=PackSlot(1, 0, 2, sub - 1, 400)) for sub in (1, 2)]
    elsewhere, on_disk = meta(3, node="n2"), meta(4, tier=TierName.DISK)
    restarted = TierManager("n1", object_store_bytes=1000)
    held = [single, *pack, elsewhere, on_disk]
    assert restarted.adopt_memory_segments("s", config, held) == 600
    assert restarted.adopt_memory_segments("s", config, held) == 0  # taken once
    assert restarted.memory.used_by("s") == 600
    [placement] = restarted.reserve("s", [600])
    assert placement.grant is None or placement.grant.tier != TierName.MEMORY
    restarted.free_segments("s", [single])
    assert restarted.memory.used_by("s") == 400
    restarted.free_segments("s", [pack[0], single])  # the pack's object is still held
    assert restarted.memory.used_by("s") == 400
    restarted.free_segments("s", [pack[1]])
    assert restarted.memory.used_by("s") == 0
    restarted.release_shuffle("s")
    assert restarted.adopt_memory_segments("s", config, held) == 0  # released here


def test_freeing_segments_tries_every_file_and_frees_the_bytes_of_those_that_went(
        tmp_path, monkeypatch):
    """A segment file that cannot be unlinked fails the call, so the master retries, but
    no longer stops the batch's other files at the first failure: they are gone and their
    bytes given back, once; the retry frees only what is left."""
    import errno

    from hybrid_ray.tiers.disk import DiskTier

    spill = tmp_path / "spill"
    tm = TierManager("n1", object_store_bytes=0)
    cfg = ShuffleConfig(memory_capacity_bytes=0, spill_dirs=[str(spill)])
    placements = tm.reserve("s", [100] * 12, register=cfg)
    writer_disk = DiskTier(cfg.segment_bytes[TierName.DISK], cfg.spill_dirs_for("n1"))
    metas = [writer_disk.write(SegmentId("s", 0, sub, 0, 0), b"x" * 100, p.grant)
             for sub, p in enumerate(placements)]
    tm.settle("s", [(p.grant, 100) for p in placements])
    disk = tm._tier("s", TierName.DISK)
    assert disk.used_by("s") == 1200
    busy = {metas[3].location, metas[8].location}
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path) in busy:
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        return real_unlink(path, *args, **kwargs)

    forged = SegmentMeta(SegmentId("s", 0, 99, 0, 0), TierName.DISK, 100, 1, "n1",
                         str(tmp_path / "not-ours.seg"))  # refused, never deleted
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match=r"freeing segments of shuffle s could not delete 2 "
                                      r"file\(s\), first .*Device or resource busy.*; 1 "
                                      r"refused: refusing to delete .*not-ours\.seg"):
        tm.free_segments("s", metas + [forged])
    assert tm.refused_deletions == 0  # counted by the call that returns the refusal
    assert sorted(str(p) for p in spill.rglob("*.seg")) == sorted(busy)
    assert disk.used_by("s") == 200
    monkeypatch.setattr(os, "unlink", real_unlink)
    [refusal] = tm.free_segments("s", metas + [forged])  # the master's retry
    assert "not-ours.seg" in refusal and tm.refused_deletions == 1
    assert list(spill.rglob("*.seg")) == []
    assert disk.used_by("s") == 0
    tm.free_segments("s", metas)  # a retry of a retry gives nothing back twice
    assert disk.used_by("s") == 0


def test_a_segment_listed_twice_in_one_free_gives_its_bytes_back_once(tmp_path):
    """Within one batch too: a memory segment listed twice (an abort's list and the
    master's drop merged) is freed once, so the tier does not under-count its use."""
    tm = TierManager("n1", object_store_bytes=1000)
    tm.register_shuffle("s", ShuffleConfig(memory_capacity_bytes=1000))
    [first, second] = tm.reserve("s", [100, 100])
    assert {first.grant.tier, second.grant.tier} == {TierName.MEMORY}
    tm.settle("s", [(first.grant, 100), (second.grant, 100)])
    memory = tm._tier("s", TierName.MEMORY)
    assert memory.used_by("s") == 200
    meta = SegmentMeta(SegmentId("s", 0, 0, 0, 0), TierName.MEMORY, 100, 1, "n1")
    tm.free_segments("s", [meta, meta])
    assert memory.used_by("s") == 100


def test_a_pack_s_bytes_come_back_when_its_last_member_is_freed(tmp_path):
    """Memory-tier segments packed into one object (``PackSlot``) leave the store only
    when the last member is freed: their bytes stay counted until then, once, however the
    members' frees are split and repeated. (Freed per member, the budget believed in room
    the object store did not have.)"""
    from hybrid_ray.segment import PackSlot

    tm = TierManager("n1", object_store_bytes=10_000)
    tm.register_shuffle("s", ShuffleConfig(memory_capacity_bytes=10_000))
    sizes = [100, 200, 300, 400]
    grants = [p.grant for p in tm.reserve("s", sizes + [50])]
    assert {g.tier for g in grants} == {TierName.MEMORY}
    tm.settle("s", [(g, n) for g, n in zip(grants, sizes + [50])])
    memory = tm._tier("s", TierName.MEMORY)
    assert memory.used_by("s") == 1050
    # Map 3 attempt 1's flush: subpartitions 4..7 as one pack led by (4, 2).
    pack = [SegmentMeta(SegmentId("s", 3, 4 + k, 2, 1), TierName.MEMORY, n, 1, "n1",
                        pack=PackSlot(4, 2, 4, k)) for k, n in enumerate(sizes)]
    alone = SegmentMeta(SegmentId("s", 3, 9, 0, 1), TierName.MEMORY, 50, 1, "n1")
    tm.free_segments("s", [pack[0], alone])
    assert memory.used_by("s") == 1000  # the segment alone went; the pack stays whole
    tm.free_segments("s", [pack[2], pack[0]])  # pack[0] again: counted once
    assert memory.used_by("s") == 1000
    tm.free_segments("s", [pack[1], pack[3]])
    assert memory.used_by("s") == 0
    assert tm._open_packs == {}


def test_a_released_shuffle_s_half_freed_packs_are_forgotten(tmp_path):
    from hybrid_ray.segment import PackSlot

    tm = TierManager("n1", object_store_bytes=10_000)
    tm.register_shuffle("s", ShuffleConfig(memory_capacity_bytes=10_000))
    [placement] = tm.reserve("s", [100])
    tm.settle("s", [(placement.grant, 100)])
    tm.free_segments("s", [SegmentMeta(SegmentId("s", 0, 0, 0), TierName.MEMORY, 100, 1,
                                       "n1", pack=PackSlot(0, 0, 2, 0))])
    assert tm.memory.used_by("s") == 100 and "s" in tm._open_packs
    tm.release_shuffle("s")
    assert tm.memory.used_by("s") == 0 and tm._open_packs == {}


@pytest.mark.parametrize("bad_prefix", ["/\x00x", "/\ud800x", "/a\nb"])
def test_an_unprintable_location_is_refused_and_the_rest_of_its_batch_freed(tmp_path,
                                                                           bad_prefix):
    """A location with a NUL or a lone surrogate passed the segment-file shape check, then
    os.path.realpath raised ValueError: no file of the batch was unlinked, on every retry
    (review of 2026-11-27). It is refused, counted, and the others go."""
    from hybrid_ray.tiers.disk import segment_path

    spill = str(tmp_path / "spill")
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("s", ShuffleConfig(spill_dirs=[spill], memory_fraction=0.0))
    [placement] = tm.reserve("s", [1])
    assert placement.grant.tier == TierName.DISK
    good_id = SegmentId("s", 0, 1, 0)
    good = segment_path(spill, good_id)
    os.makedirs(os.path.dirname(good), exist_ok=True)
    with open(good, "wb") as f:
        f.write(b"x")
    tm.settle("s", [(placement.grant, 1)])
    bad = SegmentMeta(SegmentId("s", 1, 1, 0), TierName.DISK, 1, 1, "n1",
                      bad_prefix + "/hybrid_ray/s/sub-00001/m000001-a000-s000000.seg")
    [refusal] = tm.free_segments("s", [bad, SegmentMeta(good_id, TierName.DISK, 1, 1, "n1",
                                                        good)])
    assert "not a hybrid_ray segment file" in refusal
    assert not os.path.exists(good)
    assert tm._tier("s", TierName.DISK).used_by("s") == 0


def test_the_disk_byte_cap_bounds_the_node_whatever_each_shuffle_s_config(tmp_path):
    """``disk_capacity_bytes`` is a cap per node, but each config's disk tier (keyed by its
    dirs, reserve and cap) checked it against its own bytes: two shuffles differing only
    in their reserve fraction were granted 8 MiB each under a 10 MiB cap (found by a
    review). The cap now bounds the node's disk tiers together."""
    tm = TierManager("n1", object_store_bytes=0)
    spill = [str(tmp_path / "spill")]
    a = ShuffleConfig(memory_fraction=0, spill_dirs=spill, disk_capacity_bytes=10 * MiB,
                      min_reserve_fraction=0.05, progress=False)
    b = a.replace(min_reserve_fraction=0.04)
    tm.register_shuffle("a", a)
    tm.register_shuffle("b", b)
    assert tm.reserve("a", [8 * MiB])[0].grant.tier == TierName.DISK
    [refused] = tm.reserve("b", [8 * MiB])
    assert refused.grant is None
    assert tm.reserve("b", [2 * MiB])[0].grant.tier == TierName.DISK  # what is left
    # A shuffle spilling to other directories, capped or not, does not count: its bytes
    # starved the capped shuffles in the first version of this fix.
    elsewhere = a.replace(spill_dirs=[str(tmp_path / "other")], disk_capacity_bytes=None)
    tm.register_shuffle("c", elsewhere)
    assert tm.reserve("c", [50 * MiB])[0].grant.tier == TierName.DISK
    tm.release_shuffle("a")
    assert tm.reserve("b", [8 * MiB])[0].grant.tier == TierName.DISK  # a's room came back
    for shuffle in ("b", "c"):
        tm.release_shuffle(shuffle)


def test_the_disk_byte_cap_counts_the_same_spill_dirs_listed_in_another_order(tmp_path):
    """The node's disk cap counts every disk tier over the same spill dirs; two configs
    listing the same two dirs in another order (or one through a symlink) are the same
    dirs, but were keyed apart, so each got the whole cap: 16 MiB under a 10 MiB cap."""
    tm = TierManager("n1", object_store_bytes=0)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    os.makedirs(x)
    os.symlink(x, str(tmp_path / "x-link"))
    a = ShuffleConfig(memory_fraction=0, spill_dirs=[x, y], disk_capacity_bytes=10 * MiB,
                      progress=False)
    b = a.replace(spill_dirs=[y, x])
    c = a.replace(spill_dirs=[str(tmp_path / "x-link"), y])
    for shuffle, config in (("a", a), ("b", b), ("c", c)):
        tm.register_shuffle(shuffle, config)
    assert tm.reserve("a", [8 * MiB])[0].grant.tier == TierName.DISK
    assert tm.reserve("b", [8 * MiB])[0].grant is None
    assert tm.reserve("c", [8 * MiB])[0].grant is None
    assert tm.reserve("b", [2 * MiB])[0].grant.tier == TierName.DISK  # what is left
    for shuffle in ("a", "b", "c"):
        tm.release_shuffle(shuffle)


def test_a_release_whose_removal_failed_is_retried_past_the_late_files_window(
        tmp_path, monkeypatch):
    """The tier manager's orphan sweep releases a shuffle its master no longer knows; no
    master retries that release, only the late-files sweep (``remove_late_files``). It
    looked at a release for ``LATE_FILES_WINDOW_S`` only: a removal that kept failing
    longer (a file busy for 11 minutes) was never tried again, and the files stayed for
    good. A removal that failed is now tried again on every sweep until it succeeds."""
    from hybrid_ray import tier_manager
    from hybrid_ray.tiers.disk import shuffle_dir

    spill = str(tmp_path / "spill")
    tm = TierManager("n1", 0)
    tm.register_shuffle("shf-1", ShuffleConfig(spill_dirs=[spill], memory_capacity_bytes=0))
    _, real_unlink = _busy_segment_file_of_shf_1(spill, monkeypatch)
    with pytest.raises(OSError, match="Device or resource busy"):
        tm.release_shuffle("shf-1")  # as the orphan sweep does: nobody calls it again
    clock = [tier_manager.time.monotonic() + tier_manager.LATE_FILES_WINDOW_S + 1]
    monkeypatch.setattr(tier_manager.time, "monotonic", lambda: clock[0])
    with pytest.raises(OSError, match="Device or resource busy"):
        tm.remove_late_files()  # still busy, past the window: still tried, and said
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert tm.remove_late_files() == ["shf-1"]
    assert not os.path.exists(shuffle_dir(spill, "shf-1"))
    assert tm.remove_late_files() == []  # done: not looked at again


def test_a_disk_tier_holding_a_failed_removal_is_not_forgotten(tmp_path, monkeypatch):
    """A release whose removal failed is retried by the late-files sweep through the disk
    tiers (60a0f5c); ``_prune_disks`` (0d4468f) protected its tier only while the shuffle
    was among the last RELEASED_MEMORY releases. Once it fell out, the tier was forgotten,
    the sweep found no tier holding its files, gave up on it, and the files stayed."""
    from hybrid_ray import tier_manager
    from hybrid_ray.tiers.disk import shuffle_dir

    monkeypatch.setattr(tier_manager, "RELEASED_MEMORY", 2)
    monkeypatch.setattr(tier_manager, "DISK_TIERS_KEPT", 1)

    def config(name):
        return ShuffleConfig(spill_dirs=[str(tmp_path / name)], memory_capacity_bytes=0)

    spill = str(tmp_path / "a")
    tm = TierManager("n1", 0)
    tm.register_shuffle("shf-1", config("a"))
    _, real_unlink = _busy_segment_file_of_shf_1(spill, monkeypatch)
    with pytest.raises(OSError, match="Device or resource busy"):
        tm.release_shuffle("shf-1")  # as the orphan sweep does
    monkeypatch.setattr(os, "unlink", real_unlink)
    for name in ("b", "c", "d"):  # later releases push shf-1 out of the recent ones
        tm.register_shuffle(f"shf-{name}", config(name))
        tm.release_shuffle(f"shf-{name}")
    tm.register_shuffle("shf-e", config("e"))  # a new tier: the idle ones are pruned
    assert tm.remove_late_files() == ["shf-1"]
    assert not os.path.exists(shuffle_dir(spill, "shf-1"))


def _busy_segment_file_of_shf_1(spill: str, monkeypatch) -> tuple[str, object]:
    """Write a segment file of shuffle "shf-1" in its marked directory under ``spill`` and
    make unlinking any segment file fail with EBUSY; returns the file and the real
    ``os.unlink``."""
    import errno

    from hybrid_ray.tiers.disk import (
        make_private_dir, segment_path, shuffle_dir, write_private_file, write_shuffle_marker,
    )

    path = segment_path(spill, SegmentId("shf-1", 0, 3, 0))
    make_private_dir(os.path.dirname(path))
    write_shuffle_marker(shuffle_dir(spill, "shf-1"), "shf-1")
    write_private_file(path, b"x" * 100)
    real_unlink = os.unlink

    def busy_segments(p, *args, **kwargs):
        if str(p).endswith(".seg"):
            raise OSError(errno.EBUSY, "Device or resource busy", p)
        return real_unlink(p, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", busy_segments)
    return path, real_unlink


def test_the_disk_byte_cap_counts_tiers_sharing_some_of_its_spill_dirs(tmp_path):
    """Configs over [X] and [X, Y] with a 10 MiB cap were counted apart (the dir sets
    differ), so X took 16 MiB under the cap (found by a review). A tier that shares a dir
    counts; one over other dirs still does not."""
    tm = TierManager("n1", object_store_bytes=0)
    x, y, z = (str(tmp_path / d) for d in "xyz")
    a = ShuffleConfig(memory_fraction=0, spill_dirs=[x], disk_capacity_bytes=10 * MiB,
                      progress=False)
    tm.register_shuffle("a", a)
    tm.register_shuffle("b", a.replace(spill_dirs=[x, y]))
    tm.register_shuffle("c", a.replace(spill_dirs=[z]))
    assert tm.reserve("a", [8 * MiB])[0].grant.tier == TierName.DISK
    assert tm.reserve("b", [8 * MiB])[0].grant is None
    assert tm.reserve("b", [2 * MiB])[0].grant.tier == TierName.DISK  # what is left
    assert tm.reserve("c", [8 * MiB])[0].grant.tier == TierName.DISK  # other dirs
    for shuffle in ("a", "b", "c"):
        tm.release_shuffle(shuffle)


def test_public_tier_entry_points_refuse_what_is_not_a_config_or_a_size(tmp_path):
    """build_io_tiers and TierManager are exported for your own producers (README, "Lower
    level"): a dict config failed with "'dict' object has no attribute ...", and a
    negative object store size was taken (every memory budget negative)."""
    from hybrid_ray import ConfigError, build_io_tiers

    with pytest.raises(ConfigError, match="build_io_tiers takes a hybrid_ray.ShuffleConfig"):
        build_io_tiers({"spill_dirs": [str(tmp_path)]})
    for size in (-5, "1GiB", float("nan")):
        with pytest.raises(ConfigError, match="object_store_bytes must be"):
            TierManager("node-a", size)
    tm = TierManager("node-a", 1 << 20)
    with pytest.raises(ConfigError, match="register_shuffle takes a hybrid_ray.ShuffleConfig"):
        tm.register_shuffle("shf-1", {})
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")])
    assert tm.register_shuffle("shf-1", config) >= 0
    assert set(build_io_tiers(config, memory_budget=0)) >= {TierName.DISK}
    tm.release_shuffle("shf-1")


def test_a_cancelled_reservation_gives_back_exactly_what_it_granted(tmp_path):
    """A writer whose wait for a reservation's answer ran out never saw its grants and
    cannot settle them: cancelling the call gives them back. Cancelling a call the same
    writer followed with another (so it got the answer), one that granted nothing, or
    the same one twice changes nothing."""
    from hybrid_ray.tier_manager import ReserveToken

    config = ShuffleConfig(memory_fraction=0, spill_dirs=[str(tmp_path / "spill")],
                           disk_capacity_bytes=64 * MiB)
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("s", config)
    disk = tm._tier("s", TierName.DISK)
    answered = tm.reserve("s", [8 * MiB], token=ReserveToken("w1", 1))
    lost = tm.reserve("s", [4 * MiB, 4 * MiB], token=ReserveToken("w1", 2))
    other = tm.reserve("s", [2 * MiB], token=ReserveToken("w2", 1))
    assert all(p.grant is not None for p in answered + lost + other)
    assert disk.used_by("s") == 18 * MiB

    assert tm.cancel_reserve("s", ReserveToken("w1", 1)) == 0  # followed by call 2
    assert tm.cancel_reserve("s", ReserveToken("w1", 3)) == 0  # never ran
    assert disk.used_by("s") == 18 * MiB
    assert tm.cancel_reserve("s", ReserveToken("w1", 2)) == 2
    assert disk.used_by("s") == 10 * MiB  # w1's first 8 MiB and w2's 2 MiB stay
    assert tm.cancel_reserve("s", ReserveToken("w1", 2)) == 0  # once only
    assert disk.used_by("s") == 10 * MiB
    # A call that granted nothing forgets the writer's earlier one: its answer came.
    refused = tm.reserve("s", [200 * MiB], token=ReserveToken("w2", 2))
    assert refused[0].grant is None
    assert tm.cancel_reserve("s", ReserveToken("w2", 1)) == 0
    assert disk.used_by("s") == 10 * MiB
    tm.release_shuffle("s")
    assert tm.cancel_reserve("s", ReserveToken("w1", 1)) == 0  # released: nothing left
    assert tm._last_grants == {}


def test_a_tier_manager_remembers_the_last_reservations_of_a_bounded_number_of_writers(
        tmp_path, monkeypatch):
    """Each writer's last granting reservation is kept for a cancel; a long application's
    shuffle has a writer per task attempt, so only the newest LAST_GRANTS_KEPT are."""
    from hybrid_ray import tier_manager
    from hybrid_ray.tier_manager import ReserveToken

    monkeypatch.setattr(tier_manager, "LAST_GRANTS_KEPT", 3)
    config = ShuffleConfig(memory_fraction=0, spill_dirs=[str(tmp_path / "spill")])
    tm = TierManager("n1", object_store_bytes=0)
    tm.register_shuffle("s", config)
    for writer in "abcd":
        tm.reserve("s", [MiB], token=ReserveToken(writer, 1))
    assert list(tm._last_grants["s"]) == ["b", "c", "d"]
    assert tm.cancel_reserve("s", ReserveToken("a", 1)) == 0  # forgotten: counted still
    assert tm.cancel_reserve("s", ReserveToken("b", 1)) == 1
    assert tm._tier("s", TierName.DISK).used_by("s") == 3 * MiB
    tm.reserve("s", [MiB], token=ReserveToken("c", 2))  # c's newest call, moved last
    assert list(tm._last_grants["s"]) == ["d", "c"]
    tm.release_shuffle("s")



def test_releasing_a_shuffle_whose_spill_dir_cannot_be_opened_succeeds_when_nothing_is_there(
        tmp_path):
    # A shuffle whose spill dir is a file failed its first reservation (its map's
    # ConfigError); the master's release of it then raised the spill dir's error on every
    # retry, a deletion pending for good in `hybrid-ray status`.
    (tmp_path / "afile").write_text("x")
    bad = ShuffleConfig(spill_dirs=[str(tmp_path / "afile" / "x")])
    tm = TierManager("n1", 10**6)
    with pytest.raises(ConfigError):
        tm.reserve("shf-bad", [100], register=bad)
    tm.release_shuffle("shf-bad", config=bad)
    assert tm.was_released("shf-bad")
    assert tm.usage().shuffles == ()


def test_a_release_still_raises_where_an_unusable_spill_dir_holds_a_data_dir(tmp_path):
    spill = tmp_path / "spill"
    (spill / "hybrid_ray" / "shf-1").mkdir(parents=True)
    spill.chmod(0o777)  # world-writable, not sticky: refused, and data may be there
    try:
        tm = TierManager("n1", 10**6)
        with pytest.raises(ConfigError):
            tm.release_shuffle("shf-1", config=ShuffleConfig(spill_dirs=[str(spill)]))
    finally:
        spill.chmod(0o700)


def test_check_spill_dirs_names_the_dir_the_node_and_the_fix(tmp_path, monkeypatch):
    """hybrid_ray.init has each node's tier manager check the config's spill dirs (they are
    the node's own): one that cannot be created (under /proc, below a regular file) or
    written was taken by init, and the first shuffle failed on it instead. One that does
    not exist yet but can be created is created, 0700, as on a shuffle's first use."""
    from hybrid_ray.errors import SpillDirError

    tm = TierManager("node-a", object_store_bytes=0)
    (tmp_path / "a-file").write_text("not a directory")
    for spill_dir, problem in ((tmp_path / "a-file" / "spill", "Not a directory"),
                               ("/proc/hybrid_ray_spill", "No such file or directory")):
        with pytest.raises(SpillDirError) as info:
            tm.check_spill_dirs(ShuffleConfig(spill_dirs=[str(tmp_path), str(spill_dir)]))
        message = str(info.value)
        assert message.startswith(f"node node-a: spill dir {spill_dir} cannot be used")
        assert problem in message and "point spill_dirs at a writable directory" in message
    new = tmp_path / "new" / "{node_id}"
    assert tm.check_spill_dirs(ShuffleConfig(spill_dirs=[str(new)])) == \
        [str(tmp_path / "new" / "node-a" / "hybrid_ray")]
    assert os.stat(tmp_path / "new" / "node-a").st_mode & 0o777 == 0o700
    assert tm._disks == {}  # a check opens no disk tier
    # A data dir that exists but takes no file (a read-only disk; root writes anywhere, so
    # the refusal is simulated here).
    import hybrid_ray.tiers.disk as disk

    def read_only(path, payload):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(disk, "write_private_file", read_only)
    with pytest.raises(SpillDirError, match=rf"node node-a: spill dir {tmp_path} cannot be "
                       rf"used: {tmp_path}/hybrid_ray cannot be written \(Permission denied"):
        tm.check_spill_dirs(ShuffleConfig(spill_dirs=[str(tmp_path)]))
    # A shuffle's own disk tier names the node too.
    with pytest.raises(SpillDirError, match="node node-a: spill dir /proc/hybrid_ray_spill"):
        tm.register_shuffle("shf-1", ShuffleConfig(spill_dirs=["/proc/hybrid_ray_spill"]))


def test_build_io_tiers_refuses_a_memory_budget_that_is_not_a_byte_count(tmp_path):
    """build_io_tiers (exported for your own producers) took any memory_budget: a negative,
    bool or float budget (the memory tier then refused every segment), NaN (it then took
    every segment without bound) and a string (a bare TypeError at the first
    reservation). NumPy integers are byte counts, kept as plain ints, as in the config."""
    import numpy as np

    from hybrid_ray import build_io_tiers

    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], memory_fraction=0.3)
    for budget in (-5, True, 1.5, float("nan"), "1GiB", None):
        with pytest.raises(ConfigError, match=r"build_io_tiers\(memory_budget=\.\.\.\) must "
                                              r"be an integer number of bytes >= 0 \(use "
                                              r"hybrid_ray.MiB/GiB\), got "):
            build_io_tiers(config, memory_budget=budget)
    for budget in (0, 4 * MiB, np.int64(4 * MiB), np.uint32(4096)):
        memory = build_io_tiers(config, memory_budget=budget)[TierName.MEMORY]
        assert memory.budget_bytes == budget and type(memory.budget_bytes) is int
