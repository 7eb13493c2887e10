"""Sources that read the run folder: NCCL debug files and heartbeat files.

NCCL opens its debug file when a process first logs and truncates it at open;
2.27+ writes it line-buffered, older versions may leave a partial last line,
which the incremental parser keeps until the rest arrives.  A file that
shrinks was re-created (same pid reused, or a user truncating it): its parser
starts over and a note says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from ncclwatch.watchdog.events import Citation, RankTransport, Unusable
from ncclwatch.watchdog.parsing.heartbeat import parse_heartbeat
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.parsing.transport import TransportScanner
from ncclwatch.watchdog.sources import DownOnce, Emit, PollingSource
from ncclwatch.watchdog.sources.holes import data_after, hole_after, last_line_end, line_start_from
from ncclwatch.watchdog.sources.run_space import RunFolderSpace

READ_LIMIT = 8 << 20  # bytes per file per poll: a burst is caught up over several polls
R = TypeVar("R")


@dataclass
class _Tail(Generic[R]):
    reader: R
    inode: int
    offset: int = 0


class FolderTails(Generic[R]):
    """The bytes appended to each file of ``folder`` since the last ``read``, each file with a reader of its own.

    A file new to us, re-created (another inode) or truncated is read from
    its start with a fresh reader (``new_reader(path)``).  At most ``limit``
    bytes per file per read: a burst is caught up over several reads.
    """

    def __init__(self, folder: Path, new_reader: Callable[[str], R], limit: int = READ_LIMIT) -> None:
        self.folder = folder
        self.new_reader = new_reader
        self.limit = limit
        self.tails: dict[str, _Tail[R]] = {}

    def read(self) -> list[tuple[str, R, bytes, bool]]:
        """(path, its reader, the new bytes, whether it started over) per file that changed.

        Raises ``OSError`` when the folder cannot be listed; a file gone between listing and reading is skipped.
        """
        changed = []
        for entry in [e for e in os.scandir(self.folder) if e.is_file()]:
            try:
                stat = entry.stat()
            except OSError:
                continue
            tail = self.tails.get(entry.path)
            restarted = tail is not None and (stat.st_ino != tail.inode or stat.st_size < tail.offset)
            if tail is None or restarted:
                tail = self.tails[entry.path] = _Tail(self.new_reader(entry.path), inode=stat.st_ino)
            if stat.st_size == tail.offset and not restarted:
                continue
            try:
                with open(entry.path, "rb") as handle:
                    start, stop = _readable(handle.fileno(), tail.offset, stat.st_size)
                    handle.seek(start)
                    data = handle.read(min(self.limit, stop - start))
            except OSError:
                continue  # gone between scandir and open; the next read sees it
            tail.offset = start + len(data)
            changed.append((entry.path, tail.reader, data, restarted))
        return changed


def _readable(fd: int, offset: int, size: int) -> tuple[int, int]:
    """(where to read from, where to stop): whole lines only around a hole, and never into one (its zeros are no
    text).  Holes are freed behind another reader of the file (``run_space.py``), or before this one came to it.
    The partial line before a hole and the rest of one after it are skipped, so a reader never joins them."""
    start = data_after(fd, offset)
    if start > offset:
        start = line_start_from(fd, start, size)
    while start < size:
        hole = hole_after(fd, start)
        if hole >= size:
            return start, size
        stop = last_line_end(fd, start, hole)
        if stop > start:
            return start, stop
        start = line_start_from(fd, data_after(fd, hole), size)  # no whole line before the hole: past it
    return size, size


@dataclass
class _NcclLog:
    parser: NcclLogParser
    garbled_seen: int = 0


class NcclFileSource(PollingSource):
    """Tails every NCCL debug file in ``folder`` as it appears."""

    name = "nccl_log"

    def __init__(self, folder: Path, interval: float = 0.25, space: RunFolderSpace | None | bool = True) -> None:
        """``space``: what frees the files behind this reader; True: the run folder's own policy (``SPACE_FILE``
        in ``folder``'s parent), none where it has none."""
        self.folder = folder
        self.interval = interval
        self._tails = FolderTails(folder, lambda path: _NcclLog(NcclLogParser(path)))
        self._down = DownOnce(self.name)
        self.space = RunFolderSpace.of(folder.parent) if space is True else space or None

    @property
    def files(self) -> list[str]:
        return sorted(self._tails.tails)

    def poll(self, emit: Emit) -> None:
        try:
            changed = self._tails.read()
        except OSError as exc:
            self._down(emit, f"cannot list {self.folder}: {exc.strerror}")
            return
        self._down(emit, None)
        for path, log, data, restarted in changed:
            if restarted:
                emit(
                    Unusable(
                        reason="file was truncated or re-created; reading it again from the start",
                        cite=Citation(file=path),
                    )
                )
            for event in log.parser.feed(data):
                emit(event)
            if log.parser.garbled > log.garbled_seen:
                log.garbled_seen = log.parser.garbled
                emit(Unusable(reason=f"{log.garbled_seen} garbled operation line(s) skipped", cite=Citation(file=path)))
            if self.space is not None:
                self.space.consumed(path, self._tails.tails[path].offset)
        if self.space is not None:
            self.space.check({path: tail.offset for path, tail in self._tails.tails.items()})


class TransportReader:
    """The transports NCCL chose (init and channel lines) in every debug file of ``folder``, read when asked.

    Not a source: transports matter once a minute (the performance look,
    ``live/performance_look.py``), and scanning for them costs about what parsing the
    operations does, so they are read then, from where the last call stopped,
    off the per-poll path.  ``read_limit`` bounds one call per file; a
    backlog is caught up over later calls.  Call it from one thread at a time.
    """

    def __init__(self, folder: Path, read_limit: int = 8 * READ_LIMIT) -> None:
        self._tails = FolderTails(folder, lambda path: TransportScanner(), read_limit)

    def facts(self) -> list[RankTransport]:
        try:
            changed = self._tails.read()
        except OSError:
            return []  # the NCCL source says the folder is unreadable
        for _, scanner, data, _ in changed:
            scanner.feed(data)
        return [fact for tail in self._tails.tails.values() for fact in tail.reader.facts()]


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
