"""Ingestion throughput and memory of ``ncclwatch analyze``, whole process.

Writes NCCL 2.28.9-format debug files (one per rank, the real line shapes of
the shared fixtures: init, COLL lines for a DDP-like step with Send/Recv,
destroy), then runs ``ncclwatch analyze --json`` on them in a fresh process
pinned to one core and reports wall time, lines per second and peak RSS.

    python bench/ingest.py                       # 4 ranks x 500k lines
    python bench/ingest.py --ranks 2 --lines 4000000 --lines 500000   # memory vs length

Results go to stdout as a Markdown table (copy into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def run_analyze(folder: Path) -> tuple[float, int, dict]:
    """Wall seconds, peak RSS in KiB and the report of one analyze process on one core."""
    cmd = [sys.executable, "-m", "ncclwatch", "analyze", "--json", str(folder)]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", "0", *cmd]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1, 2):
        raise SystemExit(f"analyze failed ({proc.returncode}): {proc.stderr[-2000:]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, peak_kib, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, action="append", help="lines per rank (repeatable); default 500000")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best is reported")
    args = parser.parse_args()
    sizes = args.lines or [500_000]
    print(
        "| ranks | lines/rank | total lines | MB | best wall s | lines/s (whole process, 1 core) "
        "| peak RSS MiB | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for lines in sizes:
        with tempfile.TemporaryDirectory(prefix="ncclwatch-bench-") as tmp:
            folder = Path(tmp)
            for rank in range(args.ranks):
                write_rank_log(folder / f"nccl.node1.{700 + rank}.log", rank, args.ranks, lines)
            size_mb = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
            runs = []
            for _ in range(args.repeat):
                runs.append(run_analyze(folder))
            wall = min(r[0] for r in runs)
            # ru_maxrss of children is the max over every child so far: run the
            # sizes in increasing order to read each one's peak.
            peak = runs[-1][1] / 1024
            total = lines * args.ranks
            verdict = runs[-1][2]["verdict"]
            print(
                f"| {args.ranks} | {lines:,} | {total:,} | {size_mb:.0f} | {wall:.2f} | {total / wall:,.0f} "
                f"| {peak:.0f} | {verdict} |"
            )


if __name__ == "__main__":
    main()
