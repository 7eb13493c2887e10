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

import tarfile
from collections.abc import Mapping

import pytest
from conftest import NOW, shared
from test_straggler_symptoms import job

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.slowness.bandwidth import match_collectives
from ncclwatch.watchdog.slowness.engine import collective_health
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.slowness.stragglers import collective_series, last_arrivals, stragglers

T0 = int(NOW * 1e9)
KiB_FLOATS = 256  # floats per KiB
STEP_S = 0.06  # the FSDP2 job's step on the H100 (300 steps in about 20 s)
RETIRE_S = 0.003
# FSDP2's step: an all-gather of the parameters (1 MiB out of 0.5 MiB per rank) and a reduce-scatter of the
# gradients (2 MiB in), each kernel ~0.5 ms on that box's NET/Socket transport.
FSDP = (
    ("AllGather", "nccl:_allgather_base", 512 * KiB_FLOATS, 1024 * KiB_FLOATS, 0.010),
    ("ReduceScatter", "nccl:_reduce_scatter_base", 2048 * KiB_FLOATS, 1024 * KiB_FLOATS, 0.040),
)
KERNEL_S = 0.0005


def fsdp_job(
    steps: int,
    *,
    host_ahead: Mapping[int, float],
    gpu_late: Mapping[int, float] = {},
    ranks: tuple[int, ...] = (0, 1),
    unretired: Mapping[int, int] = {},
    nccl: bool = True,
    live: bool = False,
    retire_s: float = RETIRE_S,
) -> list[FrDump]:
    """Every rank's dump after ``steps`` FSDP2 steps.  ``host_ahead``: rank -> seconds its host enqueues before its GPU
    reaches the collective; ``gpu_late``: rank -> seconds its GPU reaches it after the others'; ``unretired``:
    rank -> its newest steps not retired at the dump; ``nccl`` False: gloo entries (scheduled, no times).

    ``live``: the dump is taken as the performance look takes it, while the job runs: just after the last
    enqueue, so what the hosts queued ahead of their GPUs is ``scheduled`` (no start, no duration), what runs is
    ``started``, and what ended less than ``retire_s`` ago is ``completed`` without a duration.
    """
    timeline = []  # per step and collective: when each rank's GPU reaches it, and when every kernel ends
    for step in range(steps):
        for op, name, numel_in, numel_out, offset in FSDP:
            reach = {r: T0 + int((step * STEP_S + offset + gpu_late.get(r, 0.0)) * 1e9) + 10_000 * r for r in ranks}
            timeline.append((step, op, name, numel_in, numel_out, reach, max(reach.values()) + int(KERNEL_S * 1e9)))
    created = {r: [reach[r] - int(host_ahead[r] * 1e9) for *_, reach, _ in timeline] for r in ranks}
    if live:
        dumped = max(c for times in created.values() for c in times) + 1_000_000
    else:
        dumped = T0 + int((steps + 1) * STEP_S * 1e9) + 1_000_000_000
    groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(ranks))}
    dumps = []
    for rank in ranks:
        entries = []
        for i, (step, op, name, numel_in, numel_out, reach, end) in enumerate(timeline):
            if created[rank][i] > dumped:
                break
            retired = nccl and step < steps - unretired.get(rank, 0) and end + int(retire_s * 1e9) <= dumped
            if not nccl or reach[rank] > dumped:
                state, started, completed = OpState.scheduled, None, None
            elif end > dumped:
                state, started, completed = OpState.started, dumped, None
            else:
                discovered = end + int(retire_s * 1e9) if retired else dumped
                state, started, completed = OpState.completed, discovered, discovered
            entries.append(
                FrEntry(
                    index=i + 1,
                    record_id=i + 1,
                    pg_id="0",
                    collective_seq_id=i + 1,
                    profiling_name=name,
                    op=op,
                    is_p2p=False,
                    input_sizes=[[numel_in]],
                    output_sizes=[[numel_out]],
                    input_dtypes=["Float"],
                    output_dtypes=["Float"],
                    state=state,
                    time_created_ns=created[rank][i],
                    time_started_ns=started,
                    time_completed_ns=completed,
                    duration_ms=(end - reach[rank]) / 1e6 if retired else None,
                    timeout_ms=600_000,
                )
            )
        dumps.append(
            FrDump(rank=rank, version="2.10", process_groups=groups, entries=entries, cite=Citation(file=f"fr_{rank}"))
        )
    return dumps


