"""The leader's verdict reaches every member before the leader ends its job (its node serves the store).

On the H100 (pipeline both_recv, two wrappers) node 1 had not read node 0's verdict when node 0's kill took the
store away; it then judged alone and wrote ``stuck_in_collective [0]`` beside the paged ``p2p_deadlock [0, 1]``.
A real torch TCPStore; the real clock (the leader's wait is bounded in seconds).
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

import pytest
from support import torch_store_server

from ncclwatch.watchdog.cluster.handoff import VerdictHandoff
from ncclwatch.watchdog.cluster.incident_evidence import IncidentEvidence
from ncclwatch.watchdog.cluster.judge import degraded, unread_verdict
from ncclwatch.watchdog.cluster.peers import Cluster, Membership
from ncclwatch.watchdog.cluster.store import StoreClient
from ncclwatch.watchdog.cluster.view import NodeSummary
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

dist = pytest.importorskip("torch.distributed")

KEY = "job/0|p2p_deadlock:0,1"


@pytest.fixture
def store():  # type: ignore[no-untyped-def]
    return torch_store_server()


class Node(NamedTuple):
    cluster: Cluster
    evidence: IncidentEvidence
    verdicts: VerdictHandoff


def node(port: int, me: int) -> Node:
    cluster = Cluster(
        Membership("127.0.0.1", port, "job", 0, me, 2),
        f"node{me}",
        client=StoreClient("127.0.0.1", port, timeout_s=15.0),
    )
    evidence = IncidentEvidence(cluster)
    return Node(cluster, evidence, VerdictHandoff(cluster, evidence))


def summary(me: int, phase: str) -> NodeSummary:
    now = time.time()
    return NodeSummary(node=me, host=f"node{me}", at=now, ranks=[me], last_progress=now - 10, phase=phase)


async def judged(leader: Node, member: Node) -> None:
    """Two rounds, an incident, the leader's verdict; the member has read the view that announces it."""
    for phase in ("watching", "suspect"):
        for c in (leader.cluster, member.cluster):
            await c.exchange(summary(c.me, phase))
    assert leader.cluster.leads()
    await leader.evidence.open_incident(time.time())
    await member.cluster.exchange(summary(1, "suspect"))
    await leader.verdicts.publish(
        KEY, Decision(Finding(Verdict.p2p_deadlock, "both recv first", culprits=(0, 1)), page=True)
    )
    await member.cluster.exchange(summary(1, "suspect"))


def test_a_member_hurries_while_an_announced_verdict_is_unread(store) -> None:  # type: ignore[no-untyped-def]
    async def talk():  # type: ignore[no-untyped-def]
        leader, member = node(store.port, 0), node(store.port, 1)
        await judged(leader, member)
        before = (member.verdicts.unread(), member.verdicts.hurry())
        verdict = await member.verdicts.read()
        return before, verdict, (member.verdicts.unread(), member.verdicts.hurry())

    before, verdict, after = asyncio.run(talk())
    assert before == (KEY, True)  # judging is over, but the verdict waits to be read: exchange at HOT_S
    assert verdict is not None and verdict.key == KEY
    assert after == (None, False)


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_the_leader_waits_until_the_member_shows_it_follows(store) -> None:  # type: ignore[no-untyped-def]
    async def talk():  # type: ignore[no-untyped-def]
        leader, member = node(store.port, 0), node(store.port, 1)
        await judged(leader, member)

        async def follow() -> None:
            await asyncio.sleep(0.5)
            await member.verdicts.read()
            await member.cluster.publish_summary(summary(1, "paged"))

        started = time.monotonic()
        waiting, _ = await asyncio.gather(leader.verdicts.handed_off(wait_s=5.0), follow())
        return waiting, time.monotonic() - started

    waiting, took = asyncio.run(talk())
    assert waiting == []
    assert 0.4 <= took < 3.0  # as soon as it shows "paged", well before the bound


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_the_leaders_wait_is_bounded_and_names_who_did_not_follow(store) -> None:  # type: ignore[no-untyped-def]
    async def talk():  # type: ignore[no-untyped-def]
        leader, member = node(store.port, 0), node(store.port, 1)
        await judged(leader, member)
        started = time.monotonic()
        return await leader.verdicts.handed_off(wait_s=0.6), time.monotonic() - started

    waiting, took = asyncio.run(talk())
    assert waiting == [1]
    assert 0.6 <= took < 2.0


def test_a_member_that_lost_the_store_before_reading_says_the_leader_paged() -> None:
    alone = degraded(
        Decision(Finding(Verdict.stuck_in_collective, "Collective #1501 never completed.", culprits=(0,)), page=True),
        "store gone",
    )
    said = unread_verdict(alone, 0, KEY).finding
    assert said.summary.startswith(f"Node 0 judged the whole job and paged it ({KEY}); its store went away")
    assert said.summary.endswith("This node's ranks alone: Collective #1501 never completed.")
    assert any(f"node 0's bundle and page ({KEY})" in note for note in said.missing)
