"""One NVML snapshot per call, in ncclwatch's own JSON format.

    {"time": unix, "gpus": [{"index", "uuid", "bus_id", "util_gpu_pct", "util_mem_pct", "power_w",
      "sm_clock_mhz", "gpm": {"sm_util_pct", "sm_occupancy_pct", "dram_bw_util_pct",
      "any_tensor_util_pct"} | null, "processes": [{"pid", "used_memory_bytes"}]}]}

(read by ``watchdog.parsing.nvml``; ``tools/capture`` writes lists of these).
GPU-Util alone only says "a kernel is resident"; GPM (Hopper and newer, where
``nvmlGpmQueryDeviceSupport`` says so) tells a NCCL kernel spinning on 24
channels from a 1-block kernel, so each snapshot spends ``gpm_window_s``
between two GPM samples.  ``time`` is the end of that window.

NVML is initialised once per process, lazily, under a lock.  Where it is
absent (no driver, no GPU, no pynvml) ``sample_gpus`` returns None at once,
every time, after one debug log line: no data, not an error loop.  A field
NVML cannot give is null; nothing raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ncclwatch.watchdog.events import Citation, GpuSnapshot
from ncclwatch.watchdog.parsing.nvml import snapshot_from_doc

try:
    import pynvml
except ImportError:  # the daemon runs without it: every call is "no data"
    pynvml = None

log = logging.getLogger(__name__)

# (our key, NVML GPM metric id): SM_UTIL=2, SM_OCCUPANCY=3, ANY_TENSOR_UTIL=5, DRAM_BW_UTIL=10
GPM_METRICS = (("sm_util_pct", 2), ("sm_occupancy_pct", 3), ("dram_bw_util_pct", 10), ("any_tensor_util_pct", 5))

# One thread in NVML at a time: the NVML source and a probe (or the bundle's evidence) sample at once, each from its
# own thread.  On 4 x H200 a sidecar died of SIGSEGV in a look that sampled while the source may have been
# sampling too; not proven the cause, but nothing here needs two threads inside NVML.  Never held across the GPM
# window's sleep.
_lock = threading.Lock()
_usable: bool | None = None  # None: not tried yet; False: tried and failed, never retried


def _nvml_ready() -> bool:
    global _usable
    with _lock:
        if _usable is None:
            _usable = False
            if pynvml is None:
                log.debug("NVML not available: pynvml is not installed")
            else:
                try:
                    pynvml.nvmlInit()
                    _usable = True
                except (pynvml.NVMLError, OSError) as exc:
                    log.debug("NVML not available: %s", exc)
        return _usable


def _safe(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def sample_gpus(gpm_window_s: float = 1.0) -> dict | None:
    """Blocks for ``gpm_window_s`` when a GPU supports GPM; call it from a thread in async code."""
    if not _nvml_ready():
        return None
    try:
        with _lock:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        log.debug("NVML device enumeration failed: %s", exc)
        return None
    gpm = _gpm_window(handles, gpm_window_s)
    with _lock:
        return {"time": time.time(), "gpus": [_gpu(i, h, gpm.get(i)) for i, h in enumerate(handles)]}


async def sample_gpus_async(gpm_window_s: float = 1.0) -> dict | None:
    return await asyncio.to_thread(sample_gpus, gpm_window_s)


def _gpu(index: int, handle: Any, gpm: dict | None) -> dict:
    util = _safe(pynvml.nvmlDeviceGetUtilizationRates, handle)
    pci = _safe(pynvml.nvmlDeviceGetPciInfo, handle)
    power_mw = _safe(pynvml.nvmlDeviceGetPowerUsage, handle)
    procs = _safe(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return {
        "index": index,
        "uuid": _text(_safe(pynvml.nvmlDeviceGetUUID, handle)),
        "bus_id": _text(pci.busId) if pci is not None else None,
        "util_gpu_pct": util.gpu if util is not None else None,
        "util_mem_pct": util.memory if util is not None else None,
        "power_w": round(power_mw / 1000.0, 3) if power_mw is not None else None,
        "sm_clock_mhz": _safe(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
        "gpm": gpm,
        # usedGpuMemory is None where NVML cannot tell (MIG, some containers)
        "processes": [{"pid": int(p.pid), "used_memory_bytes": p.usedGpuMemory} for p in procs],
    }


def _gpm_supported(handle: Any) -> bool:
    support = _safe(pynvml.nvmlGpmQueryDeviceSupport, handle)
    return bool(support is not None and support.isSupportedDevice)


def _gpm_window(handles: list, window_s: float) -> dict[int, dict]:
    """{gpu index: metrics over the window}; GPUs without GPM are left out (their "gpm" is null)."""
    with _lock:
        supported = [i for i, h in enumerate(handles) if _gpm_supported(h)]
    if not supported:
        return {}
    first: dict[int, Any] = {}
    second: dict[int, Any] = {}
    try:
        for samples in (first, second):
            if samples is second:
                time.sleep(window_s)
            with _lock:
                for i in supported:
                    sample = pynvml.nvmlGpmSampleAlloc()
                    samples[i] = sample
                    pynvml.nvmlGpmSampleGet(handles[i], sample)
        with _lock:
            return {i: m for i in supported if (m := _gpm_metrics(first[i], second[i])) is not None}
    except pynvml.NVMLError as exc:
        log.debug("NVML GPM sampling failed: %s", exc)
        return {}
    finally:
        with _lock:
            for sample in (*first.values(), *second.values()):
                _safe(pynvml.nvmlGpmSampleFree, sample)


def _gpm_metrics(sample1: Any, sample2: Any) -> dict | None:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(GPM_METRICS)
    request.sample1 = sample1
    request.sample2 = sample2
    for k, (_, metric_id) in enumerate(GPM_METRICS):
        request.metrics[k].metricId = metric_id
    if _safe(pynvml.nvmlGpmMetricsGet, request) is None:
        return None
    return {
        name: round(request.metrics[k].value, 4) if int(request.metrics[k].nvmlReturn) == 0 else None
        for k, (name, _) in enumerate(GPM_METRICS)
    }


async def gpu_snapshot() -> GpuSnapshot | None:
    """One NVML sample with GPM over the preceding second; None without NVML."""
    sample = await sample_gpus_async()
    if sample is None:
        return None
    snapshot = snapshot_from_doc(sample, Citation(file="nvml (live)"))
    return snapshot if isinstance(snapshot, GpuSnapshot) else None
