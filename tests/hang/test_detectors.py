"""Detectors on literal NCCL lines: one class per rule, a quiet case beside each firing one."""

from __future__ import annotations

from engine import snapshot_of, verdict_of
from nccl_lines import destroy, init, op, steps

from ncclwatch.watchdog.events import Citation, WorkerFailure
from ncclwatch.watchdog.hang.comm_rules import p2p_log_pairs
from ncclwatch.watchdog.hang.verdicts import Verdict


def job(n: int, body) -> dict[str, str]:
    """One log per rank: init, then body(rank)."""
    return {f"r{r}.log": init(r, n, f"0xc{r}") + body(r) for r in range(n)}


class TestCollectiveMismatch:
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

    def test_identical_sequences_are_not_a_mismatch(self):
        finding = verdict_of(job(3, lambda r: steps(r, f"0xc{r}", 4)))
        assert finding.verdict == Verdict.inconclusive  # no end lines, no completion state


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


class TestPointToPoint:
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

    def test_balanced_ring_exchange_is_quiet(self):
        def body(r):
            peer = 1 - r
            return op(r, "Send", 64, f"0xc{r}", root=peer) + op(r, "Recv", 64, f"0xc{r}", root=peer)

        snapshot = snapshot_of(job(2, body))
        assert all(p2p_log_pairs(c) is None for c in snapshot.comms)


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
        from engine import state_of

        state = state_of(job(2, lambda r: steps(r, f"0xc{r}", 500)), window=32)
        for comm in state.comms.values():
            for seq in comm.ranks.values():
                assert seq.total == 2000
                assert len(seq.coll) <= 64


class TestMerge:
    def test_merging_two_nodes_gives_the_same_verdict_as_one_state(self):
        from engine import state_of

        from ncclwatch.watchdog.hang.job_rules import job_finding
        from ncclwatch.watchdog.hang.snapshot import take_snapshot

        def body(r):
            return steps(r, f"0xc{r}", 3) + ("" if r == 3 else op(r, "AllReduce", 4195328, f"0xc{r}"))

        logs = job(4, body)
        node_a = state_of({k: v for k, v in logs.items() if k in ("r0.log", "r1.log")})
        node_b = state_of({k: v for k, v in logs.items() if k in ("r2.log", "r3.log")})
        node_a.merge(node_b)
        merged = job_finding(take_snapshot(node_a, 0.0))
        assert (merged.verdict, merged.culprits) == (Verdict.rank_behind, (3,))
