"""Who judges a stall: this node alone (``NodeJudging``), or the whole job through its store (``ClusterJudging``).

The sidecar asks its ``Judging`` for the decision at every probe (``judge``) and, when it pages, the few things
that differ with several nodes: whether the verdict is the whole job's (``job_wide``), whether this node only
follows the leader's page (``follows``), the state the report is taken from, the incident key, publishing the
verdict with the response every node carries out, and which node pages when this one does not
(``paged_elsewhere``).  It never needs to know which of the two it has.

Several nodes: ``run`` meets the other nodes' sidecars once the workers name the store, then publishes this
node's summary and reads the job's view every PUBLISH_S (HOT_S while a stall is judged).  The leader's sidecar
judges the whole job from every node's compact evidence and the full evidence of the few nodes that decide; the
others share theirs, hold, and follow the leader's verdict (``Watch.follow_verdict``): one verdict, one page.
Without the store each judges alone, asks whether the store's node is lost (``store_node_lost``), and one node,
elected through the lifelines, pages.  ``farewell`` does the same when the job fails here after the store went
away.

Proof (``Proof``): which decisions prove a hang by themselves, so the incident pages them at once and without a
second look (``incident.py``), and whether the streamed state (NCCL logs, workers' /proc) already holds one before
any probe.  Across nodes a member's proof only opens its incident: the leader still judges the job and pages.

Failure modes: a store that fails mid-exchange is a ``SourceDown`` of the cluster source, and this node judges
its own ranks (the verdict says it is degraded); a node whose lifeline cannot listen is taken for lost by the
others once the store is gone; a leader's verdict that went unread before the store went is said, never paged
twice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ncclwatch.watchdog.cluster.judge import (
    STORE_GONE,
    JobEvidence,
    degraded,
    focus,
    unread_verdict,
    with_lost_nodes,
)
from ncclwatch.watchdog.cluster.judge import incident_key as job_incident_key
from ncclwatch.watchdog.cluster.lifeline import LINGER_S, STORE_GONE_LINGER_S, Lifeline
from ncclwatch.watchdog.cluster.payload import TAIL_SHARED_MAX, paused_gc
from ncclwatch.watchdog.cluster.peers import (
    EVIDENCE_WAIT_S,
    FULL_NODES,
    FULL_WAIT_S,
    HANDOFF_S,
    Cluster,
    LeaderVerdict,
    Membership,
    exchange_or_degrade,
)
from ncclwatch.watchdog.cluster.store import StoreError
from ncclwatch.watchdog.cluster.view import HOT_S, PUBLISH_S, Contact, NodeSummary
from ncclwatch.watchdog.events import STOPPED_STATES, Event, SourceDown, SourceUp, Stall
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState, Worker
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.hang.verdicts import CONCLUSIVE, Verdict
from ncclwatch.watchdog.live.bundle import live_report
from ncclwatch.watchdog.live.incident import Action, Incident, Phase
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.live.journal import live_inputs
from ncclwatch.watchdog.response.policy import Plan

log = logging.getLogger("ncclwatch")

ClusterFactory = Callable[[Membership, str], Cluster]  # (membership, host) -> this node's side of the exchange
CLUSTER = "cluster"  # the source the store's reachability is reported under (``SourceDown``, ``LiveJob.down``)


PEEK_WAIT_S = 3.0  # a leader's peek waits this long for the other nodes' compact evidence of the same silence
PEEKED_HOT_S = 5.0  # a member exchanges at HOT_S this long after its peek (``ClusterJudging._hot``)
STREAMED_QUIET_S = 1.0  # the streamed state is judged once the job has been silent this long, when events came
# torchrun ends the other workers when one fails (its monitor looks every 0.1 s, then SIGTERM): a rank gone this long
# while its peers live is a hang (it exited 0 early, or its peers outlive it), not a job being torn down.
DEAD_SETTLED_S = 5.0
# A blocking py-spy or a debugger's attach stops a rank (state t) for a moment.  Below the span of the /proc samples
# a worker keeps (hang/state.py: 8, 0.5 s apart), or it would never settle.
STOPPED_SETTLED_S = 2.0
# A rank's GPU in another kernel while its peers' spin in NCCL, for this long of silence: no training kernel runs so
# long, and a rank still autotuning has not issued the collective its peers wait in.
GPU_HANG_SETTLED_S = 15.0
# The same GPU spinning on almost none of its SMs, no NCCL operation running on it (``classify._spinning``): no
# compute kernel looks so; this long of silence is three NVML looks past a step's usual gaps.  On 4 x H200 a GPU
# hang under FSDP2, TP and the pipelines otherwise waited for the stall timeout (8.3-9.4 s).
GPU_SPIN_SETTLED_S = 3.0


def judge_at(state: JobState, at: float) -> Decision:
    return classify(take_snapshot(state, observed_at=at))


class Proof:
    """Which decisions prove a hang by themselves, and whether the streamed state already holds one.

    A decision proves a hang when it pages, its verdict is conclusive in the catalogue (``CONCLUSIVE``) and a
    dead or stopped culprit is settled: gone for DEAD_SETTLED_S, stopped for STOPPED_SETTLED_S (by the /proc samples
    of the node that runs it, shared with the leader; a culprit no state holds samples of is left to the second
    look).  ``streamed`` judges what the sources streamed
    (NCCL logs, the workers' /proc states) without any probe, once the job has been silent STREAMED_QUIET_S and
    only when an event that could change a verdict came since (``LiveJob.revision``) or a culprit settles.
    """

    def __init__(self, live: LiveJob) -> None:
        self.live = live
        self._judged = -1  # the revision last judged
        self._again_at: float | None = None  # a dead or stopped culprit settles then: judge again
        self.slowest_s = 0.0  # the longest streamed judging so far (-v says when it grows past 50 ms)

    def proves(self, decision: Decision, at: float, state: JobState | None = None) -> bool:
        """``state``: the one the decision was judged on, when it is not this node's alone (the leader's, with every
        node's evidence: a stopped rank on another node is settled by that node's /proc samples)."""
        proven_at = self._proven_at(decision, at, state or self.live.state)
        return proven_at is not None and proven_at <= at

    def settles_at(self, decision: Decision, at: float, state: JobState | None = None) -> float | None:
        """When a decision that does not prove the hang yet will: its dead or stopped culprit not so long enough
        at ``at``.  None where it never will by waiting (not conclusive, or no /proc samples of the culprit)."""
        proven_at = self._proven_at(decision, at, state or self.live.state)
        return proven_at if proven_at is not None and at < proven_at < math.inf else None

    def streamed(self, view: LiveView) -> bool:
        if view.stalled_for < STREAMED_QUIET_S or view.stalled_for >= view.stall_timeout:
            return False
        revision, at = self.live.revision, view.observed_at
        if revision == self._judged and (self._again_at is None or at < self._again_at):
            return False
        self._judged, self._again_at = revision, None
        began = time.perf_counter()
        snapshot = take_snapshot(self.live.state, observed_at=at)
        decision = classify(replace(snapshot, stall=None))  # an earlier probe's stall clock says nothing of this one
        self._took(time.perf_counter() - began)
        settled = self._proven_at(decision, at, self.live.state)
        if settled is None:
            return False
        if settled > at:
            self._again_at = settled if settled < math.inf else None
            return False
        log.info(
            "streamed evidence proves a hang after %.1f s of silence: %s %s; looking now",
            view.stalled_for,
            decision.finding.verdict,
            decision.finding.culprits,
        )
        return True

    def _took(self, seconds: float) -> None:
        if seconds > max(self.slowest_s, 0.05):
            log.info("judging the streamed state took %.0f ms", seconds * 1e3)
        self.slowest_s = max(self.slowest_s, seconds)

    def _this_round(self, decision: Decision) -> bool:
        """After an elastic restart the state still holds the old round's sequences (its NCCL logs; its dumps until
        the new round's come): a mismatch proves a hang only from the current round's processes and dumps (else
        the stall timeout and the second look decide, as before any proof).  A process's own state is its round's."""
        state, finding = self.live.state, decision.finding
        current = state.current_round()
        if current == 0 or finding.verdict is not Verdict.collective_mismatch:
            return True
        comm = state.comms.get(finding.comm_key or "")
        if comm is None:
            return False
        if comm.source == "flight_recorder":
            return all(self.live.dumped_in.get((comm.key, seq.rank)) == current for seq in comm.ranks.values())
        pids = {w.pid for w in state.current_workers()}
        return all(seq.proc is not None and seq.proc.pid in pids for seq in comm.ranks.values())

    def _proven_at(self, decision: Decision, at: float, state: JobState) -> float | None:
        """When ``decision`` proves the hang (``math.inf``: not by waiting); None where it never does by itself."""
        if not decision.page or decision.finding.verdict not in CONCLUSIVE or not self._this_round(decision):
            return None
        return self._settled_at(decision, at, state)

    def _settled_at(self, decision: Decision, at: float, state: JobState) -> float:
        """When the decision's dead or stopped culprits have been so long enough, or its stuck GPU held for
        GPU_HANG_SETTLED_S of silence, GPU_SPIN_SETTLED_S where it spins (``at`` for any other verdict)."""
        verdict = decision.finding.verdict
        if verdict is Verdict.gpu_compute_hang:
            held = GPU_SPIN_SETTLED_S if decision.finding.kind == "spin" else GPU_HANG_SETTLED_S
            return self.live.last_progress() + held
        if verdict not in (Verdict.process_dead, Verdict.process_stopped):
            return at
        workers = {w.rank: w for w in state.current_workers()}
        times = []
        for rank in decision.finding.culprits:
            worker = workers.get(rank)
            since = None if worker is None else worker.gone_at if verdict is Verdict.process_dead else _stopped(worker)
            if since is None:
                return math.inf
            times.append(since + (DEAD_SETTLED_S if verdict is Verdict.process_dead else STOPPED_SETTLED_S))
        return max(times, default=at)


def _stopped(worker: Worker) -> float | None:
    """Since when the worker's /proc samples have said stopped (the oldest of the latest run of them)."""
    since = None
    for sample in reversed(worker.samples):
        if sample.state not in STOPPED_STATES:
            break
        since = sample.at
    return since


