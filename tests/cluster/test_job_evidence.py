"""The leader's incremental state (``JobEvidence``) judges as ``job_state`` rebuilt from every node's evidence, and as
the single-process engine fed every node's events, for several faults at 64 nodes of 8 ranks (bench/cluster.py's
evidence, one rank changed)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
from conftest import REPO

from ncclwatch.watchdog.cluster.incident_evidence import FULL_NODES
from ncclwatch.watchdog.cluster.judge import JobEvidence, focus, job_state
from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    OpState,
    SequenceTail,
    StackDump,
    Stall,
    ThreadStack,
    WorkerGone,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision

NODES, RANKS = 64, 8
Fault = Callable[[list[Event], int], list[Event]]  # one node's events, the rank at fault -> its events


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest):  # noqa: ANN201
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import cluster

    request.addfinalizer(monkeypatch.undo)
    return cluster


def behind(events: list[Event], rank: int) -> list[Event]:
    return events  # bench/cluster.py's own fault: the job's last rank issued one collective fewer


def mismatch(events: list[Event], rank: int) -> list[Event]:
    """Its newest collective has half the size on this rank, in its dump and its NCCL tail."""

    def changed(event: Event) -> Event:
        if isinstance(event, FrDump) and event.rank == rank:
            last = event.entries[-1].model_copy(update={"input_sizes": [[1 << 19]]})
            return event.model_copy(update={"entries": [*event.entries[:-1], last]})
        if isinstance(event, SequenceTail) and event.global_rank == rank:
            return event.model_copy(update={"sigs": [*event.sigs[:-1], event.sigs[-1]._replace(count=1 << 19)]})
        return event

    return [changed(e) for e in events]


def dead(events: list[Event], rank: int) -> list[Event]:
    """Its process exited while the others wait in the collective."""
    seen = next(e for e in events if isinstance(e, WorkerSeen) and e.rank == rank)
    return [*events, WorkerGone(pid=seen.pid, rank=rank, at=seen.at + 590)]


def p2p(events: list[Event], rank: int) -> list[Event]:
    """This rank and the next each wait in a recv from the other, after every collective completed."""

    def changed(event: Event) -> Event:
        if not isinstance(event, FrDump) or event.rank not in (rank, rank + 1):
            return event
        entries = [e.model_copy(update={"state": OpState.completed}) for e in event.entries]
        peer = rank + 1 if event.rank == rank else rank
        recv = FrEntry(
            index=len(entries),
            pg_id="0",
            p2p_seq_id=1,
            profiling_name=f"nccl:recv {event.rank}<-{peer}",
            op="Recv",
            is_p2p=True,
            peer=peer,
            input_sizes=[[1 << 20]],
            input_dtypes=["BFloat16"],
            state=OpState.started,
        )
        return event.model_copy(update={"entries": [*entries, recv]})

    return [changed(e) for e in events]


def evidence(bench, fault: Fault, culprit: int) -> tuple[Stall, dict[int, list[Event]]]:  # noqa: ANN001
    stall = bench.stall_at(1_000_000.0)
    nodes = {n: bench.node_evidence(n, RANKS, NODES, stall) for n in range(NODES)}
    if fault is not behind:  # the bench's own fault healed: the job's last rank issued as many as the others
        last = NODES * RANKS - 1

        def healed(event: Event) -> Event:
            if isinstance(event, FrDump) and event.rank == last:
                return event.model_copy(update={"entries": bench.ring(bench.ISSUED)})
            if isinstance(event, SequenceTail) and event.global_rank == last:
                return event.model_copy(update={"base": event.base + 1})
            return event

        nodes[NODES - 1] = [healed(e) for e in nodes[NODES - 1]]
    node = culprit // RANKS
    nodes[node] = fault(nodes[node], culprit)
    return stall, nodes


def shared(events: list[Event], kind: str, stall: Stall, node: int) -> list[Event]:
    """As the leader reads them: packed for the store by the node, unpacked."""
    payload = unpack(pack(node, kind, stall.at, events), f"node {node}")  # type: ignore[arg-type]
    assert payload is not None
    return payload.events


def leader_and_compact(
    stall: Stall, nodes: dict[int, list[Event]], without: tuple[int, ...] = ()
) -> tuple[JobState, dict[int, list[Event]]]:
    """Node 0's own state (the leader's), and every other node's compact evidence as the leader reads it."""
    local = JobState()
    for event in nodes[0]:
        local.apply(event)
    return local, {n: shared(events, "compact", stall, n) for n, events in nodes.items() if n not in (0, *without)}


