"""The cluster server's hosts view and incident page in a real browser: headless Chromium against a real
``ncclwatch serve`` that took real uploads (two jobs' hangs naming one host), through ?token= and its cookie."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from cluster_bundles import bundle_bytes, node_report
from test_page_chromium import browse, chromium
from test_server import TOKEN, serve_process

UPLOAD = "upload-token-for-chromium"


@pytest.fixture
def server(tmp_path: Path):
    env = {"NCCLWATCH_API_TOKEN": TOKEN, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD}
    process, address = serve_process("--bundle-dir", str(tmp_path / "bundles"), env=env)

    async def send() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {UPLOAD}"}) as session:
            for job, node, key, days in (("job-a", "gpu1", "key-a", 1), ("job-a", "gpu7", "key-a", 1),
                                         ("job-b", "gpu3", "key-b", 2)):  # fmt: skip
                data = bundle_bytes(node_report(job, node, "gpu7", time.time() - days * 86400))[1]
                headers = {"X-Ncclwatch-Incident": key}
                async with session.post(f"http://{address}/api/upload", data=data, headers=headers) as reply:
                    assert reply.status == 201, await reply.text()

    asyncio.run(send())
    yield address
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0


def test_chromium_renders_the_hosts_view_and_the_incident_page(server, tmp_path):
    browser = chromium()
    hosts = browse(browser, tmp_path / "p1", "--dump-dom", f"http://{server}/hosts?token={TOKEN}").stdout
    assert "401" not in hosts.split("<main>", 1)[-1][:200], "the browser did not get past the token"
    assert '<tr class="culprit" data-host="gpu7">' in hosts  # a repeat host: two jobs this week
    assert '<a href="/hosts/gpu7">gpu7</a>' in hosts and "<td>2 / 2</td>" in hosts

    page = browse(browser, tmp_path / "p2", "--dump-dom", f"http://{server}/incidents/key-a?token={TOKEN}").stdout
    assert page.count('<tr data-bundle="job-a-gpu') == 2 and '<svg class="timeline"' not in page.split("Report")[0]
    assert "Nodes' bundles (2)" in page and "different collective" in page
    assert 'href="/api/bundles/job-a-gpu7-' in page

    shot = tmp_path / "hosts.png"
    browse(browser, tmp_path / "p3", f"--screenshot={shot}", f"http://{server}/hosts?token={TOKEN}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
