"""What the terminal says about an upload (issue 46): one line when the bundle is on the server, with the incident's
address; one line when it is given up, with why; the normal retry while the bundle is still being written says
nothing, and a retry for another reason is said once, not at every attempt."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import aiohttp
from receiver import Receiver, Reply, alert, run

from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.sinks.upload import UploadSink

FAST = (0.01, 0.02, 0.05)
KEY = "ncclwatch-hang-train-0123456789ab"
BUNDLE = "train-node1-20261122T100005Z-collective_mismatch"


def deliver(bundles: Path, spool: Path, *replies: Reply, bundle_late_s: float | None = None) -> list[str]:
    """Upload one node's bundle to a server answering ``replies``; the lines the terminal got.  With
    ``bundle_late_s`` the bundle file appears that long after the page, as it does live."""
    said: list[str] = []

    async def go() -> None:
        import asyncio

        async with Receiver(*replies) as server, aiohttp.ClientSession() as session:
            sink = UploadSink(session, server.url, "t", bundles)
            dispatcher = Dispatcher([sink], spool, backoff_s=FAST, say=said.append)
            await dispatcher.start()
            dispatcher.submit(alert(bundle_id=BUNDLE, created_at=time.time()))
            if bundle_late_s is not None:
                await asyncio.sleep(bundle_late_s)
                (bundles / f"{BUNDLE}.tar.gz").write_bytes(b"bundle")
            assert await dispatcher.drain(5)
            await dispatcher.close()
            said.append(f"server: {server.url}")

    run(go())
    return said


def test_a_delivered_upload_is_one_line_with_the_incidents_address(tmp_path: Path) -> None:
    (tmp_path / f"{BUNDLE}.tar.gz").write_bytes(b"bundle")
    *lines, server = deliver(tmp_path, tmp_path / "spool", Reply(201))
    url = server.removeprefix("server: ").rstrip("/")
    assert lines == [f"upload: bundle {BUNDLE} is on the server: {url}/incidents/{KEY}"]


def test_an_upload_refused_is_one_line_saying_it_was_given_up_and_why(tmp_path: Path) -> None:
    (tmp_path / f"{BUNDLE}.tar.gz").write_bytes(b"bundle")
    *lines, server = deliver(tmp_path, tmp_path / "spool", Reply(401, "wrong upload token"))
    url = server.removeprefix("server: ").rstrip("/")
    assert lines == [f"upload: bundle {BUNDLE} not uploaded to {url}, given up: HTTP 401: wrong upload token"]


def test_the_wait_for_the_bundle_is_not_said_and_a_server_error_is_said_once(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="ncclwatch"):
        lines = deliver(
            tmp_path, tmp_path / "spool", Reply(503, "busy"), Reply(503, "busy"), Reply(201), bundle_late_s=0.1
        )
    retries = [r for r in caplog.records if "not delivered" in r.getMessage()]
    writing = [r.levelno for r in retries if "still being written" in r.getMessage()]
    busy = [r.levelno for r in retries if "HTTP 503" in r.getMessage()]
    assert writing and set(writing) == {logging.INFO}  # -v's log only: the bundle follows its page
    assert busy == [logging.WARNING, logging.INFO]  # the same reason twice: said once
    assert len(lines) == 2 and "is on the server" in lines[0]
