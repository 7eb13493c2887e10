"""Delivery: every alert reaches every sink once, through outages and restarts.

``submit`` writes one spool file per (sink, alert) before anything is sent,
so a page survives a receiver that is down, rate limiting, and a restart of
the sidecar; ``start`` picks up whatever a previous run left.  One task per
sink sends that sink's files oldest first (a resolve never overtakes its
trigger), and one sink's outage never delays another's page.

Spool layout (``spool_dir``)::

    <sink>/<seq:020d>.<action>.<key>.json   waiting: the alert as JSON; seq orders them
    <sink>/.<name>.tmp                      being written (a crash leftover, a minute old, is removed at start)
    sent/<sink>.<action>.<key>              delivered: empty markers, so a repeat is still ignored
    failed/<sink>.<action>.<key>.json       refused (4xx) or unreadable: sink, detail, failed_at, alert
    failed/<sink>.<action>.<key>.raw        an unreadable spool file's own bytes, kept for people to read

``<key>`` is the alert's ``dedup_key`` (``sha256_<32 hex>`` of it when it is
not ``[A-Za-z0-9_-]``).  A (sink, action, key) seen in any of the three is
submitted at most once: a second trigger for the same hang is ignored.  For a
sink that every node delivers to for itself (``each_node``: the upload of the
node's own bundle), the key is ``<dedup_key>.<host>``: the nodes of one job
share the dedup key and may share the spool, and each node's upload is its own.
``submit(alert, each_node_only=True)`` spools to those sinks alone: a node that
does not page still uploads its bundle.

Several processes share one spool (the jobs' wrappers of a node and its
agent, ``ncclwatch serve``): a file is sent only under an exclusive
``flock`` on it, and a sender that cannot take the lock leaves the file to
the holder; under the lock the ``sent/`` marker is checked again, so two
senders never both deliver one alert.  With ``rescan_s`` (the agent) the
spool is read again at that interval: alerts a job left behind, or that
another sender let go of, are picked up then.

Retries (``Delivery.retry``): forever, waiting ``backoff_s`` in turn and then
its last value, or the receiver's Retry-After (capped at that last value).
Failure modes: a 4xx is final (failed/, logged as an error); an unreadable
spool file (not JSON, not UTF-8, empty, cut short) goes to failed/ with its
bytes, logged as an error; a spool that
cannot be written is logged and the alert is delivered from memory (lost
only if the process also dies first); a sink that raises or hangs counts as
a network error.  Nothing here raises into the caller, except ``Dispatcher``
itself on a sink name that cannot name a folder (a wiring bug, at startup).
On the wire this is at least once: a reply lost after the receiver acted is
sent again (PagerDuty folds it by ``dedup_key``).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import ValidationError

from ncclwatch.watchdog.config import ConfigError
from ncclwatch.watchdog.sinks import Delivery, Sink
from ncclwatch.watchdog.sinks.alert import Alert
from ncclwatch.watchdog.sinks.pagerduty import PagerDutySink
from ncclwatch.watchdog.sinks.upload import UploadSink
from ncclwatch.watchdog.sinks.webhooks import SlackSink, WebhookSink

if TYPE_CHECKING:
    from ncclwatch.watchdog.config import Settings

log = logging.getLogger(__name__)

BACKOFF_S = (1, 2, 5, 10, 30, 60)
ATTEMPT_TIMEOUT_S = 120.0  # a sink that hangs past its own timeout must not stall its queue for good
SENT_KEEP_S = 7 * 86400  # repeats of an incident come within minutes; markers older than this are pruned
TMP_STALE_S = 60.0  # a .tmp younger than this may be another process's write in progress
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


def _safe(part: str) -> str:
    return part if _KEY.fullmatch(part) else "sha256_" + hashlib.sha256(part.encode()).hexdigest()[:32]


def ident_of(alert: Alert, each_node: bool = False) -> str:
    """``<action>.<key>``; for a sink every node delivers to for itself, ``<action>.<key>.<host>``."""
    ident = f"{alert.action}.{_safe(alert.dedup_key)}"
    return f"{ident}.{_safe(alert.host)}" if each_node else ident


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
        rescan_s: float | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """``say``: where a sink's line for the terminal goes (``Delivery.said``); default stderr, "ncclwatch: "."""
        names = [sink.name for sink in sinks]
        bad = [n for n in names if not _NAME.fullmatch(n) or n in _RESERVED]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"sink names must be unique, [a-z0-9_-], not sent/failed: {names}")
        self._sinks = {sink.name: sink for sink in sinks}
        self._each_node = {sink.name for sink in sinks if getattr(sink, "each_node", False)}
        self._spool = Path(spool_dir)
        self._backoff = tuple(backoff_s) or BACKOFF_S
        self._clock = clock
        self._rescan_s = rescan_s
        self._queues: dict[str, deque[_Entry]] = {name: deque() for name in self._sinks}
        self._wake = {name: asyncio.Event() for name in self._sinks}
        self._progress = asyncio.Condition()
        self._seen: set[tuple[str, str]] = set()
        self._queued: set[Path] = set()  # spool files in a queue here, so a rescan does not add them twice
        self._seq = 0
        self._loaded = False
        self._tasks: list[asyncio.Task[None]] = []
        self._say = say or _to_stderr

    async def start(self) -> None:
        """Deliver what a previous run left in the spool, then whatever is submitted (and, with rescan_s, appears)."""
        self._load()
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker(n), name=f"ncclwatch-sink-{n}") for n in self._sinks]
            if self._rescan_s is not None:
                self._tasks.append(
                    asyncio.create_task(self._rescan_forever(self._rescan_s), name="ncclwatch-spool-rescan")
                )
        left = self.pending()
        if left:
            log.info("delivering %d alert(s) left in %s", left, self._spool)

    def pending(self) -> int:
        """Alerts queued here and not yet delivered or refused."""
        return sum(map(len, self._queues.values()))

    def submit(self, alert: Alert, *, each_node_only: bool = False) -> None:
        """Spool ``alert`` for every sink and wake their tasks; a repeat (same key, action) is ignored.
        ``each_node_only``: for the sinks every node delivers to for itself alone (its bundle's upload), where
        another node pages."""
        self._load()
        for name in self._each_node if each_node_only else self._sinks:
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
        """Stop the tasks; undelivered alerts stay in the spool for the next ``start`` (or the node agent)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def rescan(self) -> int:
        """Queue spool files that appeared since (another process's), or that another sender let go; how many."""
        before = self.pending()
        try:
            for name in self._sinks:
                for path in sorted(self._listing(self._spool / name)):
                    self._load_one(name, path, first=False)
        except Exception:  # a broken spool must not stop the agent
            log.exception("alert spool %s could not be read", self._spool)
        for name in self._sinks:
            if self._queues[name]:
                self._wake[name].set()
        return self.pending() - before

    async def _rescan_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            found = self.rescan()
            if found:
                log.info("alert spool %s: %d alert(s) to deliver", self._spool, found)

    def _idle(self) -> bool:
        return not any(self._queues.values())

    def _enqueue(self, name: str, alert: Alert) -> None:
        ident = ident_of(alert, name in self._each_node)
        if (name, ident) in self._seen:
            log.info("%s: %s already queued or sent; repeat ignored", name, ident)
            return
        self._seen.add((name, ident))
        self._seq = max(self._seq + 1, time.time_ns())  # a second process on the spool sorts after older files
        path: Path | None = self._spool / name / f"{self._seq:020d}.{ident}.json"
        try:
            _write_atomic(path, alert.model_dump_json().encode())
        except OSError as exc:
            log.error("%s: cannot spool %s (%s); sending from memory, a restart now would lose it", name, ident, exc)
            path = None
        self._push(_Entry(name, ident, alert, path))

    def _push(self, entry: _Entry) -> None:
        self._queues[entry.sink].append(entry)
        if entry.path is not None:
            self._queued.add(entry.path)
        self._wake[entry.sink].set()

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
            if refused.name.endswith(".json"):
                self._seen.add(_pair(refused.name))
        for name in self._sinks:
            for path in sorted(self._listing(self._spool / name)):
                self._load_one(name, path, first=True)
        for folder in self._listing(self._spool):
            if folder.is_dir() and folder.name not in self._sinks and folder.name not in _RESERVED:
                log.warning("alert spool %s: sink %r is not configured; its alerts stay there", folder, folder.name)

    def _load_one(self, name: str, path: Path, *, first: bool) -> None:
        if path in self._queued:
            return
        if path.name.startswith("."):
            self._remove_stale_tmp(path) if first else None
            return
        seq, ident = _pair(path.name)
        if not seq.isdigit() or not ident:
            if first:
                log.warning("alert spool: %s is not a spool file; ignored", path)
            return
        self._seq = max(self._seq, int(seq))
        if self._settled(name, ident):  # sent or refused, then its sender died before removing it
            path.unlink(missing_ok=True)
            return
        self._seen.add((name, ident))
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # another sender delivered it meanwhile
            return
        except OSError as exc:
            log.error("alert spool: %s cannot be read (%s); left in place", path, exc)
            return
        try:
            alert = Alert.model_validate_json(data)
        except ValidationError as exc:  # not JSON, not UTF-8, empty, cut short, or not an alert
            self._quarantine(name, ident, path, exc)
            return
        self._push(_Entry(name, ident, alert, path))

    def _settled(self, name: str, ident: str) -> bool:
        """Sent or refused, by anyone: the markers on disk are what every process sharing the spool agrees on."""
        return (self._spool / "sent" / f"{name}.{ident}").exists() or (
            self._spool / "failed" / f"{name}.{ident}.json"
        ).exists()

    def _remove_stale_tmp(self, path: Path) -> None:
        """A write a crash cut short (its submit never returned); a young one may be another process's, in progress."""
        try:
            if self._clock() - path.stat().st_mtime > TMP_STALE_S:
                path.unlink()
        except OSError:
            pass

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
            try:
                with _Claim(entry.path) as claim:
                    if claim.ours and not (entry.path and self._settled(entry.sink, entry.ident)):
                        await self._deliver(self._sinks[name], entry)
                    elif claim.ours:  # delivered by another sender before we had the lock
                        entry.path.unlink(missing_ok=True)  # type: ignore[union-attr]
                    elif not claim.gone:
                        self._let_go(queue, entry)
            finally:
                if queue and queue[0] is entry:
                    queue.popleft()
                self._queued.discard(entry.path)  # type: ignore[arg-type]
            async with self._progress:
                self._progress.notify_all()

    def _let_go(self, queue: deque[_Entry], entry: _Entry) -> None:
        """Another process holds the file: it sends it.  Later alerts of the same incident wait for it (order)."""
        log.info("%s: %s is being sent by another process sharing %s", entry.sink, entry.ident, self._spool)
        key = entry.ident.partition(".")[2]
        for later in [e for e in list(queue)[1:] if e.ident.partition(".")[2] == key and e.path is not None]:
            queue.remove(later)
            self._queued.discard(later.path)  # type: ignore[arg-type]
            self._seen.discard((later.sink, later.ident))  # a rescan (the agent) picks it up again
        self._seen.discard((entry.sink, entry.ident))

    async def _deliver(self, sink: Sink, entry: _Entry) -> None:
        said_retry = None  # the last reason for a retry that was said: the same reason again is only logged
        for attempt in itertools.count(1):
            result = await self._attempt(sink, entry.alert)
            if result.ok:
                log.info("%s: %s delivered (%s)", sink.name, entry.ident, result.detail)
                if result.said:
                    self._say(result.said)
                self._sent(entry)
                return
            if not result.retry:
                if result.said:
                    self._say(result.said)
                else:
                    log.error("%s: %s refused, not retried: %s", sink.name, entry.ident, result.detail)
                self._to_failed(entry.sink, entry.ident, entry.path, result.detail, entry.alert)
                return
            delay = self._backoff[min(attempt, len(self._backoff)) - 1]
            if result.retry_after_s is not None:
                delay = min(result.retry_after_s, self._backoff[-1])
            matters = not result.expected and result.detail != said_retry
            (log.warning if matters else log.info)(
                "%s: %s not delivered (%s); attempt %d, next in %.3gs",
                sink.name,
                entry.ident,
                result.detail,
                attempt,
                delay,
            )
            said_retry = result.detail if matters else said_retry
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

    def _quarantine(self, sink: str, ident: str, path: Path, exc: ValidationError) -> None:
        """An unreadable spool file: its bytes go to failed/<sink>.<ident>.raw, a record beside them, a log line."""
        first = exc.errors()[0] if exc.errors() else {}
        detail = f"unreadable spool file: {first.get('type', 'invalid')}: {first.get('msg', exc)}"
        raw = self._spool / "failed" / f"{sink}.{ident}.raw"
        try:
            raw.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, raw)
        except OSError as exc_move:
            log.error("alert spool: %s is unreadable (%s) and could not be moved (%s)", path, detail, exc_move)
            return
        log.error("alert spool: %s is unreadable (%s); its bytes are kept in %s", path, detail, raw)
        self._to_failed(sink, ident, None, detail, None, raw_file=raw.name)

    def _to_failed(
        self, sink: str, ident: str, path: Path | None, detail: str, alert: Alert | None, raw_file: str | None = None
    ) -> None:
        record: dict[str, Any] = {"sink": sink, "detail": detail, "failed_at": self._clock()}
        record["alert"] = alert.model_dump(mode="json") if alert is not None else None
        if raw_file is not None:
            record["raw_file"] = raw_file
        try:
            _write_atomic(self._spool / "failed" / f"{sink}.{ident}.json", json.dumps(record).encode())
            if path is not None:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("%s: %s could not be moved to failed/ (%s)", sink, ident, exc)


