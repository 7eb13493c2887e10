"""A page never waits for the next job (issue 13): the node agent delivers the spool, senders share it safely,
unreadable spool files keep their bytes and are logged.

Real loopback receivers, real spool folders, a real ``ncclwatch serve`` process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from receiver import Receiver, Reply, alert, run
from support import free_port

from ncclwatch.launcher.run import Alerts
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.sinks.webhooks import WebhookSink

FAST = (0.01, 0.02, 0.05)
KEY = "ncclwatch-hang-train-0123456789ab"
CORRUPT = {
    "random": os.urandom(64),
    "empty": b"",
    "truncated": alert().model_dump_json().encode()[:40],
    "not_utf8": b'{"action": "trigger", "summary": "\xff\xfe"}',
}


class TestUnreadableSpoolFiles:
    @pytest.mark.parametrize("kind", sorted(CORRUPT))
    def test_bytes_are_kept_in_failed_and_each_is_logged(self, kind: str, tmp_path: Path, caplog):
        spool_file = tmp_path / "webhook" / f"00000000000000000001.trigger.{KEY}.json"
        spool_file.parent.mkdir()
        spool_file.write_bytes(CORRUPT[kind])

        async def go():
            dispatcher = Dispatcher([WebhookSink(None, "http://127.0.0.1:9/")], tmp_path, backoff_s=FAST)
            await dispatcher.start()
            await dispatcher.close()

        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            run(go())
        assert not spool_file.exists()
        assert (tmp_path / "failed" / f"webhook.trigger.{KEY}.raw").read_bytes() == CORRUPT[kind]
        record = json.loads((tmp_path / "failed" / f"webhook.trigger.{KEY}.json").read_text())
        assert record["raw_file"] == f"webhook.trigger.{KEY}.raw" and record["detail"].startswith("unreadable")
        [line] = [r for r in caplog.records if "unreadable" in r.getMessage()]
        assert str(spool_file) in line.getMessage() and line.levelno >= logging.WARNING


class TestSharedSpool:
    def test_two_senders_on_one_spool_deliver_an_alert_once(self, tmp_path: Path):
        async def go():
            async with Receiver(Reply(200, delay_s=0.3)) as receiver, aiohttp.ClientSession() as session:
                first = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST)
                first.submit(alert(dedup_key=KEY))  # spooled by one wrapper, not yet sent
                second = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST)
                await first.start()
                await second.start()  # loads the same file
                assert await first.drain(5) and await second.drain(5)
                await first.close()
                await second.close()
                return receiver.seen

        assert len(run(go())) == 1
        assert list((tmp_path / "webhook").glob("*.json")) == []

    def test_a_rescan_picks_up_what_another_process_spooled_later(self, tmp_path: Path):
        async def go():
            async with Receiver(Reply(200)) as receiver, aiohttp.ClientSession() as session:
                agent = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST, rescan_s=0.1)
                await agent.start()
                job = Dispatcher([WebhookSink(session, receiver.url)], tmp_path)
                job.submit(alert(dedup_key=KEY))  # the job's wrapper spools it and dies before sending
                async with asyncio.timeout(5):
                    while not receiver.seen:
                        await asyncio.sleep(0.02)
                await agent.close()
                return receiver.seen

        assert len(run(go())) == 1


class TestWrapperAfterTheJob:
    def test_keeps_retrying_after_the_job_and_says_so(self, tmp_path: Path, capsys):
        port = free_port()
        settings = Settings(bundle_dir=tmp_path, webhook_url=f"http://127.0.0.1:{port}/hook", alert_drain_timeout=30)

        async def go():
            async with Alerts(settings) as alerts:
                alerts.dispatcher.submit(alert(dedup_key=KEY))
                # The receiver comes back 5 s after the job ended: past the quiet wait, within the drain.
                asyncio.get_running_loop().call_later(5, lambda: asyncio.ensure_future(receiver.__aenter__()))
            await receiver.__aexit__()
            return receiver.seen

        receiver = Receiver(Reply(202), port=port)
        seen = run(go(), timeout_s=40)
        err = capsys.readouterr().err
        assert len(seen) == 1
        assert "retrying for up to 30 s" in err and "alerts delivered" in err and "next run" not in err

    def test_after_the_bounded_retry_the_spool_is_left_for_the_agent(self, tmp_path: Path, capsys):
        settings = Settings(
            bundle_dir=tmp_path, webhook_url=f"http://127.0.0.1:{free_port()}/hook", alert_drain_timeout=4
        )

        async def go():
            async with Alerts(settings) as alerts:
                alerts.dispatcher.submit(alert(dedup_key=KEY))

        started = time.monotonic()
        run(go(), timeout_s=20)
        assert time.monotonic() - started < 15
        err = capsys.readouterr().err
        assert "still not delivered" in err and "ncclwatch serve" in err
        assert len(list((tmp_path / ".spool" / "webhook").glob("*.json"))) == 1


class TestNodeAgent:
    def test_serve_delivers_a_spool_left_by_a_job_when_the_receiver_comes_back(self, tmp_path: Path):
        """The job ended with its receiver down; ``ncclwatch serve`` sends the page once the receiver answers."""
        port = free_port()
        hook = f"http://127.0.0.1:{port}/hook"
        job = Dispatcher([WebhookSink(None, hook)], tmp_path / ".spool")
        job.submit(alert(dedup_key=KEY))  # what a job whose receiver was down leaves behind
        env = {**os.environ, "NCCLWATCH_WEBHOOK_URL": hook, "NCCLWATCH_ALERT_RETRY_INTERVAL": "1"}
        agent = subprocess.Popen(
            [sys.executable, "-m", "ncclwatch", "serve", "--bundle-dir", str(tmp_path), "--listen", "127.0.0.1:0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        async def receive():
            await asyncio.sleep(2.5)  # down for a while: the agent's first tries fail
            async with Receiver(Reply(200), port=port) as receiver:
                async with asyncio.timeout(6):  # its retry interval is 1 s
                    while not receiver.seen:
                        await asyncio.sleep(0.05)
                return receiver.seen

        try:
            seen = run(receive(), timeout_s=15)
        finally:
            agent.send_signal(signal.SIGTERM)
            out, err = agent.communicate(timeout=15)
        assert len(seen) == 1 and json.loads(seen[0].body)["dedup_key"] == KEY
        assert "delivering spooled alerts" in out
        assert (tmp_path / ".spool" / "sent" / f"webhook.trigger.{KEY}").exists()
