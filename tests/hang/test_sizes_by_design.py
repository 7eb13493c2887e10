"""Issue 30: sizes that differ by design are no mismatch; a difference every rank completed, after which the ranks
agree again, is not the hang. Real size and dtype mismatches still are.

The recorded sizes are what torch 2.13's gloo wrote for two ranks (``dist.scatter``, ``dist.gather``, an uneven
``dist.all_to_all_single`` with input splits [1, 3] and [2, 2]), read back with ``_dump_fr_trace_json``.
"""

from __future__ import annotations

from conftest import NOW

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

DONE, WAITING = OpState.completed, OpState.scheduled


def entry(
    seq: int,
    op: str,
    sizes: tuple[list, list],
    dtypes: tuple[list, list] = (["Float"], ["Float"]),
    state: OpState = DONE,
) -> FrEntry:
    name = {
        "Scatter": "scatter",
        "Gather": "gather",
        "AlltoAll": "all_to_all",
        "AllReduce": "all_reduce",
        "Broadcast": "broadcast",
        "AllGather": "all_gather",
    }[op]
    return FrEntry(
        index=seq - 1,
        pg_id="0",
        collective_seq_id=seq,
        profiling_name=f"gloo:{name}",
        op=op,
        is_p2p=False,
        input_sizes=sizes[0],
        output_sizes=sizes[1],
        input_dtypes=dtypes[0],
        output_dtypes=dtypes[1],
        state=state,
    )


def pair_finding(rank0: list[FrEntry], rank1: list[FrEntry], last_completed: tuple[int, int] | None = None) -> Finding:
    """Two ranks' dumps; with ``last_completed``, gloo's way: every entry 'scheduled', the group's status counts."""
    state = JobState()
    for rank, entries in enumerate((rank0, rank1)):
        status = {}
        if last_completed is not None:
            entries = [e.model_copy(update={"state": WAITING}) for e in entries]
            status = {"last_enqueued": len(entries), "last_completed": last_completed[rank]}
        group = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1], **status)}
        state.apply(
            FrDump(
                rank=rank, version="2.10", process_groups=group, entries=entries, cite=Citation(file=f"fr/rank_{rank}")
            )
        )
    return job_finding(take_snapshot(state, observed_at=NOW))


def all_reduce(seq: int, count: int = 4, state: OpState = DONE, dtype: str = "Float") -> FrEntry:
    return entry(seq, "AllReduce", ([[count]], [[count]]), ([dtype], [dtype]), state)


class TestSidesEveryRankRecordsAlike:
    """Pending at the position, so only the signatures decide (no completion involved)."""

    ROOT_AND_OTHER = {
        "Scatter": ((([[2, 3]], [[3]]), (["Float"], ["Float"])), (([], [[3]]), ([], ["Float"]))),
        "Gather": ((([[3]], [[2, 3]]), (["Float"], ["Float"])), (([[3]], []), (["Float"], []))),
        # torch 2.11 NCCL on the H200 records a scatter the other way round: the chunk as input on every rank, the
        # scatter list as the root's output and [[0]] UNKNOWN_SCALAR as the other rank's.
        "Scatter, NCCL": (
            (([[256, 128]], [[256, 128], [256, 128]]), (["Float"], ["Float", "Float"])),
            (([[256, 128]], [[0]]), (["Float"], ["UNKNOWN_SCALAR"])),
        ),
        "AlltoAll": ((([[4]], [[3]]), (["Float"], ["Float"])), (([[4]], [[5]]), (["Float"], ["Float"]))),
    }

    def test_root_and_others_and_uneven_splits_issue_one_operation(self) -> None:
        for case, ((sizes0, dtypes0), (sizes1, dtypes1)) in self.ROOT_AND_OTHER.items():
            op = case.split(",")[0]
            rank0 = [all_reduce(1), entry(2, op, sizes0, dtypes0, WAITING), all_reduce(3, state=WAITING)]
            rank1 = [all_reduce(1), entry(2, op, sizes1, dtypes1, WAITING)]
            finding = pair_finding(rank0, rank1)
            assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 3), case

    def test_nccl_scatters_of_other_chunks_are_a_mismatch(self) -> None:
        root = entry(2, "Scatter", ([[4, 2]], [[4, 2], [4, 2]]), (["Float"], ["Float", "Float"]), WAITING)
        other = entry(2, "Scatter", ([[4, 3]], [[0]]), (["Float"], ["UNKNOWN_SCALAR"]), WAITING)
        finding = pair_finding([all_reduce(1), root], [all_reduce(1), other])
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_scatters_of_other_chunks_are_a_mismatch(self) -> None:
        rank0 = [all_reduce(1), entry(2, "Scatter", ([[2, 3]], [[3]]), state=WAITING)]
        rank1 = [all_reduce(1), entry(2, "Scatter", ([], [[4]]), ([], ["Float"]), WAITING)]
        finding = pair_finding(rank0, rank1)
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_all_reduces_of_other_counts_or_dtypes_are_a_mismatch(self) -> None:
        for other in (all_reduce(2, 8, WAITING), all_reduce(2, 4, WAITING, "Double")):
            finding = pair_finding([all_reduce(1), all_reduce(2, 4, WAITING)], [all_reduce(1), other])
            assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2), other


