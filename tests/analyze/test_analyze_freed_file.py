"""``ncclwatch analyze`` on a run folder's NCCL file freed at its start reads the kept tail alone, never zeros."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.sources.holes import punch_hole, punch_problem, retained_start

CAPTURE = Path(__file__).parents[1] / "fixtures" / "nccl-2.28.9-2gpu" / "mismatch" / "nccl" / "nccl.vm.714.log"


def test_a_freed_file_is_read_from_its_kept_tail(tmp_path: Path) -> None:
    if punch_problem(tmp_path):
        pytest.skip(punch_problem(tmp_path))
    lines = CAPTURE.read_bytes().splitlines(keepends=True)
    ops = b"".join(line for line in lines if b": opCount " in line)
    path = tmp_path / "nccl.vm.714.log"
    path.write_bytes(b"".join(lines) + ops * 40)
    fd = os.open(path, os.O_RDWR)
    try:
        punch_hole(fd, 0, (path.stat().st_size - (256 << 10)) // 4096 * 4096)
        start = retained_start(fd)
    finally:
        os.close(fd)
    assert 0 < start < path.stat().st_size and path.read_bytes()[start - 1 : start] == b"\n"
    report = analyze_paths([str(path)])
    assert report.inputs[0].kinds  # read as NCCL lines: the kept tail's operations, without their Init line
    assert "garbled" not in (report.inputs[0].note or "")
