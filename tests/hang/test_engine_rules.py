"""Rules the real-GPU suite asked for: a point-to-point deadlock named as such, a rank spinning in
communication never read as "busy", a collective the GPU never started read as a GPU hang."""

from __future__ import annotations

import nccl_lines as L
from conftest import NOW

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpState,
    ProcessState,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import build_report, headline
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

COMM = "0x5583d3a1f0e0"


def judged(*events: Event, logs: dict[int, str] | None = None):  # type: ignore[no-untyped-def]
    state = JobState()
    for rank, text in (logs or {}).items():
        for event in NcclLogParser(f"node1.{1000 + rank}").feed(text.encode(), final=True):
            state.apply(event)
    for event in events:
        state.apply(event)
    return classify(take_snapshot(state, observed_at=NOW))


class TestPointToPoint:
    def test_both_ranks_receiving_first_is_a_p2p_deadlock_naming_both(self) -> None:
        logs = {
            r: L.init(r, 2, COMM)
            + L.op(r, "Send", 64, COMM, root=1 - r)
            + L.op(r, "Recv", 64, COMM, root=1 - r)
            + L.op(r, "Recv", 1024, COMM, root=1 - r)
            for r in (0, 1)
        }
        decision = judged(logs=logs)
        assert decision.finding.verdict == Verdict.p2p_deadlock and decision.finding.culprits == (0, 1)
        assert "each wait for the other" in decision.finding.summary and "Send #2" in decision.finding.summary
        assert decision.page

    @staticmethod
    def stacks_in(*calls: str) -> list[Event]:
        """Two live ranks whose main threads sit in these torch.distributed calls, and the stall's clock."""
        events: list[Event] = [STALL]
        for rank, call in enumerate(calls):
            frames = [f"{call} (torch/distributed/distributed_c10d.py:2500)", "exchange (train.py:88)"]
            events += [
                WorkerSeen(pid=1000 + rank, rank=rank, host="node1", at=NOW - 60),
                StackDump(
                    pid=1000 + rank,
                    threads=[ThreadStack(name="MainThread", frames=frames)],
                    cite=Citation(file="py-spy"),
                ),
            ]
        return events

    def test_without_sequences_every_rank_blocked_in_recv_is_a_p2p_deadlock(self) -> None:
        """gloo: its Flight Recorder records no send/recv, so only the stacks can tell."""
        finding = judged(*self.stacks_in("recv", "recv")).finding
        assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1))
        assert "all wait in recv, called from exchange (train.py:88)" in finding.summary

    def test_without_sequences_a_rank_sending_or_in_a_collective_is_not_a_deadlock_by_stacks(self) -> None:
        for calls in (("recv", "send"), ("recv", "all_reduce"), ("all_reduce", "all_reduce")):
            assert judged(*self.stacks_in(*calls)).finding.verdict == Verdict.stuck_in_collective, calls

    def test_one_missing_send_stays_rank_behind(self) -> None:
        logs = {0: L.init(0, 2, COMM) + L.op(0, "Recv", 64, COMM, root=1), 1: L.init(1, 2, COMM)}
        finding = judged(logs=logs).finding
        assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,))


def p2p(index: int, op: str, rank: int, peer: int, seq: int, state: OpState) -> FrEntry:
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


def coll(index: int, seq: int, state: OpState, op: str = "AllReduce") -> FrEntry:
    return FrEntry(
        index=index,
        pg_id="0",
        collective_seq_id=seq,
        profiling_name=f"nccl:{op.lower()}",
        op=op,
        is_p2p=False,
        input_sizes=[[4096]],
        input_dtypes=["BFloat16"],
        state=state,
    )


def dumps_of(entries_of) -> list[FrDump]:  # type: ignore[no-untyped-def]
    group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
    return [
        FrDump(rank=r, version="2.10", process_groups=group, entries=entries_of(r), cite=Citation(file=f"fr/rank{r}"))
        for r in (0, 1)
    ]


