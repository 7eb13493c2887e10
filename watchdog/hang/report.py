"""The report: the stable JSON contract of a verdict, and its one-screen text form."""

from __future__ import annotations

import datetime as dt
import textwrap
from collections.abc import Sequence

from pydantic import BaseModel, Field

from ncclwatch.watchdog import __version__
from ncclwatch.watchdog.hang.gpu_signatures import gpu_signature
from ncclwatch.watchdog.hang.mesh import Mesh, coords_label, derive_mesh
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.stacks import CALL_ARROW, call_line, main_thread, short_frame, split_frame, user_frame
from ncclwatch.watchdog.hang.types import CulpritProcess, Finding
from ncclwatch.watchdog.hang.verdicts import CATALOGUE, Verdict

EXIT_NO_HANG = 0
EXIT_HANG = 1
EXIT_INCONCLUSIVE = 2
EXIT_KILLED_ON_HANG = 3  # the live wrapper ended the job after a hang (--on-hang kill)
EXIT_UNREADABLE = 4  # analyze: no input could be read or used, so no report
EXIT_DRAINED = 75  # it drained the culprit's node and ended the job (--drain): EX_TEMPFAIL, requeue elsewhere


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
    # The operation at the verdict's position as Flight Recorder recorded its stack when it was issued ("all_reduce
    # (...) <- main (train.py:71)"): with NCCL a call returns at enqueue, so ``stack`` is often far from it.
    call_site: str | None = None
    gpu: str | None = None  # GPU signature (NVML)
    state: str | None = None  # /proc state letter (live only)
    step: int | None = None  # last step the heartbeat reported (live only)
    last_progress_at: str | None = None  # live only
    # Where the rank sits in the job's DeviceMesh ({"dp": 1, "tp": 1}, ``Report.mesh_dims`` order), from Flight
    # Recorder's mesh groups (hang/mesh.py); only the dimensions it could be placed in; None without a mesh.
    mesh: dict[str, int] | None = None


class MeshGroup(BaseModel):
    """The verdict's communicator as a group of the job's ``DeviceMesh``."""

    dim: str  # "tp" for a group described mesh_tp
    ranks: list[int]  # its members (global ranks), as far as the dumps show them


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


class PerfNote(BaseModel):
    """A performance finding (``slowness/findings.py``), not the verdict.

    It is the live watchdog's latest look, or analyze's from the dumps and the NCCL logs' transports.
    """

    kind: str  # slow_collective, slow_link, straggler, transport_anomaly, ib_port
    key: str
    summary: str
    detail: str
    ranks: list[int] = Field(default_factory=list)
    hosts: list[str] = Field(default_factory=list)
    links: list[str] = Field(default_factory=list)
    communicator: str | None = None
    measured: float | None = None
    expected: float | None = None


class ActionRecord(BaseModel):
    """Something the live watchdog did about the hang, after the capture: restart, kill, drain, hook."""

    kind: str  # restart, kill, drain, hook
    at: str  # when it was done (ISO 8601, UTC)
    ok: bool
    detail: str  # what was done and what came of it: "scontrol: exit 0", "hook exit 2: <its stderr>"


class InputFile(BaseModel):
    path: str
    kinds: list[str]
    note: str | None = None