class Judging(Protocol):
    """Who judges a stall, and this node's part in paging it."""

    cluster: Cluster | None  # the other nodes' sidecars once met (the performance looks are shared through it too)
    followed: LeaderVerdict | None  # the leader's latest verdict, with the response to carry out

    async def run(self) -> None: ...  # beside the ticks for the job's life: the exchange with the other nodes
    async def close(self) -> None: ...  # the watch stopped
    def phase_changed(self) -> None: ...  # the incident moved: tell the other nodes now, not at the next round
    def peer_suspects(self) -> bool: ...  # another node probes a stall and waits for this node's evidence
    async def judge(self, stall: Stall, probed: list[Event]) -> Decision: ...
    async def peek(self, stall: Stall, probed: list[Event]) -> Decision: ...  # a quiet look: only proof counts
    async def proved(self, decision: Decision) -> None: ...  # a peek proved the hang: the probe comes next
    async def moved(self, last_progress: float) -> None: ...  # every tick: the job's latest progress here
    def job_wide(self) -> bool: ...  # a page's verdict stands for the whole job
    def follows(self) -> bool: ...  # a page's verdict is the leader's, and the leader pages it
    def report_state(self) -> JobState: ...
    def incident_key(self, decision: Decision) -> str | None: ...  # the same on every node for one hang
    async def publish_verdict(self, decision: Decision, plan: Plan | None) -> None: ...  # a job-wide verdict only
    async def paged_elsewhere(self, job_wide: bool, following: bool) -> Callable[[], str] | None: ...
    async def hand_off(self) -> None: ...  # before a job-wide response ends the job
    async def farewell(self, job_failed: bool, paged: Callable[[], bool]) -> tuple[Decision, str] | None: ...


