"""Typed events: what every source turns its raw input into.

Data flows one way: ``parsing/`` (pure, raw text or bytes -> these events) ->
``state`` (folds events into per-rank, per-communicator sequences) ->
``detectors`` (pure, state -> verdict) -> sinks.  Nothing in this module
imports anything else from the project.

Events are pydantic models, frozen, with two exceptions.  The per-operation
record ``Op`` is a ``NamedTuple``: a real NCCL log is almost all operation
lines and ingestion must sustain >= 500k lines/s on one core; a validated
pydantic object per line costs more than the whole per-line budget, so
operations travel in ``OpBatch`` events built with ``model_construct`` (the
regex in the parser has already validated every field).  A Flight Recorder
entry's frames are ``FrFrame``, a validated slotted dataclass (see there).

Beside the events, the few products of the parsers and probes that the
engines (``hang``, ``slowness``) read and that must therefore live below
them: NCCL's transport choices (``RankTransport``, frozen dataclasses: they
are never folded into the state, the performance look compares them), the
vocabulary of NCCL's RAS reports, what an InfiniBand port's sysfs text
says, and how a process group is named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Citation(Event):
    """Where a fact came from, precise enough for a human to open it."""

    file: str
    line: int | None = None  # 1-based line in a text file
    entry: str | None = None  # e.g. "entries[127]" in a dump
    text: str | None = None  # the line or a short excerpt

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
        if self.entry is not None:
            where += f" {self.entry}"
        return where


class ProcKey(NamedTuple):
    """A process as NCCL names it in every line prefix: ``host:pid:tid``."""

    host: str
    pid: int


# --------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------

P2P_OPS = frozenset({"Send", "Recv"})

# NCCL prints its enums as numbers (nccl.h: ncclDataType_t, ncclRedOp_t); reports show names.
# Reduce ops at or past ncclNumOps are user-made (ncclRedOpCreatePreMulSum) and keep their number.
NCCL_DTYPES = {
    "0": "int8",
    "1": "uint8",
    "2": "int32",
    "3": "uint32",
    "4": "int64",
    "5": "uint64",
    "6": "float16",
    "7": "float32",
    "8": "float64",
    "9": "bfloat16",
    "10": "float8_e4m3",
    "11": "float8_e5m2",
}
NCCL_REDOPS = {"0": "sum", "1": "prod", "2": "max", "3": "min", "4": "avg"}


class OpSig(NamedTuple):
    """What must be equal across ranks for one collective to match.

    ``op`` is NCCL's spelling (``AllReduce``, ``Send``...).  ``count`` is the
    per-rank element count NCCL prints; for Flight Recorder, the numel of the
    side every rank records alike (``hang/state.py``'s ``_fr_sig``: the
    inputs, the output of Broadcast, one rank's chunk of Scatter and Gather,
    and no count for AlltoAll, whose splits may be uneven); ``dtype``
    and ``redop`` are NCCL's enum numbers as text, or the PyTorch dtype name.
    ``root`` is the root for rooted collectives and the peer for Send/Recv.  ``None`` means "this source does not say".
    """

    op: str
    count: int | None
    dtype: str | None
    redop: str | None
    root: int | None

    def describe(self) -> str:
        parts = [self.op]
        if self.count is not None:
            parts.append(f"count={self.count}")
        if self.dtype is not None:
            parts.append(NCCL_DTYPES.get(self.dtype, self.dtype))
        if self.redop is not None and self.op in ("AllReduce", "Reduce", "ReduceScatter"):
            parts.append(NCCL_REDOPS.get(self.redop, f"op={self.redop}"))
        if self.root is not None and self.op in ("Broadcast", "Reduce", "Gather", "Scatter"):
            parts.append(f"root={self.root}")
        if self.root is not None and self.op in P2P_OPS:
            parts.append(("to" if self.op == "Send" else "from") + f"={self.root}")
        return " ".join(parts)


class OpState(StrEnum):
    """Progress of one operation as far as a source can tell."""

    enqueued = "enqueued"  # NCCL log: the host enqueued it; nothing more is known
    scheduled = "scheduled"  # Flight Recorder: enqueued, kernel not seen starting
    started = "started"
    completed = "completed"


class Op(NamedTuple):
    sig: OpSig
    line: int  # 1-based line in the source file, or the dump entry index
    state: OpState = OpState.enqueued
    time_ns: int | None = None
    frames: tuple[str, ...] = ()  # "func (file:line)", innermost first
    # Flight Recorder: "completed" seconds after it was enqueued, and never retired by PyTorch's watchdog (which
    # retires a completion within its poll): completed by an abort of the communicator, not by the data arriving.
    cut_short: bool = False


# --------------------------------------------------------------------------
# NCCL debug file
# --------------------------------------------------------------------------


class NcclVersion(Event):
    proc: ProcKey
    version: str
    cite: Citation


class CommInit(Event):
    """``ncclCommInitRank*`` / ``ncclCommSplit`` lines, START or COMPLETE.

    ``comm_id`` is NCCL's commId hash (2.23+ and many older versions); split
    communicators print ``parent``/``color``/``key`` and no commId instead.
    """

    proc: ProcKey
    comm_ptr: str
    rank: int
    nranks: int
    cuda_dev: int | None = None
    bus_id: str | None = None
    comm_id: str | None = None
    parent_ptr: str | None = None
    split_count: int | None = None
    color: int | None = None
    key: int | None = None
    phase: Literal["start", "complete"]
    cite: Citation


class CommTopology(Event):
    """``comm <ptr> rank r nRanks n nNodes k localRanks l localRank j ...``."""

    proc: ProcKey
    comm_ptr: str
    rank: int
    nranks: int
    nnodes: int
    local_ranks: int
    local_rank: int
    cite: Citation


class CommEnd(Event):
    """``comm <ptr> rank r nranks n ... - Destroy COMPLETE`` / ``Abort START|COMPLETE``."""

    proc: ProcKey
    comm_ptr: str
    rank: int
    kind: Literal["destroy", "abort"]
    phase: Literal["start", "complete"]
    cite: Citation


class WarningCategory(StrEnum):
    network = "network"
    cuda = "cuda"
    system = "system"
    other = "other"


class TransportMismatch(BaseModel):
    """NCCL's transport found that a message does not fit the operation its peer posted: the two ranks' operations
    differ (a collective skipped or added, or another size).  From the WARN lines of NCCL's sources:

    - ``NET/Socket : [peer %s ]message truncated : receiving %d bytes instead of %d`` (2.4+; the peer from 2.10),
      printed by the receiving rank: the peer sends the first size, the receive posted here holds the second;
    - ``NET/IB : [req %d/%d tag %x peer %s ]collective mismatch error[,] local size %d remote[ size] %d`` (2.5-2.19),
      printed by the sending rank: it sends the first size, the peer posted the second.
    """

    model_config = ConfigDict(frozen=True)

    transport: Literal["socket", "ib"]
    peer: str | None = None  # "192.0.2.2<36764>", where the line names it
    sent_bytes: int  # the sending side's message
    posted_bytes: int  # the receive the other side posted
    reporter_sends: bool  # the rank that printed the line is the sender (IB) or the receiver (socket)


class NcclWarning(Event):
    proc: ProcKey
    category: WarningCategory
    message: str
    peer: str | None = None  # "10.0.0.2<36012>" when the line names one
    mismatch: TransportMismatch | None = None  # NCCL's transport caught two ranks' operations differing
    cite: Citation


class LocalPeerClosed(Event):
    """NCCL's proxy service saw a local peer's connection close.

    ``[Service thread] Connection closed by localRank 1``: on a rank that did
    not destroy its communicator this is how its death shows in the others'
    logs.
    """

    proc: ProcKey
    local_rank: int
    cite: Citation


class OpBatch(Event):
    """Operations one process enqueued on one communicator, in order.

    Collectives and point-to-point come apart: ranks align collectives by
    position and match p2p pairwise, so their relative order is not needed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    proc: ProcKey
    comm_ptr: str
    file: str
    sigs: list[OpSig]  # collectives
    p2p: list[OpSig]  # Send and Recv; the peer is in ``root``


