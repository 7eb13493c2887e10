"""A pipeline across two nodes on one machine: two real wrappers (``--nnodes 2 --node-rank 0|1``), one gloo stage each.

``bench/pipeline_job.py`` runs a 1F1B pipeline; stage 0 lives on node 0,
stage 1 on node 1, so every send and recv crosses the nodes.  The job must
get one job-wide verdict, the same in both nodes' bundles, and one page,
counted at a loopback webhook receiver: both stages receiving first is a
``p2p_deadlock`` naming both; a stage that never sends its gradient back is
the culprit, not the stage waiting for it (which is one collective behind);
a healthy pipeline pages nothing.  gloo's Flight Recorder records no
send/recv, so on CPU the stacks say who waits in ``recv``; the same cases
run on GPUs through NCCL's logs and Flight Recorder (bench/README.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import REPO, stderr_at_end
from receiver import Receiver
from support import free_port
from test_e2e_multinode import TIMEOUT_S, reports

pytest.importorskip("torch")

FAULT_STEP = 30  # the learned stall timeout needs steps of rhythm first (before them the 300 s warm-up one holds)


async def start_node(tmp_path: Path, node: int, port: int, hook: str, job: list[str]):  # type: ignore[no-untyped-def]
    env = dict(os.environ, NCCLWATCH_WEBHOOK_URL=hook, NCCLWATCH_WEBHOOK_SECRET="s3cret")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        "pipeline",
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
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--monitor-interval=0.2",
        str(REPO / "bench" / "pipeline_job.py"),
        "--device=cpu",
        "--step-time=0.05",
        f"--fault-step={FAULT_STEP}",
        f"--mark-dir={tmp_path / f'run{node}'}",
        *job,
        env=env,
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def pipeline(tmp_path: Path, *job: str) -> tuple[list[int | None], list[str], list[dict]]:
    """Both nodes' wrappers to their end: exit codes, stderr, and the webhook's triggers."""
    async with Receiver() as receiver:
        port = free_port()
        nodes = [await start_node(tmp_path, n, port, receiver.url, list(job)) for n in (0, 1)]
        stderr = await stderr_at_end(nodes, TIMEOUT_S)
        await asyncio.sleep(0.5)  # a late delivery would still be counted
        triggers = [json.loads(s.body) for s in receiver.seen if json.loads(s.body)["action"] == "trigger"]
    return [node.returncode for node in nodes], stderr, triggers


def assert_one_job_wide_verdict(tmp_path: Path, verdict: str, culprits: list[int]) -> None:
    codes, stderr, triggers = asyncio.run(pipeline(tmp_path, *JOBS[verdict]))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:], stderr[1][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == (verdict, culprits), stderr[0][-3000:]
    for node in (0, 1):
        [report] = reports(tmp_path, node)  # each node's bundle carries the job-wide verdict, not its own
        assert (report["verdict"], report["culprit_ranks"]) == (verdict, culprits), (
            node,
            report["summary"],
            stderr[node][-3000:],
        )
        assert {r["rank"] for r in report["ranks"]} == {0, 1}
    assert "pages the job-wide verdict" in stderr[1]
    assert codes == [3, 3], stderr


JOBS = {
    "p2p_deadlock": ("--fault=both_recv", "--steps=400"),
    "rank_behind": ("--fault=missing_send", "--fault-rank=1", "--steps=400"),
}


def test_both_stages_receiving_first_is_one_p2p_deadlock_naming_both_on_every_node(tmp_path: Path) -> None:
    assert_one_job_wide_verdict(tmp_path, "p2p_deadlock", [0, 1])


def test_a_stage_that_never_sends_its_gradient_is_the_culprit_on_every_node(tmp_path: Path) -> None:
    assert_one_job_wide_verdict(tmp_path, "rank_behind", [1])


@pytest.mark.serial  # a bound on its wall time: beside other workers' jobs it ran past it once in three CI runs
def test_a_healthy_pipeline_across_nodes_pages_nothing(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(pipeline(tmp_path, "--steps=120"))
    assert triggers == [], stderr[0][-3000:]
    assert codes == [0, 0], stderr
    assert not list((tmp_path / "bundles0").glob("*.tar.gz")) and not list((tmp_path / "bundles1").glob("*.tar.gz"))
