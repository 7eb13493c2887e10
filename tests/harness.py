"""The hang engine's test harness: builders of its inputs and ``judged``, the one way a test runs the engine.

NCCL lines (``nccl_lines``) -> ``state_of`` / ``snapshot_of`` -> the job's finding (``verdict_of``, the sequence
and job-wide stages alone); any events (parsed lines, Flight Recorder dumps, stacks, workers, the stall) ->
``judged``, the whole classifier; literal Flight Recorder entries (``coll``, ``p2p``, ``dumps_of``), workers and
their stacks (``workers``, ``stacks_in``) and the stall's clock (``stall``) are built here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from conftest import NOW

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    GpuGpm,
    GpuProcess,
    GpuSample,
    GpuSnapshot,
    OpState,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.live_rules import Observed
from ncclwatch.watchdog.hang.report import Report, build_report
from ncclwatch.watchdog.hang.snapshot import Snapshot, take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser


def state_of(logs: Mapping[str, str], window: int = 2048, extra: Iterable[Event] = ()) -> JobState:
    """The engine's state after each log (file name -> NCCL lines), then ``extra`` events."""
    state = JobState(window=window)
    for name, text in logs.items():
        for event in NcclLogParser(name).feed(text.encode(), final=True):
            state.apply(event)
    for event in extra:
        state.apply(event)
    state.finish()
    return state


def snapshot_of(logs: Mapping[str, str], **kw) -> Snapshot:  # type: ignore[no-untyped-def]
    return take_snapshot(state_of(logs, **kw), observed_at=NOW)


def verdict_of(logs: Mapping[str, str], **kw) -> Finding:  # type: ignore[no-untyped-def]
    """The job's finding from NCCL lines alone: the sequence, partial and job-wide stages, no live rules."""
    return job_finding(snapshot_of(logs, **kw))


def judged_state(*events: Event, logs: Mapping[int, str] | Mapping[str, str] | None = None) -> JobState:
    """The state after NCCL lines (rank -> lines, read as ``node1.<1000 + rank>``, or file name -> lines) and
    ``events``, in that order."""
    state = JobState()
    for key, text in (logs or {}).items():
        name = f"node1.{1000 + key}" if isinstance(key, int) else key
        for event in NcclLogParser(name).feed(text.encode(), final=True):
            state.apply(event)
    for event in events:
        state.apply(event)
    return state


def snapshot_with(*events: Event, logs: Mapping[int, str] | Mapping[str, str] | None = None) -> Snapshot:
    """The snapshot, as of ``NOW``, of NCCL lines and events (``judged_state``)."""
    return take_snapshot(judged_state(*events, logs=logs), observed_at=NOW)


def observed(*events: Event, logs: Mapping[int, str] | Mapping[str, str] | None = None) -> Observed:
    """What the live rules read of NCCL lines and events (``judged_state``)."""
    return Observed.of(snapshot_with(*events, logs=logs))


def judged(*events: Event, logs: Mapping[int, str] | Mapping[str, str] | None = None) -> Decision:
    """The classifier's decision on NCCL lines and events (``judged_state``), as of ``NOW``."""
    return classify(take_snapshot(judged_state(*events, logs=logs), observed_at=NOW))


def judged_with_report(*events: Event, logs: Mapping[str, str] | None = None) -> tuple[Finding, Report]:
    """The classifier's finding and the report built from it."""
    snapshot = take_snapshot(judged_state(*events, logs=logs), observed_at=NOW)
    finding = classify(snapshot).finding
    return finding, build_report(finding, snapshot, inputs=[], cited={})


def stall(stalled_for_s: float = 30, stall_timeout_s: float = 5, progress_timeout_s: float = 600) -> Stall:
    """The stall's clock as of ``NOW``."""
    return Stall(
        at=NOW, stalled_for_s=stalled_for_s, stall_timeout_s=stall_timeout_s, progress_timeout_s=progress_timeout_s
    )


