"""End to end on CPU: both ranks call ``recv`` first (a real gloo p2p deadlock) under the real wrapper.

gloo's Flight Recorder records no send/recv, so the sequences show every
collective completed; the stacks (py-spy) show every rank blocked in
``recv``: that is ``p2p_deadlock`` naming both ranks, not a rank "stuck in
a collective" with no culprit (what the watchdog said before).  The same
verdict comes offline from the kept run folder and the bundle.  The fault
comes at step 40: before the job has shown 8 steps of progress the stall
timeout is the warm-up one (300 s), and on two busy cores the sidecar's
first look at the heartbeats can come several steps in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from support import assert_offline_parity, only_report, run_watched

from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

pytest.importorskip("torch")


def test_both_ranks_receiving_first_is_a_p2p_deadlock_naming_both(tmp_path: Path) -> None:
    job = [str(REPO / "bench" / "gpu_job.py"), "--device", "cpu", "--size", "tiny", "--steps", "90"]
    job += ["--fault", "p2p_deadlock", "--fault-step", "40", "--mark-dir", str(tmp_path / "run")]
    done = run_watched(tmp_path, job, "--on-hang", "kill", nproc=2)
    assert done.returncode == EXIT_KILLED_ON_HANG, done.stderr[-3000:]
    assert "P2P DEADLOCK" in done.stderr
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("p2p_deadlock", [0, 1])
    assert "all wait in recv, called from" in report["summary"] and "gpu_job.py" in report["summary"]
    assert_offline_parity(tmp_path, report)
