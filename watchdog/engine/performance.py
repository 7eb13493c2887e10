"""A job's performance from its matched collectives: bandwidth, arrival skew, stragglers, slow collectives and links.

Pure: the live performance look (``live/perf.py``) runs it on the dumps it
asked for (and the other nodes' records), ``ncclwatch analyze`` on the dumps
it was given; the values are what ``Health`` and the metrics carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ncclwatch.watchdog.engine.bandwidth import CollectiveTiming, comm_bandwidth, rank_bandwidth, slow_collectives, slow_links
from ncclwatch.watchdog.engine.perf import PerfFinding
from ncclwatch.watchdog.engine.state import group_label
from ncclwatch.watchdog.engine.stragglers import MIN_ROUNDS, LastArrivals, arrival_series, last_arrivals, stragglers


@dataclass(frozen=True)
class CommBandwidth:
    communicator: str
    op: str  # NCCL's spelling: "AllReduce"
    busbw_bytes_per_s: float  # median over recent collectives (engine.bandwidth.comm_bandwidth)


@dataclass(frozen=True)
class RankPerf:
    rank: int
    busbw_bytes_per_s: float | None = None  # engine.bandwidth.rank_bandwidth
    last_arrival_share: float | None = None  # engine.stragglers.LastArrivals.share
    arrival_lead_s: float | None = None  # mean lead when last by the margin
    straggler: bool = False


@dataclass(frozen=True)
class IbPortHealth:
    port: str  # "mlx5_0/1"
    active: bool
    rate_bytes_per_s: float | None = None
    xmit_bytes_per_s: float | None = None  # over the last window (probes.infiniband.ib_delta)
    rcv_bytes_per_s: float | None = None
    errors: int = 0  # error counters' rise over the last window


@dataclass(frozen=True)
class PerfHealth:
    """The latest performance look (``live/perf.py``), as the ``Health`` fields of the same names carry it."""

    comm_bandwidth: tuple[CommBandwidth, ...] = ()
    rank_perf: tuple[RankPerf, ...] = ()
    arrival_skew_s: float | None = None
    perf_findings: tuple[PerfFinding, ...] = ()
    ib_ports: tuple[IbPortHealth, ...] = ()


def collective_health(
    timings: Sequence[CollectiveTiming], labels: Mapping[str, str], *, now: float, hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
) -> PerfHealth:  # fmt: skip
    """Bandwidth per communicator and rank, arrival skew, stragglers, slow collectives and links; pure.

    Only collectives every rank of the group was seen arriving at are used.  A group with ranks on
    other nodes is seen in part: the time its data took is the last rank's kernel time, and when the
    last rank is elsewhere every kernel seen here includes waiting for it, so a remote straggler
    would read as a slow link (``job_health`` adds the other nodes' ranks).
    """
    whole = [t for t in timings if t.all_arrived]
    series = [last_arrivals(rounds, source="arrival", what=what) for what, rounds in arrival_series(whole).items()]
    late: dict[str, PerfFinding] = {}
    # A rank late at several collectives is one finding: the one where it is last most often.
    for stats in sorted(series, key=lambda s: -max(map(s.share, s.last_counts), default=0.0)):
        for finding in stragglers(stats, hosts=hosts, links=links):
            late.setdefault(finding.key, finding)
    straggling = {rank for f in late.values() for rank in f.ranks}
    per_rank = rank_bandwidth(whole)
    rank_perf = []
    for rank in sorted({rank for t in whole for rank in t.arrivals}):
        worst = _worst_series(series, rank)
        rank_perf.append(
            RankPerf(
                rank=rank,
                busbw_bytes_per_s=per_rank.get(rank),
                last_arrival_share=worst.share(rank) if worst else None,
                arrival_lead_s=worst.mean_lead_s.get(rank) if worst else None,
                straggler=rank in straggling,
            )
        )
    latest = max(whole, key=lambda t: min(t.arrivals.values()), default=None)
    slow = slow_collectives(whole, now_ns=int(now * 1e9), hosts=hosts, links=links) + slow_links(whole, hosts=hosts, links=links)
    bandwidth = comm_bandwidth(whole)
    return PerfHealth(
        comm_bandwidth=tuple(CommBandwidth(labels.get(pg, group_label(pg, None)), op, bw) for (pg, op), bw in bandwidth.items()),
        rank_perf=tuple(rank_perf),
        arrival_skew_s=latest.skew_s if latest is not None else None,
        perf_findings=tuple(slow + list(late.values())),
    )


def _worst_series(series: Sequence[LastArrivals], rank: int) -> LastArrivals | None:
    """The collective at which this rank was last most often (metrics show the rank's worst case), among those
    with enough rounds to tell: a one-off collective (start-up's broadcast of the model) says nothing."""
    enough = [s for s in series if s.rounds >= MIN_ROUNDS]
    return max(enough, key=lambda s: (s.share(rank), s.rounds), default=None)
