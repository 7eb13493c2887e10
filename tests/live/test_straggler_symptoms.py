"""A straggler is one finding: the link time is measured from the last rank's start, and a slowdown the straggler
explains is told in its finding, not as a slow collective or link of its own (issue 23, part 4).

Flight Recorder records are built as PyTorch writes them for a data-parallel job of 3 NCCL ranks: per
step a 32 MiB gradient all-reduce (8 Mi floats) and a 4 KiB loss all-reduce, one second apart.  Each
rank's entry has its enqueue time (``time_created_ns``), the discovered start and completion (set
together when the watchdog thread retires it, a few ms after the end) and the kernel's ``duration_ms``.
A rank's kernel starts at its enqueue and ends when the last rank's data has moved, so an early
rank's duration holds its wait for the last one.  An entry completed but not yet retired when its
rank dumped carries no duration and has its discovered times at the dump (as in
``tests/data/flight_recorder/torch2.11_nccl_1gpu_pickle_rank_0``: 18 completed entries, none retired).
"""

from __future__ import annotations

import pytest
from conftest import NOW
from test_performance_look import INTERVAL, Rig, training

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.slowness.bandwidth import busbw, match_collectives
from ncclwatch.watchdog.slowness.engine import collective_health, without_lateness
from ncclwatch.watchdog.slowness.findings import PerfKind

T0 = int(NOW * 1e9)
MiB = 1 << 20
RANKS = (0, 1, 2)
GRAD_NUMEL = 8 * MiB  # floats: 32 MiB
USUAL_BUSBW = 182e9  # bytes/s, what the all-reduce ran at on NVLink before anything went wrong
LINK_S = 32 * MiB * 2 * 2 / 3 / USUAL_BUSBW  # nccl-tests: all-reduce factor 2(n-1)/n
RETIRE_S = 0.003  # the watchdog thread notices a completion this long after the kernel ended
STEPS = 20


def fr_entry(seq: int, numel: int, created_ns: int, end_ns: int, *, retired: bool, dumped_ns: int) -> FrEntry:
    discovered = end_ns + int(RETIRE_S * 1e9) if retired else dumped_ns
    return FrEntry(
        index=seq,
        record_id=seq,
        pg_id="0",
        collective_seq_id=seq,
        profiling_name="nccl:all_reduce",
        op="AllReduce",
        is_p2p=False,
        input_sizes=[[numel]],
        output_sizes=[[numel]],
        input_dtypes=["Float"],
        output_dtypes=["Float"],
        state=OpState.completed,
        time_created_ns=created_ns,
        time_started_ns=discovered,
        time_completed_ns=discovered,
        duration_ms=(end_ns - created_ns) / 1e6 if retired else None,
        timeout_ms=600_000,
    )


def job(
    *,
    late_rank: int | None = None,
    late_s: float = 0.4,
    late_from: int = 0,
    link_s: dict[int, float] | None = None,
    unretired: int = 0,
    group: tuple[int, ...] = RANKS,
    pg: str = "0",
) -> list[FrDump]:
    """Every rank's dump after ``STEPS`` steps.  ``late_rank`` enqueues the gradient all-reduce ``late_s`` after the
    others from step ``late_from`` on; ``link_s``: step -> the gradient all-reduce's link time (default
    ``LINK_S``); ``unretired``: the late rank's newest gradient all-reduces its watchdog had not retired."""
    dumped = T0 + int((STEPS + 1) * 1e9)
    dumps = []
    for rank in group:
        entries = []
        for step in range(STEPS):
            arrivals = {r: T0 + int(step * 1e9) + i * 100_000 for i, r in enumerate(group)}  # 0.1 ms apart: jitter
            if late_rank is not None and step >= late_from:
                arrivals[late_rank] += int(late_s * 1e9)
            end = max(arrivals.values()) + int((link_s or {}).get(step, LINK_S) * 1e9)
            newest = step >= STEPS - unretired and rank == late_rank
            entries.append(
                fr_entry(2 * step + 1, GRAD_NUMEL, arrivals[rank], end, retired=not newest, dumped_ns=dumped)
            )
            loss_at = end + 1_000_000
            entries.append(fr_entry(2 * step + 2, 1024, loss_at, loss_at + 20_000, retired=True, dumped_ns=dumped))
        groups = {pg: FrProcessGroup(pg_id=pg, desc="default_pg" if pg == "0" else None, ranks=list(group))}
        entries = [e.model_copy(update={"pg_id": pg}) for e in entries]
        dumps.append(
            FrDump(rank=rank, version="2.10", process_groups=groups, entries=entries, cite=Citation(file=f"fr_{rank}"))
        )
    return dumps


