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
from itertools import compress

from ncclwatch.watchdog.events import (
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
    rb"(count \d+ datatype \d+ op \d+ root -?\d+ comm \S+)"
)
# When every line of a segment starts with the same "host:pid:" (one
# process per file, the normal NCCL_DEBUG_FILE case) a pattern that starts
# with a literal is twice as fast: the regex engine skips to it.
_OP_FAST_RE = re.compile(
    rb"INFO (\w+): opCount [^ ]+ sendbuff [^ ]+ recvbuff [^ ]+ (count \d+ datatype \d+ op \d+ root -?\d+ comm [^ \n]+)"
)
_PROC_ANY_RE = re.compile(rb"([^:\s\[\]]+:\d+):\d+ \[\d+\] ")


def _single_process(body: bytes, start: int, stop: int) -> bytes | None:
    """The "host:pid" of every NCCL line in body[start:stop], or None if there are several.

    Counted, not anchored at line starts: timestamps and tee prefixes do not
    matter.  A segment with lines of no process at all (the empty line NCCL
    prints before a WARN, another program's output) takes the general path.
    """
    first = _PROC_ANY_RE.search(body, start, stop)
    if first is None:
        return None
    same = body.count(first[1] + b":", start, stop)
    return first[1] if same == body.count(b"\n", start, stop) else None


_P2P = frozenset({b"Send", b"Recv"})
_LINE_HEAD_RE = re.compile(_PREFIX + _PROC + rb"(INFO|WARN) ?(.*)$", re.DOTALL)

# Each is a full scan of the buffer (fast, in C), so the list is short and
# the markers broad: "- " is in every Init/Destroy/Abort line (and in no
# operation line), "localRank" in the topology and "Connection closed" lines.
# Lines they catch that matter not are dropped by ``_rare``.
_MARKERS = (b"- ", b"NCCL WARN", b"localRank")
# The version line is a process's first: looked for until one is seen.
_VERSION_MARKER = b"NCCL version"

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
        self.version_seen = False
        self._carry = b"\n"
        self._interners: dict[bytes | None, _Interner] = {}

    def feed(self, data: bytes, final: bool = False) -> list[Event]:
        """Parse the complete lines in ``carry + data``; keep the partial rest."""
        # The carry always starts with the previous line's "\n", so every
        # line, the first included, starts at a "\n" the patterns anchor on.
        body = self._carry + data
        last_newline = body.rfind(b"\n")
        if final:
            stop = len(body) - 1 if body.endswith(b"\n") else len(body)
            self._carry = b"\n"
        else:
            stop = last_newline
            self._carry = body[last_newline:]
        if stop <= 0:
            return []
        events: list[Event] = []
        start = 0
        line_no, counted_to = self.lines_seen, 0
        for line_start, line_end in self._rare_lines(body, stop):
            self._ops(body, start, line_start, events)
            line_no += body.count(b"\n", counted_to, line_start + 1)
            counted_to = line_start + 1
            event = self._rare(body[line_start + 1 : line_end], line_no)
            if event is not None:
                events.append(event)
                self.version_seen = self.version_seen or isinstance(event, NcclVersion)
            start = line_end
        self._ops(body, start, stop, events)
        self.lines_seen += body.count(b"\n", 0, stop)
        return events

    # -- operations ------------------------------------------------------

    def _ops(self, body: bytes, start: int, stop: int, out: list[Event]) -> None:
        """Operations of the lines in body[start:stop] (``start`` is a line's "\n")."""
        if stop <= start:
            return
        single = _single_process(body, start, stop)
        found = (_OP_FAST_RE if single else _OP_RE).findall(body, start, stop)
        self.garbled += body.count(b": opCount ", start, stop) - len(found)
        if not found:
            return
        # Column-wise: one dict lookup per line interns it, then map and
        # compress split the ids by (process, communicator, kind), all in C.
        interner = self._interner(single)
        ids = list(map(interner.__getitem__, found))
        sigs = list(map(interner.sigs.__getitem__, ids))
        buckets = list(map(interner.buckets.__getitem__, ids))
        present = dict.fromkeys(buckets)  # first-appearance order
        batches: dict[tuple[bytes, bytes], tuple[list[OpSig], list[OpSig]]] = {}
        for bucket in present:
            proc, comm, is_p2p = interner.bucket_keys[bucket]
            mine = sigs if len(present) == 1 else list(compress(sigs, map(bucket.__eq__, buckets)))
            batches.setdefault((proc, comm), ([], []))[is_p2p].extend(mine)
        for (proc, comm), (coll, p2p) in batches.items():
            host, _, pid = proc.decode(errors="replace").rpartition(":")
            out.append(
                OpBatch.model_construct(
                    proc=ProcKey(host, int(pid)),
                    comm_ptr=comm.decode(errors="replace"),
                    file=self.name,
                    sigs=coll,
                    p2p=p2p,
                )
            )

    def _interner(self, single: bytes | None) -> _Interner:
        table = self._interners.get(single)
        if table is None or len(table) > _MAX_INTERNED:
            table = self._interners[single] = _Interner(single)
        return table

    # -- rare lines ------------------------------------------------------

    def _rare_lines(self, body: bytes, stop: int) -> list[tuple[int, int]]:
        """(line start, line end) of the lines in body[:stop] holding a rare marker."""
        hits: dict[int, int] = {}
        markers = _MARKERS if self.version_seen else (*_MARKERS, _VERSION_MARKER)
        for marker in markers:
            pos = body.find(marker, 0, stop)
            while pos != -1:
                line_start = body.rfind(b"\n", 0, pos)
                line_end = body.find(b"\n", pos, stop)
                if line_end == -1:
                    line_end = stop
                hits[line_start] = line_end
                pos = body.find(marker, line_end, stop)
        return sorted(hits.items())

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


