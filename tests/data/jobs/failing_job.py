"""A small gloo job on CPU that ends the way real jobs die, to capture what torchrun and the ranks print.

At ``--fault-step`` rank ``--fault-rank`` (default: the last):

  raise        raises ValueError in this file (the user's own code, on purpose)
  sigkill      kills itself with SIGKILL (the OOM killer's way)
  exit         sys.exit(3)
  timeout      sleeps past the process group's timeout (``--timeout-s``): the others' all_reduce times out
  extra        one extra all_reduce of another size (gloo checks sizes: the others abort)
  none         healthy: --steps steps, then a clean exit

Run it with plain ``torchrun --nproc-per-node=N`` (tests/fixtures/failures/README.md says how each file was made).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

FAULTS = ("none", "raise", "sigkill", "exit", "timeout", "extra")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=FAULTS, default="raise")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    return parser.parse_args()


def check_batch(step: int, values: list[float]) -> None:
    if step >= 0:
        raise ValueError(f"batch {step} has {len(values)} values, expected 4")


def main() -> int:
    import torch
    import torch.distributed as dist

    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    grads = torch.ones(4096)
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
                dist.all_reduce(torch.ones(123))
        dist.all_reduce(grads)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