def findings_of(dumps: list[FrDump]):  # type: ignore[no-untyped-def]
    """The look's findings a second after the newest moment the dumps recorded."""
    times = [
        t for d in dumps for e in d.entries for t in (e.time_created_ns, e.time_started_ns, e.time_completed_ns) if t
    ]
    return collective_health(
        match_collectives(dumps), {}, now=max(times) / 1e9 + 1, hosts={r: "vm" for r in range(8)}, links={}
    ).perf_findings


def findings(dumps: list[FrDump]) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((f.kind.value, f.ranks) for f in findings_of(dumps))


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
        newest = [
            t for t in match_collectives(fsdp_job(40, host_ahead=H100, unretired={0: 3})) if t.op == "ReduceScatter"
        ][-1]
        assert newest.gpu_arrivals is None and newest.transfer_s == pytest.approx(KERNEL_S, rel=0.05)

    def test_every_instance_timed_still_no_straggler(self) -> None:
        assert findings(fsdp_job(40, host_ahead=H100)) == []

    def test_a_look_while_both_hosts_run_ahead_judges_the_retired_instances(self) -> None:
        """The look's dump is taken mid-run: the real job queued about 40 all-gathers (14 a step, 3 steps) ahead
        of its GPUs, here one a step, so hosts 1.3 and 1.5 s ahead queue 21.  Those and the newest done but not
        retired (PyTorch's watchdog thread retires every ~100 ms) carry no kernel time: the straggler rule
        judges the last 20 retired instances, and the slow check leaves the unretired ones unmeasured (their
        completion less the last enqueue held the whole GPU queue: 1 % of the usual speed on the H100)."""
        dumps = fsdp_job(80, host_ahead={0: 1.3, 1: 1.5}, live=True, retire_s=0.1)
        gathers = [t for t in match_collectives(dumps) if t.op == "AllGather" and t.all_arrived]
        queued = [t for t in gathers if t.gpu_arrivals is None]
        assert len(queued) > 20 and all(t.last_rank == 0 and t.lead_s == pytest.approx(0.2, abs=1e-3) for t in gathers)
        unretired = [t for t in match_collectives(dumps) if t.completed and t.gpu_arrivals is None]
        assert unretired and all(t.transfer_s is None for t in unretired)
        assert findings(dumps) == []

    def test_the_same_enqueue_order_on_gloo_is_a_straggler(self) -> None:
        """Without kernel times the enqueue is all there is: today's rule names rank 0."""
        assert findings(fsdp_job(40, host_ahead=H100, nccl=False)) == [("straggler", (0,))]


class TestRealStragglerOnNccl:
    def test_the_rank_the_others_waited_for_is_one_finding(self) -> None:
        """Rank 3 of 4 enqueues its gradient all-reduce 400 ms late and the others' kernels spin 400 ms longer than
        its own; its newest three are not retired (no duration): judged on the 17 with every kernel time."""
        dumps = job(group=(0, 1, 2, 3), late_rank=3, unretired=3)
        steps = 20
        report = collective_health(match_collectives(dumps), {}, now=NOW + steps + 1, hosts={}, links={})
        (straggler,) = report.perf_findings
        assert (straggler.kind, straggler.ranks) == (PerfKind.straggler, (3,))
        assert "400 ms after the next rank" in straggler.summary
        assert "was last in 17 of the last 17 collectives" in straggler.summary
        assert "its GPU reached them last, the others' kernels waiting for it" in straggler.summary
        assert [p.rank for p in report.rank_perf if p.straggler] == [3]

    def test_a_gpu_behind_the_others_is_named_in_a_look_while_hosts_run_ahead(self) -> None:
        """The same queue as the healthy case above, and rank 1's GPU 200 ms behind: the retired instances show the
        wait, and it is named."""
        dumps = fsdp_job(80, host_ahead={0: 1.5, 1: 1.3}, gpu_late={1: 0.2}, live=True, retire_s=0.1)
        assert findings(dumps) == [("straggler", (1,))]

    def test_a_gpu_behind_the_others_is_named(self) -> None:
        """Rank 1's GPU reaches each collective 200 ms after rank 0's; both hosts enqueue 2 ms ahead."""
        assert findings(fsdp_job(40, host_ahead={0: 0.002, 1: 0.002}, gpu_late={1: 0.2})) == [("straggler", (1,))]


