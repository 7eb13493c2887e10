"""The sidecar's own cost on an op-heavy node: the wrapper's CPU and RSS at 8 ranks x 5,000 operations/s (issue 45).

Runs the real wrapper (``python -m ncclwatch ... torchrun --standalone
--nproc-per-node=8 bench/sidecar_cost_job.py``): each gloo rank, instead of
training, appends a real capture's NCCL INFO lines, as that rank in its own
process, to the debug file the wrapper injected, at ``--rate`` per second,
and beats every ``--ops-per-step`` operations, for ``--seconds``.  Every
``--every`` s it samples the wrapper process alone (the sidecar is its
asyncio loop; not its children): CPU seconds and RSS; and, for context, the
writers' CPU, the run folder's disk use and the NCCL files' logical size.

The summary: the wrapper's CPU as a share of one core over the steady state
(samples from ``--warmup`` s on), its RSS at start and end and the slope per
hour (least squares over the steady state), the run folder's peak disk use
against its cap, and what the writers achieved and spent.  With
``--profile-at S`` it runs ``py-spy record`` on the wrapper for
``--profile-s`` s from S s on (speedscope file beside the rows); the
samples over that window are left out of the CPU share.

    flock /tmp/ncclwatch-pytest.lock python bench/sidecar_cost.py --out bench/results/<date>-sidecar-cost/run1.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import psutil
from soak import slope_per_hour

from ncclwatch.watchdog.sources.holes import disk_bytes

JOB = Path(__file__).resolve().with_name("sidecar_cost_job.py")
MIB = 2**20


def wrapper_command(args: argparse.Namespace, run_dir: Path, out: Path) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        "sidecar-cost",
        "--run-dir",
        str(run_dir),
        "--bundle-dir",
        str(out.parent / f"{out.stem}-bundles"),
        str(torchrun),
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        str(JOB),
        f"--rate={args.rate}",
        f"--seconds={args.seconds}",
        f"--ops-per-step={args.ops_per_step}",
        f"--report={out.with_suffix('.writers.jsonl')}",
    ]


def is_writer(proc: psutil.Process) -> bool:
    """A rank of the job (torchrun's own command line names the job script too)."""
    try:
        command = proc.cmdline()
    except psutil.NoSuchProcess:
        return False
    return any(arg.endswith(JOB.name) for arg in command) and not any("standalone" in arg for arg in command)


def sample(wrapper: psutil.Process, run_dir: Path, started: float) -> dict:
    """One row: the wrapper alone, then the writers and the run folder for context."""
    cpu = wrapper.cpu_times()
    writers = [p for p in wrapper.children(recursive=True) if is_writer(p)]
    writers_cpu = 0.0
    for proc in writers:
        try:
            times = proc.cpu_times()
            writers_cpu += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    nccl = run_dir / "nccl"
    logical = sum(p.stat().st_size for p in nccl.iterdir()) if nccl.is_dir() else 0
    return {
        "t_s": round(time.monotonic() - started, 2),
        "wrapper_cpu_s": round(cpu.user + cpu.system, 3),
        "wrapper_rss_mib": round(wrapper.memory_info().rss / MIB, 2),
        "wrapper_threads": wrapper.num_threads(),
        "writers": len(writers),
        "writers_cpu_s": round(writers_cpu, 2),
        "run_dir_disk_mib": round(disk_bytes(run_dir) / MIB, 2),
        "nccl_logical_mib": round(logical / MIB, 1),
        "machine_busy_pct": psutil.cpu_percent(),
        "loadavg_1m": os.getloadavg()[0],
    }


def start_profile(args: argparse.Namespace, pid: int, out: Path) -> subprocess.Popen:
    target = out.with_suffix(".speedscope.json")
    command = ["py-spy", "record", "--nonblocking", "--pid", str(pid), "--duration", str(args.profile_s)]
    command += ["--rate", "100", "--format", "speedscope", "--output", str(target)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".py-spy.log"), "w"))


