"""The run folder's space: NCCL debug files freed behind the reader, the whole folder held under a cap.

NCCL writes one INFO line per operation (about 170 bytes) for the life of
the job, so an unbounded file is 4-5 GB per rank a day at 300 operations/s.
The NCCL source calls ``consumed`` after each read; what lies between a
file's head and ``keep_bytes`` behind the reader is punched out
(``holes.py``).  What stays, per file:

- the head (``head_bytes``): NCCL's version, Init and transport lines are
  there, which the performance look reads once a minute from its own offset
  (``files.TransportReader``); it skips what was freed ahead of it;
- the last ``keep_bytes`` behind the reader, well over the bundle's tail of
  each file (``EvidenceContext.tail_bytes``, 256 KiB): the bundle still
  copies the same tails;
- what the reader has not reached yet (under one poll's worth).

So a node's NCCL files hold ``ranks x (head + keep)`` plus a poll's backlog,
whatever the job's length or rate.  Every ``check_every_s`` the whole run
folder is measured (``du``: NCCL files, dumps, heartbeats, the journal);
over the cap, heads go too, ``keep_bytes`` shrinks to the bundle's tail,
then NCCL files that have not grown for ``STALE_S`` (earlier restarts'
ranks) are deleted, oldest first.  Each of those steps is said once.

Failure modes: a filesystem that cannot punch holes (``punch_problem``) is
said once and nothing is freed (the folder then grows as before); a file
that cannot be opened for writing is skipped until its next read.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ncclwatch.watchdog.sources.holes import disk_bytes, punch_hole

log = logging.getLogger("ncclwatch")

MIB = 1 << 20
DEFAULT_CAP_BYTES = 256 * MIB
KEEP_BYTES = 1 * MIB  # behind the reader: four times the bundle's 256 KiB tail
MIN_KEEP_BYTES = 320 << 10  # the bundle's tail and a margin: never less
HEAD_BYTES = 1 * MIB
MIN_PUNCH_BYTES = 256 << 10  # fewer, larger punches: one per 256 KiB consumed at most
CHECK_EVERY_S = 10.0
STALE_S = 600.0  # a file the reader saw no growth in for this long belongs to a process gone (an earlier restart)
# Written by ``live.runfolder.make_run_folder``: this folder's NCCL files are ncclwatch's to free, under this cap.
# A folder without it (a capture, a fixture, a folder ``analyze`` reads) is never written to.
SPACE_FILE = "space.json"


class RunFolderSpace:
    """Frees what the NCCL reader consumed and keeps ``root`` under ``cap_bytes``.

    ``punch`` is ``holes.punch_hole`` (injected so tests can make a filesystem refuse); ``clock`` is
    ``time.monotonic``.
    """

    def __init__(
        self,
        root: Path,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        punch: Callable[[int, int, int], None] = punch_hole,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self.keep_bytes = KEEP_BYTES
        self.head_bytes = HEAD_BYTES
        self.punch = punch
        self.clock = clock
        self.freed_to: dict[str, int] = {}  # path -> everything in [head, this) is freed
        # path -> (the reader's offset, when it last moved): a punch changes a file's mtime, so this says when its
        # writer last wrote
        self.grew: dict[str, tuple[int, float]] = {}
        self.unsupported: str | None = None
        self.used_bytes: int | None = None  # at the last check
        self._checked_at: float | None = None
        self._said: set[str] = set()

    @classmethod
    def of(cls, root: Path) -> RunFolderSpace | None:
        """The policy ``root``'s ``SPACE_FILE`` sets, or None where there is none (nothing there is freed)."""
        try:
            cap = json.loads((root / SPACE_FILE).read_text())["cap_bytes"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(root, int(cap)) if isinstance(cap, int) and cap > 0 else None

    @staticmethod
    def declare(root: Path, cap_bytes: int) -> None:
        """Mark ``root`` as a run folder whose NCCL files may be freed, under ``cap_bytes``."""
        (root / SPACE_FILE).write_text(json.dumps({"cap_bytes": cap_bytes}) + "\n")

    def consumed(self, path: str, offset: int) -> None:
        """The reader has parsed ``path`` up to ``offset``: free what lies behind its kept window."""
        now = self.clock()
        if self.grew.get(path, (None, 0.0))[0] != offset:
            self.grew[path] = (offset, now)
        if self.unsupported is not None:
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # gone, or not ours to write: the next read tries again
        try:
            block = os.fstat(fd).st_blksize or 4096
            start = max(self.freed_to.get(path, 0), -(-self.head_bytes // block) * block)
            stop = (offset - self.keep_bytes) // block * block
            if stop - start >= MIN_PUNCH_BYTES:
                self.punch(fd, start, stop - start)
                self.freed_to[path] = stop
        except OSError as exc:
            self.unsupported = f"cannot free NCCL debug files behind the reader ({exc.strerror or exc})"
            self._say(f"{self.unsupported}: the run folder {self.root} grows with the job")
        finally:
            os.close(fd)

    def check(self, offsets: dict[str, int]) -> None:
        """Every ``CHECK_EVERY_S``: measure the run folder; over the cap, free more (see the module docstring)."""
        now = self.clock()
        if self._checked_at is not None and now - self._checked_at < CHECK_EVERY_S:
            return
        self._checked_at = now
        self.used_bytes = disk_bytes(self.root)
        if self.used_bytes <= self.cap_bytes:
            return
        if self.head_bytes or self.keep_bytes > MIN_KEEP_BYTES:
            self._say(
                f"run folder {self.root} uses {self.used_bytes / MIB:.0f} MiB, over its cap of "
                f"{self.cap_bytes / MIB:.0f} MiB: NCCL files keep only their last {MIN_KEEP_BYTES >> 10} KiB "
                "(the performance look may miss transport lines)"
            )
            self.head_bytes, self.keep_bytes = 0, MIN_KEEP_BYTES
            for path, offset in offsets.items():
                self.freed_to.pop(path, None)  # the head is freed too now
                self.consumed(path, offset)
            self.used_bytes = disk_bytes(self.root)
        if self.used_bytes > self.cap_bytes:
            self._drop_stale(offsets)

    def _drop_stale(self, offsets: dict[str, int]) -> None:
        """Delete NCCL files no process wrote for ``STALE_S``, oldest first, until the folder is under its cap."""
        now = self.clock()
        stale = sorted((at, path) for path, (_, at) in self.grew.items() if now - at > STALE_S)
        for _, path in stale:
            if self.used_bytes is None or self.used_bytes <= self.cap_bytes:
                break
            try:
                freed = os.lstat(path).st_blocks * 512
                os.unlink(path)
            except OSError:
                continue
            self.used_bytes -= freed
            for known in (self.freed_to, self.grew, offsets):
                known.pop(path, None)
            self._say(f"run folder over its cap: deleted NCCL files unwritten for {STALE_S:.0f} s (earlier restarts)")
        if self.used_bytes > self.cap_bytes:
            self._say(
                f"run folder {self.root} still uses {self.used_bytes / MIB:.0f} MiB, over its cap of "
                f"{self.cap_bytes / MIB:.0f} MiB, with nothing more ncclwatch may free"
            )

    def _say(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            log.warning("ncclwatch: %s", text)
