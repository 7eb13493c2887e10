"""``ncclwatch analyze``: files a hung job left behind -> one report.

The same engine the live sidecar runs: parse (``parsing``) -> fold
(``state.JobState``) -> freeze (``snapshot``) -> judge (``classify``); and,
from the Flight Recorder dumps and the NCCL logs given, the performance
findings the live look makes (``slowness.engine.perf_health``: stragglers,
slow collectives and links, odd transports).  A
kept run folder or a bundle holds the sidecar's journal (``journal.jsonl``),
so the live-only inputs (process state, stacks, GPU samples, the stall's
clock) reach the classifier here too.  The
extra steps offline: resolving cited operations to ``file:line``, which the
state does not keep (``evidence.citations``), and NCCL's transport choices,
whose lines the same pass keeps (``inputs.TextIngest``).

Bundles (``*.tar.gz``), named or found in a folder, are unpacked and read as
the folders they hold (``bundles_in``).

Failure modes: unreadable paths, bundles cut short, unknown files and broken
dumps become lines in the report's ``inputs`` and ``notes``; nothing here
raises on bad input.  The command line says the inputs that could not be read
on stderr, and gives no report when nothing could be used (``launcher/cli.py``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from ncclwatch.watchdog.bundles_in import is_bundle, unpack_bundle
from ncclwatch.watchdog.events import FrDump, ProcKey, RankTransport
from ncclwatch.watchdog.evidence.citations import resolve_citations
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import InputFile, PerfNote, Report, build_report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW, JobState
from ncclwatch.watchdog.inputs import cleanup_stdin, ingest_file, iter_files, rescan_orphans
from ncclwatch.watchdog.parsing.transport import TransportScanner
from ncclwatch.watchdog.provenance import Identity, choose, group_runs, identify
from ncclwatch.watchdog.slowness.bandwidth import match_collectives
from ncclwatch.watchdog.slowness.engine import perf_health


def analyze_paths(paths: Iterable[str], window: int = DEFAULT_WINDOW, now: float | None = None) -> Report:
    """The verdict on ``paths``; raises ``provenance.MixedJobs`` when they hold files of two different jobs."""
    return analyze_with_dumps(paths, window, now)[0]


def analyze_with_dumps(
    paths: Iterable[str], window: int = DEFAULT_WINDOW, now: float | None = None
) -> tuple[Report, list[FrDump]]:
    """``analyze_paths``, with the Flight Recorder dumps it judged (``--entries`` prints them: ``fr_entries``)."""
    state = JobState(window=window)
    inputs = []
    stdin_spool: dict[str, str] = {}  # "-" is spooled once so that it can be rescanned
    with tempfile.TemporaryDirectory(prefix="ncclwatch-analyze-") as unpacked:
        bundles: dict[str, str] = {}  # an unpacked bundle's folder -> the bundle
        try:
            listed = list(files_and_bundles(paths, Path(unpacked), bundles))
            set_aside, note = _one_run(listed, bundles, stdin_spool)
            scanner = TransportScanner()  # NCCL's transport choices, from the same pass (``inputs.TextIngest``)
            for index, (name, problem) in enumerate(listed):
                if index in set_aside:
                    inputs.append(InputFile(path=name, kinds=[], note=set_aside[index]))
                elif problem:
                    inputs.append(InputFile(path=name, kinds=[], note=problem))
                else:
                    inputs.append(ingest_file(state, name, stdin_spool, scanner))
            rescan_orphans(state, inputs, stdin_spool)
        finally:
            cleanup_stdin(stdin_spool)
        state.finish()
        if note:
            state.notes.append(note)
        snapshot = take_snapshot(state, observed_at=time.time() if now is None else now)
        finding = classify(snapshot).finding
        report = build_report(finding, snapshot, inputs, resolve_citations(finding))
        performance = performance_notes(state.fr_dumps.values(), scanner.facts(), state.global_ranks())
        report = report.model_copy(update={"performance": performance})
        return _inside_bundles(report, bundles), list(state.fr_dumps.values())


def _one_run(
    listed: list[tuple[str, str | None]], bundles: Mapping[str, str], stdin_spool: dict[str, str]
) -> tuple[dict[int, str], str | None]:
    """The inputs set aside (of another run of the job: input index -> why), and the report's note of it."""
    names = [name for name, _ in listed]
    identities = [identify(name, stdin_spool) if not problem else Identity() for name, problem in listed]
    # A folder holding a sidecar's journal is a kept run folder: one run of one node, like a bundle.
    run_folders = {str(Path(name).parent) for name, who in zip(names, identities) if who.journal}
    containers = [_container(name, bundles, run_folders) for name in names]
    loose = [i for i, (_, problem) in enumerate(listed) if not problem and not containers[i] and identities[i].bare]
    if len(loose) > 1 or len(run_folders) > 1:  # a loose Flight Recorder dump names no process: its times do
        for index in loose:
            identities[index] = identify(names[index], stdin_spool, dumps=True)
    runs = group_runs(identities, [_shown_name(c, bundles) if c else None for c in containers], names)
    choice = choose(runs, identities)
    return choice.set_aside, choice.note


