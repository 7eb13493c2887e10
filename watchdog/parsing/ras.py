"""NCCL RAS status reports (text, and JSON from 2.28.7) -> ``RasReport`` events.

NCCL's RAS thread answers ``STATUS`` / ``VERBOSE STATUS`` on 127.0.0.1:28028;
the formats below are those printed by ``src/ras/client_support.cc``
(read at 2.29.2 and 2.32.3, plus a 2.24-era copy; real 2.28.9 replies match):

Text::

    NCCL version 2.28.9 compiled with CUDA 13.0          (no +cudaX suffix here)
    CUDA runtime version 13000, driver version 13000
    Job summary / =========== / a node-process-GPU table
    Communicators... (0.002s)                            (%.2f in the 2.24-2.26 sources)
    Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
        0         1         1         4         4         4   RUNNING  MISMATCH
    Errors / ======     job blocks INCOMPLETE, DEAD; comm blocks "#g-i (hash) INCOMPLETE|ERROR"
    Warnings / ======== job block TIMEOUT; comm blocks "#g-i (hash) MISMATCH"

Only communicators with a problem get a ``#g-i`` block; the others exist only
as summary-table rows, so OK communicators get synthesised labels ``#g-i``
(NCCL numbers them the same way) and no hash.

JSON (``SET FORMAT json``)::

    {"nccl_version", "cuda_runtime_version", "cuda_driver_version", "timestamp",
     "communicators_count", "communicators": [{"hash": "0x..", "secondary_hash",
     "size", "ranks_count", "missing_ranks_count",
     "ranks": [{rank, host, pid, cuda_dev, nvml_dev, status{init_state, async_error,
                finalize_called, destroy_flag, abort_flag}, collective_counts{Op: n}}],
     "missing_ranks": [{rank, host, pid, cuda_dev, nvml_dev,
                        status{unresponsive, considered_dead}}]}],
     "ras": {"collection_time_sec", "timeouts_count"}}

Failure modes (nothing here raises): empty, binary or unrelated input, a
server ``ERROR:`` reply, or a text report cut before its table ->
``Unusable``.  Malformed JSON (seen on NCCL 2.28.9) is repaired or salvaged
and returned *with* an ``Unusable`` note saying what was lost.  Every
counter is host-side (operations *launched*, not completed) and per
collective type; RAS has no p2p counts.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ncclwatch.watchdog.events import (
    RAS_DEAD,
    RAS_DIFFERENT_OPS,
    RAS_DIFFERENT_STATUS,
    RAS_GROUP_OPS,
    RAS_GROUP_STATUS,
    RAS_MISSING,
    Citation,
    Event,
    RasCommunicator,
    RasRank,
    RasReport,
    Unusable,
)

MALFORMED_JSON_REASON = "malformed RAS JSON (known on NCCL 2.28.9); capture the text report too"

# Rank status words.  NCCL's own: NOCOMM (2.26+; UNKNOWN before) INIT RUNNING
# FINALIZE ABORT.  Ours: RAS_MISSING (did not answer RAS), RAS_DEAD (RAS gave up
# on the process), "ERROR: <NCCL error text> (<phase>)".
_STATUS_RANK = {RAS_DEAD: 4, RAS_MISSING: 3}  # higher wins when sections disagree; ERROR: 2, others 1
_ERROR_ORDER = ("INCOMPLETE", "ERROR", "MISMATCH")  # NCCL's errorStr order
_NCCL_ERRORS = {
    1: "Unhandled CUDA error",
    2: "System error",
    3: "Internal error",
    4: "Invalid argument",
    5: "Invalid usage",
    6: "Remote process error",
}  # 0 success, 7 in progress: not errors

_SNIFF = (
    re.compile(rb"^NCCL version \S+ compiled with CUDA", re.MULTILINE),
    re.compile(rb"^Communicators\.\.\.", re.MULTILINE),
    re.compile(rb"^Group +Comms +Nodes +Ranks", re.MULTILINE),
    re.compile(rb"^#\d+-\d+ \([0-9a-f]{16}\) (?:INCOMPLETE|ERROR|MISMATCH)", re.MULTILINE),
    re.compile(rb'"nccl_version"\s*:\s*"[^"]*"\s*,\s*"cuda_runtime_version"'),
    re.compile(rb'"communicators"\s*:\s*\[\s*\{\s*"hash"\s*:\s*"0x'),
)
_PROTOCOL_LINE = re.compile(r"(?:SERVER PROTOCOL \d+|OK)\r?\n")
_JSON_START = re.compile(r'\{\s*"nccl_version"')
_RAS_JSON_KEY = re.compile(r'"(?:nccl_version|communicators|collective_counts|missing_ranks)"\s*:')


def looks_like_ras(head: bytes) -> bool:
    """Cheap sniff of the first bytes.  Never raises.

    Trap: an NCCL debug log also says ``NCCL version 2.28.9+cuda13.0``; only
    the RAS header has ``compiled with CUDA`` right after the version.
    """
    try:
        return any(p.search(head) for p in _SNIFF)
    except Exception:  # noqa: BLE001 - a sniffer must never take ingestion down
        return False


def normalize_comm_hash(value: object) -> str | None:
    """A communicator hash in the form NCCL's debug log prints it (``0x%lx``), else None.

    Accepts ``0x678a...``, ``678a...`` or an int.  Trap: the text report
    prints ``%016lx`` (zero-padded, no 0x) while the JSON and the debug log's
    ``commId`` print ``0x%lx`` (not padded); normalising both gives a string
    equal to ``CommInit.comm_id``.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return f"0x{value:x}" if 0 <= value < 1 << 64 else None
    if not isinstance(value, str):
        return None
    text = value.strip().lower().removeprefix("0x")
    if not text or len(text) > 16 or any(c not in "0123456789abcdef" for c in text):
        return None
    return f"0x{int(text, 16):x}"


