"""``hybrid_ray.cleanup``: only marked shuffle directories hybrid_ray wrote are removed,
never a user's data next to them, never a live shuffle's, and dead nodes' ``{node_id}``
spill dirs are found. Real files, a real moto S3 server and a real local Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from hybrid_ray.segment import SegmentId, encode_segment


def _payload() -> bytes:
    import pyarrow as pa

    from hybrid_ray.config import Compression

    return bytes(encode_segment(pa.table({"id": list(range(100))}),
                                SegmentId("shf-payload", 0, 0, 0), Compression.NONE))


def _write_disk(spill_dir: str, shuffle_id: str, subs: int = 2) -> None:
    from hybrid_ray.tiers import DiskTier

    tier = DiskTier(1 << 20, [spill_dir])
    for sub in range(subs):
        tier.write(SegmentId(shuffle_id, 0, sub, 0), _payload())


def _remote_tier(remote_path: str, job_id: str, options: dict | None = None):
    from hybrid_ray.tiers import RemoteTier

    return RemoteTier(1 << 20, remote_path, job_id, options or {})


def _snapshot_local(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


def _snapshot_fs(fs, root: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(root)}


# ---- spill dirs ---------------------------------------------------------------------------
def test_a_spill_dir_named_twice_through_a_symlink_is_swept_once(tmp_path):
    """Was: deduplicated by its given path only, the same data dir reached through an alias
    was swept twice, and each removal reported twice (once for a directory already gone)."""
    from hybrid_ray.cleanup import sweep_spill_dirs

    spill = str(tmp_path / "spill")
    _write_disk(spill, "shf-orphan")
    os.symlink(spill, str(tmp_path / "alias"))
    result = sweep_spill_dirs([spill, str(tmp_path / "alias")], 0)
    assert [os.path.basename(r) for r in result.removed] == ["shf-orphan"]
    assert not os.path.exists(os.path.join(spill, "hybrid_ray", "shf-orphan"))


def test_spill_sweep_removes_only_marked_shuffle_dirs(tmp_path):
    """Was: every entry of ``spill/hybrid_ray`` older than the cut-off was removed."""
    from hybrid_ray.cleanup import sweep_spill_dirs

    spill = tmp_path / "spill"
    ours = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(str(spill), ours)
    data = spill / "hybrid_ray"
    # A user's things: a look-alike without marker, a file, a dir whose marker names
    # another shuffle, and a symlink to a directory outside holding a copied marker.
    (data / "shf-000000000000" / "sub-00000").mkdir(parents=True)
    (data / "shf-000000000000" / "sub-00000" / "m.seg").write_bytes(b"user bytes")
    (data / "notes.txt").write_text("keep me")
    (data / "shf-111111111111").mkdir()
    shutil.copy(data / ours / ".hybrid_ray_shuffle", data / "shf-111111111111")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(data / ours / ".hybrid_ray_shuffle", outside)
    (outside / "precious").write_bytes(b"\x00" * 100)
    os.symlink(outside, data / ours.replace("shf", "lnk"))
    (spill / "user.bin").write_bytes(b"\x01" * 1000)
    before = _snapshot_local(str(tmp_path))

    result = sweep_spill_dirs([str(spill)], older_than_s=0)

    assert result.removed == [os.path.realpath(data / ours)]
    assert result.errors == []
    assert not (data / ours).exists()
    after = _snapshot_local(str(tmp_path))
    expected = {k: v for k, v in before.items() if not k.startswith(f"spill/hybrid_ray/{ours}/")}
    assert after == expected  # every other byte identical


def test_spill_sweep_keeps_recent_and_listed_shuffles(tmp_path):
    from hybrid_ray.cleanup import sweep_spill_dirs

    spill = str(tmp_path / "spill")
    a, b = f"shf-{uuid.uuid4().hex[:12]}", f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, a)
    _write_disk(spill, b)
    before = _snapshot_local(spill)
    recent = sweep_spill_dirs([spill], older_than_s=3600)
    assert recent.removed == [] and len(recent.kept_recent) == 2
    assert _snapshot_local(spill) == before  # kept: every byte still there
    result = sweep_spill_dirs([spill], older_than_s=0, keep={a})
    assert [os.path.basename(p) for p in result.removed] == [b]
    assert [os.path.basename(p) for p in result.kept_live] == [a]
    # The live one's files all stay, the other's directory is gone.
    assert _snapshot_local(spill) == {k: v for k, v in before.items()
                                      if not k.startswith(f"hybrid_ray/{b}/")}
    assert any(k.startswith(f"hybrid_ray/{a}/sub-") for k in before)
    assert not os.path.exists(os.path.join(spill, "hybrid_ray", b))


def test_a_single_path_given_as_spill_dirs_is_refused_not_swept_per_character(
        tmp_path, monkeypatch):
    """sweep_spill_dirs("spill", ...) took the string as one spill dir per character:
    it swept "s", "p", "i", "l" below the working directory (and "/" for an absolute
    path), removing what it found there, and never looked at the dir it was given."""
    from hybrid_ray.cleanup import find_orphans, sweep_spill_dirs
    from hybrid_ray.errors import ConfigError

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    other = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(str(work / "s"), other)  # a spill dir nobody asked to sweep
    with pytest.raises(ConfigError, match="a single path 'spill'"):
        sweep_spill_dirs("spill", older_than_s=0)
    with pytest.raises(ConfigError, match="a single path 'spill'"):
        find_orphans(spill_dirs="spill")
    assert os.listdir(work / "s" / "hybrid_ray") == [other]


@pytest.mark.parametrize("age", [float("nan"), -3600, "6h", None, True])
def test_an_age_limit_that_is_no_age_is_refused_before_anything_is_removed(tmp_path, age):
    """Was: ``older_than_s=float("nan")`` or a negative age removed every candidate, a
    shuffle directory written a moment ago included (no mtime is above a NaN cut-off),
    ``True`` was taken as 1 s, and "6h" failed with a bare TypeError after the sweep had
    looked at every directory."""
    from hybrid_ray.cleanup import sweep_spill_dirs
    from hybrid_ray.errors import ConfigError

    spill = str(tmp_path / "spill")
    _write_disk(spill, "shf-fresh")
    with pytest.raises(ConfigError, match="older_than_s must be a number of seconds >= 0"):
        sweep_spill_dirs([spill], age)
    assert os.path.isdir(os.path.join(spill, "hybrid_ray", "shf-fresh"))


def test_node_id_spill_dirs_of_dead_nodes_are_swept(tmp_path):
    """Was: ``{node_id}`` was taken literally, so no node's spill files were ever found,
    and a removed node's files stayed forever (item 12)."""
    from hybrid_ray import ShuffleConfig
    from hybrid_ray.cleanup import sweep_spill_dirs

    pattern = str(tmp_path / "spill-{node_id}" / "d")
    config = ShuffleConfig(spill_dirs=[pattern], progress=False)
    shuffles = {}
    for node in ("a1b2c3dead", "d4e5f6gone"):
        (spill,) = config.spill_dirs_for(node)
        shuffles[node] = f"shf-{uuid.uuid4().hex[:12]}"
        _write_disk(spill, shuffles[node])
    (tmp_path / "spill-other").mkdir()
    (tmp_path / "spill-other" / "user.txt").write_text("not a spill dir of ours")

    result = sweep_spill_dirs([pattern], older_than_s=0)

    assert sorted(os.path.basename(p) for p in result.removed) == sorted(shuffles.values())
    for node in shuffles:
        (spill,) = config.spill_dirs_for(node)
        assert os.listdir(os.path.join(spill, "hybrid_ray")) == []
    assert (tmp_path / "spill-other" / "user.txt").read_text() == "not a spill dir of ours"


