"""Stragglers: a rank that is last, by a margin, in most of the recent rounds.

A round is one instance of a recurring collective (same group, op and
size): when each rank enqueued it, Flight Recorder's ``time_created_ns``.
In each round the last rank and its lead over the second-to-last are
noted; a rank last by more than the margin in at least ``share`` of the
last ``window`` rounds is a straggler.  Each recurring collective is a
series of its own (``collective_series``): a step has several collectives
and the straggler is late only at the first one after its slow part; at
the rest every rank enters together, having just left the same wait, so
over all collectives it would be last in a third of them at best.

Enqueue is not arrival on NCCL: a call returns once enqueued and the
host runs ahead of its GPU, so a rank whose host synchronises (rank 0
printing ``loss.item()`` every 10 steps of a healthy FSDP2 job on the H100)
enqueues every collective hundreds of ms after a peer whose host ran ahead,
while neither GPU waits.  A real straggler keeps the others' kernels
spinning until its own joins, so their kernel times (``duration_ms``)
exceed its own by about its lead (``CollectiveTiming.wait_s``).  So where
a series has rounds with every rank's kernel time, only those rounds are
judged (``collective_arrivals``): the newest instances of a host running
ahead are still queued on the GPU, or done but not yet retired by
PyTorch's watchdog thread, and carry no kernel time, and on the H100 the
last 20 instances of a healthy job's all-gather were all such.  In them a
rank last by the margin is a straggler only if, in at least
``WAITED_SHARE`` of its rounds, the others waited ``WAIT_PART`` of its
lead or more; else its lateness is its host's, and nothing is said.
Without kernel times anywhere (gloo, whose calls are synchronous so
enqueue is arrival; NCCL without ``TORCH_NCCL_ENABLE_TIMING``) the arrival
rule alone decides.

Failure modes: rounds some rank is missing from are skipped (a dead or
silent rank is the hang detectors' business, not a straggler); fewer than
``min_rounds`` complete rounds say nothing; a tie for last is no lead.
Clocks: Flight Recorder uses each host's wall clock, so across nodes a
lead below NTP's error (a few ms) is not a margin.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ncclwatch.watchdog.slowness.bandwidth import CollectiveTiming, size_bucket, size_text
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind, ranks_text, where

Round = Mapping[int, float]  # rank -> seconds (any common origin)
MIN_ROUNDS = 10  # fewer rounds than this say nothing about who is usually last
WAIT_PART = 0.5  # the others' kernels waited at least this part of the last rank's lead: they waited for it
WAITED_SHARE = 0.5  # of a rank's timed rounds as last, the share in which the others must have waited for it


@dataclass(frozen=True)
class LastArrivals:
    """How often each rank was last by the margin over the rounds looked at, and by how much on average."""

    rounds: int
    margin_s: float
    last_counts: Mapping[int, int]
    mean_lead_s: Mapping[int, float]  # over the rounds the rank was last by the margin
    what: str | None = None  # the collective the rounds are instances of, when one ("AllReduce (1.0 MiB) of process group 0")
    # Of the rounds each rank was last by the margin: those with every kernel time (``timed``), and of those the ones
    # the others' kernels waited for it in (``waited``, at least WAIT_PART of its lead).
    timed: Mapping[int, int] = field(default_factory=dict)
    waited: Mapping[int, int] = field(default_factory=dict)

    def share(self, rank: int) -> float:
        return self.last_counts.get(rank, 0) / self.rounds if self.rounds else 0.0


def collective_series(timings: Sequence[CollectiveTiming]) -> dict[str, list[CollectiveTiming]]:
    """The instances of each recurring collective (group, op, size within a factor of two) every rank of its group
    arrived at, in sequence order, named for people."""
    series: dict[tuple[str, str, int], list[CollectiveTiming]] = defaultdict(list)
    for t in timings:
        if t.all_arrived:
            series[(t.pg, t.op, size_bucket(t.nbytes or 0))].append(t)
    return {f"{op} ({size_text(ts[-1].nbytes)}) of process group {pg}": ts for (pg, op, _), ts in series.items()}


def arrival_round(t: CollectiveTiming) -> dict[int, float]:
    """Rank -> when it enqueued the collective, in seconds."""
    return {rank: ns / 1e9 for rank, ns in t.arrivals.items()}


def collective_arrivals(instances: Sequence[CollectiveTiming], *, what: str) -> LastArrivals:
    """``last_arrivals`` over one recurring collective's instances, with how long the others' kernels waited: over
    those with every rank's kernel time where there are any (module docstring)."""
    timed = [t for t in instances if t.wait_s is not None]
    judged = timed or instances
    return last_arrivals([arrival_round(t) for t in judged], what=what, waits=[t.wait_s for t in judged])


def last_arrivals(
    rounds: Sequence[Round], *, window: int = 20, margin_s: float = 0.01, rel_margin: float = 0.1,
    what: str | None = None, waits: Sequence[float | None] | None = None,
) -> LastArrivals:  # fmt: skip
    """Who was last, by more than the margin, in each of the last ``window`` rounds.

    The margin is the larger of ``margin_s`` and ``rel_margin`` x the median
    time between rounds, so a lead of 10 ms counts in a job of 20 ms steps
    and not in one of 2 s steps.  ``waits``: per round, how long the other
    ranks' kernels waited for its last rank (``CollectiveTiming.wait_s``),
    None where not every kernel time is known.
    """
    paired = [(times, wait) for times, wait in zip(rounds, waits or [None] * len(rounds)) if len(times) >= 2][-window:]
    recent = [times for times, _ in paired]
    margin = max(margin_s, rel_margin * _period(recent))
    counts: Counter[int] = Counter()
    timed: Counter[int] = Counter()
    waited: Counter[int] = Counter()
    leads: dict[int, list[float]] = defaultdict(list)
    for times, wait in paired:
        last = max(times, key=lambda r: (times[r], r))
        lead = times[last] - max(t for r, t in times.items() if r != last)
        if lead > margin:
            counts[last] += 1
            leads[last].append(lead)
            if wait is not None:
                timed[last] += 1
                if wait >= WAIT_PART * lead:
                    waited[last] += 1
    return LastArrivals(
        rounds=len(recent),
        margin_s=margin,
        last_counts=dict(counts),
        mean_lead_s={rank: statistics.fmean(values) for rank, values in leads.items()},
        what=what,
        timed=dict(timed),
        waited=dict(waited),
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
    """The ranks last by the margin in at least ``share`` of the rounds (at most one can pass 0.5), and, where
    kernel times tell, waited for by the others (``WAITED_SHARE``, module docstring)."""
    if stats.rounds < min_rounds:
        return []
    findings = []
    for rank, count in sorted(stats.last_counts.items()):
        if count < share * stats.rounds:
            continue
        timed, waited = stats.timed.get(rank, 0), stats.waited.get(rank, 0)
        if timed and waited < WAITED_SHARE * timed:
            continue  # its host enqueued late; the GPUs did not wait for it
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
                + (f"; the others' kernels waited for it in {waited} of the {timed} with kernel times" if timed else ""),
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
