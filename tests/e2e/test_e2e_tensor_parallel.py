"""End to end on CPU (issue 30): tensor parallel on two gloo ranks under the real wrapper, rank 1 asleep in Python.

The job (``tests/data/flight_recorder/make_tp_dumps.py``) sets up ``parallelize_module`` with ColwiseParallel and
RowwiseParallel on a 1-D mesh, which scatters each sharded weight from rank 0: gloo records the whole input on
rank 0 and none on rank 1. At step 20 rank 1 sleeps while rank 0 waits in the step's first all_reduce. The watchdog
paged that as a mismatch at the set-up's scatter, with no culprit; it must name rank 1, behind, and say the same
offline from the kept run folder and the bundle. ``--stall-timeout 5`` skips the warm-up timeout (300 s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import DATA
from support import assert_offline_parity, only_report, run_watched

from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

pytest.importorskip("torch")
JOB = DATA / "flight_recorder" / "make_tp_dumps.py"


def test_tensor_parallel_rank_asleep_after_the_set_up_scatter_is_behind(tmp_path: Path) -> None:
    job = [str(JOB), "--steps", "40", "--stuck-rank", "1", "--stuck-step", "20"]
    done = run_watched(tmp_path, job, "--stall-timeout", "5", "--on-hang", "kill", nproc=2)
    assert done.returncode == EXIT_KILLED_ON_HANG, done.stderr[-3000:]
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"], report["position"]) == ("rank_behind", [1], 45), report[
        "summary"
    ]
    [asleep] = [n for n, text in enumerate(JOB.read_text().splitlines(), 1) if re.search(r"time\.sleep\(", text)]
    # Where the rank is now (py-spy), beside its last recorded call site (Flight Recorder's frames)
    assert f"now at make_tp_dumps.py:{asleep} in main()" in report["headline"], report["headline"]
    assert not any("Scatter" in e["fact"] for e in report["evidence"])
    assert_offline_parity(tmp_path, report)
