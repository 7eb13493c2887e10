#!/usr/bin/env python3
"""Two gloo ranks under torchrun: rank 0 waits in one kind of communication while rank 1 sleeps in its own code.

What a waiting rank's stack looks like to py-spy depends on who issued the
communication; ``capture_stacks.py`` runs each ``--wait`` below, dumps rank 0
with py-spy while it waits, and keeps the JSON under ``tests/fixtures/stacks/``:

  schedule_1f1b       torch.distributed.pipelining's Schedule1F1B, 2 stages: rank 0 (stage 0) waits for stage 1
  irecv_wait          ``dist.irecv(...)`` then ``work.wait()`` in the user's code
  batch_p2p_wait      ``dist.batch_isend_irecv([...])`` then ``work.wait()`` on each
  functional          a functional collective (``funcol.all_reduce``) whose result is used: ``wait_tensor``
  dtensor             a DTensor ``redistribute`` from ``Shard(0)`` to ``Replicate()`` (an all_gather)
  compiled_aot_eager  ``torch.compile(backend="aot_eager")`` of a function calling ``funcol.all_reduce``
  compiled_inductor   the same through inductor (generated Python calling ``torch.ops._c10d_functional.*``)

Rank 0 writes ``<mark dir>/waiting.0`` (JSON: pid, wait, time) just before it enters the wait; rank 1 sleeps in
Python until ``<mark dir>/release`` appears (at most ``--hold`` seconds), then posts its side: the job ends by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

WAITS = (
    "schedule_1f1b",
    "irecv_wait",
    "batch_p2p_wait",
    "functional",
    "dtensor",
    "compiled_aot_eager",
    "compiled_inductor",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wait", choices=WAITS, required=True)
    parser.add_argument("--hold", type=float, default=120.0, help="at most this many seconds rank 1 sleeps")
    parser.add_argument("--mark-dir", default=".")
    return parser.parse_args(argv)


def mark_waiting(directory: str, wait: str) -> None:
    path = os.path.join(directory, "waiting.0")
    with open(path + ".tmp", "w") as handle:
        json.dump({"pid": os.getpid(), "wait": wait, "time": time.time()}, handle)
    os.replace(path + ".tmp", path)


def hold(args: argparse.Namespace) -> None:
    """Rank 1's own code, busy with something else, until released."""
    release, deadline = os.path.join(args.mark_dir, "release"), time.monotonic() + args.hold
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)


def schedule_1f1b(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    batch, target = torch.randn(4, 8), torch.randn(4, 8)
    schedule.step(batch) if rank == 0 else schedule.step(target=target)  # a first step: shapes known, buffers made
    if rank == 1:
        hold(args)
    else:
        mark_waiting(args.mark_dir, args.wait)
    schedule.step(batch) if rank == 0 else schedule.step(target=target)


def irecv_wait(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    buffer = torch.zeros(4)
    if rank == 1:
        hold(args)
        dist.send(buffer, dst=0)
        return
    work = dist.irecv(buffer, src=1)
    mark_waiting(args.mark_dir, args.wait)
    work.wait()


def batch_p2p_wait(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = torch.ones(4), torch.zeros(4)
    if rank == 1:
        hold(args)
    peer = 1 - rank
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    if rank == 0:
        mark_waiting(args.mark_dir, args.wait)
    for work in works:
        work.wait()


def functional(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed._functional_collectives as funcol

    if rank == 1:
        hold(args)
    else:
        mark_waiting(args.mark_dir, args.wait)
    reduced = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
    print(f"rank {rank}: {float(reduced.sum())}", file=sys.stderr)  # the first use waits (wait_tensor)


def dtensor(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank == 1:
        hold(args)
    else:
        mark_waiting(args.mark_dir, args.wait)
    full = sharded.redistribute(mesh, [Replicate()]).to_local()
    print(f"rank {rank}: {float(full.sum())}", file=sys.stderr)


def compiled(torch, dist, rank: int, args: argparse.Namespace, backend: str) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed._functional_collectives as funcol

    def summed(x):  # type: ignore[no-untyped-def]
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    step = torch.compile(summed, backend=backend)
    step(torch.ones(4))  # compiled once, on both ranks, before the wait
    if rank == 1:
        hold(args)
    else:
        mark_waiting(args.mark_dir, args.wait)
    print(f"rank {rank}: {float(step(torch.ones(4)).sum())}", file=sys.stderr)


def compiled_aot_eager(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    compiled(torch, dist, rank, args, "aot_eager")


def compiled_inductor(torch, dist, rank: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    compiled(torch, dist, rank, args, "inductor")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    globals()[args.wait](torch, dist, rank, args)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
