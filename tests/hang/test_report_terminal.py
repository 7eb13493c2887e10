"""The terminal verdict: one headline, then a screen that fits 100 columns.

A realistic 8-rank live report (long hosts, long py-spy and Flight Recorder
paths, GPU signatures): every line fits, the culprit's frame stays readable
(never cut mid-name), and the headline says what, who, where and what next.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.report import (
    STACK_ARROW,
    TERMINAL_COLUMNS,
    EvidenceItem,
    RankRow,
    Report,
    _table,
    headline,
    render_text,
)
from ncclwatch.watchdog.hang.verdicts import CATALOGUE, Verdict
from ncclwatch.watchdog.live.bundle import terminal_text

TORCH = "torch/distributed/distributed_c10d.py"
USER = "step (/home/alice/projects/llm-pretraining/src/training/loops/train_loop.py:105)"


def row(rank: int, culprit: bool) -> RankRow:
    inner = (
        "main (/home/alice/projects/llm-pretraining/src/training/loops/train_loop.py:97)"
        if culprit
        else f"all_reduce ({TORCH}:3252)"
    )
    return RankRow(
        rank=rank,
        host=f"gpu-node-{rank // 4:03d}.cluster.example.com",
        pid=424200 + rank,
        issued=56 if culprit else 57,
        status="behind" if culprit else "waiting",
        detail="did not reach #57" if culprit else "#57: AllReduce count=16777216 BFloat16",
        stack=inner if culprit else f"{inner}{STACK_ARROW}{USER}",
        gpu="GPU 2: idle (util 0%, SM 0%)" if culprit else f"GPU {rank % 4}: nccl_spin (util 100%, SM 18.18%)",
        state="S",
        step=1234,
        last_progress_at="2026-11-23T13:23:09.123+00:00",
    )


def report(**changes) -> Report:  # type: ignore[no-untyped-def]
    base = Report(
        verdict=Verdict.rank_behind,
        culprit_ranks=[2],
        communicator="process group 0 (default_pg)",
        position=57,
        operation="AllReduce count=16777216 BFloat16",
        summary="Rank 2 never entered collective #57 (AllReduce count=16777216 BFloat16) on process group 0 "
        "(default_pg): it issued 56 collectives, rank 0 issued 57.",
        reason="A rank that skips a collective leaves its peers waiting in it forever.",
        ranks=[row(r, r == 2) for r in range(8)],
        evidence=[
            EvidenceItem(
                source="py-spy",
                fact="rank 2: python at main (/home/alice/projects/llm-pretraining/src/"
                "training/loops/train_loop.py:97)",
            ),
            EvidenceItem(
                source="flight_recorder",
                fact="rank 0 issued AllReduce count=16777216 BFloat16 as collective #57",
                cite="/tmp/ncclwatch-4242-abcdefgh/fr/ncclwatch_trace_0 entries[56]",
            ),
        ],
        notes=["ras: not queried: NCCL 2.27.5 is in a range known to crash when RAS is asked (NVIDIA/nccl#1762)"],
        analyzed_at="2026-11-23T13:23:16+00:00",
        job="pretrain-7b",
        host="gpu-node-000",
        hang_started_at="2026-11-23T13:23:09.123+00:00",
        detected_at="2026-11-23T13:23:16.000+00:00",
        stall_timeout_s=5.0,
    )
    return base.model_copy(update=changes)


class TestWidth:
    def test_every_line_fits_100_columns(self) -> None:
        text = terminal_text(report())
        too_wide = [line for line in text.splitlines() if len(line) > TERMINAL_COLUMNS]
        assert not too_wide, "\n".join(too_wide)

    def test_the_culprits_frame_is_readable_whole(self) -> None:
        table = _table(report().ranks)
        culprit = next(line for line in table if line.split()[0] == "2")
        assert "main (train_loop.py:97)" in culprit  # function and basename:line, not cut
        waiting = next(line for line in table if line.split()[0] == "0")
        assert re.search(r"all_reduce\b.*train_loop\.py:105", waiting), waiting  # the torch frame <- the user's line

    def test_frames_are_never_cut_mid_name(self) -> None:
        names = {"all_reduce", "main", "step", "train_loop.py:105", "train_loop.py:97", "(train_loop.py:97)"}
        for width in (100, 80, 60):
            for line in _table(report().ranks, width)[1:]:
                assert len(line) <= width
                words = line.split()
                for word in words:
                    if "train_loop" in word or "all_reduce" in word:
                        assert word.strip("()") in {n.strip("()") for n in names} | {"train_loop.py:105)"}, (
                            width,
                            word,
                        )

    def test_a_wide_terminal_keeps_every_column(self) -> None:
        header = _table(report().ranks, 400)[0].split()
        assert header == ["rank", "host", "pid", "state", "step", "issued", "status", "detail", "stack", "gpu"]

    def test_narrow_drops_columns_that_tell_ranks_apart_by_nothing_first(self) -> None:
        header = _table(report().ranks, TERMINAL_COLUMNS)[0].split()
        assert header[:3] == ["rank", "host", "pid"] and "stack" in header
        assert "state" not in header and "step" not in header  # every rank: S, step 1234

    def test_verdict_title_stays_greppable(self) -> None:
        mismatch = report(verdict=Verdict.collective_mismatch)
        assert "COLLECTIVE MISMATCH" in terminal_text(mismatch)
        assert "ncclwatch: COLLECTIVE MISMATCH — culprit rank 2" in render_text(mismatch)


class TestHeadline:
    def test_first_line_says_what_who_where_and_next(self) -> None:
        text = terminal_text(report())
        first = " ".join(line.strip() for line in text.split("=" * 78)[0].splitlines())
        assert first == headline(report())
        assert first.startswith(
            "ncclwatch: RANK BEHIND rank 2 (gpu-node-000.cluster.example.com, pid 424202) never entered AllReduce #57; "
            "its peers wait in it — it is at train_loop.py:97 in main(). Next: py-spy stack in the bundle: is rank 2 "
            "still in its own code"
        ), first

    def test_mismatch_names_both_operations(self) -> None:
        rows = [
            r.model_copy(update={"detail": "#57: AllGather count=64 Float"}) if r.rank == 2 else r
            for r in report().ranks
        ]
        line = headline(report(verdict=Verdict.collective_mismatch, ranks=rows))
        assert (
            "rank 2 (gpu-node-000.cluster.example.com, pid 424202) issued AllGather "
            "where its peers issued AllReduce #57" in line
        )
        assert "Next: compare the two call sites" in line

    def test_waiting_culprit_points_at_its_user_line_not_torch(self) -> None:
        rows = [r.model_copy(update={"stack": f"all_reduce ({TORCH}:3252){STACK_ARROW}{USER}"}) for r in report().ranks]
        line = headline(report(verdict=Verdict.stuck_in_collective, ranks=rows))
        assert "it is at train_loop.py:105 in step()" in line

    def test_no_culprit_uses_the_summary(self) -> None:
        line = headline(
            report(verdict=Verdict.progress_stalled, culprit_ranks=[], summary="No rank has made progress for 1800 s.")
        )
        assert line.startswith(
            "ncclwatch: PROGRESS STALLED No rank has made progress for 1800 s. Next: read the stacks"
        )

    @pytest.mark.parametrize("verdict", list(Verdict))
    def test_every_verdict_has_the_catalogues_advice(self, verdict: Verdict) -> None:
        advice = CATALOGUE[verdict].next_step.format(ranks="rank 2")
        assert headline(report(verdict=verdict)).endswith(f" Next: {advice}" + ("" if advice.endswith("?") else "."))

    def test_live_report_carries_it(self) -> None:
        assert Report.model_validate_json(report(headline=headline(report())).model_dump_json()).headline == headline(
            report()
        )


class TestMismatchCallSites:
    def test_each_side_names_its_user_line_from_flight_recorder(self) -> None:
        # Real 4 x H200 capture: rank 3 issued an extra all_reduce from another line of train.py.
        fr = Path(__file__).parents[1] / "fixtures" / "captures" / "nccl-2.28.9-h200x4" / "extra" / "fr"
        report = analyze_paths([str(fr)])
        assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [3])
        facts = [e.fact for e in report.evidence if e.source == "flight_recorder"]
        assert any(
            f.startswith("ranks 0, 1, 2 issued") and f.endswith("called from main (train.py:158)") for f in facts
        ), facts
        assert any(f.startswith("rank 3 issued") and f.endswith("called from main (train.py:141)") for f in facts), (
            facts
        )
        assert report.headline and report.headline.startswith("ncclwatch: COLLECTIVE MISMATCH rank 3 ")


class TestOperationLine:
    def test_an_operation_without_a_communicator_says_no_none(self) -> None:
        text = render_text(report(communicator=None, position=None))
        assert "operation: AllReduce count=16777216 BFloat16\n" in text + "\n" and "(None)" not in text

    def test_position_and_communicator_both_said(self) -> None:
        assert (
            "operation: AllReduce count=16777216 BFloat16 (collective #57, process group 0 (default_pg))"
            in render_text(report())
        )
