"""PagerDuty Events API v2: a trigger per hang, a resolve on the same ``dedup_key``.

Wire format (developer.pagerduty.com, "Send an Alert Event"): POST JSON to
``/v2/enqueue``; ``routing_key``, ``event_action`` and ``dedup_key`` at the
top, the alert under ``payload`` (``summary`` <= 1024 characters, ``source``,
``severity`` required), ``links``, ``client``, ``client_url``.  A resolve
carries the three top-level keys only.  Answers: 202 accepted; 400 invalid
event (never retried); 429 and 5xx retried, "preferably with a backoff".

The routing key is a credential: it is put into the request body and nowhere
else (not the spool, not a detail, not a log line).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from pydantic import SecretStr

from ncclwatch.watchdog.sinks import Delivery
from ncclwatch.watchdog.sinks.alert import Alert
from ncclwatch.watchdog.sinks.webhooks import TIMEOUT_S, post

DEFAULT_URL = "https://events.pagerduty.com/v2/enqueue"
CLIENT = "ncclwatch"


def event_for(alert: Alert, routing_key: str, client_url: str | None = None) -> dict[str, Any]:
    """The Events API v2 body for one alert."""
    head = {"routing_key": routing_key, "event_action": alert.action, "dedup_key": alert.dedup_key}
    if alert.action == "resolve":
        return head
    payload: dict[str, Any] = {
        "summary": alert.summary,
        "severity": "critical" if alert.problem == "hang" else "warning",  # a slow job is not a stopped one
        "source": alert.host,
        "component": "ncclwatch",
        "group": alert.job,
        "class": alert.verdict,
        "custom_details": {
            "verdict": alert.verdict,
            "culprit_ranks": alert.culprit_ranks,
            "suspect_ranks": alert.suspect_ranks,
            "communicator": alert.communicator,
            "operation": alert.operation,
            "position": alert.position,
            "bundle_url": alert.bundle_url,
            "bundle_id": alert.bundle_id,
            "job": alert.job,
            "host": alert.host,
            "slurm_job_id": alert.slurm_job_id,
            "reason": alert.reason,
        },
    }
    if alert.detected_at:
        payload["timestamp"] = alert.detected_at  # ISO 8601: when we saw it, not when a retry got through
    event = head | {"payload": payload, "client": CLIENT}
    links = [{"href": alert.bundle_url, "text": "root-cause bundle"}] if alert.bundle_url else []
    if alert.incident_url:
        links.append({"href": alert.incident_url, "text": "incident on the cluster's ncclwatch server"})
    if links:
        event["links"] = links
    if client_url:
        event["client_url"] = client_url
    return event


class PagerDutySink:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        routing_key: SecretStr | str,
        *,
        url: str = DEFAULT_URL,
        client_url: str | None = None,
        timeout_s: float = TIMEOUT_S,
        name: str = "pagerduty",
    ) -> None:
        self.name = name
        self._session = session
        self._routing_key = routing_key if isinstance(routing_key, SecretStr) else SecretStr(routing_key)
        self._url = url
        self._client_url = client_url
        self._timeout_s = timeout_s

    async def send(self, alert: Alert) -> Delivery:
        body = json.dumps(event_for(alert, self._routing_key.get_secret_value(), self._client_url)).encode()
        return await post(
            self._session, self._url, body, accepted=lambda status: status == 202, timeout_s=self._timeout_s
        )