def page_report(
    judging: Judging, decision: Decision, view: LiveView, job: str, host: str, started_at: float, at: float
) -> Report:
    """The report of a page: from the state the decision was judged on, under the incident's key."""
    snapshot = take_snapshot(judging.report_state(), observed_at=at)
    report = live_report(
        decision.finding, snapshot, view, job=job, host=host, started_at=started_at, held=decision.held
    )
    return report.model_copy(update={"incident_key": judging.incident_key(decision)})


async def gather_compact(
    cluster: Cluster, answering: set[int], since: float, wait_s: float, evidence: JobEvidence
) -> dict[int, list[Event]]:
    """The answering nodes' compact evidence of this silence, and the last evidence of nodes whose job failed
    (``ClusterJudging.farewell``): which of their ranks went, and when.  Nothing changes there after the end, so
    it counts whenever it was shared, and it is not waited for."""
    found = await cluster.gather("compact", answering, since, wait_s, fold=evidence.add)
    return found | await cluster.gather("compact", cluster.ended() - set(found), 0.0, 0.0, fold=evidence.add)


class NodeJudging:
    """One node: its ranks are the whole job; it judges them, and it pages."""

    cluster: Cluster | None = None
    followed: LeaderVerdict | None = None

    def __init__(self, live: LiveJob) -> None:
        self.live = live

    async def run(self) -> None:
        """Nothing to exchange: no other node."""

    async def close(self) -> None:
        """Nothing to close."""

    def phase_changed(self) -> None:
        """No other node to tell."""

    def peer_suspects(self) -> bool:
        return False

    async def judge(self, stall: Stall, probed: list[Event]) -> Decision:
        return judge_at(self.live.state, stall.at)

    async def peek(self, stall: Stall, probed: list[Event]) -> Decision:
        return judge_at(self.live.state, stall.at)

    async def proved(self, decision: Decision) -> None:
        """Nothing to ask of other nodes."""

    async def moved(self, last_progress: float) -> None:
        """Nothing shared."""

    def job_wide(self) -> bool:
        return False

    def follows(self) -> bool:
        return False

    def report_state(self) -> JobState:
        return self.live.state

    def incident_key(self, decision: Decision) -> str | None:
        return None

    async def publish_verdict(self, decision: Decision, plan: Plan | None) -> None:
        """No other node reads it."""

    async def paged_elsewhere(self, job_wide: bool, following: bool) -> Callable[[], str] | None:
        return None

    async def hand_off(self) -> None:
        """No other node waits for the verdict."""

    async def farewell(self, job_failed: bool, paged: Callable[[], bool]) -> tuple[Decision, str] | None:
        return None


