"""What the sidecar looks at when a stall is suspected: dumps, stacks, GPUs, in parallel.

``JobProber`` asks every rank that can answer for a Flight Recorder dump,
takes non-blocking py-spy stacks of every rank and (except on the
confirming look, which reuses it) an NVML sample.  Each piece is bounded in
time; one that fails is a missing piece of evidence (logged), never an
exception: the classifier then sees less, and says so ("blind").
A stopped rank is not asked for a dump: it cannot answer, and waiting for
it would only delay the verdict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ncclwatch.watchdog.engine.snapshot import WorkerView
from ncclwatch.watchdog.events import STOPPED_STATES, Event
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy
from ncclwatch.watchdog.sources.flight_recorder import prime, read_dump, request_dumps
from ncclwatch.watchdog.sources.gpus import gpu_snapshot

log = logging.getLogger("ncclwatch")

STACK_TIMEOUT_S = 5.0


class Prober(Protocol):
    async def probe(self, workers: Sequence[WorkerView], with_gpus: bool) -> list[Event]: ...

    def prime(self, workers: Sequence[WorkerView]) -> None: ...


class JobProber:
    def __init__(self, fr_dir: Path, pyspy: str | None) -> None:
        self.fr_dir = fr_dir
        self.pyspy = pyspy
        self._primed: set[int] = set()  # worker pids whose Flight Recorder was primed

    def prime(self, workers: Sequence[WorkerView]) -> None:
        """Ask each rank for one dump while healthy: the first is slow (seconds), later ones fast."""
        ranks = {w.rank: w.pid for w in workers if not w.gone}
        if self._primed >= set(ranks.values()):
            return
        self._primed |= set(ranks.values())
        log.info("primed Flight Recorder of %d rank(s)", prime(self.fr_dir, ranks))

    async def probe(self, workers: Sequence[WorkerView], with_gpus: bool) -> list[Event]:
        alive = [w for w in workers if not w.gone]
        answering = {w.rank: w.pid for w in alive if w.state not in STOPPED_STATES}
        dumps, stacks, gpus = await asyncio.gather(
            request_dumps(self.fr_dir, answering),
            asyncio.gather(*(self._stack(w.pid) for w in alive)),
            gpu_snapshot() if with_gpus else asyncio.sleep(0),
            return_exceptions=True,
        )
        events: list[Event] = []
        if isinstance(dumps, tuple):
            fresh, errors = dumps
            for path in fresh.values():
                events += read_dump(path)
            for rank, error in errors.items():
                log.info("rank %s: no Flight Recorder dump: %s", rank, error)
        if isinstance(stacks, list):
            events += [event for found in stacks for event in found]
        if gpus is not None and not isinstance(gpus, BaseException):
            events.append(gpus)
        return events

    async def _stack(self, pid: int) -> list[Event]:
        from ncclwatch.watchdog.probes.pyspy import pyspy_dump

        data, error = await pyspy_dump(pid, native=False, timeout_s=STACK_TIMEOUT_S, pyspy=self.pyspy)
        if data is None:
            log.info("py-spy on pid %s: %s", pid, error)
            return []
        return parse_pyspy(data, f"py-spy pid {pid} (live)")
