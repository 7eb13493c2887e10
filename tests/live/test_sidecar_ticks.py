"""The sidecar driven tick by tick: scripted events, a scripted prober, a fake clock, no sleeps.

Each test walks one edge of the incident lifecycle (``live/incident.py``)
through the real ``Sidecar``: watching -> suspect -> confirming -> paged ->
resolved, and the ways back (progress, a rank moving between looks), the
holds (a pause, a busy rank) and a probe that cannot see.  The pure state
machine has its own edge tests below.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path

import nccl_lines as L
import pytest
from conftest import NOW, Clock
from support import free_port

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    Heartbeat,
    ProcessState,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.incident import (
    CONFIRM_S,
    PEEK_EVERY_S,
    REPROBE_S,
    WATCHING,
    Incident,
    Page,
    Phase,
    Probe,
    Resolve,
    Say,
    on_probe,
    on_tick,
)
from ncclwatch.watchdog.live.journal import Journal
from ncclwatch.watchdog.live.judging import NodeJudging
from ncclwatch.watchdog.live.prober import PRIME_EXCUSE_S
from ncclwatch.watchdog.live.sidecar import Sidecar
from ncclwatch.watchdog.parsing.journal import parse_journal
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.response.policy import Plan, Response

COMM = "0x5583d3a1f0e0"
SETTINGS = Settings(stall_timeout_floor=5.0, warmup_stall_timeout=300.0, progress_timeout=600.0, poll_interval=0.25)
IN_ALL_REDUCE = "all_reduce (torch/distributed/distributed_c10d.py:3252)"
IN_TRAIN = "main (train.py:105)"


class ScriptedProber:
    """Answers each probe with the events a test scripted (stacks by pid); records every call."""

    def __init__(self) -> None:
        self.frames: dict[int, str] = {}
        self.calls: list[bool] = []  # with_gpus of each probe
        self.peeks = 0  # quiet looks below the stall timeout (``incident.py``), not counted in ``calls``
        self.extra: list[Event] = []  # answered by every look besides the stacks (Flight Recorder dumps)
        self.primed: set[int] = set()
        self.gpu_samples: list[Callable[[], Event]] = []  # what each GPU sample answers, made at the time it is taken
        self.sampled = 0

    async def gpus(self) -> list[Event]:
        self.sampled += 1
        return [make() for make in self.gpu_samples]

    def dumps_left(self, workers, since: float) -> list[Event]:  # type: ignore[no-untyped-def]
        """After the job ended: what a dead job's ranks left on disk (the scripted dumps)."""
        return list(self.extra)

    def prime(self, workers) -> int:  # type: ignore[no-untyped-def]
        new = {w.pid for w in workers} - self.primed
        self.primed |= new
        return len(new)

    async def probe(
        self,
        workers,
        with_gpus: bool,
        stalled_since: float | None = None,
        peek: bool = False,
        after_proof: bool = False,
    ) -> list[Event]:  # type: ignore[no-untyped-def]
        if peek:
            self.peeks += 1
        else:
            self.calls.append(with_gpus)
        return self.extra + [
            StackDump(
                pid=w.pid,
                threads=[ThreadStack(name="MainThread", frames=[self.frames[w.pid]])],
                cite=Citation(file="py-spy"),
            )
            for w in workers
            if w.pid in self.frames
        ]


