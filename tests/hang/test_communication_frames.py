"""Communication is recognised whoever issues it: real py-spy dumps of a waiting rank, and the engine's verdict.

``tests/fixtures/stacks/<wait>.json`` is ``py-spy dump --json --nonblocking``
(what the live sidecar takes) of rank 0 of a 2-rank gloo job waiting in
``<wait>`` while rank 1 sleeps in its own code; ``<wait>.native.json`` is
``--native``.  Made by ``tests/data/jobs/capture_stacks.py`` (torch 2.13.0+cpu,
Python 3.11, py-spy 0.4.3); the job is ``tests/data/jobs/comm_waits_job.py``.
"""

from __future__ import annotations

import pytest
from conftest import FIXTURES, NOW
from harness import judged, state_of, verdict_of
from nccl_lines import init, op

from ncclwatch.watchdog.events import Citation, ProcessState, StackDump, Stall, ThreadStack, WorkerSeen
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.stacks import IN_COMMUNICATION, whereabouts
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy

STACKS = FIXTURES / "stacks"
STALL = Stall(at=NOW, stalled_for_s=12.0, stall_timeout_s=5.0, progress_timeout_s=1800.0)
SCHEDULE_WAIT = "_wait_batch_p2p (torch/distributed/pipelining/schedules.py:683)"
WAIT_TENSOR = "wait_tensor (torch/distributed/_functional_collectives.py:142)"
COMPILED_CALLER = "compiled.<locals>.summed (comm_waits_job.py:121)"


def captured(name: str, pid: int | None = None) -> StackDump:
    (dump,) = [e for e in parse_pyspy((STACKS / name).read_bytes(), name) if isinstance(e, StackDump)]
    return dump if pid is None else dump.model_copy(update={"pid": pid})


@pytest.mark.parametrize(
    ("name", "kind", "frame", "side", "mine"),
    [
        # Schedule1F1B's stage 0 waiting for stage 1 (the case 1): the schedule's batched wait
        ("schedule_1f1b.json", "p2p", SCHEDULE_WAIT, None, "schedule_1f1b (comm_waits_job.py:67)"),
        ("schedule_1f1b.native.json", "p2p", SCHEDULE_WAIT, "send", "schedule_1f1b (comm_waits_job.py:67)"),
        # a functional collective's first use, and DTensor's redistribute (Shard(0) -> Replicate(): an all_gather)
        ("functional.json", "collective", WAIT_TENSOR, None, "functional (comm_waits_job.py:101)"),
        ("dtensor.json", "collective", WAIT_TENSOR, None, "dtensor (comm_waits_job.py:114)"),
        # work.wait() in the user's code, and a compiled graph's collective: only --native frames say so
        (
            "irecv_wait.native.json",
            "p2p",
            "c10d::ProcessGroupGloo::RecvWork::wait (libtorch_cpu.so:0)",
            "recv",
            "irecv_wait (comm_waits_job.py:78)",
        ),
        (
            "batch_p2p_wait.native.json",
            "p2p",
            "c10d::ProcessGroupGloo::SendWork::wait (libtorch_cpu.so:0)",
            "send",
            "batch_p2p_wait (comm_waits_job.py:90)",
        ),
        ("compiled_aot_eager.native.json", "collective", "c10d::Work::wait (libtorch_cpu.so:0)", None, COMPILED_CALLER),
        ("compiled_inductor.native.json", "collective", "c10d::Work::wait (libtorch_cpu.so:0)", None, COMPILED_CALLER),
    ],
)
def test_a_rank_waiting_in_communication_is_inside_it(
    name: str, kind: str, frame: str, side: str | None, mine: str
) -> None:
    where = whereabouts(captured(name))
    assert where.kind in IN_COMMUNICATION
    assert (where.kind, where.frame, where.side, where.user_frame) == (kind, frame, side, mine)


@pytest.mark.parametrize(
    ("name", "innermost", "mine"),
    [
        # The wait is a C call below the user's own line: nothing tells it from the user's code sleeping there.
        ("irecv_wait.json", "irecv_wait (comm_waits_job.py:78)", "irecv_wait (comm_waits_job.py:78)"),
        ("batch_p2p_wait.json", "batch_p2p_wait (comm_waits_job.py:90)", "batch_p2p_wait (comm_waits_job.py:90)"),
        # The generated graph calls the dispatcher, which names no op; the user's line is not the generated code's.
        ("compiled_aot_eager.json", "OpOverload.redispatch (torch/_ops.py:882)", COMPILED_CALLER),
        ("compiled_inductor.json", "OpOverload.redispatch (torch/_ops.py:882)", COMPILED_CALLER),
    ],
)
def test_without_native_frames_some_waits_cannot_be_told_from_the_users_code(
    name: str, innermost: str, mine: str
) -> None:
    where = whereabouts(captured(name))
    assert (where.kind, where.frame, where.user_frame) == ("python", innermost, mine)


