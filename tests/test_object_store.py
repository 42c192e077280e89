"""Object-store warm-up (``hybrid_ray.object_store``): pages of a shared-memory file really
allocated, contents untouched, the store's mapping found among a process's mappings."""

from __future__ import annotations

import mmap
import os
import threading
import uuid

import pytest

from hybrid_ray.object_store import (
    DEFAULT_WARM_UP_BYTES, ObjectStoreWarmUp, default_warm_up_bytes, filesystem_type,
    object_store_mapping, populate,
)

MiB = 1 << 20


@pytest.fixture
def shm_file():
    """A 32 MiB shared-memory file (tmpfs: pages are allocated when written) and a shared
    mapping of it, as Ray's object store is."""
    path = f"/dev/shm/hybrid-ray-test-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 32 * MiB)
        mapped = mmap.mmap(fd, 32 * MiB, mmap.MAP_SHARED)
        yield path, fd, mapped
        mapped.close()
    finally:
        os.close(fd)
        os.unlink(path)
    assert not os.path.exists(path)


def _address(mapped: mmap.mmap) -> int:
    import ctypes

    view = (ctypes.c_char * 1).from_buffer(mapped)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _allocated_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_populate_allocates_the_pages_and_leaves_their_content_alone(shm_file):
    _, fd, mapped = shm_file
    mapped[5 * MiB:5 * MiB + 5] = b"hello"  # an "object" already stored
    assert _allocated_bytes(fd) <= MiB  # only the pages written so far
    assert populate(_address(mapped), 24 * MiB, chunk_bytes=4 * MiB) == 24 * MiB
    assert _allocated_bytes(fd) >= 24 * MiB
    assert _allocated_bytes(fd) < 32 * MiB  # not past what was asked
    assert mapped[5 * MiB:5 * MiB + 5] == b"hello"
    assert mapped[20 * MiB:20 * MiB + 4] == b"\0\0\0\0"


def test_a_stopped_populate_allocates_nothing_more(shm_file):
    _, fd, mapped = shm_file
    stop = threading.Event()
    stop.set()
    assert populate(_address(mapped), 24 * MiB, stop) == 0
    assert _allocated_bytes(fd) == 0


def test_the_object_store_mapping_is_the_largest_shared_plasma_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000100000 rw-s 00000000 00:1b 377      /dev/shm/plasmaSMALL (deleted)\n"
        "7f0243d60000-7f0404000000 rw-s 00000000 00:1b 378      /dev/shm/plasmaKY3X9g (deleted)\n"
        "7f1000000000-7f2000000000 rw-p 00000000 00:1b 379      /dev/shm/plasmaPRIVATE\n"
        "7f3000000000-7f4000000000 rw-s 00000000 00:1b 380      /dev/shm/other-big-file\n"
        "55d5c0000000-55d5c0021000 rw-p 00000000 00:00 0        [heap]\n")
    assert object_store_mapping(str(maps)) == (0x7f0243d60000, 0x7f0404000000,
                                               "/dev/shm/plasmaKY3X9g")
    maps.write_text("55d5c0000000-55d5c0021000 rw-p 00000000 00:00 0        [heap]\n")
    assert object_store_mapping(str(maps)) is None
    assert object_store_mapping(str(tmp_path / "missing")) is None


def test_the_default_is_half_the_store_at_most_4_gib():
    assert default_warm_up_bytes(2 << 30) == 1 << 30
    assert default_warm_up_bytes(100 << 30) == DEFAULT_WARM_UP_BYTES == 4 << 30
    assert default_warm_up_bytes(0) == 0


def test_a_process_without_an_object_store_says_so_and_warms_nothing(tmp_path):
    maps = tmp_path / "maps"  # a process that never connected to Ray's object store
    maps.write_text("55d5c0000000-55d5c0021000 rw-p 00000000 00:00 0        [heap]\n")
    warm_up = ObjectStoreWarmUp(maps_path=str(maps))
    assert warm_up.start(16 * MiB)
    assert not warm_up.start(16 * MiB)  # once per process
    assert warm_up.wait(10)
    state = warm_up.state()
    assert state["done"] and state["warmed_bytes"] == 0
    assert "no mapping of the object store" in state["error"]


MOUNTINFO = (
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k\n"
    "31 27 0:30 / /mnt/huge rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M\n")


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    assert filesystem_type("/dev/shm", str(mountinfo)) == "tmpfs"
    assert filesystem_type("/dev/shmem", str(mountinfo)) == "ext4"  # not below /dev/shm
    assert filesystem_type("/tmp", str(mountinfo)) == "ext4"
    assert filesystem_type("/mnt/huge/x", str(mountinfo)) == "hugetlbfs"
    assert filesystem_type("/tmp", str(tmp_path / "missing")) is None


def test_a_store_in_a_disk_backed_file_is_not_warmed(tmp_path):
    """Ray keeps its store in /tmp when /dev/shm is too small (containers): populating that
    mapping would write gigabytes to disk, so the warm-up refuses and says why."""
    maps, mountinfo = tmp_path / "maps", tmp_path / "mountinfo"
    maps.write_text("7f0243d60000-7f0404000000 rw-s 00000000 fe:00 378      "
                    "/tmp/plasmaKY3X9g (deleted)\n")
    mountinfo.write_text(MOUNTINFO)
    warm_up = ObjectStoreWarmUp(maps_path=str(maps), mountinfo_path=str(mountinfo))
    assert warm_up.start(16 * MiB)
    assert warm_up.wait(10)
    state = warm_up.state()
    assert state["warmed_bytes"] == 0
    assert "a file on ext4 filesystem (/tmp/plasmaKY3X9g)" in state["error"]
    assert "nothing warmed" in state["error"]
