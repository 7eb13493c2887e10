"""NCCL debug files (``NCCL_DEBUG=INFO``, subsystems INIT and COLL) -> events.

Every line carries ``host:pid:tid [cudaDev] NCCL INFO|WARN ...``, optionally
behind a timestamp (``NCCL_DEBUG_TIMESTAMP_FORMAT``, 2.26+) or a launcher's
tee prefix (``[rank0]:``).  The prefix names the process, so one file may hold
several processes (a merged job log) and several communicators.

Failure modes, by design: lines that are not NCCL's are skipped; an operation
line cut short by a crash or interleaved with another thread's write is
counted in ``garbled`` and skipped, never raised; a partial last line waits
in the buffer for the next ``feed`` (live tailing) or is dropped at ``final``.

Speed: operation lines are the bulk of a file, so they are matched with one
``findall`` per segment and turned into interned ``OpSig`` objects; no object
is made per line.  Rare lines (init, destroy, warnings) are located with
``bytes.find`` and parsed one by one, and they split the buffer into segments
so that events keep file order (a communicator address can be reused after a
destroy).  Line numbers of operations are not kept: ``locate_op`` finds one
on demand when a verdict cites it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from ..types import (
    Citation,
    CommEnd,
    CommInit,
    CommTopology,
    Event,
    LocalPeerClosed,
    NcclVersion,
    NcclWarning,
    OpBatch,
    OpSig,
    ProcKey,
    WarningCategory,
)

# Optional bracketed prefixes: a timestamp "[2026-04-28 14:14:42] " or a tee
# prefix "[rank0]:" / "[default0]:".
_PREFIX = rb"(?:\[[^\]\n]*\]:? ?)*"
# WARN lines put the source location (and, from 2.29, the function) before "NCCL".
_PROC = rb"([^:\s\[\]]+):(\d+):\d+ \[\d+\] (?:\S+:\d+ (?:\([^)]*\) )?)?NCCL "

# ``count .. root ..`` is one group: interned as bytes, split only once per
# distinct signature.
_OP_RE = re.compile(
    rb"\n" + _PREFIX + rb"([^:\s\[\]]+:\d+):\d+ \[\d+\] NCCL INFO (\w+): opCount \S+ sendbuff \S+ recvbuff \S+ "
    rb"(count \d+ datatype \d+ op \d+ root -?\d+) comm (\S+)"
)
_LINE_HEAD_RE = re.compile(_PREFIX + _PROC + rb"(INFO|WARN) ?(.*)$", re.S)

_MARKERS = (
    b"NCCL WARN",
    b"Init START",
    b"Init COMPLETE",
    b"Destroy COMPLETE",
    b"Abort START",
    b"Abort COMPLETE",
    b"NCCL version",
    b" localRanks ",
    b"Connection closed by localRank",
)

_INIT_RE = re.compile(
    r"(?:(?P<fn>\w+) )?comm (?P<comm>\S+) rank (?P<rank>\d+) nranks (?P<nranks>\d+)"
    r"(?: cudaDev (?P<cuda>-?\d+))?(?: nvmlDev -?\d+)?(?: busId (?P<bus>\w+))?"
    # Split START lines have no space before the dash ("key 0- Init START", 2.27+).
    r"(?P<rest>.*?) ?- Init (?P<phase>START|COMPLETE)"
)
_COMM_ID_RE = re.compile(r"commId (0x[0-9a-fA-F]+)")
_PARENT_RE = re.compile(r"parent (\S+)")
_SPLIT_RE = re.compile(r"(?:splitCount|childCount) (-?\d+)")
_COLOR_RE = re.compile(r"color (-?\d+)")
_KEY_RE = re.compile(r"key (-?\d+)")
_END_RE = re.compile(
    r"comm (?P<comm>\S+) rank (?P<rank>\d+) n[Rr]anks \d+.*? - (?P<kind>Destroy|Abort) (?P<phase>START|COMPLETE)"
)
_TOPO_RE = re.compile(
    r"comm (?P<comm>\S+) rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+) "
    r"localRanks (?P<lranks>\d+) localRank (?P<lrank>\d+)"
)
_VERSION_RE = re.compile(r"NCCL version (\S+)")
_CLOSED_RE = re.compile(r"Connection closed by localRank (\d+)")
_PEER_RE = re.compile(r"(?:peer|from|to|remote) (\S+<\d+>)")

_NETWORK_WORDS = ("NET/", "IB", "ibv_", "socket", "Socket", "Got completion", "remote", "network", "Connection")


class NcclLogParser:
    """Incremental parser for one NCCL debug file (or a merged log)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lines_seen = 0
        self.garbled = 0  # operation records (": opCount ") that did not parse
        self._carry = b""
        self._sigs: dict[tuple[bytes, bytes], OpSig] = {}

    def feed(self, data: bytes, final: bool = False) -> list[Event]:
        """Parse the complete lines in ``carry + data``; keep the partial rest."""
        buf = self._carry + data
        end = len(buf) if final else buf.rfind(b"\n") + 1
        self._carry = b"" if final else buf[end:]
        if end <= 0:
            return []
        # A leading newline lets every pattern anchor on "\n".
        body = b"\n" + buf[:end]
        events: list[Event] = []
        start = 0
        for pos, line_start, line_end in self._rare_lines(body):
            self._ops(body, start, line_start, events)
            event = self._rare(body[line_start + 1 : line_end], self.lines_seen + body.count(b"\n", 0, line_start) + 1)
            if event is not None:
                events.append(event)
            start = line_end
        self._ops(body, start, len(body), events)
        self.lines_seen += body.count(b"\n") - 1 + (0 if body.endswith(b"\n") else 1)
        return events

    # -- operations ------------------------------------------------------

    def _ops(self, body: bytes, start: int, stop: int, out: list[Event]) -> None:
        if stop <= start:
            return
        segment = body[start:stop]
        found = _OP_RE.findall(segment)
        expected = segment.count(b": opCount ")
        self.garbled += expected - len(found)
        if not found:
            return
        sigs = self._sigs
        batches: dict[tuple[bytes, bytes], list[OpSig]] = {}
        for proc, op, fields, comm in found:
            sig = sigs.get((op, fields))
            if sig is None:
                sig = sigs[(op, fields)] = _make_sig(op, fields)
            batch = batches.get((proc, comm))
            if batch is None:
                batch = batches[(proc, comm)] = []
            batch.append(sig)
        for (proc, comm), batch in batches.items():
            host, _, pid = proc.decode(errors="replace").rpartition(":")
            out.append(
                OpBatch.model_construct(
                    proc=ProcKey(host, int(pid)), comm_ptr=comm.decode(errors="replace"), file=self.name, sigs=batch
                )
            )

    # -- rare lines ------------------------------------------------------

    @staticmethod
    def _rare_lines(body: bytes) -> list[tuple[int, int, int]]:
        """Positions of lines holding a rare marker: (hit, line start, line end)."""
        hits: dict[int, tuple[int, int, int]] = {}
        for marker in _MARKERS:
            pos = body.find(marker)
            while pos != -1:
                line_start = body.rfind(b"\n", 0, pos)
                line_end = body.find(b"\n", pos)
                if line_end == -1:
                    line_end = len(body)
                hits.setdefault(line_start, (pos, line_start, line_end))
                pos = body.find(marker, line_end)
        return [hits[k] for k in sorted(hits)]

    def _rare(self, raw: bytes, line_no: int) -> Event | None:
        head = _LINE_HEAD_RE.match(raw)
        if head is None:
            return None
        host, pid, level, rest_b = head.groups()
        proc = ProcKey(host.decode(errors="replace"), int(pid))
        rest = rest_b.decode(errors="replace").rstrip("\r")
        cite = Citation(file=self.name, line=line_no, text=raw.decode(errors="replace")[:400])
        if level == b"WARN":
            return _warning(proc, rest, cite)
        return _info_event(proc, rest, cite)


