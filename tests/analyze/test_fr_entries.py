"""``ncclwatch analyze --entries / --rank / --pg / --stack``: Flight Recorder entries, filtered, on real bundles."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from ncclwatch.launcher.cli import run_analyze

FR = FIXTURES / "flight_recorder"
DTYPE_BUNDLE = str(FR / "h100-dtype-mismatch" / "bundle.tar.gz")
PIPELINE = [str(FR / "h100-pipeline-both-recv" / f"node{n}-bundle.tar.gz") for n in (0, 1)]


def entries_of(out: str) -> list[list[str]]:
    """The table's rows after its header, split on runs of two spaces."""
    table = out.split("\nFlight Recorder entries:\n", 1)[1].splitlines()
    assert table[0].split()[:3] == ["rank", "position", "process"]
    return [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in table[1:] if line[:1] != " "]


def test_one_ranks_newest_entries_after_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    status = run_analyze([DTYPE_BUNDLE, "--rank", "1", "--last", "3"])
    out = capsys.readouterr().out
    assert status == 1 and out.startswith("ncclwatch: COLLECTIVE MISMATCH")
    assert entries_of(out) == [
        ["1", "#186", "process group 0 (default_pg)", "AllReduce", "completed", "167680", "BFloat16", "-"],
        [
            "1",
            "#187",
            "process group 0 (default_pg)",
            "AllReduce",
            "started",
            "128",
            "Float",
            "inject (gpu_job.py:260)",
        ],
        ["1", "#188", "process group 0 (default_pg)", "Broadcast", "scheduled", "16", "Long", "main (gpu_job.py:211)"],
    ]


def test_ranks_as_a_comma_list_a_group_by_description_and_the_frames(capsys: pytest.CaptureFixture[str]) -> None:
    run_analyze([*PIPELINE, "--rank", "0,1", "--pg", "default_pg", "--last", "1", "--stack"])
    out = capsys.readouterr().out
    rows = entries_of(out)
    assert [(r[0], r[1], r[3]) for r in rows] == [("0", "#1501", "AllReduce"), ("1", "#1501", "AllReduce")]
    frames = out.split("\nFlight Recorder entries:\n", 1)[1]
    assert "      main (/work/main/bench/pipeline_job.py:183)" in frames  # --stack: every recorded frame


def test_the_p2p_ops_show_their_peer_and_p2p_number(capsys: pytest.CaptureFixture[str]) -> None:
    run_analyze([*PIPELINE, "--rank", "0", "--last", "0"])
    rows = entries_of(capsys.readouterr().out)
    recv = [r for r in rows if r[3] == "Recv from 1" and r[-1] == "both_recv (pipeline_job.py:159)"]
    assert len(recv) == 1 and recv[0][1].startswith("p2p #") and recv[0][4] == "started"


def test_a_filter_that_names_nothing_says_what_the_dumps_hold(capsys: pytest.CaptureFixture[str]) -> None:
    status = run_analyze([DTYPE_BUNDLE, "--rank", "7", "--pg", "mesh_tp"])
    captured = capsys.readouterr()
    assert status == 1  # the verdict's status: the filters choose what is printed, not what is judged
    assert "no Flight Recorder dump of rank 7 (dumps of rank 0, 1)" in captured.err
    assert "no process group mesh_tp in the dumps given (they hold process group 0 (default_pg))" in captured.err
    assert "(no Flight Recorder entry matches)" in captured.out


def test_entries_and_json_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        run_analyze([DTYPE_BUNDLE, "--json", "--rank", "1"])
    assert refused.value.code == 2
    assert "--json prints the report alone" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["x", "1,-2", ","])
def test_a_rank_that_is_no_rank_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_analyze([DTYPE_BUNDLE, "--rank", bad])
    assert "ranks" in capsys.readouterr().err


def test_inputs_without_dumps_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    run_analyze([str(FIXTURES / "nccl-2.28.9-2gpu" / "mismatch" / "nccl"), "--entries"])
    assert "no Flight Recorder dump among the inputs" in capsys.readouterr().err
