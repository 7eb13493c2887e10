"""A snapshot taken with the previous one's ``RankViews`` reuses the view of a rank whose sequence cannot have
changed (a Flight Recorder dump's, a shared tail's) and reads every other again: it equals a snapshot taken afresh."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest
from conftest import NOW
from nccl_lines import init, op, steps

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpSig, OpState, SequenceTail
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import RankView, RankViews, Snapshot, take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

RANKS = 4


def dump(rank: int, issued: int) -> FrDump:
    """``issued`` all_reduces on the default group, the newest still running."""
    entries = [
        FrEntry(
            index=i,
            pg_id="0",
            collective_seq_id=i + 1,
            profiling_name="nccl:all_reduce",
            op="AllReduce",
            is_p2p=False,
            input_sizes=[[1024]],
            input_dtypes=["Float"],
            state=OpState.started if i == issued - 1 else OpState.completed,
        )
        for i in range(issued)
    ]
    group = FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(range(RANKS)))
    return FrDump(
        rank=rank, version="2.10", process_groups={"0": group}, entries=entries, cite=Citation(file=f"fr/{rank}")
    )


def views(snapshot: Snapshot, key: str) -> dict[int, RankView]:
    return next(c.by_comm_rank() for c in snapshot.comms if c.key == key)


def test_a_new_dump_is_read_again_the_others_are_reused_and_the_verdict_follows_it() -> None:
    state = JobState()
    for rank in range(RANKS):
        state.apply(dump(rank, 5 if rank == 2 else 6))
    kept = RankViews()
    first = take_snapshot(state, observed_at=NOW, views=kept)
    assert classify(first).finding.verdict == Verdict.rank_behind and classify(first).finding.culprits == (2,)

    state.apply(dump(2, 6))  # rank 2's next dump: it caught up
    second = take_snapshot(state, observed_at=NOW, views=kept)
    assert second == take_snapshot(state, observed_at=NOW)
    before, after = views(first, "fr:0"), views(second, "fr:0")
    assert [after[r] is before[r] for r in range(RANKS)] == [True, True, False, True]
    assert after[2].total == 6
    assert classify(second).finding.verdict != Verdict.rank_behind


def test_a_sequence_that_grows_in_place_is_read_again() -> None:
    """An NCCL log's sequence is the same object as it grows: its view is made again at every snapshot."""
    parsers = {r: NcclLogParser(f"r{r}.log") for r in range(2)}
    state = JobState()
    for rank, parser in parsers.items():
        for event in parser.feed((init(rank, 2, f"0xc{rank}") + steps(rank, f"0xc{rank}", 2)).encode(), final=False):
            state.apply(event)
    state.apply(dump(0, 3))
    kept = RankViews()
    first = take_snapshot(state, observed_at=NOW, views=kept)
    nccl = next(c.key for c in first.comms if c.source == "nccl_log")

    for event in parsers[1].feed(op(1, "AllReduce", 8, "0xc1").encode(), final=False):
        state.apply(event)
    second = take_snapshot(state, observed_at=NOW, views=kept)
    assert second == take_snapshot(state, observed_at=NOW)
    assert views(second, nccl)[1].total == views(first, nccl)[1].total + 1
    assert views(second, nccl)[0] is not views(first, nccl)[0]  # not settled: read again, changed or not
    assert views(second, "fr:0")[0] is views(first, "fr:0")[0]


def tail(comm: str, nranks: int, comm_rank: int) -> SequenceTail:
    """Another node's tail of pid 7 on ``host``, its global rank left to the job's largest communicator."""
    sigs = [OpSig("AllReduce", 8, "7", "0", 0)]
    return SequenceTail(
        comm_key=comm,
        label=comm,
        nranks=nranks,
        comm_rank=comm_rank,
        global_rank=None,
        host="host",
        pid=7,
        base=0,
        sigs=sigs,
    )


def test_a_settled_rank_whose_global_rank_changed_is_read_again() -> None:
    state = JobState()
    state.apply(tail("nccl:pair", 2, 1))
    kept = RankViews()
    first = take_snapshot(state, observed_at=NOW, views=kept)
    assert views(first, "nccl:pair")[1].global_rank == 1

    state.apply(tail("nccl:world", 8, 5))  # the same process in a larger communicator: its global rank is 5
    second = take_snapshot(state, observed_at=NOW, views=kept)
    assert second == take_snapshot(state, observed_at=NOW)
    assert views(second, "nccl:pair")[1].global_rank == 5


def test_a_view_is_the_one_its_dataclass_makes() -> None:
    """``snapshot._rank`` fills a view's fields at once, not through ``RankView.__init__``: every field is there, the
    view equals (and reads as) the one ``RankView(...)`` makes from the same values, and it stays frozen."""
    parser = NcclLogParser("r0.log")
    state = JobState()
    for event in parser.feed((init(0, 2, "0xc0") + steps(0, "0xc0", 3)).encode(), final=False):
        state.apply(event)
    state.apply(dump(1, 4))
    state.apply(tail("nccl:0xt", 2, 1))
    made = [view for comm in take_snapshot(state, observed_at=NOW).comms for view in comm.ranks]
    assert len(made) == 3
    for view in made:
        assert vars(view).keys() == {f.name for f in fields(RankView)}
        again = RankView(**{f.name: getattr(view, f.name) for f in fields(RankView) if f.init})
        assert view == again and vars(view) == vars(again)
        with pytest.raises(FrozenInstanceError):
            view.base = 0  # type: ignore[misc]
