"""The slowness engine's entry (``perf_health``): a job's performance from its matched collectives, NCCL's transport
choices and a node's InfiniBand ports: bandwidth, arrival skew, stragglers, slow collectives and links, odd
transports, bad ports.

Pure: the live performance look (``live/performance_look.py``) runs it on the dumps it
asked for (and the other nodes' records), its transport facts and this node's ports;
``ncclwatch analyze`` on the dumps and NCCL logs it was given; the evidence bundle on the
ports it read.  The values are what ``Health`` and the metrics carry.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from ncclwatch.watchdog.events import ProcKey, RankTransport, group_label, rate_bytes_per_s, state_name
from ncclwatch.watchdog.slowness.bandwidth import (
    CollectiveTiming,
    comm_bandwidth,
    rank_bandwidth,
    size_bucket,
    slow_collectives,
)
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind
from ncclwatch.watchdog.slowness.links import ib_port_findings, slow_links, transport_anomalies
from ncclwatch.watchdog.slowness.stragglers import (
    MIN_ROUNDS,
    LastArrivals,
    collective_arrivals,
    collective_series,
    stragglers,
)


@dataclass(frozen=True)
class CommBandwidth:
    communicator: str
    op: str  # NCCL's spelling: "AllReduce"
    busbw_bytes_per_s: float  # median over recent collectives (slowness.bandwidth.comm_bandwidth)


@dataclass(frozen=True)
class RankPerf:
    rank: int
    busbw_bytes_per_s: float | None = None  # slowness.bandwidth.rank_bandwidth
    last_arrival_share: float | None = None  # slowness.stragglers.LastArrivals.share
    arrival_lead_s: float | None = None  # mean lead when last by the margin
    straggler: bool = False


@dataclass(frozen=True)
class IbPortHealth:
    port: str  # "mlx5_0/1"
    active: bool
    rate_bytes_per_s: float | None = None
    xmit_bytes_per_s: float | None = None  # over the last window (IbPorts.delta)
    rcv_bytes_per_s: float | None = None
    errors: int = 0  # error counters' rise over the last window


@dataclass(frozen=True)
class PerfHealth:
    """What ``perf_health`` found (the live look keeps its latest), as the ``Health`` fields of these names carry it."""

    comm_bandwidth: tuple[CommBandwidth, ...] = ()
    rank_perf: tuple[RankPerf, ...] = ()
    arrival_skew_s: float | None = None
    perf_findings: tuple[PerfFinding, ...] = ()
    ib_ports: tuple[IbPortHealth, ...] = ()


IbReading = Mapping[str, Mapping[str, Mapping]]  # probes.infiniband.read_ib_counters: device -> port -> its sysfs files


@dataclass(frozen=True)
class IbPorts:
    """One node's InfiniBand ports: a reading and what changed over the window before it (``ib_delta``; None: first)."""

    host: str
    reading: IbReading
    delta: Mapping | None = None


def perf_health(
    timings: Sequence[CollectiveTiming] = (),
    labels: Mapping[str, str] = {},
    *,
    now: float,
    hosts: Mapping[int, str] = {},
    links: Mapping[int, Sequence[str]] = {},
    transport: Sequence[RankTransport] = (),
    global_ranks: Mapping[ProcKey, int] = {},
    active_ib_ports: Mapping[str, Sequence[str]] = {},
    ib: IbPorts | None = None,
) -> PerfHealth:
    """The slowness engine, whole: ``collective_health`` over the matched collectives, ``transport_anomalies`` over
    NCCL's transport choices (``global_ranks``: NCCL's process -> global rank; ``active_ib_ports``: host -> its ports
    that are up) and, where ``ib`` is given, that node's ports' state and ``ib_port_findings``, a port's ranks being
    those of ``ib.host`` whose ``links`` go through it.  Findings in that order."""
    health = collective_health(timings, labels, now=now, hosts=hosts, links=links)
    findings = list(health.perf_findings)
    findings += transport_anomalies(transport, global_ranks=global_ranks, active_ib_ports=active_ib_ports)
    ports: tuple[IbPortHealth, ...] = ()
    if ib is not None:
        users: dict[str, list[int]] = {}  # port -> the node's ranks whose NCCL traffic goes through it
        for rank, nics in links.items():
            if hosts.get(rank) == ib.host:
                for port in nics:
                    users.setdefault(port, []).append(rank)
        findings += ib_port_findings(ib.host, ib.reading, ib.delta, used=users.keys(), port_ranks=users)
        ports = tuple(port_health(ib.reading, ib.delta))
    return replace(health, perf_findings=tuple(findings), ib_ports=ports)


def port_health(reading: IbReading, delta: Mapping | None) -> list[IbPortHealth]:
    """Each port's state and rate, and over the last window its throughput and error counters' rise."""
    moved = (delta or {}).get("ports", {})
    out = []
    for dev, ports in sorted(reading.items()):
        for port, info in sorted(ports.items()):
            label = f"{dev}/{port}"
            window = moved.get(label, {})
            out.append(
                IbPortHealth(
                    port=label,
                    active=state_name(info.get("state")) == "ACTIVE",
                    rate_bytes_per_s=rate_bytes_per_s(info.get("rate")),
                    xmit_bytes_per_s=window.get("xmit_bytes_per_s"),
                    rcv_bytes_per_s=window.get("rcv_bytes_per_s"),
                    errors=sum(window.get("errors", {}).values()),
                )
            )
    return out


