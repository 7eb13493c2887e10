"""Delivery: every alert reaches every sink once, through outages and restarts.

``submit`` writes one spool file per (sink, alert) before anything is sent,
so a page survives a receiver that is down, rate limiting, and a restart of
the sidecar; ``start`` picks up whatever a previous run left.  One task per
sink sends that sink's files oldest first (a resolve never overtakes its
trigger), and one sink's outage never delays another's page.

Spool layout (``spool_dir``)::

    <sink>/<seq:020d>.<action>.<key>.json   waiting: the alert as JSON; seq orders them
    <sink>/.<name>.tmp                      being written (a crash leftover is removed at start)
    sent/<sink>.<action>.<key>              delivered: empty markers, so a repeat is still ignored
    failed/<sink>.<action>.<key>.json       refused (4xx) or unreadable: sink, detail, failed_at, alert

``<key>`` is the alert's ``dedup_key`` (``sha256_<32 hex>`` of it when it is
not ``[A-Za-z0-9_-]``).  A (sink, action, key) seen in any of the three is
submitted at most once: a second trigger for the same hang is ignored.

Retries (``Delivery.retry``): forever, waiting ``backoff_s`` in turn and then
its last value, or the receiver's Retry-After (capped at that last value).
Failure modes: a 4xx is final (failed/, logged as an error); a spool that
cannot be written is logged and the alert is delivered from memory (lost
only if the process also dies first); a sink that raises or hangs counts as
a network error.  Nothing here raises into the caller, except ``Dispatcher``
itself on a sink name that cannot name a folder (a wiring bug, at startup).
On the wire this is at least once: a reply lost after the receiver acted is
sent again (PagerDuty folds it by ``dedup_key``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import ValidationError

from ncclwatch.watchdog.sinks import Delivery, Sink
from ncclwatch.watchdog.sinks.alert import Alert
from ncclwatch.watchdog.sinks.pagerduty import PagerDutySink
from ncclwatch.watchdog.sinks.webhooks import SlackSink, WebhookSink

if TYPE_CHECKING:
    from ncclwatch.watchdog.config import Settings

log = logging.getLogger(__name__)

BACKOFF_S = (1, 2, 5, 10, 30, 60)
ATTEMPT_TIMEOUT_S = 120.0  # a sink that hangs past its own timeout must not stall its queue for good
SENT_KEEP_S = 7 * 86400  # repeats of an incident come within minutes; markers older than this are pruned
_NAME = re.compile(r"[a-z0-9_-]{1,40}")
_KEY = re.compile(r"[A-Za-z0-9_-]{1,160}")
_RESERVED = {"sent", "failed"}


@dataclass
class _Entry:
    sink: str
    ident: str  # "<action>.<key>"
    alert: Alert
    path: Path | None  # None: the spool could not be written, so only memory holds it


def _pair(name: str) -> tuple[str, str]:
    sink, _, ident = name.removesuffix(".json").partition(".")
    return sink, ident


def ident_of(alert: Alert) -> str:
    key = alert.dedup_key
    safe = key if _KEY.fullmatch(key) else "sha256_" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"{alert.action}.{safe}"


def _write_atomic(path: Path, data: bytes) -> None:
    """tmp + fsync + os.replace + fsync of the folder: after a power cut the file is whole or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself durable
    finally:
        os.close(folder)


