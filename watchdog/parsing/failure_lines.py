"""A dying job's stderr -> why each rank failed (``RankFailure``), how it exited (``RankExited``), ``JobEnded``.

Read live (the wrapper relays the job's stderr line by line) and offline (``analyze`` on torchrun's output
saved to a file): the same reader, fed chunks cut anywhere.  What explains a death, as the programs print it:

- PyTorch's watchdog: ``[rank3]:[E...] [PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective
  operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...)`` (``torch_log``'s pattern, reused);
- NCCL's errors, bare in its WARN lines or repeated in PyTorch's exception: ``message truncated``, ``collective
  mismatch error`` (``net_errors``), ``remote process exited``, ``ncclRemoteError``, ``invalid usage``;
- gloo's: ``Received data size doesn't match expected size`` (an enforce failure, printed by C++'s ``terminate``
  without torch's rank prefix), ``Connection closed by peer``, ``Connection reset by peer``, ``Timed out waiting
  3000ms for recv operation``;
- CUDA errors and CUDA out of memory;
- Python tracebacks: the exception's type and message, and the innermost frame in the user's code;
- torchrun's ``ChildFailedError`` summary: per failure its rank, host, exit code, signal, time and pid, and which
  was the ``Root Cause (first observed failure)``; its root cause's row says the job failed (``JobEnded``).

Lines keep their ``[rankN]:`` / ``[defaultN]:`` prefix (torchrun ``--tee``) or ``line_prefix``'s tags; each
prefix is one stream, so two ranks' tracebacks printed at once are read apart.  Pure and never raises: a line
of no known shape is skipped.  Fast: a chunk holding no marker costs one ``bytes.find`` per marker.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ncclwatch.watchdog.events import Citation, Event, FailureKind, JobEnded, JobOutcome, RankExited, RankFailure
from ncclwatch.watchdog.parsing import net_errors
from ncclwatch.watchdog.parsing.line_prefix import TAG_RE
from ncclwatch.watchdog.parsing.rank_prefix import rank_of_line
from ncclwatch.watchdog.parsing.torch_log import _TIMEOUT_RE as WATCHDOG_TIMEOUT_RE

# A chunk holding none of these holds nothing for this reader.
MARKERS = (
    b"Traceback (most recent call last)",
    b"Error",
    b"error",
    b"exitcode",
    b"Root Cause",
    b"imed out",
    b"EnforceNotMet",
    b"enforce fail",
    b"Connection closed by peer",
    b"Connection reset by peer",
    b"Watchdog caught collective operation timeout",
    b"out of memory",
    *net_errors.MARKERS,
)

# What tells ``inputs``' NCCL fast path that a chunk holds lines for this reader (narrower than ``MARKERS``: a
# watched marker makes the chunk's residual text be scanned).
WATCH = (
    b"Traceback (most recent call last)",
    b"Error: ",
    b"exitcode",
    b"enforce fail",
    b"imed out",
    b"CUDA error",
    b"out of memory",
)

_PREFIX_RE = re.compile(r"^(?:\[[A-Za-z_ ]+[^\]\n]*\]: ?|\d+: )")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# The line that ends a traceback: "ValueError: msg", "torch.distributed.DistBackendError: NCCL error ...", "KeyError".
_RAISED_RE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|NotMet|Failure)\w*)(?::\s?(?P<msg>.*))?$"
)
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/torch/", "<string>")
_TABLE_RANK_RE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)(?: \(local_rank: (?P<lrank>\d+)\))?")
_TABLE_HOST_RE = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)")
_TABLE_TIME_RE = re.compile(r"^\s*time\s*:\s*(?P<time>\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d)")
_TABLE_EXIT_RE = re.compile(
    r"^\s*exitcode\s*:\s*(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?\s*(?:\((?P<signal>SIG[A-Z0-9]+)\))?"
)
_GLOO_TIMEOUT_RE = re.compile(r"Timed out waiting (?P<ms>\d+)ms for (?P<what>\w+) operation")
# What a message says, in order: the first that matches classifies it.  (kind, pattern)
_CAUSES: tuple[tuple[FailureKind, re.Pattern[str]], ...] = (
    (FailureKind.out_of_memory, re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")),
    (
        FailureKind.size_mismatch,
        re.compile(r"Received data size doesn't match expected size|message truncated|collective mismatch error"),
    ),
    (
        FailureKind.collective_timeout,
        re.compile(r"Watchdog caught collective operation timeout|Timed out waiting \d+ms for \w+ operation"),
    ),
    (
        FailureKind.peer_gone,
        re.compile(
            r"Connection closed by (?:remote )?peer|Connection reset by peer|remote process exited|ncclRemoteError"
        ),
    ),
    (FailureKind.cuda_error, re.compile(r"CUDA error|CUDA kernel errors|device-side assert|illegal memory access")),
    (
        FailureKind.nccl_error,
        re.compile(
            r"NCCL error|invalid usage|ncclInvalidUsage|ncclInternalError|ncclSystemError|ncclUnhandledCudaError"
        ),
    ),
)
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
_KEEP_FRAMES = 64  # a traceback's frames kept per stream (a deep recursion prints a thousand)


def classify(message: str) -> FailureKind | None:
    """The cause a message names, or None (then it is an ordinary exception, where it ended a traceback)."""
    for kind, pattern in _CAUSES:
        if pattern.search(message):
            return kind
    return None


def is_library(path: str) -> bool:
    """A frame of torch, the standard library or an installed package: not the user's code."""
    return any(part in path for part in _LIBRARY_PARTS)


