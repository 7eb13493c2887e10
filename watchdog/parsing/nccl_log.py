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
destroy).  That is the exact path (``NcclLogParser._exact``); the fast paths
(``_fast``) give the same events from one ``split`` per 1 MiB with one or three
objects per line and everything else looked at once per distinct piece of
text, and hand the text less its operation records to the other readers of
the same file (``Residual``, ``inputs.TextIngest``): about 2 M lines/s on one
core where the exact path reads 0.8 M (BENCHMARKS.md, 2026-11-26).  Whatever they
cannot vouch for (garbled records, markers inside operation lines, lines that
repeat nothing) goes to the exact path.  Line numbers of operations are not
kept: ``iter_op_lines`` finds one on demand when a verdict cites it.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate, repeat

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
from ncclwatch.watchdog.parsing.net_errors import parse_transport_mismatch

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
# The fast path (``NcclLogParser._fast``) splits a chunk at every operation record: the fast pattern's fields, with
# opCount (``%lx``) and the buffers (``%p``: "0x..", "(nil)") held to their own characters, and the rest of the
# line as the tail, checked once per distinct tail against the fast pattern's (``_FastInterner``).
_HEX = rb"[0-9a-fA-Fx()nil]++"  # possessive: a field ends at its space, nothing to backtrack
_RECORDS_RE = re.compile(
    rb"INFO (\w++): opCount " + _HEX + rb" sendbuff " + _HEX + rb" recvbuff " + _HEX + rb" (count.*+)"
)
_TAIL_RE = re.compile(rb"count \d+ datatype \d+ op \d+ root -?\d+ comm [^ \n]+")
# The segments path (``NcclLogParser._fast_segments``) cuts only a record's variable middle out; the fast
# pattern's "INFO op" ends the segment before it, its tail starts the one after (``_PairInterner`` checks both).
_SEGMENT_RE = re.compile(rb": opCount " + _HEX + rb" sendbuff " + _HEX + rb" recvbuff " + _HEX + rb" ")
_OP_END_RE = re.compile(rb"INFO (\w+)\Z")
# What the general pattern (``_OP_RE``) needs of an operation line beyond the fast one: its head from the line's
# start, and a communicator of no other whitespace (``\S+``: a "\r" ends it there, not here).
_GENERAL_HEAD_RE = re.compile(_PREFIX + rb"([^:\s\[\]]+:\d+):\d+ \[\d+\] NCCL INFO \w+")
_GENERAL_TAIL_RE = re.compile(rb"count \d+ datatype \d+ op \d+ root -?\d+ comm \S+(?![^ \n])")
_UNSAFE, _MARKED = 1, 2  # ``_segment_info`` flags
_DISTINCT = object()  # ``_fast_segments``: lines that repeat nothing
_RECORD = b": opCount "  # in every record, once; what ``garbled`` counts
_SAMPLE = 1 << 14  # a chunk whose first 16 KiB show several processes is not tried by pieces
_BLOCK = 1 << 20  # the fast path splits this much at a time: past it, the objects a split makes leave the cache
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
    """Incremental parser for one NCCL debug file (or a merged log).

    ``watch``: markers of the other scanners that read the same text (``inputs.TextIngest``); after each ``feed``,
    ``residual`` says whether a chunk holds any of them (see ``Residual``).
    """

    def __init__(self, name: str, watch: tuple[bytes, ...] = ()) -> None:
        self.name = name
        self.lines_seen = 0
        self.garbled = 0  # operation records (": opCount ") that did not parse
        self.version_seen = False
        self.residual: Residual | None = None  # of the last feed; None when it took the exact path
        self._scanned: bytes | None = b""  # the lines the last feed read (``scanned``), when joined
        self._parts: tuple[bytes, bytes, int] = (b"", b"", 0)  # they are carry + data[:cut]
        self._carry = b"\n"
        self._interners: dict[bytes | None, _Interner] = {}
        self._fast_interners: dict[bytes, _FastInterner] = {}
        self._pairs: _PairInterner | None = None
        self._distinct_lines = False  # chunks of lines that repeat nothing (timestamps): ``_fast_pieces`` only
        self._failures = 0  # fast tries failed in a row
        self._cooldown = 0  # chunks to go before the next try
        self._watch = tuple(watch)
        if any(b"\n" in m or b"INFO" in m or b"count" in m for m in self._watch):
            raise ValueError("a watched marker may hold no newline, INFO nor count (see Residual)")

    @property
    def carry(self) -> bytes:
        """The partial last line kept for the next ``feed`` (with the "\n" before it)."""
        return self._carry

    def feed(self, data: bytes, final: bool = False) -> list[Event]:
        """Parse the complete lines in ``carry + data``; keep the partial rest."""
        # The carry always starts with the previous line's "\n", so every
        # line, the first included, starts at a "\n" the patterns anchor on.
        self.residual = None
        self._scanned = None
        if final:
            body = self._carry + data
            self._carry = b"\n"
            lines = self._scanned = body[:-1] if body.endswith(b"\n") else body
            self._parts = (lines, b"", 0)
            if not lines:
                return []
            blocks = list(_blocks(lines, memoryview(lines), 0, len(lines)))
            has_record = _RECORD in lines
        else:
            cut = data.rfind(b"\n")
            if cut < 0:
                self._carry += data
                self._parts = (b"", b"", 0)
                return []
            # The carried line, completed, then blocks of ``data`` itself (split reads a memoryview in place).
            first = data.find(b"\n")
            blocks = [self._carry + data[:first], *_blocks(data, memoryview(data), first, cut)]
            has_record = _RECORD in blocks[0] or data.find(_RECORD, 0, cut) >= 0
            self._parts = (self._carry, data, cut)
            self._carry = data[cut:]
        events = None
        if has_record and self._cooldown:
            self._cooldown -= 1
        elif has_record:
            events = self._fast(blocks)
            # Where the fast paths fail (a stderr with training output between the NCCL lines), they are tried
            # again after 1, 3, 7 .. 63 chunks: what a failed try costs is not paid on every chunk.
            self._failures = 0 if events is not None else self._failures + 1
            self._cooldown = min(2**self._failures, 64) - 1
        return events if events is not None else self._exact(self.scanned)

    @property
    def scanned(self) -> bytes:
        """The lines the last ``feed`` read, "\\n" before each and none after the last (the readers' body)."""
        if self._scanned is None:
            carry, data, cut = self._parts
            self._scanned = b"".join((carry, memoryview(data)[:cut]))
        return self._scanned

    def window(self, start: int, stop: int) -> bytes:
        """``scanned[start:stop]``, without joining the lines where they were not."""
        if self._scanned is not None:
            return self._scanned[start:stop]
        carry, data, cut = self._parts
        stop = min(stop, len(carry) + cut)
        if stop <= len(carry):
            return carry[start:stop]
        if start >= len(carry):
            return data[start - len(carry) : stop - len(carry)]
        return carry[start:] + data[: stop - len(carry)]

    @property
    def scanned_size(self) -> int:
        carry, _, cut = self._parts
        return len(self._scanned) if self._scanned is not None else len(carry) + cut

    # -- the exact path ----------------------------------------------------

    def _exact(self, body: bytes) -> list[Event]:
        """Every line of ``body`` (complete lines, each after a "\n"): rare lines split it into segments whose
        operations are matched by one ``findall`` each."""
        stop = len(body)
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

    def _ops(self, body: bytes, start: int, stop: int, out: list[Event]) -> None:
        """Operations of the lines in body[start:stop] (``start`` is a line's "\n")."""
        if stop <= start:
            return
        single = _single_process(body, start, stop)
        found = (_OP_FAST_RE if single else _OP_RE).findall(body, start, stop)
        self.garbled += body.count(b": opCount ", start, stop) - len(found)
        if not found:
            return
        interner = self._interner(single)
        _batches(interner, list(map(interner.__getitem__, found)), self.name, out)

    def _interner(self, single: bytes | None) -> _Interner:
        table = self._interners.get(single)
        if table is None or len(table) > _MAX_INTERNED:
            table = self._interners[single] = _Interner(single)
        return table

    # -- the fast path -----------------------------------------------------

    def _fast(self, blocks: list[bytes | memoryview]) -> list[Event] | None:
        """The events ``_exact`` would give, read faster; None where the fast paths cannot vouch for them.

        Both fast paths split the text at every operation record and look at what is left, which holds every
        other line whole; ``_exact`` reads the chunk again wherever they see anything unusual (a garbled record,
        several processes, a marker inside an operation line).  ``_fast_segments`` keeps one object per line; the
        text between two records repeats there only where lines carry no timestamp, so a parser that meets
        chunks of distinct lines keeps to ``_fast_pieces`` (three objects per line, but only the operation's
        fields are looked up).
        """
        first = next(filter(None, map(_PROC_ANY_RE.search, blocks)), None)  # a line holds the whole match
        if first is None:
            return None
        if not self._distinct_lines:
            events = self._fast_segments(blocks, first[1])
            if events is not _DISTINCT:
                return events  # type: ignore[return-value]
        sample = blocks[1][:_SAMPLE] if len(blocks) > 1 else blocks[0][:_SAMPLE]
        if any(proc != first[1] for proc in _PROC_ANY_RE.findall(sample)):
            return None  # several processes (a merged log): only the exact path reads them line by line
        return self._fast_pieces(blocks, first[1])

    def _fast_segments(self, blocks: list[bytes | memoryview], proc: bytes) -> list[Event] | None | object:
        """``_fast`` by segments: ``_SEGMENT_RE`` cuts out each record's variable middle (": opCount .. recvbuff ..
        "), leaving segments from one record's tail ("count .. comm .." and the rest of its line) through the
        whole lines after it to the next record's start ("host:pid:tid [dev] NCCL INFO op").  An operation is a
        pair of neighbouring segments (its op ends the first, its tail starts the second), interned whole: one
        lookup per line (``_PairInterner``, which also checks the pair and notes the process its line names).
        Each distinct segment is looked at once (``_segment_info``).  The exact path's choice is made as it would
        make it, from the lines and "host:pid:" of the segments: one process (``proc``, the first named) or the
        general pattern, which reads each line's own process (then every operation line must be one it reads).
        """
        tag = proc + b":"
        interner = self._pair_interner()
        info = interner.segments
        ids: list[int] = []
        done: list[tuple[list[bytes], bytes]] = []  # each block's segments before its records, and its last
        count = tagged = 0
        marked = False
        for block in blocks:
            segments = _SEGMENT_RE.split(block)
            distinct = set(segments)
            new = distinct.difference(info)
            if len(new) > 64 and len(new) * 16 > len(segments):
                # Lines that repeat little (timestamps, many sizes): little worth interning, here and, where many
                # lines said so, in the chunks to come.
                self._distinct_lines = len(segments) > 2048
                return _DISTINCT
            if new:
                _segment_info(info, new, self._markers() + (_VERSION_MARKER,))
            flags = 0
            for segment in distinct:
                flags |= info[segment][1]
            if flags & _UNSAFE:
                return None  # a record the split did not take
            last = segments.pop()  # the block's last record's tail and the whole lines after it
            marked = marked or bool(flags & _MARKED)
            newlines = {segment: info[segment][0] for segment in distinct}
            tags = {segment: segment.count(tag) for segment in distinct}
            in_lines = _total(segments, newlines) + newlines[last]
            count += in_lines
            tagged += in_lines if tags == newlines else _total(segments, tags) + tags[last]
            misses = interner.misses
            ids += map(interner.__getitem__, zip(segments, segments[1:] + [last]))
            if interner.unsafe:
                interner.unsafe = False
                return None
            if interner.misses - misses > 64 and (interner.misses - misses) * 16 > len(segments):
                self._distinct_lines = len(segments) > 2048
                return _DISTINCT  # pairs that repeat little: by pieces
            done.append((segments, last))
        if not ids:
            return None
        if marked:
            # The others read what the marked lines are in: less each operation line's tail (a chunk's thousands).
            short = _Untailed()
            pieces = [
                (segments[:1] + list(map(short.__getitem__, segments[1:])), short[last] if segments else last)
                for segments, last in done
            ]
            return self._fast_marked(proc, interner.view(proc), interner, ids, pieces)
        if tagged == count:
            view = interner.view(proc)
        elif interner.general(set(ids)):
            view = interner.view(None)
        else:
            return None
        events: list[Event] = []
        _batches(view, ids, self.name, events)
        self.lines_seen += count
        self.residual = Residual(count, done, marked=False)
        return events

    def _fast_pieces(self, blocks: list[bytes | memoryview], proc: bytes) -> list[Event] | None:
        """``_fast`` by pieces: ``_RECORDS_RE`` cuts every operation record out, from its "INFO" to the end of its
        line.  What is left (the pieces) holds every other line whole and, of each operation line, what came
        before "INFO".  The pieces of a chunk are looked at once each (a set): for the markers of rare lines, of
        the watched scanners and of records the split did not take, and for the process check (the exact path's
        one process per segment): the pieces hold every newline and every "host:pid:" of the text (a record holds
        neither: its fields are hexadecimal and its tail is checked, ``_FastInterner``).  The operation's fields
        are looked up alone, so lines that are each their own (timestamps) cost one set entry each.

        The text is split in blocks of whole lines (``_BLOCK``), each looked at while its objects are in the cache.
        """
        tag = proc + b":"
        interner = self._fast_interner(proc)
        markers = self._markers()
        ids: list[int] = []
        done: list[tuple[list[bytes], bytes]] = []  # each block's pieces before its records, and what follows
        count = tagged = 0
        marked = False
        for block in blocks:
            parts = _RECORDS_RE.split(block)
            pieces = parts[0::3]
            last = pieces.pop()  # after the block's last record: whole lines (the others end cut by a record)
            done.append((pieces, last))
            distinct = set(pieces)
            probe = b"\n".join(distinct)
            if _RECORD in probe or _RECORD in last:
                return None  # a record the split did not take: garbled, or of a shape only the exact path reads
            if any(m in probe or m in last for m in markers):
                marked = True
                for piece in distinct:
                    cut = piece[piece.rfind(b"\n") + 1 :]  # the start of an operation line
                    if not cut.endswith(b"NCCL ") or any(m in cut for m in markers):
                        return None
            newlines = {piece: piece.count(b"\n") for piece in distinct}
            tags = {piece: piece.count(tag) for piece in distinct}
            in_pieces = _total(pieces, newlines)
            in_lines = in_pieces + last.count(b"\n")
            # Where each piece holds as many "host:pid:" as newlines, so do they all; else they are counted.
            in_tags = (in_pieces if tags == newlines else _total(pieces, tags)) + last.count(tag)
            if in_tags != in_lines:
                return None  # lines of other processes or none: the exact path's general pattern reads them
            count += in_lines
            tagged += in_tags
            ids += map(interner.__getitem__, zip(parts[1::3], parts[2::3]))
            if interner.unsafe:
                interner.unsafe = False
                return None
        if not ids:
            return None
        if marked:
            return self._fast_marked(proc, interner, None, ids, done)
        if tagged != count:
            return None  # not every line of one process: the exact path reads them with the general pattern
        events: list[Event] = []
        _batches(interner, ids, self.name, events)
        self.lines_seen += count
        self.residual = Residual(count, done, marked=False)
        return events

    def _fast_marked(
        self,
        proc: bytes,
        interner: _Interner | _Buckets,
        pairs: _PairInterner | None,
        ids: list[int],
        blocks: list[tuple[list[bytes], bytes]],
    ) -> list[Event] | None:
        """``_fast`` for a chunk with rare or watched lines: segments located in the text less its records.

        A segment of one process (``proc``) is read with ``interner``; one the exact path reads with its general
        pattern, with the processes its lines name, where ``pairs`` knows them.
        """
        residual = Residual(0, blocks, marked=True)
        text = residual.text
        # Record i stands in the text after the pieces before it, and a block's last piece runs into the next's.
        lengths: list[int] = []
        pending = 0
        for pieces, last in blocks:
            if pieces:
                lengths.append(pending + len(pieces[0]))
                lengths += map(len, pieces[1:])
                pending = 0
            pending += len(last)
        ends = list(accumulate(lengths))
        rare = self._rare_lines(text, len(text))
        views: dict[int, _Interner | _Buckets] = {}  # segment's first op -> how its operations are read
        start, first_op = 0, 0
        for line_start, line_end in (*rare, (len(text), len(text))):
            op_end = bisect_right(ends, line_start)
            if op_end > first_op:
                single = _single_process(text, start, line_start)
                if single == proc:
                    views[first_op] = interner
                elif single is None and pairs is not None and pairs.general(set(ids[first_op:op_end])):
                    views[first_op] = pairs.view(None)
                else:
                    return None  # the exact path would read this segment otherwise
            start, first_op = line_end, op_end
        events: list[Event] = []
        line_no, counted_to, done = self.lines_seen, 0, 0
        for line_start, line_end in rare:
            op_end = bisect_right(ends, line_start)
            if op_end > done:
                _batches(views[done], ids[done:op_end], self.name, events)
                done = op_end
            line_no += text.count(b"\n", counted_to, line_start + 1)
            counted_to = line_start + 1
            event = self._rare(text[line_start + 1 : line_end], line_no)
            if event is not None:
                events.append(event)
                self.version_seen = self.version_seen or isinstance(event, NcclVersion)
        if done < len(ids):
            _batches(views[done], ids[done:], self.name, events)
        residual.lines = text.count(b"\n")
        self.lines_seen += residual.lines
        self.residual = residual
        return events

    def _markers(self) -> tuple[bytes, ...]:
        markers = _MARKERS if self.version_seen else (*_MARKERS, _VERSION_MARKER)
        return markers + self._watch

    def _pair_interner(self) -> _PairInterner:
        table = self._pairs
        if table is None or len(table) > _MAX_INTERNED or len(table.segments) > _MAX_INTERNED:
            table = self._pairs = _PairInterner(self._markers() + (_VERSION_MARKER,))
        return table

    def _fast_interner(self, proc: bytes) -> _FastInterner:
        table = self._fast_interners.get(proc)
        if table is None or len(table) > _MAX_INTERNED:
            table = self._fast_interners[proc] = _FastInterner(proc, self._markers() + (_VERSION_MARKER,))
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
        self._only: dict[int, list[OpSig | None]] = {}

    def only(self, bucket: int) -> list[OpSig | None]:
        """id -> its signature where the id is of ``bucket``, else None (``filter`` keeps a bucket's, in C)."""
        table = self._only.setdefault(bucket, [])
        for index in range(len(table), len(self.sigs)):
            table.append(self.sigs[index] if self.buckets[index] == bucket else None)
        return table

    def __missing__(self, key: tuple[bytes, ...]) -> int:
        index = self[key] = self._add(key)
        return index

    def _add(self, key: tuple[bytes, ...]) -> int:
        """A new id for ``key``'s operation (not stored under ``key``)."""
        proc, op, tail = key if len(key) == 3 else (self.proc, *key)
        fields, _, comm = tail.rpartition(b" comm ")
        bucket_key = (proc, comm, op in _P2P)
        bucket = self._bucket_of.setdefault(bucket_key, len(self.bucket_keys))
        if bucket == len(self.bucket_keys):
            self.bucket_keys.append(bucket_key)
        index = len(self.sigs)
        self.sigs.append(_make_sig(op, fields))
        self.buckets.append(bucket)
        return index


