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

from pydantic import TypeAdapter, ValidationError

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
# The lines of one kind go to pydantic together, as one JSON array: one call a kind instead of one a line (a node's
# compact evidence is 57 lines of 6 kinds; the leader reads 4,095 nodes' at 4,096 nodes): 3-5 % less time a node (64
# nodes' compact evidence, one core; building the models is the rest).
_LISTS: dict[type[Event], TypeAdapter[list[Event]]] = {
    model: TypeAdapter(list[model])  # type: ignore[valid-type]
    for model in JOURNALED.values()
}


def parse_journal(data: bytes, name: str) -> list[Event]:
    lines = data.splitlines()
    events: list[Event | None] = [None] * len(lines)
    kinds: dict[type[Event], tuple[list[int], list[bytes]]] = {}  # model -> its lines' indices, their fields
    for i, line in enumerate(lines):
        if i == 0 or not line.strip():
            continue
        cut = _cut(line)
        if cut is None:
            events[i] = _one(line, i, name)
        else:
            numbers, fields = kinds.setdefault(cut[0], ([], []))
            numbers.append(i)
            fields.append(cut[1])
    for model, (numbers, fields) in kinds.items():
        for i, event in zip(numbers, _together(model, fields) or [_one(lines[i], i, name) for i in numbers]):
            events[i] = event
    return [e for e in events if e is not None]


def _cut(line: bytes) -> tuple[type[Event], bytes] | None:
    """A line as ``journal_line`` writes it: its kind's model and its fields (``<fields>}``); None for any other."""
    if not line.startswith(_KIND_PREFIX):
        return None
    end = line.find(b'",', len(_KIND_PREFIX))
    model = JOURNALED.get(line[len(_KIND_PREFIX) : end].decode(errors="replace")) if end > 0 else None
    return (model, line[end + 2 :]) if model is not None else None


def _together(model: type[Event], fields: list[bytes]) -> list[Event] | None:
    """The events of lines of one kind, validated as one array; None where any line does not validate (each is then
    read alone, and a malformed one costs its own event only).  The count guards against a line that is not one
    object (``1},{"pid":2``): joined, it would read as two."""
    try:
        events = _LISTS[model].validate_json(b"[{" + b",{".join(fields) + b"]")
    except ValidationError:
        return None
    return events if len(events) == len(fields) else None


def _one(line: bytes, i: int, name: str) -> Event:
    """Line ``i`` (from 0) alone: its event, or an ``Unusable`` naming it."""
    try:
        return _fast(line) or _general(line)
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        return Unusable(
            reason=f"journal line not understood ({type(exc).__name__})", cite=Citation(file=name, line=i + 1)
        )


def _fast(line: bytes) -> Event | None:
    """The event of a line as ``journal_line`` writes it; None for any other line, or one JSON mode refuses (the
    general path then reads it, or says why not)."""
    cut = _cut(line)
    if cut is None:
        return None
    try:
        return cut[0].model_validate_json(b"{" + cut[1])
    except ValidationError:
        return None


def _general(line: bytes) -> Event:
    doc = json.loads(line)
    return JOURNALED[doc.pop("event")].model_validate(doc)
