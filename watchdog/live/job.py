"""The live job: the engine's state plus what only a running job shows — time.

``LiveJob`` folds every event into the engine's ``JobState`` and, per worker
process, keeps when it last made progress (a heartbeat with a new step, a new
operation in its NCCL debug file), the gaps between progress it showed while
healthy, and its latest /proc sample.  From those it answers two questions
the detectors cannot: how long has nothing moved, and how long is too long
for this job (the learned stall timeout).

``view()`` freezes what ``classify`` needs; this module decides nothing.
Memory is bounded: per worker a fixed deque of gaps; GPU and RAS samples
keep only the latest few (``JobState.keep_latest``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.engine.state import DEFAULT_WINDOW, JobState
from ncclwatch.watchdog.events import Event, Heartbeat, OpBatch, ProcessState, SourceDown, SourceUp, WorkerGone, WorkerSeen

MIN_PROGRESS = 8  # steps (or NCCL operation batches) the job must show before its own timing is trusted
GAP_MEMORY_S = 900.0  # a gap older than this no longer widens the timeout
STALL_MULTIPLIER = 3.0
SAMPLES_KEPT = 8  # /proc samples per worker (0.5 s apart: CPU and I/O rates over ~4 s)


@dataclass
class WorkerLive:
    pid: int
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    restart: int = 0
    seen_at: float = 0.0
    gone_at: float | None = None
    last_progress: float | None = None
    step: int | None = None
    beat_at: float | None = None  # when the step of the latest heartbeat was taken
    ops: int = 0
    advances: int = 0  # progress seen since the first: steps moved, NCCL batches
    gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))  # (when, gap seconds)
    samples: deque[ProcessState] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))

    @property
    def proc(self) -> ProcessState | None:
        return self.samples[-1] if self.samples else None

    def rates(self) -> tuple[float | None, float | None]:
        """CPU (cores) and I/O (bytes/s) over the samples kept: a busy rank from an idle one."""
        if len(self.samples) < 2:
            return None, None
        first, last = self.samples[0], self.samples[-1]
        seconds = last.at - first.at
        if seconds <= 0:
            return None, None
        io = (last.io_bytes - first.io_bytes) / seconds if last.io_bytes is not None and first.io_bytes is not None else None
        return (last.cpu_seconds - first.cpu_seconds) / seconds, io

    def progressed(self, at: float, advances: int = 1) -> None:
        if self.last_progress is not None and at > self.last_progress:
            self.gaps.append((at, at - self.last_progress))
            self.advances += advances
        self.last_progress = max(at, self.last_progress or at)


@dataclass(frozen=True)
class RankNow:
    """One worker as ``classify`` sees it."""

    rank: int
    pid: int
    local_rank: int | None
    host: str | None
    state: str | None  # /proc state letter
    cpu_share: float | None  # cores used over the last few seconds
    io_rate: float | None  # bytes/s read + written over the last few seconds
    step: int | None
    ops: int
    last_progress: float | None
    gone: bool


@dataclass(frozen=True)
class LiveView:
    observed_at: float
    ranks: tuple[RankNow, ...]
    last_progress: float  # the latest moment any worker made progress (or the job's start)
    stall_timeout: float
    learned_gap: float | None
    signals: frozenset[str]  # progress signals seen so far: "heartbeat", "nccl_log"
    down: tuple[str, ...]  # sources that cannot read, with why

    @property
    def stalled_for(self) -> float:
        return self.observed_at - self.last_progress


class LiveJob:
    def __init__(self, settings: Settings, started_at: float, window: int = DEFAULT_WINDOW) -> None:
        self.settings = settings
        self.started_at = started_at
        self.state = JobState(window=window)
        self.workers: dict[int, WorkerLive] = {}
        self.signals: set[str] = set()
        self.down: dict[str, str] = {}

    def worker(self, pid: int) -> WorkerLive:
        worker = self.workers.get(pid)
        if worker is None:
            worker = self.workers[pid] = WorkerLive(pid=pid)
        return worker

    def apply(self, event: Event, now: float) -> None:
        if isinstance(event, OpBatch):
            worker = self.worker(event.proc.pid)
            worker.ops += len(event.sigs) + len(event.p2p)
            worker.progressed(now)
            self.signals.add("nccl_log")
        elif isinstance(event, Heartbeat):
            worker = self.worker(event.pid)
            if worker.step != event.step:
                # Several steps can pass between two reads of the file (it is written at most every 0.1 s).
                moved = event.step - worker.step if worker.step is not None and event.step > worker.step else 1
                worker.step, worker.beat_at = event.step, event.time
                # The hook's own clock, not our poll: gaps are then the job's, not the poll interval's.
                worker.progressed(min(event.time, now), moved)
                self.signals.add("heartbeat")
        elif isinstance(event, WorkerSeen):
            worker = self.worker(event.pid)
            worker.rank, worker.local_rank, worker.host = event.rank, event.local_rank, event.host
            worker.restart, worker.seen_at = event.restart_count, event.at
        elif isinstance(event, WorkerGone):
            self.worker(event.pid).gone_at = event.at
        elif isinstance(event, ProcessState):
            self.worker(event.pid).samples.append(event)
        elif isinstance(event, SourceDown):
            self.down[event.source] = event.reason
        elif isinstance(event, SourceUp):
            self.down.pop(event.source, None)
        self.state.apply(event)
        self.state.keep_latest(4)

    def live_workers(self) -> list[WorkerLive]:
        """Workers of the current attempt: an elastic restart retires every older pid."""
        current = max((w.restart for w in self.workers.values() if w.rank is not None), default=0)
        return [w for w in self.workers.values() if w.rank is not None and w.restart == current]

    def learned_gap(self, now: float) -> tuple[float | None, int]:
        """The longest recent gap between progress, and how much progress the job has shown."""
        workers = self.live_workers()
        gaps = [g for w in workers for when, g in w.gaps if now - when <= GAP_MEMORY_S]
        return (max(gaps) if gaps else None), sum(w.advances for w in workers)

    def stall_timeout(self, now: float) -> float:
        return self._timeout(*self.learned_gap(now))

    def _timeout(self, gap: float | None, progress: int) -> float:
        if self.settings.stall_timeout is not None:
            return self.settings.stall_timeout
        if gap is None or progress < MIN_PROGRESS:
            return self.settings.warmup_stall_timeout
        return max(self.settings.stall_timeout_floor, STALL_MULTIPLIER * gap + 2 * self.settings.poll_interval)

    def last_progress(self) -> float:
        workers = self.live_workers()
        times = [w.last_progress for w in workers if w.last_progress is not None]
        if times:
            return max(times)
        return max([w.seen_at for w in workers] + [self.started_at])

    @staticmethod
    def _rank_now(worker: WorkerLive) -> RankNow:
        cpu, io = worker.rates()
        return RankNow(
            rank=worker.rank,  # type: ignore[arg-type]  # live_workers() have one
            pid=worker.pid,
            local_rank=worker.local_rank,
            host=worker.host,
            state=worker.proc.state if worker.proc else None,
            cpu_share=cpu,
            io_rate=io,
            step=worker.step,
            ops=worker.ops,
            last_progress=worker.last_progress,
            gone=worker.gone_at is not None,
        )

    def view(self, now: float) -> LiveView:
        gap, progress = self.learned_gap(now)
        ranks = tuple(self._rank_now(w) for w in sorted(self.live_workers(), key=lambda w: w.rank or 0))
        return LiveView(
            observed_at=now,
            ranks=ranks,
            last_progress=self.last_progress(),
            stall_timeout=self._timeout(gap, progress),
            learned_gap=gap,
            signals=frozenset(self.signals),
            down=tuple(f"{k}: {v}" for k, v in sorted(self.down.items())),
        )
