"""Write the probe's inputs to ``<run>/journal.jsonl`` (format in ``parsing/journal.py``).

Written at every probe, appended and flushed, so that a kept run folder (and
the bundle, which copies it) lets ``ncclwatch analyze`` replay what the live
classifier saw.  Bounded: a probe writes each current worker, its few /proc
samples, one stack per rank and one GPU sample (tens of KB for 8 ranks);
probes come every 5 s while a stall is held; past ``MAX_BYTES`` (a pause held
for hours, many incidents) the journal starts over, keeping only the newest
probes.  A write that fails is logged once and the journal is then off: it
must never stop the watch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from ncclwatch.watchdog.events import Event, GpuSnapshot, Stall, WorkerGone, XidError
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.parsing.journal import HEADER, journal_line

log = logging.getLogger("ncclwatch")

MAX_BYTES = 64 << 20


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._broken = False

    def record(self, state: JobState, stall: Stall) -> None:
        """The state's live inputs as they stand at this probe."""
        self._write([*live_inputs(state), stall])

    def _write(self, events: Iterable[Event]) -> None:
        if self._broken:
            return
        try:
            if self.path.exists() and self.path.stat().st_size > MAX_BYTES:
                self.path.unlink()  # the replay needs the latest probe, not the first hours of a held pause
            fresh = not self.path.exists()
            with self.path.open("a", encoding="utf-8") as out:
                if fresh:
                    out.write(HEADER.decode() + "\n")
                out.writelines(journal_line(e) + "\n" for e in events)
        except OSError as exc:
            self._broken = True
            log.warning("journal %s not written (%s): offline analysis will see less", self.path, exc)


def live_inputs(state: JobState) -> list[Event]:
    """The live-only inputs of the current attempt, as events: workers, /proc samples, stacks, the GPU sample, and
    the GPU driver's Xids this node's kernel log showed (``sources/kmsg.py``: nothing offline reads them again)."""
    events: list[Event] = []
    for worker in state.current_workers():
        if worker.seen is not None:  # always, for a current worker (it has a rank): the event as the source made it
            events.append(worker.seen)
        if worker.gone_at is not None:
            events.append(WorkerGone(pid=worker.pid, rank=worker.rank, at=worker.gone_at))  # type: ignore[arg-type]
        events.extend(worker.samples)
        if worker.pid in state.stacks:
            events.append(state.stacks[worker.pid])
    events.extend(g for g in state.gpus[-1:] if isinstance(g, GpuSnapshot))
    events.extend(e for e in state.partial if isinstance(e, XidError))
    return events
