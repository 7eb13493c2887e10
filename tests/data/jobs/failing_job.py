"""A small gloo job on CPU that ends the way real jobs die, to capture what torchrun and the ranks print.

At ``--fault-step`` rank ``--fault-rank`` (default: the last):

  raise        raises ValueError in this file (the user's own code, on purpose)
  sigkill      kills itself with SIGKILL (the OOM killer's way)
  exit         sys.exit(3)
  timeout      sleeps past the process group's timeout (``--timeout-s``): the others' all_reduce times out
  extra        one extra all_reduce of another size (gloo checks sizes: the others abort)
  skip         skips the step's all_reduce: its next, smaller all_gather meets the others' all_reduce
  oom          allocates more GPU memory than the GPU has (CUDA out of memory; --backend nccl)
  none         healthy: --steps steps, then a clean exit

``--backend nccl`` puts every rank on GPU 0, each with its own ``NCCL_HOSTID`` (NCCL then joins them over its
socket transport, as two nodes: NCCL-FACTS.md, "Many nodes on one GPU").

Run it with plain ``torchrun --nproc-per-node=N`` (tests/fixtures/failures/README.md says how each file was made).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

FAULTS = ("none", "raise", "sigkill", "exit", "timeout", "extra", "skip", "oom")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=FAULTS, default="raise")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    return parser.parse_args()


def check_batch(step: int, values: list[float]) -> None:
    if step >= 0:
        raise ValueError(f"batch {step} has {len(values)} values, expected 4")


def main() -> int:
    import torch
    import torch.distributed as dist

    args = parse_args()
    device = torch.device("cpu")
    if args.backend == "nccl":
        os.environ["NCCL_HOSTID"] = f"failing-job-host-{os.environ['RANK']}"
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    grads = torch.ones(1 << 18, device=device)
    gathered = [torch.empty(1024, device=device) for _ in range(world)]
    for step in range(args.steps):
        time.sleep(0.05)
        if rank == fault_rank and step == args.fault_step:
            print(f"[failing_job] rank {rank}: fault '{args.fault}' at step {step}", file=sys.stderr, flush=True)
            if args.fault == "raise":
                check_batch(step, [1.0, 2.0])
            elif args.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "exit":
                sys.exit(3)
            elif args.fault == "timeout":
                time.sleep(args.timeout_s * 4)
            elif args.fault == "extra":
                dist.all_reduce(torch.ones(123, device=device))
            elif args.fault == "oom":
                torch.empty(1 << 43, dtype=torch.uint8, device=device)  # 8 TiB
        if not (args.fault == "skip" and rank == fault_rank and step == args.fault_step):
            dist.all_reduce(grads)
        dist.all_gather(gathered, torch.full((1024,), float(rank), device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
