"""``analyze`` on the files of jobs that died (issue 44): real captures, tests/fixtures/failures/README.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

FAILURES = FIXTURES / "failures"
SHARED = Path("/work/shared/fixtures/nccl-2.28.9-2gpu")


@pytest.mark.parametrize(
    ("name", "verdict", "culprits", "kind"),
    [
        ("gloo-2.13-raise.txt", Verdict.process_dead, [1], "user_exception"),
        ("gloo-2.13-sigkill.txt", Verdict.process_dead, [1], "signal"),
        ("gloo-2.13-exit.txt", Verdict.no_hang, [], "exit"),  # sys.exit(3): the program chose to stop
        # torchrun names rank 0 (it timed out first); rank 1 never entered the all_reduce
        ("gloo-2.13-timeout.txt", Verdict.collective_timeout, [1], None),
    ],
)
def test_the_rank_that_departed_first_is_named(name: str, verdict: Verdict, culprits: list[int], kind: str) -> None:
    report = analyze_paths([str(FAILURES / name)])
    assert (report.verdict, report.culprit_ranks, report.kind) == (verdict, culprits, kind), report.summary


def test_the_users_own_exception_is_said_with_its_frame_not_as_a_collective_fault() -> None:
    report = analyze_paths([str(FAILURES / "gloo-2.13-raise.txt")])
    assert report.summary.startswith(
        "Rank 1 raised ValueError: batch 5 has 2 values, expected 4 in check_batch (failing_job.py:39): its own code"
    )
    assert "Rank 0 then failed waiting for it." in report.summary


@pytest.mark.parametrize("name", ["gloo-2.13-extra.txt", "demo-extra-gloo-2.13-run"])
def test_a_size_check_that_aborted_is_a_mismatch_whose_side_stderr_cannot_tell(name: str) -> None:
    report = analyze_paths([str(FAILURES / name)])
    aborted = 2 if name.startswith("demo") else 1
    assert (report.verdict, report.culprit_ranks, report.suspect_ranks) == (
        Verdict.collective_mismatch,
        [],
        [aborted],
    ), report.summary
    assert "Received data size doesn't match expected size" in report.summary


def test_the_sequences_name_who_issued_the_other_operation_not_who_aborted() -> None:
    # 2 x H200: rank 1 skipped step 15's collectives; PyTorch's watchdog timed both ranks out, torchrun's summary
    # follows.  The Flight Recorder dumps decide, and the death is added to the evidence.
    report = analyze_paths([str(SHARED / "mismatch_fr")])
    assert report.verdict == Verdict.collective_mismatch, report.summary
    assert "The job then died" in report.summary
    assert any(e.fact.startswith("rank 1: collective_timeout") for e in report.evidence)


def test_a_job_that_ended_cleanly_is_no_failure() -> None:
    report = analyze_paths([str(FAILURES / "gloo-2.13-clean.txt")])
    assert report.verdict not in (Verdict.process_dead, Verdict.collective_timeout, Verdict.collective_mismatch)
