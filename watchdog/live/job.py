"""The live job: the engine's state plus what only a running job shows — time.

``LiveJob`` folds every event into the engine's ``JobState`` (which keeps
each worker's identity and /proc samples, the same as ``ncclwatch analyze``
reads them back from the journal) and, per worker process, keeps when it
last made progress (a heartbeat with a new step, a new operation in its
NCCL debug file) and the gaps between progress it showed while healthy.
From those it answers three questions the detectors cannot: how long has
nothing moved, how long is too long for this job (the learned stall
timeout), and after how much silence a look may find proof of a hang before
that (``peek_after``: a look that pages only what proves itself, see
``incident.py``).  It also counts the events that could change a verdict
(``revision``: operations, workers gone or stopped, NCCL's warnings; not
heartbeats, GPU samples or unchanged /proc samples), so the streamed state is
judged again only when one came.

``view()`` freezes that; this module decides nothing.  Memory is bounded:
per worker a fixed deque of gaps; GPU and RAS samples keep only the latest
few (``JobState.keep_latest``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import (
    STOPPED_STATES,
    Event,
    FrDump,
    GpuSnapshot,
    Heartbeat,
    OpBatch,
    ProcessState,
    SourceDown,
    SourceUp,
)
from ncclwatch.watchdog.hang.snapshot import WorkerView, worker_view
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW, JobState

MIN_PROGRESS = 8  # steps (or NCCL operation batches) the job must show before its own timing is trusted
# A worker's first steps are its slowest and do not recur (CUDA and cuBLAS set up, NCCL connecting on first use,
# DDP's buckets): 2-2.6 s on the H100 suite, tripling the stall timeout.  Gaps before a worker's heartbeat has
# moved this many steps are learned only while the job has shown no others.
WARMUP_STEPS = 2
GAP_MEMORY_S = 900.0  # a gap older than this no longer widens the timeout
STALL_MULTIPLIER = 3.0
# A look for proof while the job is silent, before the stall timeout: before the job has a rhythm, after this much
# silence (on CPU a look at 3 gloo ranks took 0.2 s; a healthy start-up is looked at every PEEK_EVERY_S, silently).
# 3 s was a third of a two-wrapper page at step 1 on the H200 (6.6 s); the rhythm's peek is never sooner either...
PEEK_WARMUP_S = 2.0
PEEK_MULTIPLIER = 1.5  # ... once it has one, after 1.5 x its longest gap (the stall timeout is 3 x) ...
PEEK_MIN_S = 2.0  # ... and never sooner than this
_UNCHANGING = (Heartbeat, GpuSnapshot, SourceDown, SourceUp)  # events that change no verdict of the streamed state


@dataclass
class Progress:
    """When one worker last moved, and the gaps between its moves."""

    last_progress: float | None = None
    beat_at: float | None = None  # when the step of the latest heartbeat was taken
    ops: int = 0
    advances: int = 0  # progress seen since the first: steps moved, NCCL batches
    beats: int = 0  # the heartbeat's count of beats at its latest read
    gaps: deque[tuple[float, float, bool]] = field(default_factory=lambda: deque(maxlen=256))  # (when, seconds, warm)
    first_step: int | None = None  # the first heartbeat step seen
    warm: bool = False  # its heartbeat moved WARMUP_STEPS steps: later gaps are the job's rhythm

    def stepped(self, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        self.warm = self.warm or step - self.first_step >= WARMUP_STEPS

    def progressed(self, at: float, advances: int = 1) -> None:
        """Progress at ``at``, ``advances`` of it since the previous; a first one that says more came before it
        (a heartbeat first read at its 61st beat) counts that.

        Progress stamped before the latest (a heartbeat carries the hook's clock, NCCL's operations the poll's,
        a little later) still counts: a compiled model's 200 quick steps were dropped so, 7 advances were
        counted and its hang waited for the warm-up timeout."""
        if self.last_progress is None:
            self.advances += advances - 1
        else:
            if at > self.last_progress:
                self.gaps.append((at, at - self.last_progress, self.warm))
            self.advances += advances
        self.last_progress = max(at, self.last_progress or at)


@dataclass(frozen=True)
class LiveView:
    observed_at: float
    workers: tuple[WorkerView, ...]  # the current attempt's workers, by rank
    progress_at: Mapping[int, float | None]  # pid -> when it last made progress
    beat_at: Mapping[int, float | None]  # pid -> when its latest heartbeat step was taken
    last_progress: float  # the latest moment any worker made progress (or the job's start)
    stall_timeout: float
    learned_gap: float | None
    advances: int  # progress the job has shown (steps, NCCL batches): below MIN_PROGRESS the warm-up timeout holds
    signals: frozenset[str]  # progress signals seen so far: "heartbeat", "nccl_log"
    down: tuple[str, ...]  # sources that cannot read, with why
    peek_after: float | None = None  # silence after which a look may find proof; None: the stall timeout comes first

    @property
    def stalled_for(self) -> float:
        return self.observed_at - self.last_progress

    @property
    def alive(self) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if not w.gone)


class LiveJob:
    def __init__(self, settings: Settings, started_at: float, window: int = DEFAULT_WINDOW) -> None:
        self.settings = settings
        self.started_at = started_at
        self.state = JobState(window=window)
        self.progress: dict[int, Progress] = {}
        self.signals: set[str] = set()
        self.down: dict[str, str] = {}
        self.excused: list[tuple[float, float]] = []  # (from, to): the watchdog's own doing slowed the job
        self.revision = 0  # events folded in that could change a verdict of the streamed state
        # (communicator key, global rank) -> the round (restart count) in which a dump last replaced that sequence
        self.dumped_in: dict[tuple[str, int], int] = {}

    def excuse(self, at: float, seconds: float) -> None:
        """Gaps overlapping [at, at + seconds] were caused by the watchdog (a first Flight Recorder dump).

        They are not learned.
        """
        self.excused.append((at, at + seconds))

    def of(self, pid: int) -> Progress:
        progress = self.progress.get(pid)
        if progress is None:
            progress = self.progress[pid] = Progress()
        return progress

    def apply(self, event: Event, now: float) -> None:
        if isinstance(event, OpBatch):
            progress = self.of(event.proc.pid)
            progress.ops += len(event.sigs) + len(event.p2p)
            progress.progressed(now)
            self.signals.add("nccl_log")
        elif isinstance(event, Heartbeat):
            progress = self.of(event.pid)
            last = self.state.worker(event.pid).step  # the state takes the new step below
            if last != event.step:
                # Several steps can pass between two reads of the file (it is written at most every 0.1 s), and
                # before the first: the beat count says how many.  On the H100 a pipeline job's first read was its
                # 60th step, 0.3 s in; counted as one move, its hang there waited for the warm-up timeout.
                if event.beats > progress.beats:
                    moved = event.beats - progress.beats
                else:
                    moved = event.step - last if last is not None and event.step > last else 1
                progress.beats = max(progress.beats, event.beats)
                progress.beat_at = event.time
                progress.stepped(event.step)
                # The hook's own clock, not our poll: gaps are then the job's, not the poll interval's.
                progress.progressed(min(event.time, now), moved)
                self.signals.add("heartbeat")
        elif isinstance(event, SourceDown):
            self.down[event.source] = event.reason
        elif isinstance(event, SourceUp):
            self.down.pop(event.source, None)
        elif isinstance(event, FrDump) and event.rank is not None:
            # Only a group with entries replaces the rank's sequence (a new round's first dumps are empty: the old
            # round's sequences stay).  The key is the state's own for a Flight Recorder group ("fr:<pg>").
            for pg in {entry.pg_id for entry in event.entries}:
                self.dumped_in[(f"fr:{pg}", event.rank)] = self.state.current_round()
        if not isinstance(event, _UNCHANGING) and not (isinstance(event, ProcessState) and self._same_state(event)):
            self.revision += 1
        self.state.apply(event)
        self.state.keep_latest(4)

    def _same_state(self, sample: ProcessState) -> bool:
        """A /proc sample that changes nothing a verdict reads: the worker was, and is, stopped or not (running and
        sleeping alternate all the time)."""
        worker = self.state.workers.get(sample.pid)
        was = worker.proc_state if worker is not None else None
        return was is not None and (was in STOPPED_STATES) == (sample.state in STOPPED_STATES) and sample.state != "Z"

    def mark_progress(self, ranks: set[int], now: float) -> None:
        """Ranks seen moving by a probe (Flight Recorder positions grew): that is progress too."""
        for worker in self.state.current_workers():
            if worker.rank in ranks:
                self.of(worker.pid).progressed(now)

    def learned_gap(self, now: float) -> tuple[float | None, int]:
        """The longest recent gap between progress (past warm-up, when there is any), and how much progress the
        job has shown.  Without heartbeats no worker is ever warm: every gap counts.

        After an elastic restart the job's rhythm is the one its earlier attempts showed, once the new attempt
        has moved at all (before that it is starting up, and gets the warm-up timeout).  Seen in CI on a loaded
        machine: the new attempt's ranks were first read at step 11, already stuck, so they alone had no gaps
        and the warm-up timeout (300 s) held the page back.
        """
        current = [self.of(w.pid) for w in self.state.current_workers()]
        progress = list(self.progress.values()) if any(p.last_progress is not None for p in current) else current
        gaps = [
            (g, warm)
            for p in progress
            for when, g, warm in p.gaps
            if now - when <= GAP_MEMORY_S and not any(when - g < to and when > since for since, to in self.excused)
        ]
        steady = [g for g, warm in gaps if warm] or [g for g, _ in gaps]
        return (max(steady) if steady else None), sum(p.advances for p in progress)

    def stall_timeout(self, now: float) -> float:
        return self._timeout(*self.learned_gap(now))

    def _timeout(self, gap: float | None, progress: int) -> float:
        if self.settings.stall_timeout is not None:
            return self.settings.stall_timeout
        if gap is None or progress < MIN_PROGRESS:
            return self.settings.warmup_stall_timeout
        return max(self.settings.stall_timeout_floor, STALL_MULTIPLIER * gap + 2 * self.settings.poll_interval)

    def _peek_after(self, gap: float | None, progress: int, timeout: float) -> float | None:
        """After how much silence to look for proof (a mismatch, a dead or stopped rank) before the stall timeout:
        a few seconds while the job has no rhythm (a hang in the first second waited for the 300 s warm-up
        timeout), else 1.5 x its longest gap; None when that is not below the stall timeout."""
        if gap is None or progress < MIN_PROGRESS:
            peek = PEEK_WARMUP_S
        else:
            peek = max(PEEK_MIN_S, PEEK_MULTIPLIER * gap)
        return peek if peek < timeout else None

    def moved_since(self, since: float) -> bool:
        """Did a worker of the current attempt make progress (a step, an NCCL operation) after ``since``?"""
        return any((p := self.of(w.pid).last_progress) is not None and p > since for w in self.state.current_workers())

    def trained_since(self, since: float, before: int) -> bool:
        """Has every worker of the current round trained after ``since``?  A heartbeat step where the workers of
        round ``before`` beat (a step needs every rank's collectives, so one rank's NCCL set-up is no sign), else
        any progress of each (a job without heartbeats); and as many workers as round ``before`` had here."""
        old = [w for w in self.state.workers.values() if w.rank is not None and w.restart == before]
        current = self.state.current_workers()
        if not current or len(current) < len(old):
            return False
        beats = any(self.of(w.pid).beat_at is not None for w in old)
        times = [self.of(w.pid).beat_at if beats else self.of(w.pid).last_progress for w in current]
        return all(t is not None and t > since for t in times)

    def last_progress(self) -> float:
        workers = self.state.current_workers()
        times = [p for w in workers if (p := self.of(w.pid).last_progress) is not None]
        if times:
            return max(times)
        return max([w.seen_at for w in workers] + [self.started_at])

    def view(self, now: float) -> LiveView:
        gap, progress = self.learned_gap(now)
        workers = self.state.current_workers()
        timeout = self._timeout(gap, progress)
        return LiveView(
            observed_at=now,
            workers=tuple(worker_view(w, self.state.probes_of(w.host)) for w in workers),
            progress_at=MappingProxyType({w.pid: self.of(w.pid).last_progress for w in workers}),
            beat_at=MappingProxyType({w.pid: self.of(w.pid).beat_at for w in workers}),
            last_progress=self.last_progress(),
            stall_timeout=timeout,
            learned_gap=gap,
            advances=progress,
            signals=frozenset(self.signals),
            down=tuple(f"{k}: {v}" for k, v in sorted(self.down.items())),
            peek_after=self._peek_after(gap, progress, timeout),
        )
