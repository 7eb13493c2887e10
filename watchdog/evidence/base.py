"""What every collector takes and returns, and the guard that keeps the contract.

Contract: a collector is ``async def collect_x(ctx) -> list[EvidenceRecord]``
with its own timeout; it never raises.  A missing rank, tool or permission is
a record whose ``error`` says why, and for a per-rank file a placeholder
``<path>.missing`` holding the same words, so a reader of the bundle sees the
gap where the file would be.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict

from ncclwatch.watchdog.probes.infiniband import SYS_INFINIBAND
from ncclwatch.watchdog.probes.procfs import PROC, proc_state
from ncclwatch.watchdog.probes.ras import RAS_PORT

log = logging.getLogger(__name__)


class EvidenceRecord(BaseModel):
    """One piece of evidence, or why it is missing; ``paths`` are relative to the bundle folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    paths: list[str]
    error: str | None
    duration_s: float
    rank: int | None = None
    note: str | None = None
    # bundle path -> (the file it was copied from, the byte offset the copy starts at): the report's citations
    # name the sidecar's files, and the bundle names them by its own paths (``live/bundle.py``)
    copied: dict[str, tuple[str, int]] = {}


@dataclass(frozen=True)
class RankTarget:
    rank: int
    pid: int
    local_rank: int | None
    host: str


@dataclass(frozen=True)
class EvidenceContext:
    out_dir: Path  # the bundle's staging folder; exists
    run_dir: Path | None  # the job's run folder: nccl/<host>.<pid>, fr/ (pipes and dumps)
    ranks: tuple[RankTarget, ...]
    pyspy: str | None
    ras_port: int = RAS_PORT
    ras_withheld: str | None = None  # why RAS must not be asked (an NCCL version it crashes...); None: ask it
    worker_logs: Mapping[int, list[Path]] = field(default_factory=dict)  # rank -> torchrun worker log files
    sys_infiniband: Path = SYS_INFINIBAND
    proc_root: Path = PROC
    tail_bytes: int = 256 * 1024
    budget_s: float = 30.0
    dumpless_pids: frozenset[int] = frozenset()  # did not answer the probe's dump request moments ago: not asked again


def record(
    name: str,
    started: float,
    paths: list[str] | None = None,
    error: str | None = None,
    rank: int | None = None,
    note: str | None = None,
) -> EvidenceRecord:
    """``started`` is a ``time.monotonic()`` reading taken when the work began."""
    duration = round(time.monotonic() - started, 4)
    return EvidenceRecord(name=name, paths=paths or [], error=error, duration_s=duration, rank=rank, note=note)


async def guard(name: str, timeout_s: float, work: Awaitable[list[EvidenceRecord]]) -> list[EvidenceRecord]:
    """Run one collector's work under its timeout; whatever goes wrong becomes an error record."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except TimeoutError:
        return [record(name, started, error=f"timed out after {timeout_s:g} s")]
    except Exception as exc:  # the contract: a collector never raises; the bug is logged, the bundle goes on
        log.exception("evidence collector %s failed", name)
        return [record(name, started, error=f"collector failed: {type(exc).__name__}: {exc}")]


def write_file(ctx: EvidenceContext, rel: str, data: bytes | str) -> str:
    path = ctx.out_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return rel


def placeholder(ctx: EvidenceContext, rel: str, why: str) -> str:
    """``<rel>.missing`` saying why ``rel`` is not in the bundle; returns its relative path."""
    return write_file(ctx, f"{rel}.missing", why.rstrip("\n") + "\n")


@functools.cache
def _this_host() -> frozenset[str]:
    """Names and addresses a rank of this host may be given by; no DNS (a lookup can hang for seconds)."""
    name = socket.gethostname()
    names = {name, name.split(".")[0], "localhost"}
    for addresses in psutil.net_if_addrs().values():
        names.update(a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6))
    return frozenset(names)


def rank_problem(ctx: EvidenceContext, target: RankTarget) -> str | None:
    """Why this rank's process cannot be examined from here, or None.

    A pid is only meaningful on its own host: reading (or, worse, signalling)
    the same number here would touch an unrelated process.
    """
    hosts = _this_host()
    if target.host and target.host not in hosts and target.host.split(".")[0] not in hosts:
        return f"rank {target.rank} runs on {target.host}, not on this host ({socket.gethostname()})"
    state = proc_state(target.pid, ctx.proc_root)
    if state is None or state in ("Z", "X"):
        return f"process {target.pid} of rank {target.rank} not found (exited?)"
    return None
