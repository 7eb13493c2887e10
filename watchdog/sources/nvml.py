"""NVML samples, optional.

NVML is sampled every few seconds (a GPM sample needs a window of about a
second, taken in a thread); without a GPU or driver the source says so once
and stays quiet.  NCCL RAS is deliberately not polled: queries crashed jobs
on several NCCL versions (NVIDIA/nccl#1669, #1718, #1762), so the prober asks
it once per incident, on versions known to survive it (``live/prober.py``).
"""

from __future__ import annotations

import asyncio

from ncclwatch.watchdog.events import SourceDown
from ncclwatch.watchdog.probes.nvml import gpu_snapshot
from ncclwatch.watchdog.sources import Emit

NVML_EVERY_S = 5.0


class NvmlSource:
    name = "nvml"

    async def run(self, emit: Emit) -> None:
        while True:
            snapshot = await gpu_snapshot()
            if snapshot is None:
                emit(
                    SourceDown(
                        source=self.name, reason="NVML not available (no NVIDIA driver or GPU): no GPU signatures"
                    )
                )
                return
            emit(snapshot)
            await asyncio.sleep(NVML_EVERY_S)