class _FastInterner(_Interner):
    """``_Interner`` for the fast path's keys, ``(op, tail)`` with the tail running to the end of the line.

    A key is interned only when the fast pattern would have read its record the same way and nothing in it
    concerns another reader: the tail starts as the fast pattern's does, and neither it nor the op holds a
    ":" (a "host:pid:" the process check counts), another record or a marker.  Any other key sets ``unsafe``
    (and is not kept, so that it sets it again where it recurs): the chunk goes to the exact path.
    """

    def __init__(self, proc: bytes, markers: tuple[bytes, ...]) -> None:
        super().__init__(proc)
        self.unsafe = False
        self._markers = markers

    def __missing__(self, key: tuple[bytes, ...]) -> int:
        op, tail = key
        fast = _TAIL_RE.match(tail)
        if (
            fast is None
            or b":" in tail
            or _RECORD in tail
            or any(marker in tail or marker in op for marker in self._markers)
        ):
            self.unsafe = True
            return 0
        index = self.get((op, fast[0]))
        if index is None:
            index = super().__missing__((op, fast[0]))
        self[key] = index
        return index


def _total(pieces: list[bytes], per_piece: dict[bytes, int]) -> int:
    """sum(per_piece[p] for p in pieces), fast where nearly every piece counts 1 (a line each)."""
    other = [(piece, n) for piece, n in per_piece.items() if n != 1]
    if len(other) > 1:
        return sum(map(per_piece.__getitem__, pieces))
    return len(pieces) + sum((n - 1) * pieces.count(piece) for piece, n in other)


