"""NVML probe: "no data" without a GPU (once, quietly); on a GPU machine, a snapshot our parser reads."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ncclwatch.watchdog.events import GpuSnapshot
from ncclwatch.watchdog.parsing.nvml import parse_nvml
from ncclwatch.watchdog.probes.nvml import sample_gpus, sample_gpus_async

REPO = Path(__file__).resolve().parents[2]
HAVE_GPU = sample_gpus(gpm_window_s=0.1) is not None


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
@pytest.mark.skipif(HAVE_GPU, reason="this machine has a usable GPU")
def test_without_nvml_every_call_is_none_and_logged_once():
    """A fresh process, so the one-time initialisation really happens here."""
    script = (
        "import logging, sys, time; logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "from watchdog.probes.nvml import sample_gpus\n"
        "t = time.monotonic(); got = [sample_gpus() for _ in range(50)]\n"
        "print(got.count(None), round(time.monotonic() - t, 3))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    nones, seconds = out.stdout.split()
    assert int(nones) == 50 and float(seconds) < 1.0  # no GPM window spent, no retry loop
    assert out.stderr.count("NVML not available") == 1


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
@pytest.mark.skipif(HAVE_GPU, reason="this machine has a usable GPU")
def test_async_form_without_nvml():
    started = time.monotonic()
    assert asyncio.run(sample_gpus_async()) is None
    assert time.monotonic() - started < 1.0


@pytest.mark.skipif(not HAVE_GPU, reason="no GPU here")
def test_snapshot_is_in_our_format():
    snapshot = asyncio.run(sample_gpus_async(gpm_window_s=0.5))
    events = parse_nvml(json.dumps(snapshot).encode(), "nvml.json")
    assert [type(e) for e in events] == [GpuSnapshot]
    gpus = events[0].gpus
    assert [g.index for g in gpus] == list(range(len(gpus))) and all(g.uuid.startswith("GPU-") for g in gpus)
    assert all(g.power_w is not None and g.util_gpu_pct is not None for g in gpus)
    assert abs(snapshot["time"] - time.time()) < 5
    print(json.dumps(snapshot["gpus"][0]))  # shown with -s on the GPU machine: GPM is filled on Hopper+


class OneThreadNvml:
    """The part of pynvml that ``sample_gpus`` calls, for two GPUs with GPM; it records whether two threads were ever
    inside it at once.  A stand-in: this machine has no GPU."""

    NVML_CLOCK_SM = 1
    NVML_GPM_METRICS_GET_VERSION = 1

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.inside = 0
        self.overlapped = False
        self.calls = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        answers = {
            "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlGpmQueryDeviceSupport": lambda h: type("Support", (), {"isSupportedDevice": 1})(),
            "nvmlGpmSampleAlloc": object,
            "nvmlGpmSampleGet": lambda h, sample: None,
            "nvmlGpmSampleFree": lambda sample: None,
            "nvmlGpmMetricsGet": lambda request: 0,
            "nvmlDeviceGetUtilizationRates": lambda h: type("Util", (), {"gpu": 100, "memory": 3})(),
            "nvmlDeviceGetPciInfo": lambda h: type("Pci", (), {"busId": f"00000000:0{h}:00.0"})(),
            "nvmlDeviceGetPowerUsage": lambda h: 120_000,
            "nvmlDeviceGetComputeRunningProcesses": lambda h: [],
            "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
            "nvmlDeviceGetClockInfo": lambda h, clock: 1980,
        }
        if name not in answers:
            raise AttributeError(name)
        return self._once(answers[name])

    def _once(self, answer):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            self.inside += 1
            self.calls += 1
            self.overlapped |= self.inside > 1
            time.sleep(0.001)  # long enough for another thread to come in
            try:
                return answer(*args)
            finally:
                self.inside -= 1

        return call

    @staticmethod
    def c_nvmlGpmMetricsGet_t():  # type: ignore[no-untyped-def]
        metric = type("Metric", (), {"metricId": 0, "value": 1.5, "nvmlReturn": 0})
        return type("Request", (), {"metrics": [metric() for _ in range(8)]})()


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_two_threads_sampling_at_once_take_turns_inside_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML source and a probe sample at once, each in its own thread; NVML is entered by one at a time (a
    sidecar died of SIGSEGV in such a look on 4 x H200), and neither waits out the other's GPM window."""
    from ncclwatch.watchdog.probes import nvml

    fake = OneThreadNvml()
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_usable", True)

    async def both() -> list[dict | None]:  # type: ignore[type-arg]
        return list(await asyncio.gather(*(sample_gpus_async(gpm_window_s=0.2) for _ in range(4))))

    started = time.monotonic()
    samples = asyncio.run(both())
    assert time.monotonic() - started < 0.6  # the windows overlap: the lock is not held across the sleep
    assert fake.calls > 40 and not fake.overlapped
    assert all(s is not None and [g["gpm"]["sm_util_pct"] for g in s["gpus"]] == [1.5, 1.5] for s in samples)
