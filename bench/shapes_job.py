#!/usr/bin/env python3
"""One training job in each shape PyTorch's own parallelism libraries build; can misbehave on purpose (under torchrun).

Shapes (``--shape``), each a small but real job of that library:

  ddp             DistributedDataParallel on an MLP
  fsdp2           ``fully_shard`` per block and on the root of a small language model (embedding, residual
                  LayerNorm + MLP blocks, head)
  tp              the same model, ``parallelize_module`` with ``ColwiseParallel`` on each block's up projection and
                  ``RowwiseParallel`` on its down projection over a 1-D ``DeviceMesh`` of all ranks (the set-up
                  scatters each up weight, ``--width`` x 4 ``--width`` = 65536 elements at the default width, from
                  the mesh's first rank)
  pp_gpipe        ``torch.distributed.pipelining``: an MLP cut into one ``PipelineStage`` per rank, ``ScheduleGPipe``
  pp_1f1b         the same with ``Schedule1F1B``
  pp_interleaved  two stages per rank (stage s on rank s mod world), ``ScheduleInterleaved1F1B``
  fsdp2_tp        TorchTitan's recipe on a 2-D mesh ("dp", "tp") = (world / 2, 2): TP over "tp", then
                  ``fully_shard`` over "dp" (4 ranks)
  pp_dp           pipeline x data parallel on a 2-D mesh ("pp", "dp") = (2, world / 2): each stage's gradients
                  all_reduced over "dp" (one flat bucket) before the optimizer.  Stage 0 is ranks 0..dp-1 (the first
                  node when run as 2 wrappers), stage 1 the rest, paired in reverse: with 4 ranks the pipelines are
                  0-3 and 1-2, so ranks 1 and 2 form one pipeline across the two nodes (issue 30's layout)
  compiled        the MLP ``torch.compile``d (``--compile-backend``, inductor), then under DDP

Pipelines use ``--microbatches`` micro-batches (at least the number of stages).  Every step, after the optimizer, every
rank all_reduces its loss over the whole job for logging (a pipeline's stages other than the last send zero): the
collective ``skip`` leaves out.

Faults (``--fault`` on rank ``--fault-rank`` at step ``--fault-step``; ``--fault-where`` is when in that step:
``before`` at its start, ``mid`` between forward and backward (for pipelines: inside the schedule's step, in the
rank's first stage's forward of the first micro-batch, through a forward hook), ``after`` after the optimizer step):

  none        healthy
  stuck       the rank sleeps forever in its own Python code (``while True: time.sleep(1)``)
  skip        the rank leaves out the step's logging all_reduce (``--fault-where`` is not used): its next collective
              meets the others' all_reduce
  dead        the rank exits with ``os._exit(1)``
  gpu_hang    a kernel that never ends on the rank's GPU (``torch.cuda._sleep``) before its next collective (GPU only)
  recv_first  pp_dp only: the rank and its pipeline peer (the other stage of its pipeline, on the other node) each
              ``recv`` from the other before they ``send`` while their data-parallel peers go on to wait in the
              gradient all_reduce: a point-to-point deadlock

Just before misbehaving a rank writes ``<mark dir>/fault.<rank>`` (JSON: fault, rank, step, time), as the other bench
jobs do.  ``--pause-at S --pause-s N``: after step S every rank saves its part of the model (``torch.save`` of its local
state_dict to ``<mark dir>/pause.<rank>.pt``) and sleeps N s, outside any collective: a checkpoint that must not page.

Nothing is printed per step without ``--verbose``.  ``--device cpu`` runs on gloo; on CUDA (NCCL) a node with more
ranks than GPUs gives each rank its own ``NCCL_HOSTID`` (bench/ranks.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from fsdp_job import build_model as build_language_model  # bench/: the script's folder is on sys.path
from ranks import join_job

from ncclwatch.launcher.demo_job import mark as demo_mark

SHAPES = ("ddp", "fsdp2", "tp", "pp_gpipe", "pp_1f1b", "pp_interleaved", "fsdp2_tp", "pp_dp", "compiled")
FAULTS = ("none", "stuck", "skip", "dead", "gpu_hang", "recv_first")
WHERE = ("before", "mid", "after")
PIPELINES = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_dp")
TWO_D = ("fsdp2_tp", "pp_dp")  # a 2-D mesh with 2 on one side: an even world of 4 or more
GPU_FOREVER_CYCLES = 1 << 62  # torch.cuda._sleep's spin: about 70 years at 2 GHz


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, required=True, help="which library builds the job (see above)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo backend")
    parser.add_argument("--steps", type=int, default=100, help="training steps, then a clean exit")
    parser.add_argument("--width", type=int, default=128, help="model width; MLPs widen 4x inside")
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks of the language model (fsdp2, *tp)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the language model")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence of the language model")
    parser.add_argument("--batch", type=int, default=8, help="rows (sequences) per step; per micro-batch in pipelines")
    parser.add_argument("--microbatches", type=int, default=4, help="pipelines: micro-batches per step (>= stages)")
    parser.add_argument("--compile-backend", default="inductor", help="compiled: torch.compile's backend")
    parser.add_argument("--fault", choices=FAULTS, default="none", help="what the fault rank does (see above)")
    parser.add_argument("--fault-rank", type=int, default=1, help="the rank that misbehaves")
    parser.add_argument("--fault-step", type=int, default=50, help="the step it misbehaves at")
    parser.add_argument("--fault-where", choices=WHERE, default="before", help="when in that step (see above)")
    parser.add_argument("--pause-at", type=int, default=-1, help="after this step every rank pauses (-1: never)")
    parser.add_argument("--pause-s", type=float, default=20.0, help="seconds of that pause, after its torch.save")
    parser.add_argument("--log-every", type=int, default=10, help="read the logged loss back every N steps (a sync)")
    parser.add_argument("--verbose", action="store_true", help="print every step's loss (rank 0)")
    parser.add_argument(
        "--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> and pause.<rank>.pt go"
    )
    args = parser.parse_args(argv)
    if args.fault == "gpu_hang" and args.device != "cuda":
        parser.error("--fault gpu_hang needs --device cuda: a CPU has no GPU kernel to hang (use stuck instead)")
    if args.fault == "recv_first" and args.shape != "pp_dp":
        parser.error("--fault recv_first is for --shape pp_dp (a pipeline across nodes with data-parallel peers)")
    return args


def mlp(torch, width: int):
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


def local_state(module) -> dict:  # type: ignore[type-arg]
    """The rank's part of a state_dict: DTensors (FSDP2, TP) as their local shard, so saving issues no collective."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in module.state_dict().items()}


