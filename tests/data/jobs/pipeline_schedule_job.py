#!/usr/bin/env python3
"""A real ``torch.distributed.pipelining`` job (``Schedule1F1B``), optionally x data parallel; misbehaves on purpose.

``WORLD_SIZE = stages x --dp``.  Stage ``s`` holds ranks ``s*dp .. s*dp + dp - 1``
(a node's ranks: its data-parallel group); replicas run in snake order, so
replica ``i`` is rank ``i`` of even stages and rank ``dp - 1 - i`` of odd ones:
with 2 stages x 2 the pipelines are ranks (0, 3) and (1, 2), the ranks next
to the node boundary forming one.  Each replica's stages exchange
activations and gradients through torch's ``PipelineStage`` and
``Schedule1F1B`` over its own process group; after each step a stage
all-reduces its gradients over its data-parallel group (with ``--dp`` > 1)
and takes an SGD step (torch's optimizer hook is what ncclwatch's injected
heartbeat sees).  gloo on CPU.

At ``--fault-step``:

  none          healthy: ``--steps`` steps, then a clean exit
  python_stuck  rank ``--fault-rank`` (default: the last) sleeps forever in its own code before the step;
                its pipeline peers wait for it inside the schedule's point-to-point waits
  both_recv     the two stages of replica ``--fault-replica`` (default: the last) exchange a count, each
                calling ``recv`` before ``send`` (shared buggy code): a point-to-point deadlock; the other
                replicas finish the step and wait in the data-parallel all-reduce

Just before misbehaving a rank writes ``<mark dir>/fault.<rank>`` (JSON: fault, rank, step, time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ncclwatch.launcher.demo_job import mark

FAULTS = ("none", "python_stuck", "both_recv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument(
        "--grad-group",
        choices=("stage", "world"),
        default="stage",
        help="the gradient all-reduce (--dp > 1) spans the stage's data-parallel group or every rank",
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of simulated work per step")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-step", type=int, default=30)
    parser.add_argument("--fault-rank", type=int, default=-1, help="python_stuck: the rank (default: the last)")
    parser.add_argument("--fault-replica", type=int, default=-1, help="both_recv: the replica (default: the last)")
    parser.add_argument("--mark-dir", default=os.environ.get("NCCLWATCH_RUN_DIR", "."), help="where fault.<rank> goes")
    return parser.parse_args(argv)


def pipeline_ranks(replica: int, stages: int, dp: int) -> list[int]:
    """The global ranks of one replica's stages, in stage order (snake order across the stages)."""
    return [s * dp + (replica if s % 2 == 0 else dp - 1 - replica) for s in range(stages)]


def stuck_in_own_code() -> None:
    """The fault: a rank that never comes back from its own code (a data loader that hangs, say)."""
    while True:
        time.sleep(1)


def both_recv(torch, dist, group, stage: int) -> None:  # type: ignore[no-untyped-def]
    """The bug: both stages of a pair receive first, so neither ever reaches its send."""
    peer = 1 - stage  # the group rank of the other stage (two stages)
    count = torch.zeros(1)
    dist.recv(count, group=group, group_src=peer)
    dist.send(count, group=group, group_dst=peer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = world // args.dp
    stage, replicas = rank // args.dp, [pipeline_ranks(i, stages, args.dp) for i in range(args.dp)]
    # Every rank creates every group, in the same order (new_group is collective over the world).
    pp_groups = [dist.new_group(ranks) for ranks in replicas]
    dp_groups = [dist.new_group(list(range(s * args.dp, (s + 1) * args.dp))) for s in range(stages)]
    replica = next(i for i, ranks in enumerate(replicas) if rank in ranks)
    pp_group = pp_groups[replica]
    dp_group = dp_groups[stage] if args.grad_group == "stage" else dist.group.WORLD

    torch.manual_seed(stage)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    pipe = PipelineStage(model, stage, stages, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(pipe, n_microbatches=args.microbatches, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    rows = 2 * args.microbatches
    fault_rank = args.fault_rank if args.fault_rank >= 0 else world - 1
    fault_replica = args.fault_replica if args.fault_replica >= 0 else args.dp - 1

    for step in range(args.steps):
        if step == args.fault_step and args.fault == "python_stuck" and rank == fault_rank:
            mark(args.mark_dir, args.fault, rank, step, job="pipeline_schedule_job")
            stuck_in_own_code()
        if step == args.fault_step and args.fault == "both_recv" and replica == fault_replica:
            mark(args.mark_dir, args.fault, rank, step, job="pipeline_schedule_job")
            both_recv(torch, dist, pp_group, stage)
        batch = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(step * 100 + replica))
        if stage == 0:
            schedule.step(batch)
        elif stage == stages - 1:
            schedule.step(target=torch.zeros(rows, args.hidden))
        else:
            schedule.step()
        if args.dp > 1:
            grads = [p.grad for p in model.parameters()]
            summed = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(summed, group=dp_group)
            for grad, mean in zip(grads, (summed / dist.get_world_size(dp_group)).split([g.numel() for g in grads])):
                grad.copy_(mean.view_as(grad))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.step_time:
            time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
