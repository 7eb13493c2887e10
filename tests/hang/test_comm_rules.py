"""The sequence rules (``hang.comm_rules.COMM_RULES``): one class per rule, named after it, with a case where it
fires and one where it stays quiet (``test_rule_tables`` checks every rule has both); literal NCCL lines and Flight
Recorder entries (``harness``)."""

from __future__ import annotations

import nccl_lines as L
from conftest import NOW
from harness import coll, dumps_of, judged, judged_state, p2p, snapshot_of, stall, state_of, verdict_of
from nccl_lines import destroy, init, op, steps

from ncclwatch.watchdog.events import Citation, FrEntry, OpState, StackDump, ThreadStack, WorkerFailure, WorkerSeen
from ncclwatch.watchdog.hang.comm_collectives import check_collectives
from ncclwatch.watchdog.hang.comm_p2p import p2p_log_pairs, p2p_recv_cycle, p2p_recv_never_sent
from ncclwatch.watchdog.hang.report import build_report, headline
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict

COMM = "0x5583d3a1f0e0"


def job(n: int, body) -> dict[str, str]:
    """One log per rank: init, then body(rank)."""
    return {f"r{r}.log": init(r, n, f"0xc{r}") + body(r) for r in range(n)}


class TestCollectives:
    def test_two_ranks_the_one_breaking_the_pattern_is_the_culprit(self):
        def body(r):
            text = steps(r, f"0xc{r}", 5)
            if r == 1:  # rank 1 skips the last three ops of step 6 and goes on with step 7
                return text + op(1, "AllReduce", 4195328, "0xc1") + steps(1, "0xc1", 1)
            return text + steps(0, "0xc0", 1)

        finding = verdict_of(job(2, body))
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.culprits == (1,)
        assert finding.position == 22
        assert finding.operation.startswith("AllReduce count=16777216")

    def test_the_culprit_does_not_depend_on_which_rank_is_listed_first(self):
        def body(r):
            text = steps(r, f"0xc{r}", 5)
            return text + (op(0, "AllReduce", 4195328, "0xc0") + steps(0, "0xc0", 1) if r == 0 else steps(1, "0xc1", 1))

        assert verdict_of(job(2, body)).culprits == (0,)

    def test_four_ranks_the_minority_is_the_culprit_without_a_pattern(self):
        def body(r):
            return op(r, "AllReduce", 8, f"0xc{r}") + op(r, "Broadcast" if r == 2 else "AllGather", 4, f"0xc{r}")

        finding = verdict_of(job(4, body))
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.culprits == (2,)
        assert finding.position == 2

    def test_even_split_without_a_pattern_names_no_culprit(self):
        def body(r):
            return op(r, "AllReduce", 8, f"0xc{r}") + op(r, "Broadcast" if r else "AllGather", 4, f"0xc{r}")

        finding = verdict_of(job(2, body))
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.culprits == ()

    def test_differing_root_is_a_mismatch(self):
        def body(r):
            return op(r, "Broadcast", 4, f"0xc{r}", root=r % 2 if r == 1 else 0)

        finding = verdict_of(job(3, body))
        assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, (1,))

    def test_quiet_where_the_sequences_are_identical(self):
        logs = job(3, lambda r: steps(r, f"0xc{r}", 4))
        finding = verdict_of(logs)
        assert finding.verdict == Verdict.inconclusive  # no end lines, no completion state
        assert all(check_collectives(c) is None for c in snapshot_of(logs).comms)


class TestRankBehind:
    def test_the_rank_that_issued_fewer_is_the_culprit_and_the_missing_op_named(self):
        def body(r):
            return steps(r, f"0xc{r}", 3) + ("" if r == 1 else op(r, "AllReduce", 4195328, f"0xc{r}"))

        finding = verdict_of(job(3, body))
        assert finding.verdict == Verdict.rank_behind
        assert finding.culprits == (1,)
        assert finding.position == 13
        assert finding.operation.startswith("AllReduce count=4195328")

    def test_the_furthest_behind_is_the_culprit(self):
        def body(r):
            return steps(r, f"0xc{r}", 2) + "".join(
                op(r, "AllReduce", 8, f"0xc{r}") for _ in range({0: 3, 1: 2, 2: 1}[r])
            )

        finding = verdict_of(job(3, body))
        assert finding.culprits == (2,)
        assert "rank 1" in finding.reason

    def test_a_behind_rank_that_exited_is_process_dead(self):
        def body(r):
            return steps(r, f"0xc{r}", 2) + ("" if r == 1 else op(r, "AllReduce", 8, f"0xc{r}"))

        failure = WorkerFailure(
            rank=1, exitcode=3, pid=1001, root_cause=True, cite=Citation(file="console.log", line=3)
        )
        finding = verdict_of(job(2, body), extra=[failure])
        assert (finding.verdict, finding.culprits) == (Verdict.process_dead, (1,))

    def test_torchrun_sigterm_of_a_healthy_rank_is_not_a_death(self):
        def body(r):
            return steps(r, f"0xc{r}", 2) + ("" if r == 1 else op(r, "AllReduce", 8, f"0xc{r}"))

        failure = WorkerFailure(rank=1, exitcode=-15, pid=1001, root_cause=False, cite=Citation(file="console.log"))
        assert verdict_of(job(2, body), extra=[failure]).verdict == Verdict.rank_behind


