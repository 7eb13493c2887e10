"""The node's sidecar: sources -> one consumer -> stall check -> probe -> verdict -> report.

Lifecycle, top to bottom: ``run`` starts one supervised task per source (a
source that raises is restarted with backoff and reported down), then calls
``tick`` every poll until ``stop``.  A tick folds queued events into the
``LiveJob`` and feeds the incident state machine (``incident.py``) the
clock; the machine answers with actions, which the tick performs: probe
(``Prober``: dumps, stacks, GPU sample), page (the ``Reporter`` writes the
verdict and the bundle, then the alert goes out), resolve, or say a line on
the terminal.  Every probe's inputs go to the journal, so ``ncclwatch
analyze`` replays the same decision offline.  While no incident is open, a
task beside the ticks takes the performance look (``live/performance_look.py``): its new
findings are logged and paged only where the operator asked for them, never
through the reporter (a slow job is not a hang: no bundle, no kill).  With
several nodes each look is shared through the store and the leader judges
the job's collectives (``JobLook``).

With several nodes (``cluster``) the leader's sidecar judges the whole job
from every node's compact evidence and the full evidence of the few nodes
that decide; the others share theirs, hold, and follow the leader's verdict
(``on_verdict``): one verdict, one page.  Without the store each judges
alone, asks whether the store's node is lost (``node_lost``), and one
node, elected through the lifelines, pages.  ``farewell`` does the same when
the job fails here after the store went away.

Sources, prober, reporter, performance look and clock are injected: a test
drives the sidecar tick by tick with scripted events and a fake clock, no
sleeps.  Nothing here raises out of ``run`` for bad input: a broken source
is a ``SourceDown``; a broken probe is a missing piece of evidence; a broken
reporter or performance look is logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TextIO

from ncclwatch.watchdog.cluster.judge import STORE_GONE, degraded, focus, incident_key, job_state, unread_verdict, with_lost_nodes
from ncclwatch.watchdog.cluster.lifeline import LINGER_S, STORE_GONE_LINGER_S, Lifeline
from ncclwatch.watchdog.cluster.payload import TAIL_SHARED_MAX
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
from ncclwatch.watchdog.cluster.perf_records import PerfRecord
from ncclwatch.watchdog.cluster.store import StoreError
from ncclwatch.watchdog.cluster.view import HOT_S, PUBLISH_S, Contact, NodeSummary
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.hang.classify import Decision, judge
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.slowness.findings import pages
from ncclwatch.watchdog.slowness.engine import PerfHealth
from ncclwatch.watchdog.hang.report import ActionRecord, Report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.events import Event, SourceDown, SourceUp, Stall, WorkerSeen
from ncclwatch.watchdog.live.health import Health, health_of
from ncclwatch.watchdog.live.bundle import amend_bundle, live_report
from ncclwatch.watchdog.live.incident import WATCHING, Incident, Page, Phase, Probe, Resolve, Say, on_probe, on_tick, on_verdict
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.live.journal import Journal, live_inputs
from ncclwatch.watchdog.live.performance_look import JobLook, PerfWatch
from ncclwatch.watchdog.live.prober import PRIME_EXCUSE_S, Prober
from ncclwatch.watchdog.response.policy import Plan, Response
from ncclwatch.watchdog.sinks.alert import Alert, resolve_for, trigger_from_finding, trigger_from_report
from ncclwatch.watchdog.sinks.delivery import Dispatcher

log = logging.getLogger("ncclwatch")

PERF_RESOLVE_LOOKS = 2
QUIET_LOG_S = 10.0  # -v: every this many seconds of a quiet job, its stall timeout and why

STOP_GRACE_S = 5.0


def _judge_at(state: JobState, at: float) -> Decision:
    return judge(take_snapshot(state, observed_at=at))


class Source(Protocol):
    name: str

    async def run(self, emit: Callable[[Event], None]) -> None: ...


@dataclass
class Reported:
    """A paged incident: what was said, where the bundle is, the alert to resolve."""

    started_at: float
    decision: Decision
    report: Report
    bundle: Path | None = None
    alert: Alert | None = None  # the trigger sent, so that progress can resolve it


# (the live report, the decision it says, the view it was taken from) -> the report as written and the bundle
# (None when it could not be written).  The sidecar builds the report: the response is planned from it first.
Reporter = Callable[[Report, Decision, LiveView], Awaitable[tuple[Report, Path | None]]]


class Responder(Protocol):
    """What to do about a paged hang, and doing it (``launcher/respond.py``): restart, kill, drain, hook."""

    restarts: int

    def plan(self, report: Report, restarts_done: int) -> Plan: ...

    def follow(self, response: str, why: str, restarts_done: int) -> Plan: ...

    async def carry_out(self, plan: Plan, report: Report, bundle: Path | None, workers: Sequence[int], pages: bool) -> list[ActionRecord]: ...


@dataclass
class Restarting:
    """A restart asked for: the paged incident, resolved by the new round's first progress."""

    reported: Reported
    at: float  # when the workers were ended
    round: int  # torchrun's restart count of the round that hung
    number: int | None
    of: int | None


