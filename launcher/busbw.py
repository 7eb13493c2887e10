"""The bus-bandwidth probe around a watched job (``--preflight``): before it starts, and after ``--on-hang kill``.

Before the job: ``ncclwatch preflight`` on this node (its GPUs over NCCL;
gloo on CPU when NVML sees no GPU), the table on stderr and the document in
the run folder as ``preflight.json`` (a bundle copies it to
``busbw/before.json``).  It never holds the job back: a failure or its time
limit is one line on stderr, and the job starts.

At a hang: a probe while the hung job's kernels still spin measures
contention (14.7 GB/s against 336 GB/s idle on 4 x H200), not links.  So it
runs only once ``--on-hang kill`` has ended the job and its ranks are gone:
the GPUs are as free as before the job, and each figure is compared with the
baseline (``preflight.compare_to_baseline``) and every pair with the others
(``preflight.slow_pairs``).  The result goes beside the bundle as
``<bundle>-busbw.json`` (the bundle itself was written before the kill) and
one line says what it found.  Observe-only runs leave the hung job's GPUs
alone; the report says how to measure by hand.

Each probe runs in its own processes under a hard time limit
(``preflight.run_ranks``): it can delay the wrapper's exit by at most that
limit, and never hangs it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from ncclwatch.watchdog.live.runfolder import PREFLIGHT_NAME
from ncclwatch.watchdog.preflight import (
    CPU_SIZES,
    DEFAULT_SIZES,
    compare_to_baseline,
    nvlink_summary,
    render_table,
    run_preflight,
    slow_pairs,
)

TIME_LIMIT_S = 120.0
NOT_AT_THE_HANG = (
    "bus bandwidth was not measured at the hang: the hung job's kernels still hold the GPUs, and a probe then measures "
    "contention, not links; end the job, then run `ncclwatch preflight --pairs 64M --baseline busbw/before.json` (from "
    "this bundle)"
)


def measure(mode: str) -> dict:
    """One sweep of this node, with every pair of ranks: NCCL on the GPUs NVML sees, else gloo on the CPU."""
    gpus = len(nvlink_summary() or [])
    backend, sizes, pair = ("nccl", DEFAULT_SIZES, 64 << 20) if gpus else ("gloo", CPU_SIZES, 1 << 20)
    return run_preflight(
        nproc=gpus or 2, backend=backend, sizes=sizes, pairs_bytes=pair, time_limit_s=TIME_LIMIT_S, mode=mode
    )


async def before_job(run_dir: Path) -> Path | None:
    """Measure the idle node and keep it as the baseline; its path, or None when the probe failed."""
    print(
        "ncclwatch: --preflight: measuring this node's bus bandwidth before the job starts", file=sys.stderr, flush=True
    )
    doc = await asyncio.to_thread(measure, "idle")
    print(render_table(doc), file=sys.stderr, flush=True)
    if "error" in doc:
        print("ncclwatch: --preflight failed (above); the job starts without a baseline", file=sys.stderr, flush=True)
        return None
    path = run_dir / PREFLIGHT_NAME
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


async def after_kill(baseline: Path | None, bundle: Path) -> Path:
    """Measure again once the hung job is gone, compare, and write ``<bundle>-busbw.json``; its path."""
    print("ncclwatch: measuring bus bandwidth now that the job has ended (GPUs free) ...", file=sys.stderr, flush=True)
    doc = await asyncio.to_thread(measure, "idle")
    doc["when"] = "after --on-hang kill ended the hung job"
    before = json.loads(baseline.read_text()) if baseline is not None else None
    findings = slow_pairs(doc) + (compare_to_baseline(doc, before) if before is not None else [])
    doc["findings"] = findings
    doc["baseline"] = before
    out = bundle.with_name(bundle.name.removesuffix(".tar.gz") + "-busbw.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if "error" in doc:
        said = f"the probe failed: {doc['error']}"
    elif findings:
        said = "; ".join(findings)
    else:
        kept_up = ["every size within 80 % of the baseline" if before else "no baseline to compare with"]
        if len(doc.get("pairs", [])) >= 3:  # with fewer, no pair can be told apart as the odd one (slow_pairs)
            kept_up.append("no pair of ranks far below the others")
        said = ", ".join(kept_up)
    print(f"ncclwatch: bus bandwidth after the hang: {said}; {out}", file=sys.stderr, flush=True)
    return out


def bundle_note(on_hang: str) -> str:
    """What the report says of the bus-bandwidth probe, for a run with ``--preflight``."""
    if on_hang == "kill":
        return (
            "bus bandwidth: measured before the job (busbw/before.json) and again once --on-hang kill has ended "
            "it, with the GPUs free: <this bundle's name>-busbw.json beside this bundle"
        )
    return f"bus bandwidth: measured before the job (busbw/before.json); {NOT_AT_THE_HANG}"
