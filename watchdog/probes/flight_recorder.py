"""Flight Recorder dumps on demand: the doors (a FIFO per rank, a dump file per rank) and the requests.

Two responders listen on FIFOs in ``run_dir/fr``:

- torch's, for NCCL process groups (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=run_dir/fr/pipe_``):
  ``pipe_<rank>.pipe`` -> ``nccl_trace_rank_<rank>`` (``TORCH_FR_DUMP_TEMP_FILE`` prefix);
- ncclwatch's own, in every rank (launcher/inject/sitecustomize.py):
  ``ncclwatch_pipe.<pid>`` -> ``ncclwatch_trace_<rank>``.

One byte written to the FIFO (``O_WRONLY|O_NONBLOCK``: never block on a rank
that does not read) makes the rank dump and run on.  torch's door works
without the GIL (a C++ thread), so a hang's evidence goes through it where it
exists; but every dump through it prints ``[E] ... ProcessGroupNCCL preparing
to dump debug info`` into the job's stderr, one line per rank, and no setting
turns that line off.  So the performance look of a healthy job asks *quietly*
(``quiet=True``): ncclwatch's door, and ``QUIET_REQUEST``, which that
responder answers without stack traces (the look needs only sizes and times).  A rank's first dump
took 4.2-4.7 s on H200 (torch 2.11 symbolises C++ stack traces once), later
ones <= 1 s: the sidecar primes every rank once the job runs, so a hang finds
the fast path.  A stopped rank cannot answer.

Every rank is asked at once and waited for in parallel; a rank that does not
answer in ``wait_s`` (stopped, dead, or holding the GIL in a C call) simply
has no fresh dump, which the engine reads as a fact
(``comm_rules._silent_ranks``).  ``prime`` asks once without waiting.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

FR_WAIT_S = 10.0
POLL_S = 0.1
FULL_REQUEST = b"1"
QUIET_REQUEST = b"-"  # ncclwatch's responder: no stack traces (launcher/inject/sitecustomize.py reads it)


def fr_files(fr_dir: Path, rank: int, pid: int, *, quiet: bool = False) -> tuple[Path, Path]:
    """(FIFO, dump) of a rank: torch's when its FIFO exists and ``quiet`` is off, else ncclwatch's."""
    torch_pipe = fr_dir / f"pipe_{rank}.pipe"
    if not quiet and torch_pipe.exists():
        return torch_pipe, fr_dir / f"nccl_trace_rank_{rank}"
    return fr_dir / f"ncclwatch_pipe.{pid}", fr_dir / f"ncclwatch_trace_{rank}"


def signature(path: Path) -> tuple[int, int, int] | None:
    """Changes whenever the file is rewritten; mtime alone can tie at coarse timestamp granularity."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st.st_size > 0 else None


def trigger(pipe: Path, request: bytes = FULL_REQUEST) -> str | None:
    try:
        if not stat.S_ISFIFO(pipe.stat().st_mode):
            return f"{pipe.name} is not a FIFO: not written to"
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return f"no Flight Recorder pipe {pipe.name} in {pipe.parent}"
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return f"nobody reads {pipe.name} (ENXIO): the rank is not listening"
        return f"cannot open {pipe.name}: {exc.strerror}"
    try:
        os.write(fd, request)
    except OSError as exc:  # EAGAIN: 64 KiB of earlier triggers unread, the reader is stuck
        return f"cannot write to {pipe.name}: {exc.strerror}"
    finally:
        os.close(fd)
    return None


async def wait_for_new(dump: Path, before: tuple | None, wait_s: float = FR_WAIT_S) -> tuple[str | None, str | None]:
    """(error, note): done once the dump changed and then held still for one poll."""
    deadline = time.monotonic() + wait_s
    last = before
    while time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        now = signature(dump)
        if now is not None and now != before and now == last:
            return None, None
        last = now
    if last is not None and last != before:
        return None, f"the dump was still changing after {wait_s:g} s: may be incomplete"
    return f"no new dump within {wait_s:g} s of the trigger", None


def prime(fr_dir: Path, ranks: Mapping[int, int]) -> int:
    """Ask every rank (rank -> pid) for a dump and do not wait; how many were asked."""
    return sum(trigger(fr_files(fr_dir, rank, pid)[0]) is None for rank, pid in ranks.items())


async def request_dumps(
    fr_dir: Path, ranks: Mapping[int, int], wait_s: float = 3.0, *, quiet: bool = False
) -> tuple[dict[int, Path], dict[int, str]]:
    """Ask every rank (rank -> pid) for a dump; the fresh dump files, and why the others are missing.

    ``quiet``: through ncclwatch's own responder, which prints nothing into the job's output (see
    ``probes/flight_recorder.py``), for a job that is running well.
    """

    async def one(rank: int, pid: int) -> tuple[int, Path, str | None]:
        pipe, dump = fr_files(fr_dir, rank, pid, quiet=quiet)
        before = signature(dump)
        problem = trigger(pipe, QUIET_REQUEST if quiet else FULL_REQUEST)
        if problem is None:
            problem, _ = await wait_for_new(dump, before, wait_s)
        return rank, dump, problem

    results = await asyncio.gather(*(one(rank, pid) for rank, pid in ranks.items()))
    fresh = {rank: dump for rank, dump, problem in results if problem is None}
    errors = {rank: problem for rank, _, problem in results if problem is not None}
    return fresh, errors


def written_since(fr_dir: Path, rank: int, pid: int, since: float) -> tuple[Path, float] | None:
    """This rank's newest dump already on disk, torch's or ncclwatch's file, written at or after ``since``
    (its mtime), with that mtime; None when there is none.

    PyTorch writes its own dump when NCCL fails a communicator (``TORCH_FR_DUMP_TEMP_FILE``), to the file the
    on-demand door writes: on the H100 (FSDP2 mismatch over NET/Socket, "message truncated") that dump recorded
    the divergence 0.4 s after the stall began, and the rank then answered no request.  A dump written after the
    stall began shows where the rank hung as well as a fresh one would.
    """
    found: list[tuple[float, Path]] = []
    for path in {fr_files(fr_dir, rank, pid)[1], fr_files(fr_dir, rank, pid, quiet=True)[1]}:
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_size > 0 and st.st_mtime >= since:
            found.append((st.st_mtime, path))
    if not found:
        return None
    mtime, path = max(found)
    return path, mtime


def read_dump(path: Path) -> list[Event]:
    try:
        return parse_flight_recorder(path.read_bytes(), str(path))
    except OSError:
        return []
