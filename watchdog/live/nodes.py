"""The other nodes' sidecars: what a sidecar does besides judging once it has met them, held only then.

The sidecar meets the other nodes' sidecars once its workers name the job's store and several nodes
(``Membership.of``); from then on it holds a ``Nodes`` and asks its ``judging`` (``job_judging.JobJudging``).
``run`` publishes this node's summary and reads the job's view every PUBLISH_S (HOT_S while a stall is judged):
it sends the full evidence the leader asks for, closes the leader's incident once the watch is back to watching,
and hands the leader's verdict to the sidecar through its queue (a ``LeaderVerdict``, which the tick follows: one
verdict, one page).  Around it: ``peer_suspects`` (another node probes: look now), ``moved`` (a member's ranks
moved: withdraw its evidence), ``proved`` (the leader's peek proved a hang: ask the deciding nodes for their full
evidence now), ``hand_off`` (before a job-wide response ends the job, the members read the verdict), and
``farewell`` (the job ended here; without the store, whether the store's node is lost).

Failure modes: a store that fails mid-exchange is a ``SourceDown`` of the cluster source, emitted to the sidecar's
queue, and the node judges its own ranks; a node whose lifeline cannot listen is taken for lost by the others once
the store is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ncclwatch.watchdog.cluster.handoff import HANDOFF_S
from ncclwatch.watchdog.cluster.incident_evidence import FULL_NODES
from ncclwatch.watchdog.cluster.judge import STORE_GONE, degraded, focus, with_lost_nodes
from ncclwatch.watchdog.cluster.lifeline import LINGER_S, STORE_GONE_LINGER_S, Lifeline
from ncclwatch.watchdog.cluster.peers import Cluster, Membership, exchange_or_degrade
from ncclwatch.watchdog.cluster.perf_sharing import PerfSharing
from ncclwatch.watchdog.cluster.store import StoreError
from ncclwatch.watchdog.cluster.view import HOT_S, PUBLISH_S, NodeSummary
from ncclwatch.watchdog.events import SourceDown, SourceUp, Stall
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.incident import Phase
from ncclwatch.watchdog.live.job_judging import JobJudging, Met, Watch
from ncclwatch.watchdog.live.judging import CLUSTER

log = logging.getLogger("ncclwatch")

ClusterFactory = Callable[[Membership, str], Cluster]  # (membership, host) -> this node's side of the exchange

PEEKED_HOT_S = 5.0  # a member exchanges at HOT_S this long after its peek (``Nodes._hot``)


class Nodes:
    """This node's part among the job's nodes, met through ``cluster``; ``judging`` is the ``Judging`` the sidecar
    asks from then on."""

    def __init__(self, watch: Watch, cluster: Cluster) -> None:
        self.watch = watch
        self.live = watch.live
        self.met = Met.of(cluster)
        self.wake = asyncio.Event()  # the incident's phase changed, or a peek was shared: exchange now
        self.judging = JobJudging(watch, self.met, self.wake)
        self._lifeline: Lifeline | None = None
        self._took_store = False  # this node served the store and its job ended by a hang or a failure
        self._following: str | None = None  # the leader's verdict handed to the sidecar, not yet followed there

    async def start(self) -> None:
        """Say where the sidecars meet, and answer on this node's lifeline (announced in its summary)."""
        membership = self.met.cluster.membership
        log.info(
            "node %d of %d; sidecars meet in the store at %s:%d",
            membership.node_rank,
            membership.nnodes,
            membership.store_host,
            membership.store_port,
        )
        self._lifeline = Lifeline(membership.node_rank, self._lifeline_state)
        try:
            self.met.cluster.lifeline_port = await self._lifeline.start()
        except OSError as exc:
            log.warning("no lifeline (%s): without the store, the other nodes will take this one for lost", exc)
            self._lifeline = None

    # -- the exchange, every round ------------------------------------------

    async def run(self) -> None:
        """Publish this node's summary, read the view, follow it; every PUBLISH_S, or HOT_S, or when woken."""
        down: str | None = None
        while True:
            reason = await exchange_or_degrade(self.met.cluster, self._summary())
            if reason != down:
                self.watch.emit(SourceDown(source=CLUSTER, reason=reason) if reason else SourceUp(source=CLUSTER))
                down = reason
            if reason is None:
                await self._follow(self.met)
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), HOT_S if self._hot() else PUBLISH_S)
            except TimeoutError:
                pass

    def _lifeline_state(self) -> str:
        return "running" if self.live.view(self.watch.clock()).alive else "ended"

    async def close(self) -> None:
        if self._lifeline is not None:
            await asyncio.sleep(self.linger_s())
            await self._lifeline.close()

    def linger_s(self) -> float:
        """How long the lifeline answers after the job ended here.  A node whose job failed a moment after this
        one's must still find it alive.  Without the store, the nodes elect who pages by who answers: longer.  And
        where this node served the store and its job ended on a hang (its own response, or a failure), every other
        node loses the store now; a member that had not read the verdict yet asks this lifeline, seconds later
        (its torchrun ends once its ranks fail), whether this node is lost (H200, pipeline x DP on two wrappers:
        the member paged node_lost after 3 s of lingering here)."""
        return STORE_GONE_LINGER_S if CLUSTER in self.live.down or self._took_store else LINGER_S

    def phase_changed(self) -> None:
        """The incident moved: tell the other nodes now, not at the next round."""
        self.wake.set()

    def peer_suspects(self) -> bool:
        """Another node probes a stall and waits for this node's evidence."""
        return self.met.cluster.peer_suspects()

    def _hot(self) -> bool:
        """Exchange every HOT_S while a stall is judged (``VerdictHandoff.hurry``) or this node suspects one:
        requests and verdicts travel fast.  A member that suspects a stall is the one the leader will ask for its
        full evidence; at PUBLISH_S it would see the request only after the leader's wait for it ran out (two
        wrappers, a rank stopped on the member: 2.5 s of a 7.4 s page).  So does a member for PEEKED_HOT_S after a
        peek: where the leader's peek of the same silence proves the hang, it asks for this node's full evidence
        at once (``proved``), before this node suspects anything itself."""
        met = self.met
        suspects = self.watch.incident.phase in (Phase.suspect, Phase.confirming)
        looked_at = self._shared_at()
        peeked = looked_at is not None and self.watch.clock() - looked_at < PEEKED_HOT_S
        return suspects or met.verdicts.hurry() or (peeked and not met.cluster.leads())

    async def _follow(self, met: Met) -> None:
        """Send the full evidence the leader asks for; hand the leader's verdict to the sidecar (its queue); close
        the leader's incident."""
        cluster = met.cluster
        try:
            if (opened := met.evidence.full_wanted(self._shared_at())) is not None:
                await met.evidence.share("full", self.judging.shared, self._shared_at())
                met.evidence.full_shared(opened)
            if cluster.leads():
                watching = self.watch.incident.phase in (Phase.watching, Phase.resolved)
                if cluster.view is not None and cluster.view.incident is not None and watching:
                    await met.evidence.close_incident()
            elif (verdict := await met.verdicts.read()) is not None:
                decision = verdict.decision
                log.info("node %d's job-wide verdict %s (%s)", cluster.leader(), decision.finding.verdict, verdict.key)
                await met.evidence.drop_own()
                self._following = verdict.key
                self.watch.emit(verdict)  # the sidecar's tick follows it (``on_verdict``): this node pages its part
                await cluster.publish_summary(self._summary())  # the leader waits for this before ending its job
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    def _shared_at(self) -> float | None:
        """When this node looked for the evidence it shared last (None: it has shared none)."""
        return next((e.at for e in reversed(self.judging.shared) if isinstance(e, Stall)), None)

    def _summary(self) -> NodeSummary:
        view = self.live.view(self.watch.clock())
        phase = self.watch.incident.phase
        if phase is Phase.paged:
            self._following = None
        # A verdict handed to the sidecar and not followed by its tick yet is followed all the same: "paged".
        said = "paged" if self._following is not None else phase.value
        return NodeSummary(
            node=self.met.cluster.me,
            host=self.watch.host,
            at=view.observed_at,
            ranks=[w.rank for w in view.workers],
            last_progress=view.last_progress,
            phase=said if view.alive or not view.workers else "ended",
            world_size=self.live.state.world_size(),
            started_at=self.live.started_at,
        )

    # -- around a probe -------------------------------------------------------

    async def proved(self, decision: Decision) -> None:
        """A peek proved the hang, and the incident is open: the leader asks the nodes whose full evidence decides
        (``focus``) for it now, while its own look waits for fresh dumps, not after judging the compact evidence
        again.  They send what their peek of this silence saw (``full_wanted``)."""
        met, incident, judging = self.met, self.watch.incident, self.judging
        if CLUSTER in self.live.down or not met.cluster.leads() or judging.job_state is None:
            return
        want = focus(decision, judging.peeked_nodes, set(met.lost.lost()), FULL_NODES)
        if incident.opened_at is None or not want:
            return
        try:
            since = judging.job_state.fewest_issued()
            await met.evidence.open_incident(incident.opened_at, want, since=since, started_at=incident.started_at)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    async def moved(self, last_progress: float) -> None:
        """A member whose ranks moved after its latest look withdraws the evidence it shared: it is of a silence
        that ended, and the leader's next peek waits for this node's look at the new one.  On CPU, two wrappers, a
        rank skipping a collective at step 1: the member had peeked during a slow step, 0.1 s into the leader's
        silence; the leader took that look for this silence's, judged a rank stuck, and peeked again 20 s later."""
        looked_at, met = self._shared_at(), self.met
        if looked_at is None or last_progress <= looked_at:
            return
        self.judging.shared = []
        if met.cluster.leads() or CLUSTER in self.live.down:
            return
        try:
            await met.evidence.drop_own()
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    # -- at a page and at the end ----------------------------------------------

    async def hand_off(self) -> None:
        """The leader's node serves the store: before its job ends, and the store with it, the members read the
        verdict (bounded by HANDOFF_S; a member that did not says so in its own bundle)."""
        met = self.met
        if not met.cluster.leads():
            return
        try:
            waiting = await met.verdicts.handed_off()
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return
        if waiting:
            log.warning(
                "node(s) %s did not show the verdict within %.0f s; ending the job (and the store) anyway",
                ", ".join(map(str, waiting)),
                HANDOFF_S,
            )

    async def _leave_evidence(self, met: Met, job_failed: bool) -> None:
        """Before saying the job ended here: where it failed, this node's last evidence (which ranks went, when), for
        the leader, whose ranks now wait for this node's (torchrun ends a node whose rank died, and the H200's
        pipeline x DP job on two wrappers was paged as its two ranks stuck); where it ended well, none."""
        try:
            if not job_failed:
                await met.evidence.drop_own()
                return
            view = self.live.view(self.watch.clock())
            stall = Stall(
                at=view.observed_at,
                stalled_for_s=view.stalled_for,
                stall_timeout_s=view.stall_timeout,
                progress_timeout_s=self.live.settings.progress_timeout,
            )
            self.judging.shared = self.judging.compact([], stall)
            await met.evidence.share("compact", self.judging.shared, stall.at)
        except StoreError:
            pass  # the store went with the job (its node's torchrun): the lifeline tells the rest

    async def farewell(self, job_failed: bool, paged: bool) -> tuple[Decision, str] | None:
        """The job ended here (the sidecar folded its queue first): say so to the other nodes.  If it failed and
        the store is gone too, the store's node is lost when its lifeline does not answer (its ranks' peers fail at
        once when it dies, so no hang is ever seen here): the decision to page, and the line that says why.
        ``paged``: this node paged a hang already."""
        met = self.met
        self._took_store = met.cluster.serves_store and (job_failed or paged)
        if not met.cluster.leads() and not paged:
            await self._leave_evidence(met, job_failed)
        reason = await exchange_or_degrade(met.cluster, self._summary())
        if reason is None or not job_failed or paged or met.verdicts.unread():
            return None  # an unread verdict: the leader paged the hang and ended its job, the store with it
        self.watch.emit(SourceDown(source=CLUSTER, reason=reason))
        self.judging.store_node_lost = lost = await met.lost.store_node_lost()
        if lost is None:
            return None
        failed = Finding(Verdict.inconclusive, "this node's ranks failed after the job's store went away")
        decision = degraded(with_lost_nodes(Decision(failed, page=True), {lost.node: lost}, {}, why=STORE_GONE), reason)
        return decision, f"the job's store is gone and node {lost.node} ({lost.host}), which served it, does not answer"

    # -- the performance looks ---------------------------------------------------

    def perf_sharing(self) -> PerfSharing | None:
        """The performance looks are shared while the store answers."""
        return self.met.perf if CLUSTER not in self.live.down else None
