"""Flight Recorder dumps on demand, one per rank [fr/<dump name>].

The doors (FIFOs, dump files) are in ``probes/flight_recorder.py``.
Failure modes, each an error record for that rank: no FIFO; nobody reading it
(ENXIO: the rank never armed it, or exited); a stopped rank (state T cannot
answer: not triggered); no new dump within ``FR_WAIT_S``.  A dump that was
already there (e.g. written on a timeout) is still copied, with a note that
it predates this trigger.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from ncclwatch.watchdog.events import STOPPED_STATES
from ncclwatch.watchdog.evidence.base import (
    EvidenceContext,
    EvidenceRecord,
    RankTarget,
    guard,
    placeholder,
    rank_problem,
    record,
)
from ncclwatch.watchdog.probes.flight_recorder import FR_WAIT_S, fr_files, signature, trigger, wait_for_new
from ncclwatch.watchdog.probes.procfs import proc_state

TIMEOUT_S = FR_WAIT_S + 3.0  # the wait, plus copying dumps of a few MB


async def collect_flight_recorder(ctx: EvidenceContext) -> list[EvidenceRecord]:
    if ctx.run_dir is None:
        return [record("flight_recorder", time.monotonic(), error="no run folder: Flight Recorder pipes unknown")]

    async def all_ranks() -> list[EvidenceRecord]:
        return list(await asyncio.gather(*(_one_rank(ctx, t) for t in ctx.ranks)))

    return await guard("flight_recorder", TIMEOUT_S, all_ranks())


async def _one_rank(ctx: EvidenceContext, target: RankTarget) -> EvidenceRecord:
    started = time.monotonic()
    pipe, dump = fr_files(ctx.run_dir / "fr", target.rank, target.pid)
    before = signature(dump)
    problem = rank_problem(ctx, target)
    if problem is None and (state := proc_state(target.pid, ctx.proc_root)) in STOPPED_STATES:
        problem = f"rank {target.rank} is stopped (state {state}): it cannot answer, not triggered"
    if problem is None and target.pid in ctx.dumpless_pids:
        # Seen on H100 over NET/Socket: NCCL errored the communicator; asking again only cost 8 s of bundle time.
        problem = f"rank {target.rank} did not answer the probe's dump request moments before: not asked again"
    note = None
    if problem is None:
        problem = trigger(pipe)
    if problem is None:
        problem, note = await wait_for_new(dump, before, FR_WAIT_S)
    rel = f"fr/{dump.name}"
    found = signature(dump)
    if found is None:
        problem = problem or "the dump vanished before it could be copied"
        return record("flight_recorder", started, [placeholder(ctx, rel, problem)], problem, target.rank)
    try:
        await asyncio.to_thread(_copy, dump, ctx.out_dir / rel)
    except OSError as exc:
        return record("flight_recorder", started, error=f"cannot copy {dump}: {exc.strerror}", rank=target.rank)
    if problem is not None:
        note = f"copied the dump that was already there (written {time.ctime(found[1] / 1e9)})"
    found = record("flight_recorder", started, [rel], problem, target.rank, note)
    return found.model_copy(update={"copied": {rel: (str(dump), 0)}})


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
