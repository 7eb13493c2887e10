"""Fold events into per-communicator, per-rank operation sequences.

``JobState`` is the only mutable thing in the engine.  It keeps, for every
(communicator, rank) a ``RankSeq``: how many collectives the rank issued, the
last ``window`` of them, a stable digest of everything older, per-peer
point-to-point counts, and how the communicator ended.  Memory is therefore
bounded by ``ranks x communicators x window`` whatever the length of the run
(bench/ measures it).

Ranks are aligned by position: the n-th collective a rank issued on a
communicator must match the n-th of every other rank.  NCCL's ``opCount`` is
not used (it is 0 forever on single-node jobs from 2.27.3).

Mergeable: every ``RankSeq`` belongs to one rank and so to one node; merging
the states of several nodes is a union (``merge``): the leader's sidecar
merges the other nodes' evidence, shared through the job's store, into its own
(``live/judging.py``, ``cluster/judge.py``).

``hang.snapshot.take_snapshot`` hands detectors a frozen view; detectors never
see this module's mutable objects.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ncclwatch.watchdog.events import (
    Citation,
    CollectiveFingerprint,
    CommEnd,
    CommInit,
    CommTopology,
    Event,
    FailureKind,
    FrDump,
    FrEntry,
    FrProcessGroup,
    GpuSnapshot,
    Heartbeat,
    JobEnded,
    LocalPeerClosed,
    NcclVersion,
    NcclWarning,
    NetworkError,
    Op,
    OpBatch,
    OpSig,
    OpState,
    OrphanOps,
    PeerTail,
    PgStatus,
    ProcessState,
    ProcKey,
    RankExited,
    RankFailure,
    RankLog,
    RasReport,
    SequenceTail,
    StackDump,
    Stall,
    Unusable,
    WatchdogTimeout,
    WorkerFailure,
    WorkerGone,
    WorkerSeen,
    XidError,
    group_label,
)

DEFAULT_WINDOW = 2048
_MAX_NOTES = 200
_MAX_PARTIAL = 4000  # partial-evidence events kept (each is one diagnostic line, deduplicated)
SHARED_TAIL = " (shared via the store)"  # the file of a sequence another node's sidecar shared
SAMPLES_KEPT = 8  # /proc samples per worker (0.5 s apart live: CPU and I/O rates over ~4 s)
PROBES_KEPT = SAMPLES_KEPT  # probe windows remembered: more than the samples span
DUMP_SETTLE_S = 0.5  # after a probe, a rank may still be writing the dump it was asked for

Source = Literal["nccl_log", "flight_recorder"]


_SIG_HASHES: dict[OpSig, int] = {}


def sig_hash(sig: OpSig) -> int:
    """A hash of a signature that is the same in every process and run (unlike ``hash``)."""
    value = _SIG_HASHES.get(sig)
    if value is None:
        if len(_SIG_HASHES) > 100_000:  # sizes that never repeat must not grow memory
            _SIG_HASHES.clear()
        value = _SIG_HASHES[sig] = zlib.crc32(repr(tuple(sig)).encode())
    return value


_SIGS: dict[OpSig, OpSig] = {}


def interned(sig: OpSig) -> OpSig:
    """One object for equal signatures: detectors compare every rank's operation at each position (32,768 ranks at
    4,096 nodes), and equal objects compare at once by identity.  A dump's and a shared tail's come through here."""
    kept = _SIGS.get(sig)
    if kept is None:
        if len(_SIGS) > 100_000:  # as ``_SIG_HASHES``: sizes that never repeat must not grow memory
            _SIGS.clear()
        kept = _SIGS[sig] = sig
    return kept


def fold(digest: int, sigs: list[OpSig] | tuple[OpSig, ...]) -> int:
    """Chain ``sigs`` into ``digest``: order-sensitive, computed in C by crc32."""
    hashes = _SIG_HASHES
    values = array("I", [hashes.get(s) or sig_hash(s) for s in sigs])
    return zlib.crc32(values.tobytes(), digest)


@dataclass
class PeerLog:
    """Sends to (or receives from) one peer, in order: count and last window."""

    count: int = 0
    base: int = 0
    sigs: list[OpSig] = field(default_factory=list)
    states: dict[int, OpState] = field(default_factory=dict)  # position -> state (Flight Recorder)
    # position -> the Flight Recorder op, for ops issued alone (not in a coalesced group): its entry index is the
    # order in which one rank's sends and recvs to a peer queue on its stream; its frames, where it was called
    alone: dict[int, Op] = field(default_factory=dict)


@dataclass
class RankSeq:
    """One rank's operations on one communicator, as one source saw them."""

    comm_rank: int
    proc: ProcKey | None
    file: str
    comm_ptr: str | None = None  # NCCL log: the communicator's address in this process
    global_rank: int | None = None
    coll: list[OpSig] = field(default_factory=list)
    base: int = 0  # absolute position of coll[0]
    digest: int | None = 0  # digest of positions [0, base); None when unknown
    sent: dict[int, PeerLog] = field(default_factory=dict)
    received: dict[int, PeerLog] = field(default_factory=dict)
    details: dict[int, Op] = field(default_factory=dict)  # position -> Op, Flight Recorder only
    completed: int | None = None  # collectives known completed (Flight Recorder)
    end: Literal["destroy", "abort"] | None = None
    end_cite: Citation | None = None
    unrecorded: int = 0  # operations the group issued that its Flight Recorder did not record (``_unrecorded``)
    # Made whole from one Flight Recorder dump or one shared tail, and never changed after: a newer dump or tail makes
    # a new sequence.  Only an NCCL log's sequences grow in place.  (A snapshot reuses the view of a settled one.)
    settled: bool = False

    @property
    def total(self) -> int:
        return self.base + len(self.coll)

    @property
    def rank(self) -> int:
        """The job-wide rank when known, else the rank within the communicator."""
        return self.global_rank if self.global_rank is not None else self.comm_rank

    def trim(self, window: int) -> None:
        """Fold the oldest collectives into the digest once the window overflows."""
        if len(self.coll) > 2 * window:
            cut = len(self.coll) - window
            if self.digest is not None:
                self.digest = fold(self.digest, self.coll[:cut])
            del self.coll[:cut]
            self.base += cut
            for pos in [p for p in self.details if p < self.base]:
                del self.details[pos]
        for logs in (self.sent, self.received):
            for log in logs.values():
                if len(log.sigs) > 2 * window:
                    cut = len(log.sigs) - window
                    del log.sigs[:cut]
                    log.base += cut