class Report(BaseModel):
    tool: str = "ncclwatch"
    version: str = __version__
    verdict: Verdict
    culprit_ranks: list[int]
    culprit_processes: list[CulpritProcess] = Field(
        default_factory=list,
        description="culprits named by process (host:pid, GPU) where their rank is not in the input",
    )
    suspect_ranks: list[int] = Field(
        default_factory=list,
        description="where the verdict cannot pick one side (an even split no evidence decides): the global ranks "
        "of every side, one of which is wrong; empty whenever culprit_ranks names the culprit",
    )
    communicator: str | None = None
    position: int | None = Field(None, description="1-based sequence number of the operation in its communicator")
    operation: str | None = None
    kind: str | None = Field(
        None,
        description='a sub-kind of the verdict with its own next step: "dtype" (a collective_mismatch whose ranks '
        'called the same collective with the same count in different datatypes), "spin" (a gpu_compute_hang whose '
        "GPU spins on almost none of its SMs with no NCCL operation running)",
    )
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
    incident_key: str | None = Field(
        None,
        description="the same on every node of a multi-node job for one hang (job round + stalled collective): "
        "the alert's dedup key",
    )
    headline: str | None = Field(
        None, description="one sentence: what happened, which rank, where in its code, what to do next"
    )
    response: str | None = Field(
        None,
        description='what the live watchdog does about the hang and why: "restarting (1 of 3)", "ending the job: ..."',
    )
    actions: list[ActionRecord] = Field(
        default_factory=list,
        description="what the live watchdog did after the capture (--on-hang, --drain, --on-hang-exec), in order",
    )
    performance: list[PerfNote] = Field(
        default_factory=list,
        description="slow collectives and links, stragglers, transport and InfiniBand port findings of the live "
        "watchdog's latest look before the hang, or that ncclwatch analyze finds in the Flight Recorder dumps it was "
        "given; "
        "not the verdict",
    )
    mesh_dims: list[str] = Field(
        default_factory=list,
        description="the dimensions of the job's DeviceMesh that its process groups show (Flight Recorder's "
        "mesh_<dim> groups), outermost first where the groups' strides tell the order, else by name; each rank "
        "row's mesh holds its coordinates; empty without a mesh",
    )
    mesh_group: MeshGroup | None = Field(
        None, description="the verdict's communicator where it is a mesh group: its dimension and members"
    )

    @property
    def exit_code(self) -> int:
        if self.verdict == Verdict.no_hang:
            return EXIT_NO_HANG
        if self.verdict == Verdict.inconclusive:
            return EXIT_INCONCLUSIVE
        return EXIT_HANG


STACK_ARROW = CALL_ARROW  # innermost frame <- the user's frame that led there


def main_frame(snapshot: Snapshot, pid: int | None) -> str | None:
    """The main thread's innermost frame, then the user's own frame that led there.

    ``all_reduce (torch/distributed/distributed_c10d.py:3252) <- step (train.py:105)``;
    the frame alone when it is the user's, or when no frame is the user's.
    """
    dump = snapshot.stacks.get(pid) if pid is not None else None
    thread = main_thread(dump) if dump is not None else None
    return call_line(thread.frames) if thread is not None else None


def gpu_of(snapshot: Snapshot, pid: int | None) -> str | None:
    if pid is None:
        return None
    for snap in reversed(snapshot.gpus):
        for gpu in snap.gpus:
            if any(p.pid == pid for p in gpu.processes):
                sm = gpu.gpm.sm_util_pct if gpu.gpm else None
                dram = gpu.gpm.dram_bw_util_pct if gpu.gpm else None
                shared = f", shared by {len(gpu.processes)} processes" if len(gpu.processes) > 1 else ""
                return (
                    f"GPU {gpu.index}: {gpu_signature(gpu.util_gpu_pct, sm, dram)} (util {gpu.util_gpu_pct:g}%"
                    + (f", SM {sm:g}%" if sm is not None else "")
                    + f"{shared})"
                )
    return None


def _rows(finding: Finding, snapshot: Snapshot, mesh: Mesh) -> list[RankRow]:
    rows = {r.rank: RankRow(**r.__dict__) for r in finding.rows}
    for proc, rank in snapshot.global_ranks.items():
        rows.setdefault(rank, RankRow(rank=rank, host=proc.host, pid=proc.pid))
    workers = {w.rank: w for w in snapshot.workers}  # Flight Recorder's rows know no process: the journal's workers do
    for rank in workers.keys() & mesh.coords.keys():  # the live report's row of each worker then has its coordinates
        rows.setdefault(rank, RankRow(rank=rank))
    for row in rows.values():
        worker = workers.get(row.rank)
        pid = row.pid if row.pid is not None else snapshot.pid_of(row.rank) or (worker.pid if worker else None)
        row.pid, row.host = pid, row.host or (worker.host if worker else None)
        row.stack = main_frame(snapshot, pid)
        row.gpu = gpu_of(snapshot, pid)
        row.mesh = mesh.of(row.rank)
    return [rows[k] for k in sorted(rows)]