def _make_sig(op: bytes, fields: bytes) -> OpSig:
    _, count, _, dtype, _, redop, _, root = fields.split(b" ")
    return OpSig(op.decode(), int(count), dtype.decode(), redop.decode(), int(root))


def _info_event(proc: ProcKey, rest: str, cite: Citation) -> Event | None:
    if rest.endswith(("Init START", "Init COMPLETE")):
        return _init_event(proc, rest, cite)
    if m := _END_RE.search(rest):
        return CommEnd(
            proc=proc,
            comm_ptr=m["comm"],
            rank=int(m["rank"]),
            kind="destroy" if m["kind"] == "Destroy" else "abort",
            phase="start" if m["phase"] == "START" else "complete",
            cite=cite,
        )
    if m := _TOPO_RE.search(rest):
        return CommTopology(
            proc=proc,
            comm_ptr=m["comm"],
            rank=int(m["rank"]),
            nranks=int(m["nranks"]),
            nnodes=int(m["nnodes"]),
            local_ranks=int(m["lranks"]),
            local_rank=int(m["lrank"]),
            cite=cite,
        )
    if m := _VERSION_RE.search(rest):
        return NcclVersion(proc=proc, version=m[1], cite=cite)
    if m := _CLOSED_RE.search(rest):
        return LocalPeerClosed(proc=proc, local_rank=int(m[1]), cite=cite)
    return None


