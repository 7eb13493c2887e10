"""The failure matrix on CPU (issue 44): a job that dies gets the same root cause, bundle and page as a hang.

Each test runs the real wrapper over real torchrun and gloo ranks (``tests/data/jobs/failing_job.py``, not the
demo), with a real webhook receiver on loopback, and checks what on-call would see: one page naming the rank that
caused the death (not the first to abort), a bundle, the same verdict from ``ncclwatch analyze`` on the run folder
and on the bundle; and no incident at all for a clean end, the user's own ``sys.exit(3)`` and the user's Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from aiohttp import web

pytest.importorskip("torch")

JOB = Path(__file__).parents[1] / "data" / "jobs" / "failing_job.py"
NPROC = 3
TIMEOUT_S = 120


class Webhook:
    """A JSON webhook on loopback (aiohttp in a thread of its own): every alert posted, as received."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        import asyncio

        async def handle(request: web.Request) -> web.Response:
            self.posts.append(await request.json())
            return web.Response(text="ok")

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"  # type: ignore[union-attr]
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.run(serve())

    def triggers(self, job: str) -> list[dict]:
        """The pages of one job (the receiver is shared by the module's tests)."""
        return [post for post in self.posts if post.get("action") == "trigger" and post.get("job") == job]


@pytest.fixture(scope="module")
def webhook() -> Webhook:
    return Webhook()


def start(tmp_path: Path, webhook: Webhook, fault: str, rank: int, *job_args: str) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "ncclwatch",
        "--job-name",
        tmp_path.name,
        "--bundle-dir",
        str(tmp_path / "bundles"),
        "--run-dir",
        str(tmp_path / "run"),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        "--monitor-interval=0.2",
        str(JOB),
        f"--fault={fault}",
        f"--fault-rank={rank}",
        *job_args,
    ]
    env = {**os.environ, "NCCLWATCH_WEBHOOK_URL": webhook.url}
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(job: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, stderr = job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()
    return job.returncode, stderr


def reports(tmp_path: Path) -> list[dict]:
    found = []
    for bundle in sorted((tmp_path / "bundles").glob("*.tar.gz")):
        with tarfile.open(bundle) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
            report = json.load(tar.extractfile(member))  # type: ignore[arg-type]
            report["_files"] = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        found.append(report)
    return found


def analyzed(path: Path) -> tuple[str, list[int]]:
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", "--json", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout, done.stderr[-2000:]
    report = json.loads(done.stdout)
    return report["verdict"], report["culprit_ranks"]


@pytest.mark.parametrize(
    ("fault", "rank", "verdict"),
    [
        ("raise", 0, "process_dead"),  # the user's own ValueError, on rank 0
        ("sigkill", 1, "process_dead"),  # the OOM killer's way
        ("timeout", 1, "collective_timeout"),  # PyTorch's own timeout ends the job; the rank that never came
    ],
)
def test_a_dying_job_is_named_bundled_and_paged_once(
    tmp_path: Path, webhook: Webhook, fault: str, rank: int, verdict: str
) -> None:
    returncode, stderr = finish(start(tmp_path, webhook, fault, rank, "--timeout-s=3"))
    assert returncode == 1, stderr[-3000:]  # torchrun's own status: the watchdog changes nothing of it
    [report] = reports(tmp_path)
    assert (report["verdict"], report["culprit_ranks"]) == (verdict, [rank]), stderr[-3000:]
    assert "output/stderr.log" in report["_files"]  # what the ranks said as they died
    assert f"{verdict} (culprit rank {rank})" in stderr
    [page] = webhook.triggers(tmp_path.name)
    assert (page["verdict"], page["culprit_ranks"]) == (verdict, [rank])
    [bundle] = sorted((tmp_path / "bundles").glob("*.tar.gz"))
    for left in (tmp_path / "run", bundle):
        assert analyzed(left) == (verdict, [rank]), left


def test_gloos_size_check_names_the_rank_whose_call_differed(tmp_path: Path, webhook: Webhook) -> None:
    """Rank 2 issues one extra all_reduce of another size.  gloo aborts the rank whose receive was smaller (rank 2
    here) in C++, before any dump; its peers are often ended by torchrun before their own error arrives.  Where two
    peers' dumps agree the culprit is named; where torchrun ended them first only the reporter is known, a suspect.
    NCCL jobs log every operation of every rank, so there the sequences always decide (tests/analyze)."""
    returncode, stderr = finish(start(tmp_path, webhook, "extra", 2, "--timeout-s=3"))
    assert returncode == 1, stderr[-3000:]
    [report] = reports(tmp_path)
    assert report["verdict"] == "collective_mismatch", stderr[-3000:]
    assert (report["culprit_ranks"] or report["suspect_ranks"]) == [2], report["summary"]
    [page] = webhook.triggers(tmp_path.name)
    assert (page["verdict"], page["culprit_ranks"] or page["suspect_ranks"]) == ("collective_mismatch", [2])


@pytest.mark.parametrize("fault", ["none", "exit"])
def test_a_clean_end_and_the_users_own_exit_are_no_incident(tmp_path: Path, webhook: Webhook, fault: str) -> None:
    returncode, stderr = finish(start(tmp_path, webhook, fault, 1))
    assert returncode == (0 if fault == "none" else 1), stderr[-3000:]
    assert not reports(tmp_path) and not webhook.triggers(tmp_path.name), stderr[-3000:]


def test_the_users_ctrl_c_is_no_incident(tmp_path: Path, webhook: Webhook) -> None:
    job = start(tmp_path, webhook, "none", 0, "--steps=100000")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list((tmp_path / "run" / "hb").glob("*.json"))) < NPROC:
        time.sleep(0.2)
    time.sleep(1.0)  # training, every rank past its first steps
    psutil.Process(job.pid).send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the wrapper's group
    returncode, stderr = finish(job)
    assert returncode != 0
    assert not reports(tmp_path) and not webhook.triggers(tmp_path.name), stderr[-3000:]
