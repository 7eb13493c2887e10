"""The live rules (``hang.live_rules.LIVE_RULES``): one class per rule, named after it, with a case where it fires
and one where it stays quiet (``test_rule_tables`` checks every rule has both); then the holds ``classify`` makes of
the refined finding (a busy culprit)."""

from __future__ import annotations

import nccl_lines as L
import pytest
from conftest import FIXTURES, NOW
from harness import (
    COMPUTE_GPM,
    NCCL_SPIN_GPM,
    ONE_BLOCK_GPM,
    coll,
    dumps_of,
    gpus,
    judged,
    observed,
    stack,
    stacks_in,
    stall,
    workers,
)

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrProcessGroup,
    OpState,
    ProcessState,
    Stall,
    WorkerGone,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.live_rules import (
    behind_peers_in_p2p,
    dead,
    gpu_compute_hang,
    lead_from_gpus,
    lead_from_stacks,
    p2p_deadlock_from_stacks,
    p2p_wait_from_stacks,
    ran_ahead,
    spinning,
    stopped,
    stream_held_before_nccl,
    stuck_from_stacks,
    unblame_absent,
)
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

COMM = "0x5583d3a1f0e0"


def busy_workers(cpu_busy_rank: int) -> list[Event]:
    """Three workers, ``cpu_busy_rank`` burning most of a core over the last seconds."""
    events: list[Event] = []
    for rank in range(3):
        events.append(WorkerSeen(pid=1000 + rank, rank=rank, host="node1", at=NOW - 60))
        for i, at in enumerate((NOW - 3, NOW - 2, NOW - 1)):
            cpu = 0.9 * i if rank == cpu_busy_rank else 0.0
            events.append(ProcessState(pid=1000 + rank, rank=rank, state="R", cpu_seconds=cpu, at=at))
    return events


STALL = Stall(at=NOW, stalled_for_s=30, stall_timeout_s=5, progress_timeout_s=600)
# Real bundles: gloo pipeline x DP with rank 0 stuck; 2 x H200 pipelines whose rank 1's GPU hangs before a send.
PP_DP_STUCK_R0 = FIXTURES / "bundles" / "gloo-2.13-cpu-pp-dp-stuck-r0"
PIPELINE_GPU_HANG = sorted((FIXTURES / "bundles" / "nccl-2.28.9-h200x2-pipeline-gpu-hang").glob("*.tar.gz"))
BEHIND = {r: L.init(r, 3, COMM) + L.steps(r, COMM, 5 if r == 2 else 6) for r in range(3)}


UNDECIDED = Finding(verdict=Verdict.inconclusive, summary="nothing aligned")
STUCK = Finding(verdict=Verdict.stuck_in_collective, summary="every rank waits in #2", comm_key="0", position=2)
IN_RECV = "recv (torch/distributed/distributed_c10d.py:2500)"
IN_ALL_REDUCE = "all_reduce (torch/distributed/distributed_c10d.py:2800)"
ASLEEP = "hold (job.py:52)"


class TestUnblameAbsent:
    absent = Finding(verdict=Verdict.stuck_in_collective, summary="rank 2 left no Flight Recorder dump.", culprits=(2,),
                     absent=(2,))  # fmt: skip

    def test_offline_a_dump_not_given_blames_nobody(self) -> None:
        found = unblame_absent(observed(), self.absent)
        assert found is not None and (found.culprits, found.absent) == ((), ())
        assert found.summary == "no dump of rank 2 was given."

    def test_quiet_live_where_the_watchdog_asked_the_rank(self) -> None:
        assert unblame_absent(observed(*workers(0, 1, 2), stall()), self.absent) is None


class TestStopped:
    def test_a_worker_in_state_t_is_process_stopped(self) -> None:
        state = ProcessState(pid=1001, rank=1, state="T", cpu_seconds=0.0, at=NOW)
        found = stopped(observed(*workers(0, 1), state), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_stopped, (1,))

    def test_quiet_while_every_worker_runs_or_sleeps(self) -> None:
        state = ProcessState(pid=1001, rank=1, state="S", cpu_seconds=0.0, at=NOW)
        assert stopped(observed(*workers(0, 1), state), UNDECIDED) is None