class TestPointToPointInFlightRecorder:
    """Seen on 2 x H200 over NVLink (bench/results/2026-11-23-h200x2-s4, p2p_deadlock): both ranks' recv and send
    returned at once, the ranks blocked later in ``.item()``, and the step's loss all_reduce never started.  Flight
    Recorder's entries, as that run's report showed them, are all that says why."""

    @staticmethod
    def nvlink_deadlock(rank: int) -> list[FrEntry]:
        return [
            coll(0, 286, OpState.completed),
            p2p(1, "Recv", rank, 1 - rank, 1, OpState.started),
            p2p(2, "Send", rank, 1 - rank, 2, OpState.scheduled),
            coll(3, 287, OpState.scheduled),
            coll(4, 288, OpState.scheduled, "Broadcast"),
        ]

    def test_both_first_pending_ops_recv_from_each_other_is_a_p2p_deadlock(self) -> None:
        stacks = [
            StackDump(
                pid=1000 + r,
                threads=[ThreadStack(name="MainThread", frames=["main (gpu_job.py:214)"])],
                cite=Citation(file="py-spy"),
            )
            for r in (0, 1)
        ]
        seen = [WorkerSeen(pid=1000 + r, rank=r, host="node1", at=NOW - 60) for r in (0, 1)]
        decision = judged(*seen, *dumps_of(self.nvlink_deadlock), *stacks, STALL)
        finding = decision.finding
        assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1)) and decision.page
        line = headline(build_report(finding, take_snapshot(JobState(), observed_at=NOW), [], {}))
        assert line.startswith("ncclwatch: P2P DEADLOCK ranks 0, 1: Point-to-point deadlock") and ".." not in line
        # The ranks block in .item() (py-spy); where each posted its recv is Flight Recorder's recorded stack.
        assert (
            "each wait in a recv from the other (rank 0: called from inject (gpu_job.py:269); rank 1: called from "
            "inject (gpu_job.py:269))"
        ) in finding.summary
        assert {f.fact for f in finding.evidence} >= {
            "rank 0: first pending op with rank 1 is Recv #1 (Recv count=1024 Float from=1, started), called from "
            "inject (gpu_job.py:269); behind it: Send (scheduled)",
            "rank 1: first pending op with rank 0 is Recv #1 (Recv count=1024 Float from=0, started), called from "
            "inject (gpu_job.py:269); behind it: Send (scheduled)",
        }

    def test_a_recv_waiting_for_a_peer_that_sends_first_is_no_deadlock(self) -> None:
        def entries(rank: int) -> list[FrEntry]:
            first, second = ("Recv", "Send") if rank == 0 else ("Send", "Recv")
            return [
                coll(0, 286, OpState.completed),
                p2p(1, first, rank, 1 - rank, 1, OpState.started),
                p2p(2, second, rank, 1 - rank, 2, OpState.scheduled),
                coll(3, 287, OpState.scheduled),
            ]

        assert judged(*dumps_of(entries), STALL).finding.verdict != Verdict.p2p_deadlock

    def test_a_pending_batch_isend_irecv_group_is_no_deadlock(self) -> None:
        """Ops of one coalesced group run together: recv before send inside it orders nothing."""

        def entries(rank: int) -> list[FrEntry]:
            marker = FrEntry(
                index=3,
                pg_id="0",
                collective_seq_id=0,
                p2p_seq_id=1,
                profiling_name="nccl:coalesced",
                op="Coalesced",
                is_p2p=False,
                state=OpState.started,
            )
            return [
                coll(0, 286, OpState.completed),
                p2p(1, "Recv", rank, 1 - rank, 1, OpState.scheduled),
                p2p(2, "Send", rank, 1 - rank, 1, OpState.scheduled),
                marker,
            ]

        assert judged(*dumps_of(entries), STALL).finding.verdict != Verdict.p2p_deadlock


def workers(cpu_busy_rank: int) -> list[Event]:
    events: list[Event] = []
    for rank in range(3):
        events.append(WorkerSeen(pid=1000 + rank, rank=rank, host="node1", at=NOW - 60))
        for i, at in enumerate((NOW - 3, NOW - 2, NOW - 1)):
            cpu = 0.9 * i if rank == cpu_busy_rank else 0.0
            events.append(ProcessState(pid=1000 + rank, rank=rank, state="R", cpu_seconds=cpu, at=at))
    return events


STALL = Stall(at=NOW, stalled_for_s=30, stall_timeout_s=5, progress_timeout_s=600)
BEHIND = {r: L.init(r, 3, COMM) + L.steps(r, COMM, 5 if r == 2 else 6) for r in range(3)}


def entry(index: int, pg: str, seq: int, state: OpState, op: str = "AllReduce") -> FrEntry:
    return FrEntry(
        index=index,
        pg_id=pg,
        collective_seq_id=seq,
        profiling_name=f"nccl:{op.lower()}",
        op=op,
        is_p2p=False,
        input_sizes=[[1024]],
        input_dtypes=["Float"],
        state=state,
    )