class _PairInterner(dict[tuple[bytes, bytes], int]):
    """``_fast_segments``' table: a pair of neighbouring segments -> the id of the operation between them.

    A pair is interned when the fast pattern would read its record the same way: the first segment's last line
    ends in "INFO op" (the pattern's "INFO (\\w+)" before ": opCount"), the second starts with the pattern's tail,
    and neither line holds a marker (the line is an operation line: the exact path reads no marker in it); the
    first holds a line end (else the record before it stands on the same line).  Any other pair sets ``unsafe``
    and is not kept.  Each id also keeps the process its line names where the general pattern would read the
    line the same way (``line_procs``, else None).  ``segments``: what ``_segment_info`` said of each segment.
    ``view`` gives what ``_batches`` reads: the operations bucketed by process.
    """

    def __init__(self, markers: tuple[bytes, ...]) -> None:
        super().__init__()
        self.unsafe = False
        self.misses = 0
        self.segments: dict[bytes, tuple[int, int]] = {}
        self.sigs: list[OpSig] = []
        self.comms: list[tuple[bytes, bool]] = []  # (communicator, is p2p) of each id
        self.line_procs: list[bytes | None] = []
        self._markers = markers
        self._ids: dict[tuple[bytes | None, bytes, bytes], int] = {}
        self._views: dict[bytes | None, _Buckets] = {}

    def __missing__(self, key: tuple[bytes, bytes]) -> int:
        self.misses += 1
        before, after = key
        if b"\n" not in before:  # a segment from one record to the next on the same line
            self.unsafe = True  # the exact path's pattern says what it reads of two records on one line
            return 0
        start = before[before.rfind(b"\n") + 1 :]  # the operation line up to its op
        newline = after.find(b"\n")
        rest = after if newline < 0 else after[:newline]  # its tail and the rest of the line
        op = _OP_END_RE.search(start)
        fast = _TAIL_RE.match(rest)
        marked = (self.segments[before][1] | self.segments[after][1]) & _MARKED  # else neither line holds one
        if (
            op is None
            or fast is None
            or b":" in rest  # no "host:pid:" the process check would miss where tails are cut out (_Untailed)
            or (marked and any(marker in start or marker in rest for marker in self._markers))
        ):
            self.unsafe = True
            return 0
        general = _GENERAL_HEAD_RE.fullmatch(start)
        line_proc = general[1] if general is not None and _GENERAL_TAIL_RE.match(rest) else None
        ids_key = (line_proc, op[1], fast[0])
        index = self._ids.get(ids_key)
        if index is None:
            index = self._ids[ids_key] = len(self.sigs)
            fields, _, comm = fast[0].rpartition(b" comm ")
            self.sigs.append(_make_sig(op[1], fields))
            self.comms.append((comm, op[1] in _P2P))
            self.line_procs.append(line_proc)
        self[key] = index
        return index

    def general(self, ids: set[int]) -> bool:
        """Whether the general pattern reads every line of ``ids`` as the fast one does."""
        return all(self.line_procs[i] is not None for i in ids)

    def view(self, proc: bytes | None) -> _Buckets:
        """The ids bucketed by (``proc``, communicator, kind); by each line's own process where None."""
        view = self._views.get(proc)
        if view is None:
            view = self._views[proc] = _Buckets(self, proc)
        view.sync()
        return view