class Alerts:
    """Records what the sidecar submits (the real Dispatcher's delivery has its own tests)."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, alert) -> None:  # type: ignore[no-untyped-def]
        self.submitted.append(alert.action)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.prober = ScriptedProber()
        self.out = io.StringIO()
        self.pages: list[Decision] = []
        self.alerts = Alerts()
        self.sidecar = Sidecar(
            SETTINGS,
            "train",
            sources=[],
            prober=self.prober,
            reporter=self.report,
            journal=Journal(tmp_path / "journal.jsonl"),
            out=self.out,
            dispatcher=self.alerts,
            host="node1",
            clock=self.clock,  # type: ignore[arg-type]
        )

    async def report(self, report, decision, view):  # type: ignore[no-untyped-def]
        self.pages.append(decision)
        return report, None

    def at(self, seconds: float) -> None:
        self.clock.now = NOW + seconds

    def emit(self, *events: Event) -> None:
        for event in events:
            self.sidecar.emit(event)

    def tick(self, seconds: float) -> None:
        self.at(seconds)
        asyncio.run(self.sidecar.tick())

    @property
    def phase(self) -> Phase:
        return self.sidecar.incident.phase


def healthy_job(rig: Rig, behind: bool = True, cpu: float = 0.0) -> None:
    """Three ranks beat every second for 20 s; rank 2 issued one collective fewer (pids 100-102)."""
    for rank in range(3):
        rig.emit(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW))
    for second in range(21):
        rig.at(second)
        rig.emit(*(Heartbeat(pid=100 + r, rank=r, step=second, time=NOW + second) for r in range(3)))
    for rank in range(3):
        steps = 5 if behind and rank == 2 else 6
        text = L.init(rank, 3, COMM, pid=100 + rank) + L.steps(rank, COMM, steps, pid=100 + rank)
        rig.emit(*NcclLogParser(f"node1.{100 + rank}").feed(text.encode(), final=True))
        for i, t in enumerate((18.0, 19.0, 20.0)):
            rig.emit(ProcessState(pid=100 + rank, rank=rank, state="S", cpu_seconds=cpu * i * (rank == 2), at=NOW + t))
    rig.tick(20)


def stuck_frames(rig: Rig, lead: str = IN_TRAIN) -> None:
    rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE, 102: lead}


class TestSidecarTicks:
    def test_priming_excuses_the_gap_it_may_cause(self, tmp_path: Path) -> None:
        """The first dumps are asked once the job has a rhythm; the next PRIME_EXCUSE_S of gaps are not learned."""
        rig = Rig(tmp_path)
        healthy_job(rig)
        assert rig.prober.primed == {100, 101, 102}
        (window,) = rig.sidecar.live.excused
        assert window[1] - window[0] == PRIME_EXCUSE_S
        rig.tick(21)
        assert len(rig.sidecar.live.excused) == 1  # asked once per worker, excused once

    def test_quiet_until_the_stall_timeout(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)
        rig.tick(24.9)  # learned timeout: 3 x 1 s + 2 polls, floored at 5 s
        assert rig.phase is Phase.watching and rig.prober.calls == []

    def test_stall_is_suspect_and_probed_then_confirmed_then_paged_once(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)
        stuck_frames(rig)
        rig.tick(25.1)
        assert rig.phase is Phase.confirming and rig.prober.calls == [True] and rig.pages == []
        rig.tick(25.1 + CONFIRM_S / 2)
        assert rig.phase is Phase.confirming and len(rig.prober.calls) == 1
        rig.tick(25.1 + CONFIRM_S)
        assert rig.phase is Phase.paged and rig.prober.calls == [
            True,
            False,
        ]  # the confirming look reuses the GPU sample
        assert [d.finding.verdict for d in rig.pages] == [Verdict.rank_behind]
        assert rig.pages[0].finding.culprits == (2,)
        assert rig.alerts.submitted == ["trigger"]
        rig.tick(40)
        assert len(rig.pages) == 1 and len(rig.prober.calls) == 2

    def test_progress_after_the_page_resolves_and_watching_starts_over(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)
        stuck_frames(rig)
        rig.tick(25.1)
        rig.tick(26.2)
        rig.emit(Heartbeat(pid=100, rank=0, step=21, time=NOW + 30))
        rig.tick(30)
        assert rig.phase is Phase.resolved
        assert rig.alerts.submitted == ["trigger", "resolve"]
        assert "job progressing again" in rig.out.getvalue()
        rig.tick(30.25)
        assert rig.phase is Phase.watching

    def test_progress_while_suspect_goes_back_to_watching_without_a_page(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)
        stuck_frames(rig)
        rig.tick(25.1)
        rig.emit(*(Heartbeat(pid=100 + r, rank=r, step=21, time=NOW + 25.5) for r in range(3)))
        rig.tick(25.6)
        assert rig.phase is Phase.watching and rig.pages == []

    def test_a_pause_is_held_and_said_once_then_paged_past_the_progress_timeout(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig, behind=False)
        rig.prober.frames = {100 + r: IN_TRAIN for r in range(3)}
        rig.tick(25.1)
        assert rig.phase is Phase.suspect and rig.pages == []
        rig.tick(25.1 + REPROBE_S)
        assert rig.out.getvalue().count("not paging: no rank is inside a collective") == 1
        rig.tick(20 + SETTINGS.progress_timeout + 1)
        rig.tick(20 + SETTINGS.progress_timeout + 1 + CONFIRM_S)
        assert [d.finding.verdict for d in rig.pages] == [Verdict.progress_stalled]

    def test_a_busy_culprit_outside_collectives_is_held(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig, cpu=0.9)
        stuck_frames(rig, lead="write (torch/serialization.py:650)")
        rig.tick(25.1)
        assert rig.phase is Phase.suspect and rig.pages == []
        assert "busy (CPU or I/O moving outside any collective" in rig.out.getvalue()

    def test_a_busy_culprit_waiting_on_the_gpu_is_not_held(self, tmp_path: Path) -> None:
        """Ranks spinning in a CUDA or NCCL wait burn a core: that is waiting, not a checkpoint."""
        rig = Rig(tmp_path)
        healthy_job(rig, cpu=0.9)
        stuck_frames(rig, lead="synchronize (torch/cuda/__init__.py:1083)")
        rig.tick(25.1)
        rig.tick(25.1 + CONFIRM_S)
        assert [d.finding.verdict for d in rig.pages] == [Verdict.rank_behind]

    def test_a_blind_probe_is_said_never_read_as_a_pause(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig, behind=False)  # sequences agree and never end: they cannot decide
        rig.tick(25.1)  # py-spy and Flight Recorder both denied: the prober returns nothing
        assert rig.phase is Phase.suspect and rig.pages == []
        said = rig.out.getvalue()
        assert "a stall that cannot be decided" in said and "cannot see where rank 0, 1, 2 is" in said
        assert "a pause" not in said

    def test_every_probe_is_journaled_for_offline_replay(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)
        stuck_frames(rig)
        rig.tick(25.1)
        rig.tick(26.2)
        events = parse_journal((tmp_path / "journal.jsonl").read_bytes(), "journal.jsonl")
        kinds = {type(e).__name__ for e in events}
        assert {"WorkerSeen", "ProcessState", "StackDump", "Stall"} <= kinds
        assert sum(type(e).__name__ == "Stall" for e in events) == 2
        assert WorkerSeen(pid=100, rank=0, host="node1", at=NOW) in events  # the worker exactly as its source saw it


# -- the pure state machine ------------------------------------------------------


def decision(page: bool, held: str | None = None, blind: bool = False) -> Decision:
    return Decision(
        Finding(Verdict.rank_behind if page else Verdict.progress_stalled, "s"), page=page, held=held, blind=blind
    )


MISMATCH = Decision(Finding(Verdict.collective_mismatch, "s", culprits=(1,)), page=True)


class TestIncidentEdges:
    def test_watching_below_the_timeout_does_nothing(self) -> None:
        assert on_tick(WATCHING, NOW, NOW - 1, 1.0, 5.0) == (WATCHING, [])

    def test_watching_past_the_timeout_is_suspect_and_probes(self) -> None:
        incident, actions = on_tick(WATCHING, NOW, NOW - 6, 6.0, 5.0)
        assert (
            incident.phase is Phase.suspect and incident.started_at == NOW - 6 and actions == [Probe(confirming=False)]
        )

    def test_suspect_probes_again_only_after_the_reprobe_interval(self) -> None:
        suspect = Incident(Phase.suspect, started_at=NOW - 6, opened_at=NOW, next_probe=NOW + REPROBE_S)
        assert on_tick(suspect, NOW + 1, NOW - 6, 7.0, 5.0)[1] == []
        assert on_tick(suspect, NOW + REPROBE_S, NOW - 6, 11.0, 5.0)[1] == [Probe(confirming=False)]

    def test_paging_decision_confirms_before_paging(self) -> None:
        suspect = Incident(Phase.suspect, started_at=NOW - 6, opened_at=NOW)
        confirming, actions = on_probe(suspect, NOW, decision(True), moved=False, stalled_for=6.0)
        assert confirming.phase is Phase.confirming and actions == [] and confirming.next_probe == NOW + CONFIRM_S
        assert on_tick(confirming, NOW + CONFIRM_S, NOW - 6, 7.0, 5.0)[1] == [Probe(confirming=True)]
        paged, actions = on_probe(confirming, NOW + CONFIRM_S, decision(True), moved=False, stalled_for=7.0)
        assert paged.phase is Phase.paged and actions == [Page(decision(True))]

    def test_confirming_look_that_no_longer_pages_is_held(self) -> None:
        confirming = Incident(Phase.confirming, started_at=NOW - 6, opened_at=NOW, decision=decision(True))
        held, actions = on_probe(confirming, NOW + 1, decision(False, held="a pause"), moved=False, stalled_for=7.0)
        assert held.phase is Phase.suspect and held.held == "a pause"
        assert actions == [Say("nothing has moved for 7 s, not paging: a pause")]

    def test_the_same_hold_is_said_once(self) -> None:
        suspect = Incident(Phase.suspect, started_at=NOW - 6, opened_at=NOW, held="a pause")
        assert on_probe(suspect, NOW, decision(False, held="a pause"), moved=False, stalled_for=9.0)[1] == []

    def test_blind_is_said_as_undecided(self) -> None:
        suspect = Incident(Phase.suspect, started_at=NOW - 6, opened_at=NOW)
        _, actions = on_probe(
            suspect, NOW, decision(False, held="cannot see", blind=True), moved=False, stalled_for=6.0
        )
        assert actions == [Say("nothing has moved for 6 s, a stall that cannot be decided: cannot see")]

    @pytest.mark.parametrize("phase", [Phase.suspect, Phase.confirming])
    def test_a_rank_moving_between_looks_is_progress(self, phase: Phase) -> None:
        incident = Incident(phase, started_at=NOW - 6, opened_at=NOW)
        assert on_probe(incident, NOW, decision(True), moved=True, stalled_for=6.0) == (WATCHING, [])

    @pytest.mark.parametrize("phase", [Phase.suspect, Phase.confirming])
    def test_progress_before_a_page_is_watching(self, phase: Phase) -> None:
        incident = Incident(phase, started_at=NOW - 6, opened_at=NOW)
        assert on_tick(incident, NOW + 1, NOW + 0.5, 0.5, 5.0) == (WATCHING, [])

    def test_progress_after_a_page_resolves(self) -> None:
        paged = Incident(Phase.paged, started_at=NOW - 6, opened_at=NOW, decision=decision(True))
        resolved, actions = on_tick(paged, NOW + 9, NOW + 8, 1.0, 5.0)
        assert resolved.phase is Phase.resolved
        assert actions == [
            Say("job progressing again (1.0 s since the last progress)"),
            Resolve("the job is making progress again"),
        ]
        assert on_tick(resolved, NOW + 10, NOW + 8, 2.0, 5.0) == (WATCHING, [])

    def test_paged_without_progress_stays_paged(self) -> None:
        paged = Incident(Phase.paged, started_at=NOW - 6, opened_at=NOW)
        assert on_tick(paged, NOW + 60, NOW - 6, 66.0, 5.0) == (paged, [])


class TestPeekEdges:
    """Proof pages at once, at any time; silence waits for the stall timeout (300 s here: the warm-up)."""

    PEEK = Probe(confirming=False, peek=True)

    def peeked(self) -> Incident:
        incident, actions = on_tick(WATCHING, NOW, NOW - 3, 3.0, 300.0, peek_after=3.0)
        assert actions == [self.PEEK] and incident.phase is Phase.watching
        return incident

    def test_no_peek_before_peek_after_or_without_one(self) -> None:
        assert on_tick(WATCHING, NOW, NOW - 2, 2.0, 300.0, peek_after=3.0) == (WATCHING, [])
        assert on_tick(WATCHING, NOW, NOW - 9, 9.0, 300.0, peek_after=None) == (WATCHING, [])

    def test_a_peek_that_proves_opens_the_incident_and_the_full_look_pages_without_confirming(self) -> None:
        suspect, actions = on_probe(self.peeked(), NOW + 0.2, MISMATCH, moved=False, stalled_for=3.2, proven=True)
        # The full look knows the peek's dumps are a second old: it waits for fresh ones only briefly
        assert suspect.phase is Phase.suspect and actions == [Probe(confirming=False, after_proof=True)]
        assert suspect.started_at == NOW - 3 and suspect.opened_at == NOW + 0.2 and suspect.proof_only
        paged, actions = on_probe(suspect, NOW + 0.4, MISMATCH, moved=False, stalled_for=3.4, proven=True)
        assert paged.phase is Phase.paged and actions == [Page(MISMATCH)]

    BEHIND_1 = Decision(Finding(Verdict.rank_behind, "s", culprits=(1,)), page=True)

    def silence_peeked(self, seen: Decision) -> Incident:
        """A 5 s stall timeout: a peek at 3 s of silence sees ``seen``, then the timeout opens the incident."""
        incident, _ = on_tick(WATCHING, NOW, NOW - 3, 3.0, 5.0, peek_after=3.0)
        incident, actions = on_probe(incident, NOW + 0.3, seen, moved=False, stalled_for=3.3)
        assert actions == [] and incident.phase is Phase.watching
        suspect, actions = on_tick(incident, NOW + 2, NOW - 3, 5.0, 5.0, peek_after=3.0)
        assert suspect.phase is Phase.suspect and actions == [Probe(confirming=False)]
        return suspect

    def test_the_probe_at_the_stall_timeout_confirms_what_the_peek_saw_and_pages(self) -> None:
        paged, actions = on_probe(self.silence_peeked(self.BEHIND_1), NOW + 3, self.BEHIND_1, False, 6.0)
        assert paged.phase is Phase.paged and actions == [Page(self.BEHIND_1)]

    def test_another_culprit_or_a_held_peek_still_needs_the_confirming_look(self) -> None:
        other = Decision(Finding(Verdict.rank_behind, "s", culprits=(0,)), page=True)
        for seen in (other, decision(False, held="a pause")):
            confirming, actions = on_probe(self.silence_peeked(seen), NOW + 3, self.BEHIND_1, False, 6.0)
            assert confirming.phase is Phase.confirming and actions == [], seen

    def test_a_peek_of_an_earlier_silence_confirms_nothing(self) -> None:
        incident, _ = on_tick(WATCHING, NOW, NOW - 3, 3.0, 5.0, peek_after=3.0)
        incident, _ = on_probe(incident, NOW + 0.3, self.BEHIND_1, moved=False, stalled_for=3.3)
        # the job moved at NOW + 1, then fell silent again for the stall timeout
        suspect, _ = on_tick(incident, NOW + 6, NOW + 1, 5.0, 5.0, peek_after=3.0)
        assert suspect.phase is Phase.suspect and suspect.peeked is None
        assert on_probe(suspect, NOW + 6.5, self.BEHIND_1, False, 5.5)[0].phase is Phase.confirming

    def test_a_peek_that_does_not_prove_stays_silent_and_peeks_again_only_after_peek_every(self) -> None:
        peeked = self.peeked()
        for held in (decision(True), decision(False, held="a pause"), MISMATCH):  # a page not proven opens nothing
            looked, actions = on_probe(peeked, NOW + 0.2, held, moved=False, stalled_for=3.2)
            assert actions == [] and looked.phase is Phase.watching and looked.next_probe == peeked.next_probe
            assert looked.peeked == ((NOW + 0.2, held) if held.page else None)  # what the stall timeout's probe checks
        assert on_tick(peeked, NOW + PEEK_EVERY_S - 0.1, NOW - 3, PEEK_EVERY_S + 2.9, 300.0, 3.0) == (peeked, [])
        again, actions = on_tick(peeked, NOW + PEEK_EVERY_S, NOW - 3, PEEK_EVERY_S + 3, 300.0, 3.0)
        assert actions == [self.PEEK] and again.next_probe == NOW + 2 * PEEK_EVERY_S

    def test_a_peek_whose_proof_only_needs_time_peeks_again_when_it_has_had_it(self) -> None:
        # A rank stopped 1 s ago (on another node: the leader's peek): proof once it has been stopped 2 s.
        peeked = self.peeked()
        waiting, actions = on_probe(peeked, NOW + 0.2, MISMATCH, moved=False, stalled_for=3.2, settles_at=NOW + 1.2)
        assert actions == [] and waiting.phase is Phase.watching and waiting.next_probe == NOW + 1.2
        assert on_tick(waiting, NOW + 1.1, NOW - 3, 4.1, 300.0, 3.0) == (waiting, [])
        _, actions = on_tick(waiting, NOW + 1.2, NOW - 3, 4.2, 300.0, 3.0)
        assert actions == [self.PEEK]

    GPU_HANG_1 = Decision(Finding(Verdict.gpu_compute_hang, "s", culprits=(1,)), page=True)

    def test_a_peek_whose_proof_needs_time_is_the_first_look_of_the_stall_timeout(self) -> None:
        # 4 x H200: a GPU hang seen at 3 s of silence, not held 15 s yet; the stall timeout (6 s) came first, and its
        # probe looked again before paging though the peek had seen the same rank.
        incident, _ = on_tick(WATCHING, NOW, NOW - 3, 3.0, 6.0, peek_after=3.0)
        waiting, actions = on_probe(incident, NOW + 0.3, self.GPU_HANG_1, False, 3.3, settles_at=NOW + 12)
        assert actions == [] and waiting.peeked == (NOW + 0.3, self.GPU_HANG_1)
        suspect, _ = on_tick(waiting, NOW + 3, NOW - 3, 6.0, 6.0, peek_after=3.0)
        paged, actions = on_probe(suspect, NOW + 4, self.GPU_HANG_1, False, 7.0)
        assert paged.phase is Phase.paged and actions == [Page(self.GPU_HANG_1)]

    def test_progress_after_a_peek_starts_the_silence_over(self) -> None:
        peeked = self.peeked()
        assert on_tick(peeked, NOW + 1, NOW + 0.5, 0.5, 300.0, 3.0) == (WATCHING, [])
        _, actions = on_tick(peeked, NOW + 3.5, NOW + 0.5, 3.0, 300.0, 3.0)  # the new silence: peek_after, not 20 s
        assert actions == [self.PEEK]

    def test_a_rank_moving_during_the_peek_is_no_proof(self) -> None:
        peeked = self.peeked()
        assert on_probe(peeked, NOW + 0.2, MISMATCH, moved=True, stalled_for=3.2, proven=True) == (peeked, [])

    def test_a_peek_then_the_stall_timeout_takes_the_regular_suspect_path(self) -> None:
        peeked = self.peeked()
        suspect, actions = on_tick(peeked, NOW + 5, NOW - 3, 8.0, 5.0, 3.0)
        assert suspect.phase is Phase.suspect and actions == [Probe(confirming=False)] and not suspect.proof_only
        confirming, _ = on_probe(suspect, NOW + 5.2, decision(True), moved=False, stalled_for=8.2)
        assert confirming.phase is Phase.confirming

    def test_a_conclusive_verdict_in_suspect_pages_without_confirming(self) -> None:
        suspect, _ = on_tick(WATCHING, NOW, NOW - 6, 6.0, 5.0)
        paged, actions = on_probe(suspect, NOW + 0.2, MISMATCH, moved=False, stalled_for=6.2, proven=True)
        assert paged.phase is Phase.paged and actions == [Page(MISMATCH)]

    def test_streamed_proof_opens_the_incident_at_once(self) -> None:
        suspect, actions = on_tick(WATCHING, NOW, NOW - 1, 1.0, 300.0, 3.0, proven=True)
        assert suspect.phase is Phase.suspect and suspect.proof_only and actions == [Probe(confirming=False)]

    def test_opened_on_proof_silence_alone_still_waits_for_the_stall_timeout(self) -> None:
        """The full look no longer proves it (a rank behind, say): no confirming look, no page, until the timeout."""
        suspect, _ = on_tick(WATCHING, NOW, NOW - 1, 1.0, 300.0, 3.0, proven=True)
        held, actions = on_probe(suspect, NOW + 0.2, decision(True), moved=False, stalled_for=1.2)
        assert held.phase is Phase.suspect and actions == [] and held.proof_only
        assert on_tick(held, NOW + 5.2, NOW - 1, 6.2, 300.0, 3.0)[1] == [Probe(confirming=False)]
        late, _ = on_tick(held, NOW + 299, NOW - 1, 300.0, 300.0, 3.0)
        assert not late.proof_only
        assert on_probe(late, NOW + 299, decision(True), moved=False, stalled_for=300.0)[0].phase is Phase.confirming


def test_the_journal_starts_over_past_its_bound(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ncclwatch.watchdog.hang.state import JobState
    from ncclwatch.watchdog.live import journal as journal_module

    monkeypatch.setattr(journal_module, "MAX_BYTES", 2000)
    state = JobState()
    state.apply(WorkerSeen(pid=100, rank=0, host="node1", at=NOW))
    journal = Journal(tmp_path / "journal.jsonl")
    for second in range(40):
        journal.record(state, Stall(at=NOW + second, stalled_for_s=second, stall_timeout_s=5, progress_timeout_s=600))
    events = parse_journal((tmp_path / "journal.jsonl").read_bytes(), "journal.jsonl")
    stalls = [e for e in events if isinstance(e, Stall)]
    assert (tmp_path / "journal.jsonl").stat().st_size <= 2000 + 400 and stalls[-1].at == NOW + 39


def test_a_peer_node_probing_a_stall_makes_this_node_look_at_the_floor(tmp_path: Path) -> None:
    """A node whose own learned timeout is longer would keep the leader waiting for its evidence."""
    from ncclwatch.watchdog.cluster.peers import Cluster, Membership
    from ncclwatch.watchdog.cluster.view import JobView
    from ncclwatch.watchdog.live.nodes import Nodes

    rig = Rig(tmp_path)
    for rank in range(2):
        rig.emit(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW))
    rig.tick(6)  # no rhythm learned yet: the warm-up timeout (300 s) applies
    cluster = Cluster(Membership("127.0.0.1", 1, "job", 0, 1, 2), "node1", clock=rig.clock)
    rig.sidecar.nodes = nodes = Nodes(rig.sidecar, cluster)
    rig.sidecar.judging = nodes.judging
    cluster.view, cluster._view_changed_at = JobView(leader=0, term=0, seq=1, nnodes=2), NOW + 6
    rig.tick(6.5)
    assert rig.phase is Phase.watching
    cluster.view, cluster._view_changed_at = JobView(leader=0, term=0, seq=2, nnodes=2, probing=[0]), NOW + 6.5
    rig.sidecar.live.down["cluster"] = "test: judge alone"  # no store here: this node judges its own ranks
    rig.tick(7)
    assert rig.phase is not Phase.watching and rig.prober.calls  # probed at the 5 s floor, not 300 s


@pytest.mark.parametrize(
    ("serves", "job_failed", "paged", "lingers"),
    [
        (True, False, True, "store gone"),  # its own response ended the job, and the store with it
        (True, True, False, "store gone"),  # its job failed: the store went with it
        (True, False, False, "usual"),  # a clean end: every node's job ends cleanly
        (False, False, True, "usual"),  # a member: the store lives on elsewhere
    ],
)
def test_the_node_serving_the_store_answers_longer_when_its_job_ended_on_a_hang(
    tmp_path: Path, serves: bool, job_failed: bool, paged: bool, lingers: str
) -> None:
    """Its end takes the store from every node; a member that had not read the verdict asks its lifeline whether it
    is lost once the member's own torchrun ends, seconds later (H200: node_lost paged after 3 s of lingering)."""
    from ncclwatch.watchdog.cluster.lifeline import LINGER_S, STORE_GONE_LINGER_S
    from ncclwatch.watchdog.cluster.peers import Cluster, Membership
    from ncclwatch.watchdog.live.nodes import Nodes

    rig = Rig(tmp_path)
    cluster = Cluster(
        Membership("127.0.0.1", free_port(), "job", 0, 0, 2), "node0", clock=rig.clock, serves_store=serves
    )
    rig.sidecar.nodes = nodes = Nodes(rig.sidecar, cluster)
    assert asyncio.run(nodes.farewell(job_failed=job_failed, paged=paged)) is None
    rig.sidecar.drain()  # the sidecar folds what the farewell said (the store gone)
    assert nodes.linger_s() == {"store gone": STORE_GONE_LINGER_S, "usual": LINGER_S}[lingers]