class TestGpuArrivals:
    """Where every rank's kernel time is known, arrival is when each GPU reached the collective, whatever the
    enqueue order (H100: a rank whose GPU spun 80 ms every step enqueued as early as its peer, and was missed)."""

    def test_the_shortest_kernel_reached_it_last_by_the_others_wait(self) -> None:
        (t,) = [
            t
            for t in match_collectives(fsdp_job(1, host_ahead={0: 0.002, 1: 0.3}, gpu_late={1: 0.08}))
            if t.op == "AllGather"
        ]
        assert t.last_rank == 0  # by enqueue: rank 1's host ran 300 ms ahead of its GPU, rank 0's 2 ms
        arrivals = t.gpu_arrivals
        assert arrivals is not None and arrivals[1] - arrivals[0] == pytest.approx(0.08, abs=1e-4)

    def test_a_gpu_late_behind_an_early_host_is_the_straggler(self) -> None:
        assert findings(fsdp_job(40, host_ahead={0: 0.002, 1: 0.3}, gpu_late={1: 0.08})) == [("straggler", (1,))]

    def test_without_kernel_times_enqueue_order_decides_and_says_so(self) -> None:
        (finding,) = stragglers(last_arrivals([{0: i * 1.0, 1: i * 1.0 + 0.2} for i in range(20)]))
        assert finding.ranks == (1,) and finding.summary.endswith("by enqueue time")


def test_real_fsdp2_dumps_before_the_fault_have_a_late_host_and_no_straggler() -> None:
    """The H100 FSDP2 job's own dumps (2 ranks, NCCL 2.28.9, timing on), up to the collective rank 1 skipped: rank 0
    enqueued every all-gather ~230 ms after rank 1, and its GPU reached them last in no more than half."""
    bundle = shared(
        "bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"
    )
    dumps = []
    with tarfile.open(bundle) as tar:
        for member in tar.getmembers():
            if "/fr/nccl_trace_rank_" in member.name:
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                dumps += [e for e in parse_flight_recorder(data, member.name) if isinstance(e, FrDump)]
    ops = [{e.collective_seq_id: e.op for e in d.entries if not e.is_p2p} for d in dumps]
    diverged = min(seq for seq in ops[0].keys() & ops[1].keys() if ops[0][seq] != ops[1][seq])
    healthy = [
        d.model_copy(update={"entries": [e for e in d.entries if (e.collective_seq_id or 0) < diverged]}) for d in dumps
    ]
    assert findings(healthy) == []
    timings = match_collectives(healthy)
    now = max(e.time_created_ns for d in healthy for e in d.entries) / 1e9 + 1
    gathers = [t for t in timings if t.op == "AllGather" and t.all_arrived]
    assert all(t.last_rank == 0 and t.lead_s > 0.1 for t in gathers[-100:])  # by enqueue, always rank 0
    shares = {
        p.rank: p.last_arrival_share for p in collective_health(timings, {}, now=now, hosts={}, links={}).rank_perf
    }
    assert max(shares.values()) < 0.6  # on the GPU, neither rank is usually last


def _look_dumps(tarball: str) -> list[FrDump]:
    dumps = []
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            dumps += [e for e in parse_flight_recorder(data, member.name) if isinstance(e, FrDump)]
    return dumps


def test_real_fsdp2_gpu_straggler_is_named_from_the_look_dumps() -> None:
    """H100, FSDP2, rank 1's GPU spinning 80 ms before every step, its host enqueuing ~250 ms ahead: the dumps the
    look took mid-run (tests/fixtures/flight_recorder/h100-fsdp2-gpu-straggler).  Before, the root all-gather
    shared a series with the blocks' and enqueue order decided: no finding in 600 steps."""
    dumps = _look_dumps(str(shared("flight_recorder", "h100-fsdp2-gpu-straggler", "look-dumps.tar.gz")))
    gathers = [name for name in collective_series(match_collectives(dumps)) if name.startswith("AllGather")]
    assert sorted(gathers) == [
        "AllGather (1,048,576 bytes) of process group 0",
        "AllGather (1,052,160 bytes) of process group 0",
    ]
    (straggler,) = [f for f in findings_of(dumps) if f.kind is PerfKind.straggler]
    assert straggler.ranks == (1,) and "its GPU reached them last" in straggler.summary
    assert 25e-3 < straggler.measured < 40e-3  # the root all-gather's wait, 31 ms
    assert [f.kind for f in findings_of(dumps)] == [PerfKind.straggler]
