"""HTTP sinks: the shared POST, a Slack incoming webhook, and a signed generic JSON webhook.

``post`` maps every outcome of one request to a ``Delivery`` (see the
package docstring); it never raises.  The PagerDuty sink uses it too.

Generic webhook signature (for receivers)
-----------------------------------------
Each request carries the alert as JSON, ``X-Ncclwatch-Event: trigger|resolve``
and ``X-Ncclwatch-Id: <dedup_key>.<action>``.  With ``webhook_secret`` set it
also carries::

    X-Ncclwatch-Timestamp: <unix seconds, integer>
    X-Ncclwatch-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>

A receiver recomputes the HMAC over the exact bytes it received (before any
JSON parsing), compares in constant time, and rejects a timestamp more than
five minutes from its clock: ``verify_signature`` does all three.  The
timestamp is inside the signed string, so a captured request cannot be
replayed later with a fresh timestamp.  Delivery is at least once on the
wire (a reply lost to a timeout is sent again), so receivers should drop a
repeated ``X-Ncclwatch-Id``.
"""

from __future__ import annotations

import email.utils
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from pydantic import SecretStr

from ncclwatch.watchdog.sinks import Delivery
from ncclwatch.watchdog.sinks.alert import Alert

TIMEOUT_S = 10.0
DETAIL_MAX = 300  # of the receiver's answer, into logs and failed/ files
RETRYABLE = frozenset({408, 429})  # besides 5xx: the receiver may accept the same request later


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds (what PagerDuty and Slack send) or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def outcome(status: int, text: str, retry_after: float | None, accepted: Callable[[int], bool]) -> Delivery:
    snippet = " ".join(text.split())[:DETAIL_MAX]
    detail = f"HTTP {status}: {snippet}" if snippet else f"HTTP {status}"
    if accepted(status):
        return Delivery(ok=True, retry=False, detail=detail)
    retry = status in RETRYABLE or status >= 500
    return Delivery(ok=False, retry=retry, detail=detail, retry_after_s=retry_after if retry else None)


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    accepted: Callable[[int], bool],
    headers: Mapping[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
    secret_url: bool = False,
) -> Delivery:
    """One POST of JSON ``body``; ``secret_url`` keeps a URL that is itself a credential (Slack) out of details."""
    try:
        async with session.post(
            url,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,  # a redirected POST turns into a GET and would read as delivered
        ) as response:
            text = await response.text(errors="replace")
            return outcome(response.status, text, retry_after_s(response.headers.get("Retry-After")), accepted)
    except Exception as exc:  # noqa: BLE001 - refused, reset, timed out, closed session: all "try later"
        message = str(exc)
        if secret_url:
            message = message.replace(url, "<secret url>")
        return Delivery(ok=False, retry=True, detail=f"network: {type(exc).__name__}: {message}"[:DETAIL_MAX])


def _mrkdwn(text: str) -> str:
    # Slack reads <...> as links and mentions; these three are its only escapes.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_message(alert: Alert) -> dict[str, Any]:
    """Slack's ``{"text", "blocks"}``: the text is the notification, the blocks the message."""
    if alert.action == "resolve":
        return {"text": _mrkdwn(f"{alert.summary} (incident {alert.dedup_key})")}
    culprit = ", ".join(map(str, alert.culprit_ranks)) or (
        f"none named; suspects {', '.join(map(str, alert.suspect_ranks))}" if alert.suspect_ranks else "none named"
    )
    operation = alert.operation or "-"
    if alert.position is not None:
        operation += f" (#{alert.position}" + (f" on {alert.communicator})" if alert.communicator else ")")
    fields = {
        "Verdict": alert.verdict or "-",
        "Culprit rank": culprit,
        "Operation": operation,
        "Job": alert.job + (f" (Slurm {alert.slurm_job_id})" if alert.slurm_job_id else ""),
        "Host": alert.host,
        "Detected": alert.detected_at or "-",
    }
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": f"{alert.problem.capitalize()}: {alert.verdict or 'unknown'} in {alert.job}"[:150],
            },
        },
        {"type": "section", "text": {"type": "mrkdwn", "text": _mrkdwn(alert.summary)[:3000]}},
        {
            "type": "section",
            "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{_mrkdwn(v)}"[:2000]} for k, v in fields.items()],
        },
    ]
    if alert.reason:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"*Why*\n{_mrkdwn(alert.reason)}"[:3000]}})
    if alert.bundle_url:
        url = alert.bundle_url.replace("|", "%7C").replace(">", "%3E")  # would end Slack's <url|text>
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"<{url}|Root-cause bundle>"}})
    if alert.incident_url:
        url = alert.incident_url.replace("|", "%7C").replace(">", "%3E")
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": f"<{url}|Incident on the cluster server>"}}
        )
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"incident {alert.dedup_key}"}]})
    return {"text": _mrkdwn(alert.summary), "blocks": blocks}


class SlackSink:
    """Slack incoming webhook; success is 200 with the body ``ok``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        webhook_url: SecretStr | str,
        *,
        timeout_s: float = TIMEOUT_S,
        name: str = "slack",
    ) -> None:
        self.name = name
        self._session = session
        self._url = webhook_url if isinstance(webhook_url, SecretStr) else SecretStr(webhook_url)
        self._timeout_s = timeout_s

    async def send(self, alert: Alert) -> Delivery:
        body = json.dumps(slack_message(alert)).encode()
        return await post(
            self._session,
            self._url.get_secret_value(),
            body,
            accepted=lambda status: status == 200,
            timeout_s=self._timeout_s,
            secret_url=True,
        )


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def verify_signature(
    secret: str,
    timestamp: str | int,
    body: bytes | str,
    signature: str,
    tolerance_s: float = 300,
    now: float | None = None,
) -> bool:
    """True when ``signature`` is ours for this timestamp and body, and the timestamp is fresh."""
    try:
        stamp = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs((time.time() if now is None else now) - stamp) > tolerance_s:
        return False
    raw = body.encode() if isinstance(body, str) else body
    return hmac.compare_digest(sign(secret, stamp, raw).encode(), str(signature).encode())


class WebhookSink:
    """Generic JSON webhook: the alert as JSON, signed when a secret is set (module docstring)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        secret: SecretStr | str | None = None,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        name: str = "webhook",
    ) -> None:
        self.name = name
        self._session = session
        self._url = url
        self._secret = secret.get_secret_value() if isinstance(secret, SecretStr) else secret
        self._timeout_s = timeout_s
        self._clock = clock

    async def send(self, alert: Alert) -> Delivery:
        body = alert.model_dump_json().encode()
        headers = {"X-Ncclwatch-Event": alert.action, "X-Ncclwatch-Id": f"{alert.dedup_key}.{alert.action}"}
        if self._secret:
            timestamp = int(self._clock())
            headers["X-Ncclwatch-Timestamp"] = str(timestamp)
            headers["X-Ncclwatch-Signature"] = sign(self._secret, timestamp, body)
        return await post(
            self._session,
            self._url,
            body,
            accepted=lambda status: 200 <= status < 300,
            headers=headers,
            timeout_s=self._timeout_s,
        )