def test_the_sidecar_meets_the_other_nodes_once_its_workers_name_the_store_and_several_nodes(tmp_path: Path) -> None:
    """Before, it judges its ranks alone (``NodeJudging``) and holds no ``Nodes``; then the whole job's judging, and
    the exchange runs beside the ticks.  A single node's workers never make it meet anyone."""
    from ncclwatch.watchdog.cluster.peers import Cluster, Membership
    from ncclwatch.watchdog.live.nodes import Nodes

    met: list[Membership] = []

    def join(membership: Membership, host: str) -> Cluster:
        met.append(membership)
        return Cluster(membership, host, clock=rig.clock)

    async def tick(sidecar: Sidecar) -> None:
        await sidecar.tick()
        for task in sidecar._tasks:  # the exchange's task: no store here
            task.cancel()

    rig = Rig(tmp_path)
    sidecar = Sidecar(
        SETTINGS, "train", sources=[], prober=rig.prober, reporter=rig.report, clock=rig.clock, join_cluster=join
    )  # type: ignore[arg-type]
    store = {"store": "127.0.0.1:1", "run_id": "job", "node_rank": 1}
    sidecar.emit(WorkerSeen(pid=100, rank=0, host="node1", at=NOW, nnodes=1, **store))  # type: ignore[arg-type]
    asyncio.run(tick(sidecar))
    assert sidecar.nodes is None and isinstance(sidecar.judging, NodeJudging) and met == []
    sidecar.emit(WorkerSeen(pid=101, rank=1, host="node1", at=NOW, nnodes=2, **store))  # type: ignore[arg-type]
    asyncio.run(tick(sidecar))
    assert isinstance(sidecar.nodes, Nodes) and sidecar.judging is sidecar.nodes.judging
    assert met == [Membership("127.0.0.1", 1, "job", 0, 1, 2)]
    asyncio.run(tick(sidecar))
    assert len(met) == 1  # met once