@dataclass
class _Stream:
    """One prefix's lines: the traceback being read, and torchrun's summary row being read."""

    frames: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, function), outermost first
    in_traceback: bool = False
    row: dict[str, str] = field(default_factory=dict)  # torchrun's summary: time, host, rank, local rank


class FailureLines:
    """Incremental reader of one text (a job's stderr, torchrun's console): ``feed`` chunks, get events.

    ``file_rank``: the rank the whole text belongs to (a per-rank log), for lines without a prefix.
    ``clock``: the time a line is stamped with where it prints none (live: now; offline: None).
    """

    def __init__(self, name: str, file_rank: int | None = None, clock: bool = False) -> None:
        self.name = name
        self.file_rank = file_rank
        self.clock = clock
        self.lines_seen = 0
        self.lines_used = 0
        self._carry = b""
        self._streams: dict[str, _Stream] = {}
        self._root_cause = False
        self._in_summary = False  # between torchrun's ChildFailedError and the rule closing its root cause
        self._seen: set[tuple] = set()
        self._current = ""

    def feed(self, data: bytes, final: bool = False) -> list[Event]:
        body = self._carry + data
        cut = len(body) if final else body.rfind(b"\n") + 1
        self._carry = body[cut:]
        return self.scan(body[:cut])

    def skip(self, lines: int) -> None:
        """``lines`` lines went by that hold no marker (a caller that knows it): no traceback spans them."""
        self.lines_seen += lines
        for stream in self._streams.values():
            stream.in_traceback = False

    def scan(self, text: bytes) -> list[Event]:
        """Whole lines (a final line without "\\n" is taken as whole); no carry kept."""
        if not text:
            return []
        reading = self._in_summary or any(stream.in_traceback for stream in self._streams.values())
        if not reading and not any(marker in text for marker in MARKERS):
            self.lines_seen += text.count(b"\n") + (not text.endswith(b"\n"))
            return []
        events: list[Event] = []
        for raw in text.decode(errors="replace").splitlines():
            self.lines_seen += 1
            produced = self._line(raw.rstrip("\r"))
            if produced:
                self.lines_used += 1
                events += produced
        return events

    def _line(self, line: str) -> list[Event]:
        self._current = line  # cited whole, prefixes and all
        key, rank, text = self._split(line)
        stream = self._streams.get(key) or self._streams.setdefault(key, _Stream())
        if stream.in_traceback:
            ended = self._traceback_line(stream, text, rank)
            if ended is not None:
                return ended
        if text.startswith("Traceback (most recent call last)"):
            stream.in_traceback, stream.frames = True, []
            return []
        table = self._summary_line(stream, text)
        if table is not None:
            return table
        return self._single_line(text, rank)

    def _split(self, line: str) -> tuple[str, int | None, str]:
        """(stream key, rank the prefix gives, the text after the prefixes)."""
        key, rank, text = "", self.file_rank, line
        while (m := TAG_RE.match(text) or _PREFIX_RE.match(text)) is not None:
            prefix = m[0]
            said = rank_of_line(prefix)
            if said is not None and said[1].startswith("[rankN]"):
                rank = said[0]
            elif said is not None and rank is None:
                rank = said[0]  # torchrun --tee's local rank, or srun's task: where nothing better is said
            key += prefix.strip()
            text = text[m.end() :]
        return key, rank, text

    def _traceback_line(self, stream: _Stream, text: str, rank: int | None) -> list[Event] | None:
        """A line inside a traceback: None where it goes on, the events where it ended it."""
        if (m := _FRAME_RE.match(text)) is not None:
            if len(stream.frames) >= _KEEP_FRAMES:
                del stream.frames[1]  # keep the outermost and the innermost
            stream.frames.append((m["file"], int(m["line"]), m["func"]))
            return None
        if text[:1].isspace() or not text.strip():
            return None  # the source line under a frame, its carets, or a blank line
        stream.in_traceback = False
        m = _RAISED_RE.match(text.strip())
        if m is None:
            return []  # no exception line where one was due: the traceback was cut
        message = m["msg"] or ""
        error_type = m["type"]
        if error_type.startswith("torch.distributed.elastic.") or error_type.endswith("ChildFailedError"):
            return []  # torchrun's own traceback (before its summary, or a signal it got): no rank's failure
        kind = classify(message) or (FailureKind.out_of_memory if "OutOfMemory" in error_type else None)
        user = [f for f in stream.frames if not is_library(f[0])]
        frame = user[-1] if user else None
        own = bool(stream.frames) and not is_library(stream.frames[-1][0])
        failure = self._failure(
            rank,
            kind or FailureKind.exception,
            f"{error_type}: {message}" if message else error_type,
            text,
            error_type=error_type,
            frame=f"{frame[2]} ({frame[0].rsplit('/', 1)[-1]}:{frame[1]})" if frame else None,
            own_code=own and kind is None,
            seq_op=_timeout_of(message),
        )
        return self._once(("raised", rank, error_type, message[:200]), failure)

    def _summary_line(self, stream: _Stream, text: str) -> list[Event] | None:
        """torchrun's ``ChildFailedError`` summary: None where the line is not part of it."""
        if "ChildFailedError" in text:
            self._root_cause, self._in_summary = False, True
            return []
        if self._root_cause and text.startswith("====="):
            self._in_summary = False
            return []
        if text.strip() == "Failures:":
            self._root_cause = False
            return []
        if text.startswith("Root Cause (first observed failure)"):
            self._root_cause = True
            return []
        if (m := _TABLE_TIME_RE.match(text)) is not None:
            stream.row = {"time": m["time"]}
            return []
        if (m := _TABLE_HOST_RE.match(text)) is not None:
            stream.row["host"] = m["host"]
            return []
        if (m := _TABLE_RANK_RE.match(text)) is not None:
            stream.row.update(rank=m["rank"], local_rank=m["lrank"] or "")
            return []
        if (m := _TABLE_EXIT_RE.match(text)) is not None and "rank" in stream.row:
            row, stream.row = stream.row, {}
            exited = RankExited(
                rank=int(row["rank"]),
                local_rank=int(row["local_rank"]) if row.get("local_rank") else None,
                host=row.get("host"),
                pid=int(m["pid"]) if m["pid"] else None,
                exitcode=int(m["code"]),
                signal=m["signal"],
                root_cause=self._root_cause,
                at=_summary_time(row.get("time")),
                cite=self._cite(),
            )
            events = self._once(("exited", exited.rank, self._root_cause), exited)
            if self._root_cause and exited.at is not None:
                # The summary is torchrun's last word: it raises ChildFailedError, so it exits 1, at about that time.
                # A first failure by SIGTERM, SIGINT or SIGHUP was sent from outside (the user, a scheduler, or
                # ncclwatch ending a hung job): stopped, not failed.
                outcome = JobOutcome.stopped if exited.signal in _STOP_SIGNALS else JobOutcome.failed
                events += self._once(("ended",), JobEnded(outcome=outcome, returncode=1, at=exited.at))
            return events
        return None

    def _single_line(self, text: str, rank: int | None) -> list[Event]:
        """A line that says a cause by itself: NCCL's WARNs and errors, PyTorch's watchdog, gloo, CUDA."""
        kind = classify(text)
        if kind is None:
            return []
        error = net_errors.parse_network_line(text, self.name, self.lines_seen, rank)
        if rank is None and error is not None:
            rank = error.rank
        pid = error.proc.pid if error is not None and error.proc is not None else None
        host = error.proc.host if error is not None and error.proc is not None else None
        detail = text.strip()
        if "what():" in detail:
            detail = detail.split("what():", 1)[1].strip()
        failure = self._failure(rank, kind, detail, text, pid=pid, host=host, seq_op=_timeout_of(text))
        return self._once(("line", rank, kind, failure.seq, detail[:120]), failure)

    def _failure(
        self,
        rank: int | None,
        kind: FailureKind,
        detail: str,
        text: str,
        *,
        error_type: str | None = None,
        frame: str | None = None,
        own_code: bool = False,
        pid: int | None = None,
        host: str | None = None,
        seq_op: tuple[int, str] | None = None,
    ) -> RankFailure:
        return RankFailure(
            rank=rank,
            pid=pid,
            host=host,
            kind=kind,
            detail=detail[:400],
            error_type=error_type,
            seq=seq_op[0] if seq_op else None,
            op=seq_op[1] if seq_op else None,
            frame=frame,
            own_code=own_code,
            at=time.time() if self.clock else None,
            cite=self._cite(),
        )

    def _cite(self) -> Citation:
        return Citation(file=self.name, line=self.lines_seen, text=self._current.strip()[:400])

    def _once(self, key: tuple, event: Event) -> list[Event]:
        if key in self._seen:
            return []
        if len(self._seen) < 10_000:  # bounded: past this, repeats are emitted again
            self._seen.add(key)
        return [event]


def _timeout_of(text: str) -> tuple[int, str] | None:
    m = WATCHDOG_TIMEOUT_RE.search(text)
    return (int(m["seq"]), m["op"]) if m else None


def _summary_time(text: str | None) -> float | None:
    """torchrun's ``2026-12-07_18:36:07`` (the agent's local time) -> unix time."""
    if not text:
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%d_%H:%M:%S"))
    except ValueError:
        return None


def parse_failure_lines(data: bytes, name: str, file_rank: int | None = None) -> list[Event]:
    """A whole text at once (tests, small files); ``FailureLines`` streams."""
    reader = FailureLines(name, file_rank)
    return reader.feed(data, final=True)
