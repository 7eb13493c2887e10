"""The node's sidecar: the watch's lifecycle, start, tick, stop; the other parts live beside it.

- ``run`` starts one supervised task per source (``supervision.py``), the exchange with the other nodes
  (``nodes.py``, only where the sidecar may join them) and the performance look, then calls ``tick`` every poll
  until ``stop``.
- ``tick`` folds queued events into the ``LiveJob`` (and follows the leader's verdict, which the exchange queues
  as a ``LeaderVerdict``), feeds the incident state machine (``incident.py``) the
  clock and whether the streamed state proves a hang (``judging.Proof``), and performs what it answers: probe or
  peek (``prober.py``; probes are journaled for ``ncclwatch analyze``), say a line, resolve, or page (the
  ``Reporter`` writes the verdict and the bundle, the alert goes out, then the response, ``responding.py``).
- ``stop`` ends the tasks; before it, ``farewell`` tells the other nodes that the job ended here.

Who judges a stall and who pages is the ``Judging`` (``judging.py``): this node alone, or the leader's sidecar for
the whole job through its store (``job_judging.py``: one verdict, one page).  A slow job is no hang: its findings
are ``performance_paging.py``'s.  Sources, prober, reporter, performance look and clock are injected: a test drives
the sidecar tick by tick with scripted events and a fake clock, no sleeps.  Nothing here raises out of ``run`` for
bad input: a broken source is a ``SourceDown``; a broken probe is a missing piece of evidence; a broken reporter or
look is logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import TextIO

from ncclwatch.watchdog.cluster.handoff import LeaderVerdict
from ncclwatch.watchdog.cluster.peers import Membership
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import Event, JobEnded, JobOutcome
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.live import incident as machine
from ncclwatch.watchdog.live.health import Health, health_of
from ncclwatch.watchdog.live.incident import Action, Incident, Page, Phase, Probe, Resolve, Say
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.live.journal import Journal
from ncclwatch.watchdog.live.judging import Judging, NodeJudging, Proof, judge_at, page_report
from ncclwatch.watchdog.live.nodes import ClusterFactory, Nodes
from ncclwatch.watchdog.live.performance_look import PerfWatch
from ncclwatch.watchdog.live.performance_paging import PerformancePaging
from ncclwatch.watchdog.live.prober import Prober, Probing
from ncclwatch.watchdog.live.responding import Reported, Responder, Responding
from ncclwatch.watchdog.live.supervision import Source, supervise
from ncclwatch.watchdog.sinks.alert import resolve_for
from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.slowness.engine import PerfHealth

log = logging.getLogger("ncclwatch")


# (the live report, the decision it says, the view it was taken from) -> the report as written and the bundle
# (None when it could not be written).  The sidecar builds the report: the response is planned from it first.
Reporter = Callable[[Report, Decision, LiveView], Awaitable[tuple[Report, Path | None]]]


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
    # Where the reporter will write a report's bundle: the page goes out first and links it (None: no link).
    bundle_for: Callable[[Report, LiveView], Path | None] = lambda report, view: None
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    clock: Callable[[], float] = time.time
    join_cluster: InitVar[ClusterFactory | None] = None  # several nodes: meet the other sidecars through the store
    perf: InitVar[PerfWatch | None] = None  # bandwidth, arrival skew, transports while healthy; None: not looked at
    responder: InitVar[Responder | None] = None  # restart, kill, drain, hook after a page; None: report only

    def __post_init__(
        self, join_cluster: ClusterFactory | None, perf: PerfWatch | None, responder: Responder | None
    ) -> None:
        self.live = LiveJob(self.settings, started_at=self.clock())
        # What the sources, the probes and the other nodes' part send: events, and the leader's verdict to follow.
        self.queue: asyncio.Queue[tuple[Event | LeaderVerdict, float]] = asyncio.Queue()
        self.incident = Incident()  # watching
        self.reported: list[Reported] = []  # every incident that was paged, oldest first
        self._stopping = asyncio.Event()
        self._ended: JobEnded | None = None  # torchrun exited (``job_ended``)
        self.followed: LeaderVerdict | None = None  # the leader's latest verdict, with the response to carry out
        self._to_follow: list[tuple[list[Action], LiveView]] = []  # what following it asks, for the next tick
        self.probing = Probing(self.prober, self.live, self.settings, self.journal, self.clock, self.drain)
        self.proof = Proof(self.live)
        self._join = join_cluster
        # The other nodes' sidecars, once met (``_meet``): the exchange with them, the leader's verdict to follow.
        self.nodes: Nodes | None = None
        self.judging: Judging = NodeJudging(self.live)  # the whole job's (``JobJudging``) once the nodes met
        self._tasks: list[asyncio.Task[None]] = []
        self.responding = Responding(responder, self.live, self.clock, self._say, self.resolve)
        self.performance = None if perf is None else PerformancePaging(perf, self)

    # -- lifecycle ---------------------------------------------------------

    async def run(self) -> None:
        tasks = self._tasks
        tasks += [asyncio.create_task(supervise(s, self.emit), name=f"source:{s.name}") for s in self.sources]
        if self.performance is not None:
            tasks.append(asyncio.create_task(self.performance.run(), name="performance"))
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
            self.drain()
            if self.nodes is not None:
                await self.nodes.close()

    def stop(self) -> None:
        self._stopping.set()

    def emit(self, item: Event | LeaderVerdict) -> None:
        self.queue.put_nowait((item, self.clock()))

    def drain(self) -> None:
        """Fold what arrived into ``live``; the leader's verdict moves the incident now (``on_verdict``), and the
        tick performs what that asks."""
        while not self.queue.empty():
            item, at = self.queue.get_nowait()
            if isinstance(item, LeaderVerdict):
                self._follow(item)
            else:
                self.live.apply(item, at)

    def _follow(self, verdict: LeaderVerdict) -> None:
        """The leader's job-wide verdict, paged here too: this node's bundle, its part of the response."""
        self.followed = verdict
        view = self.live.view(self.clock())
        self.incident, actions = machine.on_verdict(
            self.incident, view.observed_at, verdict.decision, view.last_progress
        )
        self._to_follow.append((actions, view))

    async def _perform_followed(self) -> None:
        """What following the leader's verdict asks (the page of this node's part), once."""
        while self._to_follow:
            actions, view = self._to_follow.pop(0)
            await self.perform(actions, view)

    async def _meet(self) -> None:
        """Once the workers name the job's store and several nodes, this sidecar meets the other nodes' sidecars:
        the exchange runs beside the ticks, and the whole job is judged from then on."""
        if self.nodes is not None or self._join is None:
            return
        membership = Membership.of(self.live.state)
        if membership is None:
            return
        self.nodes = nodes = Nodes(self, self._join(membership, self.host))
        await nodes.start()
        self.judging = nodes.judging
        self._tasks.append(asyncio.create_task(nodes.run(), name="cluster"))

    async def job_ended(self, end: JobEnded) -> None:
        """torchrun exited.  A failed job (not stopped by the user, not ended by a response of ours, nothing paged
        yet) is judged for why it failed, from what the watch holds and what the ranks left on disk, and paged with
        its bundle as a hang is; a job that ended cleanly or was stopped is no incident."""
        self.emit(end)
        self.drain()
        self._ended = end
        await self._perform_followed()  # a verdict read as the job ended: this node's bundle still, no response
        if end.outcome is not JobOutcome.failed or self.incident.phase is Phase.paged:
            return
        view = self.live.view(self.clock())
        for event in self.prober.dumps_left(view.workers, since=view.last_progress):
            self.live.apply(event, view.observed_at)
        decision = judge_at(self.live.state, view.observed_at)
        if not decision.page:
            self._say(f"the job failed (exit status {end.returncode}); {decision.finding.summary}")
            return
        self.incident, actions = machine.on_verdict(self.incident, view.observed_at, decision, view.last_progress)
        await self.perform(actions, view)

    async def farewell(self, job_failed: bool) -> None:
        """The job ended here: the other nodes are told; a failure after the store went away may page the store's
        node as lost (``Nodes.farewell``)."""
        if self.nodes is None:
            return
        self.drain()
        lost = await self.nodes.farewell(job_failed, paged=any(r.decision.page for r in self.reported))
        self.drain()
        if lost is None:
            return
        decision, why = lost
        view = self.live.view(self.clock())
        self.incident, actions = machine.on_verdict(machine.WATCHING, view.observed_at, decision, view.last_progress)
        self._say(why)
        await self.perform(actions, view)

    # -- the tick ----------------------------------------------------------

    async def tick(self) -> None:
        """Fold what arrived, follow the leader's verdict, advance the incident, perform what it asks."""
        self.drain()
        await self._meet()
        await self._perform_followed()
        view = self.live.view(self.clock())
        if (incident := self.responding.after_restart(self.incident)) is None:
            return
        self.incident = incident
        if not view.workers or not view.alive:
            return
        self.probing.between_probes(view)
        nodes = self.nodes
        if nodes is not None:
            await nodes.moved(view.last_progress)
        peer = nodes is not None and nodes.peer_suspects()  # another node probes a stall and waits for us: look now
        timeout = min(view.stall_timeout, self.settings.stall_timeout_floor) if peer else view.stall_timeout
        before = self.incident.phase
        proven = before is Phase.watching and view.stalled_for < timeout and self.proof.streamed(view)
        self.incident, actions = machine.on_tick(
            self.incident, view.observed_at, view.last_progress, view.stalled_for, timeout, view.peek_after, proven
        )
        if self.incident.phase is not before and nodes is not None:
            nodes.phase_changed()
        if self.incident.phase is Phase.suspect and actions:
            log.info("stall: nothing moved for %.1f s (stall timeout %.1f s)", view.stalled_for, timeout)
        await self.perform(actions, view)

    async def perform(self, actions: list[Action], view: LiveView) -> None:
        for action in actions:
            if isinstance(action, Probe):
                await self._probe(view, action)
            elif isinstance(action, Say):
                self._say(action.text)
            elif isinstance(action, Resolve) and self.reported:
                self.resolve(self.reported[-1], action.why)
            elif isinstance(action, Page):
                await self._page(action.decision, view)

    async def _probe(self, view: LiveView, probe: Probe) -> None:
        look, decision, proven = await self.probing.decide(
            view, probe, self.incident.opened_at, self.judging, self.proof
        )
        settles = None if proven else self.proof.settles_at(decision, look.stall.at, self.judging.role(decision).state)
        before = self.incident.phase
        self.incident, actions = machine.on_probe(
            self.incident, look.stall.at, decision, look.moved, look.view.stalled_for, proven, settles
        )
        if before is Phase.watching and self.incident.phase is Phase.suspect and self.nodes is not None:
            await self.nodes.proved(decision)
        await self.perform(actions, look.view)

    async def _page(self, decision: Decision, view: LiveView) -> None:
        """Report the hang, alert (or say which node does), respond.  A reporter that raises is logged: the job
        may hang again, and the watch goes on."""
        started_at = self.incident.started_at if self.incident.started_at is not None else view.last_progress
        role = self.judging.role(decision)
        report = page_report(role, decision, view, self.job_name, self.host, started_at, self.clock())
        # A job that already ended has nothing left to kill, restart or drain: the verdict is its last word.
        plan = (
            None if self._ended is not None else self.responding.plan(report, self.followed if role.follows else None)
        )
        # A job-wide verdict is published before the bundle: the members page (and restart or end their ranks)
        # meanwhile.  None: this node pages.
        said_instead = await self.judging.page(decision, role, plan)
        response = {"response": plan.headline()} if plan is not None else {}
        reported = Reported(started_at, decision, report.model_copy(update=response), self.bundle_for(report, view))
        if said_instead is None and self.dispatcher is not None:  # retried and spooled by the dispatcher
            # Paged before the evidence is collected (seconds: stacks, dumps, the bandwidth probe): the alert
            # links the bundle where it is about to be written.
            reported.alert = reported.trigger(self.bundle_base_url, self.settings.upload)
            self.dispatcher.submit(reported.alert)
        elif self.dispatcher is not None and self.settings.upload:
            # Another node pages; this node's bundle still goes to the cluster's server, a part of the same
            # incident (the upload sink alone; nothing to resolve here: the pager resolves).
            self.dispatcher.submit(reported.trigger(self.bundle_base_url, self.settings.upload), each_node_only=True)
        try:
            report, reported.bundle = await self.reporter(report, decision, view)
        except Exception:  # a broken sink must not end the watch: the job may hang again
            log.exception("reporting the hang failed")
            report, reported.bundle = reported.report, None
        reported.report = report.model_copy(update=response)
        self.reported.append(reported)
        if said_instead is not None:
            self._say(said_instead())
        if plan is not None:
            if plan.ends_job and role.job_wide and self.nodes is not None:
                await self.nodes.hand_off()
            await self.responding.respond(plan, reported, [w.pid for w in view.alive], pager=said_instead is None)

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
            restarts=self.responding.restarts(),
            perf=self.performance.perf.health if self.performance is not None else PerfHealth(),
        )

    def _say(self, text: str | None) -> None:
        if text and self.out is not None:
            print(f"ncclwatch: {text}", file=self.out, flush=True)