@dataclass
class Communicator:
    key: str
    source: Source
    nranks: int
    label: str  # what a human recognises: "commId 0x67..", "pg 0 (default_pg)"
    ranks: dict[int, RankSeq] = field(default_factory=dict)  # comm rank -> sequence
    local_ranks: dict[tuple[str, int], int] = field(default_factory=dict)  # (host, localRank) -> comm rank
    members: list[int] = field(default_factory=list)  # global rank of each comm rank, when known (Flight Recorder)
    cites: list[Citation] = field(default_factory=list)  # init lines, dump files
    # The same cites as a set: a leader folding 8,192 ranks' dumps into one group must not scan the list per dump.
    cited: set[Citation] = field(default_factory=set)


@dataclass
class NcclProcess:
    """A process as NCCL's log names it (``host:pid``): its version and the files it wrote."""

    proc: ProcKey
    nccl_version: str | None = None
    files: set[str] = field(default_factory=set)
    bus_id: str | None = None  # its GPU's PCI address, from its Init line (``busId``): where a kernel Xid lands


@dataclass
class Worker:
    """A torchrun worker as the live sidecar saw it (or its journal recorded it)."""

    pid: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    restart: int = 0
    seen_at: float = 0.0
    gone_at: float | None = None
    step: int | None = None
    node_rank: int | None = None  # torchrun's GROUP_RANK
    seen: WorkerSeen | None = None  # as the worker source found it: its job's store, run id, node count
    samples: deque[ProcessState] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))

    @property
    def proc_state(self) -> str | None:
        return self.samples[-1].state if self.samples else None

    def rates(
        self, probes: Sequence[tuple[float, float]] = (), since: float | None = None
    ) -> tuple[float | None, float | None]:
        """CPU (cores) and I/O (bytes/s) over the samples kept: a busy rank from an idle one.

        ``since``: when the job fell silent; only the samples from then count where at least two are.  The samples
        kept reach 4 s back, and a look 2 s into the silence saw a rank asleep in a syscall as busy with the work it
        did before it slept (its page then waited for a second look: 9.1 s on the H200, the stall timeout 5 s).

        The CPU is the main thread's where both samples have it: the thread that runs the rank's own code.  On
        the H200 a pipeline stage asleep in Python read as busy by its process's CPU (NCCL's proxy thread spins
        while a peer's send waits), and its hang was held as "a checkpoint?".  The I/O leaves out the spans of
        ``probes`` (when ncclwatch asked the ranks for Flight Recorder dumps, and until they were written): on the
        H200 an FSDP2 rank asleep in Python wrote its dump while the confirming look sampled it, and every hang of
        FSDP2, TP and pipeline jobs was held as busy."""
        samples = list(self.samples)
        if since is not None and len(recent := [s for s in samples if s.at >= since]) >= 2:
            samples = recent
        if len(samples) < 2:
            return None, None
        first, last = samples[0], samples[-1]
        seconds = last.at - first.at
        if seconds <= 0:
            return None, None
        io = _io_rate(samples, probes)
        if last.main_cpu_seconds is not None and first.main_cpu_seconds is not None:
            return (last.main_cpu_seconds - first.main_cpu_seconds) / seconds, io
        return (last.cpu_seconds - first.cpu_seconds) / seconds, io


