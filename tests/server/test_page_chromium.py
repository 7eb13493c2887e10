"""The page in a real browser: headless Chromium opens a bundle from ``ncclwatch serve`` with ?token=.

What it proves beyond test_server: the browser follows the token-for-cookie
redirect (HttpOnly, SameSite=Strict, on 127.0.0.1), the strict CSP lets the
page render, and the rendered DOM holds the SVG timeline and the culprit's
row.  Skips when no Chromium can be found (Debian: ``apt-get install chromium``).

The screenshot goes to pytest's tmp folder; with NCCLWATCH_UPDATE_SCREENSHOTS=1
it also replaces docs/screenshots/bundle-page.png (so a plain test run leaves
the checkout clean).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from test_server import BUNDLE, TOKEN, make_bundle, serve_process

SCREENSHOT = REPO / "docs" / "screenshots" / "bundle-page.png"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    message = "no Chromium: install it (Debian: apt-get install -y chromium) to render the page"
    if os.environ.get("CI") == "true":  # .ci/run installs it: its absence in CI is a failure, not a skip
        pytest.fail(message)
    pytest.skip(message)


def browse(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        *args,
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture
def page_url(tmp_path: Path):
    make_bundle(tmp_path / "bundles")
    process, address = serve_process("--bundle-dir", str(tmp_path / "bundles"), env={"NCCLWATCH_API_TOKEN": TOKEN})
    yield f"http://{address}/bundles/{BUNDLE}?token={TOKEN}"
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0


def test_chromium_renders_the_timeline_and_the_culprit_row(page_url, tmp_path):
    browser = chromium()
    dom = browse(browser, tmp_path / "profile-dom", "--dump-dom", page_url).stdout
    assert "401" not in dom.split("<main>", 1)[-1][:200], "the browser did not get past the token"
    svg = re.search(r'<svg class="timeline".*?</svg>', dom, re.DOTALL)
    assert svg is not None
    assert 'data-culprit="true" data-rank="3"' in svg.group(0) and "diverges here" in svg.group(0)
    assert len(re.findall(r'<g class="rank', svg.group(0))) == 4
    assert re.search(r"<tr class=\"culprit\" data-culprit=\"true\" data-rank=\"3\">\s*<td>3 \(culprit\)</td>", dom)
    assert "collective mismatch" in dom and "culprit rank 3" in dom

    shot = tmp_path / "bundle-page.png"
    browse(browser, tmp_path / "profile-shot", f"--screenshot={shot}", page_url)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000  # a rendered page, not a blank one
    if os.environ.get("NCCLWATCH_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, SCREENSHOT)
