"""The job-wide rules (``hang.job_rules``): ``JOB_RULES``, which refine the most telling communicator's finding, and
``UNSEQUENCED_RULES``, which read a job without any sequence.  One class per rule, named after it, with a case where it
fires and one where it stays quiet (``test_rule_tables`` checks every rule has both)."""

from __future__ import annotations

from conftest import FIXTURES
from harness import COMPUTE_GPM, NCCL_SPIN_GPM, gpus, snapshot_with, workers

from ncclwatch.watchdog.events import (
    Citation,
    NcclWarning,
    ProcKey,
    RasCommunicator,
    RasRank,
    RasReport,
    WatchdogTimeout,
    WorkerFailure,
)
from ncclwatch.watchdog.hang.job_rules import (
    Weighed,
    corroborated,
    died,
    job_evidence,
    lead_from_gpus,
    nothing_to_align,
    partial_decided,
    partial_decides,
    ras_report,
    torchrun_dead,
)
from ncclwatch.watchdog.hang.partial import partial_finding
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.ras import parse_ras

UNDECIDED = Finding(verdict=Verdict.inconclusive, summary="nothing aligned")
BEHIND = Finding(verdict=Verdict.rank_behind, summary="rank 1 issued fewer", culprits=(1,), comm_label="tp")
STUCK = Finding(verdict=Verdict.stuck_in_collective, summary="every rank waits in #2")
DIED = WorkerFailure(rank=1, exitcode=3, pid=1001, root_cause=True, cite=Citation(file="console.log", line=3))
TORN_DOWN = WorkerFailure(rank=1, exitcode=-15, pid=1001, root_cause=False, cite=Citation(file="console.log"))
# 4 x H200, rank 3 issued one extra all_reduce: NCCL's RAS names it (tools/capture "extra").
RAS_EXTRA = FIXTURES / "captures" / "nccl-2.28.9-h200x4" / "extra" / "ras" / "ras.txt"


def job(snapshot: Snapshot, *others: Finding) -> Weighed:
    return Weighed(snapshot, others)


def timeout(rank: int, op: str) -> WatchdogTimeout:
    """PyTorch's watchdog line: ``rank`` timed out in SeqNum 5, an ``op`` of 1024 elements."""
    return WatchdogTimeout(
        rank=rank, seq=5, op=op, numel_in=1024, numel_out=1024, ran_ms=600082, cite=Citation(file=f"rank{rank}.log")
    )


class TestPartialDecides:
    def test_a_dead_peer_decides_what_aligned_sequences_could_not(self) -> None:
        found = partial_decides(job(snapshot_with(DIED)), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (1,))

    def test_quiet_where_the_sequences_decided(self) -> None:
        assert partial_decides(job(snapshot_with(DIED)), BEHIND) is None


class TestCorroborated:
    def test_another_communicators_hang_is_cited(self) -> None:
        other = Finding(verdict=Verdict.rank_behind, summary="rank 1 behind", culprits=(1,), comm_label="dp")
        found = corroborated(job(snapshot_with(), other), BEHIND)
        assert found is not None and any("dp: rank_behind, culprits [1]" in f.fact for f in found.evidence)

    def test_quiet_without_other_hangs_or_unseen_ranks(self) -> None:
        healthy = Finding(verdict=Verdict.no_hang, summary="all done", comm_label="dp")
        assert corroborated(job(snapshot_with(), healthy), BEHIND) is None


class TestDied:
    def test_a_rank_behind_that_exited_on_its_own_is_process_dead(self) -> None:
        found = died(job(snapshot_with(DIED)), BEHIND)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (1,))

    def test_quiet_where_torchrun_tore_a_healthy_rank_down(self) -> None:
        assert died(job(snapshot_with(TORN_DOWN)), BEHIND) is None


class TestLeadFromGpus:
    def test_the_rank_whose_gpu_computes_while_its_peers_spin_leads(self) -> None:
        sample = gpus(p1000=NCCL_SPIN_GPM, p1001=COMPUTE_GPM, p1002=NCCL_SPIN_GPM)
        found = lead_from_gpus(job(snapshot_with(*workers(0, 1, 2), sample)), STUCK)
        assert found is not None and found.culprits == (1,)

    def test_quiet_without_gpu_samples(self) -> None:
        assert lead_from_gpus(job(snapshot_with(*workers(0, 1, 2))), STUCK) is None


class TestJobEvidence:
    def test_nccls_warnings_and_pytorchs_timeouts_are_cited(self) -> None:
        warning = NcclWarning(
            proc=ProcKey(host="node1", pid=1001),
            category="network",
            message="NET/IB : Got completion from peer 10.0.0.2 with error 12",
            cite=Citation(file="node1.1001", line=40),
        )
        found = job_evidence(job(snapshot_with(warning, timeout(0, "ALLREDUCE"))), BEHIND)
        assert found is not None
        assert {f.source for f in found.evidence} == {"nccl_log", "pytorch"}

    def test_quiet_without_job_wide_evidence(self) -> None:
        assert job_evidence(job(snapshot_with()), BEHIND) is None


class TestPartialDecided:
    def test_ranks_timing_out_in_one_seqnum_with_different_operations(self) -> None:
        found = partial_decided(snapshot_with(timeout(0, "ALLREDUCE"), timeout(1, "BROADCAST")))
        assert found is not None and found.verdict == Verdict.collective_mismatch

    def test_quiet_where_one_ranks_timeout_decides_nothing(self) -> None:
        assert partial_decided(snapshot_with(timeout(0, "ALLREDUCE"))) is None


class TestRasReport:
    def test_the_rank_ras_counts_apart_is_named(self) -> None:
        found = ras_report(snapshot_with(*parse_ras(RAS_EXTRA.read_bytes(), "ras.txt")))
        assert found is not None and found.culprits == (3,) and found.source == "ras"

    def test_quiet_where_every_rank_launched_as_many(self) -> None:
        counts = {"AllReduce": 5}
        ranks = [RasRank(rank=r, status="RUNNING", collective_counts=counts) for r in (0, 1)]
        report = RasReport(
            format="text", communicators=[RasCommunicator(status="OK", ranks=ranks)], cite=Citation(file="ras.txt")
        )
        assert ras_report(snapshot_with(report)) is None


class TestPartialUndecided:
    def test_one_ranks_timeout_is_said_as_seen(self) -> None:
        found = partial_finding(snapshot_with(timeout(0, "ALLREDUCE")))
        assert found is not None and found.verdict == Verdict.inconclusive and "Seen:" in found.summary

    def test_quiet_without_partial_evidence(self) -> None:
        assert partial_finding(snapshot_with(DIED)) is None


class TestTorchrunDead:
    def test_a_rank_torchrun_saw_exit_on_its_own(self) -> None:
        found = torchrun_dead(snapshot_with(DIED))
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (1,))

    def test_quiet_on_torchruns_teardown(self) -> None:
        assert torchrun_dead(snapshot_with(TORN_DOWN)) is None


class TestNothingToAlign:
    def test_says_which_inputs_would_decide(self) -> None:
        found = nothing_to_align(snapshot_with())
        assert found.verdict == Verdict.inconclusive and "Flight Recorder dumps" in found.missing