def _io_rate(samples: Sequence[ProcessState], probes: Sequence[tuple[float, float]]) -> float | None:
    """Bytes per second over the spans between consecutive samples that no probe overlaps; None without any."""
    moved, seconds = 0, 0.0
    for before, after in zip(samples, list(samples)[1:]):
        if before.io_bytes is None or after.io_bytes is None or after.at <= before.at:
            continue
        if any(began < after.at and before.at < ended + DUMP_SETTLE_S for began, ended in probes):
            continue
        moved += after.io_bytes - before.io_bytes
        seconds += after.at - before.at
    return moved / seconds if seconds > 0 else None


class JobState:
    """Everything the engine knows about one job; fed one event at a time."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.comms: dict[str, Communicator] = {}
        self.procs: dict[ProcKey, NcclProcess] = {}
        self.warnings: list[NcclWarning] = []
        # The latest dump of each file, whole: bandwidth and arrival skew need its timings (slowness/engine.py).
        self.fr_dumps: dict[str, FrDump] = {}
        self.peer_closed: list[LocalPeerClosed] = []
        self.timeouts: list[WatchdogTimeout] = []
        self.failures: list[WorkerFailure] = []
        self.ras: list[RasReport] = []
        self.stacks: dict[int, StackDump] = {}
        self.gpus: list[GpuSnapshot] = []
        self.notes: list[str] = []
        self.workers: dict[int, Worker] = {}  # pid -> worker (live sidecar, or its journal)
        self.stall: Stall | None = None  # the latest probe's clock (live sidecar, or its journal)
        # host -> (began, ended) of its sidecar's latest looks; None: this node's own, or a journal's (no host named)
        self.probes: dict[str | None, deque[tuple[float, float]]] = {}
        self._live: dict[tuple[ProcKey, str], RankSeq] = {}  # (proc, comm ptr) -> open sequence
        self._comm_of: dict[tuple[ProcKey, str], str] = {}  # (proc, comm ptr) -> comm key
        self._init_count: dict[ProcKey, int] = {}
        self._unknown_ops: dict[tuple[ProcKey, str], int] = {}
        self._unknown_files: dict[tuple[ProcKey, str], str] = {}
        self.partial: list[Event] = []  # PyTorch statuses, DETAIL fingerprints, network errors, ... (hang.partial)
        # A job that died (hang.failure): per rank (None: a line that names none) its first failure of each kind,
        # per rank its exit (torchrun's root cause kept), and how the job ended.  Bounded by ranks x kinds.
        self.rank_failures: dict[tuple[int | None, FailureKind], RankFailure] = {}
        self.exits: dict[int, RankExited] = {}
        self.ended: JobEnded | None = None

    # -- folding ---------------------------------------------------------

    def apply(self, event: Event) -> None:
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _note(self, text: str) -> None:
        if len(self.notes) < _MAX_NOTES and text not in self.notes:
            self.notes.append(text)

    def _proc(self, proc: ProcKey, file: str | None = None) -> NcclProcess:
        info = self.procs.get(proc)
        if info is None:
            info = self.procs[proc] = NcclProcess(proc)
        if file:
            info.files.add(file)
        return info

    def _on_version(self, event: NcclVersion) -> None:
        self._proc(event.proc, event.cite.file).nccl_version = event.version

    def _on_init(self, event: CommInit) -> None:
        info = self._proc(event.proc, event.cite.file)
        if event.bus_id:
            info.bus_id = event.bus_id
        slot = (event.proc, event.comm_ptr)
        if event.phase == "complete" and slot in self._live:
            return
        key, label = self._comm_key(event)
        comm = self.comms.get(key)
        if comm is None:
            comm = self.comms[key] = Communicator(key=key, source="nccl_log", nranks=event.nranks, label=label)
        comm.cites.append(event.cite)
        comm.cited.add(event.cite)
        seq = comm.ranks.get(event.rank)
        if seq is not None and seq.proc != event.proc:
            self._note(
                f"communicator {label}: rank {event.rank} appears in two processes "
                f"({seq.proc.host}:{seq.proc.pid} and {event.proc.host}:{event.proc.pid}); "
                "are logs of several runs mixed? keeping the later one"
            )
        seq = comm.ranks[event.rank] = RankSeq(
            comm_rank=event.rank, proc=event.proc, file=event.cite.file, comm_ptr=event.comm_ptr
        )
        self._live[slot] = seq
        self._comm_of[slot] = key

    def _comm_key(self, event: CommInit) -> tuple[str, str]:
        if event.comm_id is not None:
            return f"nccl:{event.comm_id}", f"commId {event.comm_id}"
        if event.parent_ptr is not None:
            parent = self._comm_of.get((event.proc, event.parent_ptr), f"?{event.parent_ptr}")
            key = f"{parent}/split{event.split_count}:color{event.color}"
            return key, f"split of {parent.removeprefix('nccl:')} (color {event.color})"
        # No commId and no parent (old versions): the n-th communicator a
        # process creates is the n-th of every member, since creation is collective.
        ordinal = self._init_count.get(event.proc, 0)
        self._init_count[event.proc] = ordinal + 1
        return f"nccl:init{ordinal}:n{event.nranks}", f"communicator #{ordinal} ({event.nranks} ranks)"

    def _on_topology(self, event: CommTopology) -> None:
        key = self._comm_of.get((event.proc, event.comm_ptr))
        if key is not None:
            self.comms[key].local_ranks[(event.proc.host, event.local_rank)] = event.rank

    def _on_ops(self, event: OpBatch) -> None:
        seq = self._live.get((event.proc, event.comm_ptr))
        if seq is None:
            slot = (event.proc, event.comm_ptr)
            self._unknown_ops[slot] = self._unknown_ops.get(slot, 0) + len(event.sigs) + len(event.p2p)
            self._unknown_files.setdefault(slot, event.file)
            return
        for sig in event.p2p:
            logs = seq.sent if sig.op == "Send" else seq.received
            log = logs.get(sig.root)  # type: ignore[arg-type]
            if log is None:
                log = logs[sig.root] = PeerLog()  # type: ignore[index]
            log.count += 1
            log.sigs.append(sig)
        seq.coll.extend(event.sigs)
        seq.trim(self.window)

    def _on_end(self, event: CommEnd) -> None:
        seq = self._live.get((event.proc, event.comm_ptr))
        if seq is None:
            return
        if event.kind == "abort" or seq.end is None:
            seq.end, seq.end_cite = event.kind, event.cite
        if event.phase == "complete":
            # The address may be reused by a later communicator of this process.
            del self._live[(event.proc, event.comm_ptr)]

    def _on_fr_dump(self, dump: FrDump) -> None:
        if dump.rank is None:
            self._note(f"{dump.cite.file}: Flight Recorder dump without a rank (file name has no rank suffix); skipped")
            return
        self.fr_dumps[dump.cite.file] = dump
        by_pg: dict[str, list[FrEntry]] = {}
        for entry in dump.entries:
            by_pg.setdefault(entry.pg_id, []).append(entry)
        for pg_id, entries in by_pg.items():
            pg = dump.process_groups.get(pg_id)
            members = pg.ranks if pg and pg.ranks else []
            comm_rank = members.index(dump.rank) if dump.rank in members else dump.rank
            key = f"fr:{pg_id}"
            label = group_label(pg_id, pg.desc if pg else None)
            comm = self.comms.get(key)
            if comm is None:
                # gloo dumps leave the member list empty: the default group is every rank of the job
                nranks = len(members) if members else (self.world_size() or 0) if pg_id == "0" else 0
                comm = self.comms[key] = Communicator(
                    key=key, source="flight_recorder", nranks=nranks, label=label, members=list(members)
                )
            if comm_rank in comm.ranks and comm.ranks[comm_rank].file != dump.cite.file:
                self._note(f"{label}: two Flight Recorder dumps for rank {dump.rank}; keeping {dump.cite.file}")
            if dump.cite not in comm.cited:  # the live watchdog re-reads the same file
                comm.cited.add(dump.cite)
                comm.cites.append(dump.cite)
            seq = RankSeq(comm_rank=comm_rank, proc=None, file=dump.cite.file, global_rank=dump.rank, settled=True)
            seq.unrecorded = _unrecorded(pg, entries)
            _fold_fr_entries(seq, entries, _collectives_completed(pg, entries), by_op_id=seq.unrecorded > 0)
            comm.ranks[comm_rank] = seq
            comm.nranks = max(comm.nranks, comm_rank + 1)

    def _on_unusable(self, event: Unusable) -> None:
        self._note(f"{event.cite}: {event.reason}")

    def worker(self, pid: int) -> Worker:
        worker = self.workers.get(pid)
        if worker is None:
            worker = self.workers[pid] = Worker(pid=pid)
        return worker

    def _on_worker_seen(self, event: WorkerSeen) -> None:
        worker = self.worker(event.pid)
        worker.rank, worker.local_rank, worker.host = event.rank, event.local_rank, event.host
        worker.world_size, worker.restart, worker.seen_at = event.world_size, event.restart_count, event.at
        worker.node_rank, worker.seen = event.node_rank, event
        worker.samples.clear()  # a journal repeats the worker before each probe's samples

    def _on_worker_gone(self, event: WorkerGone) -> None:
        self.worker(event.pid).gone_at = event.at

    def _on_process_state(self, event: ProcessState) -> None:
        self.worker(event.pid).samples.append(event)

    def _on_heartbeat(self, event: Heartbeat) -> None:
        self.worker(event.pid).step = event.step

    def _on_stall(self, event: Stall) -> None:
        self.stall = event
        spans = list(event.earlier_probes)
        if event.probe_began_at is not None:
            spans.append((event.probe_began_at, event.at))
        self._probed(event.host, spans)

    def _probed(self, host: str | None, spans: Iterable[tuple[float, float]]) -> None:
        kept = self.probes.get(host)
        for span in spans:
            if kept is None:
                kept = self.probes[host] = deque(maxlen=PROBES_KEPT)
            if span not in kept:
                kept.append(span)

    def probes_of(self, host: str | None) -> list[tuple[float, float]]:
        """The looks whose dump writes are ncclwatch's on ``host``'s ranks: that node's sidecar's (another node's, as
        its shared evidence says them), and those that name no host (this node's own, a journal's)."""
        spans = list(self.probes.get(None, ()))
        return spans + list(self.probes.get(host, ())) if host is not None else spans

    def _on_tail(self, event: SequenceTail) -> None:
        comm = self.comms.get(event.comm_key)
        if comm is None:
            comm = self.comms[event.comm_key] = Communicator(
                key=event.comm_key, source="nccl_log", nranks=event.nranks, label=event.label
            )
        if event.comm_rank in comm.ranks:
            return  # this node read the rank's own log: the full sequence wins
        comm.ranks[event.comm_rank] = RankSeq(
            comm_rank=event.comm_rank,
            proc=ProcKey(event.host, event.pid),
            file=f"{event.host}:{event.pid}{SHARED_TAIL}",
            global_rank=event.global_rank,
            coll=list(map(interned, event.sigs)),
            base=event.base,
            digest=None,
            sent=_peer_logs(event.sent),
            received=_peer_logs(event.received),
            settled=True,
        )

    def sequence_tails(self, length: int) -> list[SequenceTail]:
        """This node's NCCL-log sequences, their newest ``length`` collectives each: what other nodes need to align."""
        tails = []
        for comm in self.comms.values():
            if comm.source != "nccl_log":
                continue
            for seq in comm.ranks.values():
                if seq.proc is None or seq.file.endswith(SHARED_TAIL):  # another node's: it shares its own
                    continue
                sigs = seq.coll[-length:]
                tails.append(
                    SequenceTail(
                        comm_key=comm.key,
                        label=comm.label,
                        nranks=comm.nranks,
                        comm_rank=seq.comm_rank,
                        global_rank=seq.global_rank,
                        host=seq.proc.host,
                        pid=seq.proc.pid,
                        base=seq.total - len(sigs),
                        sigs=sigs,
                        sent=_peer_tails(seq.sent, length),
                        received=_peer_tails(seq.received, length),
                    )
                )
        return tails

    def fewest_issued(self) -> dict[str, int]:
        """NCCL communicator -> the fewest collectives one of its ranks issued, as far as this state knows."""
        return {
            comm.key: min(seq.total for seq in comm.ranks.values())
            for comm in self.comms.values()
            if comm.source == "nccl_log" and comm.ranks
        }

    def world_size(self) -> int | None:
        """The job's rank count as torchrun told the workers (WORLD_SIZE), when any worker was seen."""
        sizes = [w.world_size for w in self.workers.values() if w.world_size]
        return max(sizes) if sizes else None

    def current_round(self) -> int:
        """The round of the newest workers seen (0 before any): the c10d rendezvous's, else torchrun's restart
        count (``sources.workers``)."""
        return max((w.restart for w in self.workers.values() if w.rank is not None), default=0)

    def restarts_seen(self) -> int:
        """Rounds since the first this state saw: the restarts, counted alike on every node.  A c10d rendezvous's
        rounds need not start at 0 (an etcd store keeps a reused run id's), and a node rejoining counts one too."""
        rounds = [w.restart for w in self.workers.values() if w.rank is not None]
        return max(rounds) - min(rounds) if rounds else 0

    def current_workers(self) -> list[Worker]:
        """Workers of the current attempt: an elastic restart retires every older pid."""
        current = self.current_round()
        workers = (w for w in self.workers.values() if w.rank is not None and w.restart == current)
        return sorted(workers, key=lambda w: w.rank or 0)

    def keep_latest(self, samples: int) -> None:
        """Live use: GPU and RAS samples are only useful recent; keep the last few."""
        if len(self.gpus) > samples:
            del self.gpus[:-samples]
        if len(self.ras) > samples:
            del self.ras[:-samples]

    # -- merging and views -------------------------------------------------

    def finish(self) -> None:
        """Say what was seen but could not be used (call once input is complete)."""
        jobs = self.jobs()
        if len(jobs) > 1:
            described = "; ".join(f"job {i + 1}: " + ", ".join(sorted(keys))[:200] for i, keys in enumerate(jobs))
            self._note(
                f"logs of {len(jobs)} jobs found (no process shares a communicator across them): {described}. "
                "The verdict is the most severe; analyze each job's files separately for details"
            )
        for (proc, ptr), count in self._unknown_ops.items():
            self._note(
                f"{count} operations of {proc.host}:{proc.pid} on communicator {ptr} skipped: "
                "its Init line is missing (log truncated at the start?)"
            )
        self._unknown_ops.clear()

    def take_orphans(self) -> dict[tuple[ProcKey, str], tuple[int, str]]:
        """(process, comm address) -> (operations, file) seen without an Init line; handed over once.

        ``ncclwatch analyze`` rescans those files for what can still be aligned
        (``parsing.nccl_excerpt``), so ``finish`` must not call them skipped.
        """
        orphans = {slot: (count, self._unknown_files.get(slot, "?")) for slot, count in self._unknown_ops.items()}
        self._unknown_ops.clear()
        return orphans

    def _on_partial(self, event: Event) -> None:
        if len(self.partial) < _MAX_PARTIAL:
            self.partial.append(event)

    def _on_rank_failure(self, event: RankFailure) -> None:
        self.rank_failures.setdefault((event.rank, event.kind), event)

    def _on_rank_exited(self, event: RankExited) -> None:
        known = self.exits.get(event.rank)
        if known is None or (event.root_cause and not known.root_cause):
            self.exits[event.rank] = event

    def merge(self, other: JobState) -> None:
        """Union with another node's state: each rank's sequence lives on one node."""
        for key, theirs in other.comms.items():
            mine = self.comms.get(key)
            if mine is None:
                self.comms[key] = theirs
                continue
            mine.nranks = max(mine.nranks, theirs.nranks)
            mine.local_ranks.update(theirs.local_ranks)
            mine.cites.extend(c for c in theirs.cites if c not in mine.cited)
            mine.cited |= theirs.cited
            for rank, seq in theirs.ranks.items():
                if rank not in mine.ranks or seq.total > mine.ranks[rank].total:
                    mine.ranks[rank] = seq
        for proc, info in other.procs.items():
            self.procs.setdefault(proc, info)
        self.warnings += other.warnings
        self.peer_closed += other.peer_closed
        self.timeouts += other.timeouts
        self.failures += other.failures
        self.partial += other.partial[: _MAX_PARTIAL - len(self.partial)]
        for failure in other.rank_failures.values():
            self._on_rank_failure(failure)
        for exited in other.exits.values():
            self._on_rank_exited(exited)
        self.ended = self.ended or other.ended
        self.ras += other.ras
        self.stacks.update(other.stacks)
        self.gpus += other.gpus
        for pid, worker in other.workers.items():
            self.workers.setdefault(pid, worker)
        if other.stall is not None and (self.stall is None or other.stall.at > self.stall.at):
            self.stall = other.stall
        for host, spans in other.probes.items():
            self._probed(host, spans)
        for note in other.notes:
            self._note(note)

    def jobs(self) -> list[set[str]]:
        """NCCL communicators grouped into jobs: two are one job when a process is in both."""
        parent: dict[str, str] = {}

        def root(key: str) -> str:
            while parent.setdefault(key, key) != key:
                key = parent[key]
            return key

        owner: dict[ProcKey, str] = {}
        for key, comm in self.comms.items():
            if comm.source != "nccl_log":
                continue
            root(key)
            for seq in comm.ranks.values():
                if seq.proc in owner:
                    parent[root(key)] = root(owner[seq.proc])
                elif seq.proc is not None:
                    owner[seq.proc] = key
        groups: dict[str, set[str]] = {}
        for key in parent:
            groups.setdefault(root(key), set()).add(key)
        return list(groups.values())

    def global_ranks(self) -> dict[ProcKey, int]:
        """A process's global rank is its rank in the largest communicator it belongs to."""
        best: dict[ProcKey, tuple[int, int]] = {}
        for comm in self.comms.values():
            for rank, seq in comm.ranks.items():
                if seq.proc is not None and (seq.proc not in best or comm.nranks > best[seq.proc][0]):
                    best[seq.proc] = (comm.nranks, rank)
        return {proc: rank for proc, (_, rank) in best.items()}


