"""The bundle server: API, page and /metrics, for ``ncclwatch serve`` and each node's sidecar.

Routes (GET, and HEAD):

  /api/bundles               JSON list, newest first: id, job, verdict, culprit_ranks, created, size, error
  /api/bundles/{id}          the bundle's tar.gz, as an attachment
  /api/bundles/{id}/report   its report.json
  /, /?bundle={id}           the page: every bundle; one bundle's report with its timeline picture
  /bundles/{id}              the same report page
  /metrics                   Prometheus text exposition of the injected registry
  /healthz                   200 "ok", or JSON {"status": "ok", "health": health()} when given

Auth (``auth.py``).  The API and the page need the bearer token, or the
cookie a browser gets for ``/?token=<token>`` (an expiring HMAC, 12 hours);
with no token configured they answer 401.  /healthz is open.  /metrics carries ranks, pids, hosts, steps, verdicts and
timings but no evidence (no stacks, environments or logs); it is open unless
``metrics_open=False`` (``ncclwatch serve --metrics-token``).

Ids are bundle file names without ``.tar.gz``: ``[A-Za-z0-9][A-Za-z0-9_.-]{0,200}``,
never ``*.partial``, and the file (links followed) must lie inside the bundle
folder.  Anything else is 404: no spelling reaches a file outside.

Errors.  A bad bundle never becomes a 500: ``BundleError`` (cannot read the
archive or its report.json) lists the bundle with ``verdict: null`` and an
``error``; its report answers 422.  A readable report.json with odd field
types is validated with the report's model (``view.report_view``) before the
page or the listing touch it: what does not fit is left out and named.

Connections.  An idle connection (none of a request's bytes arriving, or
nothing after an answer) is closed after ``IDLE_TIMEOUT_S``, so half-open
clients cannot pile up; requests the server cannot parse are logged with
tokens redacted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import tarfile
import threading
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ncclwatch.watchdog.server.auth import AUTH, COOKIE, Auth, install_log_redaction, require_token
from ncclwatch.watchdog.server.page import esc, listing_body, page_html, report_body
from ncclwatch.watchdog.server.view import report_view

log = logging.getLogger("ncclwatch.server")

SUFFIX = ".tar.gz"
# fullmatch, not "$": "$" also matches before a trailing newline.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}")
NAME_RE = re.compile(r"(?P<job>.+)-(?P<stamp>\d{8}T\d{6}Z)-(?P<verdict>[a-z_]+)")  # bundle.bundle_name
REPORT_MAX_BYTES = 32 << 20
FILES_MAX = 2000
CHUNK = 256 << 10
IDLE_TIMEOUT_S = 15.0  # a connection with no request under way is closed after this
__all__ = ["COOKIE", "BundleError", "BundleIndex", "BundleCollector", "make_app", "start_server", "stop_server"]


class BundleError(Exception):
    """A bundle that cannot be read: not gzip, truncated, no report.json, report.json not JSON."""


# -- the bundle folder -----------------------------------------------------------------------------------------------


def read_bundle(path: Path, *, files: bool = False) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """report.json (read from the archive stream, nothing extracted) and, with ``files``, the members.

    Without ``files`` it stops at report.json; the members list needs the whole archive decompressed.
    """
    report: dict[str, Any] | None = None
    members: list[tuple[str, int]] = []
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                inner = "/".join(parts[1:]) if len(parts) > 1 else member.name
                if files and member.isfile() and len(members) < FILES_MAX:
                    members.append((inner, member.size))
                if report is None and inner == "report.json" and len(parts) <= 2:
                    report = _report_of(tar, member)
                    if not files:
                        break
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:  # ValueError: JSON, UTF-8
        raise BundleError(f"cannot read the bundle: {exc}") from None
    if report is None:
        raise BundleError("no report.json in the bundle")
    return report, members


def _report_of(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict[str, Any]:
    if not member.isfile() or member.size > REPORT_MAX_BYTES:
        raise BundleError(f"report.json is not a regular file under {REPORT_MAX_BYTES} bytes")
    stream = tar.extractfile(member)
    report = json.loads(stream.read()) if stream is not None else None
    if not isinstance(report, dict):
        raise BundleError("report.json is not a JSON object")
    return report


def iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="seconds")


class BundleIndex:
    """The bundles in a folder and each one's summary, cached by (mtime, size) so a listing reads new ones only.

    Blocking (stat, gunzip): call from a thread.  Dot-files (a bundle being written is
    ``.<name>.tar.gz.partial``), other names and links leading outside the folder are not bundles.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._summaries: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
        self._details: OrderedDict[tuple[str, int, int], tuple[dict[str, Any], list[tuple[str, int]]]] = OrderedDict()

    def path_of(self, bundle_id: str) -> Path | None:
        """The bundle's real file, or None: a bad id, a partial, no such file, or one (a link) outside the folder."""
        if not ID_RE.fullmatch(bundle_id) or bundle_id.endswith(".partial"):
            return None
        root = Path(os.path.realpath(self.folder))
        real = Path(os.path.realpath(root / (bundle_id + SUFFIX)))
        if real == root or not real.is_relative_to(root) or not real.is_file():
            return None
        return real

    def entries(self) -> Iterator[tuple[str, os.stat_result]]:
        """(id, stat) of each bundle, in no order."""
        try:
            names = os.listdir(self.folder)
        except OSError:  # no folder yet: no bundles yet
            return
        for name in names:
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            bundle_id = name.removesuffix(SUFFIX)
            path = self.path_of(bundle_id)
            try:
                if path is not None:
                    yield bundle_id, path.stat()
            except OSError:  # removed meanwhile
                continue

    def listing(self) -> list[dict[str, Any]]:
        found = sorted(self.entries(), key=lambda e: (e[1].st_mtime, e[0]), reverse=True)
        rows = [self._summary(bundle_id, st) for bundle_id, st in found]
        with self._lock:
            for gone in set(self._summaries) - {bundle_id for bundle_id, _ in found}:
                del self._summaries[gone]
        return rows

    def _summary(self, bundle_id: str, st: os.stat_result) -> dict[str, Any]:
        key = (st.st_mtime_ns, st.st_size)
        with self._lock:
            cached = self._summaries.get(bundle_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        named = NAME_RE.fullmatch(bundle_id)
        row: dict[str, Any] = {
            "id": bundle_id,
            "job": named["job"] if named else None,
            "verdict": None,
            "culprit_ranks": [],
            "created": iso(st.st_mtime),
            "size": st.st_size,
            "summary": None,
            "host": None,
            "detected_at": None,
            "error": None,
        }
        path = self.path_of(bundle_id)
        try:
            report, _ = read_bundle(path) if path is not None else ({}, [])
        except BundleError as exc:
            row["error"] = str(exc)
        else:
            report = report_view(report)
            row.update(
                job=report["job"] or row["job"],
                verdict=report["verdict"],
                summary=report["summary"],
                culprit_ranks=report["culprit_ranks"],
                host=report["host"],
                detected_at=report["detected_at"] or report["analyzed_at"],
            )
        with self._lock:
            self._summaries[bundle_id] = (key, row)
        return row

    def detail(self, path: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
        """Report (as ``report_view`` makes it) and member list for the page.

        The last few are kept. Raises BundleError.
        """
        st = path.stat()
        key = (path.name, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key in self._details:
                self._details.move_to_end(key)
                return self._details[key]
        report, members = read_bundle(path, files=True)
        found = (report_view(report), members)
        with self._lock:
            self._details[key] = found
            while len(self._details) > 8:
                self._details.popitem(last=False)
        return found


class BundleCollector:
    """``ncclwatch_bundles{verdict}``: bundles in the folder, by the verdict their file name ends with.

    Names only (no archive is opened), so a scrape costs one directory listing.
    """

    def __init__(self, index: BundleIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("ncclwatch_bundles", "root-cause bundles in the bundle folder", labels=["verdict"])
        counts = Counter(
            (m["verdict"] if (m := NAME_RE.fullmatch(bundle_id)) else "unknown")
            for bundle_id, _ in self.index.entries()
        )
        for verdict, count in sorted(counts.items()):
            family.add_metric([verdict], count)
        yield family


# -- auth (auth.py) and safety headers ------------------------------------------------------------------------------


BUNDLES = web.AppKey("bundles", BundleIndex)
REGISTRY = web.AppKey("registry", CollectorRegistry)
HEALTH = web.AppKey("health", object)  # Callable[[], object] | None

HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The page is HTML and CSS only: no script runs, nothing loads from elsewhere.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
}


async def safety_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every answer, errors and streamed downloads included (a middleware is too late for a prepared stream)."""
    response.headers.update(HEADERS)
    if request.path not in ("/metrics", "/healthz"):
        response.headers.setdefault("Cache-Control", "no-store")


# -- the app ----------------------------------------------------------------------------------------------------------


def make_app(
    bundle_dir: Path,
    *,
    token: str | None,
    registry: CollectorRegistry | None = None,
    health: Callable[[], object] | None = None,
    metrics_open: bool = True,
) -> web.Application:
    """The server's app.  ``token`` None: the API and page refuse (401); /healthz and open /metrics still answer."""
    app = web.Application(middlewares=[require_token])
    app.on_response_prepare.append(safety_headers)
    app[BUNDLES] = BundleIndex(bundle_dir)
    app[AUTH] = Auth(token=token or None, metrics_open=metrics_open)
    app[REGISTRY] = registry if registry is not None else CollectorRegistry(auto_describe=False)
    app[HEALTH] = health
    app.router.add_get("/api/bundles", list_bundles)
    app.router.add_get("/api/bundles/{id}", download)
    app.router.add_get("/api/bundles/{id}/report", report_json)
    app.router.add_get("/", index_page)
    app.router.add_get("/bundles/{id}", bundle_page)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


def _not_found(bundle_id: str) -> web.Response:
    return web.json_response({"error": f"no bundle {bundle_id!r}"}, status=404)


async def list_bundles(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(request.app[BUNDLES].listing))


async def download(request: web.Request) -> web.StreamResponse:
    """The tar.gz as stored.  Not FileResponse: it serves ``<name>.gz``/``.br`` siblings when they exist."""
    bundle_id = request.match_info["id"]
    path = request.app[BUNDLES].path_of(bundle_id)
    if path is None:
        return _not_found(bundle_id)
    try:
        file = await asyncio.to_thread(path.open, "rb")
    except OSError:  # removed since
        return _not_found(bundle_id)
    try:
        size = os.fstat(file.fileno()).st_size
        headers = {"Content-Type": "application/gzip", "Content-Disposition": f'attachment; filename="{path.name}"'}
        response = web.StreamResponse(headers=headers)
        response.content_length = size
        await response.prepare(request)
        if request.method != "HEAD":
            while chunk := await asyncio.to_thread(file.read, CHUNK):
                await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        file.close()


async def report_json(request: web.Request) -> web.Response:
    index = request.app[BUNDLES]
    path = index.path_of(request.match_info["id"])
    if path is None:
        return _not_found(request.match_info["id"])
    try:
        report, _ = await asyncio.to_thread(read_bundle, path)
    except BundleError as exc:
        return web.json_response({"error": str(exc)}, status=422)
    return web.json_response(report)


async def metrics(request: web.Request) -> web.Response:
    # In the loop thread on purpose: collectors read the sidecar's live state, which only this thread changes.
    try:
        body = generate_latest(request.app[REGISTRY])
    except Exception as exc:  # noqa: BLE001 - a broken collector: the scrape fails visibly, the server stays up
        log.warning("metrics: %s", exc)
        return web.Response(status=503, text=f"metrics collection failed: {exc}\n")
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


async def healthz(request: web.Request) -> web.Response:
    health = request.app[HEALTH]
    if health is None:
        return web.Response(text="ok\n")
    try:
        state = plain(health())  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - health() reads live state; say so rather than drop the connection
        return web.json_response({"status": "error", "error": str(exc)}, status=503)
    return web.json_response({"status": "ok", "health": state}, dumps=lambda o: json.dumps(o, default=str))


# -- the page ---------------------------------------------------------------------------------------------------------


def html_response(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, content_type="text/html", status=status)


async def index_page(request: web.Request) -> web.Response:
    if "bundle" in request.query:
        return await _report_page(request, request.query["bundle"])
    index = request.app[BUNDLES]
    rows = await asyncio.to_thread(index.listing)
    return html_response(page_html("ncclwatch bundles", listing_body(rows), where=str(index.folder)))


async def bundle_page(request: web.Request) -> web.Response:
    return await _report_page(request, request.match_info["id"])


async def _report_page(request: web.Request, bundle_id: str) -> web.Response:
    index = request.app[BUNDLES]
    path = index.path_of(bundle_id)
    if path is None:
        return html_response(
            page_html("ncclwatch: 404", f"<h1>404: no bundle {esc(bundle_id)}</h1><p><a href='/'>all bundles</a></p>"),
            404,
        )
    try:
        report, files = await asyncio.to_thread(index.detail, path)
    except (BundleError, OSError) as exc:
        body = (
            f"<h1>{esc(bundle_id)}</h1><p class='error'>{esc(exc)}</p>"
            f"<p><a href='/api/bundles/{esc(bundle_id)}'>download it</a></p>"
        )
        return html_response(page_html("ncclwatch: unreadable bundle", body), 422)
    title = f"ncclwatch: {report.get('verdict')} {bundle_id}"
    try:
        body = report_body(bundle_id, report, files)
    except Exception:  # a page bug must not hide the bundle: say so, keep the download
        log.exception("page for %s could not be rendered", bundle_id)
        body = (
            f"<h1>{esc(bundle_id)}</h1><p class='error'>this report could not be rendered</p>"
            f"<p><a href='/api/bundles/{esc(bundle_id)}'>download it</a></p>"
        )
    return html_response(page_html(title, body, where=str(index.folder)))


# -- running it -------------------------------------------------------------------------------------------------------


class AccessLogger(AbstractAccessLogger):
    """Method, path, status, size, time.  Never the query string: the page's first visit carries ?token=."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %s %s %.3fs",
            request.remote,
            request.method,
            request.path,
            response.status,
            response.body_length,
            time,
        )


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen: expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


async def start_server(
    app: web.Application, listen: str, *, idle_timeout_s: float | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``listen`` ("HOST:PORT", port 0 picks one); return the runner and the bound "host:port"."""
    host, port = split_listen(listen)
    idle_timeout_s = IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
    install_log_redaction()
    # keepalive_timeout also runs from the connection's start (aiohttp >= 3.10): a client that opens a
    # connection and never finishes a request is closed then, not kept for aiohttp's default hour.
    runner = web.AppRunner(
        app,
        access_log_class=AccessLogger,
        access_log=logging.getLogger("ncclwatch.access"),
        shutdown_timeout=3.0,
        handle_signals=False,
        keepalive_timeout=idle_timeout_s,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, (f"[{bound_host}]" if ":" in bound_host else bound_host) + f":{bound_port}"


async def stop_server(runner: web.AppRunner, timeout_s: float = 10.0) -> None:
    """Stop listening, let requests in flight finish (3 s), close the rest; bounded by ``timeout_s``."""
    try:
        await asyncio.wait_for(runner.cleanup(), timeout_s)
    except TimeoutError:
        log.warning("server: shutdown took over %.0f s; connections dropped", timeout_s)
