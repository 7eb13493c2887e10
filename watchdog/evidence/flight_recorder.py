"""Flight Recorder dumps on demand, one per rank [fr/<dump name>].

Two responders listen on FIFOs in ``run_dir/fr``:

- torch's, for NCCL process groups (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=run_dir/fr/pipe_``):
  ``pipe_<rank>.pipe`` -> ``nccl_trace_rank_<rank>`` (``TORCH_FR_DUMP_TEMP_FILE`` prefix);
- ncclwatch's own, for gloo: ``ncclwatch_pipe.<pid>`` -> ``ncclwatch_trace_<rank>``.

One byte written to the FIFO (``O_WRONLY|O_NONBLOCK``: never block on a rank
that does not read) makes the rank dump and run on: its first dump within
about 5 s, later ones within about a second.
Failure modes, each an error record for that rank: no FIFO; nobody reading it
(ENXIO: the rank never armed it, or exited); a stopped rank (state T cannot
answer: not triggered); no new dump within ``FR_WAIT_S``.  A dump that was
already there (e.g. written on a timeout) is still copied, with a note that
it predates this trigger.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import time
from pathlib import Path

from ..probes.procfs import STOPPED, proc_state
from .base import EvidenceContext, EvidenceRecord, RankTarget, guard, placeholder, rank_problem, record

# A rank's first dump took 4.2-4.7 s on H200 (torch 2.11: it symbolises C++ stack traces), later ones <= 1 s
FR_WAIT_S = 10.0
POLL_S = 0.1
TIMEOUT_S = FR_WAIT_S + 3.0  # the wait, plus copying dumps of a few MB


def fr_files(fr_dir: Path, target: RankTarget) -> tuple[Path, Path]:
    """(FIFO, dump) of a rank: torch's when its FIFO exists, else ncclwatch's."""
    torch_pipe = fr_dir / f"pipe_{target.rank}.pipe"
    if torch_pipe.exists():
        return torch_pipe, fr_dir / f"nccl_trace_rank_{target.rank}"
    return fr_dir / f"ncclwatch_pipe.{target.pid}", fr_dir / f"ncclwatch_trace_{target.rank}"


async def collect_flight_recorder(ctx: EvidenceContext) -> list[EvidenceRecord]:
    if ctx.run_dir is None:
        return [record("flight_recorder", time.monotonic(), error="no run folder: Flight Recorder pipes unknown")]

    async def all_ranks() -> list[EvidenceRecord]:
        return list(await asyncio.gather(*(_one_rank(ctx, t) for t in ctx.ranks)))

    return await guard("flight_recorder", TIMEOUT_S, all_ranks())


async def _one_rank(ctx: EvidenceContext, target: RankTarget) -> EvidenceRecord:
    started = time.monotonic()
    pipe, dump = fr_files(ctx.run_dir / "fr", target)
    before = _signature(dump)
    problem = rank_problem(ctx, target)
    if problem is None and (state := proc_state(target.pid, ctx.proc_root)) in STOPPED:
        problem = f"rank {target.rank} is stopped (state {state}): it cannot answer, not triggered"
    note = None
    if problem is None:
        problem = _trigger(pipe)
    if problem is None:
        problem, note = await _wait_for_new(dump, before)
    rel = f"fr/{dump.name}"
    found = _signature(dump)
    if found is None:
        problem = problem or "the dump vanished before it could be copied"
        return record("flight_recorder", started, [placeholder(ctx, rel, problem)], problem, target.rank)
    try:
        await asyncio.to_thread(_copy, dump, ctx.out_dir / rel)
    except OSError as exc:
        return record("flight_recorder", started, error=f"cannot copy {dump}: {exc.strerror}", rank=target.rank)
    if problem is not None:
        note = f"copied the dump that was already there (written {time.ctime(found[1] / 1e9)})"
    return record("flight_recorder", started, [rel], problem, target.rank, note)


def _signature(path: Path) -> tuple[int, int, int] | None:
    """Changes whenever the file is rewritten; mtime alone can tie at coarse timestamp granularity."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st.st_size > 0 else None


def _trigger(pipe: Path) -> str | None:
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
        os.write(fd, b"1")
    except OSError as exc:  # EAGAIN: 64 KiB of earlier triggers unread, the reader is stuck
        return f"cannot write to {pipe.name}: {exc.strerror}"
    finally:
        os.close(fd)
    return None


async def _wait_for_new(dump: Path, before: tuple | None) -> tuple[str | None, str | None]:
    """(error, note): done once the dump changed and then held still for one poll."""
    deadline = time.monotonic() + FR_WAIT_S
    last = before
    while time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        now = _signature(dump)
        if now is not None and now != before and now == last:
            return None, None
        last = now
    if last is not None and last != before:
        return None, f"the dump was still changing after {FR_WAIT_S:g} s: may be incomplete"
    return f"no new dump within {FR_WAIT_S:g} s of the trigger", None


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
