"""Slow sources: NVML samples and NCCL RAS reports, both optional.

NVML is sampled every few seconds (a GPM sample needs a window of about a
second, taken in a thread); without a GPU or driver the source says so once
and stays quiet.  RAS answers only while some NCCL process of this user runs;
it is asked every 30 s so the latest report is at hand when a hang comes, and
the probe does not wait on it.
"""

from __future__ import annotations

import asyncio

from ncclwatch.watchdog.parsing.nvml import snapshot_from_doc
from ncclwatch.watchdog.parsing.ras import parse_ras
from ncclwatch.watchdog.events import Citation, GpuSnapshot, SourceDown
from ncclwatch.watchdog.sources import Emit

NVML_EVERY_S = 5.0
RAS_EVERY_S = 30.0


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


class RasSource:
    name = "ras"

    def __init__(self, port: int) -> None:
        self.port = port

    async def run(self, emit: Emit) -> None:
        from ncclwatch.watchdog.probes.ras import query_ras

        while True:
            data, error = await query_ras(self.port, json_format=False, timeout_s=8.0)
            if data:
                for event in parse_ras(data, f"NCCL RAS 127.0.0.1:{self.port} (live)"):
                    emit(event)
            elif error:
                emit(SourceDown(source=self.name, reason=error))
            await asyncio.sleep(RAS_EVERY_S)



