"""Enqueue is not arrival on NCCL: a straggler is a rank the others' kernels waited for, not one whose host
enqueued last (H100, NCCL 2.28.9, torch 2.11: a healthy FSDP2 job got a straggler and two slow collectives).

Flight Recorder records are built from a GPU timeline.  Per collective, each rank's GPU reaches it at
``gpu_late`` after the step's moment; its host enqueued it ``host_ahead`` before that (the NCCL call returns
at enqueue: ``time_created_ns``); every kernel starts when its GPU reaches it and ends when the last one has
joined and the data has moved, so ``duration_ms`` holds its wait for the others.  The watchdog retires an
entry (duration and discovered times) ``RETIRE_S`` after the end; an entry not yet retired when its rank
dumped is ``completed`` with no duration and its discovered times at the dump.  Gloo entries carry
neither: a gloo call is synchronous, so its enqueue is its arrival.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from conftest import NOW
from test_straggler_symptoms import job

from ncclwatch.watchdog.slowness.bandwidth import match_collectives
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.slowness.health import collective_health
from ncclwatch.watchdog.slowness.stragglers import last_arrivals, stragglers
from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState

T0 = int(NOW * 1e9)
KiB_FLOATS = 256  # floats per KiB
STEP_S = 0.06  # the FSDP2 job's step on the H100 (300 steps in about 20 s)
RETIRE_S = 0.003
# FSDP2's step: an all-gather of the parameters (1 MiB out of 0.5 MiB per rank) and a reduce-scatter of the
# gradients (2 MiB in), each kernel ~0.5 ms on that box's NET/Socket transport.
FSDP = (("AllGather", "nccl:_allgather_base", 512 * KiB_FLOATS, 1024 * KiB_FLOATS, 0.010),
        ("ReduceScatter", "nccl:_reduce_scatter_base", 2048 * KiB_FLOATS, 1024 * KiB_FLOATS, 0.040))  # fmt: skip
KERNEL_S = 0.0005


def fsdp_job(
    steps: int, *, host_ahead: Mapping[int, float], gpu_late: Mapping[int, float] = {}, ranks: tuple[int, ...] = (0, 1),
    unretired: Mapping[int, int] = {}, nccl: bool = True,
) -> list[FrDump]:  # fmt: skip
    """Every rank's dump after ``steps`` FSDP2 steps.  ``host_ahead``: rank -> seconds its host enqueues before its GPU
    reaches the collective; ``gpu_late``: rank -> seconds its GPU reaches it after the others'; ``unretired``:
    rank -> its newest steps not retired at the dump; ``nccl`` False: gloo entries (scheduled, no times)."""
    dumped = T0 + int((steps + 1) * STEP_S * 1e9) + 1_000_000_000
    groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(ranks))}
    dumps = []
    for rank in ranks:
        entries = []
        for step in range(steps):
            for op, name, numel_in, numel_out, offset in FSDP:
                seq = len(entries) + 1
                reach = {r: T0 + int((step * STEP_S + offset + gpu_late.get(r, 0.0)) * 1e9) + 10_000 * r for r in ranks}
                end = max(reach.values()) + int(KERNEL_S * 1e9)
                retired = nccl and step < steps - unretired.get(rank, 0)
                discovered = end + int(RETIRE_S * 1e9) if retired else dumped
                entries.append(FrEntry(
                    index=seq, record_id=seq, pg_id="0", collective_seq_id=seq, profiling_name=name, op=op, is_p2p=False,
                    input_sizes=[[numel_in]], output_sizes=[[numel_out]], input_dtypes=["Float"], output_dtypes=["Float"],
                    state=OpState.completed if nccl else OpState.scheduled,
                    time_created_ns=reach[rank] - int(host_ahead[rank] * 1e9),
                    time_started_ns=discovered if nccl else None, time_completed_ns=discovered if nccl else None,
                    duration_ms=(end - reach[rank]) / 1e6 if retired else None, timeout_ms=600_000,
                ))  # fmt: skip
        dumps.append(FrDump(rank=rank, version="2.10", process_groups=groups, entries=entries, cite=Citation(file=f"fr_{rank}")))
    return dumps


def findings(dumps: list[FrDump]) -> list[tuple[str, tuple[int, ...]]]:
    steps = max(len(d.entries) for d in dumps)
    report = collective_health(match_collectives(dumps), {}, now=NOW + steps, hosts={r: "vm" for r in range(8)}, links={})
    return sorted((f.kind.value, f.ranks) for f in report.perf_findings)


# Rank 0 prints loss.item() every 10 steps: its host stays a few ms ahead of its GPU; rank 1's runs 225 ms ahead.
H100 = {0: 0.002, 1: 0.225}


class TestHostRunningAhead:
    """The H100 case: rank 0 enqueues every collective 223 ms after rank 1, while neither GPU waits."""

    def test_the_late_host_is_no_straggler_and_nothing_is_slow(self) -> None:
        dumps = fsdp_job(40, host_ahead=H100, unretired={0: 3})
        gathers = [t for t in match_collectives(dumps) if t.op == "AllGather"]
        assert all(t.last_rank == 0 and t.lead_s == pytest.approx(0.223, abs=1e-3) for t in gathers)
        assert findings(dumps) == []

    def test_its_newest_entries_without_rank_0s_duration_are_timed_by_rank_1s_kernel(self) -> None:
        """Rank 1's kernel (0.5 ms, no wait) bounds the link time where rank 0 has no duration yet: the first
        discovered completion less rank 0's enqueue (5.5 ms, 9 % of the usual speed) is not taken."""
        newest = [t for t in match_collectives(fsdp_job(40, host_ahead=H100, unretired={0: 3})) if t.op == "ReduceScatter"][-1]
        assert newest.wait_s is None and newest.transfer_s == pytest.approx(KERNEL_S, rel=0.05)

    def test_every_instance_timed_still_no_straggler(self) -> None:
        assert findings(fsdp_job(40, host_ahead=H100)) == []

    def test_the_same_enqueue_order_on_gloo_is_a_straggler(self) -> None:
        """Without kernel times the enqueue is all there is: today's rule names rank 0."""
        assert findings(fsdp_job(40, host_ahead=H100, nccl=False)) == [("straggler", (0,))]


