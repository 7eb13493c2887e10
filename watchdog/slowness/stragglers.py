"""Stragglers: a rank that is last, by a margin, in most of the recent rounds.

A round is one instance of a recurring collective (same group, op and
size) and when each rank arrived at it.  In each round the last rank and
its lead over the second-to-last are noted; a rank last by more than the
margin in at least ``share`` of the last ``window`` rounds is a straggler.
Each recurring collective is a series of its own (``collective_series``):
a step has several collectives and the straggler is late only at the
first one after its slow part; at the rest every rank enters together,
having just left the same wait, so over all collectives it would be last
in a third of them at best.

Arrival is where the rank's GPU reached the collective, wherever the
kernel times tell it (``CollectiveTiming.gpu_arrivals``: the last to
arrive has the shortest kernel, and the next one waited for it the
difference).  Enqueue (Flight Recorder's ``time_created_ns``) is not
arrival on NCCL: a call returns once enqueued and the host runs ahead of
its GPU.  On the H100 a healthy FSDP2 job's rank 0, which alone called
``loss.item()``, enqueued every all-gather 212 ms after rank 1 while
neither GPU waited; and a rank whose GPU was 80 ms late every step
enqueued as early as the other, so an enqueue rule named the first and
missed the second.  So a series with instances carrying every rank's
kernel time is judged on those only: its newest instances are still queued
on the GPU, or done but not yet retired by PyTorch's watchdog thread, and
carry none (on the H100 the last 20 all-gathers of a look's dump were all
such).  Without kernel times anywhere (gloo, whose calls are synchronous
so enqueue is arrival; NCCL without ``TORCH_NCCL_ENABLE_TIMING``) enqueue
order decides.

Failure modes: rounds some rank is missing from are skipped (a dead or
silent rank is the hang detectors' business, not a straggler); fewer than
``min_rounds`` complete rounds say nothing; a tie for last is no lead.
Clocks: enqueue times are each host's wall clock, so across nodes a lead
below NTP's error (a few ms) is not a margin; kernel times are each GPU's
own and need no common clock.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ncclwatch.watchdog.slowness.bandwidth import CollectiveTiming, size_text
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind, ranks_text, where

Round = Mapping[int, float]  # rank -> seconds (any common origin)
MIN_ROUNDS = 10  # fewer rounds than this say nothing about who is usually last


@dataclass(frozen=True)
class LastArrivals:
    """How often each rank was last by the margin over the rounds looked at, and by how much on average."""

    rounds: int
    margin_s: float
    last_counts: Mapping[int, int]
    mean_lead_s: Mapping[int, float]  # over the rounds the rank was last by the margin
    what: str | None = (
        None  # the collective the rounds are instances of, when one ("AllReduce (1.0 MiB) of process group 0")
    )
    on_gpu: bool = False  # arrivals are when each GPU reached the collective (kernel times), not enqueues

    def share(self, rank: int) -> float:
        return self.last_counts.get(rank, 0) / self.rounds if self.rounds else 0.0


def collective_series(timings: Sequence[CollectiveTiming]) -> dict[str, list[CollectiveTiming]]:
    """The instances of each recurring collective (group, op, exact size) every rank of its group arrived at, in
    sequence order, named for people.

    The exact size, not the bandwidth checks' factor-of-two bucket: on the H100 an FSDP2 job's root all-gather
    (1,048,576 bytes, the first of each step, where a late GPU makes the others wait) shared a bucket with its
    blocks' thirteen (1,052,160 bytes, at which the two ranks take turns being last), and the straggler drowned.
    Sizes that read alike ("1.0 MiB" both) are named by their bytes, so neither series replaces the other."""
    series: dict[tuple[str, str, int], list[CollectiveTiming]] = defaultdict(list)
    for t in timings:
        if t.all_arrived:
            series[(t.pg, t.op, t.nbytes or 0)].append(t)
    readable = Counter((pg, op, size_text(nbytes or None)) for pg, op, nbytes in series)
    named = {}
    for (pg, op, nbytes), ts in series.items():
        size = size_text(nbytes or None)
        named[f"{op} ({size if readable[(pg, op, size)] == 1 else f'{nbytes:,} bytes'}) of process group {pg}"] = ts
    return named


def arrival_round(t: CollectiveTiming) -> dict[int, float]:
    """Rank -> when it enqueued the collective, in seconds."""
    return {rank: ns / 1e9 for rank, ns in t.arrivals.items()}


def collective_arrivals(instances: Sequence[CollectiveTiming], *, what: str) -> LastArrivals:
    """``last_arrivals`` over one recurring collective's instances: when each GPU reached them, over the instances
    with every rank's kernel time where there are any; else when each rank enqueued them (module docstring)."""
    on_gpu = [arrivals for t in instances if (arrivals := t.gpu_arrivals) is not None]
    if on_gpu:
        return last_arrivals(on_gpu, what=what, on_gpu=True)
    return last_arrivals([arrival_round(t) for t in instances], what=what)


