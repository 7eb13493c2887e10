"""Python and native stacks of every rank [stacks/rank<r>.json, stacks/rank<r>.native.json].

``collect_python_stacks``: a ``--nonblocking`` dump of every rank at once.
It never stops a rank, so it can run first, beside anything else.

``collect_native_stacks``: ``--native`` per rank, a few at a time, each
bounded.  It ptrace-stops the rank while it unwinds (``probes.pyspy``
resumes a rank it left stopped), so ``collect_all`` runs it only once the
Flight Recorder dumps are in.  A rank that was stopped before the capture
began (a SIGSTOPped culprit) gets no native dump: attaching would fail, and
the rank must stay as found.

``collect_stacks`` is both, in that order, for use alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from ncclwatch.watchdog.events import STOPPED_STATES
from ncclwatch.watchdog.evidence.base import (
    EvidenceContext,
    EvidenceRecord,
    RankTarget,
    guard,
    placeholder,
    rank_problem,
    record,
    write_file,
)
from ncclwatch.watchdog.probes.procfs import proc_state
from ncclwatch.watchdog.probes.pyspy import pyspy_dump

DUMP_TIMEOUT_S = 5.0
NATIVE_TIMEOUT_S = 8.0  # native unwinding symbolises libtorch/libnccl on first use (1-1.3 s seen on a CUDA rank)
NATIVE_AT_ONCE = 4  # each native py-spy is CPU-bound while it symbolises


def rank_states(ctx: EvidenceContext) -> dict[int, str | None]:
    """Each rank's state letter now (None: gone); taken before a capture starts, it says what was found."""
    return {t.rank: proc_state(t.pid, ctx.proc_root) for t in ctx.ranks}


async def collect_python_stacks(ctx: EvidenceContext) -> list[EvidenceRecord]:
    async def work() -> list[EvidenceRecord]:
        return list(await asyncio.gather(*(_dump(ctx, t, native=False) for t in ctx.ranks)))

    return await guard("stacks", DUMP_TIMEOUT_S + 1.0, work())


async def collect_native_stacks(
    ctx: EvidenceContext, found: Mapping[int, str | None] | None = None
) -> list[EvidenceRecord]:
    """``found``: the ranks' states before the capture began (``rank_states``); default: now."""
    before = rank_states(ctx) if found is None else found
    slots = asyncio.Semaphore(NATIVE_AT_ONCE)

    async def native(target: RankTarget) -> EvidenceRecord:
        async with slots:
            return await _native(ctx, target, before.get(target.rank))

    async def work() -> list[EvidenceRecord]:
        return list(await asyncio.gather(*(native(t) for t in ctx.ranks)))

    waves = -(-len(ctx.ranks) // NATIVE_AT_ONCE)
    return await guard("stacks_native", waves * NATIVE_TIMEOUT_S + 1.0, work())


async def collect_stacks(ctx: EvidenceContext) -> list[EvidenceRecord]:
    found = rank_states(ctx)  # before any py-spy runs
    return [*await collect_python_stacks(ctx), *await collect_native_stacks(ctx, found)]


async def _native(ctx: EvidenceContext, target: RankTarget, found: str | None) -> EvidenceRecord:
    if found in STOPPED_STATES:
        started = time.monotonic()
        why = f"rank {target.rank} was stopped (state {found}) before the capture: left as found"
        rel = placeholder(ctx, f"stacks/rank{target.rank}.native.json", why)
        return record("stacks_native", started, [rel], rank=target.rank, note=f"native dump skipped: {why}")
    return await _dump(ctx, target, native=True)


async def _dump(ctx: EvidenceContext, target: RankTarget, *, native: bool) -> EvidenceRecord:
    started = time.monotonic()
    name = "stacks_native" if native else "stacks"
    rel = f"stacks/rank{target.rank}{'.native' if native else ''}.json"
    problem = rank_problem(ctx, target)
    if problem is not None:
        return record(name, started, [placeholder(ctx, rel, problem)], problem, target.rank)
    timeout_s = NATIVE_TIMEOUT_S if native else DUMP_TIMEOUT_S
    data, message = await pyspy_dump(target.pid, native=native, timeout_s=timeout_s, pyspy=ctx.pyspy)
    if data is None:
        return record(name, started, [placeholder(ctx, rel, message)], message, target.rank)
    # a dump with a message: py-spy left the rank stopped and it was resumed (SIGCONT)
    return record(name, started, [write_file(ctx, rel, data)], rank=target.rank, note=message)
