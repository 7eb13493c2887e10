"""--on-repeat: a real command runs once when a host is named in incidents of N different jobs in the
window, is recorded on the host's page, and runs again only after the host has fallen under N."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from cluster_bundles import bundle_bytes, node_report
from test_server import REPO, TOKEN, serve_process

from ncclwatch.watchdog.server.incidents import IncidentIndex, Part
from ncclwatch.watchdog.server.repeat import Repeat
from ncclwatch.watchdog.server.view import report_view

UPLOAD = "upload-token-for-repeat"
DAY = 86400.0


def test_serve_runs_the_command_once_per_crossing_and_records_it(tmp_path: Path) -> None:
    ran = tmp_path / "drained.txt"
    command = f'echo "$NCCLWATCH_HOST $NCCLWATCH_REPEAT_JOBS" >> {ran}; cat > {tmp_path}/facts.json'
    env = {"NCCLWATCH_API_TOKEN": TOKEN, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD}
    process, address = serve_process(
        "--bundle-dir", str(tmp_path / "b"), "--on-repeat", "2/7", "--on-repeat-exec", command, env=env
    )
    base = f"http://{address}"

    async def scenario() -> list[str]:
        steps = []
        async with aiohttp.ClientSession() as session:
            for job, node, key in (("job-a", "n1", "a1"), ("job-a", "n2", "a2"), ("job-b", "n3", "b1"),
                                   ("job-c", "n4", "c1")):  # fmt: skip
                data = bundle_bytes(node_report(job, node, "gpu7", time.time()))[1]
                headers = {"Authorization": f"Bearer {UPLOAD}", "X-Ncclwatch-Incident": key}
                async with session.post(f"{base}/api/upload", data=data, headers=headers) as reply:
                    assert reply.status == 201
                await asyncio.sleep(1.0)  # the check runs after the answer
                steps.append(ran.read_text() if ran.exists() else "")
            async with session.get(f"{base}/api/hosts?host=gpu7", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                steps.append((await r.json())[0]["actions"])
            async with session.get(f"{base}/hosts/gpu7", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                steps.append(await r.text())
        return steps

    try:
        *files, actions, page = asyncio.run(scenario())
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    # two incidents of one job are not a repetition; job-b makes two jobs: once; job-c: still once
    assert files == ["", "", "gpu7 2\n", "gpu7 2\n"]
    assert [(a["incidents"], a["exit_status"], a["jobs"]) for a in actions] == [(2, 0, "job-a, job-b")]
    assert '"host": "gpu7"' in (tmp_path / "facts.json").read_text()
    assert "Actions on repetition" in page and "drained.txt" in page


def test_the_host_re_arms_when_the_window_slides_it_under(tmp_path: Path) -> None:
    now = [1_000_000_000.0]
    index = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: now[0])
    marker = tmp_path / "ran"
    repeat = Repeat(index, 2, 7.0, f"echo $NCCLWATCH_HOST >> {marker}", clock=lambda: now[0])

    def incident(job: str, key: str) -> None:
        report = report_view(node_report(job, "n1", "gpu7", now[0]).model_dump(mode="json"))
        index.record(Part(f"{key}-bundle", key, report, 1, "0" * 64))
        asyncio.run(repeat.check(["gpu7"]))

    incident("job-a", "k1")
    incident("job-b", "k2")
    assert marker.read_text() == "gpu7\n"
    incident("job-c", "k3")  # still over: no second run
    now[0] += 10 * DAY  # the window slides past all three
    asyncio.run(repeat.recheck())
    incident("job-d", "k4")
    assert marker.read_text() == "gpu7\n"  # one job in the window: under
    incident("job-e", "k5")
    assert marker.read_text() == "gpu7\ngpu7\n"  # crossed again
    index.close()


def test_on_repeat_without_a_command_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "serve", "--on-repeat", "3/7"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "--on-repeat and --on-repeat-exec go together" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "serve", "--on-repeat", "3 in 7", "--on-repeat-exec", "true"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "N/DAYS" in done.stderr