class Watch(Protocol):
    """The node's watch (``Sidecar``), as the cluster judging reads it and hands it the leader's verdict."""

    live: LiveJob
    host: str
    incident: Incident
    clock: Callable[[], float]

    def emit(self, event: Event) -> None: ...
    def drain(self) -> None: ...  # fold the queued events into ``live`` now
    def follow_verdict(self, decision: Decision, view: LiveView) -> list[Action]: ...
    async def perform(self, actions: list[Action], view: LiveView) -> None: ...


class ClusterJudging:
    """Several nodes: the leader's sidecar judges the job from every node's evidence; the others follow it."""

    def __init__(self, watch: Watch, join: ClusterFactory) -> None:
        self.watch = watch
        self.live = watch.live
        self.join = join
        self.cluster: Cluster | None = None  # once the workers say the job spans several nodes
        self.followed: LeaderVerdict | None = None
        self.job_state: JobState | None = None  # the latest probe's state merged with the other nodes' evidence
        self._shared: list[Event] = []  # what this node shared at its latest look (its full evidence on request)
        self._peeked_nodes: dict[int, int] = {}  # rank -> node, as the leader's latest peek gathered them
        self._store_node_lost: Contact | None = None  # found lost through its lifeline, the store being gone
        self._lifeline: Lifeline | None = None
        self._took_store = False  # this node served the store and its job ended by a hang or a failure
        self._wake = asyncio.Event()  # the incident's phase changed: exchange now, not at the next round

    # -- the exchange, every round ------------------------------------------

    async def run(self) -> None:
        """Find the other nodes' sidecars once the workers name the store; publish, read the view, follow it."""
        down: str | None = None
        while True:
            if self.cluster is None and (membership := Membership.of(self.live.state)) is not None:
                await self._join(membership)
            if self.cluster is not None:
                reason = await exchange_or_degrade(self.cluster, self._summary())
                if reason != down:
                    self.watch.emit(SourceDown(source=CLUSTER, reason=reason) if reason else SourceUp(source=CLUSTER))
                    down = reason
                if reason is None:
                    await self._follow(self.cluster)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), HOT_S if self._hot() else PUBLISH_S)
            except TimeoutError:
                pass

    async def _join(self, membership: Membership) -> None:
        self.cluster = cluster = self.join(membership, self.watch.host)
        log.info(
            "node %d of %d; sidecars meet in the store at %s:%d",
            membership.node_rank,
            membership.nnodes,
            membership.store_host,
            membership.store_port,
        )
        self._lifeline = Lifeline(membership.node_rank, self._lifeline_state)
        try:
            cluster.lifeline_port = await self._lifeline.start()
        except OSError as exc:
            log.warning("no lifeline (%s): without the store, the other nodes will take this one for lost", exc)
            self._lifeline = None

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
        self._wake.set()

    def peer_suspects(self) -> bool:
        return self.cluster is not None and self.cluster.peer_suspects()

    def _hot(self) -> bool:
        """Exchange every HOT_S while a stall is judged (``Cluster.hurry``) or this node suspects one: requests and
        verdicts travel fast.  A member that suspects a stall is the one the leader will ask for its full evidence;
        at PUBLISH_S it would see the request only after the leader's wait for it ran out (two wrappers, a rank
        stopped on the member: 2.5 s of a 7.4 s page).  So does a member for PEEKED_HOT_S after a peek: where the
        leader's peek of the same silence proves the hang, it asks for this node's full evidence at once
        (``proved``), before this node suspects anything itself."""
        if self.cluster is None:
            return False
        suspects = self.watch.incident.phase in (Phase.suspect, Phase.confirming)
        looked_at = self._shared_at()
        peeked = looked_at is not None and self.watch.clock() - looked_at < PEEKED_HOT_S
        return suspects or self.cluster.hurry() or (peeked and not self.cluster.leads())

    async def _follow(self, cluster: Cluster) -> None:
        """Send the full evidence the leader asks for; page the leader's verdict; close the leader's incident."""
        try:
            if (opened := cluster.full_wanted(self._shared_at())) is not None:
                await cluster.share("full", self._shared, self._shared_at())
                cluster.full_shared(opened)
            if cluster.leads():
                watching = self.watch.incident.phase in (Phase.watching, Phase.resolved)
                if cluster.view is not None and cluster.view.incident is not None and watching:
                    await cluster.close_incident()
            elif (verdict := await cluster.read_verdict()) is not None:
                decision = verdict.decision
                log.info("node %d's job-wide verdict %s (%s)", cluster.leader(), decision.finding.verdict, verdict.key)
                await cluster.drop_own_evidence()
                view = self.live.view(self.watch.clock())
                self.followed = verdict
                actions = self.watch.follow_verdict(decision, view)
                await cluster.publish_summary(self._summary())  # the leader waits for this before ending its job
                await self.watch.perform(actions, view)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    def _shared_at(self) -> float | None:
        """When this node looked for the evidence it shared last (None: it has shared none)."""
        return next((e.at for e in reversed(self._shared) if isinstance(e, Stall)), None)

    def _summary(self) -> NodeSummary:
        view = self.live.view(self.watch.clock())
        assert self.cluster is not None
        phase = self.watch.incident.phase.value if view.alive or not view.workers else "ended"
        return NodeSummary(
            node=self.cluster.me,
            host=self.watch.host,
            at=view.observed_at,
            ranks=[w.rank for w in view.workers],
            last_progress=view.last_progress,
            phase=phase,
            world_size=self.live.state.world_size(),
            started_at=self.live.started_at,
        )

    # -- at a probe ---------------------------------------------------------

    async def judge(self, stall: Stall, probed: list[Event]) -> Decision:
        """This node's view, or the whole job's: the leader judges it, the others share and wait for it."""
        cluster = self.cluster
        if cluster is None:
            return judge_at(self.live.state, stall.at)
        if CLUSTER in self.live.down:
            return await self._judge_without_store(cluster, stall, self.live.down[CLUSTER])
        self._shared = self._compact(probed, stall)
        try:
            if cluster.leads():
                return await self._judge_job(cluster, stall)
            await cluster.share("compact", self._shared, stall.at)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return await self._judge_without_store(cluster, stall, str(exc))
        alone = judge_at(self.live.state, stall.at)
        return replace(alone, page=False, held=f"node {cluster.leader()} judges the whole job; waiting for its verdict")

    def _compact(self, probed: list[Event], stall: Stall) -> list[Event]:
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
        cluster = self.cluster
        if cluster is None or CLUSTER in self.live.down:
            return judge_at(self.live.state, stall.at)
        try:
            if not cluster.leads():
                # Kept as this node's full evidence too: where the peek proves a hang the leader asks for it at
                # once, and this node's own probe comes only at its stall timeout (two wrappers, a dtype mismatch
                # at step 1 on the H200: the leader waited 2.5 s for it, of a 6.6 s page).
                self._shared = self._compact(probed, stall)
                await cluster.share("compact", self._shared, stall.at)
                self._wake.set()  # exchange now and at HOT_S (``_hot``): the leader may open its incident next
                return judge_at(self.live.state, stall.at)
            evidence = JobEvidence(self.live.state, stall)
            with paused_gc(freeze=False):
                silence = stall.at - stall.stalled_for_s
                await gather_compact(cluster, cluster.answering(), silence, PEEK_WAIT_S, evidence)
                decision = evidence.judge()
                self.job_state = evidence.state()
                self._peeked_nodes = dict(evidence.nodes_of)
                return decision
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return judge_at(self.live.state, stall.at)

    async def proved(self, decision: Decision) -> None:
        """A peek proved the hang, and the incident is open: the leader asks the nodes whose full evidence decides
        (``focus``) for it now, while its own look waits for fresh dumps, not after judging the compact evidence
        again.  They send what their peek of this silence saw (``full_wanted``)."""
        cluster, incident = self.cluster, self.watch.incident
        if cluster is None or CLUSTER in self.live.down or not cluster.leads() or self.job_state is None:
            return
        want = focus(decision, self._peeked_nodes, set(cluster.lost()), FULL_NODES)
        if incident.opened_at is None or not want:
            return
        try:
            since = self.job_state.fewest_issued()
            await cluster.open_incident(incident.opened_at, want, since=since, started_at=incident.started_at)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    async def moved(self, last_progress: float) -> None:
        """A member whose ranks moved after its latest look withdraws the evidence it shared: it is of a silence
        that ended, and the leader's next peek waits for this node's look at the new one.  On CPU, two wrappers, a
        rank skipping a collective at step 1: the member had peeked during a slow step, 0.1 s into the leader's
        silence; the leader took that look for this silence's, judged a rank stuck, and peeked again 20 s later."""
        looked_at, cluster = self._shared_at(), self.cluster
        if looked_at is None or last_progress <= looked_at or cluster is None:
            return
        self._shared = []
        if cluster.leads() or CLUSTER in self.live.down:
            return
        try:
            await cluster.drop_own_evidence()
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    async def _judge_job(self, cluster: Cluster, stall: Stall) -> Decision:
        """The leader: every node's compact evidence, then the full evidence of the nodes that decide."""
        incident = self.watch.incident
        started = incident.started_at if incident.started_at is not None else stall.at
        opened = incident.opened_at if incident.opened_at is not None else stall.at
        await cluster.open_incident(opened, started_at=started)
        answering = cluster.answering()
        evidence = JobEvidence(self.live.state, stall)  # folded as it comes; full evidence replaces in place
        # No collection until the verdict, nor after over the evidence's millions of objects (``paused_gc``).
        with paused_gc(freeze=True):
            remote = await gather_compact(cluster, answering, started, EVIDENCE_WAIT_S, evidence)
            decision = evidence.judge()
            self.job_state = evidence.state()
            if want := focus(decision, evidence.nodes_of, set(cluster.lost()), FULL_NODES):
                await cluster.open_incident(opened, want, since=self.job_state.fewest_issued())
                remote |= await cluster.gather("full", set(want), started, FULL_WAIT_S, fold=evidence.add)
                decision = evidence.judge()
                self.job_state = evidence.state()
        lost = cluster.lost()
        decision = with_lost_nodes(decision, lost, remote)
        if pending := sorted(answering - set(remote) - set(lost)):  # one that fell silent while waited for is lost
            # Their sidecar still publishes but has not probed yet (a longer learned timeout): look again.
            waiting = f"waiting for node {', '.join(map(str, pending))} to share its evidence"
            decision = replace(decision, page=False, held=waiting)
        if not decision.page:  # held (a pause, a busy rank): the members go back to their usual pace
            await cluster.open_incident(opened, judging=False)
        return decision

    async def _judge_without_store(self, cluster: Cluster, stall: Stall, why: str) -> Decision:
        """This node's ranks alone; the store's node named lost when its lifeline does not answer either.  Where
        the leader had announced its verdict and the store went (the leader ended its job) before this node read
        it, the leader paged: this node's view is said to be only that, and no node is lost."""
        decision = degraded(judge_at(self.live.state, stall.at), why)
        if (announced := cluster.unread_verdict()) is not None:
            return unread_verdict(decision, cluster.leader(), announced)
        self._store_node_lost = await cluster.store_node_lost()
        if self._store_node_lost is None:
            return decision
        return with_lost_nodes(decision, {self._store_node_lost.node: self._store_node_lost}, {}, why=STORE_GONE)

    # -- at a page -----------------------------------------------------------

    def job_wide(self) -> bool:
        """The store answers: the verdict is the whole job's, and one node pages it."""
        return self.cluster is not None and CLUSTER not in self.live.down

    def follows(self) -> bool:
        return self.job_wide() and self.cluster is not None and not self.cluster.leads()

    def report_state(self) -> JobState:
        """The job's state as the leader merged it at its latest probe, while the store answers; else this node's."""
        return self.job_state if self.job_wide() and self.job_state is not None else self.live.state

    def incident_key(self, decision: Decision) -> str | None:
        return job_incident_key(self.cluster.membership, decision) if self.cluster is not None else None

    async def publish_verdict(self, decision: Decision, plan: Plan | None) -> None:
        """The leader's verdict, with the response every node carries out; a store that fails is the cluster
        source down, and the members then judge alone."""
        cluster = self.cluster
        if cluster is None or not cluster.leads():
            return
        key = job_incident_key(cluster.membership, decision)
        response, why = (plan.response.value, plan.why) if plan is not None else (None, "")
        try:
            await cluster.publish_verdict(key, decision, response, why)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))

    async def paged_elsewhere(self, job_wide: bool, following: bool) -> Callable[[], str] | None:
        """None where this node pages; else the line it says instead, once its bundle is written (naming the
        leader then).  Without the store, the node that pages is elected now, while the others' lifelines still
        answer: a node whose leader announced a verdict it could not read, or a lower node that answers, pages."""
        cluster = self.cluster
        if cluster is None:
            return None
        if following:
            return lambda: (
                f"node {cluster.me}: this node's evidence is in its bundle; node {cluster.leader()} "
                "pages the job-wide verdict"
            )
        if job_wide:
            return None
        if (announced := cluster.unread_verdict()) is not None:
            return lambda: (
                f"node {cluster.me}: node {cluster.leader()} paged its job-wide verdict ({announced}), "
                "which this node could not read before the store went away; this node's own evidence "
                "is in its bundle"
            )
        lost = {self._store_node_lost.node} if self._store_node_lost is not None else set()
        if await cluster.pages_alone(lost):
            return None
        return lambda: (
            f"node {cluster.me}: the store is gone; this node's evidence is in its bundle, "
            "and a lower node that answers pages"
        )

    async def hand_off(self) -> None:
        """The leader's node serves the store: before its job ends, and the store with it, the members read the
        verdict (bounded by HANDOFF_S; a member that did not says so in its own bundle)."""
        cluster = self.cluster
        if cluster is None or not cluster.leads():
            return
        try:
            waiting = await cluster.handed_off()
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return
        if waiting:
            log.warning(
                "node(s) %s did not show the verdict within %.0f s; ending the job (and the store) anyway",
                ", ".join(map(str, waiting)),
                HANDOFF_S,
            )

    async def _leave_evidence(self, cluster: Cluster, job_failed: bool) -> None:
        """Before saying the job ended here: where it failed, this node's last evidence (which ranks went, when), for
        the leader, whose ranks now wait for this node's (torchrun ends a node whose rank died, and the H200's
        pipeline x DP job on two wrappers was paged as its two ranks stuck); where it ended well, none."""
        try:
            if not job_failed:
                await cluster.drop_own_evidence()
                return
            view = self.live.view(self.watch.clock())
            stall = Stall(
                at=view.observed_at,
                stalled_for_s=view.stalled_for,
                stall_timeout_s=view.stall_timeout,
                progress_timeout_s=self.live.settings.progress_timeout,
            )
            self._shared = self._compact([], stall)
            await cluster.share("compact", self._shared, stall.at)
        except StoreError:
            pass  # the store went with the job (its node's torchrun): the lifeline tells the rest

    async def farewell(self, job_failed: bool, paged: Callable[[], bool]) -> tuple[Decision, str] | None:
        """The job ended here: say so to the other nodes.  If it failed and the store is gone too, the store's node
        is lost when its lifeline does not answer (its ranks' peers fail at once when it dies, so no hang is ever
        seen here): the decision to page, and the line that says why.  ``paged``: this node paged a hang already."""
        cluster = self.cluster
        if cluster is None:
            return None
        self.watch.drain()
        self._took_store = cluster.serves_store and (job_failed or paged())
        if not cluster.leads() and not paged():
            await self._leave_evidence(cluster, job_failed)
        reason = await exchange_or_degrade(cluster, self._summary())
        if reason is None or not job_failed or paged() or cluster.unread_verdict():
            return None  # an unread verdict: the leader paged the hang and ended its job, the store with it
        self.watch.emit(SourceDown(source=CLUSTER, reason=reason))
        self.watch.drain()
        self._store_node_lost = lost = await cluster.store_node_lost()
        if lost is None:
            return None
        failed = Finding(Verdict.inconclusive, "this node's ranks failed after the job's store went away")
        decision = degraded(with_lost_nodes(Decision(failed, page=True), {lost.node: lost}, {}, why=STORE_GONE), reason)
        return decision, f"the job's store is gone and node {lost.node} ({lost.host}), which served it, does not answer"