def _peer_tails(logs: dict[int, PeerLog], length: int) -> dict[int, PeerTail]:
    return {peer: PeerTail(count=log.count, sigs=log.sigs[-length:]) for peer, log in logs.items()}


def _peer_logs(tails: dict[int, PeerTail]) -> dict[int, PeerLog]:
    """Another node's point-to-point tails: counts are absolute (NCCL's log), so they align with this node's."""
    return {peer: PeerLog(count=t.count, base=t.count - len(t.sigs), sigs=list(t.sigs)) for peer, t in tails.items()}


# The side of an operation that every rank records alike, the one its signature compares (PyTorch's analyzer,
# flight_recorder/components/types.py ``Op.match``, skips the same sides). The analyzer compares a broadcast's output
# dtypes only: its output, the root's tensor as every rank receives it, is compared.
_OUTPUT_SIDE = frozenset({"Broadcast"})
# A scatter's root records the whole scatter list and the other ranks nothing on one side, and which side that is
# differs by backend: torch 2.13 gloo (a tensor-parallel set-up) records input [[2, 512, 256]] on the root, [] on the
# other rank and output [[512, 256]] on both; torch 2.11 NCCL (H200) records input [[256, 128]] on both, output two
# [256, 128] tensors on the root and [[0]] UNKNOWN_SCALAR on the other rank. A gather mirrors it. What every rank
# records alike is one rank's chunk: the smallest tensor that holds anything, on either side.
_ROOT_HOLDS_ALL = frozenset({"Scatter", "Gather"})
# all_to_all_single's splits may be uneven, so each rank sends and receives its own total (torch 2.13 gloo, input
# splits [1, 3] and [2, 2]: outputs of 3 and 5 elements) and Flight Recorder records no splits: no size compares.
_SIZED_PER_RANK = frozenset({"AlltoAll"})


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _chunk(entry: FrEntry) -> tuple[list[list[int]], list[str]]:
    """One rank's chunk of a scatter or gather: (sizes, dtypes) of one tensor; the inputs where none holds anything."""
    tensors = [
        (_numel(shape), shape, dtype)
        for sizes, dtypes in ((entry.input_sizes, entry.input_dtypes), (entry.output_sizes, entry.output_dtypes))
        for shape, dtype in zip(sizes, dtypes, strict=False)
    ]
    held = [t for t in tensors if t[0] > 0]
    if not held:
        return entry.input_sizes, entry.input_dtypes
    _, shape, dtype = min(held, key=lambda t: t[0])
    return [shape], [dtype]