class TestDead:
    def test_a_rank_gone_while_its_peers_wait_is_process_dead(self) -> None:
        found = dead(observed(*workers(0, 1), WorkerGone(pid=1001, rank=1, at=NOW - 5)), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (1,))

    def test_quiet_when_every_rank_ended(self) -> None:
        gone = [WorkerGone(pid=1000 + r, rank=r, at=NOW - 5) for r in (0, 1)]
        assert dead(observed(*workers(0, 1), *gone), UNDECIDED) is None


class TestP2pDeadlockFromStacks:
    def test_without_sequences_every_rank_blocked_in_recv_is_a_p2p_deadlock(self) -> None:
        """gloo: its Flight Recorder records no send/recv, so only the stacks can tell."""
        finding = judged(*stacks_in("recv", "recv")).finding
        assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1))
        assert "all wait in recv, called from exchange (train.py:88)" in finding.summary

    def test_quiet_where_a_rank_sends_or_sits_in_a_collective(self) -> None:
        for calls in (("recv", "send"), ("recv", "all_reduce"), ("all_reduce", "all_reduce")):
            assert judged(*stacks_in(*calls)).finding.verdict == Verdict.stuck_in_collective, calls
            assert p2p_deadlock_from_stacks(observed(*stacks_in(*calls)), UNDECIDED) is None, calls


class TestBehindPeersInP2p:
    def test_a_rank_in_its_own_code_while_its_peer_waits_in_recv_is_behind(self) -> None:
        seen = observed(stall(), *workers(0, 1), stack(1000, IN_RECV), stack(1001, ASLEEP))
        found = behind_peers_in_p2p(seen, UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.rank_behind, (1,))

    def test_quiet_where_both_wait_in_recv(self) -> None:
        assert behind_peers_in_p2p(observed(*stacks_in("recv", "recv")), UNDECIDED) is None


class TestStuckFromStacks:
    def test_silent_ranks_inside_a_collective_are_stuck_there(self) -> None:
        found = stuck_from_stacks(observed(*stacks_in("all_reduce", "all_reduce")), UNDECIDED)
        assert found is not None and found.verdict == Verdict.stuck_in_collective

    def test_quiet_without_the_stalls_clock(self) -> None:
        seen = observed(*workers(0, 1), stack(1000, IN_ALL_REDUCE), stack(1001, IN_ALL_REDUCE))
        assert stuck_from_stacks(seen, UNDECIDED) is None


class TestLeadFromGpus:
    def test_the_rank_whose_gpu_computes_while_its_peers_spin_leads(self) -> None:
        sample = gpus(p1000=NCCL_SPIN_GPM, p1001=NCCL_SPIN_GPM, p1002=COMPUTE_GPM)
        found = lead_from_gpus(observed(*workers(0, 1, 2), sample), STUCK)
        assert found is not None and found.culprits == (2,)

    def test_quiet_where_every_gpu_spins_alike(self) -> None:
        sample = gpus(p1000=NCCL_SPIN_GPM, p1001=NCCL_SPIN_GPM, p1002=NCCL_SPIN_GPM)
        assert lead_from_gpus(observed(*workers(0, 1, 2), sample), STUCK) is None


class TestGpuComputeHang:
    led = Finding(verdict=Verdict.stuck_in_collective, summary="rank 1 leads", culprits=(1,))

    def test_the_leads_gpu_in_a_compute_kernel_while_its_peers_spin_in_nccl(self) -> None:
        found = gpu_compute_hang(observed(*workers(0, 1), gpus(p1000=NCCL_SPIN_GPM, p1001=COMPUTE_GPM)), self.led)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.gpu_compute_hang, (1,))

    def test_quiet_where_the_leads_gpu_spins_in_nccl_too(self) -> None:
        seen = observed(*workers(0, 1), gpus(p1000=NCCL_SPIN_GPM, p1001=NCCL_SPIN_GPM))
        assert gpu_compute_hang(seen, self.led) is None


