"""The kernel log, live: the GPU driver's Xid lines as they come (``/dev/kmsg``).

``/dev/kmsg`` gives one record per ``read``: ``<priority>,<sequence>,<microseconds since boot>,<flags>;<text>``,
then continuation lines that start with a space (``SUBSYSTEM=pci``).  Opened non-blocking and moved to its end
(``SEEK_END``: only records written from now on), so the sidecar reads what happens while the job runs, never a
past boot's faults; ``EAGAIN`` means nothing new, ``EPIPE`` that records were overwritten before we read them
(the next read goes on from the oldest kept).  A plain file is read the same way (many records per read), which
is how the tests feed it.

Failure modes, by design: without permission (``dmesg_restrict``, a container without ``/dev/kmsg``) the source
says so once (``SourceDown``: ``ncclwatch_source_up{source="kmsg"} 0``) and stops: the verdicts then lack the Xid,
as they did before, and nothing else changes.  An Xid the driver
repeats (code, GPU, pid) is emitted once.
"""

from __future__ import annotations

import errno
import os

from ncclwatch.watchdog.events import SourceDown
from ncclwatch.watchdog.parsing.kernel_log import MARKER, parse_xid_line
from ncclwatch.watchdog.sources import Emit, PollingSource

KMSG = "/dev/kmsg"
_READ_BYTES = 8192  # /dev/kmsg's largest record is 1 KiB (PRINTK message); a plain file is read in pieces this size
_READS_PER_POLL = 4096


class KmsgSource(PollingSource):
    name = "kmsg"
    interval = 1.0

    def __init__(self, path: str = KMSG, host: str | None = None) -> None:
        self.path = path
        self.host = host  # the kernel log names no host: this node's
        self._fd: int | None = None
        self._off = False  # not readable here: stopped for good
        self._partial = b""
        self._seen: set[tuple[int, str, int | None]] = set()

    def poll(self, emit: Emit) -> None:
        if self._off:
            return
        if self._fd is None and not self._open(emit):
            return
        for _ in range(_READS_PER_POLL):
            try:
                data = os.read(self._fd, _READ_BYTES)  # type: ignore[arg-type]
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before read: go on from the oldest record kept
                    continue
                self._close()
                return
            if not data:
                return  # a plain file's end; /dev/kmsg says EAGAIN instead
            self._lines(data, emit)

    def _open(self, emit: Emit) -> bool:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as exc:
            self._close()
            reason = f"cannot read {self.path} ({exc.strerror}): the GPU driver's Xid lines are not seen live"
            emit(SourceDown(source=self.name, reason=reason))
            return False
        return True

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self._off = True

    def _lines(self, data: bytes, emit: Emit) -> None:
        text = self._partial + data
        cut = text.rfind(b"\n") + 1
        self._partial = text[cut:]
        for line in text[:cut].split(b"\n"):
            if MARKER not in line or line.startswith(b" "):
                continue
            event = parse_xid_line(line.decode(errors="replace"), self.path, None)
            if event is None or (event.code, event.bus_id, event.pid) in self._seen:
                continue
            self._seen.add((event.code, event.bus_id, event.pid))
            emit(event.model_copy(update={"host": event.host or self.host}))