class _Claim:
    """An exclusive, non-blocking ``flock`` on a spool file for as long as it is being sent.

    ``ours``: the lock is held (or the alert lives only in memory);
    ``gone``: the file was delivered and removed by another sender.  Neither:
    another process holds it.  The lock dies with its process, so a sender
    killed mid-retry never blocks the file for good.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.ours = path is None
        self.gone = False
        self._fd: int | None = None

    def __enter__(self) -> _Claim:
        if self.path is None:
            return self
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Locked, but maybe an inode the holder has removed since: then it is delivered.
            self.ours = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
            self.gone = not self.ours
        except FileNotFoundError:
            self.gone = True
        except BlockingIOError:
            pass
        except OSError as exc:  # a spool we cannot lock: send anyway rather than sit on a page
            log.warning("alert spool: cannot lock %s (%s); sending without the lock", self.path, exc)
            self.ours = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)


def _to_stderr(line: str) -> None:
    print(f"ncclwatch: {line}", file=sys.stderr, flush=True)


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
    if settings.upload is not None:
        try:
            tokens = settings.upload_tokens()  # the settings checked there is one; its file may be gone since
        except ConfigError as exc:
            log.error("bundles are not uploaded to %s: %s", settings.upload, exc)
            return sinks
        keep_s = settings.upload_spool_days * 86400
        sinks.append(UploadSink(session, settings.upload, tokens[0], settings.bundle_dir, keep_s=keep_s))
    return sinks
