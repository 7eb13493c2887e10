"""One rank of bench/sidecar_cost.py's job: instead of training, it writes what an op-heavy rank makes the sidecar read.

Each gloo rank opens the NCCL debug file the wrapper injected
(``NCCL_DEBUG_FILE``, ``%h`` and ``%p`` expanded as NCCL expands them: the
host name up to its first dot, the pid), writes a real capture's lines
before the first operation as this rank of this job (bench/nccl_writer.py),
then appends its operation lines at ``--rate`` per second in batches every
10 ms, and calls ``ncclwatch.beat(step)`` every ``--ops-per-step``
operations, for ``--seconds``.  Then the capture's closing (Destroy) lines,
and one JSON row of what it wrote and the CPU it took to ``--report``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch.distributed as dist
from nccl_writer import CAPTURE, OpCycle, as_rank, capture, closing, paced

import ncclwatch


def debug_file_path() -> str:
    host = socket.gethostname().split(".")[0]
    return os.environ["NCCL_DEBUG_FILE"].replace("%h", host).replace("%p", str(os.getpid()))


def write_lines(args: argparse.Namespace, rank: int, nranks: int) -> dict:
    """Write this rank's NCCL lines and beats for ``args.seconds``; what was written and what it cost."""
    rank_file = sorted(CAPTURE.iterdir())[rank % 2]  # the capture has two ranks; even ranks are its rank 0
    host, pid = socket.gethostname().split(".")[0], os.getpid()
    head, ops = capture(rank_file)
    mine = as_rank(b"".join([head, *ops, closing(rank_file)]), rank=rank, nranks=nranks, host=host, pid=pid)
    lines = mine.splitlines(keepends=True)
    cycle = OpCycle(lines[head.count(b"\n") : head.count(b"\n") + len(ops)])
    began, cpu_began, written, step = time.monotonic(), time.process_time(), 0, 0
    with open(debug_file_path(), "wb", buffering=0) as out:
        out.write(b"".join(lines[: head.count(b"\n")]))
        for due in paced(lambda: args.rate, lambda: time.monotonic() - began < args.seconds):
            out.write(cycle.take(due))
            written += due
            if written // args.ops_per_step > step:
                step = written // args.ops_per_step
                ncclwatch.beat(step)
        out.write(b"".join(lines[head.count(b"\n") + len(ops) :]))
    wall = time.monotonic() - began
    cpu = time.process_time() - cpu_began
    return {
        "rank": rank,
        "pid": pid,
        "ops_written": written,
        "steps": step,
        "wall_s": round(wall, 2),
        "ops_per_s": round(written / wall, 1),
        "cpu_s": round(cpu, 2),
        "cpu_share_of_a_core": round(cpu / wall, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=5000.0, help="operation lines per second")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--ops-per-step", type=int, default=100)
    parser.add_argument("--report", required=True, help="JSON lines file each rank appends its row to")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, nranks = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank starts writing together, as a job's ranks issue their first collective
    row = write_lines(args, rank, nranks)
    with open(args.report, "a") as report:
        report.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
