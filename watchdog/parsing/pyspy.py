"""``py-spy dump --json`` output -> one ``StackDump`` per process.

py-spy prints a JSON list of threads, each with its ``pid``; ``--json``
ignores ``--subprocesses`` so one dump is one process.  A dump of a process
that py-spy could not read is usually plain text ("Permission Denied",
"Failed to ..."): that is reported as unusable with py-spy's own words.
"""

from __future__ import annotations

import json

from ncclwatch.watchdog.events import Citation, Event, StackDump, ThreadStack, Unusable


def looks_like_pyspy(head: bytes) -> bool:
    stripped = head.lstrip()
    return stripped.startswith(b"[") and b'"thread_id"' in head and b'"frames"' in head


def parse_pyspy(data: bytes, name: str) -> list[Event]:
    cite = Citation(file=name)
    try:
        threads = json.loads(data)
    except ValueError as exc:
        return [Unusable(reason=f"py-spy dump is not valid JSON ({exc})", cite=cite)]
    if not isinstance(threads, list) or not threads or not all(isinstance(t, dict) for t in threads):
        return [Unusable(reason="py-spy dump holds no threads", cite=cite)]
    by_pid: dict[int, list[ThreadStack]] = {}
    for thread in threads:
        pid = thread.get("pid")
        if not isinstance(pid, int):
            continue
        frames = [
            f"{f.get('name', '?')} ({f.get('short_filename') or f.get('filename', '?')}:{f.get('line', '?')})"
            for f in thread.get("frames") or []
            if isinstance(f, dict)
        ]
        by_pid.setdefault(pid, []).append(
            ThreadStack(
                name=thread.get("thread_name"),
                os_tid=thread.get("os_thread_id"),
                active=thread.get("active"),
                frames=frames,
            )
        )
    return [StackDump(pid=pid, threads=stacks, cite=cite) for pid, stacks in by_pid.items()]
