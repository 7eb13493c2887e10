"""The performance look: while the job is healthy, bandwidth, arrival skew, transports and ports, once a minute.

Every ``perf_interval`` seconds the sidecar, when no incident is open, asks
``PerfWatch.look``: every rank of this node is asked for one Flight
Recorder dump (the hang probe's doors, waited for at most ``DUMP_WAIT_S``),
the dumps are matched into collectives and the pure detectors run over
them (``slowness.bandwidth``, ``slowness.stragglers``, ``slowness.links``),
together with the transports NCCL chose (its init lines) and this node's
InfiniBand ports (counter deltas since the previous look).  The result is
kept as ``health`` (metrics) and ``findings`` (the hang bundle); the look
returns the findings not seen before in this run, which the sidecar logs
and, where the operator asked for it, pages.  Nothing here judges hangs,
and nothing here feeds the hang detectors' state: a look's dumps are its
own.

Several nodes (``JobLook``): a group spanning nodes is seen in part here,
so after its look each node publishes a compact record of its ranks'
newest collectives and of what NCCL chose there (``cluster.perf_records``)
and the leader, after its own look, merges the others' records of the same
round into its entries and runs the same ``collective_health`` and
``transport_anomalies`` over the whole job. Its findings are the job's:
the leader alone logs and pages them (a member logs and pages its node's
InfiniBand ports only, and keeps its own ranks' view for its metrics).
Every node looks at the same wall-clock moments (multiples of the
interval), so their newest entries cover the same collectives. Arrival
times compared across hosts carry NTP's error (a few ms): the straggler
margin, max(10 ms, 10 % of the period), stays above it. A single node, or
a store that cannot be reached, looks as one node alone.

What it cannot see alone: other nodes' ranks (arrival skew, stragglers and
bandwidth then come from groups whose ranks are all on this node; see
``collective_health``); bandwidth needs
completed entries with durations (NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``,
which the wrapper sets): gloo's Flight Recorder leaves its entries
``scheduled`` with no completion time, so a gloo job shows arrival skew
and stragglers only.

Failure modes: a rank that does not answer in time is left out of that
look (its collectives then lack an arrival and are not rounds; a look no
rank answers shows no bandwidth or arrivals until the next); a dump that
cannot be read is skipped; no InfiniBand, no NCCL log: those parts are
empty, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ncclwatch.watchdog.cluster.perf_records import PerfRecord, perf_record
from ncclwatch.watchdog.slowness.bandwidth import RankEntry, match_entries, rank_entries
from ncclwatch.watchdog.slowness.links import ib_port_findings, rank_links, transport_anomalies
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind
from ncclwatch.watchdog.slowness.engine import IbPortHealth, PerfHealth, collective_health
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.hang.state import group_label
from ncclwatch.watchdog.events import STOPPED_STATES, FrDump, ProcKey
from ncclwatch.watchdog.parsing.transport import RankTransport
from ncclwatch.watchdog.probes.infiniband import SYS_INFINIBAND, ib_delta, rate_bytes_per_s, read_ib_counters, state_name
from ncclwatch.watchdog.sources.files import TransportReader
from ncclwatch.watchdog.probes.flight_recorder import read_dump, request_dumps

log = logging.getLogger("ncclwatch")

# A primed dump takes well under a second; a rank slower than this sits out one look rather than hold the
# look (which runs beside the hang ticks, never in them) for the others.
DUMP_WAIT_S = 2.0

DumpRequest = Callable[[Mapping[int, int]], Awaitable[list[FrDump]]]  # rank -> pid: the dumps that came
IbReading = dict  # probes.infiniband.read_ib_counters
# Publishes this node's record; answers the other nodes' records when this node judges the job, None when another does.
PerfExchange = Callable[[PerfRecord], Awaitable[Mapping[int, PerfRecord] | None]]


@dataclass(frozen=True)
class JobLook:
    """How this node takes part in a job-wide look: its node rank and the exchange through the job's store."""

    node: int
    exchange: PerfExchange