class Fault:
    """This rank's part in the injected fault: when it strikes and what it does."""

    def __init__(self, args: argparse.Namespace, torch, dist, rank: int, device, pair: tuple[int, int] | None) -> None:  # type: ignore[no-untyped-def]
        self.args, self.torch, self.dist, self.rank, self.device = args, torch, dist, rank, device
        culprits = set(pair) if pair else {args.fault_rank}  # recv_first: the fault rank and its pipeline peer
        self.mine = args.fault != "none" and rank in culprits
        self.peer = sum(pair) - rank if pair and self.mine else None  # recv_first: the other side of the pair
        self.step = -1  # the step running now (the pipelines' forward hook reads it)
        self.struck = False

    def at(self, where: str) -> None:
        """Strike if this is the fault's rank, step and place (skip strikes at the logging all_reduce instead)."""
        args = self.args
        if self.struck or not self.mine or args.fault == "skip":
            return
        if where != args.fault_where or self.step != args.fault_step:
            return
        self.struck = True
        demo_mark(args.mark_dir, args.fault, self.rank, self.step, job="shapes_job")
        if args.fault == "stuck":
            while True:
                time.sleep(1)
        elif args.fault == "dead":
            os._exit(1)
        elif args.fault == "gpu_hang":
            self.torch.cuda._sleep(GPU_FOREVER_CYCLES)  # on the current stream: the next collective waits behind it
        elif args.fault == "recv_first":
            count = self.torch.zeros(1, device=self.device)
            self.dist.recv(count, src=self.peer)  # both sides receive first: neither reaches its send
            self.dist.send(count, dst=self.peer)

    def skips_logging(self) -> bool:
        args = self.args
        if not self.mine or args.fault != "skip" or self.step != args.fault_step:
            return False
        demo_mark(args.mark_dir, args.fault, self.rank, self.step, job="shapes_job")
        return True


