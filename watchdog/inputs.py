"""What ``ncclwatch analyze`` reads: paths, folders, standard input, compressed files -> events.

Every input ends as one ``InputFile`` saying what it was recognised as, how
many lines were used and why the rest was not, or why it was not read at all
(missing, empty, permission denied, an unreadable folder, a FIFO, ncclwatch's
own output).

Failure modes, by design:
- FIFOs, sockets and devices are never opened: a kept run folder holds the
  Flight Recorder pipes (``*.pipe``, ``ncclwatch_pipe.<pid>``), and opening
  one for reading blocks until a writer comes, which is never.
- Text is streamed in ``CHUNK_BYTES`` chunks through every text parser at
  once (NCCL lines, PyTorch's diagnostics, network errors, rank prefixes,
  NCCL's transport lines), so a 1 GB stderr costs one pass and one chunk of
  memory, whatever it holds; the NCCL parser's fast path spares the others
  the operation lines (``TextIngest``).
- Standard input is spooled to a temporary file (memory up to 64 MiB, then
  disk) so that it can be rescanned like any file.
- ncclwatch's own output in a bundle (``report.json``, ``report.md``,
  ``evidence.json``) is skipped by its content, and said: the report quotes
  the NCCL lines it cites, which read again counted as operations of the job.
- Nothing here raises on bad input.  An input that could not be read at all
  (missing, permission denied, a broken compressed stream, a bundle cut short)
  has a note that starts with one of ``UNREADABLE`` (``cannot_read``): the
  command line says those on stderr.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ncclwatch.watchdog.events import Event, OpBatch, ProcKey, RankLog
from ncclwatch.watchdog.hang.report import InputFile
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.parsing import EXCLUSIVE, SNIFF_BYTES, NcclLogParser
from ncclwatch.watchdog.parsing.failure_lines import WATCH as FAILURE_MARKERS
from ncclwatch.watchdog.parsing.failure_lines import FailureLines
from ncclwatch.watchdog.parsing.kernel_log import KernelLogParser, looks_like_kernel_log
from ncclwatch.watchdog.parsing.line_prefix import LinePrefix, PrefixStripper, detect
from ncclwatch.watchdog.parsing.nccl_excerpt import BareLines, OrphanScanner, has_bare_lines
from ncclwatch.watchdog.parsing.nccl_log import Residual
from ncclwatch.watchdog.parsing.rank_prefix import SAMPLE as PREFIX_SAMPLE
from ncclwatch.watchdog.parsing.rank_prefix import rank_of_file, ranks_in_chunk, ranks_in_samples
from ncclwatch.watchdog.parsing.torch_log import MARKERS as TORCH_MARKERS
from ncclwatch.watchdog.parsing.torch_log import TorchLogParser
from ncclwatch.watchdog.parsing.transport import MARKERS as TRANSPORT_MARKERS
from ncclwatch.watchdog.parsing.transport import TransportScanner
from ncclwatch.watchdog.parsing.transport import marker_lines as transport_marker_lines
from ncclwatch.watchdog.sources.holes import retained_start

CHUNK_BYTES = 8 << 20
TRANSPORT_LINES = 1 << 16  # transport lines kept per input; past this, ``analyze`` reads the input again for them
_WATCHED = (
    TORCH_MARKERS + TRANSPORT_MARKERS + FAILURE_MARKERS
)  # what the NCCL parser's fast path tells the other readers about
STDIN = "<stdin>"
_SPECIAL = (
    (
        stat.S_ISFIFO,
        "a FIFO (named pipe, e.g. a Flight Recorder debug pipe): not opened, reading it would wait forever",
    ),
    (stat.S_ISSOCK, "a socket: not opened"),
    (stat.S_ISCHR, "a character device: not opened"),
    (stat.S_ISBLK, "a block device: not opened"),
)
NO_SUCH_FILE = "no such file or directory"
UNREADABLE = (NO_SUCH_FILE, "permission denied", "cannot ")  # how every note of an input not read at all starts
_MAGIC = ((b"\x1f\x8b", "gzip", gzip.open), (b"BZh", "bzip2", bz2.open), (b"\xfd7zXZ\x00", "xz", lzma.open))
_REPORT_SKIPPED = "skipped: ncclwatch's own report, not evidence (analyze judges again from the evidence files)"
# What ncclwatch writes, by its first bytes: report.md's title, the Report's first key (report.json and
# `analyze --json`), and the evidence index's first keys (evidence/collect.py). The engine reads none of it.
_OWN_OUTPUT = (
    (re.compile(rb"# ncclwatch: "), _REPORT_SKIPPED),
    (re.compile(rb'\s*\{\s*"tool"\s*:\s*"ncclwatch"'), _REPORT_SKIPPED),
    (
        re.compile(rb'\s*\{\s*"started_unix"\s*:[^{}]*"budget_s"\s*:'),
        "skipped: ncclwatch's own index of the evidence it collected, not evidence",
    ),
)


def iter_files(paths: Iterable[str]) -> Iterator[tuple[str, str | None]]:
    """(path, problem) for every input under ``paths``, folders recursively, in a stable order; "-" is stdin."""
    for raw in paths:
        if raw == "-":
            yield STDIN, None
            continue
        try:
            mode = os.stat(raw).st_mode
        except OSError as exc:
            yield raw, _os_problem(exc)
            continue
        if stat.S_ISDIR(mode):
            yield from _walk(raw)
        else:
            yield raw, _special(mode)


def _walk(folder: str) -> Iterator[tuple[str, str | None]]:
    problems: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(
        folder, onerror=lambda exc: problems.append((exc.filename, "cannot list folder: " + _os_problem(exc)))
    ):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                yield path, _special(os.stat(path).st_mode)
            except OSError as exc:
                yield path, _os_problem(exc)
    yield from problems


def _special(mode: int) -> str | None:
    return next((why for test, why in _SPECIAL if test(mode)), None)


def _os_problem(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return NO_SUCH_FILE
    if isinstance(exc, PermissionError):
        return "permission denied"
    return f"cannot read: {exc.strerror or exc}"


@contextmanager
def open_input(name: str, stdin_spool: dict[str, str]) -> Iterator[tuple[BinaryIO, str | None]]:
    """The decompressed byte stream of an input, and the compression it had."""
    if name == STDIN:
        if STDIN not in stdin_spool:
            stdin_spool[STDIN] = _spool_stdin()
        name = stdin_spool[STDIN]
    with open(name, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        for prefix, kind, opener in _MAGIC:
            if magic.startswith(prefix):
                with opener(raw) as unpacked:  # type: ignore[operator]
                    yield unpacked, kind
                return
        raw.seek(retained_start(raw.fileno()))  # a run folder's NCCL file freed at its start: its kept tail alone
        yield raw, None


def _spool_stdin() -> str:
    out = tempfile.NamedTemporaryFile(prefix="ncclwatch-stdin-", delete=False)
    with out:
        while chunk := sys.stdin.buffer.read(CHUNK_BYTES):
            out.write(chunk)
    return out.name


def ingest_file(
    state: JobState, name: str, stdin_spool: dict[str, str] | None = None, transport: TransportScanner | None = None
) -> InputFile:
    """Parse one input into ``state``; say what it was, what was used, and what went wrong.

    ``transport``: given the transport lines of an input read whole as an NCCL log (one scanner for all the
    inputs, in order: a process whose lines are split over files is one process).
    """
    spool = stdin_spool if stdin_spool is not None else {}
    entry, ingest = _ingest(state, name, spool)
    if transport is not None and ingest is not None and "nccl_log" in entry.kinds:
        if ingest.transport_lines is not None:
            transport.take(ingest.transport_lines)
        else:
            _transport_again(name, spool, transport)
    return entry


def _transport_again(name: str, stdin_spool: dict[str, str], transport: TransportScanner) -> None:
    """An input with more transport lines than ``TextIngest`` keeps: read again, for them alone."""
    try:
        with open_input(name, stdin_spool) as (handle, _):
            while chunk := handle.read(CHUNK_BYTES):
                transport.feed(chunk)
    except (OSError, EOFError, lzma.LZMAError):
        pass  # read whole a moment ago
    transport.feed(b"", final=True)


def _ingest(state: JobState, name: str, spool: dict[str, str]) -> tuple[InputFile, TextIngest | None]:
    """``ingest_file``'s reading; the ``TextIngest`` of an input read whole as text."""
    try:
        with open_input(name, spool) as (handle, compression):
            head = handle.read(SNIFF_BYTES)
            if not head:
                note = "empty file" + (f" ({compression})" if compression else "")
                return InputFile(path=name, kinds=[], note=note), None
            skipped = next((why for start, why in _OWN_OUTPUT if start.match(head)), None)
            if skipped is not None:
                return InputFile(path=name, kinds=[], note=skipped), None
            exclusive = next((f for f in EXCLUSIVE if f.looks_like(head)), None)
            if exclusive is not None:
                for event in exclusive.parse(head + handle.read(), name):  # type: ignore[misc]
                    state.apply(event)
                return InputFile(path=name, kinds=[exclusive.name], note=_compressed(compression)), None
            if b"\x00" in head[:65536]:
                return InputFile(path=name, kinds=[], note="not a recognised format; ignored"), None
            prefix = detect(head)
            if prefix is not None and (entry := _prefixed_exclusive(state, name, prefix, head, handle, compression)):
                return entry, None
            ingest = TextIngest(state, name, prefix)
            return ingest.run(head, handle, compression), ingest
    except (OSError, EOFError, lzma.LZMAError) as exc:
        problem = (
            _os_problem(exc)
            if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile)
            else f"cannot decompress: {exc}"
        )
        return InputFile(path=name, kinds=[], note=problem), None