ClusterFactory = Callable[[Membership, str], Cluster]


@dataclass
class Sidecar:
    settings: Settings
    job_name: str
    sources: Sequence[Source]
    prober: Prober
    reporter: Reporter
    journal: Journal | None = None
    out: TextIO | None = None
    dispatcher: Dispatcher | None = None  # alerts (PagerDuty, Slack, webhooks); None: none configured
    bundle_base_url: str | None = None  # where the bundle API is reachable, for links in alerts
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    clock: Callable[[], float] = time.time
    join_cluster: ClusterFactory | None = None  # several nodes: meet the other sidecars through the job's store
    perf: PerfWatch | None = None  # bandwidth, arrival skew, transports while healthy; None: not looked at
    responder: Responder | None = None  # restart, kill, drain, hook after a page; None: report only

    def __post_init__(self) -> None:
        self.live = LiveJob(self.settings, started_at=self.clock())
        self.queue: asyncio.Queue[tuple[Event, float]] = asyncio.Queue()
        self.incident: Incident = WATCHING
        self.reported: list[Reported] = []  # every incident that was paged, oldest first
        self._stopping = asyncio.Event()
        self._positions: dict[int, int] | None = None  # collectives each rank had issued at the last look
        self._positions_of: float | None = None  # the incident (its opening time) those positions belong to
        self.cluster: Cluster | None = None  # once the workers say the job spans several nodes
        self._job_wide: JobState | None = None  # the latest probe's state merged with the other nodes' evidence
        self._probed: list[Event] = []  # the latest probe's events (Flight Recorder dumps travel to the other nodes)
        self._perf_pages: dict[str, Alert] = {}  # finding key -> its open page
        self._perf_unseen: dict[str, int] = {}  # finding key -> looks in a row without it
        self._shared: list[Event] = []  # what this node shared at its latest probe (its full evidence on request)
        self._store_node_lost: Contact | None = None  # found lost through its lifeline, the store being gone
        self._lifeline: Lifeline | None = None
        self._wake = asyncio.Event()  # the incident's phase changed: exchange now, not at the next round
        self._followed: LeaderVerdict | None = None  # the leader's latest verdict, with the response to carry out
        self._restart: Restarting | None = None  # a restart asked for, until the new round moves
        self._quiet_said = 0.0  # how long the job had been quiet when -v last said so

    # -- lifecycle ---------------------------------------------------------

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._supervise(s), name=f"source:{s.name}") for s in self.sources]
        if self.join_cluster is not None:
            tasks.append(asyncio.create_task(self._cluster_loop(), name="cluster"))
        if self.perf is not None:
            tasks.append(asyncio.create_task(self._perf_loop(), name="performance"))
        try:
            while not self._stopping.is_set():
                await self.tick()
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.settings.poll_interval)
                except TimeoutError:
                    pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._drain()
            if self._lifeline is not None:
                # A node whose job failed a moment after this one's must still find it alive (``lifeline``);
                # without the store, the nodes elect who pages by who answers: longer.
                await asyncio.sleep(STORE_GONE_LINGER_S if "cluster" in self.live.down else LINGER_S)
                await self._lifeline.close()

    def stop(self) -> None:
        self._stopping.set()

    def emit(self, event: Event) -> None:
        self.queue.put_nowait((event, self.clock()))

    async def _supervise(self, source: Source) -> None:
        backoff = 1.0
        while True:
            try:
                await source.run(self.emit)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one broken source must not stop the others
                log.exception("source %s failed", source.name)
                self.emit(SourceDown(source=source.name, reason=f"{type(exc).__name__}: {exc}"))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _cluster_loop(self) -> None:
        """Find the other nodes' sidecars once the workers name the store; publish, read the view, follow it."""
        assert self.join_cluster is not None
        down: str | None = None
        while True:
            if self.cluster is None and (membership := Membership.of(self.live.state)) is not None:
                await self._join(membership)
            if self.cluster is not None:
                reason = await exchange_or_degrade(self.cluster, self._summary())
                if reason != down:
                    self.emit(SourceDown(source="cluster", reason=reason) if reason else SourceUp(source="cluster"))
                    down = reason
                if reason is None:
                    await self._follow(self.cluster)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), HOT_S if self._hot() else PUBLISH_S)
            except TimeoutError:
                pass

    async def _join(self, membership: Membership) -> None:
        assert self.join_cluster is not None
        self.cluster = cluster = self.join_cluster(membership, self.host)
        log.info("node %d of %d; sidecars meet in the store at %s:%d", membership.node_rank, membership.nnodes,
                 membership.store_host, membership.store_port)  # fmt: skip
        self._lifeline = Lifeline(membership.node_rank, lambda: "running" if self.live.view(self.clock()).alive else "ended")
        try:
            cluster.lifeline_port = await self._lifeline.start()
        except OSError as exc:
            log.warning("no lifeline (%s): without the store, the other nodes will take this one for lost", exc)
            self._lifeline = None

    def _hot(self) -> bool:
        """Exchange every HOT_S while a stall is judged (``Cluster.hurry``): requests and verdicts travel fast."""
        return self.cluster is not None and self.cluster.hurry()

    async def _follow(self, cluster: Cluster) -> None:
        """Send the full evidence the leader asks for; page the leader's verdict; close the leader's incident."""
        try:
            if (opened := cluster.full_wanted()) is not None and self._shared:
                await cluster.share("full", self._shared, self._shared_at())
                cluster.full_shared(opened)
            if cluster.leads():
                if cluster.view is not None and cluster.view.incident is not None and self.incident.phase in (Phase.watching, Phase.resolved):
                    await cluster.close_incident()
            elif (verdict := await cluster.read_verdict()) is not None:
                decision = verdict.decision
                log.info("node %d's job-wide verdict %s (%s)", cluster.leader(), decision.finding.verdict, verdict.key)
                await cluster.drop_own_evidence()
                view = self.live.view(self.clock())
                self._followed = verdict
                self.incident, actions = on_verdict(self.incident, view.observed_at, decision, view.last_progress)
                await cluster.publish_summary(self._summary())  # the leader waits for this before ending its job
                await self._perform(actions, view)
        except StoreError as exc:
            self.emit(SourceDown(source="cluster", reason=str(exc)))

    def _follow_restart(self, restart: Restarting) -> bool:
        """After a restart: nothing to watch until torchrun starts the new round (then a fresh incident); its
        first progress resolves the page.  True once the new round is watched."""
        if self.live.state.current_round() <= restart.round:
            return False  # the old round's workers, dying: their silence is ours
        if self.incident.phase is Phase.paged:
            self.incident = WATCHING
            self._say(f"restart {restart.number} of {restart.of}: the new round's ranks are up; watching them")
        if self.live.moved_since(restart.at):
            self._restart = None
            self.resolve(restart.reported, f"training again after restart {restart.number} of {restart.of}")
            self._say(f"training again after restart {restart.number} of {restart.of}")
        return True

    def _shared_at(self) -> float:
        return next((e.at for e in reversed(self._shared) if isinstance(e, Stall)), self.clock())

    def _summary(self) -> NodeSummary:
        view = self.live.view(self.clock())
        assert self.cluster is not None
        phase = self.incident.phase.value if view.alive or not view.workers else "ended"
        return NodeSummary(
            node=self.cluster.me, host=self.host, at=view.observed_at, ranks=[w.rank for w in view.workers],
            last_progress=view.last_progress, phase=phase, world_size=self.live.state.world_size(),
            started_at=self.live.started_at,
        )  # fmt: skip

    def _drain(self) -> None:
        while not self.queue.empty():
            event, at = self.queue.get_nowait()
            self.live.apply(event, at)

    # -- detection ---------------------------------------------------------

    async def tick(self) -> None:
        """Fold what arrived, advance the incident, perform what it asks."""
        self._drain()
        view = self.live.view(self.clock())
        if self._restart is not None and not self._follow_restart(self._restart):
            return
        if not view.workers or not view.alive:
            return
        if view.stalled_for < view.stall_timeout and view.learned_gap is not None:
            if self.prober.prime(view.workers):
                self.live.excuse(view.observed_at, PRIME_EXCUSE_S)
        timeout = view.stall_timeout
        if view.stalled_for >= self._quiet_said + QUIET_LOG_S:
            # -v: a quiet job below its stall timeout says why it is not probed yet (the warm-up timeout, a long gap)
            self._quiet_said = view.stalled_for
            log.info("quiet for %.0f s; stall timeout %.1f s (learned gap %s, %d advances)", view.stalled_for,
                     view.stall_timeout, view.learned_gap, view.advances)  # fmt: skip
        elif view.stalled_for < QUIET_LOG_S:
            self._quiet_said = 0.0
        if self.cluster is not None and self.cluster.peer_suspects():
            # Another node is probing a stall and waits for this node's evidence: look now, not at our own timeout.
            timeout = min(timeout, self.settings.stall_timeout_floor)
        before = self.incident.phase
        self.incident, actions = on_tick(self.incident, view.observed_at, view.last_progress, view.stalled_for, timeout)
        if self.incident.phase is not before:
            self._wake.set()
        if self.incident.phase is Phase.suspect and actions:
            log.info("stall: nothing moved for %.1f s (stall timeout %.1f s, learned gap %s)", view.stalled_for, view.stall_timeout, view.learned_gap)
        await self._perform(actions, view)

    async def _perform(self, actions: list, view: LiveView) -> None:  # type: ignore[type-arg]
        for action in actions:
            if isinstance(action, Probe):
                await self._probe(view, confirming=action.confirming)
            elif isinstance(action, Say):
                self._say(action.text)
            elif isinstance(action, Resolve):
                self._resolve_latest(action.why)
            elif isinstance(action, Page):
                await self._page(action.decision, view)

    async def _probe(self, view: LiveView, confirming: bool) -> None:
        if self._positions_of != self.incident.opened_at:
            self._positions, self._positions_of = None, self.incident.opened_at  # each incident compares from its first look
        events = await self.prober.probe(view.workers, with_gpus=not confirming, stalled_since=view.last_progress)
        now = self.clock()
        for event in events:
            self.live.apply(event, now)
        view = self.live.view(now)
        moved = self._moved()
        stall = Stall(
            at=now, stalled_for_s=view.stalled_for, stall_timeout_s=view.stall_timeout,
            progress_timeout_s=self.settings.progress_timeout,
        )  # fmt: skip
        self.live.apply(stall, now)
        if self.journal is not None:
            self.journal.record(self.live.state, stall)
        self._probed = events
        decision = await self._judge(stall)
        f = decision.finding
        log.info("probe: %s culprits %s page=%s held=%s moved=%s", f.verdict, f.culprits, decision.page, decision.held, moved)
        self.incident, actions = on_probe(self.incident, now, decision, moved, view.stalled_for)
        await self._perform(actions, view)

    async def _judge(self, stall: Stall) -> Decision:
        """This node's view, or the whole job's: the leader judges it, the others share and wait for it."""
        cluster = self.cluster
        if cluster is None:
            return _judge_at(self.live.state, stall.at)
        if "cluster" in self.live.down:
            return await self._judge_without_store(cluster, stall, self.live.down["cluster"])
        self._shared = live_inputs(self.live.state) + self.live.state.sequence_tails(TAIL_SHARED_MAX) + self._probed + [stall]
        try:
            if cluster.leads():
                return await self._judge_job(cluster, stall)
            await cluster.share("compact", self._shared, stall.at)
        except StoreError as exc:
            self.emit(SourceDown(source="cluster", reason=str(exc)))
            return await self._judge_without_store(cluster, stall, str(exc))
        alone = _judge_at(self.live.state, stall.at)
        return replace(alone, page=False, held=f"node {cluster.leader()} judges the whole job; waiting for its verdict")

    async def _judge_job(self, cluster: Cluster, stall: Stall) -> Decision:
        """The leader: every node's compact evidence, then the full evidence of the nodes that decide."""
        started = self.incident.started_at if self.incident.started_at is not None else stall.at
        opened = self.incident.opened_at if self.incident.opened_at is not None else stall.at
        await cluster.open_incident(opened)
        answering = cluster.answering()
        remote = await cluster.gather("compact", answering, since=started, wait_s=EVIDENCE_WAIT_S)
        self._job_wide = job_state(self.live.state, remote, stall)
        decision = _judge_at(self._job_wide, stall.at)
        nodes_of = {e.rank: node for node, events in remote.items() for e in events if isinstance(e, WorkerSeen)}
        if want := focus(decision, nodes_of, set(cluster.lost()), FULL_NODES):
            await cluster.open_incident(opened, want, since=self._job_wide.fewest_issued())
            remote |= await cluster.gather("full", set(want), since=started, wait_s=FULL_WAIT_S)
            self._job_wide = job_state(self.live.state, remote, stall)
            decision = _judge_at(self._job_wide, stall.at)
        decision = with_lost_nodes(decision, cluster.lost(), remote)
        if pending := sorted(answering - set(remote)):
            # Their sidecar still publishes but has not probed yet (a longer learned timeout): look again.
            decision = replace(decision, page=False, held=f"waiting for node {', '.join(map(str, pending))} to share its evidence")
        if not decision.page:  # held (a pause, a busy rank): the members go back to their usual pace
            await cluster.open_incident(opened, judging=False)
        return decision

    async def _judge_without_store(self, cluster: Cluster, stall: Stall, why: str) -> Decision:
        """This node's ranks alone; the store's node named lost when its lifeline does not answer either.  Where
        the leader had announced its verdict and the store went (the leader ended its job) before this node read
        it, the leader paged: this node's view is said to be only that, and no node is lost."""
        decision = degraded(_judge_at(self.live.state, stall.at), why)
        if (announced := cluster.unread_verdict()) is not None:
            return unread_verdict(decision, cluster.leader(), announced)
        self._store_node_lost = await cluster.store_node_lost()
        if self._store_node_lost is None:
            return decision
        return with_lost_nodes(decision, {self._store_node_lost.node: self._store_node_lost}, {}, why=STORE_GONE)

    def _moved(self) -> bool:
        """Did any rank issue a collective since the last look (Flight Recorder)?  That is progress."""
        positions: dict[int, int] = {}
        for comm in self.live.state.comms.values():
            if comm.source == "flight_recorder":
                for seq in comm.ranks.values():
                    positions[seq.rank] = positions.get(seq.rank, 0) + seq.total
        before, self._positions = self._positions, positions
        moved = {r for r, n in positions.items() if before is not None and n > before.get(r, n)}
        if moved:
            log.info("ranks %s issued collectives since the last look: progress, not a hang", sorted(moved))
            self.live.mark_progress(moved, self.clock())
        return bool(moved)

    async def _page(self, decision: Decision, view: LiveView) -> None:
        started_at = self.incident.started_at if self.incident.started_at is not None else view.last_progress
        cluster = self.cluster
        job_wide = cluster is not None and "cluster" not in self.live.down
        state = self._job_wide if job_wide and self._job_wide is not None else self.live.state
        snapshot = take_snapshot(state, observed_at=self.clock())
        key = incident_key(cluster.membership, decision) if cluster is not None else None
        following = job_wide and cluster is not None and not cluster.leads()
        report = live_report(
            decision.finding, snapshot, view, job=self.job_name, host=self.host, started_at=started_at, held=decision.held
        ).model_copy(update={"incident_key": key})
        plan = self._plan(report, following)
        if job_wide and cluster is not None and key is not None and cluster.leads():
            try:  # before the bundle: the members page (and restart or end their ranks) meanwhile
                await cluster.publish_verdict(key, decision, plan.response.value if plan else None, plan.why if plan else "")
            except StoreError as exc:
                self.emit(SourceDown(source="cluster", reason=str(exc)))
        # Without the store, one node pages: elected before the bundle, while the others' lifelines still answer.
        lost = {self._store_node_lost.node} if self._store_node_lost is not None else set()
        announced = cluster.unread_verdict() if cluster is not None and not job_wide else None
        pages = job_wide or cluster is None or (announced is None and await cluster.pages_alone(lost))
        try:
            report, bundle = await self.reporter(report, decision, view)
        except Exception:  # a broken sink must not end the watch: the job may hang again
            log.exception("reporting the hang failed")
            return
        if plan is not None:
            report = report.model_copy(update={"response": plan.headline()})
        reported = Reported(started_at=started_at, decision=decision, report=report, bundle=bundle)
        self.reported.append(reported)
        pager = not following and pages
        if following and cluster is not None:
            self._say(f"node {cluster.me}: this node's evidence is in its bundle; node {cluster.leader()} pages the job-wide verdict")
        elif announced is not None and cluster is not None:
            self._say(f"node {cluster.me}: node {cluster.leader()} paged its job-wide verdict ({announced}), which this node "
                      "could not read before the store went away; this node's own evidence is in its bundle")  # fmt: skip
        elif not pages:
            self._say(f"node {cluster.me if cluster else '?'}: the store is gone; this node's evidence is in its bundle, "
                      "and a lower node that answers pages")  # fmt: skip
        else:
            self._alert(reported)
        if plan is not None:
            if plan.ends_job and job_wide and cluster is not None and cluster.leads():
                await self._hand_off(cluster)
            await self._respond(plan, reported, view, pager)

    async def _hand_off(self, cluster: Cluster) -> None:
        """The leader's node serves the store: before its job ends, and the store with it, the members read the
        verdict (bounded by HANDOFF_S; a member that did not says so in its own bundle)."""
        try:
            waiting = await cluster.handed_off()
        except StoreError as exc:
            self.emit(SourceDown(source="cluster", reason=str(exc)))
            return
        if waiting:
            log.warning("node(s) %s did not show the verdict within %.0f s; ending the job (and the store) anyway",
                        ", ".join(map(str, waiting)), HANDOFF_S)  # fmt: skip

    def _plan(self, report: Report, following: bool) -> Plan | None:
        """The response: the leader's when following its verdict, else the policy's on this node's report of the hang."""
        if self.responder is None:
            return None
        restarts_done = self.live.state.current_round()
        if following and self._followed is not None and self._followed.response is not None:
            return self.responder.follow(self._followed.response, self._followed.why, restarts_done)
        return self.responder.plan(report, restarts_done)

    async def _respond(self, plan: Plan, reported: Reported, view: LiveView, pager: bool) -> None:
        """Carry the plan out; what was done goes into the report, the bundle and, for a restart, the watch."""
        assert self.responder is not None
        if plan.response is not Response.report:
            self._say(plan.headline() if plan.response is Response.kill else f"{plan.headline()}: {plan.why}")
        try:
            actions = await self.responder.carry_out(plan, reported.report, reported.bundle, [w.pid for w in view.alive], pager)
        except Exception:  # the page is out; a failed action is logged, never the end of the watch
            log.exception("carrying out %s failed", plan.response.value)
            return
        reported.report = reported.report.model_copy(update={"actions": [*reported.report.actions, *actions]})
        if reported.bundle is not None and actions:
            try:
                await amend_bundle(reported.bundle, reported.report)
            except OSError as exc:
                log.warning("could not add what was done to the bundle %s: %s", reported.bundle, exc)
        if plan.response is Response.restart:
            self._restart = Restarting(reported, self.clock(), self.live.state.current_round(), plan.restart_number, plan.max_restarts)

    async def farewell(self, job_failed: bool) -> None:
        """The job ended here.  Say so to the other nodes; if it failed and the store is gone too, page the
        store's node as lost when its lifeline does not answer (its ranks' peers fail at once when it dies, so
        no hang is ever seen here)."""
        cluster = self.cluster
        if cluster is None:
            return
        self._drain()
        reason = await exchange_or_degrade(cluster, self._summary())
        if reason is None or not job_failed or any(r.decision.page for r in self.reported) or cluster.unread_verdict():
            return  # an unread verdict: the leader paged the hang and ended its job, the store with it
        self.emit(SourceDown(source="cluster", reason=reason))
        self._drain()
        self._store_node_lost = lost = await cluster.store_node_lost()
        if lost is None:
            return
        failed = Finding(Verdict.inconclusive, "this node's ranks failed after the job's store went away")
        decision = degraded(with_lost_nodes(Decision(failed, page=True), {lost.node: lost}, {}, why=STORE_GONE), reason)
        view = self.live.view(self.clock())
        self.incident = Incident(Phase.paged, started_at=view.last_progress, opened_at=view.observed_at, decision=decision)
        self._say(f"the job's store is gone and node {lost.node} ({lost.host}), which served it, does not answer")
        await self._page(decision, view)

    async def perf_tick(self) -> None:
        """The performance look, when one is due and no incident is open.

        ``run`` calls it from a task of its own, beside ``tick``: a look waits
        seconds for dumps (and, on the leader, for the other nodes' records),
        which must never delay the watch for hangs.
        """
        if self.perf is None or self.incident.phase is not Phase.watching:
            return
        view = self.live.view(self.clock())
        if view.workers and view.alive and self.perf.due(view.observed_at):
            await self._look_at_performance(view)

    async def _perf_loop(self) -> None:
        while True:
            await self.perf_tick()
            await asyncio.sleep(self.settings.poll_interval)

    async def _look_at_performance(self, view: LiveView) -> None:
        """One performance look; each new finding is one log line, and a page where its ``page_on_*`` setting says so."""
        assert self.perf is not None
        cluster = self.cluster
        job = None
        if cluster is not None and "cluster" not in self.live.down:  # several nodes: share the look, the leader judges
            job = JobLook(cluster.me, self._exchange_perf)
        try:
            new = await self.perf.look(view.workers, self.live.state.global_ranks(), self.host, view.observed_at, job)
        except Exception:  # the look is a nicety; the watch for hangs goes on
            log.exception("performance look failed")
            return
        # The job's start, not this sidecar's: whichever node leads pages a finding under the same key.
        run_started_at = cluster.job_started_at(self.live.started_at) if cluster is not None else self.live.started_at
        for finding in new:
            through = f" (links: {', '.join(finding.links)})" if finding.links else ""
            log.warning("performance: %s: %s%s", finding.kind.value, finding.summary, through)
            if self.dispatcher is not None and pages(finding, self.settings):
                alert = trigger_from_finding(finding, job=self.job_name, host=self.host, run_started_at=run_started_at)
                self.dispatcher.submit(alert)
                self._perf_pages[finding.key] = alert
        self._resolve_perf_pages_gone({f.key for f in self.perf.findings()})

    def _resolve_perf_pages_gone(self, seen: set[str]) -> None:
        """A paged finding absent from two looks in a row is over (one look may miss a rank's dump)."""
        for key in list(self._perf_pages):
            self._perf_unseen[key] = 0 if key in seen else self._perf_unseen.get(key, 0) + 1
            if self._perf_unseen[key] >= PERF_RESOLVE_LOOKS:
                self.resolve_performance(key, "not seen at the last two performance looks")

    def resolve_performance(self, key: str | None = None, why: str = "the job ended") -> None:
        """Close the page of one performance finding (``key``), or of all of them."""
        for open_key in [key] if key is not None else list(self._perf_pages):
            alert = self._perf_pages.pop(open_key, None)
            self._perf_unseen.pop(open_key, None)
            if alert is not None and self.dispatcher is not None:
                self.dispatcher.submit(resolve_for(alert, why))

    async def _exchange_perf(self, record: PerfRecord) -> Mapping[int, PerfRecord] | None:
        """Share this node's look; the leader gets the other nodes' records, a member None, and a store that
        fails mid-way leaves this node judging alone (an empty mapping), as when it cannot be reached."""
        assert self.cluster is not None and self.perf is not None
        try:
            return await self.cluster.exchange_perf(record, self.perf.interval)
        except StoreError as exc:
            self.emit(SourceDown(source="cluster", reason=str(exc)))
            return {}

    def _alert(self, reported: Reported) -> None:
        """Page (delivery is retried and spooled by the dispatcher)."""
        if self.dispatcher is None:
            return
        bundle = reported.bundle
        bundle_id = bundle.name.removesuffix(".tar.gz") if bundle else None
        if bundle_id and self.bundle_base_url:
            url = f"{self.bundle_base_url.rstrip('/')}/bundles/{bundle_id}"
        else:
            url = bundle.resolve().as_uri() if bundle else None
        reported.alert = trigger_from_report(reported.report, bundle_id=bundle_id, bundle_url=url)
        self.dispatcher.submit(reported.alert)

    def _resolve_latest(self, why: str) -> None:
        if self.reported:
            self.resolve(self.reported[-1], why)

    def resolve(self, reported: Reported, why: str) -> None:
        if self.dispatcher is not None and reported.alert is not None:
            self.dispatcher.submit(resolve_for(reported.alert, why))
            reported.alert = None

    def health(self) -> Health:
        """Now, for metrics and the status API."""
        decision = self.incident.decision
        return health_of(
            self.live,
            self.clock(),
            job=self.job_name,
            host=self.host,
            verdict=decision.finding.verdict.value if decision else None,
            culprits=decision.finding.culprits if decision else (),
            hang=self.incident.phase is Phase.paged,
            bundles_written=sum(1 for r in self.reported if r.bundle is not None),
            restarts=self.responder.restarts if self.responder is not None else 0,
            perf=self.perf.health if self.perf is not None else PerfHealth(),
        )

    def _say(self, text: str | None) -> None:
        if text and self.out is not None:
            print(f"ncclwatch: {text}", file=self.out, flush=True)
