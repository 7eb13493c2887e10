"""The verdict on every real capture: shared fixtures and tools/capture's own.

Each capture is analysed three ways: NCCL logs alone, Flight Recorder dumps
alone (where the capture has them) and everything together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CAPTURES, shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

V = Verdict

# scenario -> (verdict, culprits) expected from the whole capture
SHARED_2GPU = {
    "mismatch": (V.collective_mismatch, [1]),
    "cpu_stuck": (V.rank_behind, [1]),
    "exit": (V.process_dead, [1]),
    "healthy": (V.no_hang, []),
    "mismatch_fr": (V.collective_mismatch, [1]),
}


# With torchrun's failure summary a rank's own exit (os._exit(3), no exception, signal or error line) is the program
# choosing to stop: no incident (issue 44).  From the NCCL logs alone the survivors only saw it die: process_dead.
SHARED_2GPU_WHOLE = {**SHARED_2GPU, "exit": (V.no_hang, [])}


@pytest.mark.parametrize("scenario", sorted(SHARED_2GPU))
def test_shared_capture_whole(scenario):
    verdict, culprits = SHARED_2GPU_WHOLE[scenario]
    report = analyze_paths([str(shared("nccl-2.28.9-2gpu", scenario))])
    assert (report.verdict, report.culprit_ranks) == (verdict, culprits)


@pytest.mark.parametrize("scenario", sorted(SHARED_2GPU))
def test_shared_capture_nccl_logs_alone(scenario):
    verdict, culprits = SHARED_2GPU[scenario]
    report = analyze_paths([str(shared("nccl-2.28.9-2gpu", scenario, "nccl"))])
    assert (report.verdict, report.culprit_ranks) == (verdict, culprits)


def test_exit_death_is_seen_in_the_survivors_nccl_log():
    report = analyze_paths([str(shared("nccl-2.28.9-2gpu", "exit", "nccl"))])
    assert any("connection close" in e.fact and e.cite and "1327.log" in e.cite for e in report.evidence)


def test_shared_flight_recorder_alone():
    report = analyze_paths([str(shared("nccl-2.28.9-2gpu", "mismatch_fr", "fr"))])
    assert (report.verdict, report.culprit_ranks, report.position) == (V.collective_mismatch, [1], 82)
    assert report.operation.startswith("AllReduce count=16777216")


def test_logs_and_dumps_agree_on_the_position():
    logs = analyze_paths([str(shared("nccl-2.28.9-2gpu", "mismatch_fr", "nccl"))])
    dumps = analyze_paths([str(shared("nccl-2.28.9-2gpu", "mismatch_fr", "fr"))])
    assert logs.position == dumps.position == 82


def test_mismatch_report_cites_the_diverging_lines():
    report = analyze_paths([str(shared("nccl-2.28.9-2gpu", "mismatch"))])
    cited = {e.cite: e.text for e in report.evidence if e.cite and e.text}
    rank0 = next(t for c, t in cited.items() if "nccl.vm.714.log:" in c)
    rank1 = next(t for c, t in cited.items() if "nccl.vm.715.log:" in c)
    assert "AllReduce" in rank0 and "count 16777216" in rank0
    assert "AllReduce" in rank1 and "count 4195328" in rank1
    path, line = next(c for c in cited if "714.log:" in c).rsplit(":", 1)
    assert Path(path).read_text().splitlines()[int(line) - 1] == rank0


# ---------------------------------------------------------------------------
# tools/capture's own captures (2 and 4 x H200); expectations live beside the
# data in each scenario's expected.json, written from what the capture shows.
# ---------------------------------------------------------------------------


def _own_captures() -> list[Path]:
    return sorted(p.parent for p in CAPTURES.glob("*/*/expected.json"))


@pytest.mark.parametrize("capture", _own_captures(), ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("view", ["whole", "nccl", "fr"])
def test_own_capture(capture: Path, view: str):
    expected = json.loads((capture / "expected.json").read_text())
    if view not in expected or not (view == "whole" or (capture / view).exists()):
        pytest.skip(f"{capture.name}: no expectation for {view} alone")
    # after_kill/ holds what the ranks wrote while tools/capture killed the job.
    paths = (
        [p for p in capture.iterdir() if p.name not in ("after_kill", "expected.json")]
        if view == "whole"
        else [capture / view]
    )
    report = analyze_paths([str(p) for p in paths])
    want = expected[view]
    assert report.verdict == want["verdict"], report.summary
    assert report.culprit_ranks == want["culprit_ranks"], report.summary
