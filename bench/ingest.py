"""Ingestion throughput and memory of ``ncclwatch analyze``, whole process.

Writes NCCL 2.28.9-format debug files (one per rank, the real line shapes of
the shared fixtures: init, COLL lines for a DDP-like step with Send/Recv,
destroy), then runs ``ncclwatch analyze --json`` on them in a fresh process
pinned to one core and reports wall time (median and spread of the runs),
lines per second and peak RSS.

    python bench/ingest.py                       # 4 ranks x 500k lines
    python bench/ingest.py --ranks 2 --lines 4000000 --lines 500000   # memory vs length
    python bench/ingest.py --cpu 1 --repeat 5 --src /tmp/before --src .   # A/B, interleaved, on core 1

Results go to stdout as a Markdown table (copy into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMM_ID = "0x678a9195a2e6ef0d"
STEP = (
    ("AllReduce", 4195328, 0),
    ("AllReduce", 4198400, 0),
    ("AllReduce", 16777216, 0),
    ("AllGather", 1024, 0),
    ("Broadcast", 1024, 0),
    ("Send", 4096, None),
    ("Recv", 4096, None),
)
# NCCL connects p2p channels lazily, so these lines keep coming after init.
NOISE = "NCCL INFO New proxy send connection 98 from local rank 0, transport 0"


def write_rank_log(path: Path, rank: int, nranks: int, lines: int) -> None:
    pid = 700 + rank
    pre = f"node1:{pid}:{pid} [{rank}] "
    comm = f"0x{0x18564C40 + rank:x}"
    head = [
        pre + "NCCL INFO NCCL version 2.28.9+cuda13.0",
        pre + f"NCCL INFO ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {rank} "
        f"nvmlDev {rank} busId {rank}0 commId {COMM_ID} - Init START",
        pre
        + f"NCCL INFO comm {comm} rank {rank} nRanks {nranks} nNodes 1 localRanks {nranks} localRank {rank} MNNVL 0",
        pre + f"NCCL INFO ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {rank} "
        f"nvmlDev {rank} busId {rank}0 commId {COMM_ID} - Init COMPLETE",
    ]
    tail = pre + f"NCCL INFO comm {comm} rank {rank} nranks {nranks} cudaDev {rank} busId {rank}0 - Destroy COMPLETE"
    templates = []
    for name, count, root in STEP:
        peer = (rank + 1) % nranks if name == "Send" else (rank - 1) % nranks
        send = "(nil)" if root is None else "0x7f2963e05000"
        templates.append(
            pre + f"NCCL INFO {name}: opCount 0 sendbuff {send} recvbuff 0x7f29%08x count {count} datatype 7 op 0 "
            f"root {peer if root is None else root} comm {comm} [nranks={nranks}] stream 0x1f481490"
        )
    body_lines = lines - len(head) - 1
    with path.open("w") as out:
        out.write("\n".join(head) + "\n")
        written = 0
        block = []
        while written < body_lines:
            for template in templates:
                if written % 20 == 19:  # one line in 20 is not an operation: more than real files have
                    block.append(pre + NOISE)
                    written += 1
                block.append(template % (written * 256))
                written += 1
                if written >= body_lines:
                    break
            if len(block) >= 50_000:
                out.write("\n".join(block) + "\n")
                block.clear()
        if block:
            out.write("\n".join(block) + "\n")
        out.write(tail + "\n")


def run_analyze(folder: Path, src: Path, cpu: int) -> tuple[float, int, dict]:
    """Wall seconds, peak RSS in KiB and the report of one analyze process on one core, run from ``src``."""
    cmd = [sys.executable, "-m", "ncclwatch", "analyze", "--json", str(folder)]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=src, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    # This child's own peak (RUSAGE_CHILDREN is the largest over every child so far).
    peak_kib = _peak_kib.pop(proc.pid, 0) or resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode not in (0, 1, 2):
        raise SystemExit(f"analyze failed ({proc.returncode}): {err.decode()[-2000:]}")
    return wall, peak_kib, json.loads(out)


_peak_kib: dict[int, int] = {}
_wait = os.waitpid


def _waitpid(pid: int, options: int) -> tuple[int, int]:
    """``os.waitpid`` as ``subprocess`` calls it, through ``wait4`` to keep each child's peak RSS."""
    if not hasattr(os, "wait4"):
        return _wait(pid, options)
    got, status, usage = os.wait4(pid, options)
    if got:
        _peak_kib[got] = usage.ru_maxrss
    return got, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, action="append", help="lines per rank (repeatable); default 500000")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size and checkout")
    parser.add_argument("--cpu", type=int, default=0, help="the core every run is pinned to (taskset -c)")
    parser.add_argument(
        "--src",
        type=Path,
        action="append",
        help="a checkout to run `python -m ncclwatch` from (repeatable: A/B, runs interleaved); default this one",
    )
    parser.add_argument("--raw", type=Path, help="append every run here as a JSON line")
    args = parser.parse_args()
    sizes = args.lines or [500_000]
    srcs = args.src or [Path(__file__).resolve().parent.parent]
    os.waitpid = _waitpid  # type: ignore[assignment]
    print(
        "| ranks | lines/rank | total lines | MB | checkout | runs | median wall s | spread s (min-max) "
        "| lines/s (median) | lines/s (best) | peak RSS MiB | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lines in sizes:
        with tempfile.TemporaryDirectory(prefix="ncclwatch-bench-") as tmp:
            folder = Path(tmp)
            for rank in range(args.ranks):
                write_rank_log(folder / f"nccl.node1.{700 + rank}.log", rank, args.ranks, lines)
            size_mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
            total = lines * args.ranks
            runs: dict[Path, list[tuple[float, int, dict]]] = {src: [] for src in srcs}
            for index in range(args.repeat):
                for src in srcs:  # interleaved: a slow moment of a shared machine hits every checkout alike
                    wall, peak, report = run_analyze(folder, src, args.cpu)
                    runs[src].append((wall, peak, report))
                    if args.raw:
                        with args.raw.open("a") as raw:
                            row = {
                                "ranks": args.ranks,
                                "lines_per_rank": lines,
                                "total_lines": total,
                                "mb": round(size_mb, 1),
                                "checkout": str(src),
                                "run": index,
                                "cpu": args.cpu,
                                "wall_s": round(wall, 4),
                                "lines_per_s": round(total / wall),
                                "peak_rss_mib": round(peak / 1024, 1),
                                "verdict": report["verdict"],
                            }
                            raw.write(json.dumps(row) + "\n")
            for src, done in runs.items():
                walls = sorted(r[0] for r in done)
                median = statistics.median(walls)
                peak = max(r[1] for r in done) / 1024
                print(
                    f"| {args.ranks} | {lines:,} | {total:,} | {size_mb:.0f} | {src.name} | {len(walls)} "
                    f"| {median:.2f} | {walls[0]:.2f}-{walls[-1]:.2f} | {total / median:,.0f} "
                    f"| {total / walls[0]:,.0f} | {peak:.0f} | {done[-1][2]['verdict']} |"
                )


if __name__ == "__main__":
    main()