def health(dumps: list[FrDump]):  # type: ignore[no-untyped-def]
    timings = match_collectives(dumps)
    return collective_health(timings, {}, now=NOW + STEPS + 1, hosts={r: "node1" for r in range(8)}, links={})


class TestLinkTime:
    def test_the_early_ranks_wait_is_not_the_link_time_when_the_last_rank_has_no_duration_yet(self) -> None:
        """The issue's case: rank 2 is 0.4 s late and its newest entries are not retired.

        Its peers' kernels ran 0.4 s.
        """
        timings = match_collectives(job(late_rank=2, unretired=3))
        newest = [t for t in timings if t.op == "AllReduce" and t.nbytes == 32 * MiB][-1]
        assert newest.last_rank == 2 and newest.lead_s == pytest.approx(0.4, abs=1e-3)
        assert newest.transfer_s == pytest.approx(LINK_S, rel=1e-3)
        assert newest.busbw == pytest.approx(USUAL_BUSBW, rel=1e-3)

    def test_with_every_duration_the_shortest_is_the_last_starters(self) -> None:
        timings = match_collectives(job(late_rank=2))
        newest = [t for t in timings if t.nbytes == 32 * MiB][-1]
        assert newest.transfer_s == pytest.approx(LINK_S, rel=1e-3)

    def test_without_any_duration_the_first_completion_seen_less_the_last_arrival(self) -> None:
        dumps = [
            d.model_copy(update={"entries": [e.model_copy(update={"duration_ms": None}) for e in d.entries]})
            for d in job(late_rank=2)
        ]
        newest = [t for t in match_collectives(dumps) if t.nbytes == 32 * MiB][-1]
        assert newest.transfer_s == pytest.approx(LINK_S + RETIRE_S, rel=1e-3)  # a lower bound on busbw, never the wait


class TestOneFindingPerStraggler:
    def test_a_late_rank_is_a_straggler_and_nothing_else(self) -> None:
        found = health(job(late_rank=2, late_from=5, unretired=3)).perf_findings
        assert [(f.kind, f.ranks) for f in found] == [(PerfKind.straggler, (2,))]
        assert "400 ms after the next rank" in found[0].summary

    def test_its_group_slowed_within_its_lateness_is_folded_into_the_straggler(self) -> None:
        """While rank 2 lags 0.4 s the all-reduce itself takes 60 ms (on 2 x H200 a straggler's group read as a slow
        link): far below its usual speed, yet no longer than the straggler's lateness."""
        slowed = {step: 0.06 for step in range(STEPS - 3, STEPS)}
        timings = match_collectives(job(late_rank=2, late_from=5, link_s=slowed))
        report = collective_health(timings, {}, now=NOW + STEPS + 1, hosts={}, links={})
        (straggler,) = report.perf_findings
        assert straggler.kind is PerfKind.straggler and straggler.ranks == (2,)
        assert "slow_collective: AllReduce #39 of process group 0 (32.0 MiB, 3 ranks)" in straggler.detail
        assert "no more than its own delay" in straggler.detail

    def test_a_collective_slow_even_from_the_last_arrival_is_still_reported(self) -> None:
        """A real slow link in the straggler's own group: 2 s per all-reduce, five times its 0.4 s lateness."""
        slow_link = {step: 2.0 for step in range(STEPS - 3, STEPS)}
        found = health(job(late_rank=2, late_from=5, link_s=slow_link)).perf_findings
        kinds = sorted((f.kind.value, f.ranks) for f in found)
        assert kinds == [("slow_collective", RANKS), ("straggler", (2,))]
        slow = next(f for f in found if f.kind is PerfKind.slow_collective)
        assert slow.measured == pytest.approx(busbw("AllReduce", 32 * MiB, 3, 2.0), rel=1e-3)
        assert "no more than its own delay" not in next(f for f in found if f.kind is PerfKind.straggler).detail

    def test_a_slow_group_the_straggler_is_not_in_is_its_own_finding(self) -> None:
        lagging = job(late_rank=2, late_from=5)
        elsewhere = job(group=(3, 4), pg="1", link_s={step: 0.06 for step in range(STEPS - 3, STEPS)})
        found = health(lagging + elsewhere).perf_findings
        assert sorted((f.kind.value, f.ranks) for f in found) == [("slow_collective", (3, 4)), ("straggler", (2,))]

    def test_a_healthy_run_has_no_finding(self) -> None:
        assert health(job()).perf_findings == ()


