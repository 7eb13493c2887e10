"""A GPU's NVML numbers speak for a rank only when the rank has that GPU to itself.

Seen on one H200 shared by five benchmark jobs (bench/results/2026-11-27-h200-suite, the one-node ``pause``
scenario, 2 of 2 runs paged): both ranks slept in the job's evaluation pause, every collective had completed on both,
and the device, busy with the other jobs' spinning collectives, read as "multi-block kernel (NCCL spin)" for both.
The probe paged ``stuck_in_collective`` with no culprit 9-14 s into a healthy pause.
"""

from __future__ import annotations

from conftest import NOW

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
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
from ncclwatch.watchdog.hang.gpu_signatures import NCCL_SPIN, rank_signatures
from ncclwatch.watchdog.hang.report import gpu_of
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict

PIDS = {0: 2367, 1: 2368}
OTHER_JOB = 4711  # another job's rank on the same GPU
STALL = Stall(at=NOW, stalled_for_s=11.3, stall_timeout_s=5, progress_timeout_s=1800)
# What NVML read on the shared H200: some SMs busy, little DRAM traffic, the shape of NCCL's spin.
SPINNING = GpuGpm(sm_util_pct=18, dram_bw_util_pct=1)


def completed(rank: int) -> FrDump:
    entries = [
        FrEntry(
            index=i,
            pg_id="0",
            collective_seq_id=i + 1,
            profiling_name="nccl:all_reduce",
            op="AllReduce",
            is_p2p=False,
            input_sizes=[[4096]],
            input_dtypes=["BFloat16"],
            state=OpState.completed,
        )
        for i in range(286)
    ]
    group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
    return FrDump(rank=rank, version="2.10", process_groups=group, entries=entries, cite=Citation(file=f"fr/{rank}"))


def paused_job(*processes: int) -> JobState:
    """Both ranks asleep in the job's pause, every collective completed, one GPU running ``processes``."""
    events: list[Event] = [STALL]
    for rank, pid in PIDS.items():
        frames = ["inject (gpu_job.py:290)", "main (gpu_job.py:340)"]
        events += [
            WorkerSeen(pid=pid, rank=rank, host="vm", at=NOW - 60),
            StackDump(pid=pid, threads=[ThreadStack(name="MainThread", frames=frames)], cite=Citation(file="py-spy")),
            completed(rank),
        ]
    gpu = GpuSample(index=0, util_gpu_pct=100, gpm=SPINNING, processes=[GpuProcess(pid=p) for p in processes])
    events.append(GpuSnapshot(time=NOW, gpus=[gpu], cite=Citation(file="nvml")))
    state = JobState()
    for event in events:
        state.apply(event)
    return state


def test_a_pause_on_a_gpu_shared_with_another_job_is_not_paged() -> None:
    decision = classify(take_snapshot(paused_job(*PIDS.values(), OTHER_JOB), observed_at=NOW))
    assert decision.finding.verdict == Verdict.progress_stalled
    assert not decision.page and "pause" in (decision.held or "")


def test_a_shared_gpu_gives_no_rank_a_signature() -> None:
    for processes in ((*PIDS.values(), OTHER_JOB), (PIDS[0], PIDS[1]), (PIDS[0], OTHER_JOB)):
        assert rank_signatures(take_snapshot(paused_job(*processes), observed_at=NOW)) == {}, processes


def test_a_gpu_of_one_rank_keeps_its_signature() -> None:
    signatures = rank_signatures(take_snapshot(paused_job(PIDS[1]), observed_at=NOW))
    assert {rank: sig for rank, (sig, _) in signatures.items()} == {1: NCCL_SPIN}


def test_the_rank_table_says_the_gpu_is_shared() -> None:
    shared = take_snapshot(paused_job(*PIDS.values(), OTHER_JOB), observed_at=NOW)
    assert gpu_of(shared, PIDS[0]) == "GPU 0: multi-block kernel (NCCL spin) (util 100%, SM 18%, shared by 3 processes)"
    alone = take_snapshot(paused_job(PIDS[1]), observed_at=NOW)
    assert gpu_of(alone, PIDS[1]) == "GPU 0: multi-block kernel (NCCL spin) (util 100%, SM 18%)"
