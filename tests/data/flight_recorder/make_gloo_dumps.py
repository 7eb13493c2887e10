"""Make the torch 2.13 gloo Flight Recorder dumps (CPU only, 2 ranks).

Run: ``OUT=out TORCH_FR_BUFFER_SIZE=100 torchrun --nproc-per-node 2 make_gloo_dumps.py``.
Gloo records collectives only (its send/recv and batch_isend_irecv left no
entry), has no CUDA events (every entry stays "scheduled"), and records
one empty process group in pg_config.
"""

import os

import torch
import torch._C._distributed_c10d as c
import torch.distributed as dist


def main() -> None:
    out = os.environ.get("OUT", "out")
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.all_gather([torch.zeros(4) for _ in range(world)], t)
    dist.barrier()
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.zeros(3), peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.zeros(2), 0)
    group = dist.new_group([0, 1], group_desc="my_sub")
    dist.all_reduce(torch.ones(5, dtype=torch.float64), group=group)
    dist.all_to_all_single(torch.zeros(4), torch.ones(4))
    dist.reduce(torch.ones(3), 0)
    with open(f"{out}/fr_pickle_rank_{rank}", "wb") as f:
        f.write(c._dump_fr_trace())
    with open(f"{out}/fr_json_rank_{rank}", "wb") as f:
        f.write(c._dump_fr_trace_json())
    dist.destroy_process_group()


main()
