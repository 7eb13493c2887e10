#!/usr/bin/env python3
"""A real data-parallel training job for the benchmarks; can misbehave on purpose (run it under torchrun).

Every step, on every rank:

1. a causal bf16 transformer language model on synthetic tokens generated on
   the device (no downloads): forward, cross-entropy, backward under DDP
   (its gradient bucket all_reduces), AdamW step (torch's optimizer hook is
   what ncclwatch's injected heartbeat sees);
2. an all_reduce of the per-token losses for logging (the mean is read back
   with ``.item()`` every ``--log-every`` steps, which also keeps the host at
   most that many steps ahead of the GPU);
3. a small broadcast from rank 0 (a control tensor, as a stop flag would be).

Sizes (``--size``; each knob can be overridden): ``tiny`` for CPU dry runs,
``short`` (6 layers, d_model 768, seq 256, batch 16: ~10-20 ms a step on one
H100) and ``long`` (8 layers, d_model 1024, seq 512, batch 96: ~200 ms).
``short_compute`` (4 layers, d_model 256, seq 1024, batch 16) is a short step
whose gradients are small (10 MB): where two ranks share one GPU and NCCL
moves data over its socket transport, ``short``'s 110 MB all_reduce makes the
step network-bound (~86 ms on one H100) and hides per-step costs.

At ``--fault-step`` rank ``--fault-rank`` misbehaves, after the step's
backward and optimizer step and before its explicit collectives:

  none          healthy: ``--steps`` steps, then a clean exit
  skip          skips the loss all_reduce (its broadcast meets the others' all_reduce)
  dtype         all_reduces the losses as float32 where the others send bfloat16 (same numel)
  conditional   one all_reduce only it calls, inside an ``if`` (a gradient-norm log on one rank)
  p2p_deadlock  EVERY rank pairs with rank ^ 1 and calls ``recv`` before ``send`` (shared buggy code)
  syscall       blocks in ``os.read`` on a pipe nobody writes
  long_kernel   a CUDA kernel that spins ~``--spin-s`` before its all_reduce (GPU only; CPU: a sleep)
  sigkill       SIGKILLs itself
  exception     raises torch.cuda.OutOfMemoryError while the others wait in the all_reduce
  checkpoint    healthy: writes ``--pause-s`` of heavy disk I/O while the others wait in a barrier
  straggler     healthy: from then on sleeps an extra 30 % of its own step time every step
  pause         healthy: EVERY rank pauses ``--pause-s`` outside collectives (an evaluation)
  sigstop       stops itself (SIGSTOP)
  raise         raises ValueError in this file (the user's own check, on purpose): the job dies
  oom           allocates 1 PiB on its device: the allocator's real out-of-memory error, the job dies
  exit          ``sys.exit(3)``, the user's own decision: no incident
  pg_timeout    sleeps in its own code past ``--pg-timeout-s``: PyTorch's timeout ends its peers, the job dies

Just before misbehaving the rank writes ``<mark dir>/fault.<rank>`` = JSON
``{"fault", "rank", "step", "time"}`` (wall clock), so a benchmark measures
detection from the real start of the fault.  For ``pause`` every rank writes one.

Rank 0 writes ``--result`` (JSON) at a clean end: steady-state steps/s over the
steps after ``--warmup-steps`` (timed with a device synchronize at both ends),
the wall-clock time of process start and of the end of the first step, and
what ran.

Several ranks on one GPU: NCCL refuses two ranks of one host on one device,
so when this node has more local ranks than GPUs each rank sets its own
``NCCL_HOSTID`` (unless given) and NCCL links them through its socket transport.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from ranks import join_job  # bench/ranks.py: the script's folder is on sys.path

from ncclwatch.launcher.demo_job import mark as demo_mark

STARTED_AT = time.time()

FAULTS = (
    "none",
    "skip",
    "dtype",
    "conditional",
    "p2p_deadlock",
    "syscall",
    "long_kernel",
    "sigkill",
    "exception",
    "checkpoint",
    "straggler",
    "pause",
    "sigstop",
    "raise",
    "oom",
    "exit",
    "pg_timeout",
)
ALL_RANK_FAULTS = ("pause", "p2p_deadlock")  # every rank misbehaves (and writes a mark)
SIZES = {
    #        layers d_model heads seq batch vocab
    "tiny": (2, 64, 4, 32, 4, 512),
    "short": (6, 768, 12, 256, 16, 8192),
    "short_compute": (4, 256, 4, 1024, 16, 4096),
    "long": (8, 1024, 16, 512, 96, 8192),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo backend")
    parser.add_argument("--size", choices=tuple(SIZES), default="short")
    for knob in ("layers", "d-model", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{knob}", type=int, help="overrides the size's value")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=30, help="excluded from steps/s")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--fault-step", type=int, default=100)
    parser.add_argument("--pause-s", type=float, default=40.0, help="length of pause and checkpoint")
    parser.add_argument("--spin-s", type=float, default=600.0, help="length of the long_kernel kernel")
    parser.add_argument(
        "--pg-timeout-s", type=float, default=1800.0, help="the process group's timeout (pg_timeout: a few seconds)"
    )
    parser.add_argument("--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> goes")
    parser.add_argument("--result", help="rank 0 writes its steps/s here (JSON)")
    return parser.parse_args(argv)


def mark(directory: str, fault: str, rank: int, step: int) -> None:
    demo_mark(directory, fault, rank, step, job="gpu_job")


def build_model(torch, layers: int, d_model: int, heads: int, seq: int, vocab: int):
    nn, functional = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, heads, d_model // heads).permute(2, 0, 3, 1, 4)
            attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d_model))
            return x + self.mlp(self.norm2(x))

    class LanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.position = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            return self.head(self.norm(self.blocks(self.embed(tokens) + self.position(positions))))

    return LanguageModel()


def write_heavy_io(directory: str, seconds: float) -> int:
    """Rewrite a 1 GiB file in 64 MiB fsynced chunks for ``seconds`` (a checkpoint that keeps the disk busy)."""
    chunk = os.urandom(1 << 20) * 64
    path = os.path.join(directory, "checkpoint.bin")
    written, deadline = 0, time.monotonic() + seconds
    with open(path, "wb") as handle:
        while time.monotonic() < deadline:
            if handle.tell() >= 1 << 30:
                handle.seek(0)
            handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
            written += len(chunk)
    os.remove(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world, device = join_job(torch, dist, args.device, timeout_s=args.pg_timeout_s)
    on_gpu = device.type == "cuda"
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    faulty = args.fault != "none" and (rank == fault_rank or args.fault in ALL_RANK_FAULTS)

    layers, d_model, heads, seq, batch, vocab = SIZES[args.size]
    layers, d_model, heads = args.layers or layers, args.d_model or d_model, args.heads or heads
    seq, batch, vocab = args.seq or seq, args.batch or batch, args.vocab or vocab
    torch.manual_seed(0)
    model = build_model(torch, layers, d_model, heads, seq, vocab).to(device=device, dtype=torch.bfloat16)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
    tokens_gen = torch.Generator(device=device)
    tokens_gen.manual_seed(1000 + rank)
    control = torch.zeros(16, dtype=torch.int64, device=device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    first_step_at = measured_from = None

    for step in range(args.steps):
        if step == args.warmup_steps:
            sync()
            measured_from = time.perf_counter()
        began = time.perf_counter()
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=tokens_gen)
        logits = ddp(tokens[:, :-1])
        token_losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
        )
        token_losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses = token_losses.detach()

        reduce_losses = True
        if faulty and step == args.fault_step:
            mark(args.mark_dir, args.fault, rank, step)
            reduce_losses = inject(args, torch, dist, rank, world, device, losses)
        if reduce_losses:
            dist.all_reduce(losses)
        dist.broadcast(control, src=0)
        if args.fault == "checkpoint" and step == args.fault_step:
            dist.barrier()  # the others wait here while the fault rank writes
        if step % args.log_every == 0:
            mean = losses.float().mean().item() / world
            if rank == 0 and step % (10 * args.log_every) == 0:
                print(f"[gpu_job] step {step} loss {mean:.3f}", file=sys.stderr, flush=True)
        if faulty and args.fault == "straggler" and step >= args.fault_step:
            # A real straggler is slow on the device too: wait for this step's work, then add 30 %.
            sync()
            time.sleep(0.3 * (time.perf_counter() - began))
        if first_step_at is None:
            sync()
            first_step_at = time.time()

    sync()
    ended = time.perf_counter()
    if rank == 0 and args.result:
        measured = args.steps - args.warmup_steps
        result = {
            "steps_per_s": round(measured / (ended - measured_from), 3) if measured_from and measured > 0 else None,
            "steps_measured": measured,
            "warmup_steps": args.warmup_steps,
            "started_at": STARTED_AT,
            "first_step_at": first_step_at,
            "ended_at": time.time(),
            "world": world,
            "size": args.size,
            "shape": {"layers": layers, "d_model": d_model, "heads": heads, "seq": seq, "batch": batch, "vocab": vocab},
            "params": sum(p.numel() for p in model.parameters()),
            "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
            "fault": args.fault,
        }
        with open(args.result + ".tmp", "w") as handle:
            json.dump(result, handle)
        os.replace(args.result + ".tmp", args.result)
    dist.barrier()  # every rank past its last collective before any tears down (gloo aborted a rank at exit otherwise)
    dist.destroy_process_group()
    return 0


def check_batch(losses) -> None:
    """The user's own check, failing on purpose: a ValueError from this file, no collective fault."""
    raise ValueError(f"batch of {losses.numel()} token losses has a NaN; refusing to step")


