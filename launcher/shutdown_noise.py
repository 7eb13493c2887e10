"""torchrun's stderr through a relay that hides torchrun's own answer to ``--on-hang kill``.

When ``--on-hang kill`` ends a hung job, the wrapper SIGTERMs torchrun, and
torch 2.13's torchrun answers with log lines and a ~30-line traceback
(``tests/fixtures/torchrun-sigterm-2.13.txt``)::

    W1123 ... api.py:753] Received 15 death signal, shutting down workers
    W1123 ... api.py:1028] Sending process 29004 closing signal SIGTERM
    Traceback (most recent call last):
      ...
    torch.distributed.elastic.multiprocessing.api.SignalException: Process 28991 got signal: 15

right under the verdict, where it reads like a second failure.  So with
``--on-hang kill`` torchrun's stderr is a pipe that ``StderrRelay`` drains
into ours through ``ShutdownNoiseFilter``, whose rules make sure nothing real
is hidden:

* Until the wrapper decides to end the job, every byte passes as it comes,
  not a line at a time (a progress bar's ``\\r`` updates still move).
  ``arm_after(n)`` lets the ``n`` bytes already in the pipe at the decision
  pass too: they were written before it.
* Then complete lines are looked at (one begun before passes whole):

  - ``Received <sig> death signal, shutting down workers`` is dropped, and
    after it, up to the traceback, the ``Sending process N closing signal
    <sig>`` lines (torchrun also prints those when a worker crashes: without
    the first line they pass);
  - a ``Traceback (most recent call last):`` is held while its lines are
    indented, and dropped if it ends with ``SignalException: Process N got
    signal: <sig>``.  Any other end (another exception, ``During handling``,
    any line at column 0) or more than ``MAX_HELD_LINES`` lines lets the held
    lines out unchanged, before the line that ended them;
  - everything else passes.

* One line, dim on a terminal, says what was hidden, where it was.

Every run has the relay, because the wrapper reads the job's stderr as it
goes by (``tap``: the lines that explain a rank's death, ``job_output.py``);
only ``--on-hang kill`` arms the filter when it ends the job.  The workers
inherit torchrun's stderr, so their output goes through the relay too, all
of it passed.  Only stderr: stdout is untouched,
so lines of the two can come out in a slightly different order than written.
When our stderr is a terminal, torchrun gets a pseudo-terminal of the same
size instead of a pipe, so it and the workers still see a terminal (colour,
progress bar width); the wrapper copies size changes (``copy_window_size`` on
SIGWINCH).  The relay is a thread, so an event loop busy elsewhere never
leaves torchrun blocked on a full pipe.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import select
import signal
import struct
import termios
import threading
import time
import tty
from collections.abc import Callable

MAX_HELD_LINES = 200  # torch 2.13's SignalException traceback has 28
_TRACEBACK_START = b"Traceback (most recent call last):"
_IDLE_MS = 200  # once closing, this long without output ends the relay
_READ_SIZE = 1 << 16
_WHY = "its answer to being stopped by ncclwatch after a hang"
log = logging.getLogger("ncclwatch")


class ShutdownNoiseFilter:
    """Bytes in, bytes out: ``feed`` each chunk, ``finish`` at the end; ``arm_after`` when the job is being ended.

    Pure (no I/O); see the module docstring for the rules.
    """

    def __init__(self, sig: int = signal.SIGTERM, *, dim: bool = False) -> None:
        number, name = int(sig), signal.Signals(sig).name
        said = rf"(?:{number}|(?:Signals\.)?{name})"  # torch logs the number (2.13) or the enum (older)
        self._received = re.compile(rf"Received {said} death signal, shutting down workers$".encode())
        self._closing = re.compile(rf"Sending process \d+ closing signal (?:Signals\.)?{name}$".encode())
        self._signal_exception = re.compile(rf"(?:[\w.]+\.)?SignalException: Process \d+ got signal: {number}".encode())
        self._dim = dim
        self._unarmed_left: int | None = None  # bytes still to pass before arming; None: not asked to arm yet
        self._armed = False
        self._mid_line = False  # the last byte passed unarmed did not end a line
        self._old_line = False  # armed, and the current line began before
        self._partial = b""  # armed: the start of a line not yet complete
        self._held: list[bytes] = []  # armed: a traceback that may be torchrun's SignalException
        self._shutting_down = False  # armed, and torchrun said "Received ... death signal"
        self._hidden_log_lines = 0  # not yet said

    def arm_after(self, pending: int) -> None:
        """Look at what comes after the next ``pending`` bytes; only the first call counts."""
        if self._armed or self._unarmed_left is not None:
            return
        self._unarmed_left = pending
        if pending == 0:
            self._arm()

    def _arm(self) -> None:
        self._armed = True
        self._old_line = self._mid_line

    def feed(self, data: bytes) -> bytes:
        """What to write for ``data``; an armed filter keeps back incomplete lines and held tracebacks."""
        out = []
        if not self._armed:
            head = data if self._unarmed_left is None else data[: self._unarmed_left]
            if head:
                out.append(head)
                self._mid_line = not head.endswith(b"\n")
            data = data[len(head) :]
            if self._unarmed_left is not None:
                self._unarmed_left -= len(head)
                if self._unarmed_left == 0:
                    self._arm()
            if not data:
                return b"".join(out)
        if self._old_line:
            end = data.find(b"\n") + 1
            out.append(data[:end] if end else data)
            if not end:
                return b"".join(out)
            self._old_line, data = False, data[end:]
        *lines, self._partial = (self._partial + data).split(b"\n")
        out.extend(self._line(line + b"\n") for line in lines)
        return b"".join(out)

    def _line(self, line: bytes) -> bytes:
        text = line.rstrip(b"\r\n")
        if self._held:
            if text.startswith((b" ", b"\t")) and len(self._held) < MAX_HELD_LINES:
                self._held.append(line)
                return b""
            held, self._held = b"".join(self._held), []
            if self._signal_exception.fullmatch(text):
                self._shutting_down = False  # the traceback is torchrun's last word
                return self._notice(traceback=True)
            return held + self._line(line)
        if text == _TRACEBACK_START:
            self._held = [line]
            return b""
        if self._received.search(text) or (self._shutting_down and self._closing.search(text)):
            self._shutting_down = True
            self._hidden_log_lines += 1
            return b""
        return line

    def finish(self) -> bytes:
        """At the end of the output: the notice still owed, then whatever was kept back, unchanged."""
        notice = self._notice(traceback=False) if self._hidden_log_lines else b""
        rest, self._held, self._partial = b"".join(self._held) + self._partial, [], b""
        return notice + rest

    def _notice(self, *, traceback: bool) -> bytes:
        count = self._hidden_log_lines
        self._hidden_log_lines = 0
        hidden = ["shutdown traceback"] if traceback else []
        if count:
            hidden.append(f"{count} shutdown log line{'s' * (count != 1)}")
        text = f"ncclwatch: torchrun's {' and '.join(hidden)} hidden ({_WHY})"
        return (f"\x1b[2m{text}\x1b[0m\n" if self._dim else f"{text}\n").encode()


class StderrRelay:
    """A stderr for torchrun, drained by a thread into ``out_fd`` through a ``ShutdownNoiseFilter``.

    Give ``child_fd`` to the child, then ``close_child_end()`` (also when
    starting it failed); ``hide_shutdown_noise()`` just before signalling;
    ``close()`` once the job's processes are gone.
    """

    def __init__(self, out_fd: int = 2, tap: Callable[[bytes], None] | None = None) -> None:
        self._out = out_fd
        self._tap = tap  # sees every byte the job wrote, before any filtering, in the relay's thread
        self.last_read_at = time.monotonic()  # when the job last wrote (``quiet``)
        self.ended = threading.Event()  # every writer closed its end: the job's output is complete
        self.is_terminal = os.isatty(out_fd)
        # One read and its filtering, against hide_shutdown_noise's count; the fd's closing, against its users.
        self._lock = threading.Lock()
        if self.is_terminal:
            self._read_fd, self.child_fd = os.openpty()
            tty.setraw(self.child_fd)  # bytes as written: our own terminal does the output processing
            self.copy_window_size()
        else:
            self._read_fd, self.child_fd = os.pipe()
        self._filter = ShutdownNoiseFilter(dim=self.is_terminal)
        self._closing = False
        self._thread = threading.Thread(target=self._relay, name="ncclwatch-stderr-relay", daemon=True)
        self._thread.start()

    def close_child_end(self) -> None:
        """Our copy of the child's end: closed, so the relay sees the end when the job's last process exits."""
        os.close(self.child_fd)

    def copy_window_size(self) -> None:
        """Give the pseudo-terminal our terminal's size (at start and on SIGWINCH)."""
        with self._lock:
            if self._read_fd < 0:
                return
            try:
                termios.tcsetwinsize(self._read_fd, termios.tcgetwinsize(self._out))
            except (termios.error, OSError):
                pass

    def hide_shutdown_noise(self) -> None:
        """Filter what is written from now on: the bytes already waiting in the pipe pass as they are."""
        with self._lock:
            if self._read_fd >= 0:
                self._filter.arm_after(_unread_bytes(self._read_fd))

    def close(self, timeout_s: float = 5.0) -> None:
        """Relay the rest and stop at its end, or once nothing came for 0.2 s; waits at most ``timeout_s``."""
        self._closing = True
        self._thread.join(timeout_s)

    def _relay(self) -> None:
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        while True:
            if not poller.poll(_IDLE_MS):
                if self._closing:
                    break
                continue
            with self._lock:
                try:
                    data = os.read(self._read_fd, _READ_SIZE)
                except OSError:  # EIO: a pseudo-terminal whose last writer closed it
                    data = b""
                out = self._filter.feed(data) if data else b""
            if not data:
                break
            self.last_read_at = time.monotonic()
            self._write(out)
            self._pass_to_tap(data)
        self.ended.set()
        self._write(self._filter.finish())
        with self._lock:
            os.close(self._read_fd)
            self._read_fd = -1  # never a number the process reuses for another file

    def quiet(self, quiet_s: float) -> bool:
        """Whether the job's output has ended or nothing came for ``quiet_s``."""
        return self.ended.is_set() or time.monotonic() - self.last_read_at >= quiet_s

    def _pass_to_tap(self, data: bytes) -> None:
        """A tap that raises is dropped: the relay, and so the job's output, never depends on it."""
        if self._tap is None:
            return
        try:
            self._tap(data)
        except Exception:
            self._tap = None
            log.exception("reading the job's output failed; it is still relayed, no longer read")

    def _write(self, data: bytes) -> None:
        """All of ``data`` to ``out_fd``; if it cannot take it (closed), dropped, and the relay goes on draining."""
        try:
            while data:
                data = data[os.write(self._out, data) :]
        except OSError:
            pass


def _unread_bytes(fd: int) -> int:
    """Bytes waiting in a pipe or pseudo-terminal (FIONREAD)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0
