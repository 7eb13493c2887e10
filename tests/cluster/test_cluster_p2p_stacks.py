"""Pipeline x data parallel on gloo across any number of nodes: who waits in ``recv`` decides, job-wide.

Two pipeline stages, ``dp`` replicas, stage ``s`` on ranks ``s*dp ..``, spread
over the nodes; replica 1's two stages both call ``recv`` first (they wait for
each other) while every other rank has finished the step and waits in the
gradient all-reduce, over every rank or over its stage's ranks.  gloo's
Flight Recorder records no send/recv, so each node shares its ranks'
collectives, processes and stacks (``payload``), and the leader judges the
job (``judge.job_state``).  One communicator's rows show only its members: a
stage's all-reduce holds one waiting rank and the ranks ahead of it, which
read as "the only rank ahead never sent" (``rank_behind`` naming an innocent
rank), and the all-reduce over every rank held both waiting ranks "behind".
Over the whole job, two ranks wait in ``recv`` and several wait for them in
collectives: a ``p2p_deadlock`` of the two, whichever node leads.
"""

from __future__ import annotations

import pytest
from conftest import NOW
from test_cluster_p2p import STALL, decided_by, entry

from ncclwatch.watchdog.events import Citation, FrDump, FrProcessGroup, OpState, StackDump, ThreadStack, WorkerSeen
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict

STEPS = 30  # completed steps: one gradient all-reduce each
# where py-spy found the ranks of the real job (tests/e2e/test_e2e_pipeline_schedule.py), torch 2.13 gloo
IN_RECV = ["recv (torch/distributed/distributed_c10d.py:2799)", "both_recv (pipeline_schedule_job.py:71)"]
IN_ALL_REDUCE = ["all_reduce (torch/distributed/distributed_c10d.py:3252)", "main (pipeline_schedule_job.py:118)"]


def deadlocked_pair(dp: int) -> tuple[int, int]:
    """Replica 1's stage 0 and stage 1 ranks (stage 1 in snake order, as ``pipeline_schedule_job.py`` lays them)."""
    return 1, dp + dp - 1 - 1


def rank_events(rank: int, node: int, world: int, dp: int, grad_group: str, waiting: bool) -> list:
    """One rank's dump, worker and stack: in ``recv`` after STEPS all-reduces, or in the next one's all-reduce."""
    members = list(range(world)) if grad_group == "world" else list(range(rank // dp * dp, rank // dp * dp + dp))
    pg = "0" if grad_group == "world" else str(1 + rank // dp)
    entries = [entry(i, "AllReduce", OpState.completed, seq=i + 1) for i in range(STEPS)]
    if not waiting:
        entries.append(entry(STEPS, "AllReduce", OpState.started, seq=STEPS + 1))
    entries = [e.model_copy(update={"pg_id": pg}) for e in entries]
    main_thread = ThreadStack(name="MainThread", frames=IN_RECV if waiting else IN_ALL_REDUCE)
    return [
        FrDump(
            rank=rank,
            version="2.10",
            process_groups={pg: FrProcessGroup(pg_id=pg, ranks=members)},
            entries=entries,
            cite=Citation(file=f"node{node}/fr/ncclwatch_trace_{rank}"),
        ),
        WorkerSeen(pid=1000 + rank, rank=rank, world_size=world, host=f"node{node}", at=NOW - 60, node_rank=node),
        StackDump(pid=1000 + rank, threads=[main_thread], cite=Citation(file="py-spy")),
    ]


def nodes_of_job(nodes: int, dp: int, grad_group: str) -> dict[int, JobState]:
    world = 2 * dp
    per_node = world // nodes
    pair = deadlocked_pair(dp)
    states = {node: JobState() for node in range(nodes)}
    for rank in range(world):
        for event in rank_events(rank, rank // per_node, world, dp, grad_group, waiting=rank in pair):
            states[rank // per_node].apply(event)
    for state in states.values():
        state.apply(STALL)
    return states


@pytest.mark.parametrize("grad_group", ["world", "stage"])
@pytest.mark.parametrize(("nodes", "dp"), [(2, 2), (4, 2), (4, 4), (8, 4)])
def test_two_stages_receiving_first_are_a_p2p_deadlock_whichever_node_leads(
    nodes: int, dp: int, grad_group: str
) -> None:
    states = nodes_of_job(nodes, dp, grad_group)
    pair = deadlocked_pair(dp)
    for leader in states:
        finding = decided_by(leader, states)
        assert (finding.verdict, finding.culprits) == (Verdict.p2p_deadlock, pair), (leader, finding.summary)
        assert f"rank {pair[0]}, {pair[1]} all wait in recv, called from both_recv" in finding.summary
        assert {r.rank for r in finding.rows if r.status == "culprit"} == set(pair)  # rows every node's bundle shows


def test_one_rank_in_recv_with_several_ranks_ahead_stays_behind() -> None:
    """Who owes rank 1 its send is not known and no cycle is possible with one waiting rank."""
    states = nodes_of_job(2, 2, "world")
    states[1] = JobState()
    for rank in (2, 3):  # rank 2 finished the step too: it waits in the all-reduce, not in recv
        for event in rank_events(rank, 1, 4, 2, "world", waiting=False):
            states[1].apply(event)
    states[1].apply(STALL)
    finding = decided_by(0, states)
    assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,)), finding.summary