class TestCompletedEverywhere:
    """One call recorded with other sizes on each rank (a kind this engine does not know), completed by both."""

    @staticmethod
    def ranks(second: OpState, then_agree: bool = True) -> tuple[list[FrEntry], list[FrEntry]]:
        rank0 = [all_reduce(1), all_reduce(2, 6, second), all_reduce(3, 16), all_reduce(4, state=WAITING)]
        rank1 = [all_reduce(1), all_reduce(2, 9, second), all_reduce(3, 16 if then_agree else 32)]
        return rank0, rank1

    def test_the_ranks_met_there_and_the_stall_is_what_is_pending(self) -> None:
        finding = pair_finding(*self.ranks(DONE))
        assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 4)

    def test_gloo_s_completion_counts_the_same(self) -> None:
        # gloo (torch 2.13) leaves every entry 'scheduled'; last_completed_collective 3 on both ranks completes #2.
        finding = pair_finding(*self.ranks(DONE), last_completed=(3, 3))
        assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 4)

    def test_a_difference_still_pending_is_a_mismatch(self) -> None:
        finding = pair_finding(*self.ranks(WAITING))
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_a_completed_difference_the_ranks_never_recover_from_stays_the_divergence(self) -> None:
        # NCCL completes what it is given (the 2-GPU capture mismatch_fr): what follows is shifted, the cause is here.
        finding = pair_finding(*self.ranks(DONE, then_agree=False))
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_with_nothing_pending_after_it_a_completed_difference_holds_nothing(self) -> None:
        # A job in its set-up, slow between its first collectives: nothing it issued is still running.
        rank0 = [all_reduce(1), all_reduce(2, 6)]
        rank1 = [all_reduce(1), all_reduce(2, 9)]
        assert pair_finding(rank0, rank1).verdict == Verdict.no_hang

    def test_another_collective_is_another_call_even_completed(self) -> None:
        rank0 = [all_reduce(1), all_reduce(2), all_reduce(3), all_reduce(4, state=WAITING)]
        rank1 = [all_reduce(1), entry(2, "Broadcast", ([[4]], [[4]])), all_reduce(3)]
        finding = pair_finding(rank0, rank1)
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)


class TestDatatypesCompletedApart:
    """A collective every rank completed in other datatypes is never by design: NCCL moved bytes of one type as the
    other.  The H200, two wrappers, rank 1 all_reducing its losses in float32 where rank 0 passes bfloat16 at step 1:
    both completed all_reduce #14, then the broadcast #15 hung on both."""

    @staticmethod
    def ranks(then: list[OpState], rank1_dtype: str = "BFloat16") -> tuple[list[FrEntry], list[FrEntry]]:
        history = [all_reduce(seq) for seq in range(1, 4)]
        after = [entry(5 + i, "Broadcast", ([[16]], [[16]]), state=state) for i, state in enumerate(then)]
        return [*history, all_reduce(4), *after], [*history, all_reduce(4, dtype=rank1_dtype), *after]

    def test_the_collective_right_after_it_hanging_names_the_rank_that_changed_its_datatype(self) -> None:
        finding = pair_finding(*self.ranks([WAITING, WAITING]))
        assert (finding.verdict, finding.culprits, finding.position) == (Verdict.collective_mismatch, (1,), 4)
        assert finding.kind == "dtype"
        assert finding.summary.startswith("rank 1 passes BFloat16 where rank 0 passes Float")

    def test_with_every_collective_after_it_completed_it_is_not_what_holds_the_job(self) -> None:
        # a pause after it (a checkpoint): nothing pending, so no mismatch is the stall
        assert pair_finding(*self.ranks([DONE, DONE])).verdict is not Verdict.collective_mismatch

    def test_far_behind_the_stall_it_is_not_the_stall_s_cause(self) -> None:
        finding = pair_finding(*self.ranks([DONE] * 6 + [WAITING]))
        assert finding.verdict is not Verdict.collective_mismatch and finding.position == 11, finding.summary

    def test_a_size_that_differs_by_design_keeps_its_old_reading(self) -> None:
        # the same run with the counts differing instead (one call recorded apart): the stall is what is pending
        rank0, rank1 = self.ranks([WAITING, WAITING], rank1_dtype="Float")
        rank1[3] = all_reduce(4, count=8)
        assert pair_finding(rank0, rank1).verdict is not Verdict.collective_mismatch

    def test_a_divergence_still_pending_far_after_it_is_the_one_named(self) -> None:
        rank0, rank1 = self.ranks([DONE] * 6)
        rank0.append(all_reduce(11, state=WAITING))
        rank1.append(entry(11, "AllGather", ([[4]], [[8]]), state=WAITING))
        finding = pair_finding(rank0, rank1)
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 11), finding.summary
