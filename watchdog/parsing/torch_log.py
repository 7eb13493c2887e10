"""PyTorch worker logs and torchrun's console output -> events, streamed.

What in these files names a culprit without any NCCL file, each in every
format that shipped (from ProcessGroupNCCL.cpp, ProcessGroupWrapper.cpp and
torch.distributed.elastic):

- the watchdog's timeout: ``[Rank r] Watchdog caught collective operation
  timeout: WorkNCCL(SeqNum=s, OpType=OP[, NumelIn=n, NumelOut=m], Timeout(ms)=t)
  ran for e milliseconds before timing out.``
- where the group stood: ``[PG ID i PG GUID g(name) Rank r] failure detected
  by watchdog at work sequence id: s PG status: last enqueued work: e, last
  completed work: c`` (2.4+); ``Timeout at NCCL work: s, last enqueued NCCL
  work: e, last completed NCCL work: c`` (2.2-2.3); ``... detected by watchdog
  at work: s, last enqueued NCCL work: e, ...``; and on ranks that did not time
  out, ``Received a dump signal due to a collective timeout from rank k ...
  Last enqueued NCCL work: e, last completed NCCL work: c``.  The timeout line
  itself carries no group id from 2.4 on: the failure line of the same rank
  and sequence number gives it (``hang.partial`` pairs them).
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: ``Detected mismatch between collectives
  on ranks. Rank r is running collective: CollectiveFingerPrint(...), but Rank
  i is running collective: CollectiveFingerPrint(...)``.
- torchrun's ``ChildFailedError`` table: which rank exited, with what code.
- network and peer errors (``net_errors``).

Streaming, like ``NcclLogParser``: lines holding a marker are found with
``bytes.find`` per chunk and parsed one by one, so a 1 GB log costs a few
scans in C and memory stays one chunk.  PyTorch repeats its messages (the log
line, then the exception text, then the traceback), so each fact is emitted
once.  Lines that match no pattern are ignored.
"""

from __future__ import annotations

import re

from ncclwatch.watchdog.events import (
    Citation,
    CollectiveFingerprint,
    Event,
    PgStatus,
    WatchdogTimeout,
    WorkerFailure,
)
from ncclwatch.watchdog.parsing import net_errors
from ncclwatch.watchdog.parsing.line_prefix import TAG_RE
from ncclwatch.watchdog.parsing.rank_prefix import rank_of_line

_TIMEOUT_MARK = b"Watchdog caught collective operation timeout"
_TORCH_MARKERS = (
    _TIMEOUT_MARK,
    b"detected by watchdog at work",  # "failure detected by watchdog at work sequence id", 2.2's "at work: s"
    b"Timeout at NCCL work",
    b"Received a dump signal",
    b"Received a global timeout",
    b"Detected mismatch between collectives",
    b"ChildFailedError",
    b"Root Cause (first observed failure)",
    b"(local_rank:",
    b"exitcode",
)
MARKERS = _TORCH_MARKERS + net_errors.MARKERS
# Sniffing: a file holding any of these is worth a PyTorch pass.
SNIFF_MARKERS = (
    _TIMEOUT_MARK,
    b"ChildFailedError",
    b"Detected mismatch between collectives",
    b"PG status:",
    b"Last enqueued NCCL work",
)

_PG_PREFIX_RE = re.compile(
    r"\[PG (?:ID )?(?P<pgid>\d+)(?: PG GUID (?P<guid>[^\s(\]]+))?\s*(?:\((?P<desc>[^)]*)\))?\s*Rank (?P<rank>\d+)\]"
)
_RANK_PREFIX_RE = re.compile(r"\[Rank (?P<rank>\d+)\]")
_TIMEOUT_RE = re.compile(
    r"Watchdog caught collective operation timeout: "
    r"Work\w*\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
    r"(?:, NumelIn=(?P<nin>-?\d+))?(?:, NumelOut=(?P<nout>-?\d+))?(?:, Timeout\(ms\)=(?P<tmo>\d+))?\)"
    r"(?: ran for (?P<ran>\d+) milliseconds)?"
)
_FAILURE_RE = re.compile(r"detected by watchdog at work(?: sequence id)?: (?P<seq>\d+)")
_OLD_TIMEOUT_RE = re.compile(r"Timeout at NCCL work: (?P<seq>\d+)")
_ENQUEUED_RE = re.compile(r"last enqueued (?:NCCL )?work: (-?\d+)", re.IGNORECASE)
_STARTED_RE = re.compile(r"last started (?:NCCL )?work: (-?\d+)", re.IGNORECASE)
_COMPLETED_RE = re.compile(r"last completed (?:NCCL )?work: (-?\d+)", re.IGNORECASE)
_SIGNAL_RE = re.compile(
    r"Received a (?:dump signal|global timeout)(?: due to a collective timeout)? from (?P<src>.+?) and "
)
_MISMATCH_RE = re.compile(
    r"Detected mismatch between collectives on ranks\. Rank (?P<rank>\d+) is running (?:inconsistent )?collective: "
)
_OTHER_RE = re.compile(r", but Rank (?P<rank>\d+) is running (?:inconsistent )?collective: ")
_FP_SEQ_RE = re.compile(r"SequenceNumber=(\d+)")
_FP_OP_RE = re.compile(r"OpType=(\w+)")
_FP_SHAPE_RE = re.compile(r"TensorShape=\[([^\]]*)\]")
_FP_DTYPE_RE = re.compile(r"TensorDtypes=([\w, ]+?)(?:, TensorDeviceTypes|\))")
_TABLE_RANK_RE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)(?: \(local_rank: (?P<lrank>\d+)\))?")
_TABLE_HOST_RE = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)")
_TABLE_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?")