def flight_recorder_dumps(fr_dir: Path, wait_s: float = DUMP_WAIT_S) -> DumpRequest:
    """Ask ranks for dumps, quietly (nothing in the job's output), read what came (parsed off the event loop)."""

    async def dumps(ranks: Mapping[int, int]) -> list[FrDump]:
        fresh, errors = await request_dumps(fr_dir, ranks, wait_s, quiet=True)
        for rank, error in sorted(errors.items()):
            log.info("performance look: rank %d: %s", rank, error)
        events = await asyncio.to_thread(lambda: [e for path in fresh.values() for e in read_dump(path)])
        return [e for e in events if isinstance(e, FrDump)]

    return dumps


@dataclass
class PerfWatch:
    """The latest look's results, when the next look is due, and which findings were already told."""

    interval: float  # seconds between looks; 0: never
    dumps: DumpRequest
    transport: Callable[[], Sequence[RankTransport]] = tuple  # NCCL's transport facts so far (TransportReader.facts)
    ib_ports: Callable[[], IbReading | None] = lambda: None  # this node's InfiniBand ports (read_ib_counters)
    health: PerfHealth = field(default_factory=PerfHealth, init=False)
    _next_look: float | None = field(default=None, init=False)
    _told: set[str] = field(default_factory=set, init=False)  # finding keys reported in this run
    _found_last: set[str] = field(default_factory=set, init=False)  # finding keys the previous look made
    _ib_before: tuple[float, IbReading] | None = field(default=None, init=False)  # the previous look's port reading

    def findings(self) -> tuple[PerfFinding, ...]:
        return self.health.perf_findings

    def due(self, now: float) -> bool:
        """The first look comes one interval after the first question (the job's start), then one per interval."""
        if self.interval <= 0:
            return False
        if self._next_look is None:
            self._next_look = now + self.interval
        return now >= self._next_look

    async def look(
        self, workers: Sequence[WorkerView], global_ranks: Mapping[ProcKey, int], host: str, now: float,
        job: JobLook | None = None,
    ) -> list[PerfFinding]:  # fmt: skip
        """One look at this node's ranks (and, on the leader of several nodes, the job's); the findings whose
        key this run has not reported before."""
        # Several nodes look at the same wall-clock moments (multiples of the interval, at least half an interval
        # apart), so the newest entries each one shares cover the same collectives.
        step = self.interval
        self._next_look = now + step if job is None else math.ceil((now + step / 2) / step) * step
        answering = {w.rank: w.pid for w in workers if not w.gone and w.state not in STOPPED_STATES}
        dumps = await self.dumps(answering)
        facts, ib_now = await asyncio.to_thread(lambda: (list(self.transport()), self.ib_ports()))
        hosts = {w.rank: w.host or host for w in workers}
        links = rank_links(facts, global_ranks)
        descs = _descs(dumps)
        ports, port_findings = self._ports(host, ib_now, links, hosts, now)
        active = [p.port for p in ports if p.active]
        # Thousands of entries per rank: read and matched off the event loop (it also serves /metrics and the cluster).
        entries = await asyncio.to_thread(rank_entries, dumps)
        others: Mapping[int, PerfRecord] | None = {}
        if job is not None:
            mine = await asyncio.to_thread(
                lambda: perf_record(job.node, host, now, entries, descs=descs, hosts=hosts, links=links, transport=facts,
                                    global_ranks=global_ranks, ib_active=active)
            )  # fmt: skip
            others = await job.exchange(mine)
        remote = (others or {}).values()
        perf = await asyncio.to_thread(lambda: job_health(entries, descs, hosts, links, remote, now=now))
        # A member of several nodes keeps its ranks' view for its metrics and tells its own ports; the collectives'
        # findings and the transports compared across nodes are the leader's.
        found = port_findings
        if others is not None:
            found = list(perf.perf_findings) + self._transports(host, facts, global_ranks, active, remote) + found
        # A straggler is "consistently" last: two looks in a row, never one window of rounds (on the 2-core
        # CI machine one healthy run in three had a rank last in 13 of 20 rounds by chance and load).
        confirmed = [f for f in found if f.kind is not PerfKind.straggler or f.key in self._found_last]
        self._found_last = {f.key for f in found}
        found = confirmed
        straggling = {rank for f in found if f.kind is PerfKind.straggler for rank in f.ranks}
        rank_perf = tuple(replace(r, straggler=r.rank in straggling) for r in perf.rank_perf)
        self.health = replace(perf, perf_findings=tuple(found), ib_ports=tuple(ports), rank_perf=rank_perf)
        new = [f for f in found if f.key not in self._told]
        self._told.update(f.key for f in new)
        return new

    def _transports(
        self, host: str, facts: Sequence[RankTransport], global_ranks: Mapping[ProcKey, int], active: Sequence[str],
        remote: Iterable[PerfRecord],
    ) -> list[PerfFinding]:  # fmt: skip
        """Transport anomalies over this node's NCCL choices and, on the leader, every other node's."""
        every, ranks, up = list(facts), dict(global_ranks), {host: list(active)} if active else {}
        for record in remote:
            every += record.transport
            ranks |= dict(record.global_ranks)
            if record.ib_active:
                up[record.host] = record.ib_active
        return transport_anomalies(every, global_ranks=ranks, active_ib_ports=up)

    def _ports(
        self, host: str, reading: IbReading | None, links: Mapping[int, Sequence[str]], hosts: Mapping[int, str], now: float
    ) -> tuple[list[IbPortHealth], list[PerfFinding]]:
        if reading is None:
            return [], []
        before, self._ib_before = self._ib_before, (now, reading)
        delta = ib_delta(before[1], reading, now - before[0]) if before is not None and now > before[0] else None
        users: dict[str, list[int]] = {}  # port -> this node's ranks whose NCCL traffic goes through it
        for rank, labels in links.items():
            if hosts.get(rank) == host:
                for label in labels:
                    users.setdefault(label, []).append(rank)
        findings = ib_port_findings(host, reading, delta, used=users.keys(), port_ranks=users)
        return port_health(reading, delta), findings