def _mesh_group(finding: Finding, snapshot: Snapshot, mesh: Mesh) -> MeshGroup | None:
    """The verdict's communicator as a mesh group: a Flight Recorder group by its name, an NCCL communicator by
    its members (the one mesh group holding exactly its ranks)."""
    comm = next((c for c in snapshot.comms if c.key == finding.comm_key), None)
    if comm is None or not mesh:
        return None
    ranks = {r.global_rank for r in comm.ranks if r.global_rank is not None} | set(comm.members)
    pg = comm.key.removeprefix("fr:") if comm.source == "flight_recorder" else None  # JobState keys it fr:<name>
    if pg is not None and (dim := mesh.dim_of(pg)) is not None:
        return MeshGroup(dim=dim, ranks=sorted(ranks | set(mesh.groups[pg][1])))
    found = mesh.dim_of_members(ranks) if pg is None and ranks else None
    return MeshGroup(dim=found[0], ranks=list(found[1])) if found else None


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


def build_report(
    finding: Finding, snapshot: Snapshot, inputs: list[InputFile], cited: dict[int, tuple[str, str | None]]
) -> Report:
    """``cited`` maps an evidence index to its resolved "file:line" and line text."""
    evidence = []
    for index, item in enumerate(finding.evidence):
        cite, text = cited.get(index, (str(item.cite) if item.cite else None, item.cite.text if item.cite else None))
        evidence.append(EvidenceItem(source=item.source, fact=item.fact, cite=cite, text=text))
    mesh = derive_mesh(snapshot.mesh_groups)
    report = Report(
        verdict=finding.verdict,
        culprit_ranks=list(finding.culprits),
        culprit_processes=list(finding.culprit_processes),
        suspect_ranks=[] if finding.culprits else sorted(set(finding.suspects)),
        communicator=finding.comm_label,
        position=finding.position,
        operation=finding.operation,
        kind=finding.kind,
        summary=finding.summary,
        reason=finding.reason,
        ranks=_rows(finding, snapshot, mesh),
        timeline=_timeline(finding, snapshot),
        evidence=evidence,
        missing=list(finding.missing),
        notes=list(snapshot.notes),
        inputs=inputs,
        nccl_versions=sorted(set(snapshot.nccl_versions.values())),
        analyzed_at=dt.datetime.fromtimestamp(snapshot.observed_at, dt.UTC).isoformat(timespec="seconds"),
        mesh_dims=list(mesh.dims),
        mesh_group=_mesh_group(finding, snapshot, mesh),
    )
    return report.model_copy(update={"headline": headline(report)})


def iso(timestamp: float | None) -> str | None:
    return (
        dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="milliseconds")
        if timestamp is not None
        else None
    )


TERMINAL_COLUMNS = 100


