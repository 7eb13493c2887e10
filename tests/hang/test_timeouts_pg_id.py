"""PyTorch's watchdog timeouts from two ranks where one line carries a process-group id and the other does not
(issue 31): compared on one group, not set aside, and the rank with the lower SeqNum is behind.

The lines are ProcessGroupNCCL.cpp's: ``[Rank r] Watchdog caught collective operation timeout: WorkNCCL(...)``
(WorkNCCL::checkTimeout without a group prefix) and the same through ``logPrefix()``, ``[PG ID i PG GUID g(name)
Rank r] Watchdog caught ...``.  The corpus case g26 is the default group; here a named group joins only a line
that times out in the same kind of call, and never where two groups are named.
"""

from __future__ import annotations

from pathlib import Path

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.torch_log import parse_torch_log

NOW = 1_800_000_000.0
T = "E1126 10:00:00.000000000"


def plain(rank: int, seq: int, op: str, numel: int, tmo: int = 600000) -> str:
    return (
        f"[rank{rank}]:[{T} ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={tmo}) ran for "
        f"{tmo + 31} milliseconds before timing out.\n"
    )


def prefixed(rank: int, seq: int, op: str, numel: int, pg: str, desc: str, tmo: int = 600000) -> str:
    return (
        f"[rank{rank}]:[{T} ProcessGroupNCCL.cpp:684] [PG ID {pg} PG GUID {pg}({desc}) Rank {rank}] Watchdog caught "
        f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, "
        f"Timeout(ms)={tmo}) ran for {tmo + 94} milliseconds before timing out.\n"
    )


def analyze(tmp_path: Path, logs: dict[int, str]):
    for rank, text in logs.items():
        (tmp_path / f"rank{rank}.log").write_text(text)
    return analyze_paths([str(tmp_path)], now=NOW)


def test_the_prefixed_line_keeps_its_groups_name():
    [timeout] = parse_torch_log(prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg").encode(), "rank1.log")
    assert (timeout.rank, timeout.seq, timeout.pg, timeout.pg_desc) == (1, 12, "0", "default_pg")


def test_default_group_and_no_id_two_apart_names_the_lower(tmp_path):
    report = analyze(
        tmp_path, {0: plain(0, 10, "ALLREDUCE", 1024), 1: prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg")}
    )
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
    assert "process group 0 (default_pg)" in report.summary and "rank 0 waits in SeqNum 10, 2 before" in report.summary


def test_a_named_group_joins_a_line_of_the_same_call(tmp_path):
    report = analyze(tmp_path, {0: plain(0, 10, "ALLGATHER", 512), 1: prefixed(1, 12, "ALLGATHER", 512, "3", "tp")})
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
    assert "process group 3 (tp)" in report.summary


def test_a_named_group_does_not_join_another_kind_of_call(tmp_path):
    report = analyze(tmp_path, {0: plain(0, 10, "ALLREDUCE", 1), 1: prefixed(1, 12, "ALLGATHER", 512, "3", "tp")})
    assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])


def test_two_named_groups_leave_the_unnamed_line_alone(tmp_path):
    logs = {
        0: plain(0, 10, "ALLREDUCE", 1024),
        1: prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg") + prefixed(1, 7, "ALLGATHER", 512, "3", "tp"),
    }
    report = analyze(tmp_path, logs)
    assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])
