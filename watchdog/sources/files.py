"""Sources that read the run folder: NCCL debug files and heartbeat files.

NCCL opens its debug file when a process first logs and truncates it at open;
2.27+ writes it line-buffered, older versions may leave a partial last line,
which the incremental parser keeps until the rest arrives.  A file that
shrinks was re-created (same pid reused, or a user truncating it): its parser
starts over and a note says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ncclwatch.watchdog.parsing.heartbeat import parse_heartbeat
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.parsing.transport import RankTransport, TransportScanner
from ncclwatch.watchdog.events import Citation, Unusable
from ncclwatch.watchdog.sources import DownOnce, Emit, PollingSource

READ_LIMIT = 8 << 20  # bytes per file per poll: a burst is caught up over several polls


@dataclass
class _Tail:
    parser: NcclLogParser
    offset: int = 0
    inode: int = 0
    garbled_seen: int = 0


class NcclFileSource(PollingSource):
    """Tails every NCCL debug file in ``folder`` as it appears."""

    name = "nccl_log"

    def __init__(self, folder: Path, interval: float = 0.25) -> None:
        self.folder = folder
        self.interval = interval
        self._tails: dict[str, _Tail] = {}
        self._down = DownOnce(self.name)

    @property
    def files(self) -> list[str]:
        return sorted(self._tails)

    def poll(self, emit: Emit) -> None:
        try:
            entries = [e for e in os.scandir(self.folder) if e.is_file()]
        except OSError as exc:
            self._down(emit, f"cannot list {self.folder}: {exc.strerror}")
            return
        self._down(emit, None)
        for entry in entries:
            self._read(entry.path, entry.stat(), emit)

    def _read(self, path: str, stat: os.stat_result, emit: Emit) -> None:
        tail = self._tails.get(path)
        if tail is None or stat.st_ino != tail.inode or stat.st_size < tail.offset:
            if tail is not None:
                emit(Unusable(reason="file was truncated or re-created; reading it again from the start", cite=Citation(file=path)))
            tail = self._tails[path] = _Tail(NcclLogParser(path), inode=stat.st_ino)
        if stat.st_size == tail.offset:
            return
        try:
            with open(path, "rb") as handle:
                handle.seek(tail.offset)
                data = handle.read(READ_LIMIT)
        except OSError:
            return  # gone between scandir and open; the next poll sees it
        tail.offset += len(data)
        for event in tail.parser.feed(data):
            emit(event)
        if tail.parser.garbled > tail.garbled_seen:
            tail.garbled_seen = tail.parser.garbled
            emit(Unusable(reason=f"{tail.garbled_seen} garbled operation line(s) skipped", cite=Citation(file=path)))


@dataclass
class _TransportTail:
    scanner: TransportScanner
    inode: int
    offset: int = 0


class TransportReader:
    """The transports NCCL chose (init and channel lines) in every debug file of ``folder``, read when asked.

    Not a source: transports matter once a minute (the performance look,
    ``live/perf.py``), and scanning for them costs about what parsing the
    operations does, so they are read then, from where the last call stopped,
    off the per-poll path.  ``read_limit`` bounds one call per file; a
    backlog is caught up over later calls.  Call it from one thread at a time.
    """

    def __init__(self, folder: Path, read_limit: int = 8 * READ_LIMIT) -> None:
        self.folder = folder
        self.read_limit = read_limit
        self._tails: dict[str, _TransportTail] = {}

    def facts(self) -> list[RankTransport]:
        try:
            entries = [e for e in os.scandir(self.folder) if e.is_file()]
        except OSError:
            return []  # the NCCL source says the folder is unreadable
        for entry in entries:
            try:
                stat = entry.stat()
            except OSError:
                continue
            tail = self._tails.get(entry.path)
            if tail is None or stat.st_ino != tail.inode or stat.st_size < tail.offset:
                tail = self._tails[entry.path] = _TransportTail(TransportScanner(), inode=stat.st_ino)
            if stat.st_size == tail.offset:
                continue
            try:
                with open(entry.path, "rb") as handle:
                    handle.seek(tail.offset)
                    data = handle.read(self.read_limit)
            except OSError:
                continue
            tail.offset += len(data)
            tail.scanner.feed(data)
        return [fact for tail in self._tails.values() for fact in tail.scanner.facts()]


class HeartbeatSource(PollingSource):
    """Reads ``<run>/hb/<pid>.json``; emits a ``Heartbeat`` when one changed."""

    name = "heartbeat"

    def __init__(self, folder: Path, interval: float = 0.25) -> None:
        self.folder = folder
        self.interval = interval
        self._seen: dict[str, tuple[int, int]] = {}
        self._down = DownOnce(self.name)

    def poll(self, emit: Emit) -> None:
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.endswith(".json")]
        except OSError as exc:
            self._down(emit, f"cannot list {self.folder}: {exc.strerror}")
            return
        self._down(emit, None)
        for entry in entries:
            try:
                stat = entry.stat()
                key = (stat.st_mtime_ns, stat.st_ino)
                if self._seen.get(entry.path) == key:
                    continue
                data = Path(entry.path).read_bytes()
            except OSError:
                continue
            self._seen[entry.path] = key
            beat = parse_heartbeat(data)
            if beat is not None:
                emit(beat)