class DataParallel:
    """ddp and compiled: an MLP under DistributedDataParallel, compiled or not; every rank its own data."""

    def __init__(self, args: argparse.Namespace, torch, dist, rank: int, device) -> None:  # type: ignore[no-untyped-def]
        from torch.nn.parallel import DistributedDataParallel

        self.torch, self.args, self.device = torch, args, device
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(mlp(torch, args.width), mlp(torch, args.width)).to(device)
        inner = self.module
        if args.shape == "compiled":
            # The model compiled, then wrapped: dynamo breaks its graph at DDP's own forward (its logger), so a
            # compiled DDP ran the model eagerly.  Inductor on CPU too: its C++ build of this MLP took 12 s on a
            # 2-core VM with caches off, once, in the first step (the job's start-up, as on GPUs with Triton).
            inner = torch.compile(self.module, backend=args.compile_backend)
        self.model = DistributedDataParallel(inner, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.data = torch.Generator(device=device).manual_seed(1000 + rank)
        self.parts = [self.module]

    def forward_backward(self, step: int, fault: Fault):  # type: ignore[no-untyped-def]
        x = self.torch.randn(self.args.batch, self.args.width, device=self.device, generator=self.data)
        loss = (self.model(x) - x).pow(2).mean()
        fault.at("mid")
        loss.backward()
        return loss


class Sharded:
    """fsdp2, tp and fsdp2_tp: the small language model of bench/fsdp_job.py, sharded by FSDP2, TP or both."""

    def __init__(self, args: argparse.Namespace, torch, dist, rank: int, world: int, device) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.torch, self.args, self.device = torch, args, device
        torch.manual_seed(0)
        self.model = build_language_model(torch, args.blocks, args.width, args.vocab).to(device)
        plan = {}
        for i in range(args.blocks):
            plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
        if args.shape == "tp":
            parallelize_module(self.model, init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)), plan)
            replica = 0  # TP ranks must see the same tokens
        elif args.shape == "fsdp2":
            self._shard(fully_shard, None)
            replica = rank
        else:
            mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(self.model, mesh["tp"], plan)  # TP first, then FSDP over dp: TorchTitan's order
            self._shard(fully_shard, mesh["dp"])
            replica = mesh.get_local_rank("dp")
        # DTensor and plain parameters in groups of their own: AdamW's foreach kernels (the default on CUDA) take
        # one kind per call, and TP alone leaves the embedding, the norms and the head plain.
        params = list(self.model.parameters())
        groups = [[p for p in params if hasattr(p, "to_local")], [p for p in params if not hasattr(p, "to_local")]]
        self.optimizer = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4)
        self.data = torch.Generator(device=device).manual_seed(1000 + replica)
        self.parts = [self.model]

    def _shard(self, fully_shard, mesh) -> None:  # type: ignore[no-untyped-def]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def forward_backward(self, step: int, fault: Fault):  # type: ignore[no-untyped-def]
        args, torch = self.args, self.torch
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=self.device, generator=self.data)
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        fault.at("mid")
        loss.backward()
        return loss


