"""One stall's life as a small state machine: watching -> suspect -> confirming -> paged -> resolved.

The sidecar feeds it two kinds of observation, ``on_tick`` (the clock moved:
how long nothing has moved, the stall timeout) and ``on_probe`` (a probe's
decision, and whether any rank issued a collective since the last look),
and performs the actions it returns.  Pure: no I/O, the clock passed in, so
every edge is tested with a fake clock and no sleeps.

- watching: nothing is wrong.  A stall (nothing moved for the stall
  timeout) makes it ``suspect`` and asks for a probe.
- suspect: probing every ``REPROBE_S``.  A decision that does not page
  (a pause, a busy rank, a blind probe) is held, with its reason said once
  on the terminal; a decision that pages goes to ``confirming``.
- confirming: ranks leaving a pause enter their next collective a moment
  apart, and one look can land in that instant; a hang is what a second
  look ``CONFIRM_S`` later still sees.  Then ``paged``.
- paged: reported once.  Progress after it is ``resolved`` (the alert is
  resolved), and watching starts over with a fresh incident.

Progress (any rank moved) in suspect or confirming goes back to watching.

With several nodes, only the leader's sidecar decides; the others feed its
verdict in with ``on_verdict``, which pages from any open phase (and from
watching: the leader saw the job hang before this node's ranks did).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ncclwatch.watchdog.hang.classify import Decision

REPROBE_S = 5.0  # while a stall is held (a pause, a busy rank), look again this often
CONFIRM_S = 1.0  # a hang verdict is paged only if a second look this much later sees nothing move


class Phase(StrEnum):
    watching = "watching"
    suspect = "suspect"
    confirming = "confirming"
    paged = "paged"
    resolved = "resolved"


@dataclass(frozen=True)
class Probe:
    confirming: bool  # the confirming look reuses the GPU sample


@dataclass(frozen=True)
class Page:
    decision: Decision


@dataclass(frozen=True)
class Resolve:
    why: str


@dataclass(frozen=True)
class Say:
    text: str


Action = Probe | Page | Resolve | Say


@dataclass(frozen=True)
class Incident:
    phase: Phase = Phase.watching
    started_at: float | None = None  # the last moment anything moved
    opened_at: float | None = None
    next_probe: float = 0.0
    held: str | None = None  # why a hang-like state is not paged (suspect only)
    decision: Decision | None = None  # the latest decision (the candidate while confirming)


WATCHING = Incident()


def on_tick(
    incident: Incident, now: float, last_progress: float, stalled_for: float, stall_timeout: float
) -> tuple[Incident, list[Action]]:
    if incident.phase is not Phase.watching and incident.started_at is not None and last_progress > incident.started_at:
        return _progress(incident, stalled_for)
    if incident.phase is Phase.watching:
        if stalled_for < stall_timeout:
            return incident, []
        suspect = Incident(Phase.suspect, started_at=last_progress, opened_at=now, next_probe=now + REPROBE_S)
        return suspect, [Probe(confirming=False)]
    if incident.phase in (Phase.suspect, Phase.confirming) and now >= incident.next_probe:
        confirming = incident.phase is Phase.confirming
        return replace(incident, next_probe=now + REPROBE_S), [Probe(confirming=confirming)]
    return incident, []


def on_probe(
    incident: Incident, now: float, decision: Decision, moved: bool, stalled_for: float
) -> tuple[Incident, list[Action]]:
    if incident.phase not in (Phase.suspect, Phase.confirming):
        return incident, []
    if moved:
        return WATCHING, []
    if decision.page and incident.phase is Phase.suspect:
        return replace(incident, phase=Phase.confirming, decision=decision, held=None, next_probe=now + CONFIRM_S), []
    if decision.page:
        return replace(incident, phase=Phase.paged, decision=decision), [Page(decision)]
    said = [] if decision.held == incident.held or decision.held is None else [Say(_held_line(decision, stalled_for))]
    return replace(
        incident, phase=Phase.suspect, decision=decision, held=decision.held, next_probe=now + REPROBE_S
    ), said


def on_verdict(
    incident: Incident, now: float, decision: Decision, last_progress: float
) -> tuple[Incident, list[Action]]:
    """The leader's job-wide verdict: paged here too (this node's bundle, its part of the kill), once."""
    if incident.phase is Phase.paged:
        return incident, []
    started = (
        incident.started_at
        if incident.started_at is not None and incident.phase is not Phase.resolved
        else last_progress
    )
    opened = incident.opened_at if incident.phase in (Phase.suspect, Phase.confirming) else now
    return Incident(Phase.paged, started_at=started, opened_at=opened, next_probe=now, decision=decision), [
        Page(decision)
    ]


def _held_line(decision: Decision, stalled_for: float) -> str:
    what = "a stall that cannot be decided" if decision.blind else "not paging"
    return f"nothing has moved for {stalled_for:.0f} s, {what}: {decision.held}"


def _progress(incident: Incident, stalled_for: float) -> tuple[Incident, list[Action]]:
    if incident.phase is Phase.paged:
        return replace(incident, phase=Phase.resolved), [
            Say(f"job progressing again ({stalled_for:.1f} s since the last progress)"),
            Resolve("the job is making progress again"),
        ]
    return WATCHING, []