class _Buckets:
    """A ``_PairInterner``'s ids as ``_batches`` reads an ``_Interner``: signatures, buckets and their keys."""

    def __init__(self, pairs: _PairInterner, proc: bytes | None) -> None:
        self.sigs = pairs.sigs
        self.buckets: list[int] = []
        self.bucket_keys: list[tuple[bytes, bytes, bool]] = []
        self._pairs = pairs
        self._proc = proc
        self._bucket_of: dict[tuple[bytes, bytes, bool], int] = {}
        self._only: dict[int, list[OpSig | None]] = {}

    def sync(self) -> None:
        pairs = self._pairs
        for index in range(len(self.buckets), len(self.sigs)):
            comm, is_p2p = pairs.comms[index]
            key = (self._proc or pairs.line_procs[index] or b"?:0", comm, is_p2p)
            bucket = self._bucket_of.setdefault(key, len(self.bucket_keys))
            if bucket == len(self.bucket_keys):
                self.bucket_keys.append(key)
            self.buckets.append(bucket)

    only = _Interner.only


class _Untailed(dict[bytes, bytes]):
    """A segment after a record, less that record's tail: from its first line end (b"" where it has none)."""

    def __missing__(self, segment: bytes) -> bytes:
        newline = segment.find(b"\n")
        short = self[segment] = segment[newline:] if newline >= 0 else b""
        return short


