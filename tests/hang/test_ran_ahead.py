"""A rank that skipped a collective on NCCL runs ahead: real H200 bundles (fixtures/bundles/...-skip-ran-ahead)."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = FIXTURES / "bundles" / "nccl-2.28.9-h200-skip-ran-ahead"


@pytest.mark.parametrize(
    ("shape", "culprits", "waiting"),
    [("pp_1f1b_skip_r1", [1], "rank 0 waits in"), ("fsdp2_tp_skip_r3", [3], "rank 0, 1, 2 wait in")],
)
def test_the_rank_that_ran_ahead_is_named_not_the_ranks_waiting_for_it(
    shape: str, culprits: list[int], waiting: str
) -> None:
    (bundle,) = BUNDLES.glob(f"{shape}_after-*.tar.gz")
    report = analyze_paths([str(bundle)])
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, culprits)
    assert report.summary.startswith(f"Rank {culprits[0]} never started collective #201 (AllReduce count=1 Float)")
    assert waiting in report.summary
    rows = {row.rank: row.status for row in report.ranks}
    assert rows[culprits[0]] == "behind" and {s for r, s in rows.items() if r not in culprits} == {"waiting"}