def _prefixed_exclusive(
    state: JobState, name: str, prefix: LinePrefix, head: bytes, handle: BinaryIO, compression: str | None
) -> InputFile | None:
    """A whole-file format (a RAS report, a py-spy dump) printed through a launcher: read less its prefixes."""
    exclusive = next((f for f in EXCLUSIVE if f.looks_like(prefix.remove_lines(head))), None)
    if exclusive is None:
        return None
    for event in exclusive.parse(prefix.remove_lines(head + handle.read()), name):  # type: ignore[misc]
        state.apply(event)
    note = f"read through its {prefix.name} prefix" + _suffix(_compressed(compression))
    return InputFile(path=name, kinds=[exclusive.name], note=note)


def cannot_read(item: InputFile) -> bool:
    """Whether ``item`` could not be read, wholly or in part (as opposed to read and found of no use)."""
    return not item.kinds and (item.note or "").startswith(UNREADABLE)


def _compressed(compression: str | None) -> str | None:
    return f"{compression}-compressed" if compression else None


class TextIngest:
    """One pass over a text input through every text parser, with its accounting.

    NCCL's operation lines are the bulk of a debug file and concern only the NCCL parser: once it has read a
    chunk on its fast path it hands the rest of the text over (``nccl_log.Residual``, the lines less their
    operation records), and a chunk in which no line holds a marker of the other readers is not scanned again.
    The transport lines (``parsing.transport``) are kept for ``transport_lines``: ``analyze`` reads the
    transports of the inputs found to be NCCL logs, in order, without a second pass.
    """

    def __init__(self, state: JobState, name: str, prefix: LinePrefix | None = None) -> None:
        self.state = state
        self.name = name
        # A launcher's or scheduler's prefix on every line (``line_prefix``): rewritten before any parser reads.
        self.stripper = PrefixStripper(prefix) if prefix is not None else None
        self.kernel: KernelLogParser | None = None  # the driver's Xid lines, where the input is a kernel log
        self.bare: BareLines | None = None  # NCCL lines pasted without their host:pid:tid
        self.file_rank = rank_of_file(name)
        self.nccl = NcclLogParser(name, watch=_WATCHED)
        self.torch = TorchLogParser(name, self.file_rank)
        self.failure = FailureLines(name, self.file_rank)  # a job that died: why each rank failed (issue 44)
        self.nccl_ops = 0
        self.nccl_other = 0
        self.torch_events = 0
        self.prefixes: dict[tuple[int, str], int] = {}
        # The transport lines, in order; None once more than TRANSPORT_LINES (then ``analyze`` reads the file again).
        self.transport_lines: list[bytes] | None = []
        self._nccl_seen = False
        self._carry = b"\n"
        self._ranks_said = ""  # "rank 0-3 by [rankN]: prefix", set with the RankLog events
        self._prefixes_known: set[bytes] = set()

    def run(self, head: bytes, handle: BinaryIO, compression: str | None) -> InputFile:
        # Decided once from the head: an NCCL debug file pays nothing for the kernel log's reader.
        self.kernel = KernelLogParser(self.name) if looks_like_kernel_log(head) else None
        self.bare = BareLines(self.name) if has_bare_lines(head) else None  # a pasted excerpt's NCCL lines
        chunk = head
        while chunk:
            self._read(chunk)
            chunk = handle.read(CHUNK_BYTES)
        self._read(b"", final=True)
        return self._account(compression)

    def _read(self, chunk: bytes, final: bool = False) -> None:
        if self.kernel is not None:  # the kernel log's own prefixes carry the time and host: it reads the original
            for event in self.kernel.feed(chunk, final=final):
                self.state.apply(event)
        if self.stripper is None and self.bare is None:
            self._feed(chunk, final=final)
            return
        text = self.stripper.feed(chunk, final=final) if self.stripper is not None else chunk
        text = self.bare.feed(text, final=final) if self.bare is not None else text
        if text or final:
            self._feed(text, final=final)

    def _feed(self, chunk: bytes, final: bool = False) -> None:
        residual = None
        if self._nccl_seen or b" NCCL " in chunk:
            shared = self.nccl.carry == self._carry  # then the NCCL parser reads the same lines as the others
            self._nccl_seen = True
            self._apply(self.nccl.feed(chunk, final=final), nccl=True)
            residual = self.nccl.residual if shared else None
        # Rank prefixes are counted on whole lines, at their starts: the residual holds them all.
        if residual is not None and not final:
            # The NCCL parser read the lines the others read (the final chunk's are one "\n" short, see below).
            self._carry = self.nccl.carry
            self._others(residual, b"", 0)
            size = self.nccl.scanned_size
            head, tail = self.nccl.window(0, PREFIX_SAMPLE), self.nccl.window(max(0, size - PREFIX_SAMPLE), size)
            counts = ranks_in_samples(head, tail, lambda: residual.text, self._prefixes_known)
        else:
            # The carry keeps the partial last line; the rank prefixes' last sample ends at ``cut``.
            body = self._carry + chunk
            cut = len(body) if final else body.rfind(b"\n")
            stop = len(body) - 1 if final and body.endswith(b"\n") else cut
            self._carry = b"\n" if final else body[cut:]
            self._others(residual, body, stop)
            counted = residual.text if residual is not None and self._prefixes_known else None
            counts = ranks_in_chunk(body, self._prefixes_known, cut, counted)
        for key, n in counts.items():
            self.prefixes[key] = self.prefixes.get(key, 0) + n

    def _others(self, residual: Residual | None, body: bytes, stop: int) -> None:
        """PyTorch's diagnostics and the transport lines: in the residual when the NCCL parser left one (none to
        look for where it holds no marker), else in body[:stop]."""
        if residual is not None and not residual.marked:
            self.torch.skip(residual.lines)
            self.failure.skip(residual.lines)
            return
        if residual is not None:
            body = residual.text
            stop = len(body)
        self._apply(self.torch.scan(body, stop), nccl=False)
        self._apply(self.failure.scan(body[1:stop] if body.startswith(b"\n") else body[:stop]), nccl=False)
        self._transport(body, stop)

    def _transport(self, body: bytes, stop: int) -> None:
        if self.transport_lines is None:
            return
        self.transport_lines += transport_marker_lines(body, stop)
        if len(self.transport_lines) > TRANSPORT_LINES:
            self.transport_lines = None

    def _apply(self, events: list[Event], nccl: bool) -> None:
        for event in events:
            if isinstance(event, OpBatch):
                self.nccl_ops += len(event.sigs) + len(event.p2p)
            elif nccl:
                self.nccl_other += 1
            else:
                self.torch_events += 1
            self.state.apply(event)

    def _account(self, compression: str | None) -> InputFile:
        kernel_used = self.kernel.lines_used if self.kernel is not None else 0
        total = max(self.nccl.lines_seen, self.torch.lines_seen, self.kernel.lines_seen if self.kernel else 0)
        for event in self._rank_logs(total):
            self.state.apply(event)
        kinds = [
            k
            for k, n in (
                ("nccl_log", self.nccl_ops + self.nccl_other),
                ("torch_log", self.torch_events),
                ("kernel_log", kernel_used),
            )
            if n
        ]
        diagnostics = min(total, self.torch.lines_used + self.failure.lines_used)  # a line both read counts twice
        used = self.nccl_ops + self.nccl_other + diagnostics + kernel_used
        if not kinds and not self._ranks_said:
            return InputFile(
                path=self.name, kinds=[], note="not a recognised format; ignored" + _suffix(_compressed(compression))
            )
        parts = [f"{used:,} of {total:,} lines used"]
        detail = [
            f"{n:,} {what}"
            for n, what in (
                (self.nccl_ops, "NCCL operations"),
                (self.nccl_other, "NCCL init/end/warning lines"),
                (diagnostics, "PyTorch or network diagnostics"),
                (kernel_used, "GPU driver Xid lines"),
            )
            if n
        ]
        if detail:
            parts[0] += f" ({', '.join(detail)})"
        if total > used:
            parts.append(
                f"the other {total - used:,} are neither NCCL debug lines nor PyTorch/NCCL diagnostics "
                f"({_what_else(self.name)})"
            )
        if self.nccl.garbled:
            parts.append(f"{self.nccl.garbled} garbled operation line(s) skipped (interleaved or cut writes)")
        if self._ranks_said:
            parts.append(self._ranks_said)
        if self.stripper is not None:
            streams = len(self.stripper.labels)
            parts.append(
                f"lines read through their {self.stripper.prefix.name} prefix"
                + (f" ({streams} stream{'s' if streams != 1 else ''})" if streams else "")
            )
        if compression:
            parts.append(_compressed(compression) or "")
        return InputFile(path=self.name, kinds=kinds or ["text"], note="; ".join(parts))

    def _rank_logs(self, total: int) -> list[RankLog]:
        """Whose lines the input holds: by prefix (a combined file) or by file name (one rank's file)."""
        logs = []
        for (rank, how), n in sorted(self.prefixes.items()):
            # "12: " at a line start is also ordinary output; an srun label marks most lines.
            if how.startswith("srun") and n * 3 < total:
                continue
            logs.append(RankLog(rank=rank, file=self.name, how=how, lines=n))
        if not logs and self.file_rank is not None:
            logs.append(RankLog(rank=self.file_rank, file=self.name, how="file name", lines=total))
        by_how: dict[str, list[int]] = {}
        for log in logs:
            by_how.setdefault(log.how, []).append(log.rank)
        self._ranks_said = "; ".join(f"rank {_ranges(ranks)} by {how}" for how, ranks in by_how.items())
        return logs


