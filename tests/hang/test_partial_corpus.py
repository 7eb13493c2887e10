"""The partial-evidence corpus (tests/fixtures/partial): what users hold after a hang.

Each case folder holds the inputs and ``expected.json``; the engine must reach
the verdict and culprits from the inputs, and the summary must name what it
is about.  Real excerpts (``r*``) are cited in the folder's README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ncclwatch.watchdog.analyze import analyze_paths

CORPUS = Path(__file__).parents[1] / "fixtures" / "partial"
CASES = sorted(p.name for p in CORPUS.iterdir() if (p / "expected.json").exists())
NOW = 1_800_000_000.0


def test_the_corpus_has_at_least_25_cases_real_and_generated():
    assert len(CASES) >= 25
    assert sum(c.startswith("r") for c in CASES) >= 5


@pytest.mark.parametrize("case", CASES)
def test_case(case):
    expected = json.loads((CORPUS / case / "expected.json").read_text())
    report = analyze_paths([str(CORPUS / case)], now=NOW)
    got = (report.verdict.value, report.culprit_ranks)
    assert got == (expected["verdict"], expected["culprits"]), report.summary
    for words in expected["summary_contains"]:
        assert words in report.summary, report.summary
    inputs = [i for i in report.inputs if not i.path.endswith(("expected.json", "README.md"))]
    assert all(i.kinds for i in inputs), [(i.path, i.note) for i in inputs]


def test_inconclusive_says_what_each_rank_showed_and_what_would_decide():
    report = analyze_paths([str(CORPUS / "g04_single_rank_timeout_2.11")], now=NOW)
    assert [r.rank for r in report.ranks] == [1]
    assert report.ranks[0].last_op == "SeqNum 42 ALLREDUCE"
    assert any("TORCH_FR_DUMP_TEMP_FILE" in m for m in report.missing)
    assert any("other ranks' logs" in m for m in report.missing)
    assert report.evidence[0].cite.endswith("rank1.log:2")


def test_healthy_ras_names_the_ranks_whose_logs_are_missing():
    report = analyze_paths([str(CORPUS / "g17_healthy_ras_beside_one_timeout")], now=NOW)
    assert any(m.startswith("the logs of rank 0, 1, 2, 3, 4, 6, 7 (of 8)") for m in report.missing), report.missing


def test_a_dead_peer_is_not_the_reporting_rank():
    report = analyze_paths([str(CORPUS / "g11_connection_closed_by_peer")], now=NOW)
    assert 0 not in report.culprit_ranks and "node2" in report.summary


def test_two_process_groups_are_never_compared():
    report = analyze_paths([str(CORPUS / "g05_two_groups_on_one_rank_2.11")], now=NOW)
    assert "29" not in report.summary.replace("29,900", "")  # no "29,900 behind" arithmetic across groups
    assert "process group 0" in report.summary and "process group 1" in report.summary


def test_pasted_excerpt_on_standard_input():
    text = (CORPUS / "g02_allgather_vs_allreduce_2.11" / "rank3.log").read_bytes()
    text += b"".join((CORPUS / "g02_allgather_vs_allreduce_2.11" / f"rank{r}.log").read_bytes() for r in range(3))
    proc = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", "-"],
        input=text,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    out = proc.stdout.decode()
    assert proc.returncode == 1, out + proc.stderr.decode()
    assert "COLLECTIVE MISMATCH — culprit rank 3" in out
    assert "<stdin>: torch_log" in out and "lines used" in out


def test_a_fifo_in_a_kept_run_folder_is_skipped_not_opened(tmp_path):
    (tmp_path / "rank0.log").write_bytes((CORPUS / "g04_single_rank_timeout_2.11" / "rank1.log").read_bytes())
    os.mkfifo(tmp_path / "nccl_trace_rank_0.pipe")
    os.mkfifo(tmp_path / "ncclwatch_pipe.4242")
    report = analyze_paths([str(tmp_path)], now=NOW)  # would block forever if it opened a FIFO
    notes = {Path(i.path).name: i.note for i in report.inputs}
    assert "FIFO" in notes["nccl_trace_rank_0.pipe"] and "FIFO" in notes["ncclwatch_pipe.4242"]


def test_why_an_input_was_not_used(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "rank0.log").write_text("x\n")
    unreadable = tmp_path / "secret.log"
    unreadable.write_text("x\n")
    (tmp_path / "empty.log").write_bytes(b"")
    os.chmod(locked, 0)
    os.chmod(unreadable, 0)
    try:
        if os.access(unreadable, os.R_OK):
            pytest.skip("running as root: permissions are not enforced")
        report = analyze_paths([str(tmp_path), str(tmp_path / "missing.log")], now=NOW)
    finally:
        os.chmod(locked, 0o755)
        os.chmod(unreadable, 0o644)
    notes = {Path(i.path).name: i.note for i in report.inputs}
    assert notes["missing.log"] == "no such file or directory"
    assert notes["empty.log"] == "empty file"
    assert notes["secret.log"] == "permission denied"
    assert notes["locked"].startswith("cannot list folder: permission denied")
