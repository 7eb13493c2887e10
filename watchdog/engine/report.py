"""The report: the stable JSON contract of a verdict, and its one-screen text form."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field

from ncclwatch.watchdog import __version__
from ncclwatch.watchdog.engine.detectors import Finding, Verdict
from ncclwatch.watchdog.engine.snapshot import Snapshot
from ncclwatch.watchdog.engine.stacks import main_thread
from ncclwatch.watchdog.engine.verdict import gpu_signature

EXIT_NO_HANG = 0
EXIT_HANG = 1
EXIT_INCONCLUSIVE = 2
EXIT_KILLED_ON_HANG = 3  # the live wrapper ended the job after a hang (--on-hang kill)


class EvidenceItem(BaseModel):
    source: str
    fact: str
    cite: str | None = None  # "file:line" or "file entries[n]"
    text: str | None = None  # the cited line, when there is one


class RankRow(BaseModel):
    rank: int
    host: str | None = None
    pid: int | None = None
    issued: int | None = None  # collectives issued on the verdict's communicator
    last_op: str | None = None
    status: str = ""
    detail: str = ""
    stack: str | None = None  # innermost frame of the main thread (py-spy)
    gpu: str | None = None  # GPU signature (NVML)
    state: str | None = None  # /proc state letter (live only)
    step: int | None = None  # last step the heartbeat reported (live only)
    last_progress_at: str | None = None  # live only


class TimelineRow(BaseModel):
    """One rank's last operations on the verdict's communicator (for the timeline picture)."""

    rank: int
    first_position: int  # 1-based sequence number of ops[0]
    ops: list[str]
    states: list[str | None] = Field(default_factory=list)  # Flight Recorder's, when known


class EvidenceFile(BaseModel):
    name: str
    paths: list[str] = Field(default_factory=list)  # inside the bundle
    rank: int | None = None
    error: str | None = None
    note: str | None = None
    duration_s: float | None = None


class InputFile(BaseModel):
    path: str
    kinds: list[str]
    note: str | None = None


class Report(BaseModel):
    tool: str = "ncclwatch"
    version: str = __version__
    verdict: Verdict
    culprit_ranks: list[int]
    communicator: str | None = None
    position: int | None = Field(None, description="1-based sequence number of the operation in its communicator")
    operation: str | None = None
    summary: str
    reason: str = ""
    ranks: list[RankRow] = Field(default_factory=list)
    timeline: list[TimelineRow] = Field(default_factory=list)
    evidence: list[EvidenceItem] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    inputs: list[InputFile] = Field(default_factory=list)
    nccl_versions: list[str] = Field(default_factory=list)
    analyzed_at: str
    # The live watchdog's fields; None from ``ncclwatch analyze``.
    job: str | None = None
    host: str | None = None
    hang_started_at: str | None = Field(None, description="last moment any rank made progress (ISO 8601, UTC)")
    detected_at: str | None = None
    stall_timeout_s: float | None = None
    evidence_files: list[EvidenceFile] = Field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.verdict == Verdict.no_hang:
            return EXIT_NO_HANG
        if self.verdict == Verdict.inconclusive:
            return EXIT_INCONCLUSIVE
        return EXIT_HANG


def main_frame(snapshot: Snapshot, pid: int | None) -> str | None:
    dump = snapshot.stacks.get(pid) if pid is not None else None
    thread = main_thread(dump) if dump is not None else None
    return thread.frames[0] if thread is not None and thread.frames else None


def gpu_of(snapshot: Snapshot, pid: int | None) -> str | None:
    if pid is None:
        return None
    for snap in reversed(snapshot.gpus):
        for gpu in snap.gpus:
            if any(p.pid == pid for p in gpu.processes):
                sm = gpu.gpm.sm_util_pct if gpu.gpm else None
                dram = gpu.gpm.dram_bw_util_pct if gpu.gpm else None
                return f"GPU {gpu.index}: {gpu_signature(gpu.util_gpu_pct, sm, dram)} (util {gpu.util_gpu_pct:g}%" + (
                    f", SM {sm:g}%)" if sm is not None else ")"
                )
    return None


def _rows(finding: Finding, snapshot: Snapshot) -> list[RankRow]:
    rows = {r.rank: RankRow(**r.__dict__) for r in finding.rows}
    for proc, rank in snapshot.global_ranks.items():
        rows.setdefault(rank, RankRow(rank=rank, host=proc.host, pid=proc.pid))
    for row in rows.values():
        pid = row.pid if row.pid is not None else snapshot.pid_of(row.rank)
        row.pid = pid
        row.stack = main_frame(snapshot, pid)
        row.gpu = gpu_of(snapshot, pid)
    return [rows[k] for k in sorted(rows)]


TIMELINE_OPS = 8


def _timeline(finding: Finding, snapshot: Snapshot) -> list[TimelineRow]:
    comm = next((c for c in snapshot.comms if c.key == finding.comm_key), None)
    if comm is None:
        return []
    rows = []
    for rank in comm.ranks:
        start = max(rank.base, rank.total - TIMELINE_OPS)
        positions = range(start, rank.total)
        rows.append(
            TimelineRow(
                rank=rank.rank,
                first_position=start + 1,
                ops=[sig.describe() for p in positions if (sig := rank.at(p)) is not None],
                states=[(state.value if (state := rank.state_at(p)) else None) for p in positions],
            )
        )
    return sorted(rows, key=lambda r: r.rank)


def build_report(finding: Finding, snapshot: Snapshot, inputs: list[InputFile], cited: dict[int, tuple[str, str | None]]) -> Report:
    """``cited`` maps an evidence index to its resolved "file:line" and line text."""
    evidence = []
    for index, item in enumerate(finding.evidence):
        cite, text = cited.get(index, (str(item.cite) if item.cite else None, item.cite.text if item.cite else None))
        evidence.append(EvidenceItem(source=item.source, fact=item.fact, cite=cite, text=text))
    return Report(
        verdict=finding.verdict,
        culprit_ranks=list(finding.culprits),
        communicator=finding.comm_label,
        position=finding.position,
        operation=finding.operation,
        summary=finding.summary,
        reason=finding.reason,
        ranks=_rows(finding, snapshot),
        timeline=_timeline(finding, snapshot),
        evidence=evidence,
        missing=list(finding.missing),
        notes=list(snapshot.notes),
        inputs=inputs,
        nccl_versions=sorted(set(snapshot.nccl_versions.values())),
        analyzed_at=dt.datetime.fromtimestamp(snapshot.observed_at, dt.UTC).isoformat(timespec="seconds"),
    )


def iso(timestamp: float | None) -> str | None:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="milliseconds") if timestamp is not None else None


def render_text(report: Report, max_evidence: int = 12) -> str:
    """A short human verdict: culprit, reason, operation, a per-rank table."""
    title = report.verdict.value.replace("_", " ").upper()
    if report.culprit_ranks:
        title += f" — culprit rank {', '.join(map(str, report.culprit_ranks))}"
    lines = [f"ncclwatch: {title}", f"  {report.summary}"]
    if report.reason:
        lines.append(f"  why: {report.reason}")
    if report.operation:
        where = f"collective #{report.position}, " if report.position else ""
        lines.append(f"  operation: {report.operation} ({where}{report.communicator})")
    if report.ranks:
        lines.append("")
        lines.extend(_table(report.ranks))
    if report.evidence:
        lines.append("")
        lines.append("evidence:")
        for item in report.evidence[:max_evidence]:
            lines.append(f"  - [{item.source}] {item.fact}" + (f"\n      {item.cite}" if item.cite else ""))
        if len(report.evidence) > max_evidence:
            lines.append(f"  ... {len(report.evidence) - max_evidence} more (--json shows all)")
    for title, items in (("could not see", report.missing), ("notes", report.notes)):
        if items:
            lines.append("")
            lines.append(f"{title}:")
            lines.extend(f"  - {item}" for item in items[:10])
    return "\n".join(lines)


def _table(rows: list[RankRow]) -> list[str]:
    header = ("rank", "host", "pid", "state", "step", "issued", "status", "detail", "stack", "gpu")
    dash = lambda value: "-" if value is None or value == "" else str(value)
    cells = [
        tuple(map(dash, (r.rank, r.host, r.pid, r.state, r.step, r.issued, r.status, r.detail, r.stack, r.gpu)))
        for r in rows
    ]
    keep = [i for i in range(len(header)) if i < 3 or any(c[i] != "-" for c in cells)]
    widths = {i: min(48, max(len(header[i]), *(len(c[i]) for c in cells))) for i in keep}
    fmt = lambda row: "  " + "  ".join(row[i][: widths[i]].ljust(widths[i]) for i in keep).rstrip()
    return [fmt(header)] + [fmt(c) for c in cells]