def test_a_directory_that_cannot_be_removed_is_reported_and_fails_the_command(tmp_path):
    """Was: ``rmtree(ignore_errors=True)`` reported it as removed."""
    from hybrid_ray.cli import main

    spill = str(tmp_path / "spill")
    shuffle = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, shuffle)
    stuck = os.path.join(spill, "hybrid_ray", shuffle, "sub-00000")
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", stuck], capture_output=True).returncode != 0:
            pytest.skip("running as root without chattr +i: nothing here fails to delete")
    else:
        os.chmod(stuck, 0o500)
    try:
        code = main(["cleanup", "--spill-dir", spill, "--older-than", "0s", "--no-cluster"])
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", stuck], check=False)
        else:
            os.chmod(stuck, 0o700)
    assert code == 1
    assert os.path.isdir(stuck)
    # The marker went last, so what is left is still a candidate for the next run.
    from hybrid_ray.cleanup import find_spill_orphans

    assert [c.shuffle_id for c in find_spill_orphans([spill]).candidates] == [shuffle]


# ---- the remote tier ----------------------------------------------------------------------
def _remote_setup(remote_path: str, options: dict, fs, root: str) -> str:
    """hybrid_ray data of one shuffle next to a user's data under the same prefix; returns
    the shuffle id."""
    ours = f"shf-{uuid.uuid4().hex[:12]}"
    tier = _remote_tier(remote_path, "job-cafe", options)
    for sub in range(2):
        tier.write(SegmentId(ours, 0, sub, 0), _payload())
    marker = fs.cat_file(f"{root}/job-cafe/{ours}/.hybrid_ray_shuffle")
    user = {
        f"{root}/reports/2024/q1.csv": b"a,b\n1,2\n",
        f"{root}/job-cafe/notes.txt": b"user notes",
        f"{root}/job-cafe/shf-000000000000/sub-00000/m.seg": b"looks like ours, is not",
        # a marker copied into a user's dir of another name: names must match
        f"{root}/job-cafe/shf-222222222222/.hybrid_ray_shuffle": marker,
        f"{root}/job-cafe/shf-222222222222/data": b"user",
        f"{root}/other-job/{ours}/.hybrid_ray_shuffle": marker,  # wrong job
        f"{root}/other-job/{ours}/data": b"user",
    }
    for path, data in user.items():
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
    return ours


