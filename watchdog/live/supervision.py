"""The sidecar's sources, each run supervised in a task of its own.

A source streams events (``watchdog/sources``: the workers, their NCCL logs and heartbeats, NVML) until the
sidecar stops.  One that raises is restarted with backoff (1 s, doubling, at most MAX_BACKOFF_S) and reported
down (``SourceDown``, in the health and the report) each time: one broken source never stops the others, and
never ends the watch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from ncclwatch.watchdog.events import Event, SourceDown

log = logging.getLogger("ncclwatch")

MAX_BACKOFF_S = 30.0


class Source(Protocol):
    name: str

    async def run(self, emit: Callable[[Event], None]) -> None: ...


async def supervise(source: Source, emit: Callable[[Event], None]) -> None:
    """Run ``source`` until it returns or is cancelled, restarting it whenever it raises."""
    backoff = 1.0
    while True:
        try:
            await source.run(emit)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one broken source must not stop the others
            log.exception("source %s failed", source.name)
            emit(SourceDown(source=source.name, reason=f"{type(exc).__name__}: {exc}"))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
