"""The node's sidecar: sources -> one consumer -> stall check -> probe -> verdict -> report.

Lifecycle, top to bottom: ``run`` starts one supervised task per source
(a source that raises is restarted with backoff and reported down), then
loops: fold queued events into the ``LiveJob``, and every poll check whether
nothing has moved for the stall timeout.  A stall opens an ``Incident``; the
probe asks every rank for a Flight Recorder dump, takes non-blocking py-spy
stacks and an NVML sample, in parallel, and ``classify`` turns it all into a
decision.  A hang is reported once per incident (terminal verdict at once,
then evidence into a bundle); progress closes the incident.  ``stop`` (the
job ended) finishes within a bound and cancels what is left.

Nothing here raises out of ``run`` for bad input: a broken source is a
``SourceDown``; a broken probe is a missing piece of evidence.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ncclwatch.watchdog.engine.classify import Decision, classify
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.live.health import Health, health_of
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy
from ncclwatch.watchdog.engine.report import Report
from ncclwatch.watchdog.live.runfolder import RunDirs
from ncclwatch.watchdog.sinks.alert import Alert, resolve_for, trigger_from_report
from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.engine.snapshot import take_snapshot
from ncclwatch.watchdog.sources.files import HeartbeatSource, NcclFileSource
from ncclwatch.watchdog.sources.flight_recorder import prime, read_dump, request_dumps
from ncclwatch.watchdog.sources.gpus import NvmlSource, RasSource, gpu_snapshot
from ncclwatch.watchdog.sources.workers import WorkerSource
from ncclwatch.watchdog.events import Event, SourceDown

log = logging.getLogger("ncclwatch")

REPROBE_S = 5.0  # while a stall is held (a pause, a busy rank), look again this often
CONFIRM_S = 1.0  # a hang verdict is paged only if a second look this much later sees nothing move
STOP_GRACE_S = 5.0


@dataclass
class Incident:
    started_at: float  # the last moment anything moved
    opened_at: float
    last_probe: float = 0.0
    next_probe: float = 0.0
    held: str | None = None
    candidate: Decision | None = None  # a hang verdict waiting for its confirming look
    positions: dict[int, int] | None = None  # collectives each rank had issued at the last look (Flight Recorder)
    decision: Decision | None = None
    report: Report | None = None
    bundle: Path | None = None
    alert: Alert | None = None  # the trigger sent for it, so that progress can resolve it


Reporter = Callable[["Sidecar", Incident, Decision, LiveView], Awaitable[None]]


@dataclass
class Sidecar:
    settings: Settings
    folders: RunDirs
    torchrun_pid: int
    job_name: str
    reporter: Reporter
    out: TextIO | None = None
    worker_log_dir: Path | None = None  # torchrun's --log-dir, when the user gave one
    dispatcher: Dispatcher | None = None  # alerts (PagerDuty, Slack, webhooks); None: none configured
    bundle_base_url: str | None = None  # where the bundle API is reachable, for links in alerts
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self.live = LiveJob(self.settings, started_at=self.clock())
        self.queue: asyncio.Queue[tuple[Event, float]] = asyncio.Queue()
        poll = self.settings.poll_interval
        self.sources = [
            WorkerSource(self.torchrun_pid, interval=poll, host=self.host),
            NcclFileSource(self.folders.nccl, interval=poll),
            HeartbeatSource(self.folders.hb, interval=poll),
            NvmlSource(),
            RasSource(self.settings.ras_port),
        ]
        self.incident: Incident | None = None
        self.incidents: list[Incident] = []  # every incident that was reported
        self._stopping = asyncio.Event()
        self._primed: set[int] = set()  # worker pids whose Flight Recorder was primed

    # -- lifecycle ---------------------------------------------------------

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._supervise(s), name=f"source:{s.name}") for s in self.sources]
        try:
            while not self._stopping.is_set():
                self._drain()
                await self._tick()
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.settings.poll_interval)
                except TimeoutError:
                    pass
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._drain()

    def stop(self) -> None:
        self._stopping.set()

    def emit(self, event: Event) -> None:
        self.queue.put_nowait((event, self.clock()))

    async def _supervise(self, source) -> None:  # type: ignore[no-untyped-def]
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

    def _drain(self) -> None:
        while not self.queue.empty():
            event, at = self.queue.get_nowait()
            self.live.apply(event, at)

    # -- detection ---------------------------------------------------------

    async def _tick(self) -> None:
        now = self.clock()
        view = self.live.view(now)
        incident = self.incident
        if incident is not None and view.last_progress > incident.started_at:
            self._say(f"job progressing again ({view.stalled_for:.1f} s since the last progress)" if incident.report else None)
            self.resolve(incident, "the job is making progress again")
            self.incident = None
            incident = None
        if not view.ranks or all(r.gone for r in view.ranks):
            return
        if view.stalled_for < view.stall_timeout:
            self._prime(view)
            return
        if incident is None:
            incident = self.incident = Incident(started_at=view.last_progress, opened_at=now)
            log.info("stall: nothing moved for %.1f s (stall timeout %.1f s, learned gap %s)", view.stalled_for, view.stall_timeout, view.learned_gap)
        if incident.report is not None or now < incident.next_probe:
            return
        confirming = incident.candidate is not None
        incident.last_probe, incident.next_probe = now, now + REPROBE_S
        await self.probe(view, with_gpus=not confirming)
        view = self.live.view(self.clock())
        if self._moved(incident, view):
            return
        snapshot = take_snapshot(self.live.state, observed_at=view.observed_at)
        decision = classify(snapshot, view, self.settings)
        incident.decision = decision
        log.info("probe: %s culprits %s page=%s held=%s", decision.finding.verdict, decision.finding.culprits, decision.page, decision.held)
        if decision.page and not confirming:
            # Ranks leaving a pause enter their next collective a moment apart: one look
            # can catch that instant.  A hang is what a second look still sees.
            incident.candidate, incident.next_probe = decision, now + CONFIRM_S
        elif decision.page:
            self.incidents.append(incident)
            try:
                await self.reporter(self, incident, decision, view)
            except Exception:  # a broken sink must not end the watch: the job may hang again
                log.exception("reporting the hang failed")
        else:
            incident.candidate = None
            if decision.held != incident.held:
                incident.held = decision.held
                self._say(f"nothing has moved for {view.stalled_for:.0f} s, not paging: {decision.held}")

    def _moved(self, incident: Incident, view: LiveView) -> bool:
        """Did any rank issue a collective since the last look (Flight Recorder)?  That is progress."""
        positions: dict[int, int] = {}
        for comm in self.live.state.comms.values():
            if comm.source == "flight_recorder":
                for seq in comm.ranks.values():
                    rank = seq.global_rank if seq.global_rank is not None else seq.comm_rank
                    positions[rank] = positions.get(rank, 0) + seq.total
        before, incident.positions = incident.positions, positions
        moved = [r for r, n in positions.items() if before is not None and n > before.get(r, n)]
        if not moved:
            return False
        log.info("ranks %s issued collectives since the last look: progress, not a hang", moved)
        now = self.clock()
        for worker in self.live.live_workers():
            if worker.rank in moved:
                worker.progressed(now)
        self.incident = None
        return True

    def _prime(self, view: LiveView) -> None:
        """Once the job runs steadily, ask each rank for one dump: the first is slow (seconds), later ones fast."""
        ranks = {r.rank: r.pid for r in view.ranks if not r.gone}
        if view.learned_gap is None or self._primed >= set(ranks.values()):
            return
        self._primed |= set(ranks.values())
        log.info("primed Flight Recorder of %d rank(s)", prime(self.folders.fr, ranks))

    async def probe(self, view: LiveView, with_gpus: bool = True) -> None:
        """Fresh evidence for the verdict, gathered in parallel: dumps, stacks, GPUs (the confirming look skips NVML)."""
        ranks = {r.rank: r.pid for r in view.ranks if not r.gone}
        # A stopped rank cannot answer; waiting for its dump would only delay the verdict.
        answering = {rank: pid for rank, pid in ranks.items() if rank not in {r.rank for r in view.ranks if r.state == "T"}}
        dumps, stacks, gpus = await asyncio.gather(
            request_dumps(self.folders.fr, answering),
            asyncio.gather(*(self._stack(pid) for pid in ranks.values())),
            gpu_snapshot() if with_gpus else asyncio.sleep(0),  # the confirming look reuses the sample
            return_exceptions=True,
        )
        now = self.clock()
        if isinstance(dumps, tuple):
            fresh, errors = dumps
            for path in fresh.values():
                for event in read_dump(path):
                    self.live.apply(event, now)
            for rank, error in errors.items():
                log.info("rank %s: no Flight Recorder dump: %s", rank, error)
        if isinstance(stacks, list):
            for events in stacks:
                for event in events:
                    self.live.apply(event, now)
        if gpus is not None and not isinstance(gpus, BaseException):
            self.live.apply(gpus, now)

    async def _stack(self, pid: int) -> list[Event]:
        from ncclwatch.watchdog.probes.pyspy import pyspy_dump

        data, error = await pyspy_dump(pid, native=False, timeout_s=5.0, pyspy=self.settings.pyspy)
        if data is None:
            log.info("py-spy on pid %s: %s", pid, error)
            return []
        return parse_pyspy(data, f"py-spy pid {pid} (live)")

    def alert(self, incident: Incident) -> None:
        """Page for a reported incident (delivery is retried and spooled by the dispatcher)."""
        if self.dispatcher is None or incident.report is None:
            return
        bundle_id = incident.bundle.name.removesuffix(".tar.gz") if incident.bundle else None
        if bundle_id and self.bundle_base_url:
            url = f"{self.bundle_base_url.rstrip('/')}/bundles/{bundle_id}"
        else:
            url = incident.bundle.resolve().as_uri() if incident.bundle else None
        incident.alert = trigger_from_report(incident.report, bundle_id=bundle_id, bundle_url=url)
        self.dispatcher.submit(incident.alert)

    def resolve(self, incident: Incident, why: str) -> None:
        if self.dispatcher is not None and incident.alert is not None:
            self.dispatcher.submit(resolve_for(incident.alert, why))
            incident.alert = None

    def health(self) -> Health:
        """Now, for metrics and the status API."""
        incident = self.incident
        decision = incident.decision if incident else None
        return health_of(
            self.live,
            self.clock(),
            job=self.job_name,
            host=self.host,
            verdict=decision.finding.verdict.value if decision else None,
            culprits=decision.finding.culprits if decision else (),
            hang=bool(incident and incident.report),
            bundles_written=sum(1 for i in self.incidents if i.bundle is not None),
        )

    def _say(self, text: str | None) -> None:
        if text and self.out is not None:
            print(f"ncclwatch: {text}", file=self.out, flush=True)
