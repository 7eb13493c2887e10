"""``py-spy dump --json`` output -> one ``StackDump`` per process.

py-spy prints a JSON list of threads, each with its ``pid``; ``--json``
ignores ``--subprocesses`` so one dump is one process.  A dump of a process
that py-spy could not read is usually plain text ("Permission Denied",
"Failed to ..."): that is reported as unusable with py-spy's own words.

With ``--native`` py-spy names a native frame it found no symbol for by its
address (``0x7fdf20644f16``, line 0): such a frame says nothing a reader can
open, and the report's rank table showed ``0x7fdf20644f16 <- main``; it is
left out.  Native frames with a symbol (``c10d::Work::wait``) are kept.
"""

from __future__ import annotations

import json
import re

from ncclwatch.watchdog.events import Citation, Event, StackDump, ThreadStack, Unusable

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # a native frame py-spy found no symbol for


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
            if isinstance(f, dict) and not _ADDRESS.fullmatch(str(f.get("name", "")))
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
