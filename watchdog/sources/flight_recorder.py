"""Flight Recorder dumps on demand, while the job runs (the probe's source).

The doors are in ``probes/flight_recorder.py``.  Every rank is asked at once
and waited for in parallel; a rank that does not answer in ``wait_s``
(stopped, dead, or holding the GIL in a C call) simply has no fresh dump,
which the engine reads as a fact (``detectors._silent_ranks``).  ``prime``
asks once without waiting, so the slow first dump (C++ symbolisation) is
paid while the job is healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.probes.flight_recorder import FULL_REQUEST, QUIET_REQUEST, fr_files, signature, trigger, wait_for_new
from ncclwatch.watchdog.events import Event


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
