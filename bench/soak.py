"""A long run of one node under the wrapper: is the sidecar's memory and CPU flat?

Runs the real wrapper (``ncclwatch --on-hang report``, the performance look
every ``--perf-interval`` s) around torchrun and the demo job for
``--hours``, and every ``--every`` s samples the wrapper process, which
hosts the sidecar's asyncio loop: its RSS and CPU seconds, plus the
ranks' RSS for context.  At the end it fits a line to the samples after
the warm-up (``--warmup-min``) and writes the slope per hour of RSS and the
CPU share of a core, with the rows, to ``--out`` (JSON lines: one row per
sample, then a ``summary`` row).

    python bench/soak.py --hours 2 --ranks 8 --out bench/results/<dir>/soak.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

import ncclwatch.launcher.demo_job as demo_job


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def _share(rows: list[dict]) -> float | None:
    if len(rows) < 2:
        return None
    return round((rows[-1]["sidecar_cpu_s"] - rows[0]["sidecar_cpu_s"]) / (rows[-1]["t_s"] - rows[0]["t_s"]), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--perf-interval", type=float, default=10.0)
    parser.add_argument("--step-time", type=float, default=0.5)
    parser.add_argument("--warmup-min", type=float, default=10.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = int(args.hours * 3600 / args.step_time) + 10_000  # never ends on its own before the soak does
    command = [
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        "soak",
        "--on-hang",
        "report",
        "--perf-interval",
        str(args.perf_interval),
        "--bundle-dir",
        str(out.parent / "soak-bundles"),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        demo_job.__file__,
        "--fault=none",
        "--backend=gloo",
        f"--steps={steps}",
        f"--step-time={args.step_time}",
    ]
    wrapper = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".stderr"), "w"), start_new_session=True
    )
    process = psutil.Process(wrapper.pid)
    started = time.monotonic()
    rows = []
    with out.open("w") as sink:
        sink.write(
            json.dumps(
                {
                    "machine": platform.node(),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d"),
                    "args": vars(args),
                }
            )
            + "\n"
        )
        try:
            while time.monotonic() - started < args.hours * 3600 and wrapper.poll() is None:
                cpu = process.cpu_times()
                ranks = [p for p in process.children(recursive=True) if "demo_job" in " ".join(p.cmdline())]
                row = {
                    "t_s": round(time.monotonic() - started, 1),
                    "sidecar_rss_mib": round(process.memory_info().rss / 2**20, 2),
                    "sidecar_cpu_s": round(cpu.user + cpu.system, 2),
                    "ranks": len(ranks),
                    "ranks_rss_mib": round(sum(p.memory_info().rss for p in ranks) / 2**20, 1),
                }
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                time.sleep(args.every)
        finally:
            if wrapper.poll() is None:
                os.killpg(wrapper.pid, signal.SIGTERM)
                wrapper.wait(60)
        steady = [r for r in rows if r["t_s"] >= args.warmup_min * 60]
        first, last = (steady[0], steady[-1]) if len(steady) >= 2 else (rows[0], rows[-1])
        summary = {
            "summary": True,
            "samples": len(rows),
            "hours": round(rows[-1]["t_s"] / 3600, 3) if rows else 0,
            "wrapper_exit": wrapper.returncode,
            "rss_mib_after_warmup": [first["sidecar_rss_mib"], last["sidecar_rss_mib"]],
            "rss_slope_mib_per_hour": round(slope_per_hour([(r["t_s"], r["sidecar_rss_mib"]) for r in steady]), 3),
            "cpu_share_of_a_core": round(
                (last["sidecar_cpu_s"] - first["sidecar_cpu_s"]) / max(1.0, last["t_s"] - first["t_s"]), 4
            ),
            "cpu_seconds_slope_per_hour": round(slope_per_hour([(r["t_s"], r["sidecar_cpu_s"]) for r in steady]), 1),
            # Flat CPU means the same share of a core in both halves of the steady part.
            "cpu_share_halves": [_share(half) for half in (steady[: len(steady) // 2 + 1], steady[len(steady) // 2 :])],
        }
        sink.write(json.dumps(summary) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
