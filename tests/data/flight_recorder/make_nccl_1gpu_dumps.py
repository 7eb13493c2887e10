"""Make real NCCL Flight Recorder dumps on one GPU (world size 1).

Run: ``OUT=out TORCH_FR_BUFFER_SIZE=200 TORCH_NCCL_ENABLE_TIMING=1 python3 make_nccl_1gpu_dumps.py``.
One rank cannot make p2p entries; the 2-GPU shared fixture has them.
"""

import os
import pickle

import torch
import torch._C._distributed_c10d as c
import torch.distributed as dist

out = os.environ["OUT"]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
dev = "cuda:0"
t = torch.ones(8, device=dev)


def run(name, fn):
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:
        print("FAILED", name, type(e).__name__, str(e)[:200])


run("all_reduce", lambda: dist.all_reduce(t))
run("broadcast", lambda: dist.broadcast(t, 0))
run("reduce", lambda: dist.reduce(t, 0))
run("all_gather", lambda: dist.all_gather([torch.zeros(8, device=dev)], t))
run("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.zeros(8, device=dev), t))
run("reduce_scatter", lambda: dist.reduce_scatter(torch.zeros(8, device=dev), [t]))
run("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.zeros(8, device=dev), t))
run("all_to_all", lambda: dist.all_to_all([torch.zeros(8, device=dev)], [t]))
run("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(8, device=dev), t))
run("barrier", lambda: dist.barrier())
run("gather", lambda: dist.gather(t, [torch.zeros(8, device=dev)], dst=0))
run("scatter", lambda: dist.scatter(torch.zeros(8, device=dev), [t], src=0))
run("all_reduce_coalesced", lambda: dist.all_reduce_coalesced([t, t.clone()]))


def coal_ag():
    with dist._coalescing_manager(async_ops=False):
        dist.all_gather_into_tensor(torch.zeros(8, device=dev), t)
        dist.all_gather_into_tensor(torch.zeros(8, device=dev), t)


run("coalescing_manager_all_gather", coal_ag)


def coal_rs():
    with dist._coalescing_manager(async_ops=False):
        dist.reduce_scatter_tensor(torch.zeros(8, device=dev), t)
        dist.reduce_scatter_tensor(torch.zeros(8, device=dev), t)


run("coalescing_manager_reduce_scatter", coal_rs)


def coal_ar():
    with dist._coalescing_manager(async_ops=False):
        dist.all_reduce(t)
        dist.all_reduce(t.clone())


run("coalescing_manager_all_reduce", coal_ar)
g = dist.new_group([0], group_desc="tp_group")
run("sub_all_reduce", lambda: dist.all_reduce(torch.ones(3, dtype=torch.bfloat16, device=dev), group=g))
# leave one op in flight-ish: async without wait
w = dist.all_reduce(torch.ones(1 << 20, device=dev), async_op=True)
names = [n for n in dir(c) if "dump" in n]
print("dump functions:", names)
open(f"{out}/nccl_pickle_rank_0", "wb").write(c._dump_nccl_trace())
open(f"{out}/nccl_json_rank_0", "wb").write(c._dump_nccl_trace_json())
if hasattr(c, "_dump_fr_trace_json"):
    open(f"{out}/fr_json_rank_0", "wb").write(c._dump_fr_trace_json())
w.wait()
torch.cuda.synchronize()
d = pickle.loads(open(f"{out}/nccl_pickle_rank_0", "rb").read())  # our own fresh dump
print({k: v for k, v in d.items() if k != "entries"})
for e in d["entries"]:
    print(
        e["record_id"],
        e["pg_id"],
        e["process_group"],
        e["collective_seq_id"],
        e["p2p_seq_id"],
        e["op_id"],
        e["profiling_name"],
        e["state"],
        e["input_sizes"],
        e["output_sizes"],
        e.get("input_dtypes"),
        e.get("duration_ms"),
    )
dist.destroy_process_group()