def _check_remote_sweep(remote_path: str, options: dict) -> None:
    import fsspec

    from hybrid_ray.cleanup import sweep_remote

    fs, root = fsspec.core.url_to_fs(remote_path, **options)
    ours = _remote_setup(remote_path, options, fs, root)
    before = _snapshot_fs(fs, root)
    assert any(f"/{ours}/sub-" in p for p in before)

    result = sweep_remote(remote_path, older_than_s=0, storage_options=options)

    assert result.errors == []
    assert [p.rstrip("/") for p in result.removed] == [f"{root}/job-cafe/{ours}"]
    after = _snapshot_fs(fs, root)
    assert after == {p: v for p, v in before.items() if not p.startswith(f"{root}/job-cafe/{ours}/")}


def test_remote_sweep_on_a_shared_file_prefix_removes_only_ours(tmp_path):
    """Was: every directory two levels under the prefix was removed, whatever it was."""
    _check_remote_sweep(f"file://{tmp_path}/remote", {})


def test_remote_sweep_on_a_shared_s3_prefix_removes_only_ours(s3_bucket):
    remote_path, options = s3_bucket
    _check_remote_sweep(remote_path, options)


def test_remote_sweep_keeps_an_object_named_like_the_shuffle_s_directory(s3_bucket):
    """On S3 an object may have the key of a shuffle's directory (``job/shf-x``) beside
    the tree below it; it is not hybrid_ray's, and removing the orphaned tree deleted it
    too (a recursive rm of the prefix takes the prefix's own key) (found by a review)."""
    import fsspec

    from hybrid_ray.cleanup import sweep_remote

    remote_path, options = s3_bucket
    fs, root = fsspec.core.url_to_fs(remote_path, **options)
    ours = _remote_setup(remote_path, options, fs, root)
    users = f"{root}/job-cafe/{ours}"
    fs.pipe_file(users, b"a user's object")
    result = sweep_remote(remote_path, older_than_s=0, storage_options=options)
    assert result.errors == [] and len(result.removed) == 1
    fs.invalidate_cache()
    assert fs.cat_file(users) == b"a user's object"
    assert [f for f in fs.find(users) if f != users] == []  # ours all gone