def render_text(report: Report, max_evidence: int = 12, columns: int = TERMINAL_COLUMNS) -> str:
    """A short human verdict: culprit, reason, operation, a per-rank table.

    The table fits ``columns``; prose lines are wrapped at word boundaries.
    """
    title = report.verdict.value.replace("_", " ").upper()
    if report.culprit_ranks:
        title += f" — culprit rank {', '.join(_ranks_placed(report, report.culprit_ranks))}"
    elif report.culprit_processes:
        title += f" — culprit process {', '.join(map(str, report.culprit_processes))}"
    elif report.suspect_ranks:
        title += f" — suspects rank {', '.join(_ranks_placed(report, report.suspect_ranks))}"
    lines = [f"ncclwatch: {title}", *_wrap(report.summary, columns, "  ")]
    if report.reason:
        lines += _wrap(f"why: {report.reason}", columns, "  ")
    if report.operation:
        where = [f"collective #{report.position}"] if report.position else []
        where += [report.communicator] if report.communicator else []
        lines += _wrap(f"operation: {report.operation}" + (f" ({', '.join(where)})" if where else ""), columns, "  ")
    if report.ranks:
        lines.append("")
        lines.extend(_table(report.ranks, columns, report.mesh_dims))
    if report.evidence:
        lines.append("")
        lines.append("evidence:")
        for item in report.evidence[:max_evidence]:
            lines += _wrap(f"- [{item.source}] {item.fact}", columns, "  ", "    ")
            if item.cite:
                lines += _wrap(item.cite, columns, "      ")
        if len(report.evidence) > max_evidence:
            lines.append(f"  ... {len(report.evidence) - max_evidence} more (--json shows all)")
    for title, items in (
        ("could not see", report.missing),
        ("notes", report.notes),
        ("performance (slow, not hung)", [f"[{p.kind}] {p.summary}" for p in report.performance]),
    ):
        if items:
            lines.append("")
            lines.append(f"{title}:")
            for item in items[:10]:
                lines += _wrap(f"- {item}", columns, "  ", "    ")
    return "\n".join(lines)


def mesh_place(report: Report, rank: int) -> str | None:
    """``dp 1, tp 1``: where ``rank`` sits in the job's mesh, as its row says; None without one."""
    row = next((r for r in report.ranks if r.rank == rank), None)
    return coords_label(report.mesh_dims, row.mesh) if row is not None else None


def _ranks_placed(report: Report, ranks: list[int]) -> list[str]:
    """``["3 (dp 1, tp 1)"]``: each rank with its mesh coordinates where it has them."""
    return [f"{rank} ({place})" if (place := mesh_place(report, rank)) else str(rank) for rank in ranks]


def _peers(report: Report) -> str | None:
    """``its tp group's peers (rank 2)``: where the verdict's communicator is a mesh group, its other members."""
    group = report.mesh_group
    if group is None:
        return None
    peers = [r for r in group.ranks if r not in report.culprit_ranks]
    if not peers:
        named = ""
    elif len(peers) <= _PEERS_NAMED:
        named = f" ({'rank' if len(peers) == 1 else 'ranks'} {', '.join(map(str, peers))})"
    else:
        named = f" ({len(peers)} ranks)"
    return f"its {group.dim} group's peers{named}"


_PEERS_NAMED = 4  # more peers than this are counted, not named