class TorchLogParser:
    """Incremental parser for one text file: PyTorch's diagnostics and network errors."""

    def __init__(self, name: str, file_rank: int | None = None) -> None:
        self.name = name
        self.file_rank = file_rank
        self.lines_seen = 0
        self.lines_used = 0
        self._carry = b"\n"
        self._seen: set[tuple] = set()
        self._root_cause = False
        # Per stream (``line_prefix``'s tag, "" untagged): rank, local rank, host of the table row being read.
        self._table: dict[str, tuple[int, int | None, str | None]] = {}

    def feed(self, data: bytes, final: bool = False) -> list[Event]:
        # As in NcclLogParser: the carry starts with the previous line's "\n",
        # so every line starts at a "\n" and counting them numbers the lines.
        body = self._carry + data
        if final:
            stop = len(body) - 1 if body.endswith(b"\n") else len(body)
            self._carry = b"\n"
        else:
            stop = body.rfind(b"\n")
            self._carry = body[stop:]
        return self.scan(body, stop)

    def skip(self, lines: int) -> None:
        """``lines`` lines went by that hold no marker (``inputs.TextIngest`` knows it from the NCCL parser)."""
        self.lines_seen += lines

    def scan(self, body: bytes, stop: int | None = None) -> list[Event]:
        """The lines in body[:stop], each after a "\n" (``NcclLogParser.scanned``'s shape); no carry kept."""
        stop = len(body) if stop is None else stop
        events: list[Event] = []
        line_no, counted_to = self.lines_seen, 0
        for start, end in _marker_lines(body, stop):
            line_no += body.count(b"\n", counted_to, start + 1)
            counted_to = start + 1
            previous = body[body.rfind(b"\n", 0, start) + 1 : start] if start > 0 else b""
            text = body[start + 1 : end].decode(errors="replace").rstrip("\r")
            stream = TAG_RE.match(text)
            if stream is not None:  # a combined file: this line's stream is its tag, its previous line the stream's
                text = text[stream.end() :]
                previous = _previous_in_stream(body, start, stream[0].encode())
            produced = self._line(text, line_no, previous.decode(errors="replace"), stream[0] if stream else "")
            if produced:
                self.lines_used += 1
                events.extend(produced)
        self.lines_seen += body.count(b"\n", 0, stop)
        return events

    def _line(self, text: str, line_no: int, previous: str, stream: str = "") -> list[Event]:
        cite = Citation(file=self.name, line=line_no, text=text.strip()[:400])
        prefixed = rank_of_line(text)
        line_rank = prefixed[0] if prefixed and prefixed[1].startswith("[rankN]") else None
        if "ChildFailedError" in text or text.strip() == "Failures:":
            self._root_cause = False
        if "Root Cause (first observed failure)" in text:
            self._root_cause = True
            return []
        if (m := _TABLE_RANK_RE.match(text)) is not None:
            host = _TABLE_HOST_RE.match(previous)
            self._table[stream] = (int(m["rank"]), _opt_int(m["lrank"]), host["host"] if host else None)
            return []
        if (m := _TABLE_EXIT_RE.match(text)) is not None and stream in self._table:
            rank, local_rank, host = self._table.pop(stream)
            return self._once(
                ("failure", rank, self._root_cause),
                WorkerFailure(
                    rank=rank,
                    local_rank=local_rank,
                    exitcode=int(m["code"]),
                    pid=_opt_int(m["pid"]),
                    host=host,
                    root_cause=self._root_cause,
                    cite=cite,
                ),
            )
        pg = _PG_PREFIX_RE.search(text)
        plain = _RANK_PREFIX_RE.search(text) if pg is None else None
        rank = (
            int(pg["rank"])
            if pg
            else int(plain["rank"])
            if plain
            else line_rank
            if line_rank is not None
            else self.file_rank
        )
        pg_key = (pg["guid"] or pg["pgid"]) if pg else None
        events = self._torch_line(text, rank, pg_key, pg["desc"] if pg else None, cite)
        if events is not None:
            return events
        error = net_errors.parse_network_line(text, self.name, line_no, rank)
        if error is not None:
            return self._once(("net", error.kind, error.rank, error.peer, error.status, error.proc), error)
        return []

    def _torch_line(
        self, text: str, rank: int | None, pg: str | None, desc: str | None, cite: Citation
    ) -> list[Event] | None:
        """PyTorch's own diagnostics; None when the line is none of them."""
        if (m := _MISMATCH_RE.search(text)) is not None:
            return self._fingerprints(text, m, cite)
        if rank is None:
            return None
        if (m := _TIMEOUT_RE.search(text)) is not None:
            return self._once(
                ("timeout", rank, pg, int(m["seq"]), m["op"]),
                WatchdogTimeout(
                    rank=rank,
                    seq=int(m["seq"]),
                    op=m["op"],
                    numel_in=_opt_int(m["nin"]),
                    numel_out=_opt_int(m["nout"]),
                    timeout_ms=_opt_int(m["tmo"]),
                    ran_ms=_opt_int(m["ran"]),
                    pg=pg,
                    pg_desc=desc,
                    cite=cite,
                ),
            )
        kind, seq, source = None, None, None
        if (m := _FAILURE_RE.search(text)) is not None:
            kind, seq = "failure", int(m["seq"])
        elif (m := _OLD_TIMEOUT_RE.search(text)) is not None:
            kind, seq = "timeout", int(m["seq"])
        elif (m := _SIGNAL_RE.search(text)) is not None:
            kind, source = "dump_signal", " ".join(m["src"].split())
        if kind is None:
            return None
        enqueued, started, completed = (_search_int(r, text) for r in (_ENQUEUED_RE, _STARTED_RE, _COMPLETED_RE))
        status = PgStatus(
            rank=rank,
            pg=pg,
            pg_desc=desc,
            kind=kind,
            seq=seq,
            last_enqueued=enqueued,
            last_started=started,
            last_completed=completed,
            signal_from=source,
            cite=cite,
        )
        return self._once(("status", rank, pg, kind, seq, enqueued, completed), status)

    def _fingerprints(self, text: str, m: re.Match[str], cite: Citation) -> list[Event]:
        reporter = int(m["rank"])
        rest = text[m.end() :]
        other = _OTHER_RE.search(rest)
        sides = [(reporter, True, rest[: other.start()] if other else rest)]
        if other is not None:
            sides.append((int(other["rank"]), False, rest[other.end() :]))
        events: list[Event] = []
        for rank, self_report, part in sides:
            op = _FP_OP_RE.search(part)
            if op is None:
                continue
            seq, shape, dtype = _FP_SEQ_RE.search(part), _FP_SHAPE_RE.search(part), _FP_DTYPE_RE.search(part)
            fingerprint = CollectiveFingerprint(
                rank=rank,
                reported_by=reporter,
                self_report=self_report,
                seq=int(seq[1]) if seq else None,
                op=op[1],
                shapes=shape[1] if shape else None,
                dtypes=dtype[1].strip() if dtype else None,
                cite=cite,
            )
            events += self._once(
                ("fp", rank, reporter, fingerprint.seq, fingerprint.op, fingerprint.shapes), fingerprint
            )
        return events

    def _once(self, key: tuple, event: Event) -> list[Event]:
        if key in self._seen:
            return []
        if len(self._seen) < 100_000:  # bounded: past this, repeats are emitted again
            self._seen.add(key)
        return [event]


