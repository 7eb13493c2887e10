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
