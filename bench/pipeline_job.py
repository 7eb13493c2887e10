#!/usr/bin/env python3
"""A pipeline-parallel training job (1F1B), one stage per rank; can misbehave on purpose (run it under torchrun).

Every step, each stage ``s`` of the ``WORLD_SIZE`` stages runs Megatron's
non-interleaved 1F1B schedule over ``--microbatches`` microbatches: a few
forwards to fill the pipeline (``WORLD_SIZE - s - 1``), then one forward and
one backward in turn, then the backwards left.  Activations go to stage
``s + 1``, gradients back to ``s - 1``; where a stage both sends and receives
at once it posts the pair with ``batch_isend_irecv`` (as Megatron does: two
blocking calls in opposite orders deadlock), otherwise a plain ``send`` or
``recv``.  Each stage's part is a small MLP; the last stage's loss is
all_reduced for logging and every stage takes an AdamW step (torch's
optimizer hook is what ncclwatch's injected heartbeat sees).

At ``--fault-step``:

  none          healthy: ``--steps`` steps, then a clean exit
  both_recv     EVERY rank pairs with rank ^ 1 and exchanges its microbatch count, each calling ``recv``
                before ``send`` (shared buggy code): a point-to-point deadlock naming both
  missing_send  stage ``--fault-rank`` (default: the last) never sends the gradient of its last
                microbatch back to stage ``--fault-rank - 1``, which waits for it in ``recv``; the
                faulty stage goes on to the loss all_reduce.  The culprit is ``--fault-rank``.

Just before misbehaving a rank writes ``<mark dir>/fault.<rank>`` (JSON: fault, rank, step, time).

On CUDA (NCCL) each rank uses GPU ``LOCAL_RANK % device_count``; when a node has more ranks than GPUs
each rank sets its own ``NCCL_HOSTID`` (unless given), as NCCL refuses two ranks of one host on one GPU.
``--device cpu`` runs on gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ranks import join_job  # bench/ranks.py: the script's folder is on sys.path

from ncclwatch.launcher.demo_job import mark as demo_mark

FAULTS = ("none", "both_recv", "missing_send")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo backend")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="width of each stage's MLP")
    parser.add_argument("--batch", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of simulated work per step")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument(
        "--fault-rank", type=int, default=-1, help="missing_send: the stage that never sends (default: the last)"
    )
    parser.add_argument("--fault-step", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> goes")
    return parser.parse_args(argv)


class Stage:
    """One pipeline stage: its part of the model and its neighbours."""

    def __init__(self, torch, dist, rank: int, world: int, device, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
        self.torch, self.dist, self.rank, self.world, self.device = torch, dist, rank, world, device
        self.shape = (args.batch, args.hidden)
        torch.manual_seed(rank)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(), torch.nn.Linear(args.hidden, args.hidden)
        ).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.first, self.last = rank == 0, rank == world - 1

    def _buffer(self):  # type: ignore[no-untyped-def]
        return self.torch.empty(self.shape, device=self.device)

    def exchange(self, sends: list[tuple], recvs: list[int]) -> list:  # type: ignore[type-arg]
        """Post ``sends`` [(tensor, dst)] and receives from ``recvs`` [src]: one call alone, several as one batch."""
        dist = self.dist
        buffers = [self._buffer() for _ in recvs]
        if len(sends) + len(recvs) == 1:
            if sends:
                dist.send(sends[0][0], dst=sends[0][1])
            else:
                dist.recv(buffers[0], src=recvs[0])
            return buffers
        ops = [dist.P2POp(dist.isend, t, dst) for t, dst in sends] + [
            dist.P2POp(dist.irecv, b, src) for b, src in zip(buffers, recvs)
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buffers

    def forward(self, x, step: int, micro: int):  # type: ignore[no-untyped-def]
        if x is None:  # the first stage makes its microbatch
            gen = self.torch.Generator(device=self.device).manual_seed(step * 1000 + micro)
            x = self.torch.randn(self.shape, device=self.device, generator=gen)
        x = x.detach().requires_grad_(not self.first)
        y = self.model(x)
        loss = (y.float() ** 2).mean() if self.last else None
        return x, y, loss


def one_step(stage: Stage, step: int, microbatches: int, skip_last_grad: bool):  # type: ignore[no-untyped-def]
    """Megatron's 1F1B without interleaving; returns the step's summed loss (last stage) or zero."""
    torch, rank = stage.torch, stage.rank
    prev = None if stage.first else rank - 1
    nxt = None if stage.last else rank + 1
    warmup = min(stage.world - rank - 1, microbatches)
    in_flight: list = []  # (input, output, loss) per microbatch not yet backpropagated
    total = torch.zeros(1, device=stage.device)

    def fwd(x, micro: int):  # type: ignore[no-untyped-def]
        inp, out, loss = stage.forward(x, step, micro)
        in_flight.append((inp, out, loss))
        if loss is not None:
            total.add_(loss.detach())
        return out

    def bwd(grad):  # type: ignore[no-untyped-def]
        inp, out, loss = in_flight.pop(0)
        (loss if loss is not None else out).backward(None if loss is not None else grad)
        return inp.grad

    for micro in range(warmup):
        x = stage.exchange([], [prev])[0] if prev is not None else None
        out = fwd(x, micro)
        if nxt is not None:
            stage.exchange([(out.detach(), nxt)], [])
    steady = microbatches - warmup
    x = stage.exchange([], [prev])[0] if prev is not None and steady else None
    for i in range(steady):
        out = fwd(x, warmup + i)
        grad = stage.exchange([(out.detach(), nxt)], [nxt])[0] if nxt is not None else None
        dgrad = bwd(grad)
        last_one = i == steady - 1
        if prev is None:
            continue
        if last_one:
            if not (skip_last_grad and warmup == 0):
                stage.exchange([(dgrad, prev)], [])
        else:
            x = stage.exchange([(dgrad, prev)], [prev])[0]
    for j in range(warmup):
        grad = stage.exchange([], [nxt])[0]
        dgrad = bwd(grad)
        if prev is not None and not (skip_last_grad and j == warmup - 1):
            stage.exchange([(dgrad, prev)], [])
    return total


def both_recv(stage: Stage, microbatches: int) -> None:
    """The bug: both sides of a pair receive first, so neither ever reaches its send."""
    peer = stage.rank ^ 1
    if peer < stage.world:
        count = stage.torch.tensor([microbatches], device=stage.device)
        stage.dist.recv(count, src=peer)
        stage.dist.send(count, dst=peer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world, device = join_job(torch, dist, args.device)
    on_gpu = device.type == "cuda"
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    if args.fault == "missing_send" and not 1 <= fault_rank < world:
        raise SystemExit("missing_send: --fault-rank must name a stage after the first (it sends gradients back)")
    stage = Stage(torch, dist, rank, world, device, args)
    for step in range(args.steps):
        at_fault = args.fault != "none" and step == args.fault_step
        if at_fault and args.fault == "both_recv":
            demo_mark(args.mark_dir, args.fault, rank, step, job="pipeline_job")
            both_recv(stage, args.microbatches)
        skip = at_fault and args.fault == "missing_send" and rank == fault_rank
        if skip:
            demo_mark(args.mark_dir, args.fault, rank, step, job="pipeline_job")
        loss = one_step(stage, step, args.microbatches, skip_last_grad=skip)
        dist.all_reduce(loss)  # the last stage's loss, for the log line: every stage's one collective a step
        stage.optimizer.step()
        stage.optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0:
            value = loss.item() / args.microbatches
            if rank == 0:
                print(f"[pipeline_job] step {step} loss {value:.4f}", file=sys.stderr, flush=True)
        if args.step_time:
            time.sleep(args.step_time)
    if on_gpu:
        torch.cuda.synchronize()
    dist.barrier()  # every rank past its last p2p before any tears down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
