"""Flight Recorder dumps on demand, while the job runs.

Two doors into a worker (both set up by the launcher, see launcher/env.py):

- PyTorch's NCCL process group makes a FIFO ``<fr>/pipe_<rank>.pipe``
  (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``); a byte written to it makes the rank
  dump to ``<fr>/nccl_trace_rank_<rank>`` within about a second, from a C++
  thread, whatever Python is doing.
- For other backends (gloo) the injected responder thread reads
  ``<fr>/ncclwatch_pipe.<pid>`` and writes ``<fr>/ncclwatch_trace_<rank>``.

A stopped or dead rank cannot answer: its dump is simply absent, which the
engine reads as a fact (``detectors._silent_ranks``).  Opening a FIFO with
``O_NONBLOCK`` fails with ENXIO when nobody reads it: never blocks.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Mapping
from pathlib import Path

from ..parsing.flight_recorder import parse_flight_recorder
from ..types import Event


def doors(fr_dir: Path, rank: int, pid: int) -> list[tuple[Path, Path]]:
    """(pipe, dump file) pairs that exist for this rank, PyTorch's own first."""
    pairs = [
        (fr_dir / f"pipe_{rank}.pipe", fr_dir / f"nccl_trace_rank_{rank}"),
        (fr_dir / f"ncclwatch_pipe.{pid}", fr_dir / f"ncclwatch_trace_{rank}"),
    ]
    return [(pipe, dump) for pipe, dump in pairs if pipe.exists()]


def knock(pipe: Path) -> str | None:
    """Write one byte; the error in words, or None."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        return "nobody reads the pipe (rank not running it)" if exc.errno == errno.ENXIO else f"cannot open: {exc.strerror}"
    try:
        os.write(fd, b"1")
    except OSError as exc:
        return f"cannot write: {exc.strerror}"
    finally:
        os.close(fd)
    return None


def _stamp(path: Path) -> tuple[float, int]:
    try:
        stat = path.stat()
    except OSError:
        return 0.0, 0
    return stat.st_mtime, stat.st_size


async def request_dumps(fr_dir: Path, ranks: Mapping[int, int], wait_s: float = 3.0) -> tuple[dict[int, Path], dict[int, str]]:
    """Ask every rank (rank -> pid) for a dump; the fresh dump files, and why the others are missing."""
    asked: dict[int, tuple[Path, float]] = {}  # rank -> (dump file, its mtime before we asked)
    errors: dict[int, str] = {}
    for rank, pid in ranks.items():
        pairs = doors(fr_dir, rank, pid)
        if not pairs:
            errors[rank] = "no Flight Recorder pipe (torch without it, or the rank has not created its process group)"
            continue
        problems = []
        for pipe, dump in pairs:
            before = _stamp(dump)[0]
            problem = knock(pipe)
            if problem is None:
                asked[rank] = (dump, before)
                break
            problems.append(f"{pipe.name}: {problem}")
        else:
            errors[rank] = "; ".join(problems)
    fresh: dict[int, Path] = {}
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        for rank, (dump, before) in list(asked.items()):
            mtime, size = _stamp(dump)
            # PyTorch writes the file in place: fresh once its size held still for one poll.
            if mtime > before and size > 0 and sizes.get(rank) == size:
                fresh[rank] = dump
                del asked[rank]
            sizes[rank] = size
    for rank in asked:
        errors[rank] = f"no dump within {wait_s:g} s (stopped, or stuck holding the GIL)"
    return fresh, errors


def read_dump(path: Path) -> list[Event]:
    try:
        return parse_flight_recorder(path.read_bytes(), str(path))
    except OSError:
        return []
