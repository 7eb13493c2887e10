"""Per-rank process facts [proc/rank<r>.txt] and environment [env/rank<r>.txt].

``proc`` is what the kernel says the rank is doing: run state, wait channel,
``/proc/<pid>/{status,stat,io,cmdline}`` and every thread's state.  It is
cheap and goes stale fast (a native py-spy dump ptrace-stops threads), so
``collect_all`` takes it first.

``env`` is the rank's environment as its process sees it, every name listed
and only the values diagnosis needs kept (NCCL_*, TORCH_*, CUDA_*, torchrun's
RANK/LOCAL_RANK/..., the scheduler's ids: ``redact.redact_env``): bundles
travel to people, tickets and servers.  The command line in ``proc`` goes
through ``redact.redact_argv`` and the whole file through ``redact_text``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

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
from ncclwatch.watchdog.evidence.redact import redact_argv, redact_env, redact_text
from ncclwatch.watchdog.probes.procfs import ProcInfo, ThreadInfo, read_environ, read_proc, read_threads

TIMEOUT_S = 5.0


def format_proc(target: RankTarget, info: ProcInfo, raw: dict[str, str], threads: list[ThreadInfo]) -> str:
    """The human-readable summary first, then the raw files as read."""
    by_state = Counter(t.state for t in threads)
    io = (
        "unreadable"
        if info.io_read_bytes is None
        else f"read_bytes {info.io_read_bytes} write_bytes {info.io_write_bytes}"
    )
    lines = [
        f"rank {target.rank} pid {info.pid} host {target.host} local_rank {target.local_rank} comm {info.comm}",
        f"state: {info.state} ({info.state_name})  wchan: {info.wchan or '-'}  ppid: {info.ppid}",
        f"cpu_seconds: {info.cpu_seconds:.2f}  threads: {info.threads}  vm_rss_bytes: {info.vm_rss_bytes}",
        f"io: {io}  rchar {info.io_rchar} wchar {info.io_wchar}",
        "threads by state: " + " ".join(f"{s}={n}" for s, n in sorted(by_state.items())),
    ]
    for name, text in raw.items():
        lines += ["", f"== /proc/{info.pid}/{name}", text.rstrip("\n")]
    lines += ["", "== threads: tid state wchan comm"]
    lines += [f"{t.tid}\t{t.state}\t{t.wchan or '-'}\t{t.comm}" for t in threads]
    return "\n".join(lines) + "\n"


def _read_raw(proc_root: Path, pid: int) -> dict[str, str]:
    raw = {}
    for name in ("cmdline", "status", "stat", "io"):
        try:
            data = (proc_root / str(pid) / name).read_bytes()
        except OSError as exc:
            raw[name] = f"unreadable: {exc.strerror}"
            continue
        if name == "cmdline":  # arguments end with NUL; shown separated by spaces, secret flags' values redacted
            args = data.removesuffix(b"\0").decode(errors="replace").split("\0") if data else []
            raw[name] = " ".join(redact_argv(args))
        else:
            raw[name] = data.decode(errors="replace")
    return raw


def _proc_one(ctx: EvidenceContext, target: RankTarget) -> EvidenceRecord:
    started = time.monotonic()
    rel = f"proc/rank{target.rank}.txt"
    problem = rank_problem(ctx, target)
    info = None if problem else read_proc(target.pid, ctx.proc_root)
    if info is None:
        problem = problem or f"process {target.pid} vanished while being read"
        return record("proc", started, [placeholder(ctx, rel, problem)], problem, target.rank)
    threads = read_threads(target.pid, ctx.proc_root)
    text = redact_text(format_proc(target, info, _read_raw(ctx.proc_root, target.pid), threads))
    return record("proc", started, [write_file(ctx, rel, text)], rank=target.rank, note=f"state {info.state}")


def _env_one(ctx: EvidenceContext, target: RankTarget) -> EvidenceRecord:
    started = time.monotonic()
    rel = f"env/rank{target.rank}.txt"
    problem = rank_problem(ctx, target)
    env = None if problem else read_environ(target.pid, ctx.proc_root)
    if env is None:
        problem = problem or f"/proc/{target.pid}/environ is not readable (gone, or another user's process)"
        return record("env", started, [placeholder(ctx, rel, problem)], problem, target.rank)
    text = "".join(f"{k}={v}\n" for k, v in sorted(redact_env(env).items()))
    return record("env", started, [write_file(ctx, rel, text)], rank=target.rank)


async def collect_proc(ctx: EvidenceContext) -> list[EvidenceRecord]:
    # in a thread: a few hundred small reads per rank (one per thread) stay off the event loop
    work = asyncio.to_thread(lambda: [_proc_one(ctx, t) for t in ctx.ranks])
    return await guard("proc", TIMEOUT_S, work)


async def collect_env(ctx: EvidenceContext) -> list[EvidenceRecord]:
    work = asyncio.to_thread(lambda: [_env_one(ctx, t) for t in ctx.ranks])
    return await guard("env", TIMEOUT_S, work)
