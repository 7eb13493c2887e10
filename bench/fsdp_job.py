#!/usr/bin/env python3
"""An FSDP2 training job that can skip its logging all_reduce on one rank (run it under torchrun).

Every step, on every rank: a stack of ``--blocks`` residual MLP blocks, each
``fully_shard``-ed, and the root (embedding and head) too, with bf16
parameters and fp32 gradient reduction (``MixedPrecisionPolicy``). FSDP2
issues its collectives on one communicator: an all_gather per block in the
forward (the next block's is prefetched), again per block in the backward,
a reduce_scatter per block in the backward (these on a stream of their own),
then the root's. After the optimizer step the rank all_reduces its loss for
logging (``loss.detach()``, one float32): the operation issue #23's job
skipped.

Options that change the step's shape, to check the engine learns it:
``--clip-grad`` (``clip_grad_norm_``: one more scalar all_reduce per step,
just before the optimizer), ``--grad-accum M`` (M micro-batches per step;
gradients reduce-scattered on the last only, ``set_requires_gradient_sync``).

With ``--skip-rank R --skip-step K`` rank R does not all_reduce its loss at
step K: its next collective is the next step's first all_gather, which meets
the others' all_reduce, and the job hangs (NCCL) or fails (gloo checks sizes).
Before skipping, rank R writes ``<mark dir>/fault.R`` (as ``gpu_job.py`` does).

With ``--slow-rank R --slow-ms T`` rank R is a straggler: before each
step's forward its GPU spins for T ms (``torch.cuda._sleep``, a kernel
that busy-waits on the GPU clock: the GPU is late, not its host), so the
others' first all_gather of the step waits for it; on CPU it sleeps.

``--device cpu`` runs on gloo for a local check. Several ranks on one GPU:
NCCL refuses two ranks of one host on one device, so when this node has more
local ranks than GPUs each rank sets its own ``NCCL_HOSTID`` (unless given).
"""

from __future__ import annotations

import argparse
import os
import sys

from ranks import join_job  # bench/ranks.py: the script's folder is on sys.path

from ncclwatch.launcher.demo_job import mark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo backend")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--clip-grad", action="store_true", help="clip_grad_norm_ every step (one more all_reduce)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--skip-rank", type=int, default=-1, help="this rank skips the logging all_reduce (-1: none)")
    parser.add_argument("--skip-step", type=int, default=20)
    parser.add_argument(
        "--slow-rank", type=int, default=-1, help="this rank's GPU is --slow-ms late every step (-1: none)"
    )
    parser.add_argument("--slow-ms", type=float, default=100.0)
    parser.add_argument("--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> goes")
    return parser.parse_args(argv)


def build_model(torch, blocks: int, width: int, vocab: int):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Model()


def gpu_spin(torch, device, seconds: float):
    """A call that keeps this rank's GPU (or, on CPU, its host) busy for ``seconds``: ``torch.cuda._sleep`` takes
    clock cycles, so they are calibrated once against the GPU's own event timer."""
    if device.type != "cuda":
        import time

        return lambda: time.sleep(seconds)
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_second = cycles / (start.elapsed_time(end) / 1e3)
    return lambda: torch.cuda._sleep(int(per_second * seconds))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world, device = join_job(torch, dist, args.device)
    torch.manual_seed(0)
    model = build_model(torch, args.blocks, args.width, args.vocab).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens_gen = torch.Generator(device=device)
    tokens_gen.manual_seed(1000 + rank)

    spin = gpu_spin(torch, device, args.slow_ms / 1e3) if rank == args.slow_rank else None
    for step in range(args.steps):
        if spin is not None:
            spin()
        for micro in range(args.grad_accum):
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            tokens = torch.randint(0, args.vocab, (args.batch, 65), device=device, generator=tokens_gen)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
        if args.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach()
        if rank == args.skip_rank and step == args.skip_step:
            mark(args.mark_dir, "skip", rank, step, job="fsdp_job")
        else:
            dist.all_reduce(logged)
        if rank == 0 and step % 10 == 0:
            print(f"[fsdp_job] step {step} loss {logged.item() / world:.3f}", file=sys.stderr, flush=True)

    dist.barrier()  # every rank past its last collective before any tears down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