def _fr_sig(entry: FrEntry) -> OpSig:
    if entry.op in _ROOT_HOLDS_ALL:
        sizes, dtypes = _chunk(entry)
    elif entry.op in _OUTPUT_SIDE:
        sizes, dtypes = entry.output_sizes, entry.output_dtypes
    else:
        sizes, dtypes = entry.input_sizes, entry.input_dtypes
    numel = None
    if entry.op not in _SIZED_PER_RANK:  # a loop, not sum() (its generator costs 2x per entry; the leader folds
        numel = 0  # 4,096 nodes' entries through here)
        for shape in sizes:
            numel += _numel(shape)
    dtype = dtypes[0] if dtypes else None
    fields = (entry.op, numel, dtype, None, entry.peer if entry.is_p2p else None)
    # Looked up as a plain tuple (equal to its OpSig, same hash): a seen signature costs no OpSig made (4,095 nodes'
    # dumps at 4,096 nodes hold a few distinct ones)
    return _SIGS.get(fields) or interned(OpSig(*fields))


def _collectives_completed(pg: FrProcessGroup | None, entries: list[FrEntry]) -> int | None:
    """The group's ``last_completed_collective`` where it is what its entries' states lack, else None.

    gloo leaves every entry ``scheduled`` and counts completions in the group's status.  NCCL records each
    entry's own state, and its status is not in collective numbers: on the H100 (torch 2.11, a pipeline with
    send/recv) a rank hung in all_reduce #1501 reported ``last_enqueued_collective`` 1501 and
    ``last_completed_collective`` 7504, its point-to-point count; read as collectives, the pending all_reduce
    was "completed" and the hang a pause.
    """
    if pg is None or pg.last_completed is None:
        return None
    if any(e.state is not OpState.scheduled for e in entries if not e.is_p2p):
        return None  # the entries say for themselves what completed
    if pg.last_enqueued is not None and pg.last_completed > pg.last_enqueued:
        return None  # more completed than enqueued: not collective numbers
    return pg.last_completed


