"""Judging with several nodes: the leader's sidecar judges the whole job from every node's evidence; a member
shares its own and waits for the leader's verdict; without the store each judges its own ranks.

``JobJudging`` is the ``Judging`` (``judging.py``) of a sidecar that has met the other nodes (``nodes.py``); before,
it asks ``NodeJudging``.  The leader gathers every node's
compact evidence into one state as it arrives (``JobEvidence``), asks the nodes whose ranks decide for their full
evidence and judges again; a member's decision is held ("node 0 judges the whole job") and the leader's verdict
reaches it through the sidecar's queue (``Nodes``).  At a page, ``role`` says whether the verdict is the job's and
whether this node follows it, and ``page`` publishes the leader's verdict or says which node pages instead.

Failure modes: a store that fails mid-exchange is a ``SourceDown`` of the cluster source, emitted to the sidecar's
queue, and this node judges its own ranks (the verdict says it is degraded); a leader's verdict that went unread
before the store went is said, never paged twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ncclwatch.watchdog.cluster.handoff import LeaderVerdict, VerdictHandoff
from ncclwatch.watchdog.cluster.incident_evidence import (
    EVIDENCE_WAIT_S,
    FULL_NODES,
    FULL_WAIT_S,
    IncidentEvidence,
)
from ncclwatch.watchdog.cluster.judge import (
    STORE_GONE,
    JobEvidence,
    degraded,
    focus,
    unread_verdict,
    with_lost_nodes,
)
from ncclwatch.watchdog.cluster.judge import incident_key as job_incident_key
from ncclwatch.watchdog.cluster.lost import LostNodes
from ncclwatch.watchdog.cluster.payload import TAIL_SHARED_MAX, paused_gc
from ncclwatch.watchdog.cluster.peers import Cluster
from ncclwatch.watchdog.cluster.perf_sharing import PerfSharing
from ncclwatch.watchdog.cluster.store import StoreError
from ncclwatch.watchdog.cluster.view import Contact
from ncclwatch.watchdog.events import Event, SourceDown, Stall
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.live.incident import Incident
from ncclwatch.watchdog.live.job import LiveJob
from ncclwatch.watchdog.live.journal import live_inputs
from ncclwatch.watchdog.live.judging import CLUSTER, Role, judge_at
from ncclwatch.watchdog.response.policy import Plan

log = logging.getLogger("ncclwatch")

PEEK_WAIT_S = 3.0  # a leader's peek waits this long for the other nodes' compact evidence of the same silence


class Watch(Protocol):
    """What the cluster's parts read of the node's watch (``Sidecar``); they hand it events (and the leader's
    verdict) through its queue (``emit``), never call into it."""

    live: LiveJob
    host: str
    incident: Incident
    clock: Callable[[], float]

    def emit(self, item: Event | LeaderVerdict) -> None: ...


@dataclass(frozen=True)
class Met:
    """The other nodes' sidecars, once met: the view exchange and its roles at a stall (``cluster/``)."""

    cluster: Cluster
    evidence: IncidentEvidence
    verdicts: VerdictHandoff
    lost: LostNodes
    perf: PerfSharing

    @classmethod
    def of(cls, cluster: Cluster) -> Met:
        evidence = IncidentEvidence(cluster)
        return cls(cluster, evidence, VerdictHandoff(cluster, evidence), LostNodes(cluster), PerfSharing(cluster))


async def gather_compact(
    met: Met, answering: set[int], since: float, wait_s: float, evidence: JobEvidence
) -> dict[int, list[Event]]:
    """The answering nodes' compact evidence of this silence, and the last evidence of nodes whose job failed
    (``Nodes.farewell``): which of their ranks went, and when.  Nothing changes there after the end, so it counts
    whenever it was shared, and it is not waited for."""
    found = await met.evidence.gather("compact", answering, since, wait_s, fold=evidence.add)
    ended = met.cluster.ended() - set(found)
    return found | await met.evidence.gather("compact", ended, 0.0, 0.0, fold=evidence.add)


