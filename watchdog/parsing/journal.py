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
    XidError,
)

HEADER = b'{"ncclwatch_journal": 1}'
# FrDump and SequenceTail travel between nodes' sidecars; on disk the dumps and NCCL logs are files of their own.
JOURNALED: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (WorkerSeen, WorkerGone, ProcessState, StackDump, GpuSnapshot, XidError, Stall, FrDump, SequenceTail)
}


def journal_line(event: Event, defaults: bool = True) -> str:
    """``defaults=False``: without the fields at their defaults (nulls, empty lists), which read back the same."""
    kind = type(event).__name__
    if kind not in JOURNALED:
        raise TypeError(f"{kind} is not journaled")
    fields = event.model_dump(mode="json", exclude_defaults=not defaults)
    return json.dumps({"event": kind, **fields}, separators=(",", ":"))


def looks_like_journal(head: bytes) -> bool:
    return head.startswith(HEADER)


# ``journal_line`` writes the kind first: ``{"event":"<kind>",<fields>}``.  Such a line is validated as JSON by
# pydantic with the kind cut out (``{<fields>}``), a third of the time of ``json.loads`` then ``model_validate``
# (the leader parses 8,000 nodes' compact evidence at a hang); any other spelling takes the general path.
_KIND_PREFIX = b'{"event":"'


def parse_journal(data: bytes, name: str) -> list[Event]:
    events: list[Event] = []
    for number, line in enumerate(data.splitlines(), 1):
        if number == 1 or not line.strip():
            continue
        try:
            events.append(_fast(line) or _general(line))
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            events.append(
                Unusable(
                    reason=f"journal line not understood ({type(exc).__name__})", cite=Citation(file=name, line=number)
                )
            )
    return events


def _fast(line: bytes) -> Event | None:
    """The event of a line as ``journal_line`` writes it; None for any other line, or one JSON mode refuses (the
    general path then reads it, or says why not)."""
    if not line.startswith(_KIND_PREFIX):
        return None
    end = line.find(b'",', len(_KIND_PREFIX))
    model = JOURNALED.get(line[len(_KIND_PREFIX) : end].decode(errors="replace")) if end > 0 else None
    if model is None:
        return None
    try:
        return model.model_validate_json(b"{" + line[end + 2 :])
    except ValidationError:
        return None


def _general(line: bytes) -> Event:
    doc = json.loads(line)
    return JOURNALED[doc.pop("event")].model_validate(doc)
