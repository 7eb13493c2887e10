#!/usr/bin/env python3
"""Tensor parallel on gloo (torch 2.13, CPU), with one rank that stalls: the job behind the ``tp_*`` dumps.

The fixtures in ``tp_gloo/``, each made by (from this folder)::

    OUT=tp_gloo/tp2_stuck1 torchrun --standalone --nproc-per-node 2 make_tp_dumps.py --stuck-rank 1
    OUT=tp_gloo/dp2_tp2_stuck3 torchrun --standalone --nproc-per-node 4 make_tp_dumps.py --dp 2 --stuck-rank 3
    OUT=tp_gloo/dp2_tp2_skip3 torchrun --standalone --nproc-per-node 4 make_tp_dumps.py --dp 2 --skip-rank 3

``tp2_stuck1``: a 1-D mesh; rank 1 sleeps in Python at step 4 while rank 0 waits in step 4's first collective.
``dp2_tp2_*``: FSDP2 over dp 2 x tp 2; rank 3 sleeps at step 4, or skips step 4's logging all_reduce on its dp group.

A two-layer MLP, ``parallelize_module`` with ``ColwiseParallel`` (up) and ``RowwiseParallel`` (down) over the
``tp`` mesh dimension; with ``--dp 2`` also ``fully_shard`` over ``dp``. Setting the model up scatters each
sharded weight from the mesh's first rank (``distribute_tensor``): on gloo the scatter's root records its whole
input and every other rank none, the sizes the engine once took for a mismatch. Every step ends with a logging
all_reduce of the loss over the data-parallel group (the default group with a 1-D mesh).

With ``OUT`` set, every rank arms a timer when it reaches the faulty step: ``--dump-after`` seconds later it
writes its Flight Recorder (``_dump_fr_trace``, the recorder gloo fills, with stack traces) to
``$OUT/torch2.13_gloo_fr_rank_<rank>`` and ends its process (the ranks of a skipped collective never return).
Without ``OUT`` (under ``ncclwatch``), the stuck rank sleeps ``--stuck-s`` seconds and the job then goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (FSDP2); tp is the rest of the world")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--stuck-rank", type=int, default=-1, help="this rank sleeps in Python at --stuck-step")
    parser.add_argument("--stuck-step", type=int, default=4)
    parser.add_argument("--stuck-s", type=float, default=3600.0, help="how long it sleeps without OUT")
    parser.add_argument("--skip-rank", type=int, default=-1, help="this rank skips the logging all_reduce")
    parser.add_argument("--skip-step", type=int, default=4)
    parser.add_argument("--dump-after", type=float, default=4.0, help="seconds from the faulty step to the dumps")
    return parser.parse_args(argv)


def dump_and_exit(out: str, rank: int) -> None:
    import torch._C._distributed_c10d as c10d

    data = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    path = os.path.join(out, f"torch2.13_gloo_fr_rank_{rank}")
    with open(path + ".tmp", "wb") as handle:
        handle.write(data)
    os.replace(path + ".tmp", path)
    print(f"[tp_job] rank {rank}: dumped {path}", file=sys.stderr, flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = world // args.dp
    if args.dp > 1:
        mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
    else:
        tp_mesh, dp_group = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), None

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(args.width, 4 * args.width))
    model.add_module("act", torch.nn.GELU())
    model.add_module("down", torch.nn.Linear(4 * args.width, args.width))
    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if args.dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.Generator().manual_seed(100 + (rank // tp))  # the ranks of one tp group see the same batch

    out = os.environ.get("OUT")
    faulty = args.stuck_step if args.stuck_rank >= 0 else args.skip_step
    for step in range(args.steps):
        if out and step == faulty:
            threading.Timer(args.dump_after, dump_and_exit, (out, rank)).start()
        if rank == args.stuck_rank and step == args.stuck_step:
            print(f"[tp_job] rank {rank}: stuck in Python at step {step}", file=sys.stderr, flush=True)
            time.sleep(args.dump_after + 60 if out else args.stuck_s)
        batch = torch.randn(8, args.width, generator=inputs)
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach()
        if rank == args.skip_rank and step == args.skip_step:
            print(f"[tp_job] rank {rank}: skips the logging all_reduce at step {step}", file=sys.stderr, flush=True)
        else:
            dist.all_reduce(logged, group=dp_group)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