def _unrecorded(pg: FrProcessGroup | None, entries: list[FrEntry]) -> int:
    """How many operations a gloo group issued that its dump does not hold.

    gloo's Flight Recorder (torch 2.13) records collectives only, never a send
    or recv, while the group's ``last_enqueued_collective`` counts every op
    (it is the newest entry's ``op_id``): a 2-stage pipeline's dump had 30
    all_reduces, collective_seq_id 30, and last_enqueued 270.  The gap is what
    the dump cannot show: a rank waiting in a ``recv`` looks idle in it.
    """
    if pg is None or pg.last_enqueued is None or not entries:
        return 0
    if not all(e.profiling_name.startswith("gloo:") for e in entries):
        return 0
    newest = max((e.collective_seq_id or 0 for e in entries), default=0)
    return max(pg.last_enqueued - newest, 0)


def _fold_fr_entries(
    seq: RankSeq, entries: list[FrEntry], last_completed: int | None, *, by_op_id: bool = False
) -> None:
    """Collectives by ``collective_seq_id``, p2p per peer; coalesced markers give p2p their state.

    Gloo's entries stay ``scheduled`` forever (torch 2.13) while the group's
    ``last_completed_collective`` advances: a collective at or below it completed.  Where the group also issued
    sends and recvs its dump does not hold (``by_op_id``), that status counts them too: it is in ``op_id``
    numbers, not ``collective_seq_id`` (a 2-stage gloo pipeline whose rank 1 waited in all_reduce #31, op id 278,
    said last completed 270: read as collective #270, #31 was "completed" on it alone and a missing send's hang
    read as all completed).
    """
    seq.digest = None  # the ring buffer forgot what came before its first entry
    states, grouped = _effective_states(entries)
    if last_completed is not None:
        number = (lambda e: e.op_id) if by_op_id else (lambda e: e.collective_seq_id)
        states = [
            OpState.completed if not e.is_p2p and (n := number(e)) and n <= last_completed else st
            for e, st in zip(entries, states, strict=True)
        ]
    completed = 0
    for i, (entry, state) in enumerate(zip(entries, states, strict=True)):
        if entry.op == "Coalesced":
            continue
        sig = _fr_sig(entry)
        op = Op(sig, entry.index, state, entry.time_created_ns, tuple(map(str, entry.frames)), _cut_short(entry, state))
        if entry.is_p2p:
            logs = seq.sent if entry.op == "Send" else seq.received
            # Counts start at the ring buffer's first entry, so they are
            # relative; detectors compare only the pending ones across ranks.
            log = logs.setdefault(entry.peer if entry.peer is not None else -1, PeerLog())
            log.states[log.count] = state
            if i not in grouped:
                log.alone[log.count] = op
            log.count += 1
            log.sigs.append(sig)
            continue
        if entry.collective_seq_id and not seq.coll:
            seq.base = entry.collective_seq_id - 1
        position = seq.total
        seq.coll.append(sig)
        seq.details[position] = op
        if state == OpState.completed:
            completed = position + 1
    seq.completed = completed if seq.coll else None