def _never_raises(parse: Callable[..., list[Event]]) -> Callable[..., list[Event]]:
    """Turn any exception of a parser into ``[Unusable]``: a bad capture must not stop the watchdog."""

    @functools.wraps(parse)
    def guarded(payload: object, *args: str, **kwargs: str) -> list[Event]:
        try:
            return parse(payload, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the point of this wrapper
            name = args[0] if args else kwargs.get("name", parse.__name__)
            return [Unusable(reason=f"RAS parser failed: {type(exc).__name__}: {exc}", cite=Citation(file=name))]

    return guarded


@_never_raises
def parse_ras(data: bytes, name: str) -> list[Event]:
    """A captured RAS reply (text or JSON) -> ``[RasReport]`` or ``[Unusable]``.

    A repaired or salvaged JSON gives ``[RasReport, Unusable(note)]``: the
    report holds what survived, the note what was lost.  Never raises.
    """
    cite = Citation(file=name)
    if not data or not data.strip():
        return [Unusable(reason="empty RAS capture (no report: RAS disabled, job gone, or query timed out)", cite=cite)]
    if _looks_binary(data[:4096]):
        return [Unusable(reason="not a RAS report (binary data)", cite=cite)]
    text = data.decode("utf-8", errors="replace").replace("\x00", "")
    # Trap: a raw socket capture starts with the handshake answers
    # ("SERVER PROTOCOL 2", "OK" for TIMEOUT / SET FORMAT); drop them.
    while (m := _PROTOCOL_LINE.match(text.lstrip())) is not None:
        text = text.lstrip()[m.end() :]
    first = text.strip().splitlines()[0] if text.strip() else ""
    if first.startswith(("ERROR:", "BUSY:")):
        return [Unusable(reason=f"RAS server refused the query: {first.strip()}", cite=cite)]
    start = _json_start(text)
    if start is not None:
        return _parse_json_text(text, start, name, cite)
    if _is_text_report(text):
        return parse_ras_text(text, name)
    if not text.strip():
        return [Unusable(reason="RAS server answered the handshake but sent no report", cite=cite)]
    return [Unusable(reason="not a NCCL RAS status report (no RAS header, table or JSON keys)", cite=cite)]


def _looks_binary(head: bytes) -> bool:
    # A stray NUL (a C string terminator copied along) is tolerated; a high
    # share of control or undecodable bytes is not.
    text = head.decode("utf-8", errors="replace")
    odd = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\r\n\t"))
    return odd > max(8, len(text) // 20)


def _json_start(text: str) -> int | None:
    """Where the RAS JSON document starts, or None (text report, or JSON that is not RAS's)."""
    stripped = text.lstrip()
    if stripped.startswith("{") and _RAS_JSON_KEY.search(stripped[:65536]):
        return len(text) - len(stripped)
    # Trap: the JSON may follow text (a port that prints the text banner first).
    m = _JSON_START.search(text)
    return m.start() if m else None


def _is_text_report(text: str) -> bool:
    return any(p.search(text.encode("utf-8", errors="replace")) for p in _SNIFF[:4])


# --------------------------------------------------------------------------
# Text report
# --------------------------------------------------------------------------

# "GPU 2 managed by process 1710 on node 192.0.2.2"; "GPU 3 (NVML 7)" when
# CUDA_VISIBLE_DEVICES remaps.  Trap: the node is an IP address (inet_ntop),
# never a hostname, and may be empty for an address-less peer.
_GPU = (
    r"(?:GPU (?P<gpu>\d+)(?: \(NVML \d+\))? managed by process (?P<pid>\d+) on node (?P<host>\S*)"
    r"|\[process information not found\])"
)
_R = {
    "version": re.compile(r"^NCCL version (\S+) compiled with CUDA"),
    "row": re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$"),
    "comm": re.compile(r"^#(\d+)-(\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)\s*$"),
    "job": re.compile(r"^(INCOMPLETE|DEAD|TIMEOUT)\s*$"),
    "process": re.compile(r"^Process (\d+) on node (\S*) managing GPUs? (.+)$"),
    "diff_ops": RAS_DIFFERENT_OPS,
    "diff_status": RAS_DIFFERENT_STATUS,
    "group_ops": RAS_GROUP_OPS,
    "group_status": RAS_GROUP_STATUS,
    "group_error": re.compile(r"^(\d+) ranks reported (.+)$"),
    "phase": re.compile(r"^(Initialization|Asynchronous) errors? on \d+ ranks?$"),
    "missing": re.compile(r"^Missing communicator data from \d+ ranks?$"),
    "rank": re.compile(rf"^Rank (?P<rank>\d+) -- {_GPU}$"),
    "rank_ops": re.compile(
        rf"^Rank (?P<rank>\d+) has (?:launched up to operation (?P<value>\d+)|not launched any operations) -- {_GPU}$"
    ),
    "rank_status": re.compile(rf"^Rank (?P<rank>\d+) has status (?P<status>\w+)(?: -- {_GPU})?$"),
    "rank_error": re.compile(rf"^Rank (?P<rank>\d+) reported (?P<error>.+?) -- {_GPU}$"),
    "rank_list": re.compile(r"^The (missing|unknown) ranks?: ([\d,]+)$"),  # 2.24/2.25 only
}


@dataclass
class _CommAcc:
    label: str
    comm_hash: str | None = None
    kinds: list[str] = field(default_factory=list)
    ranks: dict[int, dict] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


@dataclass
class _TextState:
    version: str | None = None
    rows: list[tuple] = field(default_factory=list)
    no_comms: bool = False
    saw_warnings: bool = False
    comms: dict[str, _CommAcc] = field(default_factory=dict)
    job: str | None = None  # current job-level block
    comm: _CommAcc | None = None  # current communicator block
    op: str = "Collective"  # from "ranks have different <op> operation counts"
    phase: str = "unknown phase"  # from "Initialization|Asynchronous error(s) on N rank(s)"
    group: tuple[str, object] | None = None  # what a bare "Rank r -- GPU ..." line belongs to
    job_messages: list[str] = field(default_factory=list)
    dead: set[tuple[str, int]] = field(default_factory=set)


@_never_raises
def parse_ras_text(text: str, name: str = "ras.txt") -> list[Event]:
    """A RAS text report -> ``[RasReport(format="text")]`` (+ a note when cut short).

    Failure modes: no summary table (truncated: the query timed out or the
    connection closed early) -> ``[Unusable]``, because an empty report would
    read as "nothing wrong".  Table but no ``Warnings`` section -> the report
    plus an ``Unusable`` note (mismatch details may be missing).
    """
    cite = Citation(file=name)
    state = _TextState()
    for line in text.splitlines():
        _scan_line(state, line.rstrip())
    if not state.rows and not state.comms and not state.no_comms:
        got = f"NCCL {state.version} " if state.version else ""
        return [
            Unusable(
                reason=f"RAS {got}text report has no communicator table (truncated or not a STATUS reply)", cite=cite
            )
        ]
    report = RasReport(format="text", nccl_version=state.version, communicators=_text_comms(state), cite=cite)
    if state.saw_warnings:
        return [report]
    return [
        report,
        Unusable(
            reason="RAS text report ends before its Warnings section (truncated): MISMATCH details may be missing",
            cite=cite,
        ),
    ]


def _scan_line(state: _TextState, line: str) -> None:
    """Feed one line; headings switch block, indented lines are block details."""
    if not line.strip() or set(line.strip()) == {"="}:
        return
    if line.startswith(" ") and (state.comm is not None or state.job is not None):
        _scan_detail(state, line.strip())
        return
    if m := _R["version"].match(line):
        state.version = m.group(1)
    elif line.startswith("No communicator data collected!"):
        state.no_comms = True
    elif line.startswith(("Errors", "Warnings")):
        state.saw_warnings |= line.startswith("Warnings")
        state.job, state.comm = None, None
    elif m := _R["comm"].match(line):
        label = f"#{m.group(1)}-{m.group(2)}"
        acc = state.comms.setdefault(label, _CommAcc(label=label))
        acc.comm_hash = normalize_comm_hash(m.group(3))
        if m.group(4) not in acc.kinds:
            acc.kinds.append(m.group(4))
        state.job, state.comm, state.op, state.phase = None, acc, "Collective", "unknown phase"
        state.group = ("status", RAS_MISSING) if m.group(4) == "INCOMPLETE" else None
    elif m := _R["job"].match(line):
        state.job, state.comm = m.group(1), None
    elif m := _R["row"].match(line):
        state.rows.append(m.groups())


def _scan_detail(state: _TextState, line: str) -> None:
    """One indented sentence of a block: keep it, and pull out rank facts.

    Trap: a bare ``Rank r -- GPU ...`` line carries no value of its own; it
    belongs to the group sentence printed just before it (``N ranks have
    launched up to operation V``, ``N ranks have status S``, ...).
    """
    if state.job is not None:
        state.job_messages.append(f"{state.job}: {line}")
        if state.job == "DEAD" and (m := _R["process"].match(line)):
            state.dead.add((m.group(2), int(m.group(1))))
        return
    acc = state.comm
    acc.messages.append(line)
    if m := _R["diff_ops"].match(line):
        state.op = "Collective" if m.group(1) == "collective" else m.group(1)  # 2.24/2.25: all types summed
        state.group = None
    elif m := _R["phase"].match(line):
        state.phase, state.group = m.group(1).lower(), None
    elif m := _R["group_ops"].match(line):
        state.group = ("counts", {state.op: int(m.group(2) or 0)})
    elif m := _R["group_status"].match(line):
        state.group = ("status", m.group(2))
    elif m := _R["group_error"].match(line):
        state.group = ("status", f"ERROR: {m.group(2)} ({state.phase})")
    elif _R["missing"].match(line):
        state.group = ("status", RAS_MISSING)
    elif _R["diff_status"].match(line):
        state.group = None
    else:
        _scan_rank_line(state, acc, line)


def _scan_rank_line(state: _TextState, acc: _CommAcc, line: str) -> None:
    """``Rank r ...`` lines: a single-rank group carries its value, a bare one takes the group's."""
    if m := _R["rank_ops"].match(line):
        _put_rank(acc, m, counts={state.op: int(m.group("value") or 0)})
    elif m := _R["rank_status"].match(line):
        _put_rank(acc, m, status=m.group("status"))
    elif m := _R["rank_error"].match(line):
        _put_rank(acc, m, status=f"ERROR: {m.group('error')} ({state.phase})")
    elif m := _R["rank"].match(line):
        kind, value = state.group or ("", None)
        _put_rank(acc, m, **{kind: value} if kind else {})
    elif m := _R["rank_list"].match(line):
        status = RAS_MISSING if m.group(1) == "missing" else "UNKNOWN"
        for rank in m.group(2).split(","):
            if rank:
                _merge_rank(acc.ranks, int(rank), status=status)


def _put_rank(acc: _CommAcc, m: re.Match, **facts) -> None:
    gpu, pid, host = m.groupdict().get("gpu"), m.groupdict().get("pid"), m.groupdict().get("host")
    _merge_rank(
        acc.ranks,
        int(m.group("rank")),
        host=host or None,
        pid=int(pid) if pid else None,
        cuda_dev=int(gpu) if gpu else None,
        **facts,
    )


def _merge_rank(
    ranks: dict[int, dict], rank: int, *, status: str | None = None, counts: dict[str, int] | None = None, **ident
) -> None:
    """Merge what one section says about a rank into what others said."""
    rec = ranks.setdefault(rank, {"rank": rank, "collective_counts": {}})
    for key, value in ident.items():
        if value is not None and rec.get(key) is None:
            rec[key] = value
    if status is not None and _status_rank(status) >= _status_rank(rec.get("status")):
        rec["status"] = status
    rec["collective_counts"].update(counts or {})


def _status_rank(status: str | None) -> int:
    if status is None:
        return 0
    return _STATUS_RANK.get(status, 2 if status.startswith("ERROR") else 1)


def _text_comms(state: _TextState) -> list[RasCommunicator]:
    """Table rows x comm blocks -> one ``RasCommunicator`` per communicator."""
    table: dict[str, tuple] = {}
    for group, n_comms, nodes, per_node, nranks, _in_group, status, errors in state.rows:
        for index in range(int(n_comms)):
            table[f"#{group}-{index}"] = (int(nranks), status, errors, nodes, per_node)
    comms = []
    for label in sorted(set(table) | set(state.comms), key=_label_key):
        acc = state.comms.get(label) or _CommAcc(label=label)
        nranks, life, errors, nodes, per_node = table.get(label, (None, None, None, None, None))
        status = errors or ",".join(k for k in _ERROR_ORDER if k in acc.kinds) or "UNKNOWN"
        messages = list(acc.messages)
        if life is not None:
            messages.insert(0, f"Status {life} (summary table: {nodes} node(s), {per_node} rank(s) per node)")
        for rec in acc.ranks.values():  # a missing rank whose process RAS declared dead
            if rec.get("status") == RAS_MISSING and (rec.get("host"), rec.get("pid")) in state.dead:
                rec["status"] = RAS_DEAD
        ranks = [RasRank(**rec) for _, rec in sorted(acc.ranks.items())]
        comms.append(
            RasCommunicator(
                comm_hash=acc.comm_hash, label=label, nranks=nranks, status=status, ranks=ranks, messages=messages
            )
        )
    return _attach_job_messages(comms, state.job_messages)


def _label_key(label: str) -> tuple[int, int]:
    group, _, index = label[1:].partition("-")
    return int(group), int(index)


def _attach_job_messages(comms: list[RasCommunicator], job: list[str]) -> list[RasCommunicator]:
    """Job-level sentences (INCOMPLETE/DEAD/TIMEOUT) have no communicator of their own.

    They go to every communicator that is not OK (all of them if none is); with
    no communicator at all, to a stand-in labelled ``job`` so they are not lost.
    """
    if not job:
        return comms
    if not comms:
        kinds = ",".join(dict.fromkeys(m.split(":", 1)[0] for m in job))
        return [RasCommunicator(label="job", status=kinds, messages=list(job))]
    targets = {id(c) for c in comms if c.status != "OK"} or {id(c) for c in comms}
    return [c.model_copy(update={"messages": c.messages + job}) if id(c) in targets else c for c in comms]


# --------------------------------------------------------------------------
# JSON report
# --------------------------------------------------------------------------


@_never_raises
def parse_ras_json(obj: object, name: str = "ras.json") -> list[Event]:
    """A decoded RAS JSON document -> ``[RasReport(format="json")]``.

    Failure modes: not a RAS STATUS document (e.g. a MONITOR event) ->
    ``[Unusable]``; a communicator of the wrong shape is skipped and noted in
    an ``Unusable``; a rank record without a rank number is ignored.  Fewer
    records than NCCL announced (``ranks_count``...) marks the communicator
    ``PARTIAL``.  Never raises.
    """
    cite = Citation(file=name)
    if not isinstance(obj, dict) or not isinstance(obj.get("communicators"), list):
        what = "a RAS MONITOR event" if isinstance(obj, dict) and "event" in obj else "no 'communicators' list"
        return [Unusable(reason=f"not a RAS STATUS JSON report ({what})", cite=cite)]
    comms, skipped = [], 0
    for raw in obj["communicators"]:
        comm = _json_comm(raw) if isinstance(raw, dict) else None
        skipped += comm is None
        if comm is not None:
            comms.append(comm)
    job = []
    ras = obj.get("ras") if isinstance(obj.get("ras"), dict) else {}
    if _int(ras.get("timeouts_count")):
        job.append(
            f"TIMEOUT: Encountered {ras['timeouts_count']} communication timeout(s) while gathering communicator data"
        )
    version = obj.get("nccl_version") if isinstance(obj.get("nccl_version"), str) else None
    events: list[Event] = [
        RasReport(format="json", nccl_version=version, communicators=_attach_job_messages(comms, job), cite=cite)
    ]
    announced = _int(obj.get("communicators_count"))
    if skipped or (announced is not None and announced > len(comms)):
        events.append(
            Unusable(
                reason=f"RAS JSON: {len(comms)} of {announced or len(comms) + skipped} communicators readable",
                cite=cite,
            )
        )
    return events


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json_comm(raw: dict) -> RasCommunicator | None:
    """One JSON communicator; status computed as NCCL's text report would."""
    present = _records(raw.get("ranks"))
    absent = _records(raw.get("missing_ranks"))
    if not present and not absent and "hash" not in raw:
        return None
    ranks = [_json_rank(r) for r in present] + [_json_missing_rank(r) for r in absent]
    errors, messages = set(), []
    lost = [r for r in ranks if r.status in (RAS_MISSING, RAS_DEAD)]
    if lost:
        errors.add("INCOMPLETE")
        messages.append(f"Missing communicator data from {len(lost)} rank{'s' if len(lost) > 1 else ''}")
    words = {_lifecycle(r.get("status")) for r in present} | {"NOCOMM" for r in ranks if r.status == "NOCOMM"}
    if len(words) > 1:
        errors.add("MISMATCH")
        messages.append("Communicator ranks have different status")
    for op in dict.fromkeys(op for r in ranks for op in r.collective_counts):
        # Trap: compare only ranks that report the op; a record cut short by a
        # truncated document lacks some keys, which is not a mismatch.
        if len({r.collective_counts[op] for r in ranks if op in r.collective_counts}) > 1:
            errors.add("MISMATCH")
            messages.append(f"Communicator ranks have different {op} operation counts")
    for r in ranks:
        if r.status and r.status.startswith("ERROR"):
            errors.add("ERROR")
            messages.append(f"Rank {r.rank} reported {r.status.removeprefix('ERROR: ')}")
    status = ",".join(k for k in _ERROR_ORDER if k in errors) or "OK"
    partial = _partial(raw, present, absent)
    if partial:
        status = "PARTIAL" if status == "OK" else f"{status},PARTIAL"
        messages.append(partial)
    return RasCommunicator(
        comm_hash=normalize_comm_hash(raw.get("hash")),
        nranks=_int(raw.get("size")),
        status=status,
        ranks=sorted(ranks, key=lambda r: r.rank),
        messages=messages,
    )


def _records(value: object) -> list[dict]:
    """The rank records of a ``ranks`` / ``missing_ranks`` value of any shape."""
    items = value if isinstance(value, list) else []
    return [r for r in items if isinstance(r, dict) and _int(r.get("rank")) is not None]


def _partial(raw: dict, present: list, absent: list) -> str | None:
    """Why a JSON communicator is incomplete, or None."""
    if not isinstance(raw.get("ranks"), list):
        return "RAS JSON communicator without a rank list"
    want_present, want_absent = _int(raw.get("ranks_count")), _int(raw.get("missing_ranks_count"))
    short = (want_present or 0) > len(present) or (want_absent or 0) > len(absent)
    if not short and not raw.get(_SALVAGED):
        return None
    return (
        f"RAS JSON cut short: {len(present)} of {want_present if want_present is not None else '?'} rank "
        f"records and {len(absent)} of {want_absent if want_absent is not None else '?'} missing-rank records "
        "survived; ranks not listed are unknown, not missing"
    )


def _lifecycle(status: object) -> str:
    """NCCL's per-rank status word from the JSON status object."""
    s = status if isinstance(status, dict) else {}
    if s.get("abort_flag"):
        return "ABORT"
    if s.get("finalize_called") or s.get("destroy_flag"):
        return "FINALIZE"
    return "RUNNING" if s.get("init_state", 0) == 0 else "INIT"


def _json_rank(raw: dict) -> RasRank:
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    word = _lifecycle(status)
    for phase, key in (("initialization", "init_state"), ("asynchronous", "async_error")):
        code = _int(status.get(key))
        if code not in (None, 0, 7):  # 7 = ncclInProgress
            word = f"ERROR: {_NCCL_ERRORS.get(code, 'Unexpected error')} ({phase})"
    counts = raw.get("collective_counts") if isinstance(raw.get("collective_counts"), dict) else {}
    counts = {op: n for op, n in counts.items() if isinstance(op, str) and _int(n) is not None}
    return RasRank(rank=raw["rank"], status=word, collective_counts=counts, **_json_ident(raw))


def _json_missing_rank(raw: dict) -> RasRank:
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    # Trap: a missing rank that *did* answer is not lost: its process no longer
    # considers itself a member (mid-destroy) - NCCL calls that NOCOMM.
    word = RAS_DEAD if status.get("considered_dead") else RAS_MISSING if status.get("unresponsive", True) else "NOCOMM"
    return RasRank(rank=raw["rank"], status=word, **_json_ident(raw))


def _json_ident(raw: dict) -> dict:
    host = raw.get("host")
    pid, cuda = _int(raw.get("pid")), _int(raw.get("cuda_dev"))
    return {
        "host": host if isinstance(host, str) and host not in ("", "unknown") else None,
        "pid": pid if pid is not None and pid >= 0 else None,
        "cuda_dev": cuda,
    }


# --------------------------------------------------------------------------
# Malformed JSON: repair, salvage, or give up
# --------------------------------------------------------------------------


def _parse_json_text(text: str, start: int, name: str, cite: Citation) -> list[Event]:
    """Strict parse, else repair, else salvage rank records, else the text before it."""
    body = text[start:]
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)  # trailing bytes after the document are ignored
        return parse_ras_json(obj, name)
    except ValueError:
        pass
    events, fixes = _parse_repaired(body, name)
    # Trap: a repair that kept no communicator must not pass for an empty,
    # healthy report; fall through to salvage instead.
    if events and isinstance(events[0], RasReport) and events[0].communicators:
        if _TRUNCATED in fixes:
            # The document was cut inside its last communicator: say so there.
            *rest, last = events[0].communicators
            events[0] = events[0].model_copy(update={"communicators": rest + [_mark_partial(last)]})
        note = f"{MALFORMED_JSON_REASON}; repaired ({', '.join(dict.fromkeys(fixes)) or 'no change'})"
        return events + [Unusable(reason=note, cite=cite)]
    salvaged = _salvage_json(body)
    if salvaged["communicators"]:
        events = parse_ras_json(salvaged, name)
        return events + [Unusable(reason=f"{MALFORMED_JSON_REASON}; salvaged rank records only", cite=cite)]
    if _is_text_report(text[:start]):
        events = parse_ras_text(text[:start], name)
        if isinstance(events[0], RasReport):
            return events + [Unusable(reason=f"{MALFORMED_JSON_REASON}; used the text report before it", cite=cite)]
    return [Unusable(reason=MALFORMED_JSON_REASON, cite=cite)]


def _parse_repaired(body: str, name: str) -> tuple[list[Event], list[str]]:
    """``parse_ras_json`` of the repaired document, or ``[]`` when no repair loads.

    Trap: a closer that does not match can be a stray one or stand for missing
    ones; try "close what is open" first, then (only if that met such a
    closer) "drop the stray".
    """
    fixes: list[str] = []
    for mode in ("close", "drop"):
        repaired, fixes = _repair_json(body, mode)
        try:
            return parse_ras_json(json.loads(repaired), name), fixes
        except ValueError:
            if not any("bracket" in f or "stray" in f for f in fixes):
                break  # "drop" would produce the same text
    return [], fixes


_TRAILING_COMMA = re.compile(r",(\s*[\]}])")
_MISSING_COMMA = re.compile(r"([}\]])(\s*)(?=[{\[\"])")
_CLOSER = {"{": "}", "[": "]"}
_TRUNCATED = "closed a truncated document"


def _mark_partial(comm: RasCommunicator) -> RasCommunicator:
    if "PARTIAL" in comm.status:
        return comm
    status = "PARTIAL" if comm.status == "OK" else f"{comm.status},PARTIAL"
    note = "RAS JSON cut short inside this communicator: its last rank record may be incomplete"
    return comm.model_copy(update={"status": status, "messages": comm.messages + [note]})


def _repair_json(body: str, mode: str = "close") -> tuple[str, list[str]]:
    """Lenient fixes for the breakages seen in RAS JSON; returns (text, what was done).

    Trailing commas, missing commas between records, stray or missing closing
    brackets, and truncation (cut back to the last complete value, then close
    what is open).  Anything after the top-level object is dropped.
    """
    fixes = []
    text, n = _TRAILING_COMMA.subn(r"\1", body)
    if n:
        fixes.append(f"removed {n} trailing comma(s)")
    text, n = _MISSING_COMMA.subn(r"\1,\2", text)
    if n:
        fixes.append(f"inserted {n} missing comma(s)")
    out, stack, done, cut = [], [], 0, 0  # cut: end of the last complete value
    for tok in _TOKEN.finditer(text):
        ch = tok.group()
        if ch[0] == '"' and tok.group(1) is None:
            break  # an unterminated string: the document was cut inside it
        out.append(text[done : tok.start()])
        done = tok.end()
        if ch in "}]":
            if ch not in (_CLOSER[b] for b in stack) or (mode == "drop" and _CLOSER[stack[-1]] != ch):
                fixes.append(f"dropped a stray '{ch}'")
                continue
            while _CLOSER[stack[-1]] != ch:  # bad nesting: close what was left open
                out.append(_CLOSER[stack.pop()])
                fixes.append("closed a bracket left open")
            stack.pop()
        elif ch in "{[":
            stack.append(ch)
        out.append(ch)
        if ch in "{[}],":
            cut = len(out)
        if not stack:
            return "".join(out), fixes
    # Every bracket token is a cut point, so the stack at the cut is the stack now.
    kept = "".join(out[:cut]).rstrip().rstrip(",")
    return kept + "".join(_CLOSER[b] for b in reversed(stack)), fixes + [_TRUNCATED]


# A string (group 1 is None when the document ends inside it) or a structural character.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(")?|[{}\[\],]')


_SALVAGED = "__salvaged__"  # marks a communicator rebuilt from loose rank records
_RANK_OBJ = re.compile(r'\{\s*"rank"\s*:')
_COMM_HASH = re.compile(r'"hash"\s*:\s*"(0x[0-9a-fA-F]+)"')
_MISSING_LIST = re.compile(r'"missing_ranks"\s*:\s*\[')
_VERSION = re.compile(r'"nccl_version"\s*:\s*"([^"]*)"')


def _salvage_json(body: str) -> dict:
    """Last resort: decode each ``{"rank": ...}`` record on its own.

    A record goes to the communicator whose ``"hash"`` precedes it, and into
    ``missing_ranks`` when a ``"missing_ranks": [`` lies between the two.
    """
    comms: dict[str | None, dict] = {}
    hashes = [(m.start(), m.group(1)) for m in _COMM_HASH.finditer(body)]
    missing_at = [m.start() for m in _MISSING_LIST.finditer(body)]
    for m in _RANK_OBJ.finditer(body):
        record = _decode_record(body, m.start())
        if record is None:
            continue
        i = bisect.bisect_left(hashes, (m.start(), "")) - 1
        owner_at, owner = hashes[i] if i >= 0 else (-1, None)
        comm = comms.setdefault(owner, {"hash": owner, "ranks": [], "missing_ranks": [], _SALVAGED: True})
        j = bisect.bisect_left(missing_at, m.start()) - 1
        in_missing = j >= 0 and missing_at[j] > owner_at
        comm["missing_ranks" if in_missing else "ranks"].append(record)
    version = _VERSION.search(body)
    for comm in comms.values():  # records before any "hash": a communicator without one
        if comm["hash"] is None:
            del comm["hash"]
    return {"nccl_version": version.group(1) if version else None, "communicators": list(comms.values())}


def _decode_record(body: str, at: int) -> dict | None:
    """The JSON object starting at ``at``, tolerating comma slips inside it."""
    decoder = json.JSONDecoder()
    chunk = body[at : at + 4096]  # a rank record is ~500 bytes
    try:
        record, _ = decoder.raw_decode(chunk)
    except ValueError:
        try:
            record, _ = decoder.raw_decode(_MISSING_COMMA.sub(r"\1,\2", _TRAILING_COMMA.sub(r"\1", chunk)))
        except ValueError:
            return None
    return record if isinstance(record, dict) else None
