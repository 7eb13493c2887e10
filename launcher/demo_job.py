"""A small data-parallel training job that can misbehave on purpose (run it under torchrun).

``ncclwatch demo`` runs it; the end-to-end tests and the GPU benchmarks run it
too.  Every step, on every rank: a DDP forward/backward of a small MLP and an
SGD step (the injected heartbeat hook sees it), then an ``all_reduce``, an
``all_gather`` and a ``broadcast`` from rank 0.  Works on CPU with gloo
(default without a GPU) and on GPUs with NCCL.

At ``--fault-step``, rank ``--fault-rank`` (default: the last) misbehaves as
``FAULTS`` says (``ncclwatch demo --help`` prints the same list).

Before misbehaving, the rank writes ``<mark dir>/fault.<rank>`` = JSON
``{"fault", "rank", "step", "time"}`` so a benchmark can measure detection
latency from the real start of the fault.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import signal
import sys
import time

FAULTS = {
    "none": "healthy: --steps steps, then a clean exit",
    "skip": "skips the step's all_reduce and goes on (its all_gather meets the others' all_reduce)",
    "extra": "one extra all_reduce of another size before the step's all_reduce",
    "python_stuck": "sleeps in Python forever, outside any collective",
    "sigstop": "stops itself (SIGSTOP)",
    "spin_kernel": "a GPU kernel that spins ~10 minutes before the step's all_reduce (NCCL; CPU: a sleep)",
    "exit": "dies with exit code 3",
    "pause": "EVERY rank sleeps --pause-s outside collectives (a checkpoint), then goes on",
    "straggle": "sleeps --pause-s in Python while the others wait, then goes on (a hang that resolves)",
    "uneven": "healthy, but rank-dependent step times and every 10th step 4x longer",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=FAULTS, default="skip")
    parser.add_argument("--fault-rank", type=int, default=-1, help="rank that misbehaves (default: the last)")
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--pause-s", type=float, default=20.0, help="length of the 'pause' fault")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--numel", type=int, default=1 << 16, help="elements of the per-step all_reduce")
    parser.add_argument(
        "--crash-attempts",
        type=int,
        default=0,
        help=(
            "the faulty rank first crashes (exit 3 at step 3) in this many attempts, "
            "so torchrun --max-restarts restarts the job"
        ),
    )
    parser.add_argument("--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> goes")
    return parser.parse_args(argv)


def mark(directory: str, fault: str, rank: int, step: int, job: str = "demo") -> None:
    """``<directory>/fault.<rank>``: when the rank misbehaved, for the benchmarks' latencies (also bench/gpu_job.py)."""
    path = os.path.join(directory, f"fault.{rank}")
    with open(path + ".tmp", "w") as handle:
        json.dump({"fault": fault, "rank": rank, "step": step, "time": time.time()}, handle)
    os.replace(path + ".tmp", path)
    print(f"[{job}] rank {rank}: fault '{fault}' at step {step}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=30)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        # torchrun keeps its store across restarts; gloo (torch 2.13) would read the dead
        # attempt's addresses from it, so each attempt gets its own key prefix.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"ncclwatch-demo-attempt{restart}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    faulty = args.fault not in ("none", "uneven") and (rank == fault_rank or args.fault == "pause")
    crash = rank == fault_rank and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < args.crash_attempts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    big = torch.ones(args.numel, device=device)
    extra = torch.ones(12345, device=device)
    gathered = [torch.empty(64, device=device) for _ in range(world)]
    mine = torch.full((64,), float(rank), device=device)
    shared = torch.zeros(64, device=device)

    for step in range(args.steps):
        loss = ddp(torch.randn(16, 256, device=device)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_time = args.step_time
        if args.fault == "uneven":
            step_time *= (1 + rank / max(world, 1)) * (4 if step % 10 == 9 else 1)
        time.sleep(step_time)

        skip = False
        if crash and step == 3:
            print(f"[demo] rank {rank}: crashing to make torchrun restart the job", file=sys.stderr, flush=True)
            os._exit(3)
        if faulty and step == args.fault_step:
            mark(args.mark_dir, args.fault, rank, step)
            if args.fault == "skip":
                skip = True
            elif args.fault == "extra":
                dist.all_reduce(extra)
            elif args.fault == "python_stuck":
                time.sleep(1e6)
            elif args.fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "exit":
                os._exit(3)
            elif args.fault in ("pause", "straggle"):
                time.sleep(args.pause_s)
            elif args.fault == "spin_kernel":
                if backend == "nccl":
                    torch.cuda._sleep(int(600 * 1.98e9))  # one thread spinning ~10 min at ~2 GHz
                else:
                    time.sleep(600)
        if not skip:
            dist.all_reduce(big)
        dist.all_gather(gathered, mine)
        dist.broadcast(shared, src=0)
        if backend == "nccl":
            torch.cuda.synchronize()

    print(f"[demo] rank {rank}: {args.steps} steps done", file=sys.stderr, flush=True)
    # Every rank past its last collective before any tears down: without this, torch 2.13's gloo aborted a
    # rank at exit ("terminate called without an active exception") in 4 of 12 plain torchrun runs.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def leave(code: int) -> None:
    """Exit after the atexit hooks (the injected heartbeat's and Flight Recorder responder's), without the
    interpreter's teardown: even after the barrier and ``destroy_process_group``, torch 2.13's gloo aborted a
    healthy rank there once in CI ("terminate called without an active exception", exit -6, after its last
    step), and torchrun then fails a job that did all its work."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
