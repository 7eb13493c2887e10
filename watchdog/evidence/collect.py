"""Run every collector once after a verdict, stalest-first, within one budget [evidence.json].

Order (what goes stale fastest starts first):

1. at once: ``proc`` (milliseconds; read before any py-spy ptrace-stops a
   thread, so thread states are as found), the Flight Recorder triggers,
   Python stacks (``--nonblocking`` never stops a rank), NVML, RAS and
   InfiniBand (the last three mostly wait on sockets and sleeps);
2. native stacks, once the Flight Recorder dumps are in (or given up on):
   a native dump stops the rank that may be writing its dump, and a rank's
   first dump takes 4-5 s (torch 2.11 symbolises C++ stacks for it);
3. then the environment and the log tails, which do not go stale.

Whatever has not finished ``CANCEL_GRACE_S`` before ``ctx.budget_s`` is
cancelled (a py-spy being killed still resumes its rank) and becomes an
error record "timed out after N s".  ``evidence.json`` holds every record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Iterable
from functools import partial
from typing import Any

from ncclwatch.watchdog.evidence.base import EvidenceContext, EvidenceRecord, record
from ncclwatch.watchdog.evidence.flight_recorder import collect_flight_recorder
from ncclwatch.watchdog.evidence.logs import collect_job_output, collect_nccl_logs, collect_worker_logs
from ncclwatch.watchdog.evidence.node import collect_infiniband, collect_nvml, collect_ras
from ncclwatch.watchdog.evidence.process import collect_env, collect_proc
from ncclwatch.watchdog.evidence.stacks import collect_native_stacks, collect_python_stacks, rank_states

CANCEL_GRACE_S = 1.5  # for cancelled collectors to kill py-spy and SIGCONT what it stopped
EVIDENCE_JSON = "evidence.json"

Collector = Callable[[EvidenceContext], Coroutine[Any, Any, list[EvidenceRecord]]]


async def _after(first: Iterable[asyncio.Task], collector: Collector, ctx: EvidenceContext) -> list[EvidenceRecord]:
    """Start ``collector`` once ``first`` are done, however they ended."""
    await asyncio.wait(first)
    return await collector(ctx)


async def collect_all(ctx: EvidenceContext) -> list[EvidenceRecord]:
    started, wall = time.monotonic(), time.time()
    tasks: dict[asyncio.Task, str] = {}

    def start(name: str, work: Coroutine[Any, Any, list[EvidenceRecord]]) -> asyncio.Task:
        task = asyncio.create_task(work, name=f"evidence:{name}")
        tasks[task] = name
        return task

    found = rank_states(ctx)  # before anything touches a rank
    proc = start("proc", collect_proc(ctx))
    fr = start("flight_recorder", collect_flight_recorder(ctx))
    python = start("stacks", collect_python_stacks(ctx))
    for name, collector in (("nvml", collect_nvml), ("ras", collect_ras), ("infiniband", collect_infiniband)):
        start(name, collector(ctx))
    native = start("stacks_native", _after((fr, proc, python), partial(collect_native_stacks, found=found), ctx))
    for name, collector in (
        ("env", collect_env),
        ("nccl_logs", collect_nccl_logs),
        ("worker_logs", collect_worker_logs),
        ("job_output", collect_job_output),
    ):
        start(name, _after((native,), collector, ctx))

    budget = max(0.0, ctx.budget_s - CANCEL_GRACE_S)
    done, pending = await asyncio.wait(tasks, timeout=budget)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=CANCEL_GRACE_S)

    records: list[EvidenceRecord] = []
    for task, name in tasks.items():
        if task in done:
            records += task.result()  # collectors guard themselves: a result, never an exception
        else:
            records.append(record(name, started, error=f"timed out after {time.monotonic() - started:.1f} s"))
    _write_index(ctx, records, wall, time.monotonic() - started)
    return records


def _write_index(ctx: EvidenceContext, records: list[EvidenceRecord], wall: float, seconds: float) -> None:
    doc = {
        "started_unix": wall,
        "duration_s": round(seconds, 3),
        "budget_s": ctx.budget_s,
        "ranks": [{"rank": t.rank, "pid": t.pid, "local_rank": t.local_rank, "host": t.host} for t in ctx.ranks],
        "records": [r.model_dump() for r in records],
    }
    (ctx.out_dir / EVIDENCE_JSON).write_text(json.dumps(doc, indent=1) + "\n")
