"""End to end: real wrappers (gloo jobs that hang) upload their bundles to one real ``ncclwatch serve``.

Two jobs hang on the same host; each wrapper pages (a real webhook receiver on loopback) and uploads its
bundle through the spool; the server groups each job's bundle into its incident and its hosts view names
this host in two incidents of two jobs.  Then the server is down while a job hangs: the page goes out at
once (the upload sink's outage delays no other sink), and the bundle arrives once the server is started,
from the wrapper's retries.  And a job of two nodes (two wrappers, each in a UTS namespace of its own that
names its host, sharing one spool): the leader pages once, and both nodes' bundles reach the server as two
parts of one incident.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from receiver import Receiver
from support import demo, free_port, watched

import ncclwatch.launcher.demo_job as demo_job

pytest.importorskip("torch")

READ, UPLOAD = "read-token-e2e", "upload-token-e2e"


@asynccontextmanager
async def serving(folder: Path, port: int) -> AsyncIterator[str]:
    """A real ``ncclwatch serve`` on 127.0.0.1:``port`` for the block (its base URL); it must stop with exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    env |= {"NCCLWATCH_API_TOKEN": READ, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ncclwatch", "serve", "--bundle-dir", str(folder), "--listen", f"127.0.0.1:{port}",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    line = await asyncio.wait_for(process.stdout.readline(), 30)  # type: ignore[union-attr]
    assert b"http://" in line, line
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        assert await asyncio.wait_for(process.wait(), 20) == 0


async def start_job(tmp_path: Path, name: str, server: str, hook: str, drain_s: float = 60):  # type: ignore[no-untyped-def]
    folder = tmp_path / name
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    env |= {"NCCLWATCH_UPLOAD": server, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD, "NCCLWATCH_WEBHOOK_URL": hook}
    job = demo("skip", "--fault-step=6", "--steps=2000", "--backend=gloo", "--mark-dir", str(folder))
    watch = ["--stall-timeout", "4", "--on-hang", "kill", "--alert-drain-timeout", str(drain_s), "--job-name", name]
    command = watched(folder, job, *watch, nproc=2, run_dir=False)
    return await asyncio.create_subprocess_exec(*command, env=env, cwd=folder, stderr=asyncio.subprocess.PIPE)


async def get(base: str, path: str) -> object:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {READ}"}) as session:
        async with session.get(base + path) as reply:
            assert reply.status == 200, (path, reply.status, await reply.text())
            return await reply.json()


def triggers(receiver: Receiver) -> list[dict]:  # type: ignore[type-arg]
    return [s.json() for s in receiver.seen if s.json().get("action") == "trigger"]


def test_two_jobs_upload_to_one_server_which_names_the_host_in_both(tmp_path: Path) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        async with serving(tmp_path / "server", free_port()) as base, Receiver() as receiver:
            jobs = [await start_job(tmp_path, name, base, receiver.url) for name in ("job-a", "job-b")]
            results = await asyncio.wait_for(asyncio.gather(*(job.communicate() for job in jobs)), 240)
            codes = [job.returncode for job in jobs]
            incidents = await get(base, "/api/incidents")
            hosts = await get(base, "/api/hosts")
            return codes, [r[1].decode(errors="replace") for r in results], triggers(receiver), incidents, hosts

    codes, stderrs, pages, incidents, hosts = asyncio.run(scenario())
    assert codes == [3, 3], stderrs[0][-3000:] + stderrs[1][-3000:]
    assert sorted(i["job"] for i in incidents) == ["job-a", "job-b"], (incidents, stderrs[0][-2000:])
    for incident in incidents:
        assert len(incident["nodes"]) == 1 and incident["named"], incident
        page = next(p for p in pages if p["job"] == incident["job"])
        assert page["dedup_key"] == incident["incident_key"]
        assert page["incident_url"] == f"{page['incident_url'].split('/incidents/')[0]}/incidents/{page['dedup_key']}"
    me = platform.node()
    mine = next(h for h in hosts if h["host"] == me)
    assert mine["days_7"] == 2 and mine["jobs_7"] == 2 and hosts[0]["host"] == me, hosts


def test_server_down_during_the_hang_the_page_goes_out_and_the_bundle_arrives_later(tmp_path: Path) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        async with Receiver() as receiver:
            job = await start_job(tmp_path, "job-late", base, receiver.url, drain_s=120)
            waiting = asyncio.create_task(job.communicate())
            deadline = time.monotonic() + 180
            while not triggers(receiver):  # the page, while nothing listens on the server's port
                assert time.monotonic() < deadline and not waiting.done(), "no page"
                await asyncio.sleep(0.2)
            paged_at = time.monotonic()
            assert not list((tmp_path / "server").glob("*.tar.gz"))
            await asyncio.sleep(3)  # the wrapper's first upload attempts find nothing
            async with serving(tmp_path / "server", port):
                started_at = time.monotonic()
                _, stderr = await asyncio.wait_for(waiting, 180)
                incidents = await get(base, "/api/incidents")
                page = triggers(receiver)[0]
                incident = await get(base, f"/api/incidents/{page['dedup_key']}") if incidents else None
            return job.returncode, stderr.decode(errors="replace"), paged_at, started_at, incident, page

    code, stderr, paged_at, started_at, incident, page = asyncio.run(scenario())
    assert code == 3, stderr[-3000:]
    assert paged_at < started_at  # the page did not wait for the server
    assert incident is not None, stderr[-3000:]
    assert [p["bundle_id"] for p in incident["parts"]] == [page["bundle_id"]]
    assert incident["job"] == "job-late"
    assert json.loads(json.dumps(page))["incident_url"].endswith(f"/incidents/{page['dedup_key']}")


def own_host(name: str) -> list[str]:
    """The command prefix that runs a wrapper in a UTS namespace of its own, whose host is ``name``: two nodes
    of one job on one machine, each with its own host name (as two real nodes have)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    for extra in ([], ["--map-root-user"]):  # root, or an unprivileged user namespace
        prefix = [unshare, "--uts", *extra, "sh", "-c", 'hostname "$0" && exec "$@"', name]
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("cannot give a process a host name of its own here (unshare --uts)")


async def start_node(tmp_path: Path, node: int, server: str, hook: str, store: int) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    env |= {"NCCLWATCH_UPLOAD": server, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD, "NCCLWATCH_WEBHOOK_URL": hook}
    env |= {"NCCLWATCH_SPOOL_DIR": str(tmp_path / "spool"), "GLOO_SOCKET_IFNAME": "lo"}  # spool on shared storage
    return await asyncio.create_subprocess_exec(
        *own_host(f"node{node}"), sys.executable, "-m", "ncclwatch", "--job-name", "twonodes",
        "--bundle-dir", str(tmp_path / f"bundles{node}"), "--run-dir", str(tmp_path / f"run{node}"),
        "--on-hang", "kill", "--alert-drain-timeout", "60",
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={store}", "--monitor-interval=0.2", demo_job.__file__,
        "--fault=skip", "--fault-rank=3", "--fault-step=12", "--step-time=0.05", "--steps=40", "--backend=gloo",
        env=env, cwd=tmp_path, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def test_every_node_of_a_job_uploads_its_part_of_one_incident_which_pages_once(tmp_path: Path) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        async with serving(tmp_path / "server", free_port()) as base, Receiver() as receiver:
            store = free_port()
            nodes = [await start_node(tmp_path, n, base, receiver.url, store) for n in (0, 1)]
            try:
                ends = await asyncio.wait_for(asyncio.gather(*(node.communicate() for node in nodes)), 240)
            finally:
                for node in nodes:
                    if node.returncode is None:
                        os.killpg(node.pid, 9)
            incidents = await get(base, "/api/incidents")
            incident = await get(base, f"/api/incidents/{incidents[0]['incident_key']}") if incidents else None
            hosts = await get(base, "/api/hosts")
            stderrs = [end[1].decode(errors="replace") for end in ends]
            return [n.returncode for n in nodes], stderrs, triggers(receiver), incidents, incident, hosts

    codes, stderrs, pages, incidents, incident, hosts = asyncio.run(scenario())
    said = stderrs[0][-3000:] + stderrs[1][-3000:]
    assert len(pages) == 1, (pages, said)  # one page, by the leader
    [page] = pages
    assert (page["verdict"], page["culprit_ranks"], page["host"]) == ("collective_mismatch", [3], "node0"), said
    assert [i["incident_key"] for i in incidents] == [page["dedup_key"]], (incidents, said)
    assert incident is not None and sorted(p["host"] for p in incident["parts"]) == ["node0", "node1"], (incident, said)
    assert page["bundle_id"] in {p["bundle_id"] for p in incident["parts"]}
    assert {"host": "node1", "role": "culprit"} in incident["named"], incident
    assert [(h["host"], h["days_7"]) for h in hosts] == [("node1", 1)], hosts  # the incident counts once
    assert codes == [3, 3], said
