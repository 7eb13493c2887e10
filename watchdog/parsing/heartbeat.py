"""Heartbeat files written by the injected hook -> ``Heartbeat`` events.

``<run>/hb/<pid>.json`` holds one JSON object (launcher/heartbeat.py writes
it with an atomic replace): ``pid, rank, local_rank, restart, step, time,
beats``.  A file caught half-written cannot happen (rename is atomic), but a
file from another tool or version can: anything malformed is ``None``.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from ncclwatch.watchdog.events import Heartbeat


def parse_heartbeat(data: bytes) -> Heartbeat | None:
    try:
        doc = json.loads(data)
        return Heartbeat(
            pid=doc["pid"],
            rank=doc["rank"],
            step=doc["step"],
            time=doc["time"],
            restart=doc.get("restart") or 0,
            beats=doc.get("beats") or 0,
        )
    except (ValueError, KeyError, TypeError, ValidationError):
        return None
