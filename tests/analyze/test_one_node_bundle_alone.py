"""One node's bundle of a two-wrapper job, analyzed alone (the H200's pipeline x DP run,
tests/fixtures/bundles/nccl-2.28.9-h200-pp-dp-skip-ran-ahead): its journal makes the state live, but the other
node's ranks were never asked from this one, so their missing dumps blame no one."""

from __future__ import annotations

from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths

BUNDLES = FIXTURES / "bundles" / "nccl-2.28.9-h200-pp-dp-skip-ran-ahead"


def test_the_other_nodes_ranks_are_not_named_for_leaving_no_dump() -> None:
    [node0] = BUNDLES.glob("node0-*.tar.gz")
    report = analyze_paths([str(node0)])
    assert report.culprit_ranks == [], report.summary
    assert "no dump of rank 2, 3 was given" in report.summary


def test_both_nodes_bundles_still_name_the_rank_that_ran_ahead() -> None:
    report = analyze_paths([str(p) for p in sorted(BUNDLES.glob("*.tar.gz"))])
    assert report.culprit_ranks == [3], report.summary