class TestWithoutLateness:
    def test_only_instances_the_straggler_was_last_at_are_shortened_never_below_the_fastest(self) -> None:
        timings = [
            t for t in match_collectives(job(late_rank=2, late_from=10, link_s={15: 0.5})) if t.nbytes == 32 * MiB
        ]
        lagging = timings[15]
        assert without_lateness(lagging, {2}, LINK_S).transfer_s == pytest.approx(0.5 - lagging.lead_s)
        assert without_lateness(lagging, {1}, LINK_S) == lagging  # rank 1 was not last there
        on_time_link = timings[12]  # 0.4 s late, its link time measured from its own start: nothing to take off
        assert without_lateness(on_time_link, {2}, LINK_S).transfer_s == pytest.approx(LINK_S, rel=1e-3)


def kernels_waiting(dumps: list[FrDump], late_rank: int, late_ms: float = 60.0) -> list[FrDump]:
    """``training``'s NCCL dumps with the early ranks' gradient all-reduce kernels (``collective_seq_id`` 1, 4, ...)
    spinning ``late_ms`` longer, until the late rank's joins, as a GPU records a real straggler's wait."""

    def waited(e: FrEntry) -> FrEntry:
        return e.model_copy(update={"duration_ms": e.duration_ms + late_ms}) if e.collective_seq_id % 3 == 1 else e

    return [
        d if d.rank == late_rank else d.model_copy(update={"entries": [waited(e) for e in d.entries]}) for d in dumps
    ]


class TestLiveLook:
    """The sidecar's look (``test_performance_look``'s rig: scripted dumps, a fake clock): rank 2 enters each step's
    gradient all-reduce 60 ms after the others, whose kernels wait for it, and its last three instances run slower."""

    def test_a_straggler_whose_group_slows_within_its_lateness_is_one_finding(self) -> None:
        rig = Rig()
        rig.dumps.dumps = kernels_waiting(training(30, late_rank=2, durations_ms=[2.0] * 27 + [40.0] * 3), late_rank=2)
        rig.tick(INTERVAL + 1)
        assert rig.sidecar.health().perf_findings == ()  # one look never tells a straggler, nor its symptom
        rig.tick(2 * INTERVAL + 1)
        (straggler,) = rig.sidecar.health().perf_findings
        assert straggler.key == "straggler-2" and "slow_collective" in straggler.detail
        assert rig.metric("ncclwatch_perf_findings", kind="slow_collective") == 0

    def test_a_collective_far_slower_than_the_lateness_is_reported_beside_it(self) -> None:
        rig = Rig()
        rig.dumps.dumps = kernels_waiting(training(30, late_rank=2, durations_ms=[2.0] * 27 + [400.0] * 3), late_rank=2)
        rig.tick(INTERVAL + 1)
        rig.tick(2 * INTERVAL + 1)
        assert sorted(f.key for f in rig.sidecar.health().perf_findings) == [
            "slow_collective-0-AllReduce",
            "straggler-2",
        ]
