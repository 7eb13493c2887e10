"""Point-to-point across nodes: the leader judges a pipeline from every node's shared evidence.

Each node reads its own ranks' NCCL logs and dumps; a pipeline's two stages
live on two nodes.  What one node shares (``payload``) must carry each
rank's sends and recvs per peer and its pending point-to-point ops, so that
the job-wide state (``judge.job_state``) reaches the same verdict whichever
node leads, and the verdict one node would reach alone (the other side looks
as if it never posted anything) is never the job's.
"""

from __future__ import annotations

from conftest import NOW
from harness import state_of
from nccl_lines import init, op

from ncclwatch.watchdog.cluster.judge import job_state
from ncclwatch.watchdog.cluster.payload import FR_ENTRIES_COMPACT, pack, shareable, unpack
from ncclwatch.watchdog.events import (
    Citation,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpState,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.journal import live_inputs

STALL = Stall(at=NOW, stalled_for_s=30.0, stall_timeout_s=10.0, progress_timeout_s=600.0)
ACT = 4096  # elements of each activation and gradient


def node_log(rank: int, ops: list[tuple[str, int]]) -> JobState:
    """One node reading its one rank's NCCL log: rank ``rank`` of a 2-rank communicator on host node<rank>."""
    text = init(rank, 2, f"0xc{rank}", host=f"node{rank}") + "".join(
        op(rank, name, ACT, f"0xc{rank}", root=peer, host=f"node{rank}") for name, peer in ops
    )
    return state_of({f"node{rank}/nccl.{rank}.log": text})


def through_the_store(state: JobState, node: int, without_p2p: bool = False) -> list:
    """What the leader reads of another node: its sequences shared, packed, compressed and unpacked."""
    tails = [t.model_copy(update={"sent": {}, "received": {}}) if without_p2p else t for t in state.sequence_tails(64)]
    events = [*live_inputs(state), *tails, *state.fr_dumps.values(), STALL]  # what a sidecar shares at a stall
    payload = unpack(pack(node, "compact", NOW, events), f"node {node}")
    assert payload is not None
    return payload.events


def judged_by(leader: int, states: dict[int, JobState], without_p2p: bool = False) -> Finding:
    remote = {node: through_the_store(state, node, without_p2p) for node, state in states.items() if node != leader}
    return job_finding(take_snapshot(job_state(states[leader], remote, STALL), observed_at=NOW))


def stage0(steps: int, last: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Stage 0 of a 2-stage pipeline: sends activations to rank 1, receives gradients from it, per step."""
    return [("Send", 1), ("Recv", 1)] * steps + last


def stage1(steps: int, last: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [("Recv", 0), ("Send", 0)] * steps + last


class TestPointToPointSequences:
    def test_both_stages_receiving_first_is_one_deadlock_naming_both_whichever_node_leads(self) -> None:
        states = {0: node_log(0, stage0(20, [("Recv", 1)])), 1: node_log(1, stage1(20, [("Recv", 0)]))}
        # What each leader judged when tails carried collectives only: the other side looked as if it never sent.
        blind = {leader: judged_by(leader, states, without_p2p=True) for leader in (0, 1)}
        assert [(blind[n].verdict, blind[n].culprits) for n in (0, 1)] == [
            (Verdict.rank_behind, (1,)),
            (Verdict.rank_behind, (0,)),
        ]
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1)), (leader, finding.summary)
            assert "rank 1 never posted Send #21 to rank 0" in finding.summary
            assert "rank 0 never posted Send #21 to rank 1" in finding.summary

    def test_a_missing_send_names_the_stage_that_never_sent_whichever_node_leads(self) -> None:
        # Step 21: rank 0 sends its activations and waits for the gradients; rank 1 received them and never sent back.
        states = {0: node_log(0, stage0(20, [("Send", 1), ("Recv", 1)])), 1: node_log(1, stage1(20, [("Recv", 0)]))}
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,)), (leader, finding.summary)
            assert "rank 1 never posted Send #21 to rank 0; rank 0 waits in its matching Recv" in finding.summary

    def test_a_healthy_pipeline_across_nodes_names_no_one(self) -> None:
        states = {0: node_log(0, stage0(30, [])), 1: node_log(1, stage1(30, []))}
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert finding.verdict not in (Verdict.rank_behind, Verdict.p2p_deadlock, Verdict.collective_mismatch), (
                finding.summary
            )
            assert finding.culprits == ()

    def test_compact_evidence_keeps_whole_counts_and_the_newest_ops_per_peer(self) -> None:
        state = node_log(1, stage1(30, [("Recv", 0)]))
        [tail] = [e for e in through_the_store(state, 1) if type(e).__name__ == "SequenceTail"]
        assert (tail.received[0].count, tail.sent[0].count) == (31, 30)  # type: ignore[attr-defined]
        assert len(tail.received[0].sigs) == len(tail.sent[0].sigs) == 8  # type: ignore[attr-defined]


def entry(
    index: int,
    op: str,
    state: OpState,
    peer: int | None = None,
    seq: int | None = None,
    p2p: int | None = None,
    line: int = 0,
) -> FrEntry:
    return FrEntry(
        index=index,
        pg_id="0",
        collective_seq_id=seq,
        p2p_seq_id=p2p,
        profiling_name=f"nccl:{op.lower()}",
        op=op,
        is_p2p=peer is not None or op == "Coalesced",
        peer=peer,
        input_sizes=[[ACT]],
        input_dtypes=["Float"],
        state=state,
        frames=[FrFrame(name="pipeline_step", filename="pipeline_job.py", line=line)] if line else [],
    )


def dump(rank: int, entries: list[FrEntry]) -> JobState:
    state = JobState()
    state.apply(
        FrDump(
            rank=rank,
            version="2.10",
            process_groups={"0": FrProcessGroup(pg_id="0", ranks=[0, 1])},
            entries=entries,
            cite=Citation(file=f"node{rank}/fr/ncclwatch_trace_{rank}"),
        )
    )
    return state


def pipeline_entries(peer: int, first_pending: list[tuple[str, OpState, int]], collectives_after: int) -> list[FrEntry]:
    """10 completed steps (a coalesced send/recv pair and an all_reduce each), then ``first_pending`` ops issued
    alone, then ``collectives_after`` all_reduces the host enqueued behind them (NCCL returns at once)."""
    entries: list[FrEntry] = []
    for step in range(10):
        entries += [
            entry(len(entries), "Send", OpState.scheduled, peer, p2p=step + 1),
            entry(len(entries) + 1, "Recv", OpState.scheduled, peer, p2p=step + 1),
            entry(len(entries) + 2, "Coalesced", OpState.completed, p2p=step + 1),
            entry(len(entries) + 3, "AllReduce", OpState.completed, seq=step + 1),
        ]
    for n, (kind, state, line) in enumerate(first_pending):
        entries.append(entry(len(entries), kind, state, peer, p2p=11 + n, line=line))
    for n in range(collectives_after):
        entries.append(entry(len(entries), "AllReduce", OpState.scheduled, seq=11 + n))
    return entries


class TestPendingPointToPoint:
    def test_a_pending_recv_older_than_the_newest_entries_still_travels_with_its_call_site(self) -> None:
        states = {
            r: dump(
                r, pipeline_entries(1 - r, [("Recv", OpState.started, 40 + r), ("Send", OpState.scheduled, 41 + r)], 12)
            )
            for r in (0, 1)
        }
        [shared] = shareable(states[1].fr_dumps.values(), "compact")
        assert len(shared.entries) > FR_ENTRIES_COMPACT and shared.entries[0].op == "Recv"  # type: ignore[attr-defined]
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1)), (leader, finding.summary)
            assert "called from pipeline_step (pipeline_job.py:41)" in finding.summary  # rank 1's recv, from node 1

    def test_coalesced_ops_left_scheduled_never_travel_without_their_marker(self) -> None:
        """A healthy pipeline's batched send/recv stay 'scheduled' forever; shared alone they would read as pending."""
        states = {r: dump(r, pipeline_entries(1 - r, [], 12)) for r in (0, 1)}
        [shared] = shareable(states[0].fr_dumps.values(), "compact")
        ops = [e.op for e in shared.entries]  # type: ignore[attr-defined]
        # back to the oldest pending all_reduce (#11) and two before it: the last step's marker, no send or recv
        assert ops == ["Coalesced", "AllReduce", *["AllReduce"] * 12] and len(ops) > FR_ENTRIES_COMPACT
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert finding.verdict is not Verdict.p2p_deadlock and finding.culprits == (), finding.summary

    def test_one_side_waiting_in_a_recv_is_no_deadlock(self) -> None:
        """Rank 0 waits for a gradient; rank 1 has nothing pending with it: not a cycle of recvs."""
        states = {
            0: dump(0, pipeline_entries(1, [("Recv", OpState.started, 40)], 12)),
            1: dump(1, pipeline_entries(0, [], 12)),
        }
        for leader in (0, 1):
            assert judged_by(leader, states).verdict is not Verdict.p2p_deadlock


def gloo_node(rank: int, collectives: int, call: str, world: int = 2) -> JobState:
    """A node of a gloo job: one rank, its dump (collectives only: gloo records no send/recv), its worker and
    where py-spy found it (``call`` in torch.distributed, from the pipeline's own code)."""
    state = dump(
        rank,
        [
            entry(i, "AllReduce", OpState.completed if i < 30 else OpState.started, seq=i + 1)
            for i in range(collectives)
        ],
    )
    frames = [f"{call} (torch/distributed/distributed_c10d.py:2799)", f"exchange (pipeline_job.py:{80 + rank})"]
    state.apply(
        WorkerSeen(pid=1000 + rank, rank=rank, world_size=world, host=f"node{rank}", at=NOW - 60, node_rank=rank)
    )
    state.apply(
        StackDump(
            pid=1000 + rank, threads=[ThreadStack(name="MainThread", frames=frames)], cite=Citation(file="py-spy")
        )
    )
    state.apply(STALL)
    return state


def decided_by(leader: int, states: dict[int, JobState]) -> Finding:
    remote = {node: through_the_store(state, node) for node, state in states.items() if node != leader}
    return classify(take_snapshot(job_state(states[leader], remote, STALL), observed_at=NOW)).finding


class TestWaitsSeenInStacks:
    def test_a_stage_behind_that_waits_in_recv_waits_for_the_stage_that_never_sent(self) -> None:
        states = {0: gloo_node(0, 30, "recv"), 1: gloo_node(1, 31, "all_reduce")}
        for leader in (0, 1):
            finding = decided_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,)), (leader, finding.summary)
            assert finding.summary.startswith(
                "Rank 1 never posted the send that rank 0 waits for in recv (called from "
                "exchange (pipeline_job.py:80)): it went on to AllReduce"
            )
            assert {(r.rank, r.status) for r in finding.rows} == {(0, "waiting"), (1, "culprit")}

    def test_a_rank_behind_outside_any_send_or_recv_stays_the_culprit(self) -> None:
        states = {0: gloo_node(0, 30, "all_gather"), 1: gloo_node(1, 31, "all_reduce")}
        for leader in (0, 1):
            finding = decided_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (0,)), finding.summary

    def test_with_two_ranks_ahead_no_peer_is_guessed(self) -> None:
        states = {
            0: gloo_node(0, 30, "recv", world=3),
            1: gloo_node(1, 31, "all_reduce", world=3),
            2: gloo_node(2, 31, "all_reduce", world=3),
        }
        finding = decided_by(0, states)
        assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (0,)), finding.summary