def test_the_leaders_verdict_reaches_a_member_through_its_queue_and_the_tick_pages_its_part(tmp_path: Path) -> None:
    """A member's exchange reads the leader's verdict and queues it; the member's summary says it follows at once
    (the leader waits for that before its job, and the store, end), and its next tick pages this node's part: the
    bundle, no alert (the leader pages)."""
    from ncclwatch.watchdog.cluster.handoff import LeaderVerdict
    from ncclwatch.watchdog.cluster.peers import Cluster, Membership
    from ncclwatch.watchdog.cluster.view import JobView
    from ncclwatch.watchdog.live.nodes import Nodes

    rig = Rig(tmp_path)
    for rank in range(2):
        rig.emit(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW))
    rig.tick(1)
    cluster = Cluster(Membership("127.0.0.1", 1, "job", 0, 1, 2), "node1", clock=rig.clock)
    rig.sidecar.nodes = nodes = Nodes(rig.sidecar, cluster)
    rig.sidecar.judging = nodes.judging
    cluster.view, cluster._view_changed_at = JobView(leader=0, term=0, seq=1, nnodes=2), NOW + 1
    stuck = Decision(Finding(Verdict.stuck_in_collective, "rank 0 is stuck", culprits=(0,)), page=True)
    nodes._following = "job/0|stuck"  # what ``Nodes._follow`` notes as it queues the verdict
    rig.sidecar.emit(LeaderVerdict("job/0|stuck", stuck))
    assert rig.phase is Phase.watching and nodes._summary().phase == "paged"  # queued, said followed already
    rig.tick(1.5)
    assert rig.phase is Phase.paged and rig.pages == [stuck] and rig.alerts.submitted == []
    assert "node 0 pages the job-wide verdict" in rig.out.getvalue()
    assert nodes._summary().phase == "paged" and nodes._following is None


