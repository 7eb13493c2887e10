"""NVML samples, optional.

NVML is sampled every few seconds (a GPM sample needs a window of about a
second, taken in a thread); without a GPU or driver the source says so once
and stays quiet.  NCCL RAS is deliberately not polled: queries crashed jobs
on several NCCL versions (NVIDIA/nccl#1669, #1718, #1762), so the prober asks
it once per incident, on versions known to survive it (``live/probe.py``).
"""

from __future__ import annotations

import asyncio

from ncclwatch.watchdog.parsing.nvml import snapshot_from_doc
from ncclwatch.watchdog.events import Citation, GpuSnapshot, SourceDown
from ncclwatch.watchdog.sources import Emit

NVML_EVERY_S = 5.0


async def gpu_snapshot() -> GpuSnapshot | None:
    """One NVML sample with GPM over the preceding second; None without NVML."""
    from ncclwatch.watchdog.probes.nvml import sample_gpus_async

    sample = await sample_gpus_async()
    if sample is None:
        return None
    snapshot = snapshot_from_doc(sample, Citation(file="nvml (live)"))
    return snapshot if isinstance(snapshot, GpuSnapshot) else None


class NvmlSource:
    name = "nvml"

    async def run(self, emit: Emit) -> None:
        while True:
            snapshot = await gpu_snapshot()
            if snapshot is None:
                emit(SourceDown(source=self.name, reason="NVML not available (no NVIDIA driver or GPU): no GPU signatures"))
                return
            emit(snapshot)
            await asyncio.sleep(NVML_EVERY_S)