def folded_in(local: JobState, stall: Stall, compact: dict[int, list[Event]]) -> JobEvidence:
    """The leader's state with every node's compact evidence folded in, in the order it came."""
    evidence = JobEvidence(local, stall)
    for node, events in compact.items():
        evidence.add(node, events)
    return evidence


def both_paths(stall: Stall, nodes: dict[int, list[Event]]) -> tuple[Decision, Decision, JobEvidence, JobState]:
    """The leader's two judgements, incremental and rebuilt, as live/job_judging.py's ``_judge_job`` runs them."""
    local, compact = leader_and_compact(stall, nodes)
    incremental = folded_in(local, stall, compact)
    rebuilt = dict(compact)
    first = classify(take_snapshot(job_state(local, rebuilt, stall), observed_at=stall.at))
    assert incremental.judge() == first
    for node in focus(first, incremental.nodes_of, set(), FULL_NODES):
        full = shared(nodes[node], "full", stall, node)
        incremental.add(node, full)
        rebuilt[node] = full
    state = job_state(local, rebuilt, stall)
    return incremental.judge(), classify(take_snapshot(state, observed_at=stall.at)), incremental, state


@pytest.mark.parametrize(
    ("fault", "culprit", "verdict"),
    [
        (behind, NODES * RANKS - 1, "rank_behind"),
        (mismatch, 300, "collective_mismatch"),
        (dead, 77, "process_dead"),
        (p2p, 130, "p2p_deadlock"),
    ],
)
def test_the_incremental_state_judges_as_the_state_rebuilt_and_the_single_engine(
    bench,  # noqa: ANN001
    fault: Fault,
    culprit: int,
    verdict: str,
) -> None:
    stall, nodes = evidence(bench, fault, culprit)
    incremental, rebuilt, folded, state = both_paths(stall, nodes)
    assert incremental == rebuilt
    assert take_snapshot(folded.state(), observed_at=stall.at) == take_snapshot(state, observed_at=stall.at)
    single = JobState()  # one process seeing every node's events, as ``ncclwatch analyze`` would
    for events in nodes.values():
        for event in events:
            single.apply(event)
    alone = classify(take_snapshot(single, observed_at=stall.at))
    assert incremental.finding.verdict.value == alone.finding.verdict.value == verdict
    assert incremental.finding.culprits == alone.finding.culprits


def test_a_node_asked_that_created_a_communicator_is_rebuilt_the_same(bench) -> None:  # noqa: ANN001
    """Node 1's compact evidence created the job's communicators (the first folded): its full evidence would make
    them with other member lists, so the state is rebuilt, and still equals ``job_state``'s."""
    stall, nodes = evidence(bench, mismatch, RANKS + 3)  # a rank of node 1
    incremental, rebuilt, folded, state = both_paths(stall, nodes)
    assert incremental == rebuilt and incremental.finding.culprits == (RANKS + 3,)
    assert take_snapshot(folded.state(), observed_at=stall.at) == take_snapshot(state, observed_at=stall.at)


def test_a_node_new_after_the_first_judgement_rebuilds(bench) -> None:  # noqa: ANN001
    """A node whose evidence comes after the leader's own state was unioned in is folded before it, as in
    ``job_state``."""
    stall, nodes = evidence(bench, behind, NODES * RANKS - 1)
    local, compact = leader_and_compact(stall, nodes)
    incremental = JobEvidence(local, stall)
    for node in list(compact)[:-1]:
        incremental.add(node, compact[node])
    incremental.judge()
    incremental.add(NODES - 1, compact[NODES - 1])
    expected = take_snapshot(job_state(local, compact, stall), observed_at=stall.at)
    assert take_snapshot(incremental.state(), observed_at=stall.at) == expected