# --------------------------------------------------------------------------
# PyTorch Flight Recorder
# --------------------------------------------------------------------------


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class FrFrame:
    """One frame of an entry's recorded stack: a slotted dataclass, validated as a model is, without a model's
    ``__dict__`` and set of the fields given (64 bytes a frame instead of 335, 14 % less time to validate).  The leader
    at 4,096 nodes decodes 390,000 of them, and at that size holding its objects is most of decoding's time."""

    name: str
    filename: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})"


class FrEntry(Event):
    """One Flight Recorder entry, normalised across dump versions 1.4-2.10."""

    index: int  # position in the dump's entries list
    record_id: int | None = None
    pg_id: str
    collective_seq_id: int | None = None
    p2p_seq_id: int | None = None
    op_id: int | None = None  # the group's count of every op it issued, p2p included (gloo's status counts these)
    profiling_name: str  # as dumped, e.g. "nccl:send 0->1"
    op: str  # NCCL spelling: "AllReduce", "Send", "Coalesced", ...
    is_p2p: bool
    peer: int | None = None  # group rank of the peer, for p2p
    input_sizes: list[list[int]] = Field(default_factory=list)
    output_sizes: list[list[int]] = Field(default_factory=list)
    input_dtypes: list[str] = Field(default_factory=list)
    output_dtypes: list[str] = Field(default_factory=list)
    state: OpState
    time_created_ns: int | None = None
    time_started_ns: int | None = None
    time_completed_ns: int | None = None
    # GPU time between the kernel's start and end events (TORCH_NCCL_ENABLE_TIMING=1, completed entries);
    # the discovered times above are when the watchdog thread noticed, up to its poll period late.
    duration_ms: float | None = None
    timeout_ms: int | None = None
    frames: list[FrFrame] = Field(default_factory=list)
    retired: bool | None = None  # PyTorch's watchdog saw it complete and let it go; None: the dump does not say


