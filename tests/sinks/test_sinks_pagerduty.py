"""PagerDuty Events API v2: the exact body, the answers, and a page through a flaky PagerDuty."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
from receiver import Receiver, Reply, alert, run

from ncclwatch.watchdog.sinks.alert import resolve_for
from ncclwatch.watchdog.sinks.delivery import Dispatcher
from ncclwatch.watchdog.sinks.pagerduty import DEFAULT_URL, PagerDutySink, event_for

KEY = "R0UT1NGKEY0000000000000000000000"
ACCEPTED = Reply(202, '{"status":"success","message":"Event processed","dedup_key":"k"}')
FAST = (0.01, 0.02, 0.05)


class TestEventBody:
    def test_trigger_carries_payload_links_and_client(self):
        event = event_for(alert(slurm_job_id="881"), KEY, "http://node1:9464")
        assert {k: event[k] for k in ("routing_key", "event_action", "dedup_key", "client", "client_url")} == {
            "routing_key": KEY,
            "event_action": "trigger",
            "dedup_key": "ncclwatch-hang-train-0123456789ab",
            "client": "ncclwatch",
            "client_url": "http://node1:9464",
        }
        payload = event["payload"]
        assert (payload["severity"], payload["source"], payload["component"], payload["group"], payload["class"]) == (
            "critical",
            "node1",
            "ncclwatch",
            "train",
            "collective_mismatch",
        )
        assert payload["timestamp"] == "2026-11-22T10:00:05.000+00:00"
        assert payload["custom_details"] == {
            "verdict": "collective_mismatch",
            "culprit_ranks": [3],
            "suspect_ranks": [],
            "communicator": "0x7f3a (world, 8 ranks)",
            "operation": "AllReduce sum 4096 x float32",
            "position": 42,
            "bundle_url": "http://node1:9464/bundles/b-20261122-100000",
            "bundle_id": "b-20261122-100000",
            "job": "train",
            "host": "node1",
            "slurm_job_id": "881",
            "reason": "rank 3 skipped an AllReduce",
        }
        assert event["links"] == [{"href": "http://node1:9464/bundles/b-20261122-100000", "text": "root-cause bundle"}]

    def test_no_bundle_url_no_links_no_client_url(self):
        event = event_for(alert(bundle_url=None), KEY)
        assert "links" not in event and "client_url" not in event

    def test_resolve_carries_only_key_action_and_dedup_key(self):
        assert event_for(resolve_for(alert(), "progress resumed"), KEY) == {
            "routing_key": KEY,
            "event_action": "resolve",
            "dedup_key": "ncclwatch-hang-train-0123456789ab",
        }

    def test_default_endpoint(self):
        assert DEFAULT_URL == "https://events.pagerduty.com/v2/enqueue"


def send(*replies: Reply, **changes):
    async def go():
        async with Receiver(*replies) as receiver, aiohttp.ClientSession() as session:
            return await PagerDutySink(session, KEY, url=receiver.url).send(alert(**changes)), receiver.seen

    return run(go())


class TestAnswers:
    def test_202_is_delivered(self):
        result, seen = send(ACCEPTED)
        assert result.ok
        assert seen[0].headers["Content-Type"] == "application/json"
        assert seen[0].json()["routing_key"] == KEY

    def test_200_is_not_what_pagerduty_sends(self):
        result, _ = send(Reply(200, "<html>proxy login</html>"))
        assert (result.ok, result.retry) == (False, False)

    def test_400_is_final_and_names_the_problem_not_the_key(self):
        result, _ = send(Reply(400, '{"status":"invalid event","errors":["\'payload.source\' is missing"]}'))
        assert (result.ok, result.retry) == (False, False)
        assert "invalid event" in result.detail and KEY not in result.detail

    def test_429_is_retried_after_what_it_says(self):
        result, _ = send(Reply(429, "too many", {"Retry-After": "7"}))
        assert (result.ok, result.retry, result.retry_after_s) == (False, True, 7.0)

    def test_500_is_retried(self):
        result, _ = send(Reply(500))
        assert (result.ok, result.retry) == (False, True)


class TestThroughAFlakyPagerDuty:
    def test_one_accepted_trigger_and_one_accepted_resolve(self, tmp_path: Path):
        opened = alert(summary="s" * 1024)

        async def go():
            replies = (Reply(500), Reply(429, "slow down", {"Retry-After": "0"}), ACCEPTED)
            async with Receiver(*replies) as receiver, aiohttp.ClientSession() as session:
                dispatcher = Dispatcher([PagerDutySink(session, KEY, url=receiver.url)], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(opened)
                dispatcher.submit(opened)  # a second report of the same hang
                dispatcher.submit(resolve_for(opened, "progress resumed"))
                drained = await dispatcher.drain(5)
                await dispatcher.close()
                return drained, receiver.seen

        drained, seen = run(go())
        assert drained
        assert [s.status for s in seen] == [500, 429, 202, 202]
        accepted = [s.json() for s in seen if s.status == 202]
        assert [(e["event_action"], e["dedup_key"]) for e in accepted] == [
            ("trigger", opened.dedup_key),
            ("resolve", opened.dedup_key),
        ]
        payload = accepted[0]["payload"]
        assert len(payload["summary"]) <= 1024
        assert (payload["severity"], payload["source"], payload["component"], payload["group"]) == (
            "critical",
            "node1",
            "ncclwatch",
            "train",
        )
        assert payload["custom_details"]["culprit_ranks"] == [3]
        assert set(accepted[1]) == {"routing_key", "event_action", "dedup_key"}
        assert list(tmp_path.glob("pagerduty/*.json")) == []

    def test_400_is_not_retried_and_lands_in_failed(self, tmp_path: Path):
        async def go():
            async with Receiver(Reply(400, '{"status":"invalid event"}')) as receiver, aiohttp.ClientSession() as s:
                dispatcher = Dispatcher([PagerDutySink(s, KEY, url=receiver.url)], tmp_path, backoff_s=FAST)
                await dispatcher.start()
                dispatcher.submit(alert())
                assert await dispatcher.drain(5)
                await dispatcher.close()
                return receiver.seen

        seen = run(go())
        assert len(seen) == 1
        record = json.loads(
            (tmp_path / "failed" / "pagerduty.trigger.ncclwatch-hang-train-0123456789ab.json").read_text()
        )
        assert record["detail"] == 'HTTP 400: {"status":"invalid event"}'
        assert record["alert"]["dedup_key"] == "ncclwatch-hang-train-0123456789ab"
        assert KEY not in json.dumps(record)
        assert list(tmp_path.glob("pagerduty/*.json")) == []
