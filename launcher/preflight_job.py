"""One rank of ``ncclwatch preflight``: sweep collectives, time them, rank 0 writes the JSON.

Run by ``watchdog/preflight.py`` (never imported by the daemon: it imports
torch), one process per rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set.  Timing follows nccl-tests: after
``warmup`` untimed runs, ``iters`` back-to-back runs between two
synchronisations, averaged; each rank's time is reduced with MAX (the
collective is as slow as its slowest rank).  ``--pairs`` then times an
all-reduce between every pair of ranks, one pair at a time while the others
wait: links compared with each other, which stays meaningful when every GPU
is equally busy (a hung job's kernels still spinning on them).

Failure modes: an exception ends this rank with a traceback and a non-zero
status, and the parent's time limit ends the rest; rank 0 writes the
result file last and atomically, so a partial file never reads as a result.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ncclwatch.bus_bandwidth import algbw, busbw

_OPS = {"all_reduce": "AllReduce", "all_gather": "AllGather"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device: torch.device, warmup: int, iters: int, group=None) -> float:  # type: ignore[no-untyped-def]
    """Seconds per run, the slowest rank's."""
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def sweep(ops: list[str], sizes: list[int], device: torch.device, warmup: int, iters: int) -> list[dict]:
    """nccl-tests' sizes: the all-reduce buffer, the all-gather output (each rank gives 1/n of it)."""
    world = dist.get_world_size()
    rows = []
    for op in ops:
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)  # float32, a multiple of the rank count
            if op == "all_reduce":
                buf = torch.ones(numel, dtype=torch.float32, device=device)
                run = lambda buf=buf: dist.all_reduce(buf)
            else:
                out = torch.empty(numel, dtype=torch.float32, device=device)
                part = torch.ones(numel // world, dtype=torch.float32, device=device)
                run = lambda out=out, part=part: dist.all_gather_into_tensor(out, part)
            seconds = _timed(run, device, warmup, iters)
            size = numel * 4
            rows.append(
                {
                    "op": _OPS[op],
                    "bytes": size,
                    "nranks": world,
                    "seconds": seconds,
                    "algbw": algbw(size, seconds),
                    "busbw": busbw(_OPS[op], size, world, seconds),
                }
            )
    return rows


def pairs(nbytes: int, device: torch.device, warmup: int, iters: int) -> list[dict]:
    """An all-reduce between every pair of ranks in turn; every rank makes every group (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for a in range(world):
        for b in range(a + 1, world):
            group = dist.new_group([a, b])
            if rank in (a, b):
                buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
                seconds = _timed(lambda: dist.all_reduce(buf, group=group), device, warmup, iters, group=group)  # noqa: B023
                rows.append(
                    {
                        "pair": [a, b],
                        "bytes": buf.numel() * 4,
                        "seconds": seconds,
                        "busbw": busbw("AllReduce", buf.numel() * 4, 2, seconds),
                    }
                )
            dist.barrier()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    unique = {tuple(row["pair"]): row for part in gathered for row in part}
    return [unique[key] for key in sorted(unique)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--ops", default="all_reduce,all_gather")
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--pairs-bytes", type=int, default=0, help="also time every pair of ranks at this size")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if os.environ.get("NCCLWATCH_PREFLIGHT_HOSTID_PER_RANK"):
        # Several ranks on one GPU: NCCL refuses a duplicate GPU on one host, so each rank poses as its own
        # host and NCCL connects them through its network transport (NET/Socket).
        os.environ["NCCL_HOSTID"] = f"ncclwatch-preflight-{os.environ['RANK']}"
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    result = {
        "rows": sweep(args.ops.split(","), [int(s) for s in args.sizes.split(",")], device, args.warmup, args.iters)
    }
    if args.pairs_bytes:
        result["pairs"] = pairs(args.pairs_bytes, device, args.warmup, args.iters)
    if dist.get_rank() == 0:
        result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        result["torch"] = torch.__version__
        result["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
