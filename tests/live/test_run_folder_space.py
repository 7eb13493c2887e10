"""Where the run folder goes, what it says at start, and how many bundles a node keeps."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.live.bundle_retention import prune_bundles
from ncclwatch.watchdog.live.runfolder import filesystem_type, make_run_folder, space_note
from ncclwatch.watchdog.sources.run_space import SPACE_FILE, RunFolderSpace

SHM = Path("/dev/shm")


class TestRunFolderPlace:
    def test_default_is_a_new_folder_on_disk_with_its_cap(self, tmp_path: Path) -> None:
        out = io.StringIO()
        root = make_run_folder(Settings(run_folder_cap_mib=64), out=out, disk_temp=tmp_path)
        assert root.parent == tmp_path and root.name.startswith("ncclwatch-")
        space = RunFolderSpace.of(root)
        assert space is not None and space.cap_bytes == 64 << 20
        assert out.getvalue() == ""  # on disk, room to spare, holes punch: nothing to say

    def test_a_tmpfs_temp_is_not_chosen_by_default(self, tmp_path: Path) -> None:
        if filesystem_type(SHM) != "tmpfs" or not os.access(SHM, os.W_OK):
            pytest.skip("no writable tmpfs at /dev/shm")
        root = make_run_folder(Settings(), out=io.StringIO(), disk_temp=SHM)
        try:
            assert not str(root).startswith(str(SHM))
        finally:
            (root / SPACE_FILE).unlink()
            root.rmdir()

    def test_a_given_folder_in_memory_is_said_once(self, tmp_path: Path) -> None:
        if filesystem_type(SHM) != "tmpfs" or not os.access(SHM, os.W_OK):
            pytest.skip("no writable tmpfs at /dev/shm")
        given = SHM / f"ncclwatch-test-{os.getpid()}"
        out = io.StringIO()
        try:
            root = make_run_folder(Settings(run_dir=given), out=out)
            assert root == given
            lines = out.getvalue().splitlines()
            assert len(lines) == 1 and "in memory (tmpfs)" in lines[0] and str(given) in lines[0]
        finally:
            (given / SPACE_FILE).unlink(missing_ok=True)
            given.rmdir()

    def test_less_free_space_than_the_cap_is_said(self, tmp_path: Path) -> None:
        stats = os.statvfs(tmp_path)
        more_than_free = stats.f_bavail * stats.f_frsize + (1 << 30)
        note = space_note(tmp_path, more_than_free)
        assert note is not None and "MiB free, under its cap" in note

    def test_enough_room_on_disk_says_nothing(self, tmp_path: Path) -> None:
        assert space_note(tmp_path, 1 << 20) is None


def bundle(folder: Path, name: str, size: int, age_s: float) -> Path:
    path = folder / f"{name}.tar.gz"
    path.write_bytes(os.urandom(size))
    stamp = 1_700_000_000 - age_s
    os.utime(path, (stamp, stamp))
    return path


class TestBundleRetention:
    def test_beyond_the_count_the_oldest_go(self, tmp_path: Path) -> None:
        paths = [bundle(tmp_path, f"job-{i}", 4096, age_s=100 - i) for i in range(5)]  # job-4 newest
        deleted = prune_bundles(tmp_path, keep_count=3, max_bytes=1 << 30, written=paths[4])
        assert sorted(deleted) == sorted(paths[:2])
        assert all(p.exists() for p in paths[2:])

    def test_beyond_the_bytes_the_oldest_go(self, tmp_path: Path) -> None:
        paths = [bundle(tmp_path, f"job-{i}", 64 << 10, age_s=100 - i) for i in range(4)]
        deleted = prune_bundles(tmp_path, keep_count=100, max_bytes=140 << 10, written=paths[3])
        assert sorted(deleted) == sorted(paths[:2])

    def test_the_bundle_just_written_stays_even_alone_over_the_cap(self, tmp_path: Path) -> None:
        older = bundle(tmp_path, "job-old", 4096, age_s=10)
        written = bundle(tmp_path, "job-new", 256 << 10, age_s=20)  # mtime older than its neighbour
        deleted = prune_bundles(tmp_path, keep_count=1, max_bytes=64 << 10, written=written)
        assert deleted == [older] and written.exists()

    def test_staging_folders_partial_packs_and_other_files_are_left_alone(self, tmp_path: Path) -> None:
        written = bundle(tmp_path, "job-new", 4096, age_s=0)
        partial = tmp_path / ".job-x.tar.gz.partial"
        partial.write_bytes(b"x")
        hidden = bundle(tmp_path, ".job-staging", 4096, age_s=500)
        notes = tmp_path / "notes.txt"
        notes.write_text("mine")
        assert prune_bundles(tmp_path, keep_count=1, max_bytes=1 << 30, written=written) == []
        assert partial.exists() and hidden.exists() and notes.exists()
