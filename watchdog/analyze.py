"""``ncclwatch analyze``: files a hung job left behind -> one report.

The same engine the live sidecar runs: parse (``parsing``) -> fold
(``state.JobState``) -> freeze (``snapshot``) -> judge (``classify``).  A
kept run folder or a bundle holds the sidecar's journal (``journal.jsonl``),
so the live-only inputs (process state, stacks, GPU samples, the stall's
clock) reach the classifier here too.  The
only extra step offline is resolving cited operations to ``file:line``,
which the state does not keep (it would cost memory per line).

Failure modes: unreadable paths, unknown files and broken dumps become lines
in the report's ``inputs`` and ``notes``; nothing here raises on bad input.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from ncclwatch.watchdog.engine.detectors import Finding, OpRef
from ncclwatch.watchdog.parsing import SNIFF_BYTES, NcclLogParser, sniff
from ncclwatch.watchdog.parsing.nccl_log import iter_op_lines
from ncclwatch.watchdog.parsing.torch_log import looks_like_torch_log, parse_torch_log
from ncclwatch.watchdog.engine.report import InputFile, Report, build_report
from ncclwatch.watchdog.engine.snapshot import take_snapshot
from ncclwatch.watchdog.engine.state import DEFAULT_WINDOW, JobState
from ncclwatch.watchdog.events import P2P_OPS
from ncclwatch.watchdog.engine.classify import judge

CHUNK_BYTES = 8 << 20


def iter_files(paths: Iterable[str]) -> Iterator[tuple[str, str | None]]:
    """(path, problem) for every file under ``paths``, folders recursively, in a stable order."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for root, dirs, files in os.walk(path, onerror=None):
                dirs.sort()
                for name in sorted(files):
                    yield str(Path(root) / name), None
        elif path.is_file():
            yield str(path), None
        elif path.exists():
            yield str(path), "not a regular file"
        else:
            yield str(path), "no such file or directory"


def ingest_file(state: JobState, name: str) -> InputFile:
    """Parse one file into ``state``; say what it was and what went wrong."""
    try:
        with open(name, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
            formats = sniff(head)
            if not head:
                return InputFile(path=name, kinds=[], note="empty file")
            if not formats:
                return InputFile(path=name, kinds=[], note="not a recognised format; ignored")
            notes = []
            kinds = [f.name for f in formats]
            for fmt in formats:
                handle.seek(0)
                if fmt.parse is None:
                    notes += _stream_nccl_log(state, handle, name, torch_log_too="torch_log" not in kinds)
                else:
                    for event in fmt.parse(handle.read(), name):
                        state.apply(event)
    except OSError as exc:
        return InputFile(path=name, kinds=[], note=f"cannot read: {exc.strerror or exc}")
    return InputFile(path=name, kinds=[f.name for f in formats], note="; ".join(notes) or None)


def _stream_nccl_log(state: JobState, handle: BinaryIO, name: str, torch_log_too: bool) -> list[str]:
    """Feed an NCCL log in chunks; PyTorch's messages may start past the sniffed head."""
    parser = NcclLogParser(name)
    torch_markers = False
    while chunk := handle.read(CHUNK_BYTES):
        if torch_log_too and not torch_markers:
            torch_markers = looks_like_torch_log(chunk)
        for event in parser.feed(chunk):
            state.apply(event)
    for event in parser.feed(b"", final=True):
        state.apply(event)
    notes = []
    if parser.garbled:
        notes.append(f"{parser.garbled} garbled operation line(s) skipped (interleaved or cut writes)")
    if torch_markers:
        handle.seek(0)
        for event in parse_torch_log(handle.read(), name):
            state.apply(event)
    return notes


def resolve_citations(finding: Finding) -> dict[int, tuple[str, str | None]]:
    """Turn each evidence ``OpRef`` into "file:line" by rescanning only the cited files."""
    wanted: dict[str, list[tuple[int, OpRef]]] = {}
    for index, item in enumerate(finding.evidence):
        if item.op_ref is not None:
            wanted.setdefault(item.op_ref.file, []).append((index, item.op_ref))
    resolved: dict[int, tuple[str, str | None]] = {}
    for file, refs in wanted.items():
        try:
            data = Path(file).read_bytes()
        except OSError:
            continue
        counters: dict[tuple, int] = {}
        targets = {(r.proc, r.comm_ptr, r.kind, r.peer, r.ordinal): i for i, r in refs}
        for line, text, proc, comm_ptr, sig in iter_op_lines(data):
            kind = sig.op if sig.op in P2P_OPS else "coll"
            peer = sig.root if kind != "coll" else None
            key = (proc, comm_ptr, kind, peer)
            ordinal = counters.get(key, 0)
            counters[key] = ordinal + 1
            index = targets.pop((*key, ordinal), None)
            if index is not None:
                resolved[index] = (f"{file}:{line}", text)
                if not targets:
                    break
    return resolved


def analyze_paths(paths: Iterable[str], window: int = DEFAULT_WINDOW, now: float | None = None) -> Report:
    state = JobState(window=window)
    inputs = []
    for name, problem in iter_files(paths):
        inputs.append(InputFile(path=name, kinds=[], note=problem) if problem else ingest_file(state, name))
    state.finish()
    snapshot = take_snapshot(state, observed_at=time.time() if now is None else now)
    finding = judge(snapshot).finding
    return build_report(finding, snapshot, inputs, resolve_citations(finding))