def _marker_lines(body: bytes, stop: int) -> list[tuple[int, int]]:
    """(start "\\n", end) of each line in body[:stop] holding a marker, in order."""
    hits: dict[int, int] = {}
    for marker in MARKERS:
        pos = body.find(marker, 0, stop)
        while pos != -1:
            start = body.rfind(b"\n", 0, pos)
            end = body.find(b"\n", pos, stop)
            end = stop if end == -1 else end
            hits[start] = end
            pos = body.find(marker, end, stop)
    return sorted(hits.items())


def _previous_in_stream(body: bytes, start: int, tag: bytes, within: int = 64) -> bytes:
    """The line before body[start] of the stream ``tag`` (looked for in the ``within`` lines before), less its tag."""
    end = start
    for _ in range(within):
        if end <= 0:
            break
        begin = body.rfind(b"\n", 0, end) + 1
        if body.startswith(tag, begin):
            return body[begin + len(tag) : end]
        end = begin - 1
    return b""


def _opt_int(value: str | None) -> int | None:
    return int(value) if value is not None else None


def _search_int(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return int(m[1]) if m else None


def looks_like_torch_log(head: bytes) -> bool:
    return any(marker in head for marker in SNIFF_MARKERS)


def parse_torch_log(data: bytes, name: str) -> list[Event]:
    """A whole text at once (tests, small files); ``TorchLogParser`` streams."""
    parser = TorchLogParser(name)
    return parser.feed(data) + parser.feed(b"", final=True)