def sleeping(pid: int) -> StackDump:
    """A rank asleep in its own code (py-spy's spelling, as rank 1 of the same job showed it)."""
    frames = ["hold (comm_waits_job.py:52)", "schedule_1f1b (comm_waits_job.py:64)", "main (comm_waits_job.py:148)"]
    return StackDump(pid=pid, threads=[ThreadStack(name="MainThread", frames=frames)], cite=Citation(file="py-spy"))


class TestPipelineScheduleStalled:
    """gloo, 2 stages, no collective in the job: only the stacks say where the ranks are."""

    workers = [WorkerSeen(pid=1000 + r, rank=r, world_size=2, host="node1", at=NOW - 60) for r in (0, 1)]

    def test_a_stage_in_its_own_code_while_its_peer_waits_in_the_schedule_is_behind_and_paged(self) -> None:
        decision = judged(*self.workers, captured("schedule_1f1b.json", pid=1000), sleeping(1001), STALL)
        assert (decision.finding.verdict, decision.finding.culprits) == (Verdict.rank_behind, (1,))
        assert decision.page, decision.held  # before: "no rank is inside a collective (a pause)", held for 1800 s
        assert "_wait_batch_p2p (schedules.py:683)" in decision.finding.summary
        assert "hold (comm_waits_job.py:52)" in decision.finding.summary

    def test_the_busy_stage_is_held_to_the_progress_timeout(self) -> None:
        """A stage computing (an evaluation on one stage) keeps its peer waiting but is not hung yet."""
        computing = [
            ProcessState(pid=1001, rank=1, state="R", cpu_seconds=10 + 0.9 * t, at=NOW - 4 + t) for t in (0, 4)
        ]
        decision = judged(*self.workers, *computing, captured("schedule_1f1b.json", pid=1000), sleeping(1001), STALL)
        assert decision.finding.verdict == Verdict.rank_behind and not decision.page
        assert "busy" in (decision.held or "")

    def test_both_stages_in_their_own_code_is_still_a_pause(self) -> None:
        decision = judged(*self.workers, sleeping(1000), sleeping(1001), STALL)
        assert (decision.finding.verdict, decision.page) == (Verdict.progress_stalled, False)


class TestPipelineTimesDataParallelOnNccl:
    """2 x 2 on NCCL (H200, torch 2.11): ranks 1 and 2, one pipeline, both ``recv`` first while their data-parallel
    peers 0 and 3 wait in the all-reduce.  NCCL blocks 1 and 2 inside ``irecv`` (the pair's communicator is split
    from the parent, which waits for every rank): py-spy's innermost frame is ``irecv``, not ``recv``'s wait."""

    workers = [WorkerSeen(pid=1000 + r, rank=r, world_size=4, host=f"node{r // 2}", at=NOW - 60) for r in range(4)]

    @staticmethod
    def dump(pid: int, *frames: str) -> StackDump:
        thread = ThreadStack(name="MainThread", frames=list(frames))
        return StackDump(pid=pid, threads=[thread], cite=Citation(file="py-spy"))

    def test_both_receivers_are_a_p2p_deadlock_not_ranks_behind(self) -> None:
        recv = (
            "irecv (torch/distributed/distributed_c10d.py:2597)",
            "recv (torch/distributed/distributed_c10d.py:2651)",
        )
        recv_frames = (*recv, "Fault.at (shapes_job.py:139)", "main (shapes_job.py:330)")
        reduce_frames = ("all_reduce (torch/distributed/distributed_c10d.py:3007)", "main (shapes_job.py:212)")
        dumps = [self.dump(1000 + r, *(recv_frames if r in (1, 2) else reduce_frames)) for r in range(4)]
        # The sequences: 0 and 3 went on into the next all-reduce, which 1 and 2 never entered.
        logs = {
            f"node{r // 2}.{1000 + r}": init(r, 4, f"0x{r}00")
            + "".join(op(r, "AllReduce", 4096, f"0x{r}00") for _ in range(20 if r in (1, 2) else 21))
            for r in range(4)
        }
        assert (verdict_of(logs).verdict, verdict_of(logs).culprits) == (Verdict.rank_behind, (1, 2))
        decision = classify(take_snapshot(state_of(logs, extra=[*self.workers, *dumps, STALL]), observed_at=NOW))
        assert (decision.finding.verdict, decision.finding.culprits) == (Verdict.p2p_deadlock, (1, 2))
        assert "all wait in recv" in decision.finding.summary