class TestP2pLogPairs:
    def test_missing_recv_blames_the_receiver(self):
        def body(r):
            text = op(r, "AllReduce", 8, f"0xc{r}")
            return text + (op(0, "Send", 64, "0xc0", root=1) if r == 0 else "")

        finding = verdict_of(job(2, body))
        assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,))
        assert "Recv #1" in finding.summary

    def test_send_and_recv_sizes_must_agree(self):
        def body(r):
            return op(0, "Send", 64, "0xc0", root=1) if r == 0 else op(1, "Recv", 32, "0xc1", root=0)

        finding = verdict_of(job(2, body))
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.culprits == (0, 1)

    def test_quiet_on_a_balanced_ring_exchange(self):
        def body(r):
            peer = 1 - r
            return op(r, "Send", 64, f"0xc{r}", root=peer) + op(r, "Recv", 64, f"0xc{r}", root=peer)

        snapshot = snapshot_of(job(2, body))
        assert all(p2p_log_pairs(c) is None for c in snapshot.comms)

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

    def test_one_missing_send_stays_rank_behind(self) -> None:
        logs = {0: L.init(0, 2, COMM) + L.op(0, "Recv", 64, COMM, root=1), 1: L.init(1, 2, COMM)}
        finding = judged(logs=logs).finding
        assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,))


class TestP2pRecvCycle:
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
        decision = judged(*seen, *dumps_of(self.nvlink_deadlock), *stacks, stall())
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

    def test_quiet_where_a_recv_waits_for_a_peer_that_sends_first(self) -> None:
        def entries(rank: int) -> list[FrEntry]:
            first, second = ("Recv", "Send") if rank == 0 else ("Send", "Recv")
            return [
                coll(0, 286, OpState.completed),
                p2p(1, first, rank, 1 - rank, 1, OpState.started),
                p2p(2, second, rank, 1 - rank, 2, OpState.scheduled),
                coll(3, 287, OpState.scheduled),
            ]

        assert judged(*dumps_of(entries), stall()).finding.verdict != Verdict.p2p_deadlock
        assert all(p2p_recv_cycle(c) is None for c in take_snapshot(judged_state(*dumps_of(entries)), NOW).comms)

    def test_quiet_on_a_pending_batch_isend_irecv_group(self) -> None:
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

        assert judged(*dumps_of(entries), stall()).finding.verdict != Verdict.p2p_deadlock
        assert all(p2p_recv_cycle(c) is None for c in take_snapshot(judged_state(*dumps_of(entries)), NOW).comms)


class TestP2pRecvNeverSent:
    @staticmethod
    def waiting(sender: list[FrEntry]):  # type: ignore[no-untyped-def]
        """Rank 0 waits in a recv from rank 1 with the step's all_reduce queued behind it; rank 1 posted ``sender``."""
        waiter = [p2p(0, "Recv", 0, 1, 1, OpState.started), coll(1, 1, OpState.scheduled)]
        (comm,) = take_snapshot(judged_state(*dumps_of(lambda r: waiter if r == 0 else sender)), NOW).comms
        return comm

    def test_the_peer_that_went_on_to_the_next_collective_never_sent(self) -> None:
        found = p2p_recv_never_sent(self.waiting([coll(0, 1, OpState.started)]))
        assert found is not None and (found.verdict, found.culprits) == (Verdict.rank_behind, (1,))

    def test_quiet_where_the_peer_has_not_reached_that_collective(self) -> None:
        assert p2p_recv_never_sent(self.waiting([])) is None


class TestCompletion:
    def test_all_destroyed_is_no_hang(self):
        finding = verdict_of(job(2, lambda r: steps(r, f"0xc{r}", 2) + destroy(r, 2, f"0xc{r}")))
        assert finding.verdict == Verdict.no_hang

    def test_same_operations_then_abort_is_stuck(self):
        finding = verdict_of(job(2, lambda r: steps(r, f"0xc{r}", 2) + destroy(r, 2, f"0xc{r}", kind="Abort")))
        assert finding.verdict == Verdict.stuck_in_collective
        assert finding.culprits == ()
        assert finding.missing


class TestWindow:
    def test_divergence_older_than_the_window_is_still_seen_through_the_digest(self):
        def body(r):
            early = op(r, "Broadcast" if r == 2 else "AllGather", 4, f"0xc{r}")
            return op(r, "AllReduce", 8, f"0xc{r}") + early + steps(r, f"0xc{r}", 40)

        finding = verdict_of(job(3, body), window=16)
        assert finding.verdict == Verdict.collective_mismatch

    def test_memory_is_bounded_by_the_window(self):
        state = state_of(job(2, lambda r: steps(r, f"0xc{r}", 500)), window=32)
        for comm in state.comms.values():
            for seq in comm.ranks.values():
                assert seq.total == 2000
                assert len(seq.coll) <= 64


class TestMerge:
    def test_merging_two_nodes_gives_the_same_verdict_as_one_state(self):
        from ncclwatch.watchdog.hang.job_rules import job_finding

        def body(r):
            return steps(r, f"0xc{r}", 3) + ("" if r == 3 else op(r, "AllReduce", 4195328, f"0xc{r}"))

        logs = job(4, body)
        node_a = state_of({k: v for k, v in logs.items() if k in ("r0.log", "r1.log")})
        node_b = state_of({k: v for k, v in logs.items() if k in ("r2.log", "r3.log")})
        node_a.merge(node_b)
        merged = job_finding(take_snapshot(node_a, 0.0))
        assert (merged.verdict, merged.culprits) == (Verdict.rank_behind, (3,))