class TestStreamHeldBeforeNccl:
    def test_a_rank_whose_gpu_started_nothing_while_its_peers_gpu_waits_for_it(self) -> None:
        dumps = dumps_of(lambda r: [coll(0, 1, OpState.started if r == 0 else OpState.scheduled)])
        found = stream_held_before_nccl(observed(*dumps), STUCK)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.gpu_compute_hang, (1,))

    def test_quiet_where_every_gpu_started_the_collective(self) -> None:
        dumps = dumps_of(lambda r: [coll(0, 1, OpState.started)])
        assert stream_held_before_nccl(observed(*dumps), STUCK) is None

    @pytest.mark.parametrize("bundle", PIPELINE_GPU_HANG, ids=lambda p: p.name.split("_gpu_hang")[0])
    def test_the_rank_whose_gpu_started_none_of_its_nccl_work_is_named(self, bundle) -> None:  # type: ignore[no-untyped-def]
        """A pipeline rank whose GPU is held by its own kernel before its next send (real 2 x H200 bundles, GPipe and
        1F1B), paged as stuck with no culprit before."""
        report = analyze_paths([str(bundle)])
        assert (report.verdict, report.culprit_ranks) == (Verdict.gpu_compute_hang, [1]), report.summary
        assert "Rank 1's GPU runs none of the NCCL operations its host enqueued" in report.summary
        assert report.kind == "spin"  # NVML: one block busy on rank 1's GPU, and no NCCL operation running there

    def test_two_pipeline_bundles_were_given(self) -> None:
        assert len(PIPELINE_GPU_HANG) == 2


class TestLeadFromStacks:
    def test_the_rank_outside_the_collective_its_peers_sit_in_leads(self) -> None:
        seen = observed(*workers(0, 1), stack(1000, IN_ALL_REDUCE), stack(1001, ASLEEP))
        found = lead_from_stacks(seen, STUCK)
        assert found is not None and found.culprits == (1,)

    def test_quiet_where_every_rank_sits_in_the_collective(self) -> None:
        seen = observed(*workers(0, 1), stack(1000, IN_ALL_REDUCE), stack(1001, IN_ALL_REDUCE))
        assert lead_from_stacks(seen, STUCK) is None


class TestSpinning:
    hung = Finding(verdict=Verdict.gpu_compute_hang, summary="rank 1's GPU", culprits=(1,))

    @staticmethod
    def seen(gpm):  # type: ignore[no-untyped-def]
        dumps = dumps_of(lambda r: [coll(0, 1, OpState.started if r == 0 else OpState.scheduled)])
        return observed(stall(), *workers(0, 1), *dumps, gpus(at=NOW - 1, p1000=NCCL_SPIN_GPM, p1001=gpm))

    def test_a_one_block_kernel_with_no_nccl_operation_running_is_the_spin_kind(self) -> None:
        found = spinning(self.seen(ONE_BLOCK_GPM), self.hung)
        assert found is not None and found.kind == "spin"

    def test_quiet_where_the_gpu_runs_a_compute_kernel(self) -> None:
        assert spinning(self.seen(COMPUTE_GPM), self.hung) is None


class TestRanAhead:
    def test_quiet_without_flight_recorder(self) -> None:
        behind = Finding(verdict=Verdict.rank_behind, summary="rank 1 behind", culprits=(1,), comm_key="0", position=3)
        assert ran_ahead(observed(*workers(0, 1)), behind) is None

    @pytest.mark.parametrize(
        ("shape", "culprits", "waiting"),
        [("pp_1f1b_skip_r1", [1], "rank 0 waits in"), ("fsdp2_tp_skip_r3", [3], "rank 0, 1, 2 wait in")],
    )
    def test_the_rank_that_ran_ahead_is_named_not_the_ranks_waiting_for_it(
        self, shape: str, culprits: list[int], waiting: str
    ) -> None:
        """A rank that skipped a collective on NCCL runs ahead: real H200 bundles
        (fixtures/bundles/nccl-2.28.9-h200-skip-ran-ahead)."""
        (bundle,) = (FIXTURES / "bundles" / "nccl-2.28.9-h200-skip-ran-ahead").glob(f"{shape}_after-*.tar.gz")
        report = analyze_paths([str(bundle)])
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, culprits)
        assert report.summary.startswith(f"Rank {culprits[0]} never started collective #201 (AllReduce count=1 Float)")
        assert waiting in report.summary
        rows = {row.rank: row.status for row in report.ranks}
        assert rows[culprits[0]] == "behind" and {s for r, s in rows.items() if r not in culprits} == {"waiting"}


