"""The performance look across nodes: each node shares its ranks' newest collectives, the leader judges the job.

Two nodes, two ranks each (ranks 0, 1 on node0; 2, 3 on node1), in process
groups that span both: no node alone sees a whole group, so each node alone
finds nothing, and the leader, with the other node's record, names the
straggler or the slow link on node1 with its host and links.
"""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
from conftest import NOW
from support import torch_store_server

from ncclwatch.watchdog.cluster.peers import Cluster, Membership, NodeSummary
from ncclwatch.watchdog.cluster.perf_records import ENTRIES_SHARED, PerfRecord, perf_record
from ncclwatch.watchdog.cluster.perf_sharing import PerfSharing
from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState, ProcKey, RankTransport
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.live.performance_look import JobLook, PerfWatch, job_health
from ncclwatch.watchdog.parsing.transport import parse_transport
from ncclwatch.watchdog.slowness.bandwidth import RankEntry, rank_entries
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.slowness.links import transport_anomalies

MiB = 1 << 20
INTERVAL = 60.0
NODES = {0: (0, 1), 1: (2, 3)}  # node -> its ranks
HOSTS = {rank: f"node{node}" for node, ranks in NODES.items() for rank in ranks}
LINKS = {0: ("mlx5_0/1",), 1: ("mlx5_1/1",), 2: ("mlx5_0/1",), 3: ("mlx5_1/1",)}
STEP_NS = 200_000_000


def dumps(node: int, steps: int, *, late_rank: int | None = None) -> list[FrDump]:
    """This node's ranks' dumps of a job whose default group spans both nodes: per step a 64 MiB all-reduce
    (``late_rank`` enters it 60 ms after the others, whose kernels spin until its own joins) and a loss all-reduce
    all enter together."""
    groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1, 2, 3])}
    out = []
    for rank in NODES[node]:
        entries = []
        for step in range(steps):
            start = int(NOW * 1e9) + step * STEP_NS + rank * 100_000
            late = 60_000_000 if rank == late_rank else 0
            waits = (
                60.0 if late_rank is not None and rank != late_rank else 0.0
            )  # ms its gradient all-reduce kernel waited
            for offset, (numel, at) in enumerate(((16 * MiB, start + late), (256, start + 65_000_000))):
                entries.append(
                    FrEntry(
                        index=len(entries),
                        pg_id="0",
                        collective_seq_id=2 * step + offset + 1,
                        profiling_name="nccl:all_reduce",
                        op="AllReduce",
                        is_p2p=False,
                        input_sizes=[[numel]],
                        output_sizes=[[numel]],
                        input_dtypes=["Float"],
                        output_dtypes=["Float"],
                        state=OpState.completed,
                        time_created_ns=at,
                        duration_ms=2.0 + (waits if offset == 0 else 0.0),
                    )
                )
        out.append(
            FrDump(rank=rank, version="2.10", process_groups=groups, entries=entries, cite=Citation(file=f"fr_{rank}"))
        )
    return out


def node_view(node: int) -> tuple[dict[int, str], dict[int, tuple[str, ...]]]:
    return {r: HOSTS[r] for r in NODES[node]}, {r: LINKS[r] for r in NODES[node]}


def record(node: int, entries: list[RankEntry], at: float = NOW) -> PerfRecord:
    hosts, links = node_view(node)
    shared = perf_record(node, f"node{node}", at, entries, descs={"0": "default_pg"}, hosts=hosts, links=links)
    return PerfRecord.model_validate_json(shared.model_dump_json())  # as the leader reads it


def judged(node0: list[RankEntry], node1: list[RankEntry] | None):  # type: ignore[no-untyped-def]
    hosts, links = node_view(0)
    others = [record(1, node1)] if node1 is not None else []
    return job_health(node0, {"0": "default_pg"}, hosts, links, others, now=NOW + INTERVAL)


class TestMerge:
    def test_a_straggler_on_the_other_node_is_named_with_its_host_and_links(self) -> None:
        node0, node1 = rank_entries(dumps(0, 40, late_rank=3)), rank_entries(dumps(1, 40, late_rank=3))
        assert judged(node0, None).perf_findings == ()  # alone: the group is seen in part
        health = judged(node0, node1)
        (late,) = health.perf_findings
        assert (late.kind, late.ranks, late.hosts, late.links) == (PerfKind.straggler, (3,), ("node1",), ("mlx5_1/1",))
        assert "rank 3 (node1) was last in 20 of the last 20 collectives" in late.summary
        assert sorted(p.rank for p in health.rank_perf) == [0, 1, 2, 3]
        (comm,) = health.comm_bandwidth
        assert comm.communicator == "process group 0 (default_pg)"

    def test_a_slow_link_whose_ranks_are_on_the_other_node(self) -> None:
        """Replicas 0-2, 1-3 and 0-3: the two through rank 3's NIC run at a tenth of the speed."""
        groups = {"A": (0, 2), "B": (1, 3), "C": (0, 3)}
        entries = [
            RankEntry(
                rank=rank,
                pg=pg,
                seq=seq,
                op="AllReduce",
                created_ns=int(NOW * 1e9) + seq * STEP_NS,
                state=OpState.completed,
                nbytes=64 * MiB,
                nranks=2,
                duration_ms=20.0 if 3 in ranks else 2.0,
            )
            for pg, ranks in groups.items()
            for rank in ranks
            for seq in range(1, 9)
        ]
        node0 = [e for e in entries if e.rank in NODES[0]]
        assert judged(node0, None).perf_findings == ()
        (slow,) = judged(node0, [e for e in entries if e.rank in NODES[1]]).perf_findings
        assert (slow.kind, slow.ranks, slow.hosts, slow.links) == (PerfKind.slow_link, (3,), ("node1",), ("mlx5_1/1",))
        assert slow.communicator == "B,C"

    def test_eight_ranks_share_their_newest_entries_in_a_small_record(self) -> None:
        groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(range(8)))}
        eight = [
            d.model_copy(update={"rank": r, "process_groups": groups}) for r in range(8) for d in dumps(0, 100)[:1]
        ]
        shared = record(0, rank_entries(eight))
        rows = shared.groups["0"].ranks
        assert sorted(rows) == list(range(8)) and {len(r) for r in rows.values()} == {ENTRIES_SHARED}
        assert rows[0][-1][0] == 200  # the newest
        assert len(shared.model_dump_json()) < 40_000


