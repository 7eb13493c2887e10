"""A rank behind in one communicator because it waits in a pipeline's recv is not the cause (real gloo bundles)."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = FIXTURES / "bundles" / "gloo-2.13-cpu-pp-dp-stuck-r0"


@pytest.mark.parametrize("order", [("node0", "node1"), ("node1", "node0")])
def test_the_rank_in_its_own_code_is_named_whichever_node_comes_first(order: tuple[str, str]) -> None:
    paths = [str(next(BUNDLES.glob(f"{node}-*.tar.gz"))) for node in order]
    report = analyze_paths(paths)
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
    rows = {row.rank: row for row in report.ranks}
    assert "Fault.at" in (rows[0].stack or "")
    assert "forward_backward (shapes_job.py:272)" in (rows[3].stack or "")  # the schedule's recv, under its step


def test_one_nodes_bundle_alone_names_no_rank_when_the_one_behind_waits_for_an_unseen_peer() -> None:
    """Node 1's bundle alone: rank 3 waits in the schedule's recv for rank 0, which is in no input; rank 2, the
    only other rank seen, waits in the all-reduce and never owed rank 3 a send."""
    report = analyze_paths([str(next(BUNDLES.glob("node1-*.tar.gz")))])
    assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])
    assert "Rank 3 never entered AllReduce" in report.summary
    assert "ranks 0, 1 of the job are in no input given" in report.summary
    assert any(m.startswith("ranks 0, 1: no input") for m in report.missing), report.missing