def pending_alone(entries: list[FrEntry]) -> list[FrEntry]:
    """Point-to-point ops issued alone (not in a coalesced group) that have not completed, oldest first."""
    states, grouped = _effective_states(entries)
    return [
        e
        for i, (e, state) in enumerate(zip(entries, states, strict=True))
        if e.is_p2p and e.op != "Coalesced" and i not in grouped and state is not OpState.completed
    ]


# A completion PyTorch's watchdog never retired though it was found this long after the op was enqueued: the watchdog
# retires one within its poll (100 ms); in every real dump here an unretired completion was found at most 0.7 s
# after its enqueue, and an abort's (a peer's node gone, ncclRemoteError) seconds after.
CUT_SHORT_NS = 2_000_000_000


def _cut_short(entry: FrEntry, state: OpState) -> bool:
    """Completed, per the dump, only because the communicator was aborted (``Op.cut_short``)."""
    done, created = entry.time_completed_ns, entry.time_created_ns
    return (
        state is OpState.completed
        and entry.retired is False
        and entry.duration_ms is None
        and done is not None
        and created is not None
        and done - created >= CUT_SHORT_NS
    )


def _effective_states(entries: list[FrEntry]) -> tuple[list[OpState], set[int]]:
    """p2p ops inside a coalesced group stay 'scheduled' forever; their marker completes.  Also which entries
    (list positions) are such members."""
    states = [e.state for e in entries]
    grouped = set()
    for i, entry in enumerate(entries):
        if entry.op != "Coalesced":
            continue
        j = i - 1
        while j >= 0 and entries[j].is_p2p and entries[j].p2p_seq_id == entry.p2p_seq_id:
            states[j] = entry.state
            grouped.add(j)
            j -= 1
    return states, grouped