# -- the sidecar's parts, alone --------------------------------------------------


class Restarts:
    """The ``Responder``: every hang is answered by restart 1 of 3; carrying it out does nothing here."""

    restarts = 0

    def plan(self, report, restarts_done: int) -> Plan:  # type: ignore[no-untyped-def]
        return Plan(Response.restart, "a transient fault", restart_number=1, max_restarts=3)

    def follow(self, response: str, why: str, restarts_done: int) -> Plan:
        raise AssertionError("a single node never follows a leader")

    async def carry_out(self, plan, report, bundle, workers, pages):  # type: ignore[no-untyped-def]
        return []


def test_one_node_judges_its_own_ranks_and_pages_them(tmp_path: Path) -> None:
    """``NodeJudging``: no store, no other node; the verdict is this node's, and this node pages it."""
    rig = Rig(tmp_path)
    healthy_job(rig)
    stuck_frames(rig)
    rig.tick(25.1)  # the probe's stacks are in the job's state now
    judging = rig.sidecar.judging
    assert isinstance(judging, NodeJudging)
    stall = Stall(at=NOW + 26, stalled_for_s=6, stall_timeout_s=5, progress_timeout_s=600)
    decision = asyncio.run(judging.judge(stall, []))
    assert decision.page and decision.finding.culprits == (2,)
    role = judging.role(decision)
    assert (role.job_wide, role.follows, role.key) == (False, False, None) and rig.sidecar.nodes is None
    assert role.state is rig.sidecar.live.state
    assert asyncio.run(judging.page(decision, role, None)) is None


