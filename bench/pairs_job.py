#!/usr/bin/env python3
"""A training job whose ranks talk in overlapping pairs: the job ``bench/slow_links.py`` runs under the wrapper.

Each rank trains its own slice of a bf16 MLP (forward, backward), then
all-reduces its gradient (``--grad-mb``) with each of its two neighbours on
a ring of pair groups {0,1}, {1,2}, ..., {N-1,0} (as tensor- or
sequence-parallel neighbours exchange activations), then all-reduces the
loss over the whole job (read on the host every step, as a logging job
does).  Same op, same size, different groups: exactly what the slow-link
detector compares; a rank whose link is slow slows its two groups and no
other, which names it.

Faults (``--fault``):

  none       every rank on time.
  fewer_sockets  the fault rank's NCCL opens one socket per connection and no
             helper threads (``NCCL_SOCKET_NTHREADS=1 NCCL_NSOCKS_PERTHREAD=1``)
             where the others open 4 threads x 4 sockets, from the first step
             (a node configured unlike its peers; slower only where sockets
             bound the transfer).
  straggler  from ``--fault-after`` seconds, the fault rank waits 40 % of its
             own step time before each step (slow data loading, a hot CPU).
  slow_link  the fault rank's NCCL (and gloo) listens on the loopback
             interface (``NCCL_SOCKET_IFNAME=lo``, 127.0.0.1) where the others
             listen on the machine's own interface, so a throttle on traffic
             to 127.0.0.1 (``bench/slow_links.py``) slows only what the other
             ranks send to it: one rank's link, as a faulty cable on one node.

Without a GPU it runs on gloo (a dry run: gloo's Flight Recorder has no
durations, so only the straggler can be found).  Every rank has its own ``NCCL_HOSTID``, so NCCL joins them over its
network transport even when they share one GPU.  Rank 0 decides when to stop
(``--seconds``) and tells the others through the loss all-reduce, so every
rank runs the same number of steps.  Marks (JSON, ``--mark-dir``):
``first_step`` (time of rank 0's first finished step), ``fault.<rank>``
(the moment the fault began), ``steps`` (steps run and seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def mark(folder: str, name: str, **data: object) -> None:
    path = Path(folder) / name
    path.with_suffix(".tmp").write_text(json.dumps({"time": time.time(), **data}))
    path.with_suffix(".tmp").rename(path)


def machine_interface() -> str:
    """The first interface with an IPv4 address off the loopback (the one NCCL's default would take)."""
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses):
            return name
    raise SystemExit("slow_link needs an interface besides the loopback")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=("none", "fewer_sockets", "straggler", "slow_link"), default="none")
    parser.add_argument("--fault-rank", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--fault-after", type=float, default=15.0, help="straggler: seconds after the first step")
    parser.add_argument("--seconds", type=float, default=45.0, help="train this long after the first step")
    parser.add_argument("--grad-mb", type=int, default=32, help="size of each pair all-reduce")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mark-dir", default=".")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fault_rank = args.fault_rank % world
    os.environ.setdefault("NCCL_HOSTID", f"pairs-host{rank}")
    slow = args.fault == "fewer_sockets" and rank == fault_rank
    # Read by NCCL's socket transport when the first communicator is made: set before init.
    os.environ["NCCL_SOCKET_NTHREADS"] = "1" if slow else "4"
    os.environ["NCCL_NSOCKS_PERTHREAD"] = "1" if slow else "4"
    if args.fault == "slow_link":
        # Both the fault rank's and the others' explicit: gloo would take the host name's address, often 127.0.0.1 too.
        ifname = "lo" if rank == fault_rank else machine_interface()
        os.environ["NCCL_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = ifname

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # a dry run of the harness on CPU (gloo: arrival skew only, no durations)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # Every rank makes every group, in the same order (new_group is collective over the world).
    pairs = [dist.new_group([r, (r + 1) % world]) for r in range(world)]
    # Each rank takes its two groups in the groups' order: a chain, never a cycle of ranks waiting on each other.
    mine = [pairs[i] for i in sorted({(rank - 1) % world, rank})]

    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(), torch.nn.Linear(args.hidden, args.hidden)
    ).to(device, torch.bfloat16)
    batch = torch.randn(64, args.hidden, device=device, dtype=torch.bfloat16)
    exchange = torch.zeros((args.grad_mb << 20) // 2, device=device, dtype=torch.bfloat16)
    status = torch.zeros(2, device=device)  # loss, stop

    started = fault_at = None
    step = 0
    while True:
        began = time.perf_counter()
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        exchange[: min(flat.numel(), exchange.numel())].copy_(flat[: exchange.numel()])
        for group in mine:
            dist.all_reduce(exchange, group=group)
        model.zero_grad(set_to_none=True)
        status[0] = loss.detach()
        status[1] = float(rank == 0 and started is not None and time.time() - started > args.seconds)
        dist.all_reduce(status)
        stop = status[1].item() > 0  # the host reads it: one sync per step, as a job logging its loss
        step += 1
        if started is None:
            started = time.time()
            if rank == 0:
                mark(args.mark_dir, "first_step")
        if args.fault == "straggler" and rank == fault_rank and time.time() - started > args.fault_after:
            if fault_at is None:
                fault_at = time.time()
                mark(args.mark_dir, f"fault.{rank}", step=step)
            time.sleep(0.4 * (time.perf_counter() - began))
        if stop:
            break
    if rank == 0:
        mark(args.mark_dir, "steps", steps=step, seconds=round(time.time() - started, 1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