_HANDLERS = {
    NcclVersion: JobState._on_version,
    CommInit: JobState._on_init,
    CommTopology: JobState._on_topology,
    OpBatch: JobState._on_ops,
    CommEnd: JobState._on_end,
    FrDump: JobState._on_fr_dump,
    Unusable: JobState._on_unusable,
    WorkerSeen: JobState._on_worker_seen,
    WorkerGone: JobState._on_worker_gone,
    ProcessState: JobState._on_process_state,
    Heartbeat: JobState._on_heartbeat,
    Stall: JobState._on_stall,
    SequenceTail: JobState._on_tail,
    NcclWarning: lambda s, e: s.warnings.append(e) if len(s.warnings) < _MAX_NOTES else None,
    LocalPeerClosed: lambda s, e: s.peer_closed.append(e),
    WatchdogTimeout: lambda s, e: s.timeouts.append(e),
    PgStatus: JobState._on_partial,
    CollectiveFingerprint: JobState._on_partial,
    NetworkError: JobState._on_partial,
    RankLog: JobState._on_partial,
    OrphanOps: JobState._on_partial,
    XidError: JobState._on_partial,
    WorkerFailure: lambda s, e: s.failures.append(e),
    RankFailure: JobState._on_rank_failure,
    RankExited: JobState._on_rank_exited,
    JobEnded: lambda s, e: setattr(s, "ended", e),
    RasReport: lambda s, e: s.ras.append(e),
    StackDump: lambda s, e: s.stacks.__setitem__(e.pid, e),
    GpuSnapshot: lambda s, e: s.gpus.append(e),
}
