"""The dispatcher: no alert lost to an outage or a restart, none sent twice, none blocking another sink."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import aiohttp
import pytest
from receiver import Receiver, Reply, alert, run
from support import free_port

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.sinks import Delivery
from ncclwatch.watchdog.sinks.alert import Alert, resolve_for
from ncclwatch.watchdog.sinks.delivery import Dispatcher, ident_of, sinks_from_settings, spool_dir_for
from ncclwatch.watchdog.sinks.webhooks import WebhookSink

FAST = (0.01, 0.02, 0.05)
KEY = "ncclwatch-hang-train-0123456789ab"


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def pending(spool: Path, sink: str = "webhook") -> list[str]:
    return sorted(p.name for p in (spool / sink).glob("*.json"))


class Flaky:
    """A sink that breaks its never-raise contract once (not HTTP: the contract itself is under test)."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0

    async def send(self, alert: Alert) -> Delivery:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("bug in a sink")
        return Delivery(ok=True, retry=False, detail="fine")


class TestOutage:
    def test_receiver_down_at_first_gets_the_alert_when_it_comes_up(self, tmp_path: Path):
        port = free_port()

        async def go():
            async with aiohttp.ClientSession() as session:
                sink = WebhookSink(session, f"http://127.0.0.1:{port}/hook")
                dispatcher = Dispatcher([sink], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(alert())
                await asyncio.sleep(0.2)  # several refused attempts
                assert pending(tmp_path) and not await dispatcher.drain(0.05)
                async with Receiver(Reply(200), port=port) as receiver:
                    assert await dispatcher.drain(5)
                await dispatcher.close()
                return receiver.seen

        seen = run(go())
        assert len(seen) == 1 and seen[0].json()["dedup_key"] == KEY
        assert pending(tmp_path) == []

    def test_one_sink_down_does_not_delay_another(self, tmp_path: Path):
        async def go():
            async with (
                Receiver(Reply(503)) as down,
                Receiver(Reply(200)) as up,
                aiohttp.ClientSession() as session,
            ):
                sinks = [WebhookSink(session, down.url, name="down"), WebhookSink(session, up.url, name="up")]
                dispatcher = Dispatcher(sinks, tmp_path, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(alert())
                await until(lambda: up.seen)
                drained = await dispatcher.drain(0.1)
                await dispatcher.close()
                return drained

        assert run(go()) is False
        assert len(pending(tmp_path, "down")) == 1 and pending(tmp_path, "up") == []

    @pytest.mark.parametrize(
        ("retry_after", "backoff_s"),
        [("0", (3.0,)), ("3600", (0.01,))],
        ids=["receiver_sooner_than_backoff", "receiver_later_is_capped"],
    )
    def test_retry_after_replaces_the_backoff_up_to_its_cap(self, retry_after, backoff_s, tmp_path: Path):
        async def go():
            replies = (Reply(429, headers={"Retry-After": retry_after}), Reply(200))
            async with Receiver(*replies) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=backoff_s)
                await dispatcher.start()
                dispatcher.submit(alert())
                drained = await dispatcher.drain(1)
                await dispatcher.close()
                return drained, [s.status for s in receiver.seen]

        assert run(go()) == (True, [429, 200])

    def test_sink_that_raises_is_retried_not_lost(self, tmp_path: Path):
        async def go():
            sink = Flaky()
            dispatcher = Dispatcher([sink], tmp_path, backoff_s=FAST)
            await dispatcher.start()
            dispatcher.submit(alert())
            assert await dispatcher.drain(5)
            await dispatcher.close()
            return sink.calls

        assert run(go()) == 2


class TestRestart:
    def test_spooled_alerts_survive_a_restart_and_keep_their_order(self, tmp_path: Path):
        port = free_port()
        opened = alert()

        async def first_run():
            async with aiohttp.ClientSession() as session:
                sink = WebhookSink(session, f"http://127.0.0.1:{port}/hook")
                dispatcher = Dispatcher([sink], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(opened)
                dispatcher.submit(resolve_for(opened, "job ended"))
                await asyncio.sleep(0.05)
                await dispatcher.close()  # the sidecar is killed with both undelivered

        async def second_run():
            async with Receiver(Reply(200), port=port) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                assert await dispatcher.drain(5)
                await dispatcher.close()
                return receiver.seen

        run(first_run())
        assert [re.sub(r"^\d{20}\.", "<seq>.", n) for n in pending(tmp_path)] == [
            f"<seq>.trigger.{KEY}.json",
            f"<seq>.resolve.{KEY}.json",
        ]
        seen = run(second_run())
        assert [s.json()["action"] for s in seen] == ["trigger", "resolve"]
        assert pending(tmp_path) == []

    def test_a_repeat_after_delivery_and_restart_is_still_ignored(self, tmp_path: Path):
        async def deliver(*alerts: Alert):
            async with Receiver(Reply(200)) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                for item in alerts:
                    dispatcher.submit(item)
                assert await dispatcher.drain(5)
                await dispatcher.close()
                return receiver.seen

        assert len(run(deliver(alert()))) == 1
        assert run(deliver(alert(summary="the same hang, seen again"))) == []
        assert len(run(deliver(alert(dedup_key="ncclwatch-hang-train-another")))) == 1

    def test_crash_leftovers_are_cleaned_without_a_resend(self, tmp_path: Path):
        sink_dir = tmp_path / "webhook"
        sink_dir.mkdir()
        leftover = sink_dir / f".00000000000000000009.trigger.{KEY}.json.tmp"
        leftover.write_text('{"action": "tri')
        os.utime(leftover, (0, 0))  # a minute old or more: no process is still writing it
        delivered = sink_dir / f"00000000000000000003.trigger.{KEY}.json"
        delivered.write_text(alert().model_dump_json())
        (tmp_path / "sent").mkdir()
        (tmp_path / "sent" / f"webhook.trigger.{KEY}").touch()  # sent, then killed before the unlink

        async def go():
            async with Receiver(Reply(200)) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([WebhookSink(session, receiver.url)], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                assert await dispatcher.drain(1)
                await dispatcher.close()
                return receiver.seen

        assert run(go()) == []
        assert list(sink_dir.iterdir()) == []

    def test_unreadable_spool_file_goes_to_failed(self, tmp_path: Path):
        (tmp_path / "webhook").mkdir()
        (tmp_path / "webhook" / f"00000000000000000001.trigger.{KEY}.json").write_text("{not json")

        async def go():
            dispatcher = Dispatcher([WebhookSink(None, "http://127.0.0.1:9/")], tmp_path, backoff_s=FAST)
            await dispatcher.start()
            await dispatcher.close()

        run(go())
        record = json.loads((tmp_path / "failed" / f"webhook.trigger.{KEY}.json").read_text())
        assert record["detail"].startswith("unreadable spool file") and record["alert"] is None


class TestSpool:
    def test_submit_writes_the_alert_before_anything_is_sent(self, tmp_path: Path):
        dispatcher = Dispatcher([WebhookSink(None, "http://127.0.0.1:9/")], tmp_path)
        dispatcher.submit(alert())  # not started: nothing sends, the file is the promise
        (name,) = pending(tmp_path)
        assert re.fullmatch(rf"\d{{20}}\.trigger\.{KEY}\.json", name)
        assert Alert.model_validate_json((tmp_path / "webhook" / name).read_bytes()) == alert()
        assert [p.name for p in (tmp_path / "webhook").iterdir()] == [name]  # no .tmp left

    def test_unsafe_dedup_key_is_hashed_for_the_file_name(self):
        assert re.fullmatch(r"trigger\.sha256_[0-9a-f]{32}", ident_of(alert(dedup_key="../../etc/passwd")))

    def test_unwritable_spool_still_delivers_from_memory(self, tmp_path: Path):
        blocked = tmp_path / "spool"
        blocked.write_text("a file where the folder should be")

        async def go():
            async with Receiver(Reply(200)) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([WebhookSink(session, receiver.url)], blocked, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(alert())
                assert await dispatcher.drain(5)
                await dispatcher.close()
                return receiver.seen

        assert len(run(go())) == 1

    @pytest.mark.parametrize("names", [["a", "a"], ["failed"], ["sent"], ["Slack"], ["a/b"]])
    def test_sink_names_must_name_a_folder(self, names, tmp_path: Path):
        sinks = [WebhookSink(None, "http://127.0.0.1:9/", name=n) for n in names]
        with pytest.raises(ValueError):
            Dispatcher(sinks, tmp_path)

    def test_old_sent_markers_are_pruned(self, tmp_path: Path):
        (tmp_path / "sent").mkdir()
        marker = tmp_path / "sent" / f"webhook.trigger.{KEY}"
        marker.touch()
        os.utime(marker, (0, 0))
        Dispatcher([WebhookSink(None, "http://127.0.0.1:9/")], tmp_path).submit(alert())
        assert not marker.exists() and len(pending(tmp_path)) == 1


class TestSettings:
    def test_each_configured_sink_is_built(self, tmp_path: Path):
        settings = Settings(
            pagerduty_routing_key="k" * 32,
            slack_webhook_url="https://hooks.slack.com/services/T/B/X",
            webhook_url="https://example.net/hook",
            webhook_secret="s",
            bundle_dir=tmp_path,
        )

        async def go():
            async with aiohttp.ClientSession() as session:
                return [sink.name for sink in sinks_from_settings(settings, session)]

        assert run(go()) == ["pagerduty", "slack", "webhook"]
        assert spool_dir_for(settings) == tmp_path / ".spool"

    def test_nothing_configured_no_sinks(self, tmp_path: Path):
        settings = Settings(spool_dir=tmp_path / "q")
        assert sinks_from_settings(settings, None) == [] and spool_dir_for(settings) == tmp_path / "q"