_MAX_INTERNED = 100_000  # distinct (op, sizes, comm) keys before a table starts over


class _Interner(dict[tuple[bytes, ...], int]):
    """Operation line fields -> a small id; ids index ``sigs`` and ``buckets``.

    Keys are ``(op, "count .. comm ..")`` for a single-process segment (the
    process is the table's) or ``(proc, op, tail)``.  A training job has a
    few hundred distinct keys, so one lookup per line replaces all per-line
    parsing.  A bucket is one (process, communicator, is p2p) stream.
    """

    def __init__(self, proc: bytes | None) -> None:
        super().__init__()
        self.proc = proc
        self.sigs: list[OpSig] = []
        self.buckets: list[int] = []
        self.bucket_keys: list[tuple[bytes, bytes, bool]] = []
        self._bucket_of: dict[tuple[bytes, bytes, bool], int] = {}

    def __missing__(self, key: tuple[bytes, ...]) -> int:
        proc, op, tail = key if len(key) == 3 else (self.proc, *key)
        fields, _, comm = tail.rpartition(b" comm ")
        bucket_key = (proc, comm, op in _P2P)
        bucket = self._bucket_of.setdefault(bucket_key, len(self.bucket_keys))
        if bucket == len(self.bucket_keys):
            self.bucket_keys.append(bucket_key)
        index = self[key] = len(self.sigs)
        self.sigs.append(_make_sig(op, fields))
        self.buckets.append(bucket)
        return index


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


def iter_op_lines(data: bytes) -> Iterator[tuple[int, str, ProcKey, str, OpSig]]:
    """Every operation line: 1-based number, text, process, comm (slow path, for citations)."""
    body = b"\n" + data
    line = 0
    last = 0
    for m in _OP_RE.finditer(body):
        line += body.count(b"\n", last, m.start() + 1)
        last = m.start() + 1
        proc, op, tail = m.groups()
        fields, _, comm = tail.rpartition(b" comm ")
        host, _, pid = proc.decode(errors="replace").rpartition(":")
        end = body.find(b"\n", last)
        text = body[last : end if end != -1 else None].decode(errors="replace")[:400]
        yield line, text, ProcKey(host, int(pid)), comm.decode(errors="replace"), _make_sig(op, fields)