class FrProcessGroup(Event):
    pg_id: str
    desc: str | None = None
    # global ranks, group order; in JSON a long list travels as runs, "0-1023,2048-3071" (every dump of a
    # 1,024-node job names the default group's 8,192 members)
    ranks: list[int] = Field(default_factory=list)
    last_enqueued: int | None = None
    last_started: int | None = None
    last_completed: int | None = None

    @field_validator("ranks", mode="before")
    @classmethod
    def _expand_runs(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        ranks: list[int] = []
        for run in filter(None, value.split(",")):
            span, _, step = run.partition(":")
            first, _, last = span.partition("-")
            ranks.extend(range(int(first), int(last or first) + 1, int(step or 1)))
        return ranks

    @field_serializer("ranks", when_used="json")
    def _as_runs(self, ranks: list[int]) -> list[int] | str:
        """Arithmetic runs: "0-8191" (the default group), "3-8187:8" (a data-parallel group of every 8th rank)."""
        if len(ranks) < 16:
            return ranks
        runs: list[str] = []
        i = 0
        while i < len(ranks):
            step = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
            j = i + 1
            while j < len(ranks) and ranks[j] - ranks[j - 1] == step and step > 0:
                j += 1
            if j - i < 3:  # two numbers are no run
                runs.append(str(ranks[i]))
                i += 1
                continue
            runs.append(f"{ranks[i]}-{ranks[j - 1]}" + (f":{step}" if step != 1 else ""))
            i = j
        text = ",".join(runs)
        return text if len(text) < 4 * len(ranks) else ranks


class FrDump(Event):
    rank: int | None  # global rank: from the file name suffix, else inferred
    version: str
    comm_lib_version: str | None = None
    process_groups: dict[str, FrProcessGroup]
    entries: list[FrEntry]
    cite: Citation


def group_label(pg: str, desc: str | None) -> str:
    """A Flight Recorder process group as communicators, reports and metrics name it: "process group 0 (default_pg)"."""
    return f"process group {pg}" + (f" ({desc})" if desc else "")


# --------------------------------------------------------------------------
# NCCL RAS
# --------------------------------------------------------------------------


# RasRank.status words of ours, beside NCCL's (NOCOMM, INIT, RUNNING, FINALIZE, ABORT, "ERROR: ..."):
# MISSING did not answer RAS, DEAD is a process RAS gave up on.
RAS_MISSING, RAS_DEAD = "MISSING", "DEAD"
# NCCL's sentences in RasCommunicator.messages (client_support.cc) that say how its ranks differ: the parser reads
# them, and the hang engine counts the ranks of each group, which NCCL does not name (hang/ras.py).
RAS_DIFFERENT_OPS = re.compile(r"^Communicator ranks have different (\w+) operation counts$")
RAS_DIFFERENT_STATUS = re.compile(r"^Communicator ranks have different status$")
RAS_GROUP_OPS = re.compile(r"^(\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)$")
RAS_GROUP_STATUS = re.compile(r"^(\d+) ranks have status (\w+)$")


class RasRank(Event):
    rank: int
    host: str | None = None
    pid: int | None = None
    cuda_dev: int | None = None
    status: str | None = None
    collective_counts: dict[str, int] = Field(default_factory=dict)


class RasCommunicator(Event):
    comm_hash: str | None = None
    label: str | None = None  # "#0-0" in the text report
    nranks: int | None = None
    status: str  # "OK", "MISMATCH", "INCOMPLETE", ...
    ranks: list[RasRank] = Field(default_factory=list)
    messages: list[str] = Field(default_factory=list)  # the report's own sentences


class RasReport(Event):
    format: Literal["text", "json"]
    nccl_version: str | None = None
    communicators: list[RasCommunicator]
    cite: Citation


# --------------------------------------------------------------------------
# PyTorch and torchrun logs
# --------------------------------------------------------------------------


class WatchdogTimeout(Event):
    """PyTorch's ``Watchdog caught collective operation timeout`` line."""

    rank: int
    seq: int
    op: str  # PyTorch's OpType spelling, e.g. "ALLGATHER"
    numel_in: int | None = None
    numel_out: int | None = None
    timeout_ms: int | None = None
    ran_ms: int | None = None
    pg: str | None = None  # from a "[PG ID n PG GUID g(name) Rank r]" prefix, when the line has one
    pg_desc: str | None = None  # the prefix's name: "default_pg", "tp"
    cite: Citation


class WorkerFailure(Event):
    """One entry of torchrun's ``ChildFailedError`` summary."""

    rank: int
    local_rank: int | None = None
    exitcode: int
    pid: int | None = None
    host: str | None = None
    root_cause: bool
    cite: Citation


class JobOutcome(StrEnum):
    """How the job (torchrun) ended, as the wrapper saw it."""

    clean = "clean"  # exit status 0
    failed = "failed"  # a non-zero status nobody asked for: a rank died, torchrun gave up
    stopped = "stopped"  # the user stopped it (SIGINT, SIGTERM, ... to the wrapper, passed on): no incident
    ended = "ended"  # ncclwatch's own response to a hang ended it (``--on-hang kill``, drain)


class JobEnded(Event):
    """torchrun exited: the last event of a job.  A failed job is judged for why it failed (``hang.failure``)."""

    outcome: JobOutcome
    returncode: int  # ``Popen.returncode``: -N when a signal N ended torchrun itself
    at: float


# --------------------------------------------------------------------------
# A job that died: what its stderr says about each rank, and how the job ended (issue 44)
# --------------------------------------------------------------------------


class FailureKind(StrEnum):
    """What a line of a dying job's stderr says a rank failed of; the value names the cause."""

    exception = "exception"  # a Python exception that is none of the below (``own_code``: raised in the user's code)
    out_of_memory = "out_of_memory"  # CUDA out of memory (torch.OutOfMemoryError, "CUDA error: out of memory")
    cuda_error = "cuda_error"  # "CUDA error: an illegal memory access ...", a device-side assert, ...
    collective_timeout = "collective_timeout"  # PyTorch's watchdog (WorkNCCL(SeqNum=...)) or gloo timed it out
    size_mismatch = "size_mismatch"  # the transport saw two ranks' operations differ (NCCL truncation, gloo enforce)
    peer_gone = "peer_gone"  # a peer closed the connection, or NCCL's remote error: this rank waited for another
    nccl_error = "nccl_error"  # another NCCL error: invalid usage, internal, system


class RankFailure(Event):
    """One line (or traceback) of a job's stderr that says why a rank failed.

    ``rank``: from a ``[rankN]:`` prefix or the line's own words; None where the line names none (C++'s
    ``terminate called ...`` is printed without torch's prefix).  ``frame``: the innermost frame of the traceback
    in the user's code (not torch's, not a library's), ``"check_batch (train.py:39)"``; ``own_code``: the exception
    was raised there (the innermost frame is the user's), so the user's code raised it, not a collective.
    """

    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    kind: FailureKind
    detail: str  # the message: "ValueError: batch 5 has 2 values, expected 4"
    error_type: str | None = None  # the exception's type as printed: "ValueError", "torch.OutOfMemoryError"
    seq: int | None = None  # a timed-out collective's sequence number (WorkNCCL(SeqNum=...))
    op: str | None = None  # its operation as PyTorch spells it (ALLREDUCE)
    frame: str | None = None
    own_code: bool = False
    at: float | None = None  # unix time, where the reader knows it (live: when the line came)
    cite: Citation


class RankExited(Event):
    """A rank's process ended with a failure: torchrun's ``ChildFailedError`` summary, or the live wrapper.

    ``signal``: the signal's name where it was killed (``SIGKILL``, ``SIGABRT``); ``root_cause``: torchrun's
    "first observed failure"; ``at``: unix time (torchrun's summary prints it to the second, local time).
    """

    rank: int
    local_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    exitcode: int
    signal: str | None = None
    root_cause: bool = False
    at: float | None = None
    cite: Citation | None = None


# --------------------------------------------------------------------------
# Stacks and GPUs
# --------------------------------------------------------------------------


class ThreadStack(Event):
    name: str | None = None
    os_tid: int | None = None
    active: bool | None = None
    frames: list[str] = Field(default_factory=list)  # innermost first


class StackDump(Event):
    pid: int
    threads: list[ThreadStack]
    cite: Citation


class WireModel(Event):
    """Read from a file another program wrote: unknown keys are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class GpuGpm(WireModel):
    sm_util_pct: float | None = None
    sm_occupancy_pct: float | None = None
    dram_bw_util_pct: float | None = None
    any_tensor_util_pct: float | None = None


class GpuProcess(WireModel):
    pid: int
    used_memory_bytes: int | None = None


class GpuSample(WireModel):
    index: int
    uuid: str | None = None
    bus_id: str | None = None
    util_gpu_pct: float | None = None
    util_mem_pct: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    gpm: GpuGpm | None = None
    processes: list[GpuProcess] = Field(default_factory=list)


class GpuSnapshot(Event):
    time: float
    gpus: list[GpuSample]
    cite: Citation


class Unusable(Event):
    """Input that could not be read; becomes a line in the report."""

    reason: str
    cite: Citation


# --------------------------------------------------------------------------
# The live job: workers, heartbeats, process state
# --------------------------------------------------------------------------


class WorkerSeen(Event):
    """A torchrun worker found by the sidecar, with what its environment says."""

    pid: int
    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    restart_count: int = 0  # the worker's round: the c10d rendezvous's where known (``sources.workers``)
    host: str
    at: float
    # torchrun's view of the job across nodes (the worker's environment); None on older launchers
    node_rank: int | None = None  # GROUP_RANK
    nnodes: int | None = None  # GROUP_WORLD_SIZE
    store: str | None = None  # MASTER_ADDR:MASTER_PORT, the rendezvous store every node reaches
    run_id: str | None = None  # TORCHELASTIC_RUN_ID ("none" under static rendezvous)


class WorkerGone(Event):
    """A worker's process ended (its exit code belongs to torchrun, not to us)."""

    pid: int
    rank: int
    at: float


class Heartbeat(Event):
    """``<run>/hb/<pid>.json`` as the injected hook wrote it (see launcher/heartbeat.py)."""

    pid: int
    rank: int
    step: int
    time: float  # when the worker took the step
    restart: int = 0
    beats: int = 0


class InspectorProgress(Event):
    """How far one rank got in one communicator, from NVIDIA's NCCL Inspector plugin (``sources/inspector.py``).

    Sequence numbers are the highest *completed* ones the plugin recorded (per communicator, collectives and p2p
    apart); it records nothing under its size floor and may drop completions between two dumps, so they are
    "at least this far", never a count.  ``rank`` is the rank in that communicator.
    """

    host: str
    pid: int
    comm_id: str  # NCCL's communicator hash, "0x..."
    comm_name: str
    rank: int
    nranks: int
    last_coll_seq: int | None
    last_p2p_seq: int | None
    bus_bw_gbs_median: float | None
    exec_us_median: float | None
    dumped_at: float  # wall clock of the plugin's latest dump that held this communicator
    cite: Citation


STOPPED_STATES = frozenset({"T", "t"})  # /proc state letters of a stopped process: SIGSTOP (T) and ptrace stop (t)
BLOCKED_STATES = frozenset({"S", "D"})  # /proc: asleep in the kernel (a read, a sleep, a futex) or in disk I/O


class ProcessState(Event):
    """One /proc sample of a worker: state letter and counters that show activity."""

    pid: int
    rank: int
    state: str  # R, S, D, T (stopped), t (traced), Z, X
    cpu_seconds: float
    io_bytes: int | None = None  # read + write bytes, when /proc/<pid>/io is readable
    at: float
    main_cpu_seconds: float | None = None  # the main (training) thread's alone; None where /proc/<pid>/task is not read


class PeerTail(Event):
    """One rank's sends to (or recvs from) one peer: how many, and the newest of them (``sigs`` ends at ``count``)."""

    count: int
    sigs: list[OpSig]


class SequenceTail(Event):
    """The newest collectives one rank issued on one NCCL communicator, as another node's sidecar shares them.

    ``base`` is the absolute position of ``sigs[0]`` in the communicator's sequence, so the tail aligns
    with full sequences read here; what came before it is unknown (no digest).  ``sent`` and ``received``
    (peer -> its point-to-point tail) travel too: without them a rank whose peer lives on another node
    looks as if that peer never posted its side (a pipeline deadlock was paged as ``rank_behind``).
    """

    comm_key: str
    label: str
    nranks: int
    comm_rank: int
    global_rank: int | None
    host: str
    pid: int
    base: int
    sigs: list[OpSig]
    sent: dict[int, PeerTail] = Field(default_factory=dict)
    received: dict[int, PeerTail] = Field(default_factory=dict)


class Stall(Event):
    """The live sidecar's clock at a probe: how long nothing has moved, and the bounds it judged by.

    Recorded in the run folder's journal with the probe's other inputs so
    that ``ncclwatch analyze`` reaches the same decision offline.
    """

    at: float
    stalled_for_s: float
    stall_timeout_s: float
    progress_timeout_s: float
    # When this probe began asking the ranks for dumps: the I/O of the dumps it asked for is ncclwatch's, not the
    # rank's (hang/state.py's Worker.rates leaves it out).
    probe_began_at: float | None = None
    # Where another node's sidecar shares its look: its host, and its earlier looks (began, ended) within its /proc
    # samples' reach.  Their dump writes are ncclwatch's too, and only that node knows when it asked: on 4 x H200 a
    # stage asleep in Python on the other node of a pipeline x DP job wrote the dump its node's peek asked for, and
    # the leader held the hang as "busy (a checkpoint?)" for the whole run.
    host: str | None = None
    earlier_probes: list[tuple[float, float]] = []


class SourceDown(Event):
    """A source cannot read what it watches; its detectors must not read this as healthy."""

    source: str
    reason: str


class SourceUp(Event):
    """A source that was down reads again."""

    source: str


# --------------------------------------------------------------------------
# Partial evidence: what a user holds after a hang (issue 16)
# --------------------------------------------------------------------------


class PgStatus(Event):
    """Where one rank's process group stood, as PyTorch's watchdog printed it.

    ``kind``: ``failure`` (``failure detected by watchdog at work sequence id:
    s PG status: last enqueued work: e, last completed work: c``), ``timeout``
    (the older ``Timeout at NCCL work: s, last enqueued NCCL work: e, ...``)
    or ``dump_signal`` (``Received a dump signal due to a collective timeout
    from rank k ... Last enqueued NCCL work: e, last completed NCCL work: c``:
    printed by ranks that did not time out themselves, so it places them).
    """

    rank: int
    pg: str | None = None  # the group's GUID (or id in older prefixes); None: the line names none
    pg_desc: str | None = None  # "default_pg", ...
    kind: Literal["failure", "timeout", "dump_signal"]
    seq: int | None = None  # the work that failed; None for dump_signal
    last_enqueued: int | None = None
    last_started: int | None = None
    last_completed: int | None = None
    signal_from: str | None = None  # "rank 7", "this local rank"
    cite: Citation


class CollectiveFingerprint(Event):
    """One side of a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` mismatch report.

    ``self_report``: the rank described itself ("Rank r is running ..."),
    which is authoritative; the other side ("but Rank i is running ...") is
    decoded from a gathered tensor and is garbage when the two fingerprints
    differ in size (seen on torch 2.13: ``SequenceNumber=0OpType=SCATTER``).
    """

    rank: int
    reported_by: int
    self_report: bool
    seq: int | None = None
    op: str
    shapes: str | None = None
    dtypes: str | None = None
    cite: Citation


class NetworkError(Event):
    """A network or peer failure line (NCCL WARN, or NCCL's error inside PyTorch's exception).

    ``kind``: ``ib_completion`` (``NET/IB : Got completion from peer ... with
    error|status``), ``connection_closed`` (``Connection closed by remote
    peer``, ``Connection reset by peer``), ``remote_error`` (``ncclRemoteError``,
    ``remote process exited or there was a network error``), ``system_error``
    (``ncclSystemError``), ``socket`` (other socket failures), ``size_mismatch`` (NCCL's transport caught two
    ranks' operations differing: ``mismatch``).
    """

    kind: Literal["ib_completion", "connection_closed", "remote_error", "system_error", "socket", "size_mismatch"]
    rank: int | None = None  # the reporting rank, when the line or its prefix says
    proc: ProcKey | None = None  # the reporting process, from an NCCL line prefix
    peer: str | None = None  # "10.0.0.2<45678>" or "node-3<12345>"
    device: str | None = None  # "mlx5_0"
    status: int | None = None  # ibv_wc_status number
    status_name: str | None = None  # "IBV_WC_RETRY_EXC_ERR"
    meaning: str | None = None
    mismatch: TransportMismatch | None = None  # kind size_mismatch: the sizes NCCL's transport compared
    cite: Citation

    @property
    def peer_host(self) -> str | None:
        return self.peer.split("<", 1)[0] if self.peer else None


class XidError(Event):
    """The GPU driver's Xid in the kernel log: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``

    ``bus_id`` as the driver prints it (``0000:3b:00``: domain, bus, device); ``gpu_bus_key`` compares it with
    NCCL's ``busId 3b000`` and NVML's ``00000000:3B:00.0``.  ``time``: as the log printed it (seconds since boot
    for dmesg and /dev/kmsg, a date for ``dmesg -T``, syslog and journalctl); ``host``: where the log names it.
    ``meaning`` and ``hardware`` come from the table of common Xids (``parsing.kernel_log.XID_TABLE``).
    """

    code: int
    bus_id: str
    pid: int | None = None
    process: str | None = None
    message: str
    time: str | None = None
    host: str | None = None
    meaning: str | None = None
    hardware: bool = False  # the Xid points at the GPU or its links, not the program
    cite: Citation


def gpu_bus_key(bus_id: str | None) -> str | None:
    """One spelling of a GPU's PCI address, ``dddd:bb:dd`` (domain, bus, device), from the driver's
    ``0000:3b:00``, NVML's ``00000000:3B:00.0`` or NCCL's ``busId 3b000`` (its int64 of the same hex digits)."""
    if not bus_id:
        return None
    text = bus_id.strip().lower().removeprefix("pci:")
    try:
        if ":" not in text:
            value = int(text, 16)
            return f"{value >> 20:04x}:{(value >> 12) & 0xFF:02x}:{(value >> 4) & 0xFF:02x}"
        parts = text.split(":")
        domain, bus, device = ([0, *parts] if len(parts) == 2 else parts)[-3:]
        return f"{int(str(domain), 16):04x}:{int(bus, 16):02x}:{int(device.split('.')[0], 16):02x}"
    except ValueError:
        return None


class RankLog(Event):
    """Lines of one rank were found in an input: its log is held (a combined file or one per rank)."""

    rank: int
    file: str
    how: str  # "[rankN]: prefix", "file name", ...
    lines: int | None = None


class OrphanOps(Event):
    """NCCL operation lines of a communicator whose Init line is not in the input.

    Without Init there is no rank and no communicator identity, so these are
    kept apart from the aligned sequences: per process and communicator
    address, the count and the last few operations with their ``opCount``
    (hex, 0 forever on single-node jobs from NCCL 2.27.3).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    proc: ProcKey
    comm_ptr: str
    file: str
    rank: int | None = None  # from a "[rankN]:" prefix or the file name
    nranks: int | None = None  # "[nranks=N]" on the line (2.19+)
    cuda_dev: int | None = (
        None  # the line prefix's "[cudaDev]": which GPU the process drove, a hint where ranks are unknown
    )
    count: int
    last: list[tuple[int, OpSig, int]]  # (opCount, signature, 1-based line), oldest first


# --------------------------------------------------------------------------
# NCCL's transport choices (parsing/transport.py reads them from its INIT lines)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class NetDevice:
    index: int  # NCCL's net device number: the <d> of "via NET/IB/<d>"
    name: str  # "mlx5_0" (IB, RoCE) or "eth0" (Socket)
    port: int | None = None
    link_layer: str | None = None  # "IB", "RoCE"
    address: str | None = None  # Socket: "192.0.2.2<0>"

    @property
    def label(self) -> str:
        """``mlx5_0/1`` (the sysfs port path) or ``eth0``."""
        return f"{self.name}/{self.port}" if self.port is not None else self.name


@dataclass(frozen=True)
class RankTransport:
    """What one process's NCCL chose for one communicator."""

    proc: ProcKey
    comm_ptr: str | None
    rank: int | None  # in the communicator
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    cuda_dev: int | None = None
    bus_id: str | None = None
    network: str | None = None  # "Using network <name>"
    ib_devices: tuple[NetDevice, ...] = ()
    ib_absent: bool = False  # "NET/IB : No device found."
    socket_devices: tuple[NetDevice, ...] = ()
    socket_threads: tuple[int, int] | None = None  # (threads, sockets per thread)
    ib_hca: str | None = None  # NCCL_IB_HCA as this process's NCCL read it (None: unset, or its line not seen)
    coll_channels: int | None = None
    nvls_channels: int | None = None
    p2p_channels: int | None = None
    connections: dict[str, int] = field(default_factory=dict)  # "P2P/CUMEM", "SHM", "NET/IB", "NET/Socket" -> count
    net_devices_used: tuple[int, ...] = ()  # the <d> of every "via NET/<name>/<d>"
    gdr: bool | None = None  # some NET connection used GPU Direct RDMA
    p2p_disabled: str | None = None  # the line that says so

    def links(self) -> tuple[str, ...]:
        """The NICs this rank's network connections go through (``mlx5_1/1``); IB first, then sockets."""
        devices = {d.index: d for d in (self.ib_devices if "NET/IB" in self.connections else self.socket_devices)}
        return tuple(devices[i].label for i in self.net_devices_used if i in devices)


# --------------------------------------------------------------------------
# InfiniBand ports: what the sysfs text of a reading says (probes/infiniband.py reads it)
# --------------------------------------------------------------------------

_RATE_RE = re.compile(r"([\d.]+) Gb/sec")


def rate_bytes_per_s(rate: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 5e10 bytes/s; anything else -> None."""
    match = _RATE_RE.match(rate or "")
    return float(match[1]) * 1e9 / 8 if match else None


def state_name(state: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``, ``"5: LinkUp"`` -> ``"LinkUp"``; None stays None."""
    return None if state is None else state.partition(":")[2].strip() or state