def inject(args, torch, dist, rank: int, world: int, device, losses) -> bool:
    """The fault itself; returns whether this rank still all_reduces the losses this step."""
    fault = args.fault
    if fault == "skip":
        return False
    if fault == "dtype":
        dist.all_reduce(losses.float())
        return False
    if fault == "conditional":
        # Called only where ``faulty`` holds: the classic ``if rank == 0: dist.all_reduce(...)`` for a log line.
        dist.all_reduce(losses.float().sum().reshape(1))
        return True
    if fault == "p2p_deadlock":
        peer = rank ^ 1
        if peer < world:
            buffer = torch.zeros(1024, device=device)
            dist.recv(buffer, src=peer)  # both sides receive first: neither ever sends
            dist.send(buffer, dst=peer)
        return True
    if fault == "syscall":
        read_end, _write_end = os.pipe()  # the write end stays open, so the read never sees EOF
        os.read(read_end, 1)
    elif fault == "long_kernel":
        if device.type == "cuda":
            # torch.cuda._sleep spins for a number of GPU cycles; ~2 GHz is an H100/H200 boost clock.
            torch.cuda._sleep(int(args.spin_s * 2e9))
        else:
            time.sleep(args.spin_s)
    elif fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "exception":
        raise torch.cuda.OutOfMemoryError(f"ncclwatch bench: injected out-of-memory on rank {rank}")
    elif fault == "raise":
        check_batch(losses)
    elif fault == "oom":
        # A real allocation that cannot succeed (1 PiB), on the GPU or in host memory: the allocator's own error.
        torch.empty(1 << 50, dtype=torch.uint8, device=device)
    elif fault == "exit":
        sys.exit(3)  # the user's own decision to stop: no incident
    elif fault == "pg_timeout":
        time.sleep(args.pg_timeout_s * 4)  # in this rank's own code: its peers' collective times out
    elif fault == "checkpoint":
        written = write_heavy_io(args.mark_dir, args.pause_s)
        print(f"[gpu_job] rank {rank}: checkpoint wrote {written >> 20} MiB", file=sys.stderr, flush=True)
    elif fault == "pause":
        time.sleep(args.pause_s)
    elif fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    return True


if __name__ == "__main__":
    sys.exit(main())