# ---- live shuffles ------------------------------------------------------------------------
def test_a_live_shuffle_survives_cleanup_with_older_than_0(ray_local, tmp_path, s3_bucket):
    """Was: ``--older-than 0s`` deleted a running shuffle's data. The masters of every
    namespace are asked; an orphan of the same age next to it goes."""
    import fsspec
    import ray

    from hybrid_ray import ShuffleConfig
    from hybrid_ray.actors import get_master
    from hybrid_ray.cleanup import find_orphans, live_shuffles, remove

    remote_path, options = s3_bucket
    config = ShuffleConfig(spill_dirs=[str(tmp_path / "spill")], remote_path=remote_path,
                           storage_options=options, progress=False,
                           namespace=f"hr-clean-{uuid.uuid4().hex[:6]}")
    master = get_master(config.namespace)
    live, orphan = f"shf-{uuid.uuid4().hex[:12]}", f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(live, 1, 2, config, False))
    try:
        tier = _remote_tier(remote_path, config.job_id, options)
        for shuffle in (live, orphan):
            _write_disk(config.spill_dirs[0], shuffle)
            tier.write(SegmentId(shuffle, 0, 0, 0), _payload())
        plan = find_orphans(config.spill_dirs, remote_path, options)
        known = live_shuffles(timeout_s=30)
        assert known[live] == config.job_id and orphan not in known
        result = remove(plan, 0, keep=known)
        assert sorted(os.path.basename(p.rstrip("/")) for p in result.removed) == \
            [orphan, orphan]
        assert len(result.kept_live) == 2 and result.errors == []
        fs, root = fsspec.core.url_to_fs(remote_path, **options)
        fs.invalidate_cache()
        assert fs.exists(f"{root}/{config.job_id}/{live}/sub-00000")
        assert not fs.exists(f"{root}/{config.job_id}/{orphan}")
        assert os.path.isdir(os.path.join(config.spill_dirs[0], "hybrid_ray", live, "sub-00001"))
    finally:
        ray.get(master.release.remote(live))


# ---- remote paths fsspec would expand, credentials, bounds, ids with dots ------------------
def test_a_remote_path_with_glob_characters_is_refused_before_anything_is_deleted(tmp_path):
    """fsspec's rm expands * ? [ ] as a glob: with remote_path ".../team[1]", removing a
    shuffle deleted the same shuffle's directory under ".../team1", someone else's data,
    and left its own. Such paths are refused everywhere a remote path enters."""
    import fsspec

    from hybrid_ray import ConfigError, ShuffleConfig
    from hybrid_ray.cleanup import find_remote_orphans
    from hybrid_ray.errors import UnsafePathError
    from hybrid_ray.ids import require_inside_remote

    fs = fsspec.filesystem("memory")
    other = f"/bkt-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{other}/team1/job-a/shf-1/sub-00000/theirs.seg", b"not ours")
    url = f"memory:/{other}/team[1]"
    with pytest.raises(ConfigError, match=r"remote_path 'memory://.*team\[1\]' holds '\[\]'"):
        ShuffleConfig(remote_path=url)
    with pytest.raises(ConfigError, match=r"holds '\[\]', which fsspec expands"):
        _remote_tier(url, "job-a").remove_shuffle_data("shf-1")
    with pytest.raises(ConfigError, match=r"holds '\*'"):
        find_remote_orphans(f"file://{tmp_path}/*")
    with pytest.raises(UnsafePathError, match="which fsspec expands as a glob"):
        require_inside_remote("/bkt/pre?", "/bkt/pre?/job/shf-1", "remove")
    assert fs.cat_file(f"{other}/team1/job-a/shf-1/sub-00000/theirs.seg") == b"not ours"


