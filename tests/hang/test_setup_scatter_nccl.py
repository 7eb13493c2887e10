"""A tensor-parallel job's set-up scatter on NCCL is one operation, and a completed one holds nothing up (a real
H200 bundle paged as a mismatch 3 s into the run; tests/fixtures/bundles/nccl-2.28.9-h200-tp-setup-scatter)."""

from __future__ import annotations

from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLE = FIXTURES / "bundles" / "nccl-2.28.9-h200-tp-setup-scatter"


def test_the_set_up_scatter_is_no_mismatch() -> None:
    report = analyze_paths([str(p) for p in BUNDLE.glob("*.tar.gz")])
    assert report.verdict != Verdict.collective_mismatch, report.summary
    assert report.suspect_ranks == []
    # Every rank completed everything it issued; the stacks (NCCL connecting its next communicator) are what is left.
    assert "completed on every rank: nothing is pending" in report.summary