@pytest.fixture
def torch_store():  # type: ignore[no-untyped-def]
    pytest.importorskip("torch.distributed")
    return torch_store_server()


class ScriptedDumps:
    def __init__(self, node: int) -> None:
        self.node = node

    async def __call__(self, ranks) -> list[FrDump]:  # type: ignore[no-untyped-def]
        return dumps(self.node, 40, late_rank=3)


def nccl_choices(node: int, network: str) -> list[RankTransport]:
    """What NCCL's init lines say on ``node``: each of its ranks on ``network``, in a 4-rank communicator."""
    lines = []
    for rank in NODES[node]:
        prefix = f"node{node}:{100 + rank}:{100 + rank} [0] NCCL INFO "
        lines += [
            prefix + f"Using network {network}",
            prefix + f"comm 0x{rank}a rank {rank} nRanks 4 nNodes 2 localRanks 2 localRank {rank % 2} MNNVL 0",
        ]
    return parse_transport("\n".join(lines) + "\n")


def two_node_looks(torch_store, networks: dict[int, str]) -> tuple[dict[int, list], dict[int, PerfWatch]]:  # type: ignore[no-untyped-def,type-arg]
    """Two looks in a row on both nodes, sharing through the real store; what each node told, and its watch."""

    def workers(node: int) -> list[WorkerView]:
        return [
            WorkerView(
                rank=r,
                pid=100 + r,
                local_rank=None,
                world_size=4,
                host=f"node{node}",
                state="S",
                cpu_share=None,
                io_rate=None,
                step=None,
                gone=False,
            )
            for r in NODES[node]
        ]

    async def run() -> tuple:  # type: ignore[type-arg]
        clusters = {
            n: Cluster(Membership("127.0.0.1", torch_store.port, "job", 0, n, 2), f"node{n}", clock=lambda: NOW + 200)
            for n in NODES
        }
        watches = {
            n: PerfWatch(interval=INTERVAL, dumps=ScriptedDumps(n), transport=partial(nccl_choices, n, networks[n]))
            for n in NODES
        }
        summaries = {
            n: NodeSummary(
                node=n,
                host=f"node{n}",
                at=NOW + 200,
                ranks=list(NODES[n]),
                last_progress=NOW,
                phase="watching",
                started_at=NOW + n * 1.3,
            )
            for n in NODES
        }
        for n in (0, 1, 0):
            await clusters[n].exchange(summaries[n])
        # Whichever node pages a finding keys it on the job's start, the same on both.
        assert {clusters[n].job_started_at(summaries[n].started_at) for n in NODES} == {NOW}  # type: ignore[arg-type]
        told: dict[int, list] = {0: [], 1: []}  # type: ignore[type-arg]
        sharing = {n: PerfSharing(clusters[n]) for n in NODES}
        for look in (NOW + 120.4, NOW + 180.4):  # two looks in a row make a straggler; node1 looks first
            for n in (1, 0):
                job = JobLook(n, partial(sharing[n].exchange, interval=INTERVAL))
                global_ranks = {ProcKey(f"node{n}", 100 + r): r for r in NODES[n]}
                told[n] += await watches[n].look(workers(n), global_ranks, f"node{n}", look + n * 0.3, job)
        for cluster in clusters.values():
            await cluster.client.close()
        return told, watches

    return asyncio.run(run())


def test_two_nodes_share_their_looks_through_a_real_store_and_the_leader_names_the_straggler(torch_store) -> None:  # type: ignore[no-untyped-def]
    told, watches = two_node_looks(torch_store, {0: "IB", 1: "IB"})
    assert told[1] == [] and watches[1].health.perf_findings == ()  # a member tells only its node's ports
    (late,) = told[0]
    assert (late.ranks, late.hosts) == ((3,), ("node1",))
    assert [p.rank for p in watches[0].health.rank_perf if p.straggler] == [3]
    assert watches[0]._next_look == watches[1]._next_look  # both look again at the same moment


def test_the_leader_compares_transports_across_nodes(torch_store) -> None:  # type: ignore[no-untyped-def]
    """node1 fell back to sockets: alone it sees two ranks that agree; the leader, with node1's record, names it."""
    assert transport_anomalies(nccl_choices(1, "Socket")) == []
    told, _ = two_node_looks(torch_store, {0: "IB", 1: "Socket"})
    assert told[1] == []
    (fallback,) = [f for f in told[0] if f.kind is PerfKind.transport_anomaly]
    assert (fallback.ranks, fallback.hosts) == ((2, 3), ("node1",))
    assert "uses network Socket while the other nodes use IB" in fallback.summary
