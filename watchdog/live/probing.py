"""One probe of a stall, as the sidecar takes it: evidence folded in, progress between looks, the stall journaled.

At a probe the ``Prober`` (``prober.py``) takes this node's evidence: Flight Recorder dumps, py-spy stacks and,
except on the confirming look, a GPU sample.  Its events are folded into the ``LiveJob``.  A rank whose Flight
Recorder shows more collectives issued than at the incident's previous look moved: that is progress (marked in
the job), never a hang.  The ``Stall`` the decision is judged at is folded in too, and written to the journal
with the job's inputs, so ``ncclwatch analyze`` replays the same decision offline.  Before any stall, once the
job has a rhythm, the ranks are asked for their first dumps, and the gaps that may cause are excused.

Failure modes: a probe that cannot see (py-spy or Flight Recorder denied) brings fewer events, a missing piece of
evidence the decision says ("blind"), never an exception; without a journal nothing is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import Event, Stall
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.live.journal import Journal
from ncclwatch.watchdog.live.prober import PRIME_EXCUSE_S, Prober

log = logging.getLogger("ncclwatch")

QUIET_LOG_S = 10.0  # -v: every this many seconds of a quiet job, its stall timeout and why


@dataclass(frozen=True)
class Look:
    """What one probe saw."""

    view: LiveView  # the job with the probe's events folded in
    events: list[Event]  # the probe's own (its Flight Recorder dumps travel to the other nodes)
    stall: Stall  # the moment the decision is judged at
    moved: bool  # a rank issued a collective since the incident's previous look


class Probing:
    """The probes of this node's ranks, and how many collectives each rank had issued at the latest one."""

    def __init__(
        self, prober: Prober, live: LiveJob, settings: Settings, journal: Journal | None, clock: Callable[[], float]
    ) -> None:
        self.prober = prober
        self.live = live
        self.settings = settings
        self.journal = journal
        self.clock = clock
        self._positions: dict[int, int] | None = None  # collectives each rank had issued at the last look
        self._positions_of: float | None = None  # the incident (its opening time) those positions belong to
        self._quiet_said = 0.0  # how long the job had been quiet when -v last said so

    def between_probes(self, view: LiveView) -> None:
        """Every tick of a running job.  Below the stall timeout, once the job has a rhythm: the ranks' first
        dumps, the gaps they may cause excused.  With -v, every QUIET_LOG_S of a quiet job: its stall timeout, and
        why it is not probed yet (the warm-up timeout, a long gap)."""
        if view.stalled_for < view.stall_timeout and view.learned_gap is not None:
            if self.prober.prime(view.workers):
                self.live.excuse(view.observed_at, PRIME_EXCUSE_S)
        if view.stalled_for >= self._quiet_said + QUIET_LOG_S:
            self._quiet_said = view.stalled_for
            log.info("quiet for %.0f s; stall timeout %.1f s (learned gap %s, %d advances)", view.stalled_for,
                     view.stall_timeout, view.learned_gap, view.advances)  # fmt: skip
        elif view.stalled_for < QUIET_LOG_S:
            self._quiet_said = 0.0

    async def look(self, view: LiveView, confirming: bool, incident_opened_at: float | None) -> Look:
        """Probe the ranks of ``view``; the confirming look reuses the GPU sample."""
        if self._positions_of != incident_opened_at:  # each incident compares from its first look
            self._positions, self._positions_of = None, incident_opened_at
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
        return Look(view, events, stall, moved)

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