def test_the_page_goes_out_before_the_evidence_and_links_the_bundle_about_to_be_written(tmp_path: Path) -> None:
    """Collecting the evidence takes seconds (stacks, dumps, the bandwidth probe): the alert does not wait for it."""
    rig = Rig(tmp_path)
    sent: list = []  # type: ignore[type-arg]
    rig.sidecar.dispatcher.submit = sent.append  # type: ignore[union-attr]
    planned = tmp_path / "bundles" / "train-node1-hang.tar.gz"
    rig.sidecar.bundle_for = lambda report, view: planned
    seen_by_reporter: list[int] = []

    async def slow_reporter(report, decision, view):  # type: ignore[no-untyped-def]
        seen_by_reporter.append(len(sent))  # alerts already submitted when the bundle is begun
        planned.parent.mkdir()
        planned.write_bytes(b"bundle")
        return report, planned

    rig.sidecar.reporter = slow_reporter
    healthy_job(rig)
    stuck_frames(rig)
    rig.tick(25.1)
    rig.tick(25.1 + CONFIRM_S)
    assert rig.phase is Phase.paged and seen_by_reporter == [1]
    (alert,) = sent
    assert alert.action == "trigger" and alert.bundle_url == planned.resolve().as_uri()
    assert rig.sidecar.reported[0].bundle == planned