def test_what_this_node_saw_after_the_first_judgement_is_in_the_second(bench) -> None:  # noqa: ANN001
    """The leader's own sources go on while it waits for full evidence: a new stack of one of its ranks (here: in
    its own code, not the collective) is judged as ``job_state`` would judge it then."""
    stall, nodes = evidence(bench, behind, NODES * RANKS - 1)
    local, compact = leader_and_compact(stall, nodes)
    incremental = folded_in(local, stall, compact)
    incremental.judge()
    local.apply(
        StackDump(
            pid=10_003,
            threads=[ThreadStack(name="MainThread", frames=["load (/opt/train/data.py:7)"])],
            cite=Citation(file="py-spy"),
        )
    )
    expected = take_snapshot(job_state(local, compact, stall), observed_at=stall.at)
    assert take_snapshot(incremental.state(), observed_at=stall.at) == expected
    assert expected.stacks[10_003].threads[0].frames == ["load (/opt/train/data.py:7)"]


def test_the_second_judgement_reads_again_only_the_asked_nodes_ranks(bench) -> None:  # noqa: ANN001
    """The asked node's full evidence says its rank caught up (its compact evidence was older): the verdict that named
    that rank flips, as ``job_state`` rebuilt judges it; the node's ranks are read again, every other node's keep the
    views of the first judgement."""
    stall, nodes = evidence(bench, behind, NODES * RANKS - 1)
    _, healed = evidence(bench, lambda events, rank: events, 0)  # the job's last rank issued as many as the others
    local, compact = leader_and_compact(stall, nodes)
    folded = folded_in(local, stall, compact)
    first = folded.snapshot()
    assert classify(first).finding.culprits == (NODES * RANKS - 1,)
    assert focus(classify(first), folded.nodes_of, set(), FULL_NODES) == [NODES - 1]

    full = shared(healed[NODES - 1], "full", stall, NODES - 1)
    folded.add(NODES - 1, full)
    second = folded.snapshot()
    rebuilt = take_snapshot(job_state(local, {**compact, NODES - 1: full}, stall), observed_at=stall.at)
    assert second == rebuilt
    assert classify(second) == classify(rebuilt)
    assert classify(second).finding.culprits != (NODES * RANKS - 1,)

    def views(snapshot):  # noqa: ANN001, ANN202
        return {(comm.key, view.comm_rank): view for comm in snapshot.comms for view in comm.ranks}

    asked = range((NODES - 1) * RANKS, NODES * RANKS)
    reused = {slot: view is views(first)[slot] for slot, view in views(second).items()}
    assert {slot for slot, same in reused.items() if not same} == {(key, r) for key, _ in reused for r in asked}


def test_a_malformed_line_of_one_node_is_set_aside_and_said_the_others_judged(bench) -> None:  # noqa: ANN001
    """Node 5's payload with its first Flight Recorder dump cut short (the leader reads each kind's lines together):
    that dump alone is set aside, with a note naming the node's line; its other dumps and every other node are folded,
    and the verdict is the job's, incrementally as rebuilt."""
    stall, nodes = evidence(bench, behind, NODES * RANKS - 1)
    meta, _, body = pack(5, "compact", stall.at, nodes[5]).partition(b"\n")
    lines = zlib.decompress(body).split(b"\n")
    cut = next(i for i, line in enumerate(lines) if line.startswith(b'{"event":"FrDump"'))
    lines[cut] = lines[cut][: len(lines[cut]) // 2]
    payload = unpack(meta + b"\n" + zlib.compress(b"\n".join(lines)), "node 5")
    assert payload is not None
    local, compact = leader_and_compact(stall, nodes, without=(5,))
    compact[5] = payload.events
    folded = folded_in(local, stall, compact)
    decision = folded.judge()
    assert decision == classify(take_snapshot(job_state(local, compact, stall), observed_at=stall.at))
    assert decision.finding.verdict.value == "rank_behind" and decision.finding.culprits == (NODES * RANKS - 1,)
    state = folded.state()
    assert f"node 5:{cut + 1}: journal line not understood (JSONDecodeError)" in state.notes
    assert [f"fr/{r}" in state.fr_dumps for r in range(5 * RANKS, 6 * RANKS)] == [False] + [True] * (RANKS - 1)
    assert len(state.fr_dumps) == (NODES - 1) * RANKS - 1  # every other node's (the leader's own: its sequences)
