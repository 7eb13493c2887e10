"""One stall's life as a small state machine: watching -> suspect -> confirming -> paged -> resolved.

The sidecar feeds it two kinds of observation, ``on_tick`` (the clock moved:
how long nothing has moved, the stall timeout, when a silent look is due,
whether the streamed evidence already proves a hang) and ``on_probe`` (a
probe's decision, whether it is *proven*, and whether any rank moved since
the last look), and performs the actions it returns.  Pure: no I/O, the
clock passed in, so every edge is tested with a fake clock and no sleeps.

A decision is proven when its verdict is conclusive in the catalogue
(``hang/verdicts.py``: a mismatch, a dead or stopped rank; the evidence
proves the hang by itself and does not go away with a pause) and settled
(``judging.Proof``: a dead rank gone, a stopped rank stopped, for a few
seconds).  Proof pages at any time, step 0 included; silence alone waits
for the stall timeout (learned, or the warm-up timeout).

- watching: nothing is wrong.  A stall (nothing moved for the stall
  timeout) makes it ``suspect`` and asks for a probe.  Before that, after
  ``peek_after`` of silence, a *peek*: a quiet look (no RAS, no GPU sample,
  nothing printed into the job's output, not journaled) whose decision is
  kept only when proven; then ``suspect`` at once.  Otherwise nothing is
  said or held, and the next peek comes after ``PEEK_EVERY_S`` more silence
  (a long compile or checkpoint load is not probed every tick).  Streamed
  evidence that proves a hang (``judging.Proof.streamed``: a mismatch in the
  NCCL logs, a dead or stopped rank) makes it ``suspect`` at once too.
- suspect: probing every ``REPROBE_S``.  A decision that does not page
  (a pause, a busy rank, a blind probe) is held, with its reason said once
  on the terminal; a proven decision pages; another that pages goes to
  ``confirming``.
- confirming: ranks leaving a pause enter their next collective a moment
  apart, and one look can land in that instant; a hang is what a second
  look ``CONFIRM_S`` later still sees.  Then ``paged``.  A peek of the same
  silence that saw the same hang is that first look: the probe at the stall
  timeout then pages without confirming again.
- paged: reported once.  Progress after it is ``resolved`` (the alert is
  resolved), and watching starts over with a fresh incident.

Progress (any rank moved) in suspect or confirming goes back to watching.

With several nodes, only the leader's sidecar decides; the others feed its
verdict in with ``on_verdict``, which pages from any open phase (and from
watching: the leader saw the job hang before this node's ranks did).  A
peek there judges this node's ranks only: proof opens the incident, which
starts the leader's job-wide judging, and pages nothing by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from ncclwatch.watchdog.hang.types import Decision

REPROBE_S = 5.0  # while a stall is held (a pause, a busy rank), look again this often
CONFIRM_S = 1.0  # a hang verdict is paged only if a second look this much later sees nothing move
PEEK_EVERY_S = 20.0  # while the job stays silent below the stall timeout, a peek at most this often


class Phase(StrEnum):
    watching = "watching"
    suspect = "suspect"
    confirming = "confirming"
    paged = "paged"
    resolved = "resolved"


@dataclass(frozen=True)
class Probe:
    confirming: bool  # the confirming look reuses the GPU sample
    peek: bool = False  # a quiet look while watching: only proof counts
    after_proof: bool = False  # the peek just before proved the hang: its dumps are a second old


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
    started_at: float | None = None  # the last moment anything moved (watching: the silence last peeked at)
    opened_at: float | None = None
    next_probe: float = 0.0  # watching: the next peek
    held: str | None = None  # why a hang-like state is not paged (suspect only)
    proof_only: bool = False  # opened on proof before the stall timeout: until then only proof pages
    decision: Decision | None = None  # the latest decision (the candidate while confirming)
    # A peek of this silence whose decision pages without proving (a rank behind, stuck in a collective), and when:
    # the probe at the stall timeout that sees the same is the second look, and pages without a confirming look.
    peeked: tuple[float, Decision] | None = None


WATCHING = Incident()


def on_tick(
    incident: Incident,
    now: float,
    last_progress: float,
    stalled_for: float,
    stall_timeout: float,
    peek_after: float | None = None,
    proven: bool = False,
) -> tuple[Incident, list[Action]]:
    """``peek_after``: silence after which a peek is due (None: none); ``proven``: the streamed evidence proves a
    hang now (only asked while watching)."""
    if incident.phase is not Phase.watching and incident.started_at is not None and last_progress > incident.started_at:
        return _progress(incident, stalled_for)
    if incident.phase is Phase.watching:
        this_silence = incident.started_at is not None and incident.started_at >= last_progress  # peeked at already
        if stalled_for >= stall_timeout or proven:
            suspect = Incident(
                Phase.suspect,
                started_at=last_progress,
                opened_at=now,
                next_probe=now + REPROBE_S,
                proof_only=stalled_for < stall_timeout,
                peeked=incident.peeked if this_silence else None,
            )
            return suspect, [Probe(confirming=False)]
        if peek_after is not None and stalled_for >= peek_after and (not this_silence or now >= incident.next_probe):
            return Incident(started_at=last_progress, next_probe=now + PEEK_EVERY_S), [Probe(False, peek=True)]
        return (incident if this_silence or incident.started_at is None else WATCHING), []
    if incident.proof_only and stalled_for >= stall_timeout:
        incident = replace(incident, proof_only=False)
    if incident.phase in (Phase.suspect, Phase.confirming) and now >= incident.next_probe:
        confirming = incident.phase is Phase.confirming
        return replace(incident, next_probe=now + REPROBE_S), [Probe(confirming=confirming)]
    return incident, []


def on_probe(
    incident: Incident,
    now: float,
    decision: Decision,
    moved: bool,
    stalled_for: float,
    proven: bool = False,
    settles_at: float | None = None,
) -> tuple[Incident, list[Action]]:
    """``proven``: ``decision`` pages, and its evidence proves the hang by itself (``judging.Proof.proves``);
    ``settles_at``: when it will, where only time is missing (a rank stopped or gone not long enough yet)."""
    if incident.phase is Phase.watching:  # a peek: proof opens the incident and looks again at once, fully
        if moved or incident.started_at is None:
            return incident, []
        if not proven:
            # What it saw is the first look for the stall timeout's probe, even where the proof only needs time (a
            # GPU hang not held 15 s yet: 1.6 s of a 9 s page went to a confirming look on 4 x H200).
            peeked = replace(incident, peeked=(now, decision) if decision.page else None)
            if settles_at is not None:  # peek again then
                return replace(peeked, next_probe=min(incident.next_probe, settles_at)), []
            return peeked, []
        opened = replace(incident, phase=Phase.suspect, opened_at=now, next_probe=now + REPROBE_S, proof_only=True)
        return replace(opened, decision=decision), [Probe(confirming=False, after_proof=True)]
    if incident.phase not in (Phase.suspect, Phase.confirming):
        return incident, []
    if moved:
        return WATCHING, []
    if decision.page and (proven or incident.phase is Phase.confirming or _seen_at_peek(incident, decision, now)):
        return replace(incident, phase=Phase.paged, decision=decision, held=None), [Page(decision)]
    if decision.page and incident.proof_only:  # silence alone waits for the stall timeout
        return replace(incident, phase=Phase.suspect, decision=decision, next_probe=now + REPROBE_S), []
    if decision.page:
        return replace(incident, phase=Phase.confirming, decision=decision, held=None, next_probe=now + CONFIRM_S), []
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


def _seen_at_peek(incident: Incident, decision: Decision, now: float) -> bool:
    """The peek of this silence saw the same hang (verdict and culprits) at least ``CONFIRM_S`` before, and nothing
    has moved since (progress ends the incident): that peek was the first look, this one confirms it.  On the H200 a
    rank asleep in a syscall paged 3.2 s after the 5 s stall timeout, 2 s of it the confirming look; its peek had
    named the same rank 2.8 s before the timeout."""
    if incident.peeked is None or incident.proof_only:
        return False
    at, seen = incident.peeked
    same = (seen.finding.verdict, seen.finding.culprits) == (decision.finding.verdict, decision.finding.culprits)
    return same and now - at >= CONFIRM_S


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
