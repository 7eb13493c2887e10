"""A training job that checkpoints and resumes, for ``--on-hang restart`` (run it under torchrun).

A small transformer language model under DDP with AdamW; every step also
all_reduces the loss for logging.  Rank 0 saves model, optimizer and step to
``--ckpt-dir`` every ``--ckpt-every`` steps; every rank resumes from it when
it exists, so a restarted round goes on where the last checkpoint left off.

Rank 0 appends one JSON line per event to ``--events``: ``start`` (round,
step it starts from), ``step`` (each step, with the wall time) and ``done``;
the faulty rank adds ``fault`` just before it misbehaves.  The restart
benchmark reads the time from the fault to the first step of the next round
from these lines.

Faults (at ``--fault-step`` on ``--fault-rank``, only in the first
``--fault-rounds`` rounds, so a fault can be transient):
  sigstop  the rank stops itself (a process frozen by the kernel, a debugger)
  gather   the rank all_gathers the loss where the others all_reduce it (a branch on the rank: every round)
  stuck    the rank sleeps in Python forever, outside any collective
Works on CPU with gloo and on GPUs with NCCL (``--device cuda``: one GPU per local rank, or several ranks
of one GPU, each its own ``NCCL_HOSTID``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--events", required=True, help="JSON lines from rank 0 and the faulty rank")
    parser.add_argument("--fault", choices=("none", "sigstop", "gather", "stuck"), default="none")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--fault-rounds", type=int, default=1, help="rounds (torchrun restarts + 1) that misbehave")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=128, help="model width (the GPU benchmark uses more)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of extra compute per step (CPU jobs)")
    return parser.parse_args(argv)


def log_event(path: str, **fields: object) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps({**fields, "time": time.time()}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # The restart round every node agrees on: torchrun's rendezvous round as ncclwatch records it (a node's
    # TORCHELASTIC_RESTART_COUNT counts only the restarts its own workers failed into).
    round_ = int(os.environ.get("NCCLWATCH_RDZV_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            os.environ.setdefault("NCCL_HOSTID", f"host{rank}")  # two ranks on one GPU: NCCL wants two "hosts"
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(minutes=30)
    # env://, as most jobs do: ncclwatch gives each restart round its own view of torchrun's store.  (A per-round
    # prefix of the job's own from TORCHELASTIC_RESTART_COUNT breaks on several nodes: only the node whose
    # worker failed counts the restart, so the nodes of one round read different prefixes.)
    dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)

    torch.manual_seed(0)
    vocab, seq = 512, 64
    layer = torch.nn.TransformerEncoderLayer(args.width, nhead=4, dim_feedforward=4 * args.width, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, args.width),
        torch.nn.TransformerEncoder(layer, args.layers),
        torch.nn.Linear(args.width, vocab),
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    checkpoint = Path(args.ckpt_dir) / "ckpt.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"] + 1
    if rank == 0:
        log_event(args.events, event="start", round=round_, step=start)

    faulty = args.fault != "none" and rank == args.fault_rank and round_ < args.fault_rounds
    generator = torch.Generator(device="cpu").manual_seed(1000 + rank)
    for step in range(start, args.steps):
        tokens = torch.randint(0, vocab, (8, seq), generator=generator).to(device)
        logits = ddp(tokens)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if faulty and step == args.fault_step:
            log_event(args.events, event="fault", fault=args.fault, rank=rank, step=step, round=round_)
            if args.fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "stuck":
                time.sleep(1e6)
        reported = loss.detach().clone()
        if faulty and args.fault == "gather" and step == args.fault_step:
            dist.all_gather([torch.empty_like(reported) for _ in range(world)], reported)
        else:
            dist.all_reduce(reported)
        if cuda:
            torch.cuda.synchronize()
        if rank == 0:
            log_event(args.events, event="step", step=step, round=round_, loss=reported.item() / world)
        if (step + 1) % args.ckpt_every == 0:
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save(state, str(checkpoint) + ".tmp")
                os.replace(str(checkpoint) + ".tmp", checkpoint)
            dist.barrier()

    if rank == 0:
        log_event(args.events, event="done", round=round_, step=args.steps)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