def job_health(
    entries: Sequence[RankEntry], descs: Mapping[str, str | None], hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]], others: Iterable[PerfRecord], *, now: float,
) -> PerfHealth:  # fmt: skip
    """``collective_health`` over this node's entries and the other nodes' records: each rank lives on one node,
    so the union is every rank's view of each collective (none: this node alone)."""
    every_rank = list(entries)
    labels = {pg: group_label(pg, desc) for pg, desc in descs.items()}
    all_hosts, all_links = dict(hosts), dict(links)
    for record in others:
        every_rank += record.rank_entries()
        labels = record.labels() | labels
        all_hosts |= record.hosts
        all_links |= record.links
    return collective_health(match_entries(every_rank), labels, now=now, hosts=all_hosts, links=all_links)


def _descs(dumps: Sequence[FrDump]) -> dict[str, str | None]:
    """Process group -> its description (``default_pg``), from the first dump that lists it."""
    out: dict[str, str | None] = {}
    for dump in dumps:
        for pg_id, pg in dump.process_groups.items():
            out.setdefault(pg_id, pg.desc)
    return out


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


def perf_watch(interval: float, fr_dir: Path, nccl_dir: Path, ib_root: Path = SYS_INFINIBAND) -> PerfWatch:
    """The look as a job runs it: its ranks' Flight Recorder, its NCCL debug files, this node's sysfs."""
    return PerfWatch(
        interval=interval,
        dumps=flight_recorder_dumps(fr_dir),
        transport=TransportReader(nccl_dir).facts,
        ib_ports=lambda: read_ib_counters(ib_root),
    )