class Dispatcher:
    def __init__(
        self,
        sinks: Sequence[Sink],
        spool_dir: Path,
        *,
        backoff_s: Sequence[float] = BACKOFF_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        names = [sink.name for sink in sinks]
        bad = [n for n in names if not _NAME.fullmatch(n) or n in _RESERVED]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"sink names must be unique, [a-z0-9_-], not sent/failed: {names}")
        self._sinks = {sink.name: sink for sink in sinks}
        self._spool = Path(spool_dir)
        self._backoff = tuple(backoff_s) or BACKOFF_S
        self._clock = clock
        self._queues: dict[str, deque[_Entry]] = {name: deque() for name in self._sinks}
        self._wake = {name: asyncio.Event() for name in self._sinks}
        self._progress = asyncio.Condition()
        self._seen: set[tuple[str, str]] = set()
        self._seq = 0
        self._loaded = False
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Deliver what a previous run left in the spool, then whatever is submitted."""
        self._load()
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker(n), name=f"ncclwatch-sink-{n}") for n in self._sinks]
        left = sum(map(len, self._queues.values()))
        if left:
            log.info("delivering %d alert(s) left in %s", left, self._spool)

    def submit(self, alert: Alert) -> None:
        """Spool ``alert`` for every sink and wake their tasks; a repeat (same key, action) is ignored."""
        self._load()
        for name in self._sinks:
            try:
                self._enqueue(name, alert)
            except Exception:  # the caller is the hang reporter; it must carry on, and so must other sinks
                log.exception("%s: alert %s %s could not be queued", name, alert.action, alert.dedup_key)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every sink's queue is empty (True) or ``timeout_s`` passed (False)."""
        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(self._idle), timeout_s)
            except TimeoutError:
                return self._idle()
        return True

    async def close(self) -> None:
        """Stop the tasks; undelivered alerts stay in the spool for the next ``start``."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _idle(self) -> bool:
        return not any(self._queues.values())

    def _enqueue(self, name: str, alert: Alert) -> None:
        ident = ident_of(alert)
        if (name, ident) in self._seen:
            log.info("%s: %s already queued or sent; repeat ignored", name, ident)
            return
        self._seen.add((name, ident))
        self._seq += 1
        path: Path | None = self._spool / name / f"{self._seq:020d}.{ident}.json"
        try:
            _write_atomic(path, alert.model_dump_json().encode())
        except OSError as exc:
            log.error("%s: cannot spool %s (%s); sending from memory, a restart now would lose it", name, ident, exc)
            path = None
        self._queues[name].append(_Entry(name, ident, alert, path))
        self._wake[name].set()

    def _load(self) -> None:
        """Once: learn what was sent or refused, and queue what waits, oldest first."""
        if self._loaded:
            return
        self._loaded = True
        try:
            self._scan()
        except Exception:  # a broken spool must not stop new alerts
            log.exception("alert spool %s could not be read", self._spool)

    def _scan(self) -> None:
        now = self._clock()
        for marker in self._listing(self._spool / "sent"):
            try:
                if now - marker.stat().st_mtime > SENT_KEEP_S:
                    marker.unlink()
                    continue
            except OSError:
                pass  # kept: a marker that cannot be aged still blocks a repeat
            self._seen.add(_pair(marker.name))
        for refused in self._listing(self._spool / "failed"):
            self._seen.add(_pair(refused.name))
        for name in self._sinks:
            for path in sorted(self._listing(self._spool / name)):
                self._load_one(name, path)
        for folder in self._listing(self._spool):
            if folder.is_dir() and folder.name not in self._sinks and folder.name not in _RESERVED:
                log.warning("alert spool %s: sink %r is not configured; its alerts stay there", folder, folder.name)

    def _load_one(self, name: str, path: Path) -> None:
        if path.name.startswith("."):
            path.unlink(missing_ok=True)  # a write that a crash cut short; its submit never returned
            return
        seq, ident = _pair(path.name)
        if not seq.isdigit() or not ident:
            log.warning("alert spool: %s is not a spool file; ignored", path)
            return
        self._seq = max(self._seq, int(seq))
        if (name, ident) in self._seen:  # sent or refused, then the process died before removing it
            path.unlink(missing_ok=True)
            return
        self._seen.add((name, ident))
        try:
            alert = Alert.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            self._to_failed(name, ident, path, f"unreadable spool file: {exc}", None)
            return
        self._queues[name].append(_Entry(name, ident, alert, path))

    @staticmethod
    def _listing(folder: Path) -> list[Path]:
        try:
            return list(folder.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:  # unreadable spool: new alerts still go out, from memory if need be
            log.error("alert spool %s cannot be listed: %s", folder, exc)
            return []

    async def _worker(self, name: str) -> None:
        queue, wake = self._queues[name], self._wake[name]
        while True:
            if not queue:
                wake.clear()
                await wake.wait()
                continue
            entry = queue[0]
            await self._deliver(self._sinks[name], entry)
            queue.popleft()
            async with self._progress:
                self._progress.notify_all()

    async def _deliver(self, sink: Sink, entry: _Entry) -> None:
        for attempt in itertools.count(1):
            result = await self._attempt(sink, entry.alert)
            if result.ok:
                log.info("%s: %s delivered (%s)", sink.name, entry.ident, result.detail)
                self._sent(entry)
                return
            if not result.retry:
                log.error("%s: %s refused, not retried: %s", sink.name, entry.ident, result.detail)
                self._to_failed(entry.sink, entry.ident, entry.path, result.detail, entry.alert)
                return
            delay = self._backoff[min(attempt, len(self._backoff)) - 1]
            if result.retry_after_s is not None:
                delay = min(result.retry_after_s, self._backoff[-1])
            log.warning(
                "%s: %s not delivered (%s); attempt %d, next in %.3gs",
                sink.name,
                entry.ident,
                result.detail,
                attempt,
                delay,
            )
            await asyncio.sleep(delay)

    @staticmethod
    async def _attempt(sink: Sink, alert: Alert) -> Delivery:
        try:
            return await asyncio.wait_for(sink.send(alert), ATTEMPT_TIMEOUT_S)
        except TimeoutError:
            return Delivery(ok=False, retry=True, detail=f"no answer within {ATTEMPT_TIMEOUT_S:g}s")
        except Exception as exc:  # a sink broke its never-raise contract; keep the alert
            log.exception("%s: send raised", sink.name)
            return Delivery(ok=False, retry=True, detail=f"sink raised {type(exc).__name__}: {exc}")

    def _sent(self, entry: _Entry) -> None:
        # Marker first, then the spool file: a crash between the two is resolved at load, without a resend.
        try:
            (self._spool / "sent").mkdir(parents=True, exist_ok=True)
            (self._spool / "sent" / f"{entry.sink}.{entry.ident}").touch()
            if entry.path is not None:
                entry.path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("%s: %s delivered, but the spool could not record it (%s)", entry.sink, entry.ident, exc)

    def _to_failed(self, sink: str, ident: str, path: Path | None, detail: str, alert: Alert | None) -> None:
        record: dict[str, Any] = {"sink": sink, "detail": detail, "failed_at": self._clock()}
        record["alert"] = alert.model_dump(mode="json") if alert is not None else None
        try:
            _write_atomic(self._spool / "failed" / f"{sink}.{ident}.json", json.dumps(record).encode())
            if path is not None:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("%s: %s could not be moved to failed/ (%s)", sink, ident, exc)


def spool_dir_for(settings: Settings) -> Path:
    return settings.spool_dir or settings.bundle_dir / ".spool"


def sinks_from_settings(settings: Settings, session: aiohttp.ClientSession) -> list[Sink]:
    """The sinks the settings configure, on one shared session (the caller closes it)."""
    sinks: list[Sink] = []
    if settings.pagerduty_routing_key is not None:
        sinks.append(
            PagerDutySink(
                session, settings.pagerduty_routing_key, url=settings.pagerduty_url, client_url=settings.public_url
            )
        )
    if settings.slack_webhook_url is not None:
        sinks.append(SlackSink(session, settings.slack_webhook_url))
    if settings.webhook_url is not None:
        sinks.append(WebhookSink(session, settings.webhook_url, secret=settings.webhook_secret))
    return sinks
