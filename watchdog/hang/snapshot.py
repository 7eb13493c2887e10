"""The frozen view of a ``JobState`` that detectors read.

Detectors are pure functions of a ``Snapshot``: tuples and read-only
mappings, the clock passed in as ``observed_at``.  Building one copies each
rank's window (bounded), never the whole history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    GpuSnapshot,
    JobEnded,
    LocalPeerClosed,
    NcclWarning,
    Op,
    OpSig,
    OpState,
    ProcKey,
    RankExited,
    RankFailure,
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
    # base + len(window).  Detectors read it per rank and position (millions of reads at 32,768 ranks): an
    # attribute, not a property.
    total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.base + len(self.window))

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
    gone_at: float | None = None  # when its process exited


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
    # A job that died (hang.failure): each rank's first failure of each kind as its stderr said it, in the order
    # seen; the ranks' failed exits; how the job ended (None: still running, or not known offline)
    rank_failures: tuple[RankFailure, ...] = ()
    exits: tuple[RankExited, ...] = ()
    ended: JobEnded | None = None

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


_NO_PEERS: Mapping[int, PeerView] = MappingProxyType({})


def _peers(logs: dict[int, PeerLog], own: Callable[[dict], dict]) -> Mapping[int, PeerView]:
    if not logs:
        return _NO_PEERS
    return MappingProxyType(
        {
            peer: PeerView(
                log.count,
                log.base,
                tuple(log.sigs),
                MappingProxyType(own(log.states)),
                MappingProxyType(own(log.alone)),
            )
            for peer, log in logs.items()
        }
    )


def _rank(seq: RankSeq, global_rank: int | None) -> RankView:
    # A settled sequence never changes: its view reads its maps in place.  One that grows (an NCCL log's) is copied.
    own: Callable[[dict], dict] = _itself if seq.settled else dict
    # Its fields go into the view's __dict__ at once: a frozen dataclass's __init__ sets each through
    # object.__setattr__ (2.2 us a view against 0.4; a judgement of 32,768 ranks makes 65,536 views).  The same view
    # as ``RankView(...)`` (tests/hang/test_snapshot_views.py).
    view = object.__new__(RankView)
    window = tuple(seq.coll)
    view.__dict__.update(
        comm_rank=seq.comm_rank,
        global_rank=global_rank,
        proc=seq.proc,
        file=seq.file,
        comm_ptr=seq.comm_ptr,
        base=seq.base,
        window=window,
        digest=seq.digest,
        sent=_peers(seq.sent, own),
        received=_peers(seq.received, own),
        details=MappingProxyType(own(seq.details)),
        completed=seq.completed,
        end=seq.end,
        end_cite=seq.end_cite,
        unrecorded=seq.unrecorded,
        total=seq.base + len(window),
    )
    return view


class RankViews:
    """The views of settled sequences (``RankSeq.settled``: a dump's, a shared tail's, never changed after) that one
    snapshot made, reused by the next snapshot of the same state where the sequence is still there.

    At a hang the cluster's leader judges every node's compact evidence, then again once the full evidence of one or
    two nodes replaced theirs: the other nodes' ranks are unchanged, and copying each one's sequence into its view
    was about a third of a judgement of 32,768 ranks.  A sequence that grows in place (an NCCL log's) is read again."""

    def __init__(self) -> None:
        # id(seq) -> (seq, its view): the sequence is held, so that its id names no other while kept
        self._made: dict[int, tuple[RankSeq, RankView]] = {}
        self._last: dict[int, tuple[RankSeq, RankView]] = {}

    def view(self, seq: RankSeq, global_rank: int | None) -> RankView:
        if not seq.settled:
            return _rank(seq, global_rank)
        kept = self._last.get(id(seq))
        # a shared tail without its global rank takes it from the job's largest communicator, which may have come since
        view = kept[1] if kept is not None and kept[1].global_rank == global_rank else _rank(seq, global_rank)
        self._made[id(seq)] = (seq, view)
        return view

    def next_snapshot(self) -> None:
        """What this snapshot made is what the next may reuse; nothing older (a replaced sequence is let go)."""
        self._last, self._made = self._made, {}


def _itself(mapping: dict) -> dict:
    return mapping


def _comm(comm: Communicator, global_ranks: Mapping[ProcKey, int], views: RankViews | None) -> CommView:
    ranks = []
    for rank in sorted(comm.ranks):
        seq = comm.ranks[rank]
        global_rank = seq.global_rank
        if global_rank is None and seq.proc is not None:
            global_rank = global_ranks.get(seq.proc)
        ranks.append(views.view(seq, global_rank) if views is not None else _rank(seq, global_rank))
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


def worker_view(worker: Worker, probes: Sequence[tuple[float, float]] = (), since: float | None = None) -> WorkerView:
    """``since``: when the job fell silent (its rates count from then)."""
    cpu, io = worker.rates(probes, since)
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
        gone_at=worker.gone_at,
    )


def silent_since(state: JobState) -> float | None:
    """When the silence the latest look judged began."""
    stall = state.stall
    return stall.at - stall.stalled_for_s if stall is not None else None


def take_snapshot(state: JobState, observed_at: float, views: RankViews | None = None) -> Snapshot:
    """``views``: the rank views of the previous snapshot of this state, reused where their sequence is unchanged."""
    global_ranks = state.global_ranks()
    comms = tuple(_comm(c, global_ranks, views) for c in state.comms.values())
    if views is not None:
        views.next_snapshot()
    return Snapshot(
        observed_at=observed_at,
        comms=comms,
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
        workers=tuple(worker_view(w, state.probes_of(w.host), silent_since(state)) for w in state.current_workers()),
        stall=state.stall,
        partial=tuple(state.partial),
        mesh_groups=mesh_groups_of_dumps(state.fr_dumps.values()),
        gpu_bus=MappingProxyType({p: i.bus_id for p, i in state.procs.items() if i.bus_id}),
        rank_failures=tuple(state.rank_failures.values()),
        exits=tuple(state.exits.values()),
        ended=state.ended,
    )
