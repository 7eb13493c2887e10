"""Wall time of ``collect_all`` on N real, sleeping Python processes.

Each process sits in ``time.sleep`` inside a Python function (optionally
after ``import torch``, so native unwinding has libtorch to symbolise); one
can be SIGSTOPped like a culprit.  Nothing else of a job is there: no NCCL
files, no Flight Recorder FIFOs, no RAS server (refused at once), no GPU, no
InfiniBand, so the figures are the per-rank collectors (py-spy Python and
native dumps, /proc, environment) plus the fixed costs.

    python bench/evidence.py                          # 3 and 8 ranks, 3 runs each
    python bench/evidence.py --ranks 8 --import-torch --stopped 1

Results go to stdout as a Markdown table (copy into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ncclwatch.watchdog.evidence import EvidenceContext, RankTarget, collect_all

SLEEPER = """
import sys, time
if sys.argv[1] == "torch":
    import torch  # noqa: F401
def sleeping_here():
    print("ready", flush=True)
    time.sleep(3600)
sleeping_here()
"""


def spawn(n: int, import_torch: bool, stopped: int) -> list[subprocess.Popen]:
    mode = "torch" if import_torch else "plain"
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER, mode], stdout=subprocess.PIPE) for _ in range(n)]
    for proc in procs:
        if proc.stdout.readline() != b"ready\n":
            raise SystemExit(f"sleeper {proc.pid} did not start")
    time.sleep(0.2)  # all inside time.sleep
    for proc in procs[:stopped]:
        os.kill(proc.pid, signal.SIGSTOP)
    return procs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(procs: list[subprocess.Popen], work: Path) -> tuple[float, dict[str, float], int]:
    out = Path(tempfile.mkdtemp(dir=work))
    ranks = tuple(RankTarget(rank=i, pid=p.pid, local_rank=i, host="localhost") for i, p in enumerate(procs))
    ctx = EvidenceContext(
        out_dir=out, run_dir=work, ranks=ranks, pyspy=None, ras_port=free_port(), sys_infiniband=work / "no-ib"
    )
    started = time.monotonic()
    records = asyncio.run(collect_all(ctx))
    seconds = time.monotonic() - started
    slowest: dict[str, float] = {}
    for r in records:
        slowest[r.name] = max(slowest.get(r.name, 0.0), r.duration_s)
    errors = sum(1 for r in records if r.error)
    return seconds, slowest, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, action="append", help="number of processes (repeatable; default 3, 8)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stopped", type=int, default=0, help="SIGSTOP this many of them")
    parser.add_argument("--import-torch", action="store_true")
    args = parser.parse_args()
    print(f"cpus {os.cpu_count()}, python {sys.version.split()[0]}, torch imported: {args.import_torch}")
    print("| ranks | stopped | runs | collect_all s (median, max) | slowest stacks / native s | errors |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "fr").mkdir()
        (work / "nccl").mkdir()
        for n in args.ranks or [3, 8]:
            procs = spawn(n, args.import_torch, args.stopped)
            try:
                runs = [one_run(procs, work) for _ in range(args.runs)]
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
            times = [s for s, _, _ in runs]
            stacks = max(r[1].get("stacks", 0) for r in runs)
            native = max(r[1].get("stacks_native", 0) for r in runs)
            print(
                f"| {n} | {args.stopped} | {args.runs} | {statistics.median(times):.2f}, {max(times):.2f} "
                f"| {stacks:.2f} / {native:.2f} | {runs[-1][2]} |"
            )


if __name__ == "__main__":
    main()
