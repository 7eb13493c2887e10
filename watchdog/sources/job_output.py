"""The job's stderr as it goes by: the lines that explain a rank's death, and a copy in the run folder.

The wrapper relays torchrun's stderr (the ranks inherit it) to the terminal in a thread of its own
(``launcher/shutdown_noise.py``) and hands every chunk to ``feed`` on the way.  ``run`` writes the chunks to
``<run>/output/stderr.log`` (the bundle copies it, and ``ncclwatch analyze`` on the run folder reads the same
lines, so offline gives the live verdict) and parses them with ``TorchLogParser`` (PyTorch's watchdog timeouts,
DETAIL mismatches, network errors) and ``FailureLines`` (why each rank died: tracebacks, NCCL and gloo errors,
CUDA errors, torchrun's summary).  A job stays observed even when its output is not: nothing here can block or
slow the relay (``feed`` only appends to a deque).

The copy is bounded: at ``FILE_MAX`` bytes it becomes ``stderr.1.log`` (the one before is dropped) and a new
``stderr.log`` begins, so a job that prints for a month keeps at most twice that.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path

from ncclwatch.watchdog.parsing.failure_lines import FailureLines
from ncclwatch.watchdog.parsing.torch_log import TorchLogParser
from ncclwatch.watchdog.sources import Emit

FILE_MAX = 8 << 20
FILE_NAME = "stderr.log"
OLDER_NAME = "stderr.1.log"


class JobOutputSource:
    """``feed`` from any thread; ``run`` in the sidecar's loop; ``caught_up`` once the job's output ended."""

    name = "job_output"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / FILE_NAME
        self._chunks: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived = asyncio.Event()
        # PyTorch's diagnostics (timeouts, DETAIL mismatches, network errors) and why each rank died (tracebacks,
        # NCCL and gloo errors, torchrun's summary); stamped with the time a line arrived, where it prints none.
        self._parsers = (TorchLogParser(str(self.path)), FailureLines(str(self.path), clock=True))
        self._written = 0

    def feed(self, data: bytes) -> None:
        """A chunk of the job's stderr (the relay's thread)."""
        with self._lock:
            self._chunks.append(data)
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._arrived.set)

    async def run(self, emit: Emit) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._loop = asyncio.get_running_loop()
        while True:
            self._take(emit)
            await self._arrived.wait()
            self._arrived.clear()

    async def caught_up(self, emit: Emit) -> None:
        """Everything fed so far parsed and emitted (the job ended: its last lines decide a failure's verdict)."""
        self._take(emit, final=True)

    def _take(self, emit: Emit, final: bool = False) -> None:
        with self._lock:
            chunks, self._chunks = list(self._chunks), collections.deque()
        data = b"".join(chunks)
        if data:
            self._keep(data)
        for parser in self._parsers:
            for event in parser.feed(data, final=final):
                emit(event)

    def _keep(self, data: bytes) -> None:
        if self._written + len(data) > FILE_MAX and self._written:
            self.path.replace(self.folder / OLDER_NAME)
            self._written = 0
        with self.path.open("ab") as out:
            out.write(data)
        self._written += len(data)
