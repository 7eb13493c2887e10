"""A collective completed on some ranks and only 'scheduled' on another is no hang: an all-reduce completes on no
rank before every rank's part has run (real gloo bundles of a false page during a pause)."""

from __future__ import annotations

from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = FIXTURES / "bundles" / "gloo-2.13-cpu-pause-lagging-record"


def test_a_pause_with_one_lagging_record_is_a_pause_not_a_stuck_collective() -> None:
    report = analyze_paths([str(p) for p in sorted(BUNDLES.glob("*.tar.gz"))])
    # The bundle's stall with every rank outside communication: a pause, paged only after the progress timeout.
    assert report.verdict == Verdict.progress_stalled, report.summary
    assert report.culprit_ranks == []
    assert any("rank 2: collective #54 is scheduled, completed on another rank" in e.fact for e in report.evidence)