def with_dump(state: JobState, rank: int, entries: list[FrEntry]) -> JobState:
    """The same node's rank also dumped its Flight Recorder (NCCL: logs and dumps side by side)."""
    state.apply(dump(rank, entries).fr_dumps[f"node{rank}/fr/ncclwatch_trace_{rank}"])
    return state


class TestCountsAndPendingOpsTogether:
    """On NCCL both hosts go on enqueueing past a hung recv: Flight Recorder's first pending ops are recvs on both
    sides whether one stage never sent or both received first; NCCL's counts tell the two apart."""

    cycle = staticmethod(lambda rank: pipeline_entries(1 - rank, [("Recv", OpState.started, 40 + rank)], 12))

    def test_one_direction_short_of_a_send_names_the_stage_that_never_sent(self) -> None:
        states = {
            0: with_dump(node_log(0, stage0(20, [("Send", 1), ("Recv", 1), ("Send", 1)])), 0, self.cycle(0)),
            1: with_dump(node_log(1, stage1(20, [("Recv", 0), ("Recv", 0)])), 1, self.cycle(1)),
        }
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,)), (leader, finding.summary)
            assert "rank 1 never posted Send #21 to rank 0" in finding.summary

    def test_even_counts_leave_the_cycle_a_deadlock_naming_both(self) -> None:
        states = {
            0: with_dump(node_log(0, stage0(20, [("Recv", 1), ("Send", 1)])), 0, self.cycle(0)),
            1: with_dump(node_log(1, stage1(20, [("Recv", 0), ("Send", 0)])), 1, self.cycle(1)),
        }
        for leader in (0, 1):
            finding = judged_by(leader, states)
            assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, (0, 1)), (leader, finding.summary)