def _segment_info(info: dict[bytes, tuple[int, int]], segments: set[bytes], markers: tuple[bytes, ...]) -> None:
    """Each new segment's newlines and flags: a record the split did not take (``_UNSAFE``), a marker
    (``_MARKED``).  The markers are looked for in all of them at once first."""
    probe = b"\n".join(segments)
    record = _RECORD in probe
    marked = any(marker in probe for marker in markers)
    for segment in segments:
        flags = _UNSAFE if record and _RECORD in segment else 0
        if marked and any(marker in segment for marker in markers):
            flags |= _MARKED
        info[segment] = (segment.count(b"\n"), flags)


def _batches(interner: _Interner, ids: list[int], file: str, out: list[Event]) -> None:
    """One ``OpBatch`` per (process, communicator) of the interned operations ``ids``, in first-appearance order.

    Column-wise, all in C: the distinct ids give the buckets present, and each bucket's signatures are the ids
    mapped through its table (``_Interner.only``), Nones filtered out.
    """
    buckets = interner.buckets
    distinct = set(ids)
    present = {buckets[i] for i in distinct}
    if len(present) > 1:  # in first-appearance order: the distinct ids in theirs, then their buckets
        order = sorted(distinct, key=ids.index) if len(distinct) <= 16 else dict.fromkeys(ids)
        present = dict.fromkeys(buckets[i] for i in order)  # type: ignore[assignment]
    batches: dict[tuple[bytes, bytes], tuple[list[OpSig], list[OpSig]]] = {}
    for bucket in present:
        proc, comm, is_p2p = interner.bucket_keys[bucket]
        if len(present) == 1:
            mine: list = list(map(interner.sigs.__getitem__, ids))
        else:
            mine = list(filter(None, map(interner.only(bucket).__getitem__, ids)))
        batches.setdefault((proc, comm), ([], []))[is_p2p].extend(mine)
    for (proc, comm), (coll, p2p) in batches.items():
        host, _, pid = proc.decode(errors="replace").rpartition(":")
        out.append(
            OpBatch.model_construct(
                proc=ProcKey(host, int(pid)),
                comm_ptr=comm.decode(errors="replace"),
                file=file,
                sigs=coll,
                p2p=p2p,
            )
        )


