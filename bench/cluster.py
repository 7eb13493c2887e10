"""What the multi-node exchange costs: bytes per sidecar per second in steady state, and the leader's work at a hang.

Runs N simulated sidecars (one asyncio client each) against a real torch
TCPStore on loopback, as in a job of N nodes x R ranks:

- steady state: every sidecar publishes its summary and reads the others'
  once per ``PUBLISH_S``; bytes are counted at each client's socket;
- at a hang: every node shares its evidence (R ranks' workers, /proc samples,
  stacks, Flight Recorder dumps trimmed as the sidecar trims them, NCCL-log
  tails), the leader gathers all of it and judges the whole job with the
  engine; wall and CPU time of that are measured.

    python bench/cluster.py --nodes 64 --ranks 8 [--rounds 20] [--out bench/results/cluster.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ncclwatch.watchdog.cluster.judge import job_state
from ncclwatch.watchdog.cluster.peers import PUBLISH_S, TAIL_SHARED, Cluster, Membership, NodeSummary, encode, shareable
from ncclwatch.watchdog.engine.classify import judge
from ncclwatch.watchdog.engine.snapshot import take_snapshot
from ncclwatch.watchdog.engine.state import JobState
from ncclwatch.watchdog.events import (
    Citation,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpSig,
    OpState,
    ProcessState,
    SequenceTail,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)

NOW = time.time()


def node_evidence(node: int, ranks: int, world: int, behind_rank: int) -> list:
    """One node's evidence at a hang: rank ``behind_rank`` issued one collective fewer."""
    events: list = []
    group = {"0": FrProcessGroup(pg_id="0", ranks=list(range(world)))}
    for local in range(ranks):
        rank = node * ranks + local
        pid = 10_000 + rank
        events.append(WorkerSeen(pid=pid, rank=rank, local_rank=local, world_size=world, host=f"node{node}", at=NOW - 600, node_rank=node))
        events += [ProcessState(pid=pid, rank=rank, state="S", cpu_seconds=1.0, at=NOW - 4 + i * 0.5) for i in range(8)]
        frames = [f"frame{i} (/opt/train/model.py:{100 + i})" for i in range(20)]
        events.append(StackDump(pid=pid, threads=[ThreadStack(name="MainThread", frames=frames)], cite=Citation(file="py-spy")))
        total = 2000 - (rank == behind_rank)
        entries = [
            FrEntry(index=i, pg_id="0", collective_seq_id=total - 2000 + i + 1, profiling_name="nccl:all_reduce", op="AllReduce",
                    is_p2p=False, input_sizes=[[1 << 20]], input_dtypes=["BFloat16"],
                    state=OpState.completed if i < 1999 else OpState.started,
                    frames=[FrFrame(name="step", filename="/opt/train/loop.py", line=42)] * 12)  # fmt: skip
            for i in range(2000)
        ]
        events.append(FrDump(rank=rank, version="2.10", process_groups=group, entries=entries, cite=Citation(file=f"fr/{rank}")))
        sig = OpSig("AllReduce", 1 << 20, "9", "0", 0)
        events.append(SequenceTail(comm_key="nccl:0xabc", label="commId 0xabc", nranks=world, comm_rank=rank, global_rank=rank,
                                   host=f"node{node}", pid=pid, base=total - TAIL_SHARED, sigs=[sig] * TAIL_SHARED))  # fmt: skip
    return shareable(events)


async def steady(port: int, nodes: int, ranks: int, rounds: int) -> dict:
    clusters = [Cluster(Membership("127.0.0.1", port, "bench", 0, n, nodes), f"node{n}") for n in range(nodes)]

    def summary(c: Cluster) -> NodeSummary:
        return NodeSummary(node=c.me, host=c.host, at=time.time(), ranks=list(range(c.me * ranks, (c.me + 1) * ranks)),
                           last_progress=time.time(), phase="watching", world_size=nodes * ranks)  # fmt: skip

    for c in clusters:  # sidecars join over the job's first seconds, not in one instant (one process here: one backlog)
        await c.exchange(summary(c))
        c.client.sent_bytes = c.client.received_bytes = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(c.exchange(summary(c)) for c in clusters))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    per_round = [(c.client.sent_bytes + c.client.received_bytes) / rounds for c in clusters]
    for c in clusters:
        await c.client.close()
    return {
        "bytes_per_sidecar_per_s": round(max(per_round) / PUBLISH_S, 1),
        "sent_per_round_bytes": round(max(c.client.sent_bytes for c in clusters) / rounds, 1),
        "received_per_round_bytes": round(max(c.client.received_bytes for c in clusters) / rounds, 1),
        "cpu_per_sidecar_per_round_ms": round(1000 * cpu / rounds / nodes, 3),
        "cpu_share_of_a_core": round(cpu / rounds / nodes / PUBLISH_S, 5),
        "wall_per_round_all_nodes_s": round(wall / rounds, 4),
    }


async def at_hang(port: int, nodes: int, ranks: int) -> dict:
    world = nodes * ranks
    clusters = [Cluster(Membership("127.0.0.1", port, "bench-hang", 0, n, nodes), f"node{n}", clock=lambda: NOW) for n in range(nodes)]
    payloads = [node_evidence(n, ranks, world, behind_rank=world - 1) for n in range(nodes)]
    size = len(encode(payloads[-1]))
    for c, events in zip(clusters[1:], payloads[1:]):
        await c.share_evidence(events, stall_at=NOW)
    leader = clusters[0]
    for c in clusters[1:]:  # the leader has read everyone's summary
        leader.summaries[c.me] = NodeSummary(node=c.me, host=c.host, at=NOW, ranks=[], last_progress=NOW, phase="suspect")
    local = JobState()
    for event in payloads[0]:
        local.apply(event)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    remote = await leader.gather_evidence(since=NOW - 60)
    gathered = time.perf_counter() - wall0
    stall = Stall(at=NOW, stalled_for_s=10, stall_timeout_s=5, progress_timeout_s=1800)
    decision = judge(take_snapshot(job_state(local, remote, stall), observed_at=NOW))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for c in clusters:
        await c.client.close()
    return {
        "evidence_bytes_per_node": size,
        "leader_gather_s": round(gathered, 3),
        "leader_gather_and_judge_wall_s": round(wall, 3),
        "leader_gather_and_judge_cpu_s": round(cpu, 3),
        "verdict": decision.finding.verdict.value,
        "culprits": list(decision.finding.culprits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    result = {
        "nodes": args.nodes, "ranks_per_node": args.ranks, "publish_s": PUBLISH_S, "machine": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "steady": asyncio.run(steady(store.port, args.nodes, args.ranks, args.rounds)),
        "at_hang": asyncio.run(at_hang(store.port, args.nodes, args.ranks)),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