class TestP2pWaitFromStacks:
    behind = Finding(verdict=Verdict.rank_behind, summary="rank 1 is behind", culprits=(1,))

    def test_the_one_rank_that_went_on_never_posted_the_send_its_peer_waits_for(self) -> None:
        seen = observed(stall(), *workers(0, 1), stack(1000, IN_ALL_REDUCE), stack(1001, IN_RECV))
        found = p2p_wait_from_stacks(seen, self.behind)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.rank_behind, (0,))

    def test_quiet_where_the_rank_behind_is_in_its_own_code(self) -> None:
        seen = observed(stall(), *workers(0, 1), stack(1000, IN_ALL_REDUCE), stack(1001, ASLEEP))
        assert p2p_wait_from_stacks(seen, self.behind) is None

    @pytest.mark.parametrize("order", [("node0", "node1"), ("node1", "node0")])
    def test_the_rank_in_its_own_code_is_named_whichever_node_comes_first(self, order: tuple[str, str]) -> None:
        """A rank behind in one communicator because it waits in a pipeline's recv is not the cause (real gloo
        bundles, pipeline x DP, rank 0 stuck)."""
        paths = [str(next(PP_DP_STUCK_R0.glob(f"{node}-*.tar.gz"))) for node in order]
        report = analyze_paths(paths)
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
        rows = {row.rank: row for row in report.ranks}
        assert "Fault.at" in (rows[0].stack or "")
        assert "forward_backward (shapes_job.py:272)" in (rows[3].stack or "")  # the schedule's recv, under its step

    def test_one_nodes_bundle_alone_names_no_rank_when_the_one_behind_waits_for_an_unseen_peer(self) -> None:
        """Node 1's bundle alone: rank 3 waits in the schedule's recv for rank 0, which is in no input; rank 2, the
        only other rank seen, waits in the all-reduce and never owed rank 3 a send."""
        report = analyze_paths([str(next(PP_DP_STUCK_R0.glob("node1-*.tar.gz")))])
        assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])
        assert "Rank 3 never entered AllReduce" in report.summary
        assert "ranks 0, 1 of the job are in no input given" in report.summary
        assert any(m.startswith("ranks 0, 1: no input") for m in report.missing), report.missing


class TestBusy:
    def test_a_busy_culprit_outside_communication_is_held(self) -> None:
        decision = judged(*busy_workers(cpu_busy_rank=2), STALL, logs=BEHIND)
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
            entries=[coll(0, 1, OpState.scheduled, pg="5", size=1024, dtype="Float")],
            cite=Citation(file="fr/rank2"),
        )
        decision = judged(*busy_workers(cpu_busy_rank=2), pending, STALL, logs=BEHIND)
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
                entries=[
                    coll(0, 1, OpState.completed, size=1024, dtype="Float"),
                    coll(1, 2, state, size=1024, dtype="Float"),
                ],
            )
            for rank, state in ((0, OpState.scheduled), (1, OpState.started))
        ]
        finding = judged(*dumps).finding
        assert (finding.verdict, finding.culprits) == (Verdict.gpu_compute_hang, (0,))
        assert "never started" in finding.summary

    def test_quiet_where_every_gpu_started_it(self) -> None:
        group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
        dumps = [
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=group,
                cite=Citation(file=f"fr/rank{rank}"),
                entries=[coll(0, 1, OpState.started, size=1024, dtype="Float")],
            )
            for rank in (0, 1)
        ]
        assert judged(*dumps).finding.verdict == Verdict.stuck_in_collective

    def test_quiet_where_its_peers_completed_it_a_record_behind(self) -> None:
        """A collective completes on no rank alone: the peers' "completed" proves the lead ran it, and its
        "scheduled" lags (seen on gloo, where a CPU pause was paged as a GPU hang)."""
        group = {"0": FrProcessGroup(pg_id="0", ranks=[0, 1])}
        dumps = [
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=group,
                cite=Citation(file=f"fr/rank{rank}"),
                entries=[
                    coll(0, 1, OpState.completed, size=1024, dtype="Float"),
                    coll(1, 2, state, size=1024, dtype="Float"),
                ],
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