class Residual:
    """A chunk's lines with the operation records cut out, as the fast paths leave them.

    The same lines in the same order (so line numbers hold), each operation line less its record's fields
    (what is left of it, "host:pid:tid [dev] NCCL INFO op", holds no marker).  ``marked``: some line holds a rare
    marker or a watched one; when not, the watched scanners have nothing to read in this chunk.
    """

    __slots__ = ("_blocks", "_text", "lines", "marked")

    def __init__(self, lines: int, blocks: list[tuple[list[bytes], bytes]], marked: bool) -> None:
        self.lines = lines  # newlines in the chunk's lines: the lines it holds
        self.marked = marked
        self._blocks = blocks
        self._text: bytes | None = None

    @property
    def text(self) -> bytes:
        """The lines, records cut out ("\\n" before each line, as the parsers' bodies)."""
        if self._text is None:
            self._text = b"".join([b"".join(pieces) + last for pieces, last in self._blocks])
        return self._text


def _blocks(text: bytes, view: memoryview, start: int, stop: int) -> Iterator[memoryview]:
    """text[start:stop] (a "\\n" at ``start``) in blocks of whole lines of about ``_BLOCK`` bytes, each from a
    "\\n", as slices of ``view`` (no copy)."""
    while start < stop:
        end = text.find(b"\n", start + _BLOCK, stop) if start + _BLOCK < stop else -1
        end = stop if end < 0 else end
        yield view[start:end]
        start = end


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
    return NcclWarning(
        proc=proc,
        category=category,
        message=rest.strip(),
        peer=peer[1] if peer else None,
        mismatch=parse_transport_mismatch(rest),
        cite=cite,
    )


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


