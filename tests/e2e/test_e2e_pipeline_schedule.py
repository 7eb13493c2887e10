"""End to end on CPU: a real ``torch.distributed.pipelining`` job (``Schedule1F1B``) under the real wrapper.

``tests/data/jobs/pipeline_schedule_job.py`` on gloo.  gloo's Flight
Recorder records no send/recv, so the stacks say who waits where:

- 2 stages on one node, stage 1 asleep in its own code at step 30: stage 0
  waits in the schedule's batched wait (``_wait_batch_p2p``), which was not
  read as communication ("not paging: no rank is inside a collective (a
  pause ...); progress_stalled is reported after 1800 s").  It is
  ``rank_behind [1]``, paged within seconds of the learned stall timeout
  (5 s), and ``analyze`` says the same from the run folder and the bundle.
- pipeline x data parallel on two wrappers (2 nodes x 2 ranks, pipelines
  (0, 3) and (1, 2)): ranks 1 and 2 both ``recv`` first from each other while
  their data-parallel peers 0 and 3 wait in the gradient all-reduce.  That was
  paged ``rank_behind [1, 2]`` (all-reduce over every rank) or
  ``rank_behind [3]`` (over each stage's ranks: the only rank ahead of rank 2
  in its group taken for the one that never sent); it is one job-wide
  ``p2p_deadlock [1, 2]``, the same in both nodes' bundles, paged once.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import DATA, stderr_at_end
from receiver import Receiver
from support import assert_offline_parity, fault_time, free_port, only_report, run_watched
from test_e2e_multinode import reports

from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

pytest.importorskip("torch")

JOB = DATA / "jobs" / "pipeline_schedule_job.py"
FAULT_STEP = 30
TIMEOUT_S = 120  # each run takes 15-35 s on two busy cores


def test_a_stage_stuck_in_its_own_code_is_behind_and_paged_within_the_stall_timeout(tmp_path: Path) -> None:
    job = [str(JOB), "--steps=400", "--step-time=0.05", "--fault=python_stuck", f"--fault-step={FAULT_STEP}"]
    job += [f"--mark-dir={tmp_path / 'run'}"]
    done = run_watched(tmp_path, job, "--on-hang", "kill", nproc=2, timeout_s=TIMEOUT_S)
    assert done.returncode == EXIT_KILLED_ON_HANG, done.stderr[-3000:]
    after_fault = done.stderr.partition("fault 'python_stuck' at step")[2]
    assert "RANK BEHIND" in after_fault and "progress_stalled is reported after" not in after_fault
    report = only_report(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == ("rank_behind", [1]), report["summary"]
    assert "_wait_batch_p2p (schedules.py:" in report["summary"] and "stuck_in_own_code" in report["summary"]
    detected = datetime.datetime.fromisoformat(report["detected_at"]).timestamp()
    assert 0 < detected - fault_time(tmp_path) < 30
    assert_offline_parity(tmp_path, report)


async def start_node(tmp_path: Path, node: int, port: int, hook: str, grad_group: str):  # type: ignore[no-untyped-def]
    env = dict(os.environ, NCCLWATCH_WEBHOOK_URL=hook, NCCLWATCH_WEBHOOK_SECRET="s3cret")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        "pp-dp",
        "--bundle-dir",
        str(tmp_path / f"bundles{node}"),
        "--run-dir",
        str(tmp_path / f"run{node}"),
        "--on-hang",
        "kill",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node}",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--monitor-interval=0.2",
        str(JOB),
        "--dp=2",
        f"--grad-group={grad_group}",
        "--steps=400",
        "--step-time=0.05",
        "--fault=both_recv",
        f"--fault-step={FAULT_STEP}",
        f"--mark-dir={tmp_path / f'run{node}'}",
        env=env,
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def two_nodes(tmp_path: Path, grad_group: str) -> tuple[list[int | None], list[str], list[dict]]:
    """Both nodes' wrappers to their end: exit codes, stderr, and the webhook's triggers."""
    async with Receiver() as receiver:
        port = free_port()
        nodes = [await start_node(tmp_path, n, port, receiver.url, grad_group) for n in (0, 1)]
        stderr = await stderr_at_end(nodes, TIMEOUT_S)
        await asyncio.sleep(0.5)  # a late delivery would still be counted
        triggers = [json.loads(s.body) for s in receiver.seen if json.loads(s.body)["action"] == "trigger"]
    return [node.returncode for node in nodes], stderr, triggers


@pytest.mark.parametrize("grad_group", ["world", "stage"])
def test_two_stages_on_two_nodes_receiving_first_are_one_p2p_deadlock_on_every_node(
    tmp_path: Path, grad_group: str
) -> None:
    codes, stderr, triggers = asyncio.run(two_nodes(tmp_path, grad_group))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:], stderr[1][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == ("p2p_deadlock", [1, 2]), stderr[0][-3000:]
    for node in (0, 1):
        [report] = reports(tmp_path, node)  # each node's bundle carries the job-wide verdict, not its own
        assert (report["verdict"], report["culprit_ranks"]) == ("p2p_deadlock", [1, 2]), (node, report["summary"])
        assert "rank 1, 2 all wait in recv, called from both_recv (pipeline_schedule_job.py:" in report["summary"]
        assert {r["rank"] for r in report["ranks"]} == {0, 1, 2, 3}
    assert "pages the job-wide verdict" in stderr[1]
    assert codes == [3, 3], stderr