def _wrap(text: str, columns: int, indent: str, then: str | None = None) -> list[str]:
    """Wrap at spaces only: a path or a frame longer than a line stays whole on its own line."""
    return textwrap.wrap(
        text,
        columns,
        initial_indent=indent,
        subsequent_indent=then if then is not None else indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


_HEADER = ("rank", "host", "pid", "state", "step", "issued", "status", "detail", "stack", "gpu")
_MESH = "mesh"  # in _NARROWING: each mesh dimension's column, which follows "rank" (keyed "mesh:<dim>")
# When the table is too wide: shorten a column (to its next shorter form) or drop it, in this order,
# until it fits.  "uniform" drops a column whose every row says the same (it tells ranks apart by nothing).
_NARROWING = (
    ("shorten", "host"),
    ("shorten", "gpu"),
    ("shorten", "detail"),
    ("shorten", "stack"),
    ("uniform", "host"),
    ("uniform", "state"),
    ("uniform", "step"),
    ("uniform", "issued"),
    ("uniform", _MESH),
    ("drop", "issued"),
    ("shorten", "stack"),
    ("drop", "step"),
    ("drop", "state"),
    ("shorten", "gpu"),
    ("drop", "gpu"),
    ("shorten", "stack"),
    ("drop", "host"),
    ("drop", "detail"),
    ("drop", "status"),
    ("drop", _MESH),
    ("drop", "pid"),
    ("drop", "stack"),
)


def _table(rows: list[RankRow], columns: int = TERMINAL_COLUMNS, dims: Sequence[str] = ()) -> list[str]:
    """The per-rank table, at most ``columns`` wide; a column per mesh dimension in ``dims`` after the rank.

    Too wide, it shortens cells at name boundaries (a frame becomes ``func (file.py:123)``, then
    ``func <- file.py:123``; a GPU signature loses its figures) and then drops the least telling
    columns: a cell is never cut in the middle of a name.
    """
    dash = lambda value: "-" if value is None or value == "" else str(value)
    mesh_columns = [f"{_MESH}:{dim}" for dim in dims]
    header = (_HEADER[0], *mesh_columns, *_HEADER[1:])
    forms: dict[str, list[list[str]]] = {name: [] for name in header}  # column -> per row, longest form first
    # The stack column shows where each rank issued the verdict's operation (Flight Recorder) when known, and
    # py-spy's current position on a second line only where it is elsewhere.
    now: list[list[str] | None] = []
    for r in rows:
        shown = r.call_site or r.stack
        cells = dict(zip(_HEADER, (r.rank, r.host, r.pid, r.state, r.step, r.issued, r.status, r.detail, shown, r.gpu)))
        for name, value in cells.items():
            text = dash(value)
            shorter = {"host": _host_forms, "stack": _stack_forms, "detail": _detail_forms, "gpu": _gpu_forms}.get(name)
            forms[name].append(shorter(text) if shorter and text != "-" else [text])
        for dim, name in zip(dims, mesh_columns, strict=True):
            forms[name].append([dash((r.mesh or {}).get(dim))])
        # compared by function names and the user's line: torch's own line differs between the two records
        elsewhere = r.call_site and r.stack and _stack_forms(r.stack)[2] != _stack_forms(r.call_site)[2]
        now.append([_NOW + form for form in _stack_forms(r.stack)] if elsewhere else None)  # type: ignore[arg-type]
    keep = [n for n in header if n in _HEADER[:3] or any(f[0] != "-" for f in forms[n])]
    level = dict.fromkeys(header, 0) | {"stack": 1}  # frames always with their file's basename only
    cell = lambda name, row: forms[name][row][min(level[name], len(forms[name][row]) - 1)]
    now_cell = lambda row: now[row][min(level["stack"], len(now[row]) - 1)] if now[row] else ""  # type: ignore[index]
    label = dict(zip(_HEADER, _HEADER)) | dict(zip(mesh_columns, dims, strict=True))
    label |= {"stack": "call site"} if any(r.call_site for r in rows) else {}
    width = lambda name: max(
        len(label[name]),
        *(len(cell(name, i)) for i in range(len(rows))),
        *(len(now_cell(i)) for i in range(len(rows)) if name == "stack"),
    )
    fits = lambda: 2 + sum(width(n) for n in keep) + 2 * (len(keep) - 1) <= columns
    narrowing = [
        (action, column) for action, name in _NARROWING for column in (mesh_columns if name == _MESH else [name])
    ]
    for action, name in narrowing:
        if fits():
            break
        if name not in keep:
            continue
        if action == "shorten":
            level[name] += 1
        elif action == "drop" or len({cell(name, i) for i in range(len(rows))}) == 1:
            keep.remove(name)
    widths = {n: width(n) for n in keep}
    fmt = lambda texts: "  " + "  ".join(texts[n].ljust(widths[n]) for n in keep).rstrip()
    lines = [fmt({n: label[n] for n in keep})]
    for i in range(len(rows)):
        lines.append(fmt({n: cell(n, i) for n in keep}))
        if now[i] and "stack" in keep:
            lines.append(fmt({n: now_cell(i) if n == "stack" else "" for n in keep}))
    return lines


_NOW = "now: "  # py-spy's position, under a call site it differs from


def _stack_forms(stack: str) -> list[str]:
    """``inner <- mine`` from longest to shortest: frames with their file's basename, then the torch
    frame by name only, then the user's line only.  The same index is the same degree of shortening
    for every row, so a column narrows evenly; a user's frame is kept longest."""
    inner, _, mine = stack.partition(STACK_ARROW)
    name = split_frame(inner)[0]
    if not mine:
        if user_frame([inner]) is None:
            return [stack, short_frame(inner), short_frame(inner), name]
        return [stack, short_frame(inner), short_frame(inner), short_frame(inner), _at(inner)]
    return [
        stack,
        f"{short_frame(inner)}{STACK_ARROW}{short_frame(mine)}",
        f"{name}{STACK_ARROW}{short_frame(mine)}",
        f"{name}{STACK_ARROW}{_at(mine)}",
        _at(mine),
    ]


def _at(frame: str) -> str:
    """``train.py:105``: the frame's file basename and line."""
    _, path, line = split_frame(frame)
    base = path.rpartition("/")[2]
    return f"{base}:{line}" if line else base


def _host_forms(host: str) -> list[str]:
    """``gpu-node-001.cluster.example.com`` -> ``gpu-node-001``."""
    short = host.partition(".")[0]
    return [host, short] if short and short != host else [host]


def _detail_forms(detail: str) -> list[str]:
    """``#67: AllReduce count=65536 Float`` -> ``#67: AllReduce``: the operation without its sizes."""
    words = detail.split(" ")
    return [detail, " ".join(words[:2])] if detail.startswith("#") and len(words) > 2 else [detail]


def _gpu_forms(gpu: str) -> list[str]:
    """``GPU 0: nccl_spin (util 100%, SM 18.2%)`` -> ``GPU 0: nccl_spin`` -> ``nccl_spin``."""
    short = gpu.partition(" (")[0]
    signature = short.partition(": ")[2] or short
    return list(dict.fromkeys((gpu, short, signature)))


def headline(report: Report) -> str:
    """One sentence: what happened, which rank (host, pid), where in its own code, what to do next (the
    verdict's ``culprit_does`` and ``next_step`` in ``verdicts.CATALOGUE``).

    ``ncclwatch: RANK BEHIND rank 2 (node1, pid 4242) never entered AllReduce #57; its peers wait in it —
    it is at train.py:105 in step(). Next: py-spy stack in the bundle; ...``

    Where Flight Recorder recorded the line that issued the operation (``call_site``), that line, and
    py-spy's only when the rank is now elsewhere: with NCCL a collective returns at enqueue.

    Where the job has a ``DeviceMesh``, the culprit by its place in it and the verdict's group by its dimension:
    ``rank 3 (dp 1, tp 1) never entered AllGather #13; its dp group's peers (rank 1) wait in it``.
    """
    title = report.verdict.value.replace("_", " ").upper()
    rows = {row.rank: row for row in report.ranks}
    culprits = report.culprit_ranks
    op = report.operation.split(" ")[0] if report.operation else "the collective"
    op = f"{op} #{report.position}" if report.operation and report.position else op
    if culprits:
        first = rows.get(culprits[0])
        place = ", ".join(x for x in (first.host, f"pid {first.pid}" if first.pid else None) if x) if first else ""
        place = "; ".join(x for x in (mesh_place(report, culprits[0]), place) if x)  # "dp 1, tp 1; node1, pid 42"
        who = f"rank {culprits[0]}" + (f" ({place})" if place and len(culprits) == 1 else "")
        if len(culprits) > 1:
            who = f"ranks {', '.join(_ranks_placed(report, culprits))}"
        does = CATALOGUE[report.verdict].culprit_does
        if report.verdict == Verdict.collective_mismatch:
            does = _mismatch_words(_op_at(first, report.position), report.operation, report.position)
            if report.kind == "dtype":
                does = _dtype_words(report, _op_at(first, report.position)) or does
        if (peers := _peers(report)) is not None:
            does = does.replace("its peers", peers, 1)
        what = f"{who} {does.format(op=op)}" if does else f"{who}: {report.summary.rstrip('.')}"
        called = _user_site(first.call_site) if first else None
        mine = _user_site(first.stack) if first else None
        peers = sorted(
            {site for row in report.ranks if row.rank not in culprits and (site := _user_site(row.call_site))}
        )
        if called:
            # a rank behind never issued the operation: its call site is that of the last one it issued
            issued = "its last recorded call site is" if report.verdict == Verdict.rank_behind else "issued from"
            what += f" — {issued} {called}" + (f" (py-spy: now at {mine})" if mine and mine != called else "")
        elif mine:
            what += f" — {'it is' if len(culprits) == 1 else f'rank {culprits[0]} is'} at {mine}"
        what += f"; its peers issued theirs from {' and '.join(peers)}" if peers else ""
    elif report.culprit_processes:
        what = f"process {', '.join(map(str, report.culprit_processes))}: {report.summary.rstrip('.')}"
    else:
        what = report.summary.rstrip(".")
        sites = [f"rank {row.rank} from {site}" for row in report.ranks if (site := _user_site(row.call_site))]
        what += f" — {', '.join(sites)}" if sites and report.verdict == Verdict.collective_mismatch else ""
    ranks = f"rank {', '.join(map(str, culprits))}" if culprits else "the lead rank"
    advice = CATALOGUE[report.verdict].next_step_for(report.kind).format(ranks=ranks)
    return f"ncclwatch: {title} {what}. Next: {advice}{'' if advice.endswith('?') else '.'}"


def _op_at(row: RankRow | None, position: int | None) -> str | None:
    """The operation a rank issued at ``position``, from its row's detail (``#67: AllGather count=64 Float``)."""
    prefix = f"#{position}: "
    return (
        row.detail[len(prefix) :]
        if row is not None and position is not None and row.detail.startswith(prefix)
        else None
    )


def _mismatch_words(theirs: str | None, expected: str | None, position: int | None) -> str:
    """By name when the names differ (AllGather vs AllReduce), else with the sizes that differ."""
    if not theirs or not expected:
        return "issued a different operation than its peers at {op}"
    if theirs.split(" ")[0] != expected.split(" ")[0]:
        return f"issued {theirs.split(' ')[0]} where its peers issued {{op}}"
    return f"issued {theirs} where its peers issued {expected} (#{position})"


def _dtype_words(report: Report, theirs: str | None) -> str | None:
    """``passes BFloat16 where ranks 0, 2 pass Float to {op}``: the one word that differs between the culprit's
    operation and its peers' (a dtype mismatch differs in nothing else)."""
    expected = report.operation
    if not theirs or not expected or len(theirs.split()) != len(expected.split()):
        return None
    differ = [(a, b) for a, b in zip(theirs.split(), expected.split(), strict=True) if a != b]
    if len(differ) != 1:
        return None
    others = [row.rank for row in report.ranks if row.rank not in report.culprit_ranks]
    if not others:
        return None
    peers = f"rank {others[0]} passes" if len(others) == 1 else f"ranks {', '.join(map(str, others))} pass"
    verb = "passes" if len(report.culprit_ranks) == 1 else "pass"
    return f"{verb} {differ[0][0]} where {peers} {differ[0][1]} to {{op}}"


def _user_site(stack: str | None) -> str | None:
    """``train.py:105 in step()`` from a row's stack (``inner <- mine``, or the user's frame alone)."""
    if not stack:
        return None
    inner, _, mine = stack.partition(STACK_ARROW)
    frame = mine or (inner if user_frame([inner]) else None)
    if frame is None:
        return None
    return f"{_at(frame)} in {split_frame(frame)[0]}()"
