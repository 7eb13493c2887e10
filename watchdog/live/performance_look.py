"""The performance look: while the job is healthy, bandwidth, arrival skew, transports and ports, once a minute.

Every ``perf_interval`` seconds the sidecar, when no incident is open, asks
``PerfWatch.look``: every rank of this node is asked for one Flight
Recorder dump (the hang probe's doors, waited for at most ``DUMP_WAIT_S``),
the dumps are matched into collectives and the slowness engine
(``slowness.engine.perf_health``) runs over them, together with the
transports NCCL chose (its init lines) and this node's InfiniBand ports
(counter deltas since the previous look).  The result is
kept as ``health`` (metrics) and ``findings`` (the hang bundle); the look
returns the findings not seen before in this run, which the sidecar logs
and, where the operator asked for it, pages.  Nothing here judges hangs,
and nothing here feeds the hang detectors' state: a look's dumps are its
own.

Several nodes (``JobLook``): a group spanning nodes is seen in part here,
so after its look each node publishes a compact record of its ranks'
newest collectives and of what NCCL chose there (``cluster.perf_records``)
and the leader, after its own look, merges the others' records of the same
round into its entries and its transport facts and runs the same
``perf_health`` over the whole job. Its findings are the job's:
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
from ncclwatch.watchdog.events import STOPPED_STATES, FrDump, ProcKey, RankTransport, group_label
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.probes.flight_recorder import read_dump, request_dumps
from ncclwatch.watchdog.probes.infiniband import SYS_INFINIBAND, ib_delta, read_ib_counters
from ncclwatch.watchdog.slowness.bandwidth import RankEntry, match_entries, rank_entries
from ncclwatch.watchdog.slowness.engine import IbPorts, IbReading, PerfHealth, perf_health, port_health
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind
from ncclwatch.watchdog.slowness.links import rank_links
from ncclwatch.watchdog.sources.files import TransportReader

log = logging.getLogger("ncclwatch")

# A primed dump takes well under a second; a rank slower than this sits out one look rather than hold the
# look (which runs beside the hang ticks, never in them) for the others.
DUMP_WAIT_S = 2.0

DumpRequest = Callable[[Mapping[int, int]], Awaitable[list[FrDump]]]  # rank -> pid: the dumps that came
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
        self,
        workers: Sequence[WorkerView],
        global_ranks: Mapping[ProcKey, int],
        host: str,
        now: float,
        job: JobLook | None = None,
    ) -> list[PerfFinding]:
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
        ib = self._ib_ports(host, ib_now, now)
        active = [p.port for p in port_health(ib_now, None) if p.active] if ib_now is not None else []
        # Thousands of entries per rank: read and matched off the event loop (it also serves /metrics and the cluster).
        entries = await asyncio.to_thread(rank_entries, dumps)
        others: Mapping[int, PerfRecord] | None = {}
        if job is not None:
            mine = await asyncio.to_thread(
                lambda: perf_record(
                    job.node,
                    host,
                    now,
                    entries,
                    descs=descs,
                    hosts=hosts,
                    links=links,
                    transport=facts,
                    global_ranks=global_ranks,
                    ib_active=active,
                )
            )
            others = await job.exchange(mine)
        # A member of several nodes keeps its ranks' view for its metrics and tells its own ports; the collectives'
        # findings and the transports compared across nodes are the leader's.
        judges = others is not None
        remote, compared = (others or {}).values(), facts if judges else ()
        perf = await asyncio.to_thread(
            lambda: job_health(
                entries,
                descs,
                hosts,
                links,
                remote,
                now=now,
                transport=compared,
                global_ranks=global_ranks,
                ib_active={host: active} if active else {},
                ib=ib,
            )
        )
        found = list(perf.perf_findings) if judges else [f for f in perf.perf_findings if f.kind is PerfKind.ib_port]
        # A straggler is "consistently" last: two looks in a row, never one window of rounds (on the 2-core
        # CI machine one healthy run in three had a rank last in 13 of 20 rounds by chance and load).
        confirmed = [f for f in found if f.kind is not PerfKind.straggler or f.key in self._found_last]
        self._found_last = {f.key for f in found}
        found = confirmed
        straggling = {rank for f in found if f.kind is PerfKind.straggler for rank in f.ranks}
        rank_perf = tuple(replace(r, straggler=r.rank in straggling) for r in perf.rank_perf)
        self.health = replace(perf, perf_findings=tuple(found), rank_perf=rank_perf)
        new = [f for f in found if f.key not in self._told]
        self._told.update(f.key for f in new)
        return new

    def _ib_ports(self, host: str, reading: IbReading | None, now: float) -> IbPorts | None:
        """This node's ports and, from the second look on, what changed since the previous look's reading."""
        if reading is None:
            return None
        before, self._ib_before = self._ib_before, (now, reading)
        delta = ib_delta(before[1], reading, now - before[0]) if before is not None and now > before[0] else None
        return IbPorts(host, reading, delta)


def job_health(
    entries: Sequence[RankEntry],
    descs: Mapping[str, str | None],
    hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
    others: Iterable[PerfRecord],
    *,
    now: float,
    transport: Sequence[RankTransport] = (),
    global_ranks: Mapping[ProcKey, int] = {},
    ib_active: Mapping[str, Sequence[str]] = {},
    ib: IbPorts | None = None,
) -> PerfHealth:
    """``perf_health`` over this node's entries and NCCL's choices (``transport``, ``ib_active``: host -> its ports
    that are up) and the other nodes' records: each rank lives on one node, so the union is every rank's view of each
    collective and every process's transport (none: this node alone).  ``ib``: this node's ports."""
    every_rank, every_transport = list(entries), list(transport)
    labels = {pg: group_label(pg, desc) for pg, desc in descs.items()}
    all_hosts, all_links, all_ranks, up = dict(hosts), dict(links), dict(global_ranks), dict(ib_active)
    for record in others:
        every_rank += record.rank_entries()
        labels = record.labels() | labels
        all_hosts |= record.hosts
        all_links |= record.links
        every_transport += record.transport
        all_ranks |= dict(record.global_ranks)
        if record.ib_active:
            up[record.host] = record.ib_active
    return perf_health(
        match_entries(every_rank),
        labels,
        now=now,
        hosts=all_hosts,
        links=all_links,
        transport=every_transport,
        global_ranks=all_ranks,
        active_ib_ports=up,
        ib=ib,
    )


def _descs(dumps: Sequence[FrDump]) -> dict[str, str | None]:
    """Process group -> its description (``default_pg``), from the first dump that lists it."""
    out: dict[str, str | None] = {}
    for dump in dumps:
        for pg_id, pg in dump.process_groups.items():
            out.setdefault(pg_id, pg.desc)
    return out


def perf_watch(interval: float, fr_dir: Path, nccl_dir: Path, ib_root: Path = SYS_INFINIBAND) -> PerfWatch:
    """The look as a job runs it: its ranks' Flight Recorder, its NCCL debug files, this node's sysfs."""
    return PerfWatch(
        interval=interval,
        dumps=flight_recorder_dumps(fr_dir),
        transport=TransportReader(nccl_dir).facts,
        ib_ports=lambda: read_ib_counters(ib_root),
    )
