"""End to end on CPU: the performance look under the real wrapper names a real straggler and does not page it.

``python -m ncclwatch --perf-interval 3 ... torchrun bench/gpu_job.py
--device cpu --fault straggler``: two gloo ranks train a small DDP model;
from step 5 rank 1 sleeps an extra 30 % of its step after each step, so
it enters every step's gradient all-reduce late while rank 0 waits in it.
gloo's Flight Recorder gives each entry its enqueue time (no completion,
no duration: arrival skew, no bandwidth), which is what the look needs.
While the job runs, /metrics must show rank 1 as the straggler; the
wrapper's log names it once; a configured webhook receives nothing
(``page_on_straggler`` is off by default) and no bundle is written (a
straggler is not a hang).  The fault comes before the job has run the 10
rounds a straggler needs, so no look can judge the healthy steps alone: on
two loaded cores a healthy pair of ranks can be unevenly served.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families
from receiver import Receiver
from support import free_port, kill_leftovers, watched

pytest.importorskip("torch")
# Two ranks' arrival times decide it, and other workers' jobs on the same two cores would skew them: run alone.
pytestmark = pytest.mark.serial

# 300 CPU steps: 2.4 steps/s on the 2-core CI machine of 2026-11-24 (a fresh-clone run reached step 268 at 120 s)
TIMEOUT_S = 240


def samples(body: str) -> dict[tuple[str, str | None], float]:
    """(name, its rank or kind label) -> value of each sample."""
    return {
        (s.name, s.labels.get("rank") or s.labels.get("kind")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


async def run_straggler_job(tmp_path: Path) -> tuple[int, str, dict, list]:  # type: ignore[type-arg]
    """The job under the wrapper; its exit code, stderr, the first /metrics showing a straggler,
    and the webhook's requests."""
    port = free_port()
    job = [str(REPO / "bench" / "gpu_job.py"), "--device", "cpu", "--size", "tiny", "--batch", "16", "--seq", "64"]
    job += ["--steps", "300", "--fault", "straggler", "--fault-step", "5"]
    command = watched(tmp_path, job, "--listen", f"127.0.0.1:{port}", "--perf-interval", "3", nproc=2)
    async with Receiver() as receiver:
        env = {**os.environ, "NCCLWATCH_WEBHOOK_URL": receiver.url}
        process = await asyncio.create_subprocess_exec(*command, env=env, cwd=tmp_path, stderr=asyncio.subprocess.PIPE)
        assert process.stderr is not None
        stderr = asyncio.create_task(process.stderr.read())
        ended = asyncio.create_task(process.wait())
        seen: dict = {}  # type: ignore[type-arg]
        async with aiohttp.ClientSession() as session:
            while not ended.done() and not seen:
                await asyncio.sleep(1.0)
                try:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        scraped = samples(await response.text())
                except aiohttp.ClientError:
                    continue  # not serving yet, or already gone
                if scraped.get(("ncclwatch_rank_straggler", "1")) == 1:
                    seen = scraped
        code = await asyncio.wait_for(ended, TIMEOUT_S)
        return code, (await stderr).decode(errors="replace"), seen, receiver.seen


def test_a_straggler_is_named_in_metrics_and_the_log_and_not_paged(tmp_path: Path) -> None:
    try:
        code, stderr, metrics, pages = asyncio.run(asyncio.wait_for(run_straggler_job(tmp_path), TIMEOUT_S))
    finally:
        leftovers = kill_leftovers(tmp_path)
    assert not leftovers, f"processes outlived the wrapper: {leftovers}"
    assert code == 0, stderr[-3000:]
    assert metrics, f"no scrape showed a straggler:\n{stderr[-3000:]}"
    assert metrics[("ncclwatch_rank_straggler", "0")] == 0
    assert (
        metrics[("ncclwatch_rank_last_arrival_ratio", "1")] >= 0.6 > metrics[("ncclwatch_rank_last_arrival_ratio", "0")]
    )
    assert metrics[("ncclwatch_perf_findings", "straggler")] == 1
    said = [line for line in stderr.splitlines() if "performance: straggler" in line]
    assert len(said) == 1 and "performance: straggler: rank 1 (" in said[0] and "AllReduce" in said[0], stderr[-3000:]
    assert pages == []  # page_on_straggler is off
    assert not (tmp_path / "bundles").exists()