def last_arrivals(
    rounds: Sequence[Round],
    *,
    window: int = 20,
    margin_s: float = 0.01,
    rel_margin: float = 0.1,
    what: str | None = None,
    on_gpu: bool = False,
) -> LastArrivals:
    """Who was last, by more than the margin, in each of the last ``window`` rounds.

    The margin is the larger of ``margin_s`` and ``rel_margin`` x the median
    time between rounds, so a lead of 10 ms counts in a job of 20 ms steps
    and not in one of 2 s steps.
    """
    recent = [times for times in rounds if len(times) >= 2][-window:]
    margin = max(margin_s, rel_margin * _period(recent))
    counts: Counter[int] = Counter()
    leads: dict[int, list[float]] = defaultdict(list)
    for times in recent:
        last = max(times, key=lambda r: (times[r], r))
        lead = times[last] - max(t for r, t in times.items() if r != last)
        if lead > margin:
            counts[last] += 1
            leads[last].append(lead)
    return LastArrivals(
        rounds=len(recent),
        margin_s=margin,
        last_counts=dict(counts),
        mean_lead_s={rank: statistics.fmean(values) for rank, values in leads.items()},
        what=what,
        on_gpu=on_gpu,
    )


def _period(rounds: Sequence[Round]) -> float:
    """Median time between consecutive rounds (by their earliest arrival); 0 with fewer than two."""
    starts = [min(r.values()) for r in rounds]
    gaps = [b - a for a, b in zip(starts, starts[1:]) if b > a]
    return statistics.median(gaps) if gaps else 0.0


def stragglers(
    stats: LastArrivals,
    *,
    hosts: Mapping[int, str] = {},
    links: Mapping[int, Sequence[str]] = {},
    share: float = 0.6,
    min_rounds: int = MIN_ROUNDS,
) -> list[PerfFinding]:
    """The ranks last by the margin in at least ``share`` of the rounds (at most one can pass 0.5)."""
    if stats.rounds < min_rounds:
        return []
    findings = []
    for rank, count in sorted(stats.last_counts.items()):
        if count < share * stats.rounds:
            continue
        host_names, link_names = where([rank], hosts, links)
        lead = stats.mean_lead_s[rank]
        findings.append(
            PerfFinding(
                kind=PerfKind.straggler,
                key=f"straggler-{rank}",
                summary=f"{ranks_text([rank], hosts)} was last in {count} of the last {stats.rounds} collectives"
                + (f" at {stats.what}" if stats.what else "")
                + f", on average {lead * 1e3:.0f} ms "
                f"after the next rank (margin {stats.margin_s * 1e3:.0f} ms)"
                + (
                    "; its GPU reached them last, the others' kernels waiting for it"
                    if stats.on_gpu
                    else ", by enqueue time"
                ),
                detail="the others wait for it every step: look at that rank's data loading, CPU and GPU clocks "
                "and throttling (NVML), and its stacks between collectives",
                ranks=(rank,),
                hosts=host_names,
                links=link_names,
                measured=lead,
                expected=stats.margin_s,
            )
        )
    return findings
