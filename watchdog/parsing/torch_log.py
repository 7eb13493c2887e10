"""PyTorch worker logs and torchrun's console output -> events.

Two things in them name a culprit without any NCCL file: the process-group
watchdog's timeout line (which rank gave up, in which collective, by
sequence number) and torchrun's ``ChildFailedError`` summary (which rank
exited, with what code, and which failure torchrun saw first).  Everything
else in these files is ignored.
"""

from __future__ import annotations

import re

from ncclwatch.watchdog.events import Citation, Event, WatchdogTimeout, WorkerFailure

_TIMEOUT_RE = re.compile(
    r"\[Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: "
    r"Work\w*\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
    r"(?:, NumelIn=(?P<nin>-?\d+))?(?:, NumelOut=(?P<nout>-?\d+))?(?:, Timeout\(ms\)=(?P<tmo>\d+))?\)"
    r"(?: ran for (?P<ran>\d+) milliseconds)?"
)
# One entry of the ChildFailedError table; "Root Cause" entries follow that heading.
_FAILURE_RE = re.compile(
    r"^\s*\[\d+\]:\s*\n"
    r"(?:\s*time\s*:.*\n)?"
    r"\s*host\s*:\s*(?P<host>\S+)\s*\n"
    r"\s*rank\s*:\s*(?P<rank>\d+)(?: \(local_rank: (?P<lrank>\d+)\))?\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?",
    re.MULTILINE,
)
_MARKERS = ("Watchdog caught collective operation timeout", "ChildFailedError")


def looks_like_torch_log(head: bytes) -> bool:
    return any(marker.encode() in head for marker in _MARKERS)


def parse_torch_log(data: bytes, name: str) -> list[Event]:
    """Timeouts and worker failures; lines that do not match are ignored."""
    text = data.decode(errors="replace")
    events: list[Event] = []
    seen_timeouts: set[tuple[int, int]] = set()
    for m in _TIMEOUT_RE.finditer(text):
        key = (int(m["rank"]), int(m["seq"]))
        if key in seen_timeouts:  # PyTorch repeats the line in the exception text
            continue
        seen_timeouts.add(key)
        events.append(
            WatchdogTimeout(
                rank=key[0],
                seq=key[1],
                op=m["op"],
                numel_in=_opt_int(m["nin"]),
                numel_out=_opt_int(m["nout"]),
                timeout_ms=_opt_int(m["tmo"]),
                ran_ms=_opt_int(m["ran"]),
                cite=_cite(name, text, m.start()),
            )
        )
    root_cause_at = text.find("Root Cause (first observed failure)")
    for m in _FAILURE_RE.finditer(text):
        events.append(
            WorkerFailure(
                rank=int(m["rank"]),
                local_rank=_opt_int(m["lrank"]),
                exitcode=int(m["code"]),
                pid=_opt_int(m["pid"]),
                host=m["host"],
                root_cause=root_cause_at != -1 and m.start() > root_cause_at,
                cite=_cite(name, text, m.start()),
            )
        )
    return events


def _opt_int(value: str | None) -> int | None:
    return int(value) if value is not None else None


def _cite(name: str, text: str, offset: int) -> Citation:
    line_no = text.count("\n", 0, offset) + 1
    line_end = text.find("\n", offset)
    excerpt = text[offset : line_end if line_end != -1 else None].strip()
    return Citation(file=name, line=line_no, text=excerpt[:400])
