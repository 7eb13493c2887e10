"""Issue 30: sizes that differ by design are no mismatch; a difference every rank completed, after which the ranks
agree again, is not the hang. Real size and dtype mismatches still are.

The recorded sizes are what torch 2.13's gloo wrote for two ranks (``dist.scatter``, ``dist.gather``, an uneven
``dist.all_to_all_single`` with input splits [1, 3] and [2, 2]), read back with ``_dump_fr_trace_json``.
"""

from __future__ import annotations

from conftest import NOW

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdict import decide
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


def judged(rank0: list[FrEntry], rank1: list[FrEntry], last_completed: tuple[int, int] | None = None) -> Finding:
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
    return decide(take_snapshot(state, observed_at=NOW))


def all_reduce(seq: int, count: int = 4, state: OpState = DONE, dtype: str = "Float") -> FrEntry:
    return entry(seq, "AllReduce", ([[count]], [[count]]), ([dtype], [dtype]), state)


class TestSidesEveryRankRecordsAlike:
    """Pending at the position, so only the signatures decide (no completion involved)."""

    ROOT_AND_OTHER = {
        "Scatter": ((([[2, 3]], [[3]]), (["Float"], ["Float"])), (([], [[3]]), ([], ["Float"]))),
        "Gather": ((([[3]], [[2, 3]]), (["Float"], ["Float"])), (([[3]], []), (["Float"], []))),
        "AlltoAll": ((([[4]], [[3]]), (["Float"], ["Float"])), (([[4]], [[5]]), (["Float"], ["Float"]))),
    }

    def test_root_and_others_and_uneven_splits_issue_one_operation(self) -> None:
        for op, ((sizes0, dtypes0), (sizes1, dtypes1)) in self.ROOT_AND_OTHER.items():
            rank0 = [all_reduce(1), entry(2, op, sizes0, dtypes0, WAITING), all_reduce(3, state=WAITING)]
            rank1 = [all_reduce(1), entry(2, op, sizes1, dtypes1, WAITING)]
            finding = judged(rank0, rank1)
            assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 3), op

    def test_scatters_of_other_chunks_are_a_mismatch(self) -> None:
        rank0 = [all_reduce(1), entry(2, "Scatter", ([[2, 3]], [[3]]), state=WAITING)]
        rank1 = [all_reduce(1), entry(2, "Scatter", ([], [[4]]), ([], ["Float"]), WAITING)]
        finding = judged(rank0, rank1)
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_all_reduces_of_other_counts_or_dtypes_are_a_mismatch(self) -> None:
        for other in (all_reduce(2, 8, WAITING), all_reduce(2, 4, WAITING, "Double")):
            finding = judged([all_reduce(1), all_reduce(2, 4, WAITING)], [all_reduce(1), other])
            assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2), other


class TestCompletedEverywhere:
    """One call recorded with other sizes on each rank (a kind this engine does not know), completed by both."""

    @staticmethod
    def ranks(second: OpState, then_agree: bool = True) -> tuple[list[FrEntry], list[FrEntry]]:
        rank0 = [all_reduce(1), all_reduce(2, 6, second), all_reduce(3, 16), all_reduce(4, state=WAITING)]
        rank1 = [all_reduce(1), all_reduce(2, 9, second), all_reduce(3, 16 if then_agree else 32)]
        return rank0, rank1

    def test_the_ranks_met_there_and_the_stall_is_what_is_pending(self) -> None:
        finding = judged(*self.ranks(DONE))
        assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 4)

    def test_gloo_s_completion_counts_the_same(self) -> None:
        # gloo (torch 2.13) leaves every entry 'scheduled'; last_completed_collective 3 on both ranks completes #2.
        finding = judged(*self.ranks(DONE), last_completed=(3, 3))
        assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (1,), 4)

    def test_a_difference_still_pending_is_a_mismatch(self) -> None:
        finding = judged(*self.ranks(WAITING))
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_a_completed_difference_the_ranks_never_recover_from_stays_the_divergence(self) -> None:
        # NCCL completes what it is given (the 2-GPU capture mismatch_fr): what follows is shifted, the cause is here.
        finding = judged(*self.ranks(DONE, then_agree=False))
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)

    def test_another_collective_is_another_call_even_completed(self) -> None:
        rank0 = [all_reduce(1), all_reduce(2), all_reduce(3), all_reduce(4, state=WAITING)]
        rank1 = [all_reduce(1), entry(2, "Broadcast", ([[4]], [[4]])), all_reduce(3)]
        finding = judged(rank0, rank1)
        assert (finding.verdict, finding.position) == (Verdict.collective_mismatch, 2)
