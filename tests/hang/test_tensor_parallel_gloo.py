"""Issue 30: real Flight Recorder dumps of tensor-parallel jobs on gloo (torch 2.13), judged from the dumps alone.

``tests/data/flight_recorder/make_tp_dumps.py`` made them (its docstring has the commands): ``parallelize_module``
with ColwiseParallel/RowwiseParallel, then a stalled rank. Setting the model up scatters each sharded weight from
the mesh's first rank; gloo records the scatter's whole input on that rank and none on the others. The engine read
that as "ranks split evenly at collective #1" and never looked at the real stall.
"""

from __future__ import annotations

from conftest import DATA, NOW

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

TP_GLOO = DATA / "flight_recorder" / "tp_gloo"


def analyzed(case: str):  # type: ignore[no-untyped-def]
    return analyze_paths([str(TP_GLOO / case)], now=NOW)


def no_false_mismatch(report) -> bool:  # type: ignore[no-untyped-def]
    """Neither the verdict nor a corroborating fact is a mismatch at the set-up's scatters."""
    facts = [report.summary, report.reason, *(e.fact for e in report.evidence)]
    return not any("Scatter" in text or "split evenly at" in text for text in facts)


def test_the_set_up_scatter_reads_the_same_on_root_and_non_root() -> None:
    state = JobState()
    for path in sorted((TP_GLOO / "tp2_stuck1").iterdir()):
        for event in parse_flight_recorder(path.read_bytes(), str(path)):
            state.apply(event)
    [comm] = take_snapshot(state, observed_at=NOW).comms
    root, other = comm.ranks
    assert root.at(0) == other.at(0)  # output [[512, 256]] on both; the input only on the root
    assert root.at(0).describe() == "Scatter count=131072 Float"


def test_a_rank_asleep_after_the_set_up_is_behind_not_a_mismatch_at_the_scatter() -> None:
    report = analyzed("tp2_stuck1")
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [1])
    assert report.position == 13  # 3 scatters and a broadcast, 2 collectives a step: step 4's first all_reduce
    assert report.operation == "AllReduce count=2048 Float"
    assert no_false_mismatch(report)


def test_fsdp2_and_tp_a_rank_asleep_is_named_not_the_rank_waiting_for_it_elsewhere() -> None:
    # Rank 3 sleeps; rank 1 waits for it in its dp group's all_gather, so rank 1 is behind in its tp group too.
    report = analyzed("dp2_tp2_stuck3")
    assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [3])
    assert no_false_mismatch(report)


def test_fsdp2_and_tp_a_skipped_logging_all_reduce_is_the_mismatch_on_the_dp_group() -> None:
    report = analyzed("dp2_tp2_skip3")
    assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [3])
    assert report.communicator is not None and "mesh_dp" in report.communicator
    assert report.position == 15 and "rank 3 skipped AllReduce count=1 Float" in report.reason
    assert no_false_mismatch(report)
