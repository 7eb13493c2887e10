"""``ncclwatch analyze``: files a hung job left behind -> one report.

The same engine the live sidecar runs: parse (``parsing``) -> fold
(``state.JobState``) -> freeze (``snapshot``) -> judge (``classify``); and,
from the Flight Recorder dumps given, the performance findings the live
look makes (``slowness.engine``).  A
kept run folder or a bundle holds the sidecar's journal (``journal.jsonl``),
so the live-only inputs (process state, stacks, GPU samples, the stall's
clock) reach the classifier here too.  The
only extra step offline is resolving cited operations to ``file:line``,
which the state does not keep (it would cost memory per line).

Failure modes: unreadable paths, unknown files and broken dumps become lines
in the report's ``inputs`` and ``notes``; nothing here raises on bad input.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ncclwatch.watchdog.bundles_in import expand_bundles
from ncclwatch.watchdog.hang.classify import judge
from ncclwatch.watchdog.hang.types import Finding, OpRef
from ncclwatch.watchdog.slowness.bandwidth import match_collectives
from ncclwatch.watchdog.slowness.engine import collective_health
from ncclwatch.watchdog.hang.report import InputFile, PerfNote, Report, build_report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW, JobState
from ncclwatch.watchdog.events import P2P_OPS, FrDump, OpSig, ProcKey
from ncclwatch.watchdog.inputs import CHUNK_BYTES, cleanup_stdin, ingest_file, iter_files, rescan_orphans
from ncclwatch.watchdog.parsing.nccl_log import iter_op_lines


def resolve_citations(finding: Finding) -> dict[int, tuple[str, str | None]]:
    """Turn each evidence ``OpRef`` into "file:line" by rescanning only the cited files."""
    wanted: dict[str, list[tuple[int, OpRef]]] = {}
    for index, item in enumerate(finding.evidence):
        if item.op_ref is not None:
            wanted.setdefault(item.op_ref.file, []).append((index, item.op_ref))
    resolved: dict[int, tuple[str, str | None]] = {}
    for file, refs in wanted.items():
        counters: dict[tuple, int] = {}
        targets = {(r.proc, r.comm_ptr, r.kind, r.peer, r.ordinal): i for i, r in refs}
        for line, text, proc, comm_ptr, sig in _op_lines(file):
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


def _op_lines(file: str) -> Iterator[tuple[int, str, ProcKey, str, OpSig]]:
    """Operation lines of a file, chunk by chunk: a cited 1 GB log is never read whole."""
    try:
        with open(file, "rb") as handle:
            carry, lines = b"", 0
            while chunk := handle.read(CHUNK_BYTES):
                body = carry + chunk
                cut = body.rfind(b"\n") + 1
                for line, text, proc, comm_ptr, sig in iter_op_lines(body[:cut]):
                    yield lines + line, text, proc, comm_ptr, sig
                lines += body.count(b"\n", 0, cut)
                carry = body[cut:]
            for line, text, proc, comm_ptr, sig in iter_op_lines(carry):
                yield lines + line, text, proc, comm_ptr, sig
    except OSError:
        return


def analyze_paths(paths: Iterable[str], window: int = DEFAULT_WINDOW, now: float | None = None) -> Report:
    state = JobState(window=window)
    inputs = []
    stdin_spool: dict[str, str] = {}  # "-" is spooled once so that it can be rescanned
    with tempfile.TemporaryDirectory(prefix="ncclwatch-analyze-") as unpacked:
        paths, bundle_notes = expand_bundles(paths, Path(unpacked))
        inputs += [InputFile(path=tarball, kinds=[], note=note) for tarball, note in bundle_notes]
        try:
            for name, problem in iter_files(paths):
                inputs.append(InputFile(path=name, kinds=[], note=problem) if problem else ingest_file(state, name, stdin_spool))
            rescan_orphans(state, inputs, stdin_spool)
        finally:
            cleanup_stdin(stdin_spool)
        state.finish()
        snapshot = take_snapshot(state, observed_at=time.time() if now is None else now)
        finding = judge(snapshot).finding
        report = build_report(finding, snapshot, inputs, resolve_citations(finding))
        return report.model_copy(update={"performance": performance_notes(state.fr_dumps.values())})


def performance_notes(dumps: Iterable[FrDump]) -> list[PerfNote]:
    """What the live performance look would say of these dumps: stragglers, slow collectives and links.

    Judged as of the newest entry, so the collective a hang left pending (its dumps end there) is
    never "running slowly" for the hours between the dump and this run.
    """
    timings = match_collectives(dumps)
    arrivals = [ns for t in timings for ns in t.arrivals.values()]
    if not arrivals:
        return []
    health = collective_health(timings, {}, now=max(arrivals) / 1e9, hosts={}, links={})
    return [PerfNote.model_validate(finding.to_dict()) for finding in health.perf_findings]
