"""What a live verdict becomes: a report, a one-screen verdict, and the root-cause bundle.

Order matters at 3 AM: the verdict goes to the terminal the moment it is
decided; evidence is collected after (stale-fastest first, bounded by
``evidence_budget``), citations are resolved to ``file:line``, and the bundle
``<bundle-dir>/<job>-<host>-<UTC time>-<verdict>.tar.gz`` appears atomically (written
under a dot-name, then renamed), holding ``report.json``, ``report.md`` and
the evidence files.  A failure to collect one piece of evidence is a line in
the report, never a missing bundle.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import logging
import os
import re
import shutil
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.evidence import EvidenceContext, RankTarget, collect_all
from ncclwatch.watchdog.evidence.citations import resolve_citations
from ncclwatch.watchdog.hang.report import (
    TERMINAL_COLUMNS,
    EvidenceFile,
    EvidenceItem,
    PerfNote,
    RankRow,
    Report,
    build_report,
    gpu_of,
    headline,
    iso,
    main_frame,
    render_text,
)
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.live.bundle_retention import MIB, prune_bundles
from ncclwatch.watchdog.live.job import LiveView
from ncclwatch.watchdog.live.runfolder import JOURNAL_NAME, PREFLIGHT_NAME
from ncclwatch.watchdog.slowness.findings import PerfFinding

log = logging.getLogger("ncclwatch")


def live_report(
    finding: Finding,
    snapshot: Snapshot,
    view: LiveView,
    *,
    job: str,
    host: str,
    started_at: float,
    held: str | None = None,
    performance: Sequence[PerfFinding] = (),
) -> Report:
    report = build_report(finding, snapshot, inputs=[], cited={})
    rows = {row.rank: row for row in report.ranks}
    for worker in snapshot.workers:  # every node's, when the verdict is job-wide
        row = rows.setdefault(worker.rank, RankRow(rank=worker.rank))
        row.pid, row.host = worker.pid, worker.host or row.host
        row.state = (
            worker.state + (" (exited)" if worker.gone else "") if worker.state else ("exited" if worker.gone else None)
        )
        row.step = worker.step
        row.last_progress_at = iso(view.progress_at.get(worker.pid))
        row.stack = main_frame(snapshot, worker.pid)
        row.gpu = gpu_of(snapshot, worker.pid)
    notes = list(report.notes) + list(view.down)
    if held:
        notes.append(held)
    live = report.model_copy(
        update={
            "ranks": [rows[r] for r in sorted(rows)],
            "job": job,
            "host": host,
            "hang_started_at": iso(started_at),
            "detected_at": iso(view.observed_at),
            "stall_timeout_s": round(view.stall_timeout, 2),
            "notes": notes,
            "performance": perf_notes(performance),
        }
    )
    return live.model_copy(update={"headline": headline(live)})  # from the live rows: host, pid, stack


def perf_notes(findings: Sequence[PerfFinding]) -> list[PerfNote]:
    return [PerfNote.model_validate(f.to_dict()) for f in findings]


def terminal_text(report: Report, bundle: Path | None = None) -> str:
    """The screen a live verdict prints: the headline first, then the verdict, at most 100 columns."""
    started = dt.datetime.fromisoformat(report.hang_started_at) if report.hang_started_at else None
    detected = dt.datetime.fromisoformat(report.detected_at) if report.detected_at else None
    wrap = lambda text: textwrap.wrap(
        text, TERMINAL_COLUMNS, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    lines = [*wrap(report.headline or headline(report)), "=" * 78, render_text(report, max_evidence=6), ""]
    if started and detected:
        lines += wrap(
            f"  nothing moved since {started:%H:%M:%S} UTC; "
            f"detected {(detected - started).total_seconds():.1f} s later "
            f"(stall timeout {report.stall_timeout_s:g} s)"
        )
    lines.append(f"  bundle: {bundle}" if bundle else "  collecting evidence for the bundle ...")
    lines.append("=" * 78)
    return "\n".join(lines)


def bundle_name(job: str, host: str, detected_at: float, verdict: str) -> str:
    """``<job>-<host>-<UTC time>-<verdict>``: the host keeps two nodes' bundles apart on shared storage."""
    stamp = dt.datetime.fromtimestamp(detected_at, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = lambda text: re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"
    return f"{safe(job)}-{safe(host)}-{stamp}-{verdict}"


def report_markdown(report: Report) -> str:
    out = [f"# ncclwatch: {report.verdict.value}", "", f"**{report.summary}**", ""]
    if report.reason:
        out += [report.reason, ""]
    facts = [
        ("job", report.job),
        ("host", report.host),
        ("culprit ranks", ", ".join(map(str, report.culprit_ranks)) or "none named"),
        (
            "operation",
            f"{report.operation} (#{report.position} on {report.communicator})" if report.operation else None,
        ),
        ("hang started", report.hang_started_at),
        ("detected", report.detected_at),
        ("stall timeout", f"{report.stall_timeout_s:g} s" if report.stall_timeout_s else None),
    ]
    out += [f"- {k}: {v}" for k, v in facts if v] + [""]
    if report.response or report.actions:
        out += ["## What was done", ""] + ([f"{report.response}", ""] if report.response else [])
        out += [f"- {a.at} {a.kind}: {a.detail}" + ("" if a.ok else " (failed)") for a in report.actions] + [""]
    if report.ranks:
        out += [
            "## Ranks",
            "",
            "| rank | host | pid | state | step | issued | status | stack | gpu |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report.ranks:
            cells = (r.rank, r.host, r.pid, r.state, r.step, r.issued, r.status, r.stack, r.gpu)
            out.append("| " + " | ".join("" if c is None else str(c).replace("|", "\\|") for c in cells) + " |")
        out.append("")
    if report.evidence:
        out += ["## Evidence", ""]
        for item in report.evidence:
            out.append(f"- [{item.source}] {item.fact}" + (f" — `{item.cite}`" if item.cite else ""))
            if item.text:
                out.append(f"  `{item.text[:300]}`")
        out.append("")
    if report.evidence_files:
        out += ["## Files in this bundle", ""]
        for ev in report.evidence_files:
            status = f"error: {ev.error}" if ev.error else ", ".join(ev.paths) or "-"
            rank = f" (rank {ev.rank})" if ev.rank is not None else ""
            out.append(f"- {ev.name}{rank}: {status}" + (f" ({ev.note})" if ev.note else ""))
        out.append("")
    for title, items in (("Could not see", report.missing), ("Notes", report.notes)):
        if items:
            out += [f"## {title}", ""] + [f"- {i}" for i in items] + [""]
    if report.performance:
        out += ["## Performance (slow, not hung)", ""]
        out += [
            f"- [{p.kind}] {p.summary}" + (f" (links: {', '.join(p.links)})" if p.links else "") + f" — {p.detail}"
            for p in report.performance
        ] + [""]
    return "\n".join(out)


async def write_bundle(
    report: Report, finding: Finding, staging: Path, bundle_dir: Path, collect
) -> tuple[Path, Report]:  # type: ignore[no-untyped-def]
    """Collect evidence into ``staging`` (``collect(staging)`` -> records), write the reports, pack, rename.

    Returns the bundle and the final report (citations resolved, evidence files listed).
    """
    records = await collect(staging)
    cited = await asyncio.to_thread(resolve_citations, finding)
    evidence = [
        item.model_copy(update={"cite": cited[i][0], "text": cited[i][1]}) if i in cited else item
        for i, item in enumerate(report.evidence)
    ]
    copies = {source: (rel, start) for r in records for rel, (source, start) in r.copied.items()}
    evidence = await asyncio.to_thread(_inside_bundle, evidence, copies)
    report = report.model_copy(
        update={
            "evidence": evidence,
            "evidence_files": [EvidenceFile.model_validate(r, from_attributes=True) for r in records],
        }
    )
    for name, text in report_files(report).items():
        (staging / name).write_text(text)
    bundle_dir.mkdir(parents=True, exist_ok=True)
    final = bundle_dir / f"{staging.name.lstrip('.')}.tar.gz"
    partial = bundle_dir / f".{final.name}.partial"
    await asyncio.to_thread(_pack, staging, partial, final.name.removesuffix(".tar.gz"))
    os.replace(partial, final)
    shutil.rmtree(staging, ignore_errors=True)
    return final, report


def _inside_bundle(evidence: list[EvidenceItem], copies: dict[str, tuple[str, int]]) -> list[EvidenceItem]:
    """Each citation of a file the bundle holds a copy of, by the bundle's own path (``nccl/vm.543:1472``,
    ``fr/nccl_trace_rank_1 entries[412]``): the sidecar's files are gone with its run folder.

    A log's copy is its tail: a cited line's number counts from the copy's first line, or, where the line is
    older than the tail, the citation says so with its number in the whole file.
    """
    lines_before: dict[str, int | None] = {}  # source -> lines before its copy's start; None: gone since
    out = []
    for item in evidence:
        cite = item.cite or ""
        source = next((s for s in copies if cite == s or cite.startswith((s + ":", s + " "))), None)
        if source is None:
            out.append(item)
            continue
        rel, start = copies[source]
        rest = cite.removeprefix(source)
        line = re.match(r":(\d+)", rest)
        if line is not None and start:
            if source not in lines_before:
                lines_before[source] = _count_lines(source, start)
            before = lines_before[source]
            number = int(line[1]) - before if before is not None else 0
            if number >= 1:
                kept = f":{number}"
            elif before is None:  # the sidecar's file is gone: its line cannot be counted in the tail
                kept = f" (line {line[1]} of the whole file)"
            else:
                kept = f" (line {line[1]} of the whole file, older than the tail kept)"
            rest = kept + rest[line.end() :]
        out.append(item.model_copy(update={"cite": rel + rest}))
    return out


def _count_lines(path: str, end: int, chunk: int = 8 << 20) -> int | None:
    """Newlines in the first ``end`` bytes of ``path`` (a log only grows: they are those before its tail)."""
    count = 0
    try:
        with open(path, "rb") as handle:
            while end > 0 and (data := handle.read(min(chunk, end))):
                count += data.count(b"\n")
                end -= len(data)
    except OSError:
        return None
    return count


def _pack(folder: Path, target: Path, top: str) -> None:
    with tarfile.open(target, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=top)


def report_files(report: Report) -> dict[str, str]:
    """The bundle's report, as its files: name -> text."""
    return {"report.json": report.model_dump_json(indent=2), "report.md": report_markdown(report)}


async def amend_bundle(bundle: Path, report: Report) -> None:
    """Replace the bundle's report.json and report.md with ``report`` (what was done after the capture).

    The bundle is read and written again under a dot-name, then renamed over
    the old one: a reader sees the old bundle or the new one, never half.
    """
    partial = bundle.with_name(f".{bundle.name}.partial")
    await asyncio.to_thread(_repack, bundle, partial, report_files(report))
    os.replace(partial, bundle)


def _repack(source: Path, target: Path, texts: dict[str, str]) -> None:
    with tarfile.open(source, "r:gz") as old, tarfile.open(target, "w:gz", compresslevel=6) as new:
        for member in old:
            name = member.name.split("/", 1)[-1]
            if name in texts:
                data = texts[name].encode()
                member.size = len(data)
                member.mtime = int(time.time())
                new.addfile(member, io.BytesIO(data))
            else:
                new.addfile(member, old.extractfile(member) if member.isfile() else None)


@dataclass(frozen=True)
class BundleWriter:
    """The sidecar's ``Reporter``: say the verdict now, then collect evidence and write the bundle.

    It adds to the sidecar's live report (this run's notes, the latest performance findings) and
    never builds another: the response was planned from that one.
    """

    settings: Settings
    run_dir: Path
    job_name: str
    host: str
    worker_log_dir: Path | None = None  # torchrun's --log-dir, when the user gave one
    dumpless: Callable[[], frozenset[int]] = frozenset  # pids whose Flight Recorder did not answer the probe
    performance: Callable[[], Sequence[PerfFinding]] = (
        tuple  # the latest performance look's findings (live/performance_look.py)
    )
    ras_withheld: Callable[[], str | None] = lambda: None  # why RAS must not be asked (the prober's rule); None: ask
    notes: Sequence[str] = ()  # said in every report of this run (what the bus-bandwidth probe measures, and when)

    def bundle_for(self, report: Report, view: LiveView) -> Path:
        """Where this report's bundle will be written (``write_bundle`` renames the staging folder's pack to it)."""
        name = bundle_name(self.job_name, self.host, view.observed_at, report.verdict.value)
        return self.settings.bundle_dir / f"{name}.tar.gz"

    async def __call__(self, report: Report, decision: Decision, view: LiveView) -> tuple[Report, Path | None]:
        report = report.model_copy(
            update={"notes": [*report.notes, *self.notes], "performance": perf_notes(self.performance())}
        )
        print(terminal_text(report), file=sys.stderr, flush=True)
        settings = self.settings
        staging = settings.bundle_dir / ("." + self.bundle_for(report, view).name.removesuffix(".tar.gz"))
        staging.mkdir(parents=True, exist_ok=True)
        alive = view.alive
        targets = tuple(
            RankTarget(rank=w.rank, pid=w.pid, local_rank=w.local_rank, host=w.host or self.host) for w in alive
        )
        worker_logs = find_worker_logs(self.worker_log_dir, {w.rank: w.local_rank for w in alive})

        async def collect(folder: Path) -> list:  # type: ignore[type-arg]
            context = EvidenceContext(
                out_dir=folder,
                run_dir=self.run_dir,
                ranks=targets,
                pyspy=settings.pyspy,
                ras_port=settings.ras_port,
                worker_logs=worker_logs,
                budget_s=settings.evidence_budget,
                dumpless_pids=self.dumpless(),
                ras_withheld=self.ras_withheld(),
            )
            records = await collect_all(context)
            journal = self.run_dir / JOURNAL_NAME
            if journal.is_file():  # the probe's inputs: `ncclwatch analyze` on the bundle replays the decision
                await asyncio.to_thread(shutil.copyfile, journal, folder / JOURNAL_NAME)
            baseline = self.run_dir / PREFLIGHT_NAME
            if baseline.is_file():  # --preflight's measurement before the job
                (folder / "busbw").mkdir(exist_ok=True)
                await asyncio.to_thread(shutil.copyfile, baseline, folder / "busbw" / "before.json")
            return records

        began = time.monotonic()
        try:
            bundle, report = await write_bundle(report, decision.finding, staging, settings.bundle_dir, collect)
        except Exception as exc:  # the page must go out even when the bundle cannot be written (disk full...)
            log.exception("bundle failed")
            print(
                f"ncclwatch: could not write the bundle ({type(exc).__name__}: {exc}); paging without it",
                file=sys.stderr,
            )
            return report, None
        print(f"ncclwatch: bundle written in {time.monotonic() - began:.1f} s: {bundle}", file=sys.stderr, flush=True)
        max_bytes = settings.bundles_max_mib * MIB
        await asyncio.to_thread(prune_bundles, settings.bundle_dir, settings.bundles_kept, max_bytes, bundle)
        return report, bundle


def find_worker_logs(log_dir: Path | None, local_ranks: dict[int, int | None]) -> dict[int, list[Path]]:
    """torchrun's per-worker logs: ``<log-dir>/<run id>/attempt_<n>/<local rank>/*.log``, latest attempt."""
    if log_dir is None or not log_dir.is_dir():
        return {}
    found: dict[int, list[Path]] = {}
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return {}
    for rank, local_rank in local_ranks.items():
        if local_rank is not None:
            found[rank] = sorted((attempts[-1] / str(local_rank)).glob("*.log"))
    return found
