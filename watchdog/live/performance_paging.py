"""Paging for performance findings: the performance look beside the ticks, its new findings told and paged.

While no incident is open, every poll ``tick`` asks the ``PerfWatch`` whether a look is due and takes it
(``live/performance_look.py``).  Each new finding is one log line, and a page only where its ``page_on_*`` setting
says so, never through the hang reporter: a slow job is not a hang (no bundle, no kill).  A paged finding that
two looks in a row no longer see is over and its page resolved (one look may miss a rank's dump); ``resolve``
closes the pages still open when the job ends.  With several nodes each look is shared through the job's store
and the leader judges the job's collectives (``JobLook``); a page is keyed on the job's start, so whichever node
leads pages a finding under the same key.

Failure modes: a look that raises is logged and the watch for hangs goes on; a store that fails mid-exchange is
the cluster source down, and this node judges its look alone.  A look waits seconds (dumps, the other nodes'
records): it runs in a task of its own, so it never delays the watch for hangs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from ncclwatch.watchdog.cluster.perf_records import PerfRecord
from ncclwatch.watchdog.cluster.perf_sharing import PerfSharing
from ncclwatch.watchdog.cluster.store import StoreError
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import Event, SourceDown
from ncclwatch.watchdog.live.incident import Incident, Phase
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.live.judging import CLUSTER
from ncclwatch.watchdog.live.nodes import Nodes
from ncclwatch.watchdog.live.performance_look import JobLook, PerfWatch
from ncclwatch.watchdog.sinks.alert import Alert, resolve_for, trigger_from_finding
from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.slowness.findings import pages

log = logging.getLogger("ncclwatch")

PERF_RESOLVE_LOOKS = 2


class Watch(Protocol):
    """What the looks read of the node's watch (``Sidecar``); a store that fails goes to its queue (``emit``)."""

    settings: Settings
    live: LiveJob
    job_name: str
    host: str
    clock: Callable[[], float]
    dispatcher: Dispatcher | None  # None: findings are only logged
    incident: Incident  # a look is taken only while watching
    nodes: Nodes | None  # the other nodes' sidecars, once met: the looks are shared through the store

    def emit(self, item: Event) -> None: ...


class PerformancePaging:
    """The looks this node takes, and the pages of their findings still open."""

    def __init__(self, perf: PerfWatch, watch: Watch) -> None:
        self.perf = perf
        self.watch = watch
        self.settings = watch.settings
        self.live = watch.live
        self._pages: dict[str, Alert] = {}  # finding key -> its open page
        self._unseen: dict[str, int] = {}  # finding key -> looks in a row without it

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.settings.poll_interval)

    async def tick(self) -> None:
        """The performance look, when one is due and no incident is open."""
        if self.watch.incident.phase is not Phase.watching:
            return
        view = self.live.view(self.watch.clock())
        if view.workers and view.alive and self.perf.due(view.observed_at):
            await self._look(view)

    async def _look(self, view: LiveView) -> None:
        """One look; each new finding is one log line, and a page where its ``page_on_*`` setting says so."""
        nodes = self.watch.nodes
        exchange = nodes.perf_sharing() if nodes is not None else None
        job = None
        if exchange is not None:  # several nodes: share the look, the leader judges
            job = JobLook(exchange.cluster.me, lambda record: self._exchange(exchange, record))
        host = self.watch.host
        try:
            new = await self.perf.look(view.workers, self.live.state.global_ranks(), host, view.observed_at, job)
        except Exception:  # the look is a nicety; the watch for hangs goes on
            log.exception("performance look failed")
            return
        # The job's start, not this sidecar's: whichever node leads pages a finding under the same key.
        started = self.live.started_at
        run_started_at = nodes.met.cluster.job_started_at(started) if nodes is not None else started
        dispatcher = self.watch.dispatcher
        for finding in new:
            through = f" (links: {', '.join(finding.links)})" if finding.links else ""
            log.warning("performance: %s: %s%s", finding.kind.value, finding.summary, through)
            if dispatcher is not None and pages(finding, self.settings):
                alert = trigger_from_finding(finding, job=self.watch.job_name, host=host, run_started_at=run_started_at)
                dispatcher.submit(alert)
                self._pages[finding.key] = alert
        self._resolve_gone({f.key for f in self.perf.findings()})

    def _resolve_gone(self, seen: set[str]) -> None:
        """A paged finding absent from two looks in a row is over (one look may miss a rank's dump)."""
        for key in list(self._pages):
            self._unseen[key] = 0 if key in seen else self._unseen.get(key, 0) + 1
            if self._unseen[key] >= PERF_RESOLVE_LOOKS:
                self.resolve(key, "not seen at the last two performance looks")

    def resolve(self, key: str | None = None, why: str = "the job ended") -> None:
        """Close the page of one performance finding (``key``), or of all of them."""
        for open_key in [key] if key is not None else list(self._pages):
            alert = self._pages.pop(open_key, None)
            self._unseen.pop(open_key, None)
            if alert is not None and self.watch.dispatcher is not None:
                self.watch.dispatcher.submit(resolve_for(alert, why))

    async def _exchange(self, exchange: PerfSharing, record: PerfRecord) -> Mapping[int, PerfRecord] | None:
        """Share this node's look; the leader gets the other nodes' records, a member None, and a store that
        fails mid-way leaves this node judging alone (an empty mapping), as when it cannot be reached."""
        try:
            return await exchange.exchange(record, self.perf.interval)
        except StoreError as exc:
            self.watch.emit(SourceDown(source=CLUSTER, reason=str(exc)))
            return {}