# What the lines a text input holds besides diagnostics are, by where it is: a bundle's record of a rank (kept for
# people, read for what it may cite), or else a log.
_BUNDLE_RECORDS = (
    (re.compile(r"(^|/)env/rank\d+\.txt$"), "the rank's environment, as the bundle keeps it"),
    (re.compile(r"(^|/)proc/rank\d+\.txt$"), "the rank's /proc state, as the bundle keeps it"),
)


def _what_else(name: str) -> str:
    return next((what for pattern, what in _BUNDLE_RECORDS if pattern.search(name)), "training output, tracebacks")


def _suffix(text: str | None) -> str:
    return f" ({text})" if text else ""


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:32])) + (" ..." if len(ranks) > 32 else "")


def rescan_orphans(state: JobState, inputs: list[InputFile], stdin_spool: dict[str, str]) -> None:
    """Operations whose Init line is missing: rescan their files for what ``hang.partial`` can align."""
    by_file: dict[str, set[tuple[ProcKey, str]]] = {}
    for slot, (_, file) in state.take_orphans().items():
        by_file.setdefault(file, set()).add(slot)
    notes = {i.path: i for i in inputs}
    for file, wanted in by_file.items():
        scanner = OrphanScanner(file, wanted, rank_of_file(file))
        try:
            with open_input(file, stdin_spool) as (handle, compression):
                if compression is None:
                    _skip_to_tail(handle, scanner)
                while chunk := handle.read(CHUNK_BYTES):
                    scanner.feed(chunk)
                scanner.feed(b"", final=True)
        except (OSError, EOFError, lzma.LZMAError):
            continue
        events = scanner.events()
        for event in events:
            state.apply(event)
        entry = notes.get(file)
        if entry is not None and events:
            count = sum(e.count for e in events)
            extra = (
                f"{count:,} operations on {len(events)} communicator(s) without their Init line: "
                "no rank or communicator id, aligned by opCount only"
            )
            entry.note = f"{entry.note}; {extra}" if entry.note else extra


TAIL_BYTES = 8 << 20  # orphans keep their last few operations: only the end of a file is parsed


def _skip_to_tail(handle: BinaryIO, scanner: OrphanScanner) -> None:
    """Count the lines before the last ``TAIL_BYTES`` (for line numbers) without parsing them."""
    skip = os.fstat(handle.fileno()).st_size - TAIL_BYTES
    if skip <= handle.tell():  # the start, or a freed file's kept tail (``open_input``)
        return
    lines = 0
    while handle.tell() < skip and (chunk := handle.read(min(CHUNK_BYTES, skip - handle.tell()))):
        lines += chunk.count(b"\n")
    if handle.readline().endswith(b"\n"):  # finish the line cut by the skip
        lines += 1
    scanner.skip_lines(lines)


def cleanup_stdin(stdin_spool: dict[str, str]) -> None:
    for path in stdin_spool.values():
        Path(path).unlink(missing_ok=True)
