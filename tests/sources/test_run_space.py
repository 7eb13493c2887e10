"""The run folder's NCCL files freed behind the reader: real files, real holes punched on the test's folder.

The writer holds its file open and writes at its own offset, as NCCL does; the lines are a real capture's
(``tests/fixtures/nccl-2.28.9-2gpu/mismatch``, 2 x H200, NCCL 2.28.9).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from ncclwatch.watchdog.events import OpBatch, Unusable
from ncclwatch.watchdog.evidence.logs import read_tail
from ncclwatch.watchdog.sources.files import NcclFileSource, TransportReader
from ncclwatch.watchdog.sources.holes import punch_problem, retained_start
from ncclwatch.watchdog.sources.run_space import (
    HEAD_BYTES,
    KEEP_BYTES,
    MIB,
    MIN_KEEP_BYTES,
    RunFolderSpace,
)

CAPTURE = Path(__file__).parents[1] / "fixtures" / "nccl-2.28.9-2gpu" / "mismatch" / "nccl" / "nccl.vm.714.log"


def capture_parts() -> tuple[bytes, list[bytes]]:
    """(the lines before the first operation: version, Init, transports; the operation lines)."""
    lines = CAPTURE.read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if b": opCount " in line)
    return b"".join(lines[:first]), [line for line in lines[first:] if b": opCount " in line]


class Writer:
    """Appends real NCCL lines through one open descriptor, as NCCL's line-buffered FILE does."""

    def __init__(self, path: Path) -> None:
        self.head, self.ops = capture_parts()
        self.handle = path.open("wb", buffering=0)
        self.handle.write(self.head)
        self.written_ops = 0

    def write_ops(self, nbytes: int) -> None:
        block = b"".join(self.ops)
        rounds = max(1, nbytes // len(block))
        self.handle.write(block * rounds)
        self.written_ops += rounds * len(self.ops)

    def close(self) -> None:
        self.handle.close()


def run_folder(tmp_path: Path, cap_bytes: int = 256 * MIB) -> Path:
    (tmp_path / "nccl").mkdir()
    RunFolderSpace.declare(tmp_path, cap_bytes)
    return tmp_path


def ops_in(events: list) -> int:
    return sum(len(e.sigs) + len(e.p2p) for e in events if isinstance(e, OpBatch))


def disk(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.fixture
def punchable(tmp_path: Path) -> Path:
    problem = punch_problem(tmp_path)
    if problem:
        pytest.skip(problem)
    return tmp_path


class TestFreedBehindTheReader:
    def test_a_long_file_takes_head_and_window_only_and_every_operation_is_read(self, punchable: Path) -> None:
        root = run_folder(punchable)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        source = NcclFileSource(root / "nccl")
        events: list = []
        for _ in range(12):  # 12 x 2 MiB, read after each write
            writer.write_ops(2 * MIB)
            source.poll(events.append)
        assert path.stat().st_size > 20 * MIB
        assert disk(path) <= HEAD_BYTES + KEEP_BYTES + 3 * MIB  # head, window, the last write's backlog
        assert ops_in(events) == writer.written_ops
        assert not [e for e in events if isinstance(e, Unusable)]
        writer.close()

    def test_the_head_and_the_bundles_tail_are_kept_byte_for_byte(self, punchable: Path) -> None:
        root = run_folder(punchable)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        source = NcclFileSource(root / "nccl")
        for _ in range(6):
            writer.write_ops(2 * MIB)
            source.poll(lambda event: None)
        data = path.read_bytes()
        assert data.startswith(writer.head)
        tail, size = read_tail(path, 256 * 1024)
        assert size == len(data) and b"\0" not in tail and tail.count(b": opCount ") > 1000
        assert b"\0" * 4096 in data  # the middle was freed: it reads as zeros
        writer.close()

    def test_nccl_goes_on_writing_at_its_offset_after_a_punch(self, punchable: Path) -> None:
        root = run_folder(punchable)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        source = NcclFileSource(root / "nccl")
        writer.write_ops(4 * MIB)
        source.poll(lambda event: None)
        size = path.stat().st_size
        writer.handle.write(writer.ops[0])
        assert path.stat().st_size == size + len(writer.ops[0])
        events: list = []
        source.poll(events.append)
        assert ops_in(events) == 1
        writer.close()

    def test_a_reader_new_to_a_freed_file_starts_at_a_line_after_the_hole(self, punchable: Path) -> None:
        root = run_folder(punchable)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        first = NcclFileSource(root / "nccl")
        for _ in range(4):
            writer.write_ops(2 * MIB)
            first.poll(lambda event: None)
        again = NcclFileSource(root / "nccl", space=None)  # the sidecar started again
        events: list = []
        again.poll(events.append)
        again.poll(events.append)
        kept_ops = path.read_bytes()[retained_start(os.open(path, os.O_RDONLY)) :].count(b": opCount ")
        assert ops_in(events) >= kept_ops  # the head's operations, then the kept tail's, none garbled
        assert not [e for e in events if isinstance(e, Unusable)]
        writer.close()

    def test_the_transport_reader_reads_the_head_then_skips_what_was_freed(self, punchable: Path) -> None:
        root = run_folder(punchable)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        source = NcclFileSource(root / "nccl")
        for _ in range(4):
            writer.write_ops(2 * MIB)
            source.poll(lambda event: None)
        unbounded = TransportReader(root / "nccl").facts()
        assert unbounded  # the capture's transport lines are in the kept head
        writer.close()


class TestWhereFreeingStops:
    def test_a_folder_without_a_space_file_is_never_written(self, tmp_path: Path) -> None:
        (tmp_path / "nccl").mkdir()
        path = tmp_path / "nccl" / "vm.714"
        writer = Writer(path)
        writer.write_ops(6 * MIB)
        source = NcclFileSource(tmp_path / "nccl")
        source.poll(lambda event: None)
        assert source.space is None
        assert disk(path) >= path.stat().st_size - 4096
        writer.close()

    def test_a_filesystem_that_refuses_is_said_once_and_reading_goes_on(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        def refuse(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

        root = run_folder(tmp_path)
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        source = NcclFileSource(root / "nccl", space=RunFolderSpace(root, punch=refuse))
        events: list = []
        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            for _ in range(4):
                writer.write_ops(2 * MIB)
                source.poll(events.append)
        said = [r for r in caplog.records if "cannot free NCCL debug files" in r.getMessage()]
        assert len(said) == 1 and "grows with the job" in said[0].getMessage()
        assert ops_in(events) == writer.written_ops
        assert disk(path) >= path.stat().st_size - 4096
        writer.close()

    def test_over_the_cap_heads_go_then_files_of_gone_processes(
        self, punchable: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        cap = 640 << 10  # under what two files' kept tails take: one must go
        root = run_folder(punchable, cap_bytes=cap)
        old = root / "nccl" / "vm.500"  # an earlier restart's rank: nobody writes it any more
        old.write_bytes(os.urandom(3 * MIB))
        path = root / "nccl" / "vm.714"
        writer = Writer(path)
        now = [0.0]
        space = RunFolderSpace(root, cap_bytes=cap, clock=lambda: now[0])
        source = NcclFileSource(root / "nccl", space=space)
        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            for _ in range(4):
                writer.write_ops(2 * MIB)
                source.poll(lambda event: None)
                now[0] += 700.0  # past STALE_S: the file that stopped growing is an earlier restart's
        assert not old.exists() and path.exists()
        assert space.head_bytes == 0 and space.keep_bytes == MIN_KEEP_BYTES
        assert space.used_bytes is not None and space.used_bytes <= cap
        assert any("over its cap" in r.getMessage() for r in caplog.records)
        tail, _ = read_tail(path, 256 * 1024)
        assert b"\0" not in tail
        writer.close()


def test_tmpfs_punches_too() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    assert punch_problem(shm) is None
