"""The frozen view of a ``JobState`` that detectors read.

Detectors are pure functions of a ``Snapshot``: tuples and read-only
mappings, the clock passed in as ``observed_at``.  Building one copies each
rank's window (bounded), never the whole history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    GpuSnapshot,
    LocalPeerClosed,
    NcclWarning,
    Op,
    OpSig,
    OpState,
    ProcKey,
    RasReport,
    StackDump,
    Stall,
    WatchdogTimeout,
    WorkerFailure,
)
from ncclwatch.watchdog.hang.mesh import GroupView, mesh_groups_of_dumps
from ncclwatch.watchdog.hang.state import Communicator, JobState, PeerLog, RankSeq, Source, Worker, fold


@dataclass(frozen=True)
class PeerView:
    count: int
    base: int
    sigs: tuple[OpSig, ...]
    states: Mapping[int, OpState]
    alone: Mapping[int, Op]  # position -> the Flight Recorder op, of ops issued outside a group


@dataclass(frozen=True)
class RankView:
    comm_rank: int
    global_rank: int | None
    proc: ProcKey | None
    file: str
    comm_ptr: str | None
    base: int
    window: tuple[OpSig, ...]
    digest: int | None
    sent: Mapping[int, PeerView]
    received: Mapping[int, PeerView]
    details: Mapping[int, Op]
    completed: int | None
    end: Literal["destroy", "abort"] | None
    end_cite: Citation | None
    unrecorded: int = 0  # operations its group issued that its Flight Recorder dump does not hold (gloo's p2p)

    @property
    def total(self) -> int:
        return self.base + len(self.window)

    @property
    def rank(self) -> int:
        """The job-wide rank when known, else the rank within the communicator."""
        return self.global_rank if self.global_rank is not None else self.comm_rank

    @property
    def name(self) -> str:
        return f"rank {self.rank}"

    def at(self, position: int) -> OpSig | None:
        """The collective at 0-based ``position``, if this rank issued it and still holds it."""
        index = position - self.base
        return self.window[index] if 0 <= index < len(self.window) else None

    def digest_at(self, position: int) -> int | None:
        """Digest of positions [0, position), when the window reaches that far back."""
        if self.digest is None or not self.base <= position <= self.total:
            return None
        return fold(self.digest, self.window[: position - self.base])

    def state_at(self, position: int) -> OpState | None:
        op = self.details.get(position)
        return op.state if op is not None else None


@dataclass(frozen=True)
class CommView:
    key: str
    source: Source
    label: str
    nranks: int
    ranks: tuple[RankView, ...]  # ordered by comm rank
    local_ranks: Mapping[tuple[str, int], int]
    members: tuple[int, ...]  # global rank of each comm rank, when known
    cites: tuple[Citation, ...]

    def by_comm_rank(self) -> Mapping[int, RankView]:
        return {r.comm_rank: r for r in self.ranks}


@dataclass(frozen=True)
class WorkerView:
    """One torchrun worker of the current attempt, as the live sidecar sampled it."""

    rank: int
    pid: int
    local_rank: int | None
    world_size: int | None
    host: str | None
    state: str | None  # /proc state letter
    cpu_share: float | None  # cores used over the last few seconds
    io_rate: float | None  # bytes/s read + written over the last few seconds
    step: int | None
    gone: bool
    node_rank: int | None = None  # torchrun's GROUP_RANK


@dataclass(frozen=True)
class Snapshot:
    observed_at: float
    comms: tuple[CommView, ...]
    global_ranks: Mapping[ProcKey, int]
    nccl_versions: Mapping[ProcKey, str]
    warnings: tuple[NcclWarning, ...]
    peer_closed: tuple[LocalPeerClosed, ...]
    timeouts: tuple[WatchdogTimeout, ...]
    failures: tuple[WorkerFailure, ...]
    ras: tuple[RasReport, ...]
    stacks: Mapping[int, StackDump]
    gpus: tuple[GpuSnapshot, ...]
    notes: tuple[str, ...]
    workers: tuple[WorkerView, ...] = ()  # empty offline unless a journal was read
    stall: Stall | None = None  # the live clock at the probe; None offline without a journal
    partial: tuple[Event, ...] = ()  # PgStatus, CollectiveFingerprint, NetworkError, RankLog, OrphanOps
    # the process groups a DeviceMesh made (name, dimension, members), from the Flight Recorder dumps: hang/mesh.py
    mesh_groups: tuple[GroupView, ...] = ()
    # each NCCL process's GPU (PCI address from its Init line's busId): which rank a kernel Xid's GPU is
    gpu_bus: Mapping[ProcKey, str] = field(default_factory=lambda: MappingProxyType({}))

    def rank_of_pid(self) -> dict[int, int]:
        """Global rank of every process known: NCCL's Init lines, then the workers' environment."""
        ranks = {proc.pid: rank for proc, rank in self.global_ranks.items()}
        ranks.update({w.pid: w.rank for w in self.workers})
        return ranks

    def pid_of(self, global_rank: int) -> int | None:
        for proc, rank in self.global_ranks.items():
            if rank == global_rank:
                return proc.pid
        return None


def _peer(log: PeerLog) -> PeerView:
    return PeerView(
        log.count, log.base, tuple(log.sigs), MappingProxyType(dict(log.states)), MappingProxyType(dict(log.alone))
    )


def _rank(seq: RankSeq, global_rank: int | None) -> RankView:
    return RankView(
        comm_rank=seq.comm_rank,
        global_rank=global_rank,
        proc=seq.proc,
        file=seq.file,
        comm_ptr=seq.comm_ptr,
        base=seq.base,
        window=tuple(seq.coll),
        digest=seq.digest,
        sent=MappingProxyType({p: _peer(log) for p, log in seq.sent.items()}),
        received=MappingProxyType({p: _peer(log) for p, log in seq.received.items()}),
        details=MappingProxyType(dict(seq.details)),
        completed=seq.completed,
        end=seq.end,
        end_cite=seq.end_cite,
        unrecorded=seq.unrecorded,
    )


def _comm(comm: Communicator, global_ranks: Mapping[ProcKey, int]) -> CommView:
    ranks = []
    for rank in sorted(comm.ranks):
        seq = comm.ranks[rank]
        global_rank = seq.global_rank
        if global_rank is None and seq.proc is not None:
            global_rank = global_ranks.get(seq.proc)
        ranks.append(_rank(seq, global_rank))
    return CommView(
        key=comm.key,
        source=comm.source,
        label=comm.label,
        nranks=comm.nranks,
        ranks=tuple(ranks),
        local_ranks=MappingProxyType(dict(comm.local_ranks)),
        members=tuple(comm.members),
        cites=tuple(comm.cites),
    )


def worker_view(worker: Worker, probes: Sequence[tuple[float, float]] = ()) -> WorkerView:
    cpu, io = worker.rates(probes)
    return WorkerView(
        rank=worker.rank,  # type: ignore[arg-type]  # current_workers() have one
        pid=worker.pid,
        local_rank=worker.local_rank,
        world_size=worker.world_size,
        host=worker.host,
        state=worker.proc_state,
        cpu_share=cpu,
        io_rate=io,
        step=worker.step,
        gone=worker.gone_at is not None,
        node_rank=worker.node_rank,
    )


def take_snapshot(state: JobState, observed_at: float) -> Snapshot:
    global_ranks = state.global_ranks()
    return Snapshot(
        observed_at=observed_at,
        comms=tuple(_comm(c, global_ranks) for c in state.comms.values()),
        global_ranks=MappingProxyType(global_ranks),
        nccl_versions=MappingProxyType({p: i.nccl_version for p, i in state.procs.items() if i.nccl_version}),
        warnings=tuple(state.warnings),
        peer_closed=tuple(state.peer_closed),
        timeouts=tuple(state.timeouts),
        failures=tuple(state.failures),
        ras=tuple(state.ras),
        stacks=MappingProxyType(dict(state.stacks)),
        gpus=tuple(state.gpus),
        notes=tuple(state.notes),
        workers=tuple(worker_view(w, state.probes) for w in state.current_workers()),
        stall=state.stall,
        partial=tuple(state.partial),
        mesh_groups=mesh_groups_of_dumps(state.fr_dumps.values()),
        gpu_bus=MappingProxyType({p: i.bus_id for p, i in state.procs.items() if i.bus_id}),
    )