def collective_health(
    timings: Sequence[CollectiveTiming],
    labels: Mapping[str, str],
    *,
    now: float,
    hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
) -> PerfHealth:
    """Bandwidth per communicator and rank, arrival skew, stragglers, slow collectives and links; pure.

    Only collectives every rank of the group was seen arriving at are used.  A group with ranks on
    other nodes is seen in part: the time its data took is the last rank's kernel time, and when the
    last rank is elsewhere every kernel seen here includes waiting for it, so a remote straggler
    would read as a slow link (``job_health`` adds the other nodes' ranks).  A rank that enqueues last while the
    others' kernels do not wait for it is a host running ahead, no straggler (``stragglers``).  A slowdown a straggler
    explains is told in the straggler's finding, not as one of its own (``fold_symptoms``).
    """
    whole = [t for t in timings if t.all_arrived]
    series = [collective_arrivals(instances, what=what) for what, instances in collective_series(whole).items()]
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
    slow, late = fold_symptoms(_slowness(whole, now, hosts, links), late, whole, now=now, hosts=hosts, links=links)
    bandwidth = comm_bandwidth(whole)
    return PerfHealth(
        comm_bandwidth=tuple(
            CommBandwidth(labels.get(pg, group_label(pg, None)), op, bw) for (pg, op), bw in bandwidth.items()
        ),
        rank_perf=tuple(rank_perf),
        arrival_skew_s=latest.skew_s if latest is not None else None,
        perf_findings=tuple(slow + list(late.values())),
    )


def _slowness(
    timings: Sequence[CollectiveTiming], now: float, hosts: Mapping[int, str], links: Mapping[int, Sequence[str]]
) -> list[PerfFinding]:
    return slow_collectives(timings, now_ns=int(now * 1e9), hosts=hosts, links=links) + slow_links(
        timings, hosts=hosts, links=links
    )


def fold_symptoms(
    slow: Sequence[PerfFinding],
    late: Mapping[str, PerfFinding],
    timings: Sequence[CollectiveTiming],
    *,
    now: float,
    hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
) -> tuple[list[PerfFinding], dict[str, PerfFinding]]:
    """Slow collectives and links that a straggler explains, folded into the straggler's finding.

    While a rank lags, its group's collectives can take longer (4 ranks on 2 x H200: the straggler's group
    read as a slow link, BENCHMARKS.md), and an instance whose link time could not be measured from the last
    rank's start still holds the wait.  A slowdown no larger than the straggler's lateness at the very
    instances judged is its symptom: each slow finding is judged again with every instance the straggler
    was last at shortened by its lead (``without_lateness``), and one that no longer holds goes into the
    straggler's detail.  One that still holds is slow from the last arrival on, a link of its own: it stays
    beside the straggler.  Returns the slow findings left and the stragglers by key.
    """
    owner = {rank: key for key, finding in late.items() for rank in finding.ranks}
    if not slow or not owner:
        return list(slow), dict(late)
    fastest: dict[tuple, float] = {}
    for t in timings:
        if t.transfer_s is not None:
            key = _series_key(t)
            fastest[key] = min(t.transfer_s, fastest.get(key, t.transfer_s))
    recheck = [without_lateness(t, owner, fastest.get(_series_key(t), 0.0)) for t in timings]
    still = {f.key for f in _slowness(recheck, now, hosts, links)}
    kept, folded = [], dict(late)
    for finding in slow:
        key = next((owner[r] for r in finding.ranks if r in owner), None)
        if finding.kind not in (PerfKind.slow_collective, PerfKind.slow_link) or finding.key in still or key is None:
            kept.append(finding)
            continue
        host = folded[key]
        symptom = (
            f"its lateness also slowed its group ({finding.kind.value}: {finding.summary}), "
            "no more than its own delay: not a slow link"
        )
        folded[key] = replace(host, detail=f"{host.detail}; {symptom}")
    return kept, folded


def without_lateness(t: CollectiveTiming, late_ranks: Collection[int], fastest_s: float) -> CollectiveTiming:
    """This collective with its link time shortened by its last rank's lead, when that rank is a straggler, but
    never below ``fastest_s``, the fastest the same collective ran: a link time measured from the last rank's
    start holds none of the lead, and an instance that ran at its usual speed must not read as faster."""
    if t.transfer_s is None or not t.all_arrived or t.last_rank not in late_ranks:
        return t
    return replace(t, transfer_s=max(t.transfer_s - t.lead_s, fastest_s))


def _series_key(t: CollectiveTiming) -> tuple:
    """Instances of one recurring collective, as the slow-collective check groups them."""
    return (t.pg, t.op, size_bucket(t.nbytes or 0))


def _worst_series(series: Sequence[LastArrivals], rank: int) -> LastArrivals | None:
    """The collective at which this rank was last most often (metrics show the rank's worst case), among those
    with enough rounds to tell: a one-off collective (start-up's broadcast of the model) says nothing."""
    enough = [s for s in series if s.rounds >= MIN_ROUNDS]
    return max(enough, key=lambda s: (s.share(rank), s.rounds), default=None)