class TestBusy:
    def test_a_busy_culprit_outside_communication_is_held(self) -> None:
        decision = judged(*workers(cpu_busy_rank=2), STALL, logs=BEHIND)
        assert decision.finding.verdict == Verdict.rank_behind and not decision.page and "busy" in (decision.held or "")

    def test_work_done_before_the_silence_began_is_not_busy(self) -> None:
        """The samples reach 4 s back: a look 2 s into the silence saw a rank asleep in a syscall as busy with what
        it did before it slept (the H200: its page waited for a second look).  Only the silence's samples count."""
        events: list[Event] = []
        for rank in range(3):
            events.append(WorkerSeen(pid=1000 + rank, rank=rank, host="node1", at=NOW - 60))
            for at, cpu in ((NOW - 4, 0.0), (NOW - 3, 0.9), (NOW - 2, 1.8), (NOW - 1, 1.8), (NOW, 1.8)):
                cpu = cpu if rank == 2 else 0.0
                events.append(ProcessState(pid=1000 + rank, rank=rank, state="S", cpu_seconds=cpu, at=at))
        asleep = Stall(at=NOW, stalled_for_s=2, stall_timeout_s=5, progress_timeout_s=600)
        decision = judged(*events, asleep, logs=BEHIND)
        assert decision.finding.culprits == (2,) and decision.page and decision.held is None
        earlier = Stall(at=NOW, stalled_for_s=4, stall_timeout_s=5, progress_timeout_s=600)  # busy in this silence
        assert not judged(*events, earlier, logs=BEHIND).page

    def test_a_culprit_spinning_in_a_pending_operation_is_waiting_not_busy(self) -> None:
        """Seen on H100: ranks in a NCCL wait burn a full core; Flight Recorder says they wait."""
        pending = FrDump(
            rank=2,
            version="2.10",
            process_groups={"5": FrProcessGroup(pg_id="5", ranks=[0, 2])},
            entries=[entry(0, "5", 1, OpState.scheduled)],
            cite=Citation(file="fr/rank2"),
        )
        decision = judged(*workers(cpu_busy_rank=2), pending, STALL, logs=BEHIND)
        assert decision.finding.culprits == (2,) and decision.page and decision.held is None


class TestNeverStartedOnGpu:
    def test_scheduled_on_the_lead_and_started_on_its_peers_is_a_gpu_compute_hang(self) -> None:
        """Seen on H100 with two ranks sharing the GPU (NVML cannot tell them apart):
        a never-ending kernel on rank 0."""
        group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
        dumps = [
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=group,
                cite=Citation(file=f"fr/rank{rank}"),
                entries=[entry(0, "0", 1, OpState.completed), entry(1, "0", 2, state)],
            )
            for rank, state in ((0, OpState.scheduled), (1, OpState.started))
        ]
        finding = judged(*dumps).finding
        assert (finding.verdict, finding.culprits) == (Verdict.gpu_compute_hang, (0,))
        assert "never started" in finding.summary

    def test_started_everywhere_names_no_gpu_hang(self) -> None:
        group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
        dumps = [
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=group,
                cite=Citation(file=f"fr/rank{rank}"),
                entries=[entry(0, "0", 1, OpState.started)],
            )
            for rank in (0, 1)
        ]
        assert judged(*dumps).finding.verdict == Verdict.stuck_in_collective

    def test_completed_on_its_peers_is_a_record_behind_not_a_gpu_hang(self) -> None:
        """A collective completes on no rank alone: the peers' "completed" proves the lead ran it, and its
        "scheduled" lags (seen on gloo, where a CPU pause was paged as a GPU hang)."""
        group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
        dumps = [
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=group,
                cite=Citation(file=f"fr/rank{rank}"),
                entries=[entry(0, "0", 1, OpState.completed), entry(1, "0", 2, state)],
            )
            for rank, state in ((0, OpState.scheduled), (1, OpState.completed))
        ]
        assert judged(*dumps).finding.verdict != Verdict.gpu_compute_hang


def test_dumps_of_only_some_ranks_blame_no_absent_rank() -> None:
    """Replaying a real 4 x H200 skip (rank 3) with only ranks 0 and 1's dumps: the others are unseen, not guilty."""
    from pathlib import Path

    from ncclwatch.watchdog.analyze import analyze_paths

    capture = Path(__file__).parents[1] / "fixtures" / "captures" / "nccl-2.28.9-h200x4" / "skip" / "fr"
    report = analyze_paths([str(capture / "nccl_trace_rank_0"), str(capture / "nccl_trace_rank_1")])
    assert report.culprit_ranks == []
    assert any("rank 2, 3" in m for m in report.missing)