class TestRealStragglerOnNccl:
    def test_the_rank_the_others_waited_for_is_one_finding(self) -> None:
        """Rank 3 of 4 enqueues its gradient all-reduce 400 ms late and the others' kernels spin 400 ms longer than
        its own; its newest three are not retired (no duration): judged on the 17 timed."""
        dumps = job(group=(0, 1, 2, 3), late_rank=3, unretired=3)
        steps = 20
        report = collective_health(match_collectives(dumps), {}, now=NOW + steps + 1, hosts={}, links={})
        (straggler,) = report.perf_findings
        assert (straggler.kind, straggler.ranks) == (PerfKind.straggler, (3,))
        assert "400 ms after the next rank" in straggler.summary
        assert "the others' kernels waited for it in 17 of the 17 with kernel times" in straggler.summary
        assert [p.rank for p in report.rank_perf if p.straggler] == [3]

    def test_a_gpu_behind_the_others_is_named(self) -> None:
        """Rank 1's GPU reaches each collective 200 ms after rank 0's; both hosts enqueue 2 ms ahead."""
        assert findings(fsdp_job(40, host_ahead={0: 0.002, 1: 0.002}, gpu_late={1: 0.2})) == [("straggler", (1,))]


class TestWaitRule:
    """``last_arrivals`` with each round's wait: rank 1 enqueues 200 ms last in all 20 rounds."""

    ROUNDS = [{0: i * 1.0, 1: i * 1.0 + 0.2} for i in range(20)]

    def test_waited_for_in_most_timed_rounds_is_a_straggler(self) -> None:
        waits = [0.19] * 12 + [0.0] * 8
        (finding,) = stragglers(last_arrivals(self.ROUNDS, source="arrival", waits=waits))
        assert finding.ranks == (1,) and "waited for it in 12 of the 20" in finding.summary

    def test_waited_for_in_fewer_than_half_is_not(self) -> None:
        waits = [0.19] * 8 + [0.0] * 12
        assert stragglers(last_arrivals(self.ROUNDS, source="arrival", waits=waits)) == []

    def test_a_wait_under_half_the_lead_is_no_wait(self) -> None:
        assert stragglers(last_arrivals(self.ROUNDS, source="arrival", waits=[0.09] * 20)) == []

    def test_rounds_without_kernel_times_leave_the_arrival_rule(self) -> None:
        (finding,) = stragglers(last_arrivals(self.ROUNDS, source="arrival", waits=[None] * 20))
        assert finding.ranks == (1,) and "kernel times" not in finding.summary
        assert [f.ranks for f in stragglers(last_arrivals(self.ROUNDS, source="arrival", waits=[None] * 15 + [0.0] * 5))] == []
