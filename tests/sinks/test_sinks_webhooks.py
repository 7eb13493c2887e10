"""HTTP sinks against real aiohttp receivers on loopback: the shared POST, Slack, the signed webhook.

``Receiver`` and ``run`` live in ``tests/receiver.py``, shared with the other alert tests.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from conftest import NOW
from receiver import Receiver, Reply, Seen, alert, run
from support import free_port

from ncclwatch.watchdog.sinks.alert import Alert, resolve_for
from ncclwatch.watchdog.sinks.webhooks import (
    SlackSink,
    WebhookSink,
    outcome,
    post,
    retry_after_s,
    sign,
    verify_signature,
)

SECRET = "s3cret-hmac-key"


class TestOutcome:
    def test_accepted_status_is_delivered(self):
        assert outcome(202, "", None, lambda s: s == 202).ok

    @pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
    def test_rate_limit_timeout_and_5xx_are_retried(self, status):
        result = outcome(status, "busy", 3.0, lambda s: s == 202)
        assert (result.ok, result.retry, result.retry_after_s) == (False, True, 3.0)

    @pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 200, 301])
    def test_other_answers_are_final(self, status):
        result = outcome(status, "invalid event", 3.0, lambda s: s == 202)
        assert (result.ok, result.retry, result.retry_after_s) == (False, False, None)
        assert result.detail == f"HTTP {status}: invalid event"

    def test_retry_after_seconds_and_http_date(self):
        assert retry_after_s("0") == 0.0
        assert retry_after_s("2.5") == 2.5
        assert retry_after_s("Sun, 22 Nov 2026 10:00:30 GMT", now=1_795_341_600.0) == 30.0
        assert retry_after_s("soon") is None
        assert retry_after_s(None) is None


class TestPost:
    def test_connection_refused_is_retried(self):
        async def go():
            async with aiohttp.ClientSession() as session:
                return await post(session, f"http://127.0.0.1:{free_port()}/x", b"{}", accepted=lambda s: s == 200)

        result = run(go())
        assert (result.ok, result.retry) == (False, True)
        assert result.detail.startswith("network: ")

    def test_timeout_is_retried(self):
        async def go():
            async with Receiver(Reply(delay_s=0.5)) as receiver, aiohttp.ClientSession() as session:
                return await post(session, receiver.url, b"{}", accepted=lambda s: s == 200, timeout_s=0.1)

        result = run(go())
        assert (result.ok, result.retry) == (False, True)

    def test_secret_url_stays_out_of_the_detail(self):
        url = f"http://127.0.0.1:{free_port()}/services/T000/B000/XXXXSECRET"

        async def go():
            async with aiohttp.ClientSession() as session:
                return await post(session, url, b"{}", accepted=lambda s: s == 200, secret_url=True)

        assert "XXXXSECRET" not in run(go()).detail


class TestSlack:
    def test_trigger_posts_text_and_blocks(self):
        async def go():
            async with Receiver(Reply(200, "ok")) as receiver, aiohttp.ClientSession() as session:
                result = await SlackSink(session, receiver.url).send(alert())
                return result, receiver.seen

        result, seen = run(go())
        assert result.ok and result.detail == "HTTP 200: ok"
        body = seen[0].json()
        assert body["text"].startswith("ncclwatch: rank 3 collective_mismatch in train on node1")
        blocks = json.dumps(body["blocks"])
        for fact in ("collective_mismatch", "*Culprit rank*\\n3", "AllReduce sum 4096 x float32 (#42 on 0x7f3a"):
            assert fact in blocks
        assert "<http://node1:9464/bundles/b-20261122-100000|Root-cause bundle>" in blocks

    def test_resolve_posts_a_short_resolved_text(self):
        async def go():
            async with Receiver(Reply(200, "ok")) as receiver, aiohttp.ClientSession() as session:
                await SlackSink(session, receiver.url).send(resolve_for(alert(), "progress resumed"))
                return receiver.seen[0].json()

        body = run(go())
        assert set(body) == {"text"}
        assert (
            body["text"]
            == "ncclwatch: resolved in train on node1: progress resumed (incident ncclwatch-hang-train-0123456789ab)"
        )

    def test_user_text_cannot_become_a_slack_mention(self):
        async def go():
            async with Receiver(Reply(200, "ok")) as receiver, aiohttp.ClientSession() as session:
                await SlackSink(session, receiver.url).send(alert(reason="<!channel> & co"))
                return receiver.seen[0].json()

        assert "&lt;!channel&gt; &amp; co" in json.dumps(run(go())["blocks"])

    def test_gone_webhook_is_final(self):
        async def go():
            async with Receiver(Reply(404, "no_service")) as receiver, aiohttp.ClientSession() as session:
                return await SlackSink(session, receiver.url).send(alert())

        result = run(go())
        assert (result.ok, result.retry, result.detail) == (False, False, "HTTP 404: no_service")


class SigningReceiver(Receiver):
    """Verifies like a real receiver would: raw bytes, then the two headers."""

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        ok = verify_signature(
            SECRET,
            request.headers.get("X-Ncclwatch-Timestamp", ""),
            body,
            request.headers.get("X-Ncclwatch-Signature", ""),
            now=NOW + 1,
        )
        self.seen.append(Seen(204 if ok else 401, request.path, dict(request.headers), body))
        return web.Response(status=204 if ok else 401)


class TestSignedWebhook:
    def test_receiver_verifies_the_signature(self):
        async def go():
            async with SigningReceiver() as receiver, aiohttp.ClientSession() as session:
                sink = WebhookSink(session, receiver.url, secret=SECRET, clock=lambda: NOW)
                return await sink.send(alert()), receiver.seen[0]

        result, seen = run(go())
        assert result.ok and seen.status == 204
        assert seen.headers["X-Ncclwatch-Timestamp"] == str(int(NOW))
        assert seen.headers["X-Ncclwatch-Id"] == "ncclwatch-hang-train-0123456789ab.trigger"
        assert Alert.model_validate_json(seen.body) == alert()

    def test_wrong_secret_is_refused_and_not_retried(self):
        async def go():
            async with SigningReceiver() as receiver, aiohttp.ClientSession() as session:
                return await WebhookSink(session, receiver.url, secret="other", clock=lambda: NOW).send(alert())

        result = run(go())
        assert (result.ok, result.retry) == (False, False)

    def test_tampered_body_fails(self):
        body = alert().model_dump_json().encode()
        signature = sign(SECRET, int(NOW), body)
        assert verify_signature(SECRET, str(int(NOW)), body, signature, now=NOW)
        assert not verify_signature(SECRET, str(int(NOW)), body.replace(b"rank 3", b"rank 4"), signature, now=NOW)

    def test_stale_or_future_timestamp_fails(self):
        body = b'{"action":"trigger"}'
        old = int(NOW) - 301
        assert not verify_signature(SECRET, old, body, sign(SECRET, old, body), now=NOW)
        ahead = int(NOW) + 301
        assert not verify_signature(SECRET, ahead, body, sign(SECRET, ahead, body), now=NOW)
        assert verify_signature(SECRET, old, body, sign(SECRET, old, body), tolerance_s=600, now=NOW)

    def test_timestamp_moved_to_a_fresh_one_fails(self):
        body = b'{"action":"trigger"}'
        assert not verify_signature(SECRET, int(NOW), body, sign(SECRET, int(NOW) - 3600, body), now=NOW)

    def test_garbage_headers_fail_quietly(self):
        assert not verify_signature(SECRET, "yesterday", b"{}", "sha256=00", now=NOW)
        assert not verify_signature(SECRET, int(NOW), b"{}", "", now=NOW)

    def test_no_secret_sends_no_signature(self):
        async def go():
            async with Receiver(Reply(200)) as receiver, aiohttp.ClientSession() as session:
                await WebhookSink(session, receiver.url).send(alert())
                return receiver.seen[0].headers

        headers = run(go())
        assert "X-Ncclwatch-Signature" not in headers and "X-Ncclwatch-Timestamp" not in headers
        assert headers["X-Ncclwatch-Event"] == "trigger"
