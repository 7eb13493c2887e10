"""``ncclwatch analyze`` on one large combined stderr: streamed and bounded.

Writes a torchrun ``--tee``-style file (every line prefixed ``[rankN]:``) of
about ``--gb`` GB: 8 ranks' training output and NCCL COLL lines interleaved,
PyTorch's watchdog timeout markers near the start (so the old reader would
have read the whole file at once), a dump-signal line placing rank 5 behind,
then runs ``ncclwatch analyze --json`` in a fresh process pinned to one core
and reports wall time and peak RSS (target: 1 GB in < 30 s, < 200 MB).

    python bench/combined_stderr.py --gb 1
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

RANKS = 8


def write(path: Path, gigabytes: float) -> int:
    head = []
    for r in range(RANKS):
        head.append(f"[rank{r}]:gpu{r // 4}:{700 + r}:{700 + r} [{r % 4}] NCCL INFO NCCL version 2.21.5+cuda12.4")
    for r in (0, 1, 2, 3, 4, 6, 7):
        head.append(
            f"[rank{r}]:[E1123 10:00:00.0 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective "
            "operation timeout: "
            "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for "
            "600037 milliseconds before timing out."
        )
        head.append(
            f"[rank{r}]:[E1123 10:00:00.0 ProcessGroupNCCL.cpp:2199] [PG ID 0 PG GUID 0(default_pg) Rank {r}]  "
            "failure detected by "
            "watchdog at work sequence id: 42 PG status: last enqueued work: 42, last completed work: 41"
        )
    head.append(
        "[rank5]:[E1123 10:00:00.1 ProcessGroupNCCL.cpp:1714] [PG ID 0 PG GUID 0(default_pg) Rank 5] "
        "Received a dump signal due to a "
        "collective timeout from  rank 0 and we will try our best to dump the debug info. "
        "Last enqueued NCCL work: 41, last completed NCCL work: 41."
    )
    block = []
    for step in range(200):
        for r in range(RANKS):
            block.append(f"[rank{r}]:step {step} loss 2.{r}31 lr 3.0e-04 tokens/s 41234.{r}")
            block.append(
                f"[rank{r}]:gpu{r // 4}:{700 + r}:{750 + r} [{r % 4}] NCCL INFO AllReduce: opCount {step:x} "
                "sendbuff 0x7f2963e05000 "
                "recvbuff 0x7f2963e06000 count 4195328 datatype 9 op 0 root 0 "
                f"comm 0x55d1c0a{r} [nranks=8] stream 0x1f481490"
            )
    chunk = ("\n".join(block) + "\n").encode()
    target = int(gigabytes * (1 << 30))
    with path.open("wb") as out:
        out.write(("\n".join(head) + "\n").encode())
        while out.tell() < target:
            out.write(chunk)
        return out.tell()


def run(path: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-m", "ncclwatch", "analyze", "--json", str(path)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report = json.loads(proc.stdout)
    return {
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(rss_mib),
        "verdict": report["verdict"],
        "culprits": report["culprit_ranks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = Path(tmp) / "slurm-combined.out"
        size = write(path, args.gb)
        result = run(path)
    print("| MB | wall s | MB/s | peak RSS MiB | verdict |")
    print("|---|---|---|---|---|")
    mb = size / 1e6
    print(
        f"| {mb:,.0f} | {result['wall_s']} | {mb / result['wall_s']:,.0f} | {result['peak_rss_mib']} | "
        f"{result['verdict']} {result['culprits']} |"
    )


if __name__ == "__main__":
    main()
