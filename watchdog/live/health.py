"""The job's health right now, as plain values: what metrics and the status API read.

Built from the sidecar's ``LiveJob`` and its open incident at scrape time
(no copy is kept), so a scrape always sees the latest state and costs only
this walk over ranks and communicators.  The performance fields are the
latest look's (``PerfHealth``, once per ``perf_interval``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ncclwatch.watchdog.live.job import LiveJob
from ncclwatch.watchdog.slowness.engine import CommBandwidth, IbPortHealth, PerfHealth, RankPerf
from ncclwatch.watchdog.slowness.findings import PerfFinding


@dataclass(frozen=True)
class RankHealth:
    rank: int
    pid: int
    host: str | None
    state: str | None  # /proc state letter
    step: int | None
    heartbeat_age_s: float | None  # since the step of the latest heartbeat was taken
    progress_age_s: float | None  # since any progress (heartbeat step or NCCL operation)


@dataclass(frozen=True)
class CommPosition:
    communicator: str  # a human label: "commId 0x67..", "process group 0 (default_pg)"
    rank: int  # global rank
    position: int  # operations issued so far (the last one's 1-based sequence number)


@dataclass(frozen=True)
class Health:
    observed_at: float
    job: str
    host: str
    ranks: tuple[RankHealth, ...]
    positions: tuple[CommPosition, ...]
    stalled_for_s: float
    stall_timeout_s: float
    hang: bool  # an incident was reported and nothing has moved since
    verdict: str | None  # of the open incident, reported or held
    culprits: tuple[int, ...]
    sources_down: tuple[str, ...]
    bundles_written: int
    restarts: int = 0  # of the workers, after a hang (--on-hang restart)
    comm_bandwidth: tuple[CommBandwidth, ...] = ()
    rank_perf: tuple[RankPerf, ...] = ()
    arrival_skew_s: float | None = None  # the latest collective every rank arrived at: last minus first
    perf_findings: tuple[PerfFinding, ...] = ()  # open slow/straggler/transport/IB findings
    ib_ports: tuple[IbPortHealth, ...] = ()


def health_of(
    live: LiveJob,
    now: float,
    *,
    job: str,
    host: str,
    verdict: str | None,
    culprits: tuple[int, ...],
    hang: bool,
    bundles_written: int,
    restarts: int = 0,
    perf: PerfHealth = PerfHealth(),
) -> Health:
    view = live.view(now)
    ranks = tuple(
        RankHealth(
            rank=w.rank,
            pid=w.pid,
            host=w.host,
            state=w.state,
            step=w.step,
            heartbeat_age_s=now - beat if (beat := view.beat_at.get(w.pid)) is not None else None,
            progress_age_s=now - moved if (moved := view.progress_at.get(w.pid)) is not None else None,
        )
        for w in view.workers
    )
    global_ranks = live.state.global_ranks()
    positions = []
    for comm in live.state.comms.values():
        for seq in comm.ranks.values():
            rank = global_ranks.get(seq.proc, seq.rank) if seq.global_rank is None and seq.proc else seq.rank
            positions.append(CommPosition(comm.label, rank, seq.total))
    return Health(
        observed_at=now,
        job=job,
        host=host,
        ranks=ranks,
        positions=tuple(positions),
        stalled_for_s=view.stalled_for,
        stall_timeout_s=view.stall_timeout,
        hang=hang,
        verdict=verdict,
        culprits=culprits,
        sources_down=view.down,
        bundles_written=bundles_written,
        restarts=restarts,
        comm_bandwidth=perf.comm_bandwidth,
        rank_perf=perf.rank_perf,
        arrival_skew_s=perf.arrival_skew_s,
        perf_findings=perf.perf_findings,
        ib_ports=perf.ib_ports,
    )
