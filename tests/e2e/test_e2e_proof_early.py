"""End to end on CPU, default settings: proof pages within seconds, even in the first steps; silence waits.

Real torchrun, 3 gloo ranks, real py-spy, the real wrapper, and no ``--stall-timeout``: before the job has shown
8 steps the stall timeout is the 300 s warm-up timeout, so a hang is paged early only when its evidence proves it
(``hang/verdicts.py``'s conclusive verdicts, ``live/incident.py``'s peeks).  Each hung run is bounded well below
300 s, so a watchdog that waits for the warm-up timeout fails here fast.

- rank 1 skips the all_reduce of step 1 (its all_gather meets its peers' all_reduce): ``collective_mismatch
  [1]``, found by a peek at 3 s of silence (gloo writes no NCCL log: the Flight Recorder dumps show it);
- rank 1 exits 0 at step 2 while its peers wait (a rank that returned early; a forked child keeps its gloo
  sockets open, as a dead peer over NVLink or shared memory leaves NCCL's ranks waiting): ``process_dead [1]``
  from the workers' /proc alone, once torchrun would have ended the others (5 s);
- controls that must not page before the warm-up timeout: every rank pausing 15 s outside collectives at step 1
  (a checkpoint), and rank 1 alone in its own code for 15 s while its peers wait (loading, compiling).
"""

from __future__ import annotations

import datetime
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from support import assert_offline_parity, demo, fault_time, only_report, run_watched

pytest.importorskip("torch")
# Each bounds the time from the wrapper's start to the page: run alone, not beside other workers' jobs.
pytestmark = pytest.mark.serial

HUNG_S = 90  # a hung run is killed by the wrapper (--on-hang kill) long before this; the warm-up timeout is 300 s
PAGED_WITHIN_S = 30  # from the wrapper's start to the page

# A rank that exits 0 early (torchrun waits for the others) and whose gloo connections stay open in a child.
EARLY_EXIT_JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    big, parts = torch.ones(1024), [torch.empty(64) for _ in range(world)]
    for step in range(30):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(0.05)
        if rank == 1 and step == 2:
            with open(os.path.join(os.environ["NCCLWATCH_RUN_DIR"], "fault.1"), "w") as mark:
                mark.write('{"time": %r}' % time.time())
            print(f"[job] rank 1: exits at step {step}", file=sys.stderr, flush=True)
            if os.fork() == 0:  # holds the sockets: its peers see no reset, they wait
                time.sleep(120)
                os._exit(0)
            os._exit(0)
        dist.all_reduce(big)
        dist.all_gather(parts, torch.zeros(64))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def run(tmp_path: Path, job: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """The wrapper's result (``--on-hang kill``) and when it started; no process of the job may outlive it."""
    started = time.time()
    return run_watched(tmp_path, job, "--on-hang", "kill", timeout_s=HUNG_S), started


def paged_after(report: dict, since: float) -> float:
    return datetime.datetime.fromisoformat(report["detected_at"]).timestamp() - since


def test_a_collective_skipped_at_step_1_is_paged_within_seconds(tmp_path: Path) -> None:
    done, started = run(tmp_path, demo("skip", "--fault-step=1", "--fault-rank=1"))
    assert done.returncode == 3, done.stderr[-3000:]
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("collective_mismatch", [1])
    latency = paged_after(report, fault_time(tmp_path))
    print(f"skip at step 1: paged {latency:.1f} s after the fault, {paged_after(report, started):.1f} s after start")
    assert paged_after(report, started) < PAGED_WITHIN_S, report["detected_at"]
    assert_offline_parity(tmp_path, report)


def test_a_rank_that_exits_at_step_2_while_its_peers_wait_is_paged_dead(tmp_path: Path) -> None:
    job = tmp_path / "early_exit.py"
    job.write_text(EARLY_EXIT_JOB)
    done, started = run(tmp_path, [str(job)])
    assert done.returncode == 3, done.stderr[-3000:]
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("process_dead", [1])
    latency = paged_after(report, fault_time(tmp_path))
    print(f"exit at step 2: paged {latency:.1f} s after the exit, {paged_after(report, started):.1f} s after start")
    assert 4 < latency < 20 and paged_after(report, started) < PAGED_WITHIN_S


@pytest.mark.parametrize("fault", ["pause", "straggle"])
def test_an_early_pause_is_not_paged(tmp_path: Path, fault: str) -> None:
    """A checkpoint (every rank outside collectives) or one rank in its own code while its peers wait: silence
    that proves nothing, so the warm-up timeout holds; the job ends well."""
    job_args = ("--fault-step=1", "--fault-rank=1", "--pause-s=15", "--steps=12")
    done, _ = run(tmp_path, demo(fault, *job_args))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 steps done" in done.stderr
    assert not (tmp_path / "bundles").exists()
    assert "not paging" not in done.stderr  # no incident was opened: nothing to hold
