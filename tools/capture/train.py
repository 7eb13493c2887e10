#!/usr/bin/env python3
"""Small DDP-style job that can inject one real NCCL hang (run under torchrun).

Every step, on every rank:
  1. DDP forward/backward of a small MLP + SGD step (DDP bucket all_reduces),
  2. all_reduce of a 64 MiB float32 tensor,
  3. all_gather of 1024 floats,
  4. broadcast of 1024 floats from rank 0,
  5. ring batch_isend_irecv (send to rank+1, recv from rank-1),
  6. torch.cuda.synchronize(), then the heartbeat file <dir>/hb/hb.<rank>
     is rewritten with "<step> <unix time>" (last completed step, 0-based).

With --fault, rank --fault-rank injects one fault at step --fault-step, after
the DDP backward of that step and before its explicit collectives:
  none          healthy run: --steps steps, destroy_process_group, exit 0
  skip          skip the step's all_reduce/all_gather/broadcast/p2p, go on
  extra         one extra all_reduce (--extra-numel floats) before the step's all_reduce
  python_stuck  time.sleep(1e6) in Python
  sigstop       os.kill(os.getpid(), SIGSTOP)
  spin_kernel   torch.cuda._sleep(~--spin-seconds) on the current stream just
                before the step's all_reduce, then carry on normally
  exit          os._exit(3)
Just before injecting, the faulty rank writes <dir>/fault.<rank> with
"<scenario> <step> <unix time>".

--backend gloo runs the same job on CPU (for dry runs of the capture driver
on a machine without GPUs; spin_kernel then degrades to time.sleep).
"""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

FAULTS = ("none", "skip", "extra", "python_stuck", "sigstop", "spin_kernel", "exit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="capture directory (hb/, fault.<rank>, meta.<rank>.json go here)")
    p.add_argument("--steps", type=int, default=40, help="steps to run (a faulty run usually never finishes them)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=-1, help="rank that injects the fault (default: last rank)")
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout, seconds")
    p.add_argument("--step-sleep", type=float, default=0.0, help="host sleep after each step, seconds")
    p.add_argument("--ar-mib", type=float, default=64.0, help="size of the per-step all_reduce, MiB")
    p.add_argument("--extra-numel", type=int, default=12345, help="numel of the 'extra' all_reduce")
    p.add_argument("--spin-seconds", type=float, default=600.0, help="length of the spin_kernel kernel")
    p.add_argument("--spin-clock-mhz", type=float, default=1980.0, help="SM clock used to turn seconds into cycles")
    return p.parse_args(argv)


def write_atomic(path, text):
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def nccl_version_str():
    try:
        v = torch.cuda.nccl.version()
        if isinstance(v, tuple):
            return ".".join(str(x) for x in v)
        return str(v)
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    faulty = args.fault != "none" and rank == fault_rank
    hb_dir = os.path.join(args.dir, "hb")
    os.makedirs(hb_dir, exist_ok=True)

    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    meta = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "backend": args.backend,
        "torch": torch.__version__,
        "nccl": nccl_version_str() if args.backend == "nccl" else None,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(local_rank) if args.backend == "nccl" else "cpu",
        "fault": args.fault,
        "fault_rank": fault_rank,
        "fault_step": args.fault_step,
        "steps": args.steps,
        "start_unix": time.time(),
    }
    write_atomic(os.path.join(args.dir, f"meta.{rank}.json"), json.dumps(meta, indent=1))
    print(
        f"[train] rank {rank}/{world} pid {os.getpid()} device {device} fault={args.fault} "
        f"fault_rank={fault_rank} fault_step={args.fault_step}",
        file=sys.stderr,
        flush=True,
    )

    dist.init_process_group(backend=args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if args.backend == "nccl" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    ar_numel = int(args.ar_mib * 1024 * 1024) // 4
    big = torch.ones(ar_numel, dtype=torch.float32, device=device)
    ag_in = torch.full((1024,), float(rank), dtype=torch.float32, device=device)
    ag_out = [torch.empty(1024, dtype=torch.float32, device=device) for _ in range(world)]
    bc = torch.zeros(1024, dtype=torch.float32, device=device)
    p2p_send = torch.full((1024,), float(rank), dtype=torch.float32, device=device)
    p2p_recv = torch.empty(1024, dtype=torch.float32, device=device)
    extra = torch.ones(args.extra_numel, dtype=torch.float32, device=device)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    for step in range(args.steps):
        x = torch.randn(32, 1024, device=device)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        do_collectives = True
        spin_now = False
        if faulty and step == args.fault_step:
            write_atomic(os.path.join(args.dir, f"fault.{rank}"), f"{args.fault} {step} {time.time()!r}\n")
            print(f"[train] rank {rank} injecting fault {args.fault} at step {step}", file=sys.stderr, flush=True)
            if args.fault == "skip":
                do_collectives = False
            elif args.fault == "extra":
                dist.all_reduce(extra)
            elif args.fault == "python_stuck":
                time.sleep(1e6)
            elif args.fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "exit":
                os._exit(3)
            elif args.fault == "spin_kernel":
                spin_now = True

        if do_collectives:
            if spin_now:
                if args.backend == "nccl":
                    cycles = int(args.spin_seconds * args.spin_clock_mhz * 1e6)
                    torch.cuda._sleep(cycles)  # 1-thread kernel on the current stream
                else:
                    time.sleep(args.spin_seconds)
            dist.all_reduce(big)
            dist.all_gather(ag_out, ag_in)
            if rank == 0:
                bc.fill_(float(step))
            dist.broadcast(bc, src=0)
            ops = [dist.P2POp(dist.isend, p2p_send, nxt), dist.P2POp(dist.irecv, p2p_recv, prv)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if args.backend == "nccl":
            torch.cuda.synchronize()
        write_atomic(os.path.join(hb_dir, f"hb.{rank}"), f"{step} {time.time()!r}\n")
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    print(f"[train] rank {rank} finished {args.steps} steps", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
