"""A rank is busy when its training thread runs, not when its other threads do.

On the H200 a pipeline stage asleep in Python read as busy: NCCL's proxy thread spun while a peer's send
waited, the process's CPU moved, and the hang was held as "a checkpoint?".  Real processes here: a main
thread asleep beside a spinning thread, and a main thread that spins.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from ncclwatch.watchdog.hang.classify import BUSY_CPU_SHARE
from ncclwatch.watchdog.hang.state import Worker
from ncclwatch.watchdog.sources.workers import sample

SLEEPS_BESIDE_A_SPINNING_THREAD = """
import threading, time
def spin():
    while True:
        sum(range(1000))
threading.Thread(target=spin, daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""
SPINS_IN_ITS_MAIN_THREAD = """
print("up", flush=True)
while True:
    sum(range(1000))
"""


def cpu_share(code: str) -> tuple[float | None, float]:
    """The worker's CPU as the engine reads it, and the whole process's, over one second."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        process = psutil.Process(proc.pid)
        worker = Worker(pid=proc.pid, rank=0)
        first = sample(process, 0)
        time.sleep(1.0)
        last = sample(process, 0)
        assert first is not None and last is not None
        worker.samples.extend([first, last])
        whole = (last.cpu_seconds - first.cpu_seconds) / (last.at - first.at)
        return worker.rates()[0], whole
    finally:
        proc.kill()
        proc.wait()


def test_a_main_thread_asleep_beside_a_spinning_thread_is_not_busy() -> None:
    share, whole = cpu_share(SLEEPS_BESIDE_A_SPINNING_THREAD)
    assert whole >= BUSY_CPU_SHARE  # the process burns CPU ...
    assert share is not None and share < BUSY_CPU_SHARE  # ... its training thread does not


def test_a_main_thread_that_spins_is_busy() -> None:
    share, _ = cpu_share(SPINS_IN_ITS_MAIN_THREAD)
    assert share is not None and share >= BUSY_CPU_SHARE
