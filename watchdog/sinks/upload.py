"""The upload sink: each node's bundle to the cluster's ``ncclwatch serve`` (``--upload URL``).

One more sink behind the dispatcher, so an upload is spooled, retried and deduplicated like a page, and a
server that is down or slow never delays one: each sink has its own queue.  Unlike a page it is each node's
(``each_node``): the node that pages submits its alert to every sink, every other node of the job submits
its own (same dedup key, its own host and bundle) to this sink alone, and the spool keys an upload by the
host too.  What the spool holds is the alert, which names the bundle (``bundle_id``), never the bundle's
bytes: the file is read from ``bundle_dir`` when it is sent, so a bundle amended after the page (what was
done about the hang) goes up as amended.

``POST <url>/api/upload`` with the upload token, ``X-Ncclwatch-Incident: <dedup key>`` (every node of the
job sends the same, so the server groups their bundles into one incident) and ``X-Ncclwatch-Slurm-Job``
under Slurm.  201 or 200 (already there) is delivered; 429 and 5xx are retried (after the server's
Retry-After); another 4xx (a refused archive, a wrong token) is final and goes to the spool's failed/.

Bounded: an upload the server has not taken within ``keep_s`` of its alert (``upload_spool_days``), or
whose bundle file is gone, is given up (failed/, logged), so a server that never comes back leaves no
queue growing for ever.  The terminal gets one line for the outcome (``Delivery.said``): the incident's address
on the server, or why the bundle was given up; the normal retry while the bundle is still being written is not
said (``Delivery.expected``).  A resolve or a performance page has no bundle: nothing to upload, delivered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import aiohttp

from ncclwatch.watchdog.sinks import Delivery
from ncclwatch.watchdog.sinks.alert import Alert, incident_url
from ncclwatch.watchdog.sinks.webhooks import DETAIL_MAX, outcome, retry_after_s

UPLOAD_PATH = "/api/upload"
BASE_TIMEOUT_S = 30.0
SLOWEST_BYTES_PER_S = 1 << 20  # the timeout grows with the bundle: 50 MB at 1 MiB/s is 78 s
BUNDLE_WRITE_S = 600.0  # a bundle not there this long after its page never will be (evidence budgets are seconds)


class UploadSink:
    each_node = True  # every node uploads its own bundle, the node that pages and the others (Dispatcher.submit)

    def __init__(
        self,
        session: aiohttp.ClientSession,
        server: str,
        token: str,
        bundle_dir: Path,
        *,
        keep_s: float = 7 * 86400,
        clock: Callable[[], float] = time.time,
        name: str = "upload",
    ) -> None:
        self.name = name
        self._session = session
        self._server = server.rstrip("/")
        self._url = self._server + UPLOAD_PATH
        self._token = token
        self._bundle_dir = bundle_dir
        self._keep_s = keep_s
        self._clock = clock

    async def send(self, alert: Alert) -> Delivery:
        if alert.action != "trigger" or not alert.bundle_id:
            return Delivery(ok=True, retry=False, detail="no bundle to upload")
        delivery = await self._upload(alert)
        if delivery.ok:
            where = incident_url(self._server, alert.dedup_key)
            return replace(delivery, said=f"upload: bundle {alert.bundle_id} is on the server: {where}")
        if not delivery.retry:
            said = f"upload: bundle {alert.bundle_id} not uploaded to {self._server}, given up: {delivery.detail}"
            return replace(delivery, said=said)
        return delivery

    async def _upload(self, alert: Alert) -> Delivery:
        path = self._bundle_dir / f"{alert.bundle_id}.tar.gz"
        waited = self._clock() - alert.created_at
        if waited > self._keep_s:
            return Delivery(
                ok=False, retry=False, detail=f"the server took no upload for {waited:.0f} s (--upload-spool-days)"
            )
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/gzip",
            "X-Ncclwatch-Incident": alert.dedup_key,
        }
        if alert.slurm_job_id:
            headers["X-Ncclwatch-Slurm-Job"] = alert.slurm_job_id
        try:
            handle = path.open("rb")
        except FileNotFoundError as exc:
            # The page goes out before the evidence is collected (live/sidecar.py): the bundle follows.
            writing = waited < BUNDLE_WRITE_S
            detail = "the bundle is still being written" if writing else f"the bundle cannot be read: {exc}"
            return Delivery(ok=False, retry=writing, detail=detail[:DETAIL_MAX], expected=writing)
        except OSError as exc:
            return Delivery(ok=False, retry=False, detail=f"the bundle cannot be read: {exc}"[:DETAIL_MAX])
        with handle:
            size = path.stat().st_size
            timeout = aiohttp.ClientTimeout(total=BASE_TIMEOUT_S + size / SLOWEST_BYTES_PER_S)
            try:
                async with self._session.post(
                    self._url, data=handle, headers=headers, timeout=timeout, allow_redirects=False
                ) as response:
                    text = await response.text(errors="replace")
                    after = retry_after_s(response.headers.get("Retry-After"))
                    return outcome(response.status, text, after, accepted=lambda status: status in (200, 201))
            except Exception as exc:  # noqa: BLE001 - refused, reset, timed out: all "try later"
                return Delivery(ok=False, retry=True, detail=f"network: {type(exc).__name__}: {exc}"[:DETAIL_MAX])
