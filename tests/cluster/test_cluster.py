"""The sidecars' meeting place: torch's own TCPStore spoken from pure Python, the leader rule, the job-wide verdict."""

from __future__ import annotations

import asyncio

import pytest
from conftest import NOW
from support import torch_store_server

from ncclwatch.watchdog.cluster.handoff import VerdictHandoff
from ncclwatch.watchdog.cluster.incident_evidence import IncidentEvidence
from ncclwatch.watchdog.cluster.judge import degraded, focus, incident_key, job_state, with_lost_nodes
from ncclwatch.watchdog.cluster.lifeline import Lifeline, ask
from ncclwatch.watchdog.cluster.lost import LostNodes
from ncclwatch.watchdog.cluster.payload import (
    FR_ENTRIES_COMPACT,
    FR_ENTRIES_SHARED,
    FR_FRAMES_SHARED,
    TAIL_SHARED_MAX,
    encode,
    pack,
    shareable,
    unpack,
)
from ncclwatch.watchdog.cluster.peers import Cluster, Membership
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.cluster.view import LOST_AFTER_S, Contact, JobView, NodeSummary, compose, may_lead, pager_order
from ncclwatch.watchdog.events import (
    Citation,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpState,
    ProcessState,
    Stall,
    Unusable,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision, Finding, RankStatus
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.journal import parse_journal

dist = pytest.importorskip("torch.distributed")


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def torch_store(request):  # type: ignore[no-untyped-def]
    """A real torch TCPStore server, both of its backends."""
    return torch_store_server(use_libuv=request.param)


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

    def test_many_keys_go_with_one_write_and_the_connection_stays_in_step(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        for n in range(300):
            torch_store.set(f"evidence/{n}", b"x")

        async def talk() -> tuple[int, int, bytes | None, int]:
            client = StoreClient("127.0.0.1", torch_store.port)
            await client.set("kept", b"k")
            deleted = await client.delete_many([f"evidence/{n}" for n in range(300)] + ["never-set"])
            requests = client.requests
            kept = await client.get("kept")  # the next answer is this request's, not a delete's
            left = await client.num_keys()
            await client.close()
            return deleted, requests, kept, left

        deleted, requests, kept, left = asyncio.run(talk())
        assert deleted == 300 and requests == 2 and kept == b"k"
        assert not any(torch_store.check([f"evidence/{n}"]) for n in range(0, 300, 37)) and left >= 1

    def test_unreachable_store_is_an_error_not_an_empty_store(self) -> None:
        from support import free_port

        async def talk() -> None:
            await StoreClient("127.0.0.1", free_port(), timeout_s=1.0).get("x")

        with pytest.raises(StoreError):
            asyncio.run(talk())


def summary(node: int, at: float, ranks: list[int], phase: str = "watching") -> NodeSummary:
    return NodeSummary(node=node, host=f"node{node}", at=at, ranks=ranks, last_progress=at - 1, phase=phase)


def view(leader: int = 0, lost: tuple[int, ...] = (), **kw) -> JobView:  # type: ignore[no-untyped-def]
    return JobView(leader=leader, term=0, seq=3, nnodes=4, lost=[Contact(node=n, host=f"node{n}") for n in lost], **kw)


class TestLeadership:
    def test_without_a_view_node_zero_leads_at_once_and_node_k_after_k_silent_periods(self) -> None:
        assert may_lead(None, 0, 4, stale_s=0.0)
        assert not may_lead(None, 2, 4, stale_s=LOST_AFTER_S)
        assert may_lead(None, 2, 4, stale_s=2 * LOST_AFTER_S + 0.1)

    def test_the_leader_keeps_leading_and_a_fresh_view_keeps_the_others_members(self) -> None:
        assert may_lead(view(leader=0), 0, 4, stale_s=100.0)
        assert not may_lead(view(leader=0), 1, 4, stale_s=LOST_AFTER_S - 0.1)

    def test_a_stale_view_hands_over_to_the_next_fresh_node_then_the_one_after(self) -> None:
        stale = view(leader=0, lost=(1,))
        assert may_lead(stale, 2, 4, stale_s=LOST_AFTER_S + 0.1)  # node 1 was lost already: node 2 is next
        assert not may_lead(stale, 3, 4, stale_s=LOST_AFTER_S + 0.1)
        assert may_lead(stale, 3, 4, stale_s=2 * LOST_AFTER_S + 0.1)  # node 2 did not take it either

    def test_the_view_counts_what_it_cannot_list_and_names_the_store_node(self) -> None:
        own = summary(0, NOW, [0, 1])
        others = {n: summary(n, NOW, [2 * n, 2 * n + 1]) for n in range(1, 100)}
        others[7] = others[7].model_copy(update={"serves_store": True, "lifeline": "10.0.0.7:4000"})
        fresh = set(range(1, 50))
        composed = compose(None, 0, 100, others, fresh, own, since_start_s=60)
        assert composed.lost_count == 50 and len(composed.lost) == 32 and composed.lost[0].node == 50
        assert composed.store is not None and composed.store.node == 7 and composed.store.lifeline == "10.0.0.7:4000"
        assert [c.node for c in composed.candidates] == list(range(8)) and composed.joined == 100
        assert len(composed.model_dump_json()) < 6000  # every member reads it every round

    def test_nodes_that_never_published_are_lost_only_after_the_others_had_time_to_join(self) -> None:
        own = summary(0, NOW, [0])
        assert compose(None, 0, 3, {1: summary(1, NOW, [1])}, {1}, own, since_start_s=2).lost_count == 0
        assert [c.node for c in compose(None, 0, 3, {1: summary(1, NOW, [1])}, {1}, own, since_start_s=30).lost] == [2]

    def test_a_node_whose_job_ended_is_not_lost(self) -> None:
        own = summary(0, NOW, [0])
        composed = compose(None, 0, 2, {1: summary(1, NOW - 60, [1], phase="ended")}, set(), own, since_start_s=90)
        assert composed.lost_count == 0 and composed.ended == 1

    def test_without_the_store_the_store_node_then_the_candidates_page_in_order(self) -> None:
        v = view(store=Contact(node=0, host="a"), candidates=[Contact(node=n, host=f"h{n}") for n in (0, 1, 2)])
        assert [c.node for c in pager_order(v, 2, lost={0})] == [1, 2]
        assert [c.node for c in pager_order(v, 2, lost=set())] == [0, 1, 2]


def entry(index: int, seq: int) -> FrEntry:
    return FrEntry(
        index=index,
        pg_id="0",
        collective_seq_id=seq,
        profiling_name="nccl:all_reduce",
        op="AllReduce",
        is_p2p=False,
        state=OpState.completed,
        frames=[FrFrame(name="step", filename="train.py", line=seq)],
    )


class TestPayload:
    def test_dumps_travel_trimmed_to_their_newest_entries_and_stacks(self) -> None:
        dump = FrDump(
            rank=3,
            version="2.10",
            process_groups={},
            entries=[entry(i, i + 1) for i in range(500)],
            cite=Citation(file="d"),
        )
        noise = Unusable(reason="py-spy denied", cite=Citation(file="p"))
        [shared] = shareable([dump, noise])
        assert [e.collective_seq_id for e in shared.entries] == list(range(501 - FR_ENTRIES_SHARED, 501))
        assert sum(bool(e.frames) for e in shared.entries) == FR_FRAMES_SHARED
        assert len(encode([shared])) < 40_000
        [back] = parse_journal(encode([shared]), "node 1")
        assert back == shared

    def test_compact_evidence_keeps_where_each_rank_is_and_the_latest_samples(self) -> None:
        dump = FrDump(
            rank=3,
            version="2.10",
            process_groups={},
            entries=[entry(i, i + 1) for i in range(500)],
            cite=Citation(file="d"),
        )
        samples = [ProcessState(pid=9, rank=3, state="S", cpu_seconds=float(i), at=NOW + i) for i in range(10)]
        shared = shareable([dump, *samples], "compact")
        assert [e.collective_seq_id for e in shared[0].entries] == list(range(501 - FR_ENTRIES_COMPACT, 501))
        assert [s.cpu_seconds for s in shared[1:]] == [7.0, 8.0, 9.0]  # the newest, in order

    def test_a_payload_round_trips_compressed_with_its_probe_time(self) -> None:
        groups = {
            "0": FrProcessGroup(pg_id="0", ranks=list(range(8192))),
            "5": FrProcessGroup(pg_id="5", ranks=list(range(3, 8192, 8))),
        }
        dumps = [
            FrDump(rank=r, version="2.10", process_groups=groups, entries=[entry(0, 1)], cite=Citation(file=f"d{r}"))
            for r in range(8)
        ]
        full = unpack(pack(5, "full", NOW, dumps), "node 5")
        assert full is not None and (full.node, full.kind, full.stall_at) == (5, "full", NOW) and full.events == dumps
        raw = pack(5, "compact", NOW, dumps)
        assert len(raw) < 2000  # 8 dumps naming 8,192 and 1,024 members each
        compact = unpack(raw, "node 5")
        assert compact is not None
        [pg0, pg5] = compact.events[0].process_groups.values()  # type: ignore[attr-defined]
        assert pg0.ranks == [] and pg5.ranks == list(range(3, 8192, 8))  # the identity says nothing: left out

    def test_a_payload_that_does_not_parse_is_none_not_an_exception(self) -> None:
        assert unpack(b'{"node": 1}\nnot zlib', "x") is None and unpack(b"", "x") is None


def cluster(port: int, node: int, nnodes: int = 3, clock=lambda: NOW, run: str = "job", restart: int = 0) -> Cluster:  # type: ignore[no-untyped-def]
    # 15 s: torch's classic server now and then answers a fresh connection 5 s late on this VM (its own client too)
    client = StoreClient("127.0.0.1", port, timeout_s=15.0)
    return Cluster(Membership("127.0.0.1", port, run, restart, node, nnodes), f"node{node}", clock=clock, client=client)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


async def rounds(nodes: list[Cluster], clock: Clock, count: int, phase: str = "watching") -> None:
    """``count`` publication rounds 2.5 s apart, every node in turn."""
    for _ in range(count):
        clock.now += 2.5
        for c in nodes:
            await c.exchange(summary(c.me, clock.now, [c.me], phase))


class TestExchange:
    def test_members_read_one_view_and_only_the_leader_reads_the_summaries(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        clock = Clock()

        async def talk():  # type: ignore[no-untyped-def]
            nodes = [cluster(torch_store.port, n, nnodes=6, clock=clock) for n in range(6)]
            await rounds(nodes, clock, 3)
            before = [c.client.requests for c in nodes]
            await rounds(nodes, clock, 1)
            per_round = [c.client.requests - b for c, b in zip(nodes, before)]
            return nodes, per_round

        nodes, per_round = asyncio.run(talk())
        assert {c.leader() for c in nodes} == {0} and nodes[0].leads()
        assert per_round[1:] == [2] * 5  # set the summary, read the view: whatever the job's size
        # plus the view's compare-and-set and every summary: one MULTI_GET on libuv, CHECK + GET each on classic
        assert per_round[0] == (4 if nodes[0].client.sparse_reads else 3 + 2 * 5)
        assert nodes[3].view is not None and nodes[3].view.joined == 6 and LostNodes(nodes[3]).lost() == {}
        assert nodes[0].summaries[5].ranks == [5] and nodes[1].summaries == {}

    def test_a_silent_leader_is_replaced_by_the_next_node_and_the_others_follow(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        clock = Clock()

        async def talk():  # type: ignore[no-untyped-def]
            nodes = [cluster(torch_store.port, n, clock=clock) for n in range(3)]
            await rounds(nodes, clock, 3)
            await rounds(nodes[1:], clock, 7)  # node 0 stops publishing
            return nodes

        nodes = asyncio.run(talk())
        assert nodes[1].leads() and nodes[2].leader() == 1 and nodes[2].view is not None and nodes[2].view.term == 1
        assert set(LostNodes(nodes[2]).lost()) == {0}

    def test_a_node_silent_since_the_leaders_last_exchange_is_lost_when_it_judges(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        """CI, two wrappers, node 1 frozen: the leader judged 5.8 s into the silence, over 7.5 s after it had seen
        node 1's summary change.  Node 1 no longer answered (its evidence was not waited for), but the view
        composed at the last exchange did not name it lost either: ``stuck_in_collective`` without a culprit was
        paged, not ``node_lost``.  A node is one or the other at every moment; a leader whose own exchange fell
        behind takes nobody for silent past one round after its last read."""
        clock = Clock()

        async def talk():  # type: ignore[no-untyped-def]
            nodes = [cluster(torch_store.port, n, clock=clock) for n in range(3)]
            await rounds(nodes, clock, 3)
            await rounds([nodes[0], nodes[2]], clock, 4)  # node 1 froze: silent 7.5 s at the leader's last read
            return nodes

        nodes = asyncio.run(talk())
        leader, lost = nodes[0], LostNodes(nodes[0]).lost
        assert leader.leads() and 1 in leader.answering() and lost() == {}
        clock.now += 1.0  # no exchange since the view was composed
        assert leader.answering() == {2}
        assert set(lost()) == {1} and lost()[1].ranks == [1]
        clock.now += 10.0  # the leader's exchange fell behind: node 2 published, unread
        assert leader.answering() == {2} and set(lost()) == {1}

    def test_two_nodes_taking_over_at_once_end_with_one_leader(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        async def talk():  # type: ignore[no-untyped-def]
            one, two = cluster(torch_store.port, 1), cluster(torch_store.port, 2)
            # Neither has seen a view for long: both may create it; the compare-and-set lets one win.
            one._view_changed_at = two._view_changed_at = NOW - 100
            await asyncio.gather(one.exchange(summary(1, NOW, [1])), two.exchange(summary(2, NOW, [2])))
            await one.exchange(summary(1, NOW, [1]))
            await two.exchange(summary(2, NOW, [2]))
            return one, two

        one, two = asyncio.run(talk())
        assert one.leader() == two.leader() and one.leads() != two.leads()

    def test_evidence_on_demand_then_the_verdict_for_every_member_then_the_keys_go(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        clock = Clock()

        async def talk():  # type: ignore[no-untyped-def]
            nodes = [cluster(torch_store.port, n, clock=clock) for n in range(3)]
            await rounds(nodes, clock, 2)
            keys_watching = await nodes[0].client.num_keys()
            leader = nodes[0]
            evidence = [IncidentEvidence(c) for c in nodes]
            verdicts = [VerdictHandoff(c, e) for c, e in zip(nodes, evidence)]
            await evidence[0].open_incident(clock.now)
            for c in nodes[1:]:
                await c.exchange(summary(c.me, clock.now, [c.me], phase="suspect"))
                await evidence[c.me].share(
                    "compact", [WorkerSeen(pid=10 + c.me, rank=c.me, host=c.host, at=NOW)], stall_at=clock.now
                )
            compact = await evidence[0].gather("compact", {1, 2}, since=clock.now - 1, wait_s=1.0)
            await evidence[0].open_incident(clock.now, want=[2])
            await nodes[2].exchange(summary(2, clock.now, [2], phase="suspect"))
            await nodes[1].exchange(summary(1, clock.now, [1], phase="suspect"))
            asked = (evidence[1].full_wanted(clock.now), evidence[2].full_wanted(clock.now))
            await evidence[2].share(
                "full", [Stall(at=clock.now, stalled_for_s=9, stall_timeout_s=5, progress_timeout_s=600)], clock.now
            )
            full = await evidence[0].gather("full", {2}, since=clock.now - 1, wait_s=1.0)
            found = decision(
                Verdict.rank_behind, (2,), rows=tuple(RankStatus(r, "h", r, 5, "x", "ok") for r in range(100))
            )
            await verdicts[0].publish("job/0|pg#5", found)
            for c in nodes[1:]:
                await c.exchange(summary(c.me, clock.now, [c.me], phase="suspect"))
            read = [await v.read() for v in verdicts[1:]]
            for e in evidence[1:]:
                await e.drop_own()
            again = await verdicts[1].read()
            keys_paged = await leader.client.num_keys()
            await evidence[0].close_incident()
            return compact, asked, full, read, again, keys_watching, keys_paged, await leader.client.num_keys()

        compact, asked, full, verdicts, again, watching, paged, closed = asyncio.run(talk())
        assert sorted(compact) == [1, 2] and [type(e).__name__ for e in full[2]] == ["Stall"]
        assert asked[0] is None and asked[1] == NOW + 5.0  # only node 2 was asked for its full evidence
        for shared in verdicts:
            assert (
                shared.key == "job/0|pg#5"
                and shared.decision.finding.culprits == (2,)
                and len(shared.decision.finding.rows) == 64
            )
        assert again is None  # each verdict is followed once
        assert paged == watching + 1 and closed == watching  # evidence goes with the verdict, the verdict at the end

    def test_a_new_round_removes_this_nodes_keys_of_the_round_before(self, torch_store) -> None:  # type: ignore[no-untyped-def]
        async def talk():  # type: ignore[no-untyped-def]
            first = cluster(torch_store.port, 0, nnodes=2)
            await first.exchange(summary(0, NOW, [0]))
            await IncidentEvidence(first).share("compact", [], NOW)
            before = await first.client.num_keys()
            second = cluster(torch_store.port, 0, nnodes=2, restart=1)
            await second.exchange(summary(0, NOW, [0]))
            return before, await second.client.num_keys()

        before, after = asyncio.run(talk())
        assert after == before - 1  # node, view and compact of round 0 gone; node and view of round 1 set

    def test_unreachable_store_raises(self) -> None:
        from support import free_port

        async def talk() -> None:
            await cluster(free_port(), 1).exchange(summary(1, NOW, [1]))

        with pytest.raises(StoreError):
            asyncio.run(talk())


class TestLifelines:
    def test_a_live_sidecar_answers_a_dead_one_does_not(self) -> None:
        async def talk():  # type: ignore[no-untyped-def]
            state = ["running"]
            line = Lifeline(4, lambda: state[0])
            port = await line.start("127.0.0.1")
            running = await ask(f"127.0.0.1:{port}")
            state[0] = "ended"
            ended = await ask(f"127.0.0.1:{port}")
            await line.close()
            return running, ended, await ask(f"127.0.0.1:{port}", timeout_s=0.5)

        assert asyncio.run(talk()) == ("running", "ended", None)

    def test_without_the_store_the_lowest_answering_node_pages_once(self) -> None:
        async def talk():  # type: ignore[no-untyped-def]
            lines = [Lifeline(n, lambda: "ended") for n in range(4)]
            ports = [await line.start("127.0.0.1") for line in lines]
            contacts = [
                Contact(node=n, host=f"h{n}", ranks=[n], lifeline=f"127.0.0.1:{p}") for n, p in enumerate(ports)
            ]
            await lines[0].close()  # the store's node is gone
            await lines[1].close()  # and so is the lowest candidate
            nodes = [cluster(1, n, nnodes=4) for n in range(4)]
            for c in nodes:
                c.view = view(store=contacts[0], candidates=contacts)
            lost = await LostNodes(nodes[3]).store_node_lost()
            pagers = [await LostNodes(c).pages_alone({0}) for c in nodes[2:]]
            for line in lines[2:]:
                await line.close()
            return lost, pagers

        lost, pagers = asyncio.run(talk())
        assert lost is not None and lost.node == 0 and lost.ranks == [0]
        assert pagers == [True, False]  # node 2 pages; node 3 finds node 2 alive


def decision(verdict: Verdict, culprits: tuple[int, ...] = (), **kw) -> Decision:  # type: ignore[no-untyped-def]
    return Decision(Finding(verdict, "engine says", culprits=culprits, **kw), page=verdict != Verdict.inconclusive)


class TestJobWideVerdict:
    def test_a_silent_node_is_node_lost_naming_its_ranks(self) -> None:
        lost = with_lost_nodes(decision(Verdict.inconclusive), {1: summary(1, NOW - 20, [2, 3]).contact()}, remote={})
        assert lost.page and lost.finding.verdict == Verdict.node_lost and lost.finding.culprits == (2, 3)
        assert "node1" in lost.finding.summary

    def test_a_mismatch_named_elsewhere_stands(self) -> None:
        named = decision(Verdict.collective_mismatch, (0,))
        assert with_lost_nodes(named, {1: summary(1, NOW - 20, [2, 3]).contact()}, remote={}) is named

    def test_a_neighbour_behind_or_stuck_next_to_a_lost_node_is_its_symptom(self) -> None:
        for symptom in (Verdict.rank_behind, Verdict.stuck_in_collective):
            lost = with_lost_nodes(decision(symptom, (5,)), {4: summary(4, NOW - 20, [4]).contact()}, remote={})
            assert (lost.finding.verdict, lost.finding.culprits) == (Verdict.node_lost, (4,))
            assert "Engine on the rest" in lost.finding.reason

    def test_a_node_that_shared_its_evidence_is_not_lost(self) -> None:
        quiet = decision(Verdict.inconclusive)
        assert with_lost_nodes(quiet, {1: summary(1, NOW - 20, [2, 3]).contact()}, remote={1: []}) is quiet

    def test_judging_alone_is_said(self) -> None:
        alone = degraded(decision(Verdict.rank_behind, (2,)), "store 10.0.0.1:29500: ConnectionRefusedError")
        assert "judged from this node's ranks only" in alone.finding.missing[-1]

    def test_every_node_derives_the_same_key_for_the_same_stall(self) -> None:
        membership = Membership("10.0.0.1", 29500, "job7", 0, 0, 2)
        d = decision(Verdict.collective_mismatch, (3,), comm_label="process group 0", position=57)
        assert (
            incident_key(membership, d)
            == incident_key(Membership("10.0.0.1", 29500, "job7", 0, 1, 2), d)
            == "job7/0|process group 0#57"
        )

    def test_a_lost_node_is_one_key_whoever_sees_it(self) -> None:
        membership = Membership("10.0.0.1", 29500, "job7", 0, 0, 4)
        seen_by_leader = decision(Verdict.node_lost, (2, 3))
        seen_across_a_partition = decision(Verdict.node_lost, (0, 1))
        assert (
            incident_key(membership, seen_by_leader)
            == incident_key(membership, seen_across_a_partition)
            == "job7/0|node_lost"
        )

    def test_full_evidence_is_asked_of_the_culprits_and_odd_ranks_nodes_only(self) -> None:
        rows = tuple(
            RankStatus(r, "h", r, 10 if r != 5 else 9, "x", "waiting" if r != 5 else "behind") for r in range(8)
        )
        d = decision(Verdict.rank_behind, (5,), rows=rows)
        nodes_of = {r: r // 2 for r in range(8)}
        assert focus(d, nodes_of, lost=set(), limit=8) == [2]
        assert (
            focus(decision(Verdict.inconclusive, rows=rows[:4]), nodes_of, lost=set(), limit=8) == []
        )  # a tie names no one
        assert focus(d, nodes_of, lost={2}, limit=8) == []

    def test_a_rank_behind_an_unseen_operation_asks_the_nodes_ahead(self) -> None:
        """H100, FSDP2 on two wrappers: rank 0 behind, and what rank 1 issued at its position unknown (its host ran
        157 collectives ahead, past its compact tail); the leader, rank 0's node, must ask rank 1's."""
        rows = (RankStatus(0, "h", 0, 1107, "x", "behind"), RankStatus(1, "h", 1, 1264, "x", "waiting"))
        d = Decision(Finding(Verdict.rank_behind, "s", culprits=(0,), operation="?", rows=rows), page=True)
        assert focus(d, {0: 0, 1: 1}, lost=set(), limit=8) == [0, 1]
        known = Decision(Finding(Verdict.rank_behind, "s", culprits=(0,), operation="AllReduce", rows=rows), page=True)
        assert focus(known, {0: 0, 1: 1}, lost=set(), limit=8)[0] == 0

    def test_a_culprit_on_the_leaders_node_with_one_peer_asks_nobody(self) -> None:
        """Two ranks, rank 0 stopped on the leader's node (not in ``nodes_of``), rank 1 waiting: the peer's row is
        the usual one, whatever the order of a set; its node has nothing the verdict needs."""
        rows = (RankStatus(0, "h", 0, 10, "x", "stopped"), RankStatus(1, "h", 1, 10, "x", "waiting"))
        stopped = Decision(Finding(Verdict.process_stopped, "s", culprits=(0,), rows=rows), page=True)
        assert focus(stopped, {1: 1}, lost=set(), limit=8) == []
        split = Decision(Finding(Verdict.collective_mismatch, "s", suspects=(0, 1), rows=rows), page=True)
        assert focus(split, {0: 0, 1: 1}, lost=set(), limit=8) == [0, 1]  # suspects: both sides' history decides

    def test_remote_workers_join_the_local_state(self) -> None:
        local = JobState()
        local.apply(WorkerSeen(pid=1, rank=0, host="a", at=NOW))
        stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
        merged = job_state(local, {1: [WorkerSeen(pid=7, rank=2, host="b", at=NOW)]}, stall)
        assert sorted(w.rank for w in merged.current_workers()) == [0, 2] and merged.stall == stall
        assert [w.rank for w in local.current_workers()] == [0]  # the local state is left as it was


def node(rank: int, text: str) -> JobState:
    """What node ``rank``'s sidecar read: that rank's NCCL log only."""
    from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

    state = JobState()
    for event in NcclLogParser(f"node{rank}.{1000 + rank}").feed(text.encode(), final=True):
        state.apply(event)
    return state


class TestSequenceTails:
    def test_another_nodes_newest_collectives_align_by_absolute_position(self) -> None:
        """Each node reads only its own ranks' NCCL logs; the tails it shares let the leader see the divergence."""
        import nccl_lines as L

        from ncclwatch.watchdog.hang.classify import classify
        from ncclwatch.watchdog.hang.snapshot import take_snapshot

        comm = "0x5583d3a1f0e0"

        zero = node(
            0,
            L.init(0, 2, comm, host="node0")
            + L.steps(0, comm, 40, host="node0")
            + L.op(0, "AllReduce", 4096, comm, host="node0"),
        )
        one = node(
            1,
            L.init(1, 2, comm, host="node1")
            + L.steps(1, comm, 40, host="node1")
            + L.op(1, "Broadcast", 16, comm, host="node1"),
        )
        tails = one.sequence_tails(8)
        assert [t.base for t in tails] == [tails[0].base] and tails[0].base > 0 and len(tails[0].sigs) == 8
        shared = parse_journal(encode(tails), "node 1")  # through the wire format
        stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
        finding = classify(take_snapshot(job_state(zero, {1: shared}, stall), observed_at=NOW)).finding
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.position == tails[0].base + 8

    def test_a_host_far_past_the_divergence_is_shared_back_to_the_slowest_rank(self) -> None:
        """H100, FSDP2 on two wrappers: rank 1 skipped a collective and its host enqueued 157 more before the job
        stopped, so its newest 64 began past rank 0's last and the leader read ``rank_behind [0]``.  The leader
        asks for full evidence back to the fewest collectives any rank issued (``IncidentView.since``)."""
        import nccl_lines as L

        from ncclwatch.watchdog.hang.classify import classify
        from ncclwatch.watchdog.hang.snapshot import take_snapshot

        comm = "0x5583d3a1f0e0"

        zero = node(
            0,
            L.init(0, 2, comm, host="node0")
            + L.steps(0, comm, 40, host="node0")
            + L.op(0, "AllReduce", 4096, comm, host="node0"),
        )
        one = node(
            1,
            L.init(1, 2, comm, host="node1") + L.steps(1, comm, 40, host="node1") + L.steps(1, comm, 60, host="node1"),
        )
        ahead = one.sequence_tails(TAIL_SHARED_MAX)
        stall = Stall(at=NOW, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)

        def leader_sees(events: list) -> Finding:
            shared = unpack(pack(1, "full", NOW, events, since=zero.fewest_issued()), "node 1")
            assert shared is not None
            return classify(take_snapshot(job_state(zero, {1: shared.events}, stall), observed_at=NOW)).finding

        newest_only = unpack(pack(1, "full", NOW, ahead), "node 1")
        assert newest_only is not None
        alone = classify(take_snapshot(job_state(zero, {1: newest_only.events}, stall), observed_at=NOW)).finding
        assert (alone.verdict, alone.culprits) == (Verdict.rank_behind, (0,))  # what the leader read before
        since = job_state(zero, {1: one.sequence_tails(8)}, stall).fewest_issued()
        assert since == zero.fewest_issued()  # rank 0's count: it is the slowest
        finding = leader_sees(ahead)
        assert finding.verdict == Verdict.collective_mismatch
        assert finding.position == next(iter(since.values())) and finding.culprits == (
            0,
        )  # its AllReduce is in no step
