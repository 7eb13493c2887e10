"""What every benchmark job does first under torchrun: its rank, its device, the process group joined.

With more local ranks than GPUs (one GPU lent, several "nodes" on it) each
rank gets its own ``NCCL_HOSTID`` unless one is given, as NCCL refuses two
ranks of one host on one GPU; it then joins them over its socket transport.
"""

from __future__ import annotations

import datetime
import os
from typing import Any


def join_job(torch: Any, dist: Any, device_kind: str, timeout_s: float = 1800.0) -> tuple[int, int, Any]:
    """(rank, world size, device) after ``init_process_group``: NCCL on ``cuda``, gloo on ``cpu``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    on_gpu = device_kind == "cuda"
    if on_gpu:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if local_world > torch.cuda.device_count():
            os.environ.setdefault("NCCL_HOSTID", f"host{rank}")
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout, device_id=device if on_gpu else None)
    return rank, world, device
