"""Run the engine on literal NCCL lines: parse -> state -> snapshot -> decide."""

from __future__ import annotations

from conftest import NOW

from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.snapshot import Snapshot, take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser


def state_of(logs: dict[str, str], window: int = 2048, extra: list[Event] = ()) -> JobState:
    state = JobState(window=window)
    for name, text in logs.items():
        for event in NcclLogParser(name).feed(text.encode(), final=True):
            state.apply(event)
    for event in extra:
        state.apply(event)
    state.finish()
    return state


def snapshot_of(logs: dict[str, str], **kw) -> Snapshot:
    return take_snapshot(state_of(logs, **kw), observed_at=NOW)


def verdict_of(logs: dict[str, str], **kw) -> Finding:
    return job_finding(snapshot_of(logs, **kw))
