"""The sidecars' meeting place: torch's own TCPStore spoken from pure Python, the leader rule, the job-wide verdict."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from conftest import NOW

from ncclwatch.watchdog.cluster.judge import degraded, incident_key, job_state, with_lost_nodes
from ncclwatch.watchdog.cluster.peers import (
    FR_ENTRIES_SHARED,
    FR_FRAMES_SHARED,
    LOST_AFTER_S,
    Cluster,
    Membership,
    NodeSummary,
    encode,
    leader_of,
    shareable,
)
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.engine.classify import Decision
from ncclwatch.watchdog.engine.detectors import Finding, Verdict
from ncclwatch.watchdog.engine.state import JobState
from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrFrame, OpState, Stall, Unusable, WorkerSeen
from ncclwatch.watchdog.parsing.journal import parse_journal

dist = pytest.importorskip("torch.distributed")


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def torch_store(request):  # type: ignore[no-untyped-def]
    """A real torch TCPStore server, both of its backends."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=request.param, timeout=timedelta(seconds=5))


class TestStoreClient:
    def test_keys_mean_the_same_from_torch_and_from_us(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        torch_store.set("from-torch", b"hello")

        async def talk() -> tuple:  # type: ignore[type-arg]
            client = StoreClient("127.0.0.1", torch_store.port)
            got = await client.get("from-torch"), await client.get("nobody-set-this")
            await client.set("from-us", b"\x00binary\xff" * 100)
            counts = await client.add("counter", 5), await client.add("counter", 2)
            await client.close()
            return got, counts

        (theirs, missing), counts = asyncio.run(talk())
        assert (theirs, missing) == (b"hello", None)  # a missing key never blocks
        assert torch_store.get("from-us") == b"\x00binary\xff" * 100
        assert counts == (5, 7) and torch_store.add("counter", 0) == 7

    def test_unreachable_store_is_an_error_not_an_empty_store(self) -> None:
        from test_sinks_webhooks import free_port

        async def talk() -> None:
            await StoreClient("127.0.0.1", free_port(), timeout_s=1.0).get("x")

        with pytest.raises(StoreError):
            asyncio.run(talk())


def summary(node: int, at: float, ranks: list[int]) -> NodeSummary:
    return NodeSummary(node=node, host=f"node{node}", at=at, ranks=ranks, last_progress=at - 1, phase="watching")


class TestMembership:
    def test_every_node_computes_the_same_round_from_torchruns_variables(self) -> None:
        state = JobState()
        state.apply(WorkerSeen(pid=10, rank=2, host="b", at=NOW, restart_count=1, node_rank=1, nnodes=2, store="10.0.0.1:29500", run_id="none"))
        membership = Membership.of(state)
        assert membership == Membership("10.0.0.1", 29500, "none", 1, 1, 2)
        assert membership.prefix == "ncclwatch/none/1/" and membership.job_key == "10.0.0.1:29500/1"

    def test_a_single_node_job_has_no_cluster(self) -> None:
        state = JobState()
        state.apply(WorkerSeen(pid=10, rank=0, host="a", at=NOW, node_rank=0, nnodes=1, store="127.0.0.1:29500"))
        assert Membership.of(state) is None


class TestLeader:
    def test_lowest_fresh_node_leads(self) -> None:
        assert leader_of({0: summary(0, NOW, [0]), 2: summary(2, NOW, [2])}, me=1, now=NOW + 1) == 0

    def test_a_lost_leader_hands_over_to_the_next_node(self) -> None:
        stale = summary(0, NOW - LOST_AFTER_S - 1, [0, 1])
        assert leader_of({0: stale, 2: summary(2, NOW, [4])}, me=1, now=NOW) == 1


def entry(index: int, seq: int) -> FrEntry:
    return FrEntry(
        index=index, pg_id="0", collective_seq_id=seq, profiling_name="nccl:all_reduce", op="AllReduce", is_p2p=False,
        state=OpState.completed, frames=[FrFrame(name="step", filename="train.py", line=seq)],
    )  # fmt: skip


class TestSharing:
    def test_dumps_travel_trimmed_to_their_newest_entries_and_stacks(self) -> None:
        dump = FrDump(rank=3, version="2.10", process_groups={}, entries=[entry(i, i + 1) for i in range(500)], cite=Citation(file="d"))
        noise = Unusable(reason="py-spy denied", cite=Citation(file="p"))
        [shared] = shareable([dump, noise])
        assert [e.collective_seq_id for e in shared.entries] == list(range(501 - FR_ENTRIES_SHARED, 501))
        assert sum(bool(e.frames) for e in shared.entries) == FR_FRAMES_SHARED
        assert len(encode([shared])) < 40_000
        [back] = parse_journal(encode([shared]), "node 1")
        assert back == shared

    def test_sidecars_exchange_summaries_and_evidence_through_a_real_store(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        def cluster(node: int) -> Cluster:
            return Cluster(Membership("127.0.0.1", torch_store.port, "job", 0, node, 2), f"node{node}", clock=lambda: NOW)

        async def talk():  # type: ignore[no-untyped-def]
            zero, one = cluster(0), cluster(1)
            await zero.exchange(summary(0, NOW, [0, 1]))
            await one.exchange(summary(1, NOW, [2, 3]))
            await zero.exchange(summary(0, NOW, [0, 1]))
            stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
            await one.share_evidence([stall], stall_at=NOW)
            return zero.summaries, one.summaries, await zero.gather_evidence(since=NOW - 10), zero.leader(), one.leader()

        zeros, ones, evidence, leader0, leader1 = asyncio.run(talk())
        assert zeros[1].ranks == [2, 3] and ones[0].ranks == [0, 1]
        assert [type(e).__name__ for e in evidence[1]] == ["Stall"]
        assert leader0 == leader1 == 0


def decision(verdict: Verdict, culprits: tuple[int, ...] = (), **kw) -> Decision:  # type: ignore[no-untyped-def]
    return Decision(Finding(verdict, "engine says", culprits=culprits, **kw), page=verdict != Verdict.inconclusive)


class TestJobWideVerdict:
    def test_a_silent_node_is_node_lost_naming_its_ranks(self) -> None:
        lost = with_lost_nodes(decision(Verdict.inconclusive), {1: summary(1, NOW - 20, [2, 3])}, remote={})
        assert lost.page and lost.finding.verdict == Verdict.node_lost and lost.finding.culprits == (2, 3)
        assert "node1" in lost.finding.summary

    def test_a_culprit_named_elsewhere_stands(self) -> None:
        named = decision(Verdict.rank_behind, (0,))
        assert with_lost_nodes(named, {1: summary(1, NOW - 20, [2, 3])}, remote={}) is named

    def test_a_node_that_shared_its_evidence_is_not_lost(self) -> None:
        quiet = decision(Verdict.inconclusive)
        assert with_lost_nodes(quiet, {1: summary(1, NOW - 20, [2, 3])}, remote={1: []}) is quiet

    def test_judging_alone_is_said(self) -> None:
        alone = degraded(decision(Verdict.rank_behind, (2,)), "store 10.0.0.1:29500: ConnectionRefusedError")
        assert "judged from this node's ranks only" in alone.finding.missing[-1]

    def test_every_node_derives_the_same_key_for_the_same_stall(self) -> None:
        membership = Membership("10.0.0.1", 29500, "job7", 0, 0, 2)
        d = decision(Verdict.collective_mismatch, (3,), comm_label="process group 0", position=57)
        assert incident_key(membership, d) == incident_key(Membership("10.0.0.1", 29500, "job7", 0, 1, 2), d) == "job7/0|process group 0#57"

    def test_remote_workers_join_the_local_state(self) -> None:
        local = JobState()
        local.apply(WorkerSeen(pid=1, rank=0, host="a", at=NOW))
        stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
        merged = job_state(local, {1: [WorkerSeen(pid=7, rank=2, host="b", at=NOW)]}, stall)
        assert sorted(w.rank for w in merged.current_workers()) == [0, 2] and merged.stall == stall
        assert [w.rank for w in local.current_workers()] == [0]  # the local state is left as it was


class TestSequenceTails:
    def test_another_nodes_newest_collectives_align_by_absolute_position(self) -> None:
        """Each node reads only its own ranks' NCCL logs; the tails it shares let the leader see the divergence."""
        import nccl_lines as L

        from ncclwatch.watchdog.engine.classify import judge
        from ncclwatch.watchdog.engine.snapshot import take_snapshot
        from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

        comm = "0x5583d3a1f0e0"

        def node(rank: int, text: str) -> JobState:
            state = JobState()
            for event in NcclLogParser(f"node{rank}.{1000 + rank}").feed(text.encode(), final=True):
                state.apply(event)
            return state

        zero = node(0, L.init(0, 2, comm, host="node0") + L.steps(0, comm, 40, host="node0") + L.op(0, "AllReduce", 4096, comm, host="node0"))
        one = node(1, L.init(1, 2, comm, host="node1") + L.steps(1, comm, 40, host="node1") + L.op(1, "Broadcast", 16, comm, host="node1"))
        tails = one.sequence_tails(8)
        assert [t.base for t in tails] == [tails[0].base] and tails[0].base > 0 and len(tails[0].sigs) == 8
        shared = parse_journal(encode(tails), "node 1")  # through the wire format
        stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
        finding = judge(take_snapshot(job_state(zero, {1: shared}, stall), observed_at=NOW)).finding
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.position == tails[0].base + 8
