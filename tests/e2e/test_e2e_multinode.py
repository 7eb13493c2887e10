"""Two nodes on one machine: two real wrappers (``--nnodes 2 --node-rank 0|1``), real torchrun, gloo ranks.

The sidecars meet through torchrun's own store (static ``--master-addr``
rendezvous), share compact state, and the job gets one verdict and one page,
counted at a loopback webhook receiver.  Faults are on the second node's
ranks: a skipped collective, a rank stuck in Python, the whole node frozen
with SIGSTOP (its wrapper and sidecar too); a healthy job and a pause must
page nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tarfile
from pathlib import Path

import psutil
import pytest
from receiver import Receiver
from support import free_port

import ncclwatch.launcher.demo_job as demo_job

pytest.importorskip("torch")

TIMEOUT_S = 150
PER_NODE = 2


async def start_node(tmp_path: Path, node: int, nnodes: int, per_node: int, port: int, hook: str, job: list[str]):
    env = dict(os.environ, NCCLWATCH_WEBHOOK_URL=hook, NCCLWATCH_WEBHOOK_SECRET="s3cret")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        "twonodes",
        "--bundle-dir",
        str(tmp_path / f"bundles{node}"),
        "--run-dir",
        str(tmp_path / f"run{node}"),
        "--on-hang",
        "kill",
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={per_node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--monitor-interval=0.2",
        demo_job.__file__,
        *job,
        env=env,
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def training(run_dir: Path, ranks: int, steps: int = 20, timeout_s: float = 240.0) -> None:
    """Until each of the node's ranks is ``steps`` into training (its heartbeat says so): the learned stall
    timeout needs a few steps of rhythm (before them the 300 s warm-up timeout holds), and start-up time
    varies with the machine's load."""
    for _ in range(int(timeout_s / 0.2)):
        beats = []
        for path in (run_dir / "hb").glob("*.json"):
            try:
                beats.append(json.loads(path.read_text())["step"])
            except (OSError, ValueError, KeyError):
                continue  # being written
        if len(beats) >= ranks and min(beats) >= steps:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{run_dir}: not {steps} steps into training after {timeout_s} s")


def tree(pid: int) -> list[psutil.Process]:
    """A wrapper and everything under it: its torchrun and ranks run in sessions of their own."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def freeze(pid: int) -> list[psutil.Process]:
    """SIGSTOP a wrapper and everything under it: a node that hangs whole."""
    processes = tree(pid)
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    return processes


def kill(pid: int) -> list[psutil.Process]:
    """SIGKILL a wrapper and everything under it: a node that dies whole (with the store, on node 0)."""
    processes = tree(pid)
    for process in processes:
        process.kill()
    return []


async def run_nodes(
    tmp_path: Path,
    fault: str,
    fault_rank: int,
    *job_args: str,
    nnodes: int = 2,
    per_node: int = PER_NODE,
    act_on: int | None = None,
    act=freeze,
    after_s: float = 1.0,
    timeout_s: float = TIMEOUT_S,
):
    """``nnodes`` wrappers of one job; ``act`` on node ``act_on`` (freeze, kill) ``after_s`` into its training.
    The exit codes and stderr of the nodes that ran to the end, and the webhook's triggers.  Every node's
    stderr is read at once: a node blocked on a full pipe would hold up torchrun's exit barrier on the others."""
    job = [
        f"--fault={fault}",
        f"--fault-rank={fault_rank}",
        "--fault-step=12",
        "--step-time=0.05",
        "--steps=40",
        "--backend=gloo",
        *job_args,
    ]
    async with Receiver() as receiver:
        port = free_port()
        nodes = [await start_node(tmp_path, n, nnodes, per_node, port, receiver.url, job) for n in range(nnodes)]
        stopped: list[psutil.Process] = []
        if act_on is not None:
            await training(tmp_path / f"run{act_on}", per_node)
            await asyncio.sleep(after_s)
            stopped = act(nodes[act_on].pid)
        try:
            ends = await asyncio.wait_for(
                asyncio.gather(*(node.communicate() for n, node in enumerate(nodes) if n != act_on)), timeout_s
            )
        except TimeoutError:
            raise TimeoutError(f"not every node ended within {timeout_s} s:\n{ended(nodes, act_on)}") from None
        finally:
            for node in nodes:
                if node.returncode is None:
                    os.killpg(node.pid, signal.SIGKILL)
            for process in stopped:
                if process.is_running():
                    process.kill()
        await asyncio.sleep(0.5)  # a late delivery would still be counted
        triggers = [json.loads(s.body) for s in receiver.seen if json.loads(s.body)["action"] == "trigger"]
    stderr = [end[1].decode(errors="replace") for end in ends]
    codes = [node.returncode for n, node in enumerate(nodes) if n != act_on]
    return codes, stderr, triggers