class Pipelined:
    """pp_gpipe, pp_1f1b, pp_interleaved and pp_dp: an MLP cut into ``PipelineStage``s run by a pipelining schedule."""

    def __init__(self, args: argparse.Namespace, torch, dist, rank: int, world: int, device, fault: Fault) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.torch, self.dist, self.args, self.device = torch, dist, args, device
        group, self.dp_group, replica = None, None, 0
        if args.shape == "pp_dp":
            mesh = pp_dp_mesh(torch, device.type, world)
            group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
            pp_rank, pp_size, replica = mesh.get_local_rank("pp"), 2, mesh.get_local_rank("dp")
        else:
            pp_rank, pp_size = rank, world
        per_rank = 2 if args.shape == "pp_interleaved" else 1
        stages = pp_size * per_rank
        if args.microbatches < stages:
            raise SystemExit(f"--microbatches {args.microbatches}: a {args.shape} schedule needs at least {stages}")
        self.parts, self.stages = [], []
        for index in range(pp_rank, stages, pp_size):  # stage s on pipeline rank s mod pp_size
            torch.manual_seed(index)
            part = mlp(torch, args.width).to(device)
            # The "mid" fault: inside the schedule's step, in this rank's first stage's forward.
            part.register_forward_hook(lambda *_: fault.at("mid"))
            self.parts.append(part)
            self.stages.append(PipelineStage(part, index, stages, device, group=group))
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        loss_fn = lambda out, target: torch.nn.functional.mse_loss(out, target)  # noqa: E731
        if args.shape == "pp_interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, args.microbatches, loss_fn=loss_fn)
        else:
            kind = ScheduleGPipe if args.shape == "pp_gpipe" else Schedule1F1B
            self.schedule = kind(self.stages[0], args.microbatches, loss_fn=loss_fn)
        self.optimizer = torch.optim.AdamW([p for part in self.parts for p in part.parameters()], lr=1e-4)
        self.replica = replica

    def forward_backward(self, step: int, fault: Fault):  # type: ignore[no-untyped-def]
        torch, args = self.torch, self.args
        data = torch.Generator(device=self.device).manual_seed(step * 1000 + self.replica)  # alike on every stage
        rows = args.batch * args.microbatches
        x = torch.randn(rows, args.width, device=self.device, generator=data)
        target = torch.randn(rows, args.width, device=self.device, generator=data)
        losses: list = []  # type: ignore[type-arg]
        inputs = (x,) if self.first else ()
        if self.last:
            self.schedule.step(*inputs, target=target, losses=losses)
        else:
            self.schedule.step(*inputs)
        if self.dp_group is not None:
            self._all_reduce_grads()
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        return total / args.microbatches

    def _all_reduce_grads(self) -> None:
        """Each stage's gradients averaged over its data-parallel peers, as one flat bucket."""
        grads = [p.grad for part in self.parts for p in part.parameters()]
        flat = self.torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dist.get_world_size(self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def pp_dp_layout(world: int) -> list[list[int]]:
    """The ("pp", "dp") mesh: stage 0 is ranks 0..dp-1, stage 1 the rest in reverse, so rank dp - 1 (node 0's last)
    and rank dp (node 1's first) form one pipeline, as in issue 30's deadlock."""
    dp = world // 2
    return [list(range(dp)), list(range(world - 1, dp - 1, -1))]


def pp_dp_mesh(torch, device_type: str, world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, pp_dp_layout(world), mesh_dim_names=("pp", "dp"))


def pipeline_peer(world: int, rank: int) -> int:
    """pp_dp: the other stage of ``rank``'s pipeline."""
    stage0, stage1 = pp_dp_layout(world)
    return stage1[stage0.index(rank)] if rank in stage0 else stage0[stage1.index(rank)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world, device = join_job(torch, dist, args.device)
    if args.shape in TWO_D and (world < 4 or world % 2):
        raise SystemExit(f"--shape {args.shape} needs an even world of 4 or more ranks (got {world})")
    if not 0 <= args.fault_rank < world:
        raise SystemExit(f"--fault-rank {args.fault_rank}: the job has ranks 0..{world - 1}")
    pair = (args.fault_rank, pipeline_peer(world, args.fault_rank)) if args.fault == "recv_first" else None
    fault = Fault(args, torch, dist, rank, device, pair)
    if args.shape in PIPELINES:
        job = Pipelined(args, torch, dist, rank, world, device, fault)
    elif args.shape in ("ddp", "compiled"):
        job = DataParallel(args, torch, dist, rank, device)
    else:
        job = Sharded(args, torch, dist, rank, world, device)

    began = time.monotonic()
    for step in range(args.steps):
        fault.step = step
        fault.at("before")
        loss = job.forward_backward(step, fault)
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        fault.at("after")
        logged = loss.detach().float().reshape(1)
        if not fault.skips_logging():
            dist.all_reduce(logged)
        if step % args.log_every == 0 or args.verbose:
            value = logged.item() / world  # a read back: keeps a GPU's host at most --log-every steps ahead
            if args.verbose and rank == 0:
                print(f"[shapes_job] {args.shape} step {step} loss {value:.4f}", file=sys.stderr, flush=True)
        if step == args.pause_at:
            state = {f"part{i}": local_state(part) for i, part in enumerate(job.parts)}
            torch.save(state, os.path.join(args.mark_dir, f"pause.{rank}.pt"))
            time.sleep(args.pause_s)
    dist.barrier()  # every rank past its last collective before any tears down
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"[shapes_job] {args.shape}: {args.steps} steps on {world} ranks in {time.monotonic() - began:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
