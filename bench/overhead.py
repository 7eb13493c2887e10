#!/usr/bin/env python3
"""Wall-time overhead of ``ncclwatch torchrun`` on a healthy job.

Runs the healthy demo job (``--fault none``) alternately under bare torchrun
and under the wrapper, ``--repeat`` times each, and compares median wall
times (the whole command: start-up, training, shutdown).  The wrapper's cost
is its sidecar's polling, the heartbeat hook, NCCL's INFO logging (GPU) and
Flight Recorder's timing events.

    python3 bench/overhead.py --nproc 3 --steps 200 --step-time 0.02 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "launcher" / "demo_job.py"


def timed(command: list[str], cwd: Path) -> float:
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{command[:4]}... failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    job = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(DEMO), "--fault=none", f"--steps={args.steps}", f"--step-time={args.step_time}", f"--numel={args.numel}",
    ]  # fmt: skip
    bare, wrapped = [], []
    with tempfile.TemporaryDirectory(prefix="overhead-") as work:
        for _ in range(args.repeat):
            bare.append(timed(job + ["--mark-dir", work], Path(work)))
            wrapped.append(timed([sys.executable, "-m", "ncclwatch", "--bundle-dir", f"{work}/b", *job, "--mark-dir", work], Path(work)))
    result = {
        "nproc": args.nproc,
        "steps": args.steps,
        "bare_s": [round(x, 2) for x in bare],
        "wrapped_s": [round(x, 2) for x in wrapped],
        "bare_median_s": round(statistics.median(bare), 2),
        "wrapped_median_s": round(statistics.median(wrapped), 2),
    }
    result["overhead_pct"] = round(100 * (result["wrapped_median_s"] / result["bare_median_s"] - 1), 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
