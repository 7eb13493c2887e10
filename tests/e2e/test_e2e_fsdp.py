"""End to end on CPU: FSDP2 on two gloo ranks under the real wrapper (issue #23's job, bench/fsdp_job.py).

Rank 1 skips the step's logging all_reduce; its next collective is the next step's first all_gather,
which meets rank 0's all_reduce, and gloo hangs. Two ranks split evenly: the step the communicator
repeats (15 collectives of FSDP2, most of them identical all_gathers and reduce_scatters) must name
rank 1, with the line of each side's call that Flight Recorder recorded. The skip comes at step 40:
before 8 steps of progress the stall timeout is the warm-up one (300 s). A healthy FSDP2 run beside it
must exit cleanly with nothing to say.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from support import assert_offline_parity, only_report, run_watched

from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

pytest.importorskip("torch")
JOB = REPO / "bench" / "fsdp_job.py"


def line_of(pattern: str) -> int:
    """The line of bench/fsdp_job.py that matches ``pattern`` (the job's own call sites, not copied numbers)."""
    [line] = [n for n, text in enumerate(JOB.read_text().splitlines(), 1) if re.search(pattern, text)]
    return line


def run(tmp_path: Path, *job_args: str) -> subprocess.CompletedProcess[str]:
    job = [str(JOB), "--device", "cpu", "--blocks", "4", "--width", "64", "--mark-dir", str(tmp_path / "run")]
    return run_watched(tmp_path, [*job, *job_args], "--on-hang", "kill", nproc=2)


def test_fsdp2_rank_skipping_the_logging_all_reduce_is_named_with_its_line(tmp_path: Path) -> None:
    done = run(tmp_path, "--steps", "90", "--skip-rank", "1", "--skip-step", "40")
    assert done.returncode == EXIT_KILLED_ON_HANG, done.stderr[-3000:]
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("collective_mismatch", [1])
    logged, forward = line_of(r"dist\.all_reduce\(logged\)"), line_of(r"logits = model\(")
    assert (
        f"rank 1 skipped AllReduce count=1 Float at fsdp_job.py:{logged}, which every step issues once"
        in report["reason"]
    )
    assert f"it is already at AllGather count=65536 BFloat16 at fsdp_job.py:{forward}" in report["reason"]
    sites = {row["rank"]: row["call_site"] for row in report["ranks"]}
    assert sites[0].endswith(f"fsdp_job.py:{logged})") and sites[1].endswith(f"fsdp_job.py:{forward})"), sites
    assert f"issued from fsdp_job.py:{forward} in main()" in report["headline"]
    assert f"its peers issued theirs from fsdp_job.py:{logged} in main()" in report["headline"]
    assert_offline_parity(tmp_path, report)


def test_healthy_fsdp2_job_exits_zero_without_a_bundle(tmp_path: Path) -> None:
    done = run(tmp_path, "--steps", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "bundles").exists()
    said = [
        line for line in done.stderr.splitlines() if line.startswith("ncclwatch:") and "run folder kept" not in line
    ]
    assert not said, said  # nothing to say about a healthy job (--run-dir keeps the folder, and says where)
