"""The sidecar's journal (``<run>/journal.jsonl``): the probe inputs only a live job shows.

Each line is one event, ``{"event": "<class name>", ...fields}``: the
workers and their /proc samples, py-spy stacks, NVML samples and the stall's
clock at each probe.  ``ncclwatch analyze`` on a kept run folder or a bundle
replays them into the same engine, so it reaches the live verdict.  The
first line is the header ``{"ncclwatch_journal": 1}``; a line that does not
validate becomes an ``Unusable`` event, never an exception.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    GpuSnapshot,
    ProcessState,
    SequenceTail,
    StackDump,
    Stall,
    Unusable,
    WorkerGone,
    WorkerSeen,
)

HEADER = b'{"ncclwatch_journal": 1}'
# FrDump and SequenceTail travel between nodes' sidecars; on disk the dumps and NCCL logs are files of their own.
JOURNALED: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (WorkerSeen, WorkerGone, ProcessState, StackDump, GpuSnapshot, Stall, FrDump, SequenceTail)
}


def journal_line(event: Event) -> str:
    kind = type(event).__name__
    if kind not in JOURNALED:
        raise TypeError(f"{kind} is not journaled")
    return json.dumps({"event": kind, **event.model_dump(mode="json")}, separators=(",", ":"))


def looks_like_journal(head: bytes) -> bool:
    return head.startswith(HEADER)


def parse_journal(data: bytes, name: str) -> list[Event]:
    events: list[Event] = []
    for number, line in enumerate(data.splitlines(), 1):
        if number == 1 or not line.strip():
            continue
        try:
            doc = json.loads(line)
            events.append(JOURNALED[doc.pop("event")].model_validate(doc))
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            events.append(
                Unusable(
                    reason=f"journal line not understood ({type(exc).__name__})", cite=Citation(file=name, line=number)
                )
            )
    return events
