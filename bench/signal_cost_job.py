#!/usr/bin/env python3
"""One rank of a signal-cost job: joins the job, warms up, then times one block each time it is told.

Started by ``bench/signal_cost.py`` (not torchrun), which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, and the environment of the configuration being measured.
Protocol: the rank prints ``SIGNALCOST {"ready": ...}`` on stdout once warm,
then for each ``RUN`` line on stdin runs one block and prints
``SIGNALCOST {"times": {item: seconds}}``; ``EXIT`` ends it cleanly. Other
stdout lines (NCCL's own, where a configuration prints there) are not ours.

Workloads (``--workload``):

  allreduce  back-to-back all_reduces of a few KiB, the worst case for a per-operation cost. Items: one per
             ``--sizes`` entry, ``--ops`` asynchronous all_reduces each (the host enqueues, the GPU runs them in
             order), and ``ar<largest>_sync``: ``--sync-ops`` all_reduces each followed by a device synchronize
             (a blocking small collective, where host-side costs show in full).
  fsdp2_tp   a real training step on a 2-D mesh ("dp", "tp") = (world / 2, 2): bench/fsdp_job.py's language
             model with TP (ColwiseParallel up, RowwiseParallel down projections) over "tp", then FSDP2 over
             "dp" (TorchTitan's order); forward, cross-entropy, backward, AdamW step. One item, ``step``:
             ``--steps`` steps.

Each block starts after a device synchronize and a barrier (not timed) and
ends with a device synchronize, so it times the GPU's work, not only the
host's enqueueing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from fsdp_job import build_model  # bench/: the script's folder is on sys.path
from ranks import join_job

PROTOCOL = "SIGNALCOST"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("allreduce", "fsdp2_tp"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="1024,32768", help="allreduce: message sizes in bytes, comma-separated")
    parser.add_argument("--ops", type=int, default=3000, help="allreduce: asynchronous operations per size")
    parser.add_argument("--sync-ops", type=int, default=1000, help="allreduce: blocking operations")
    parser.add_argument("--steps", type=int, default=20, help="fsdp2_tp: training steps per block")
    parser.add_argument("--blocks", type=int, default=4, help="fsdp2_tp: residual blocks")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    return parser.parse_args(argv)


class AllReduces:
    """The worst case: many small all_reduces back to back, then blocking ones."""

    def __init__(self, args: argparse.Namespace, torch, dist, device) -> None:  # type: ignore[no-untyped-def]
        self.torch, self.dist, self.device = torch, dist, device
        sizes = [int(size) for size in args.sizes.split(",")]
        # Zeros: a sum of zeros stays finite however many times it is reduced.
        tensors = {size: torch.zeros(size // 4, dtype=torch.float32, device=device) for size in sizes}
        self.items = [(f"ar{size // 1024}k", tensors[size], args.ops, False) for size in sizes]
        largest = max(sizes)
        self.items.append((f"ar{largest // 1024}k_sync", tensors[largest], args.sync_ops, True))

    def block(self) -> dict[str, float]:
        times = {}
        for name, tensor, ops, blocking in self.items:
            start = settle(self.torch, self.dist, self.device)
            for _ in range(ops):
                self.dist.all_reduce(tensor)
                if blocking:
                    synchronize(self.torch, self.device)
            synchronize(self.torch, self.device)
            times[name] = time.perf_counter() - start
        return times


class Fsdp2Tp:
    """A 2-D (dp, tp) training step: TP inside each block, FSDP2 over dp."""

    def __init__(self, args: argparse.Namespace, torch, dist, device) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        world = dist.get_world_size()
        if world < 4 or world % 2:
            raise SystemExit(f"fsdp2_tp needs an even world of 4 or more ranks, not {world}")
        self.torch, self.dist, self.device, self.args = torch, dist, device, args
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        self.model = build_model(torch, args.blocks, args.width, args.vocab).to(device)
        plan = {}
        for i in range(args.blocks):
            plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(self.model, mesh["tp"], plan)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(self.model, mesh=mesh["dp"])
        # DTensor and plain parameters apart: AdamW's foreach kernels take one kind per call.
        params = list(self.model.parameters())
        groups = [[p for p in params if hasattr(p, "to_local")], [p for p in params if not hasattr(p, "to_local")]]
        self.optimizer = torch.optim.AdamW([{"params": group} for group in groups if group], lr=1e-4)
        self.data = torch.Generator(device=device).manual_seed(1000 + mesh.get_local_rank("dp"))

    def step(self) -> None:
        torch, args = self.torch, self.args
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.device, generator=self.data)
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def block(self) -> dict[str, float]:
        start = settle(self.torch, self.dist, self.device)
        for _ in range(self.args.steps):
            self.step()
        synchronize(self.torch, self.device)
        return {"step": time.perf_counter() - start}


def synchronize(torch, device) -> None:  # type: ignore[no-untyped-def]
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle(torch, dist, device) -> float:  # type: ignore[no-untyped-def]
    """Every rank at the same point with an idle GPU; the block's clock starts here."""
    synchronize(torch, device)
    dist.barrier()
    synchronize(torch, device)
    return time.perf_counter()


def say(message: dict) -> None:
    print(f"{PROTOCOL} {json.dumps(message)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world, device = join_job(torch, dist, args.device)
    workload = (AllReduces if args.workload == "allreduce" else Fsdp2Tp)(args, torch, dist, device)
    workload.block()  # connections, allocator, first-call paths: not what a block measures
    versions = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    say({"ready": {"rank": rank, "world": world, "pid": os.getpid(), **versions}})
    while command := sys.stdin.readline().strip():
        if command == "EXIT":
            break
        say({"rank": rank, "times": workload.block()})
    dist.barrier()  # every rank past its last collective before any tears down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
