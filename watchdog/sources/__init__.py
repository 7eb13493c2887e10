"""Sources: each reads one kind of raw input and emits typed events; none decides.

A source has a ``name`` and ``async run(emit)``.  Polling sources implement a
synchronous ``poll(emit)`` (tests call it directly, tick by tick) and inherit
the loop.  A source that cannot read what it watches emits ``SourceDown``
once and keeps trying; the supervisor in ``sidecar`` restarts one that
raises, with backoff, so one broken source never stops the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ncclwatch.watchdog.events import Event, SourceDown, SourceUp

Emit = Callable[[Event], None]


class PollingSource:
    name = "source"
    interval = 0.25

    def poll(self, emit: Emit) -> None:
        raise NotImplementedError

    async def run(self, emit: Emit) -> None:
        while True:
            self.poll(emit)
            await asyncio.sleep(self.interval)


class DownOnce:
    """Emit ``SourceDown`` once per distinct reason, not on every poll."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.reason: str | None = None

    def __call__(self, emit: Emit, reason: str | None) -> None:
        if reason is not None and reason != self.reason:
            emit(SourceDown(source=self.source, reason=reason))
        elif reason is None and self.reason is not None:
            emit(SourceUp(source=self.source))
        self.reason = reason