def test_cleanup_shows_no_credential_of_the_remote_path(capsys, tmp_path):
    """Errors of `hybrid-ray cleanup` quoted the remote path and the library's message
    as they were: credentials in the URL were printed to the terminal."""
    from hybrid_ray.cleanup import find_remote_orphans
    from hybrid_ray.cli import main

    url = "s3://bucket/pre"
    options = {"client_kwargs": {
                   "endpoint_url": "http://AKIAEXAMPLEKEY:SuperSecretValue@127.0.0.1:1"},
               "key": "AKIAEXAMPLEKEY", "secret": "SuperSecretValue",
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
    plan = find_remote_orphans(url, options)
    assert plan.errors and plan.candidates == []
    assert "SuperSecretValue" not in repr(plan.errors)
    assert main(["cleanup", "--no-cluster", "--spill-dir", str(tmp_path),
                 "--remote-path", url, "--storage-options", json.dumps(options)]) == 1
    out = capsys.readouterr()
    assert "could not remove" in out.err
    assert "SuperSecretValue" not in out.out + out.err
    # Credentials written into the URL itself are refused before anything is opened,
    # without being shown (fsspec would take them for part of the bucket's name).
    assert main(["cleanup", "--no-cluster", "--spill-dir", str(tmp_path), "--remote-path",
                 "s3://AKIAEXAMPLEKEY:SuperSecretValue@bucket/pre"]) == 2
    out = capsys.readouterr()
    assert "fsspec does not read credentials from the URL" in out.err
    assert "SuperSecretValue" not in out.out + out.err


def test_cleanup_gives_up_on_an_endpoint_that_never_answers():
    """cleanup opened its filesystem without the remote tier's timeouts and gave its calls
    no deadline: an endpoint that accepts and never answers held it for many minutes."""
    import socket
    import time

    from hybrid_ray.cleanup import find_remote_orphans

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (the kernel does), never answers
    try:
        started = time.monotonic()
        plan = find_remote_orphans(
            "s3://bucket/pre", {"key": "k", "secret": "s", "client_kwargs": {
                "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"}})
        took = time.monotonic() - started
    finally:
        silent.close()
    assert plan.candidates == [] and len(plan.errors) == 1
    assert "cannot list" in plan.errors[0][1]
    # The deadline: 2 x (5 s connect + 5 s read timeout) = 20 s, plus slack for a busy
    # machine; botocore's and s3fs's own defaults and retries waited for minutes.
    assert took < 60, took


def test_a_job_id_with_a_dot_is_cleaned_up_too(tmp_path):
    """Job ids may hold dots (``hybrid_ray.ids``: "etl.daily"); cleanup's own id pattern
    did not, so such a job's orphans were never candidates."""
    from hybrid_ray.cleanup import find_remote_orphans

    remote = f"file://{tmp_path}/remote"
    tier = _remote_tier(remote, "etl.daily")
    tier.write(SegmentId("shf-1", 0, 0, 0), _payload())
    plan = find_remote_orphans(remote)
    assert plan.errors == []
    assert [(c.shuffle_id, c.path) for c in plan.candidates] == [
        ("shf-1", f"{tmp_path}/remote/etl.daily/shf-1")]


class _CutShortFs:
    """An fsspec filesystem whose deletes stop half-way with a timeout (a large tree
    against a slow store), deleting in sorted order as s3fs's batches do."""

    def __init__(self, fs):
        self._fs = fs

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def rm(self, path, recursive=False, **kwargs):
        from fsspec.exceptions import FSTimeoutError

        paths = sorted(p for p in self._fs.expand_path(path, recursive=recursive)
                       if self._fs.isfile(p))
        for p in paths[:max(1, len(paths) // 2)]:
            self._fs.rm_file(p)
        raise FSTimeoutError()


def test_a_remote_removal_cut_short_keeps_the_marker_so_cleanup_finds_it_again(tmp_path):
    """The shuffle marker sorts first, so a recursive delete cut short (a deadline, an
    outage) removed it with the first batch and left the data unmarked: no cleanup would
    ever find it again. The marker now goes last, for cleanup and for the remote tier."""
    import dataclasses

    import fsspec

    from hybrid_ray.cleanup import find_remote_orphans, remove

    fs = fsspec.filesystem("memory")
    remote = f"memory://bkt-{uuid.uuid4().hex[:8]}/pre"
    tier = _remote_tier(remote, "job-a")
    for sub in range(6):
        tier.write(SegmentId("shf-1", 0, sub, 0), _payload())
    plan = find_remote_orphans(remote)
    [candidate] = plan.candidates
    plan.candidates = [dataclasses.replace(candidate, fs=_CutShortFs(fs))]
    result = remove(plan, older_than_s=0)
    assert result.removed == [] and "FSTimeoutError" in result.errors[0][1]
    again = find_remote_orphans(remote)
    assert [c.path for c in again.candidates] == [candidate.path]
    assert remove(again, older_than_s=0).removed == [candidate.path]
    assert not fs.exists(candidate.path)


class _SilentlyFailingFs(_CutShortFs):
    """An fsspec filesystem whose deletes skip one key without an error, as S3's
    DeleteObjects answers 200 with a per-key error that s3fs does not raise."""

    def __init__(self, fs, stuck):
        super().__init__(fs)
        self._stuck = stuck

    def rm(self, path, recursive=False, **kwargs):
        paths = self._fs.expand_path(path, recursive=recursive)
        for p in sorted(paths, reverse=True):
            if p == self._stuck:
                continue
            if self._fs.isfile(p):
                self._fs.rm_file(p)
            elif self._fs.isdir(p):
                try:
                    self._fs.rmdir(p)
                except OSError:
                    pass


def test_a_key_the_store_silently_kept_keeps_the_marker_so_cleanup_finds_it_again(tmp_path):
    """The marker went in the same recursive removal as data keys that S3 silently kept
    (per-key errors are not raised): the removal raised, but what was left had no marker
    and no cleanup would find it again (review of 2026-11-27). The data is looked for
    before the marker goes."""
    import fsspec

    from hybrid_ray.cleanup import find_remote_orphans, remove
    from hybrid_ray.tiers.remote import remove_remote_tree

    fs = fsspec.filesystem("memory")
    remote = f"memory://bkt-{uuid.uuid4().hex[:8]}/pre"
    tier = _remote_tier(remote, "job-a")
    for sub in range(3):
        tier.write(SegmentId("shf-1", 0, sub, 0), _payload())
    [candidate] = find_remote_orphans(remote).candidates
    stuck = sorted(f for f in fs.find(candidate.path) if f.endswith(".seg"))[1]
    with pytest.raises(OSError, match="still under the shuffle's remote directory after "
                                      "deleting them, first .*; its marker stays"):
        remove_remote_tree(_SilentlyFailingFs(fs, stuck), candidate.path)
    assert [f for f in fs.find(candidate.path) if f.endswith(".seg")] == [stuck]
    again = find_remote_orphans(remote)
    assert [c.path for c in again.candidates] == [candidate.path]
    assert remove(again, older_than_s=0).removed == [candidate.path]
    assert not fs.exists(candidate.path)


# ---- what another user could do; a removal cut short ----------------------------------------
def test_a_spill_data_dir_others_can_write_is_reported_not_swept(tmp_path):
    """Cleanup (often run as root) removed marked directories of any ``hybrid_ray`` data
    dir, whoever could write it: another user could then swap a shuffle directory for a
    symlink while it was being removed and have the removal go on elsewhere. Such a data
    dir is held to the rules a shuffle's own writes are held to, and left alone."""
    from hybrid_ray.cleanup import find_spill_orphans, remove

    spill = str(tmp_path / "spill")
    shuffle = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, shuffle)
    data_dir = os.path.join(spill, "hybrid_ray")
    os.chmod(data_dir, 0o777)
    plan = find_spill_orphans([spill])
    assert plan.candidates == []
    [(path, why)] = plan.errors
    assert path == data_dir and why.startswith("not swept: ") and "mode 777" in why
    assert remove(plan, 0).errors == plan.errors  # reported: the command fails
    assert os.path.isdir(os.path.join(data_dir, shuffle, "sub-00000"))
    os.chmod(data_dir, 0o700)
    assert [c.shuffle_id for c in find_spill_orphans([spill]).candidates] == [shuffle]


def test_a_local_remote_tree_others_can_write_is_reported_not_swept(tmp_path):
    """The same for a remote tier on the local filesystem (a shared mount): fsspec removes
    file by file and follows a directory swapped for a symlink meanwhile."""
    from hybrid_ray.cleanup import find_remote_orphans

    root = tmp_path / "remote"
    shuffle = f"shf-{uuid.uuid4().hex[:12]}"
    tier = _remote_tier(f"file://{root}", "job-cafe")
    tier.write(SegmentId(shuffle, 0, 0, 0), _payload())
    shuffle_dir = root / "job-cafe" / shuffle
    assert [c.shuffle_id for c in find_remote_orphans(f"file://{root}").candidates] == [shuffle]
    os.chmod(shuffle_dir, 0o777)
    plan = find_remote_orphans(f"file://{root}")
    assert plan.candidates == []
    [(path, why)] = plan.errors
    assert path.rstrip("/").endswith(f"job-cafe/{shuffle}")
    assert "writable by other users (mode 777)" in why


def test_a_removal_cut_short_is_finished_by_the_next_run_whatever_its_age_limit(tmp_path):
    """A removal that failed part-way unlinked some files, which made the shuffle
    directory's mtime "now": the next run, once the cause was fixed, kept the rest as
    recent for --older-than (6 h by default) and reported success. Age is the newest
    file's, not a directory's."""
    from hybrid_ray.cleanup import find_spill_orphans, remove

    spill = str(tmp_path / "spill")
    shuffle = f"shf-{uuid.uuid4().hex[:12]}"
    _write_disk(spill, shuffle, subs=3)
    tree = os.path.join(spill, "hybrid_ray", shuffle)
    day_ago = os.path.getmtime(tree) - 86400
    for d, dirs, files in os.walk(tree):
        for name in dirs + files:
            os.utime(os.path.join(d, name), (day_ago, day_ago))
    os.utime(tree, (day_ago, day_ago))
    # What a first, failed run leaves: one subpartition gone, the directory touched now.
    shutil.rmtree(os.path.join(tree, "sub-00000"))
    result = remove(find_spill_orphans([spill]), older_than_s=6 * 3600)
    assert result.kept_recent == [] and result.errors == []
    assert [os.path.basename(p) for p in result.removed] == [shuffle]
    assert not os.path.exists(tree)


def test_asking_which_shuffles_are_live_is_bounded_when_the_gcs_never_answers(monkeypatch):
    """``live_shuffles`` bounded only the masters' answers: listing the named actors and
    looking a master up were left to Ray's own GCS retries, which outlast ``--timeout``
    by minutes against a GCS that accepts and never answers."""
    import threading
    import time

    import ray

    from hybrid_ray.cleanup import live_shuffles

    never = threading.Event()
    monkeypatch.setattr(ray.util, "list_named_actors",
                        lambda all_namespaces=False: never.wait(60) or [])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="the cluster's GCS listing its named actors did "
                                           "not answer within 0.5 s"):
        live_shuffles(timeout_s=0.5)
    assert time.monotonic() - start < 5
    # A lookup of one master that never answers is bounded the same way.
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [
        {"name": "hybrid_ray_shuffle_master", "namespace": "team1"}])
    monkeypatch.setattr(ray, "get_actor", lambda *a, **kw: never.wait(60))
    from hybrid_ray.actors import MASTER_NAME

    assert MASTER_NAME == "hybrid_ray_shuffle_master"
    with pytest.raises(TimeoutError, match="looking up the shuffle master of namespace "
                                           "'team1'"):
        live_shuffles(timeout_s=0.5)
    never.set()