def ended(nodes: list, act_on: int | None) -> str:
    """Which wrappers had ended, and what their processes were doing: the diagnosis of a node that did not end."""
    said = []
    for n, node in enumerate(nodes):
        if n == act_on:
            continue
        if node.returncode is not None:
            said.append(f"node {n} ended {node.returncode}")
            continue
        try:
            alive = [f"{p.pid} {p.name()} {p.status()} {' '.join(p.cmdline()[1:4])}" for p in tree(node.pid)]
        except psutil.Error as exc:
            alive = [str(exc)]
        said.append(f"node {n} running: " + "; ".join(alive))
    return "\n".join(said)


async def two_nodes(tmp_path: Path, fault: str, fault_rank: int, *job_args: str, freeze_node1: bool = False):
    return await run_nodes(tmp_path, fault, fault_rank, *job_args, act_on=1 if freeze_node1 else None)


def reports(tmp_path: Path, node: int) -> list[dict]:
    found = []
    for bundle in sorted((tmp_path / f"bundles{node}").glob("*.tar.gz")):
        with tarfile.open(bundle) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
            found.append(json.load(tar.extractfile(member)))  # type: ignore[arg-type]
    return found


@pytest.mark.parametrize(
    ("fault", "fault_rank", "verdict"),
    [("skip", 3, "collective_mismatch"), ("python_stuck", 2, "rank_behind")],
)
def test_one_verdict_and_one_page_for_a_fault_on_the_second_node(
    tmp_path: Path, fault: str, fault_rank: int, verdict: str
) -> None:
    codes, stderr, triggers = asyncio.run(two_nodes(tmp_path, fault, fault_rank))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:], stderr[1][-3000:])
    [page] = triggers
    assert (page["verdict"], page["culprit_ranks"]) == (verdict, [fault_rank]), stderr[0][-3000:]
    assert page["host"]  # the leader's host names the page
    for node in (0, 1):
        [report] = reports(tmp_path, node)  # every node keeps its own evidence
        assert (report["verdict"], report["culprit_ranks"]) == (verdict, [fault_rank]), (node, stderr[node][-3000:])
        assert {r["rank"] for r in report["ranks"]} >= {0, 1, 2, 3}  # the job-wide table
    assert "pages the job-wide verdict" in stderr[1]
    assert codes == [3, 3], stderr


def test_a_frozen_node_is_node_lost(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(two_nodes(tmp_path, "none", 0, "--steps=4000", freeze_node1=True))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == ("node_lost", [2, 3]), stderr[0][-3000:]
    assert codes == [3]


@pytest.mark.parametrize("fault", ["none", "pause"])
def test_healthy_and_paused_jobs_page_nothing(tmp_path: Path, fault: str) -> None:
    codes, stderr, triggers = asyncio.run(two_nodes(tmp_path, fault, 3, "--pause-s=12"))
    assert triggers == [], stderr[0][-3000:]
    assert codes == [0, 0], stderr


def test_a_mismatch_between_nodes_at_step_1_is_paged_before_any_rhythm(tmp_path: Path) -> None:
    """Three nodes of one rank, rank 1 skips the all_reduce of step 1: each node alone sees its rank waiting in a
    collective, which proves nothing, and no step rhythm is learned yet (the warm-up timeout is 300 s, longer than
    this test waits).  The leader's peek judges every node's evidence and finds the mismatch (2 H200 wrappers of
    one rank: the page came only once the job was killed)."""
    codes, stderr, triggers = asyncio.run(run_nodes(tmp_path, "skip", 1, "--fault-step=1", nnodes=3, per_node=1))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:], stderr[1][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == ("collective_mismatch", [1]), stderr[0][-3000:]
    assert codes == [3, 3, 3], stderr