def test_a_restart_is_followed_until_the_new_round_trains(tmp_path: Path) -> None:
    """``Responding``: after restart 1 of 3 the old round's silence is not watched; the new round's ranks are, and
    the page is resolved once every one of them has taken a step."""
    rig = Rig(tmp_path)
    rig.sidecar.responding.responder = Restarts()
    healthy_job(rig)
    stuck_frames(rig)
    rig.tick(25.1)
    rig.tick(25.1 + CONFIRM_S)
    assert rig.phase is Phase.paged and rig.alerts.submitted == ["trigger"]
    assert "restarting (1 of 3): a transient fault" in rig.out.getvalue()
    rig.tick(40)  # the old round's workers, dying: nothing is probed
    assert rig.phase is Phase.paged and len(rig.prober.calls) == 2
    rig.emit(*(WorkerSeen(pid=200 + r, rank=r, restart_count=1, host="node1", at=NOW + 41) for r in range(3)))
    rig.tick(41)
    assert rig.phase is Phase.watching and rig.alerts.submitted == ["trigger"]
    assert "restart 1 of 3: the new round's ranks are up; watching them" in rig.out.getvalue()
    rig.emit(*(Heartbeat(pid=200 + r, rank=r, step=1, time=NOW + 42, restart=1) for r in range(2)))
    rig.tick(42)  # rank 2 has not stepped (still setting up NCCL, or failing to): not training yet
    assert rig.alerts.submitted == ["trigger"] and rig.sidecar.responding.restarting is not None
    rig.emit(Heartbeat(pid=202, rank=2, step=1, time=NOW + 43, restart=1))
    rig.tick(43)
    assert rig.alerts.submitted == ["trigger", "resolve"] and rig.sidecar.responding.restarting is None
    assert "training again after restart 1 of 3" in rig.out.getvalue()