def _init_event(proc: ProcKey, rest: str, cite: Citation) -> CommInit | None:
    m = _INIT_RE.search(rest)
    if m is None:
        return None
    extra = m["rest"]

    def _int(pattern: re.Pattern[str]) -> int | None:
        found = pattern.search(extra)
        return int(found[1]) if found else None

    comm_id = _COMM_ID_RE.search(extra)
    parent = _PARENT_RE.search(extra)
    return CommInit(
        proc=proc,
        comm_ptr=m["comm"],
        rank=int(m["rank"]),
        nranks=int(m["nranks"]),
        cuda_dev=int(m["cuda"]) if m["cuda"] else None,
        bus_id=m["bus"],
        comm_id=comm_id[1] if comm_id else None,
        parent_ptr=parent[1] if parent else None,
        split_count=_int(_SPLIT_RE),
        color=_int(_COLOR_RE),
        key=_int(_KEY_RE),
        phase="start" if m["phase"] == "START" else "complete",
        cite=cite,
    )


def _warning(proc: ProcKey, rest: str, cite: Citation) -> NcclWarning:
    if "Cuda failure" in rest or "CUDA" in rest or "cuda" in rest:
        category = WarningCategory.cuda
    elif any(word in rest for word in _NETWORK_WORDS):
        category = WarningCategory.network
    elif "system error" in rest or "errno" in rest:
        category = WarningCategory.system
    else:
        category = WarningCategory.other
    peer = _PEER_RE.search(rest)
    return NcclWarning(proc=proc, category=category, message=rest.strip(), peer=peer[1] if peer else None, cite=cite)


def looks_like_nccl_log(head: bytes) -> bool:
    """True when the first lines look like NCCL debug output."""
    return b" NCCL INFO " in head or b" NCCL WARN " in head


def iter_op_lines(data: bytes) -> Iterator[tuple[int, ProcKey, str, OpSig]]:
    """Every operation line with its 1-based line number (slow path, for citations)."""
    body = b"\n" + data
    line = 0
    last = 0
    for m in _OP_RE.finditer(body):
        line += body.count(b"\n", last, m.start() + 1)
        last = m.start() + 1
        proc, op, fields, comm = m.groups()
        host, _, pid = proc.decode(errors="replace").rpartition(":")
        yield line, ProcKey(host, int(pid)), comm.decode(errors="replace"), _make_sig(op, fields)