def _container(name: str, bundles: Mapping[str, str], run_folders: set[str]) -> str | None:
    parents = [str(p) for p in Path(name).parents]
    return next((f for f in parents if f in bundles), None) or next((f for f in parents if f in run_folders), None)


def _shown_name(path: str, bundles: Mapping[str, str]) -> str:
    """An unpacked bundle's file as ``<bundle name>/<path inside>``: what ``tar xzf`` of the bundle gives."""
    for folder in bundles:
        if path == folder:
            return bundles[folder]
        if path.startswith(folder + "/"):
            return path.removeprefix(folder + "/")
    return path


def _inside_bundles(report: Report, bundles: Mapping[str, str]) -> Report:
    """Every path of an unpacked bundle in the report (inputs, citations, notes) as the bundle names it.

    The whole report is rewritten, not chosen fields: a note, an unusable dump's reason or a fact may name an
    input, and the temporary folder is gone when ``analyze`` ends.
    """
    if not bundles:
        return report
    text = report.model_dump_json()
    for folder in sorted(bundles, key=len, reverse=True):
        text = text.replace(json.dumps(folder + "/")[1:-1], "")
    return Report.model_validate_json(text)


def files_and_bundles(
    paths: Iterable[str], into: Path, bundles: dict[str, str] | None = None
) -> Iterator[tuple[str, str | None]]:
    """``inputs.iter_files``, with every bundle among them, named or found in a folder, replaced by its files.

    A bundle's notes (members refused, the bundle cut short) come as (bundle, note).  A bundle inside a bundle
    is not unpacked: ours never hold one.  ``bundles``: filled with each unpacked folder -> its bundle.
    """
    count = 0
    for name, problem in iter_files(paths):
        if problem is not None or not is_bundle(name) or Path(name).is_relative_to(into):
            yield name, problem
            continue
        count += 1
        unpacked = unpack_bundle(name, into / f"{count}-{Path(name).name.removesuffix('.tar.gz').removesuffix('.tgz')}")
        yield from ((name, note) for note in unpacked.notes)
        if unpacked.folder is not None:
            if bundles is not None:
                bundles[str(unpacked.folder)] = name
            yield from iter_files([str(unpacked.folder)])
        elif unpacked.plain:
            yield name, None


def performance_notes(
    dumps: Iterable[FrDump], transport: Sequence[RankTransport] = (), global_ranks: Mapping[ProcKey, int] = {}
) -> list[PerfNote]:
    """What the live performance look would say of these dumps and NCCL's transport choices: stragglers, slow
    collectives and links, a node on another transport than its peers (``global_ranks``: NCCL's process -> rank).

    Judged as of the newest entry, so the collective a hang left pending (its dumps end there) is
    never "running slowly" for the hours between the dump and this run.
    """
    timings = match_collectives(dumps)
    newest_ns = max((ns for t in timings for ns in t.arrivals.values()), default=0)
    health = perf_health(timings, now=newest_ns / 1e9, transport=transport, global_ranks=global_ranks)
    return [PerfNote.model_validate(finding.to_dict()) for finding in health.perf_findings]