class JobJudging:
    """Several nodes: the leader judges the job; a member shares its evidence and waits for the leader's verdict."""

    def __init__(self, watch: Watch, met: Met, wake: asyncio.Event) -> None:
        self.watch = watch
        self.live = watch.live
        self.met = met
        self.wake = wake  # the exchange runs now (``Nodes.run``), not at its next round
        self.job_state: JobState | None = None  # the latest probe's state merged with the other nodes' evidence
        self.shared: list[Event] = []  # what this node shared at its latest look (its full evidence on request)
        self.peeked_nodes: dict[int, int] = {}  # rank -> node, as the leader's latest peek gathered them
        self.store_node_lost: Contact | None = None  # found lost through its lifeline, the store being gone

    async def judge(self, stall: Stall, probed: list[Event]) -> Decision:
        """This node's view, or the whole job's: the leader judges it, the others share and wait for it."""
        met = self.met
        if CLUSTER in self.live.down:
            return await self._judge_without_store(met, stall, self.live.down[CLUSTER])
        self.shared = self.compact(probed, stall)
        try:
            if met.cluster.leads():
                return await self._judge_job(met, stall)
            await met.evidence.share("compact", self.shared, stall.at)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return await self._judge_without_store(met, stall, str(exc))
        alone = judge_at(self.live.state, stall.at)
        held = f"node {met.cluster.leader()} judges the whole job; waiting for its verdict"
        return replace(alone, page=False, held=held)

    def compact(self, probed: list[Event], stall: Stall) -> list[Event]:
        """This node's compact evidence: its inputs, each rank's recent operations, the look's events, and the look's
        clock with this node's earlier looks (the leader leaves their dump writes out of this node's ranks' I/O)."""
        state = self.live.state
        earlier = [span for span in state.probes_of(None) if span != (stall.probe_began_at, stall.at)]
        shared = stall.model_copy(update={"host": self.watch.host, "earlier_probes": earlier})
        return live_inputs(state) + state.sequence_tails(TAIL_SHARED_MAX) + probed + [shared]

    async def peek(self, stall: Stall, probed: list[Event]) -> Decision:
        """A quiet look across nodes, before the stall timeout: every node shares its compact evidence, and the
        leader judges the job from what came within ``PEEK_WAIT_S``; only a proven decision opens the incident.

        A mismatch between ranks of two nodes is visible to neither alone (one rank per node: each sees its rank
        waiting in a collective, which proves nothing), and the warm-up timeout is minutes.  No incident is opened:
        the other nodes' sidecars go on watching, and the evidence is gathered from this silence only."""
        met = self.met
        if CLUSTER in self.live.down:
            return judge_at(self.live.state, stall.at)
        try:
            if not met.cluster.leads():
                # Kept as this node's full evidence too: where the peek proves a hang the leader asks for it at
                # once, and this node's own probe comes only at its stall timeout (two wrappers, a dtype mismatch
                # at step 1 on the H200: the leader waited 2.5 s for it, of a 6.6 s page).
                self.shared = self.compact(probed, stall)
                await met.evidence.share("compact", self.shared, stall.at)
                self.wake.set()  # exchange now and at HOT_S (``Nodes._hot``): the leader may open its incident next
                return judge_at(self.live.state, stall.at)
            evidence = JobEvidence(self.live.state, stall)
            with paused_gc(freeze=False):
                silence = stall.at - stall.stalled_for_s
                await gather_compact(met, met.cluster.answering(), silence, PEEK_WAIT_S, evidence)
                decision = evidence.judge()
                self.job_state = evidence.state()
                self.peeked_nodes = dict(evidence.nodes_of)
                return decision
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return judge_at(self.live.state, stall.at)

    async def _judge_job(self, met: Met, stall: Stall) -> Decision:
        """The leader: every node's compact evidence, then the full evidence of the nodes that decide."""
        incident, cluster = self.watch.incident, met.cluster
        started = incident.started_at if incident.started_at is not None else stall.at
        opened = incident.opened_at if incident.opened_at is not None else stall.at
        await met.evidence.open_incident(opened, started_at=started)
        answering = cluster.answering()
        evidence = JobEvidence(self.live.state, stall)  # folded as it comes; full evidence replaces in place
        # No collection until the verdict, nor after over the evidence's millions of objects (``paused_gc``).
        with paused_gc(freeze=True):
            remote = await gather_compact(met, answering, started, EVIDENCE_WAIT_S, evidence)
            decision = evidence.judge()
            self.job_state = evidence.state()
            if want := focus(decision, evidence.nodes_of, set(met.lost.lost()), FULL_NODES):
                await met.evidence.open_incident(opened, want, since=self.job_state.fewest_issued())
                remote |= await met.evidence.gather("full", set(want), started, FULL_WAIT_S, fold=evidence.add)
                decision = evidence.judge()
                self.job_state = evidence.state()
        lost = met.lost.lost()
        decision = with_lost_nodes(decision, lost, remote)
        if pending := sorted(answering - set(remote) - set(lost)):  # one that fell silent while waited for is lost
            # Their sidecar still publishes but has not probed yet (a longer learned timeout): look again.
            waiting = f"waiting for node {', '.join(map(str, pending))} to share its evidence"
            decision = replace(decision, page=False, held=waiting)
        if not decision.page:  # held (a pause, a busy rank): the members go back to their usual pace
            await met.evidence.open_incident(opened, judging=False)
        return decision

    async def _judge_without_store(self, met: Met, stall: Stall, why: str) -> Decision:
        """This node's ranks alone; the store's node named lost when its lifeline does not answer either.  Where
        the leader had announced its verdict and the store went (the leader ended its job) before this node read
        it, the leader paged: this node's view is said to be only that, and no node is lost."""
        decision = degraded(judge_at(self.live.state, stall.at), why)
        if (announced := met.verdicts.unread()) is not None:
            return unread_verdict(decision, met.cluster.leader(), announced)
        self.store_node_lost = await met.lost.store_node_lost()
        if self.store_node_lost is None:
            return decision
        return with_lost_nodes(decision, {self.store_node_lost.node: self.store_node_lost}, {}, why=STORE_GONE)

    # -- at a page -----------------------------------------------------------

    def role(self, decision: Decision) -> Role:
        """While the store answers the verdict is the whole job's, taken from the state the leader merged at its
        latest probe, and a member follows the leader's page; else this node's."""
        met = self.met
        key = job_incident_key(met.cluster.membership, decision)
        if CLUSTER in self.live.down:
            return Role(self.live.state, key=key)
        state = self.job_state if self.job_state is not None else self.live.state
        return Role(state, job_wide=True, follows=not met.cluster.leads(), key=key)

    async def page(self, decision: Decision, role: Role, plan: Plan | None) -> Callable[[], str] | None:
        """The leader publishes its verdict, with the response every node carries out (a store that fails is the
        cluster source down, and the members then judge alone).  None where this node pages; else the line it says
        instead, once its bundle is written (naming the leader then).  Without the store, the node that pages is
        elected now, while the others' lifelines still answer: a node whose leader announced a verdict it could not
        read, or a lower node that answers, pages."""
        met = self.met
        cluster = met.cluster
        if role.job_wide and cluster.leads():
            response, why = (plan.response.value, plan.why) if plan is not None else (None, "")
            try:
                await met.verdicts.publish(job_incident_key(cluster.membership, decision), decision, response, why)
            except StoreError as exc:
                self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
        if role.follows:
            return lambda: (
                f"node {cluster.me}: this node's evidence is in its bundle; node {cluster.leader()} "
                "pages the job-wide verdict"
            )
        if role.job_wide:
            return None
        if (announced := met.verdicts.unread()) is not None:
            return lambda: (
                f"node {cluster.me}: node {cluster.leader()} paged its job-wide verdict ({announced}), "
                "which this node could not read before the store went away; this node's own evidence "
                "is in its bundle"
            )
        lost = {self.store_node_lost.node} if self.store_node_lost is not None else set()
        if await met.lost.pages_alone(lost):
            return None
        return lambda: (
            f"node {cluster.me}: the store is gone; this node's evidence is in its bundle, "
            "and a lower node that answers pages"
        )
