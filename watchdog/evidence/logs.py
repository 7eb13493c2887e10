"""Tails of the job's logs: NCCL debug files [nccl/<name>], torchrun worker logs [logs/rank<r>/<name>], the job's
stderr as the wrapper read it [output/<name>].

Only the last ``ctx.tail_bytes`` of each file, cut at a line start: the end
of a log is where the hang is, and a bundle must stay small however long the
job ran.  The files keep growing while they are read; a tail is bounded by
its offset at the time of the read.  A log may echo a command line, a URL or
an environment, so each tail is copied through ``redact.redact_bytes``
(credentials found by value; bytes that are not UTF-8 are kept as they were).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ncclwatch.watchdog.evidence.base import EvidenceContext, EvidenceRecord, guard, record, write_file
from ncclwatch.watchdog.evidence.redact import redact_bytes

TIMEOUT_S = 10.0


def read_tail(path: Path, nbytes: int) -> tuple[bytes, int]:
    """(last ``nbytes`` from a line start, file size); a single line longer than that is cut."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size <= nbytes:
            f.seek(0)
            return f.read(nbytes), size
        # one byte more, before the tail: tells whether the tail already starts a line
        f.seek(size - nbytes - 1)
        data = f.read(nbytes + 1)
    newline = data.find(b"\n")
    return (data[newline + 1 :] if 0 <= newline < len(data) - 1 else data[1:]), size


def _copy_tails(
    ctx: EvidenceContext, files: list[Path], folder: str
) -> tuple[list[str], list[str], int, dict[str, tuple[str, int]]]:
    """(bundle paths, errors, files cut, each copy's source and start offset); same-named files (two torchrun
    attempts) get a numeric prefix."""
    paths: list[str] = []
    errors: list[str] = []
    copied: dict[str, tuple[str, int]] = {}
    cut = 0
    for index, path in enumerate(files):
        name = path.name if not any(p.name == path.name for p in files[:index]) else f"{index}.{path.name}"
        try:
            data, size = read_tail(path, ctx.tail_bytes)
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
            continue
        cut += size > len(data)
        rel = write_file(ctx, f"{folder}/{name}", redact_bytes(data))
        paths.append(rel)
        copied[rel] = (str(path), size - len(data))
    return paths, errors, cut, copied


def _nccl_tails(ctx: EvidenceContext) -> list[EvidenceRecord]:
    started = time.monotonic()
    folder = ctx.run_dir / "nccl" if ctx.run_dir is not None else None
    if folder is None or not folder.is_dir():
        return [record("nccl_logs", started, error=f"no NCCL debug folder ({folder})")]
    files = sorted(p for p in folder.iterdir() if p.is_file())
    paths, errors, cut, copied = _copy_tails(ctx, files, "nccl")
    note = f"{len(paths)} files, {cut} cut to their last {ctx.tail_bytes} bytes"
    found = record("nccl_logs", started, paths, "; ".join(errors) or None, note=note)
    return [found.model_copy(update={"copied": copied})]


def _worker_tails(ctx: EvidenceContext) -> list[EvidenceRecord]:
    if not ctx.worker_logs:  # one record for the job, not the same line once per rank
        return [record("worker_logs", time.monotonic(), error=NO_WORKER_LOGS)]
    records = []
    for target in ctx.ranks:
        started = time.monotonic()
        files = list(ctx.worker_logs.get(target.rank, []))
        if not files:
            records.append(record("worker_logs", started, error="no worker log files known", rank=target.rank))
            continue
        paths, errors, cut, copied = _copy_tails(ctx, files, f"logs/rank{target.rank}")
        note = f"{cut} cut to their last {ctx.tail_bytes} bytes" if cut else None
        found = record("worker_logs", started, paths, "; ".join(errors) or None, target.rank, note)
        records.append(found.model_copy(update={"copied": copied}))
    return records


NO_WORKER_LOGS = "no worker log files: torchrun writes them with --log-dir and --redirects or --tee"


def _output_tails(ctx: EvidenceContext) -> list[EvidenceRecord]:
    """The job's stderr as the wrapper read it (``sources/job_output.py``): what explains a death, whichever rank
    printed it, and torchrun's failure summary."""
    started = time.monotonic()
    folder = ctx.run_dir / "output" if ctx.run_dir is not None else None
    files = [folder / name for name in ("stderr.1.log", "stderr.log")] if folder is not None else []
    files = [path for path in files if path.is_file()]
    if not files:
        return [record("job_output", started, error=f"no copy of the job's stderr ({folder})")]
    paths, errors, cut, copied = _copy_tails(ctx, files, "output")
    note = f"the last {ctx.tail_bytes} bytes of each" if cut else None
    found = record("job_output", started, paths, "; ".join(errors) or None, note=note)
    return [found.model_copy(update={"copied": copied})]


async def collect_job_output(ctx: EvidenceContext) -> list[EvidenceRecord]:
    return await guard("job_output", TIMEOUT_S, asyncio.to_thread(_output_tails, ctx))


async def collect_nccl_logs(ctx: EvidenceContext) -> list[EvidenceRecord]:
    return await guard("nccl_logs", TIMEOUT_S, asyncio.to_thread(_nccl_tails, ctx))


async def collect_worker_logs(ctx: EvidenceContext) -> list[EvidenceRecord]:
    return await guard("worker_logs", TIMEOUT_S, asyncio.to_thread(_worker_tails, ctx))