def workers(*ranks: int, host: str = "node1") -> list[Event]:
    """Each rank's worker, pid 1000 + rank, seen a minute ago."""
    return [WorkerSeen(pid=1000 + r, rank=r, host=host, at=NOW - 60) for r in ranks]


def stack(pid: int, *frames: str) -> StackDump:
    """py-spy's dump of one process: its main thread, innermost frame first."""
    return StackDump(
        pid=pid, threads=[ThreadStack(name="MainThread", frames=list(frames))], cite=Citation(file="py-spy")
    )


def stacks_in(*calls: str) -> list[Event]:
    """Live ranks (one per call) whose main threads sit in these torch.distributed calls, and the stall's clock."""
    events: list[Event] = [stall()]
    for rank, call in enumerate(calls):
        events += workers(rank)
        events.append(
            stack(1000 + rank, f"{call} (torch/distributed/distributed_c10d.py:2500)", "exchange (train.py:88)")
        )
    return events


def p2p(index: int, op: str, rank: int, peer: int, seq: int, state: OpState) -> FrEntry:
    """A Flight Recorder send or recv of 1024 floats, posted from the job's own line."""
    arrow = "<-" if op == "Recv" else "->"
    line = 269 if op == "Recv" else 270  # the job's dist.recv / dist.send, as Flight Recorder records the stack
    frames = [
        FrFrame(name=op.lower(), filename="/usr/lib/python3/torch/distributed/distributed_c10d.py", line=2597),
        FrFrame(name="inject", filename="/job/gpu_job.py", line=line),
    ]
    return FrEntry(
        index=index,
        pg_id="0",
        collective_seq_id=0,
        p2p_seq_id=seq,
        is_p2p=True,
        op=op,
        peer=peer,
        profiling_name=f"nccl:{op.lower()} {rank}{arrow}{peer}",
        input_sizes=[[1024]],
        input_dtypes=["Float"],
        state=state,
        frames=frames,
    )


def coll(
    index: int,
    seq: int,
    state: OpState,
    op: str = "AllReduce",
    pg: str = "0",
    size: int = 4096,
    dtype: str = "BFloat16",
) -> FrEntry:
    """A Flight Recorder collective."""
    return FrEntry(
        index=index,
        pg_id=pg,
        collective_seq_id=seq,
        profiling_name=f"nccl:{op.lower()}",
        op=op,
        is_p2p=False,
        input_sizes=[[size]],
        input_dtypes=[dtype],
        state=state,
    )


def dumps_of(entries_of: Callable[[int], list[FrEntry]], ranks: Iterable[int] = (0, 1)) -> list[FrDump]:
    """Each rank's dump of process group "0" over ``ranks``, its entries ``entries_of(rank)``."""
    ranks = list(ranks)
    group = {"0": FrProcessGroup(pg_id="0", ranks=ranks)}
    return [
        FrDump(rank=r, version="2.10", process_groups=group, entries=entries_of(r), cite=Citation(file=f"fr/rank{r}"))
        for r in ranks
    ]


# What NVML reads (H200, NCCL-FACTS.md): NCCL's spin keeps some SMs busy and moves no memory; a compute kernel
# fills the SMs; a one-block kernel (NCCL's point-to-point, a user kernel waiting on a flag) barely any.
NCCL_SPIN_GPM = GpuGpm(sm_util_pct=18, dram_bw_util_pct=1)
COMPUTE_GPM = GpuGpm(sm_util_pct=90, dram_bw_util_pct=30)
ONE_BLOCK_GPM = GpuGpm(sm_util_pct=1, dram_bw_util_pct=0)


def gpus(at: float = NOW, **gpm_of_pid: GpuGpm) -> GpuSnapshot:
    """One NVML sample at ``at``: a busy GPU per process (``p1000=NCCL_SPIN_GPM``), each running it alone."""
    samples = [
        GpuSample(index=i, util_gpu_pct=100, gpm=gpm, processes=[GpuProcess(pid=int(pid.lstrip("p")))])
        for i, (pid, gpm) in enumerate(gpm_of_pid.items())
    ]
    return GpuSnapshot(time=at, gpus=samples, cite=Citation(file="nvml"))