def summarize(args: argparse.Namespace, rows: list[dict], writer_rows: list[dict], exit_code: int | None) -> dict:
    steady = [r for r in rows if args.warmup <= r["t_s"] and r["writers"] == args.ranks]
    busy_s = cpu_s = 0.0
    for before, after in zip(steady, steady[1:], strict=False):
        if before.get("profiling") or after.get("profiling"):
            continue  # py-spy reads the wrapper then
        busy_s += after["t_s"] - before["t_s"]
        cpu_s += after["wrapper_cpu_s"] - before["wrapper_cpu_s"]
    windows = [
        100 * (b["wrapper_cpu_s"] - a["wrapper_cpu_s"]) / (b["t_s"] - a["t_s"])
        for a, b in zip(steady, steady[1:], strict=False)
        if not (a.get("profiling") or b.get("profiling"))
    ]
    writers_s = steady[-1]["t_s"] - steady[0]["t_s"] if len(steady) > 1 else 0.0
    ops = sum(w["ops_written"] for w in writer_rows)
    return {
        "kind": "summary",
        "wrapper_exit": exit_code,
        "steady_samples": len(steady),
        "steady_s": round(busy_s, 1),
        "wrapper_cpu_pct_of_a_core": round(100 * cpu_s / busy_s, 3) if busy_s else None,
        "wrapper_cpu_pct_per_window_min_median_max": (
            [round(min(windows), 2), round(sorted(windows)[len(windows) // 2], 2), round(max(windows), 2)]
            if windows
            else None
        ),
        "wrapper_rss_mib_first_sample": rows[0]["wrapper_rss_mib"] if rows else None,
        "wrapper_rss_mib_steady_start_end": [steady[0]["wrapper_rss_mib"], steady[-1]["wrapper_rss_mib"]]
        if steady
        else None,
        "wrapper_rss_mib_max": max(r["wrapper_rss_mib"] for r in rows) if rows else None,
        "wrapper_rss_slope_mib_per_hour": round(slope_per_hour([(r["t_s"], r["wrapper_rss_mib"]) for r in steady]), 3),
        # The first minutes fill bounded buffers (gaps, tails, caches); growth that goes on shows in the second half.
        "wrapper_rss_slope_mib_per_hour_second_half": round(
            slope_per_hour([(r["t_s"], r["wrapper_rss_mib"]) for r in steady[len(steady) // 2 :]]), 3
        ),
        "run_dir_disk_mib_max": max(r["run_dir_disk_mib"] for r in rows) if rows else None,
        "run_dir_cap_mib": args.cap_mib,
        "nccl_logical_mib_end": rows[-1]["nccl_logical_mib"] if rows else None,
        "writers_reported": len(writer_rows),
        "ops_written": ops,
        "ops_per_s_per_rank": [w["ops_per_s"] for w in sorted(writer_rows, key=lambda w: w["rank"])],
        "writers_cpu_pct_of_a_core_each": [
            round(100 * w["cpu_share_of_a_core"], 1) for w in sorted(writer_rows, key=lambda w: w["rank"])
        ],
        "writers_cpu_pct_of_a_core_all_steady": round(
            100 * (steady[-1]["writers_cpu_s"] - steady[0]["writers_cpu_s"]) / writers_s, 1
        )
        if writers_s
        else None,
        "machine_busy_pct_median": sorted(r["machine_busy_pct"] for r in steady)[len(steady) // 2] if steady else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rate", type=float, default=5000.0, help="NCCL operation lines per second per rank")
    parser.add_argument("--ops-per-step", type=int, default=100, help="operations between heartbeats")
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the ranks write")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=60.0, help="samples before this are not the steady state")
    parser.add_argument("--cap-mib", type=int, default=256, help="the run folder's cap (the wrapper's default)")
    parser.add_argument("--run-root", default="/var/tmp", help="where the run folder goes")
    parser.add_argument("--profile-at", type=float, default=None, help="start py-spy on the wrapper at this second")
    parser.add_argument("--profile-s", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".writers.jsonl").unlink(missing_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="ncclwatch-sidecar-cost-", dir=args.run_root))
    rows: list[dict] = []
    with out.open("w") as sink:

        def emit(row: dict) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

        emit(
            {
                "kind": "machine",
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
                "torch": version("torch"),
                "psutil": version("psutil"),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "loadavg_at_start": os.getloadavg(),
                "args": vars(args),
                "command": wrapper_command(args, run_dir, out),
            }
        )
        stderr = open(out.with_suffix(".wrapper.log"), "w")
        wrapper = subprocess.Popen(
            wrapper_command(args, run_dir, out), stdout=stderr, stderr=stderr, start_new_session=True
        )
        process, started, profiler = psutil.Process(wrapper.pid), time.monotonic(), None
        psutil.cpu_percent()  # the first call only starts the machine-wide count
        try:
            while wrapper.poll() is None and time.monotonic() - started < args.seconds + 300:
                time.sleep(args.every)
                if args.profile_at is not None and profiler is None and time.monotonic() - started >= args.profile_at:
                    profiler = start_profile(args, wrapper.pid, out)
                row = {"kind": "sample", **sample(process, run_dir, started)}
                row["profiling"] = profiler is not None and profiler.poll() is None
                rows.append(row)
                emit(row)
        except psutil.NoSuchProcess:
            pass  # the wrapper ended between the poll and the sample
        finally:
            if wrapper.poll() is None:
                os.killpg(wrapper.pid, signal.SIGTERM)
            wrapper.wait(120)
            if profiler is not None:
                profiler.wait(60)
        report = out.with_suffix(".writers.jsonl")
        writer_rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
        summary = summarize(args, rows, writer_rows, wrapper.returncode)
        emit(summary)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