_OP_MIDDLE_RE = re.compile(b"(" + _SEGMENT_RE.pattern + b")")


class OpRecords:
    """``iter_op_lines``' records of one text, column-wise (``op_records``): ``ids`` holds one small int per
    record, in order; ``key``, ``sig`` and ``line`` say what a record is and where (for the few a verdict cites)."""

    def __init__(self, table: _PairInterner, body: bytes, parts: list[bytes], ids: list[int]) -> None:
        self.ids = ids
        self._table = table
        self._body = body
        self._parts = parts

    def key(self, index: int) -> tuple[ProcKey, str, OpSig]:
        """The process, communicator and signature of id ``index``."""
        table = self._table
        host, _, pid = (table.line_procs[index] or b"?:0").decode(errors="replace").rpartition(":")
        return ProcKey(host, int(pid)), table.comms[index][0].decode(errors="replace"), table.sigs[index]

    def line(self, record: int) -> tuple[int, str]:
        """The 1-based line number and the text of the ``record``-th record, as ``iter_op_lines`` gives them."""
        before = self._parts[: 2 * record + 1]  # the segments and middles before its middle
        line = sum(map(bytes.count, before[0::2], repeat(b"\n")))
        start = sum(map(len, before))
        begin = self._body.rfind(b"\n", 0, start) + 1
        end = self._body.find(b"\n", start)
        return line, self._body[begin : end if end != -1 else None].decode(errors="replace")[:400]


def op_records(data: bytes, table: _PairInterner | None = None) -> OpRecords | None:
    """``iter_op_lines(data)`` column-wise, from one split (``_fast_segments``' way); None where it cannot vouch.

    Every record must be one the general pattern reads alike (``_PairInterner.general``) and none may be left
    that it did not take.  ``table``: one per file (``OpRecords.table``) keeps the ids the same across chunks.
    """
    body = b"\n" + data
    parts = _OP_MIDDLE_RE.split(body)
    segments = parts[0::2]
    if len(segments) == 1:
        return OpRecords(table or op_table(), body, parts, [])
    table = table or op_table()
    distinct = set(segments)
    _segment_info(table.segments, distinct.difference(table.segments), ())
    if any(table.segments[segment][1] & _UNSAFE for segment in distinct):
        return None  # a record the split did not take (the general pattern may read it)
    last = segments.pop()
    ids = list(map(table.__getitem__, zip(segments, segments[1:] + [last])))
    if table.unsafe or not table.general(set(ids)):
        table.unsafe = False
        return None
    return OpRecords(table, body, parts, ids)


def op_table() -> _PairInterner:
    """A table for ``op_records``, for one file."""
    return _PairInterner(())
