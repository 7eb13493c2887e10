"""``ncclwatch serve`` as the cluster's bundle server: uploads, incidents across jobs, the hosts they name.

Routes, added to ``app.make_app``'s (``install``):

  POST /api/upload             a bundle (tar.gz body), with the upload token (``intake.py``): 201 stored,
                               200 the same bytes were there; 400 not a bundle, 401, 413 too large, 429 slow down
  /api/incidents               JSON, newest first; ?job= ?host= ?verdict= ?since= ?until= (ISO 8601) ?limit=
  /api/incidents/{key}         one incident: its parts (each node's bundle) and the hosts it names
  /api/hosts                   per host named in the last 30 days: incidents over 7 and 30 days by verdict and
                               role (culprit, lost_node, slow_link), jobs, the last (``last_at``, ISO 8601 UTC;
                               ``last_at_unix``); repeat hosts first; ?host=, ?limit= (default the first 200)
  /incidents, /incidents/{key}, /hosts, /hosts/{host}   the same as pages (``cluster_page.py``)
  /metrics                     also ``ncclwatch_host_incidents_total{host,verdict}``

The index (``incidents.py``) is SQLite; every query runs in a thread, never on the event loop.  After an
upload, each host it names is checked against ``--on-repeat`` (``repeat.py``) in the background: the
answer does not wait for a command.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from ncclwatch.watchdog.server.app import BUNDLES, html_response, iso
from ncclwatch.watchdog.server.auth import UPLOAD_PATH
from ncclwatch.watchdog.server.cluster_page import host_body, hosts_body, incident_body, incidents_body
from ncclwatch.watchdog.server.incidents import HOST_RE, HOSTS_SHOWN, IncidentIndex, epoch
from ncclwatch.watchdog.server.intake import KEY_RE, SLURM_RE, Intake, Refused, which_token
from ncclwatch.watchdog.server.page import esc, page_html
from ncclwatch.watchdog.server.repeat import Repeat

log = logging.getLogger("ncclwatch.server")

INTAKE = web.AppKey("intake", Intake)
REPEAT = web.AppKey("repeat", object)  # Repeat | None
TASKS = web.AppKey("tasks", set)


def install(app: web.Application, intake: Intake, repeat: Repeat | None = None) -> None:
    app[INTAKE] = intake
    app[REPEAT] = repeat
    app[TASKS] = set()
    app.router.add_post(UPLOAD_PATH, upload)
    app.router.add_get("/api/incidents", incidents_json)
    app.router.add_get("/api/incidents/{key}", incident_json)
    app.router.add_get("/api/hosts", hosts_json)
    app.router.add_get("/incidents", incidents_page)
    app.router.add_get("/incidents/{key}", incident_page)
    app.router.add_get("/hosts", hosts_page)
    app.router.add_get("/hosts/{host}", host_page)


class HostIncidentsCollector:
    """``ncclwatch_host_incidents_total{host,verdict}``: incidents that named the host, since the index began.

    Read from the index's in-memory counts (no query at scrape time); retention never lowers them.
    """

    def __init__(self, index: IncidentIndex) -> None:
        self.index = index

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "ncclwatch_host_incidents",
            "incidents whose bundles named the host (culprit, lost node, slow link), by the incident's verdict",
            labels=["host", "verdict"],
        )
        for (host, verdict), total in sorted(dict(self.index.totals).items()):
            family.add_metric([host, verdict], total)
        yield family


# -- upload ----------------------------------------------------------------------------------------------------------


def _refusal(exc: Refused) -> web.Response:
    headers = {"Retry-After": f"{exc.retry_after_s:.0f}"} if exc.retry_after_s is not None else None
    if exc.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": 'Bearer realm="ncclwatch upload"'}
    return web.json_response({"error": exc.message}, status=exc.status, headers=headers)


async def upload(request: web.Request) -> web.Response:
    intake = request.app[INTAKE]
    try:
        who = _uploader(request, intake)
        key = _header(request, "X-Ncclwatch-Incident", KEY_RE)
        slurm = _header(request, "X-Ncclwatch-Slurm-Job", SLURM_RE)
        if request.content_length is not None and request.content_length > intake.max_bytes:
            raise Refused(413, f"not stored: {request.content_length} bytes, over the limit of {intake.max_bytes}")
        wait = intake.rate.take(who)
        if wait is not None:
            raise Refused(429, f"too many uploads with this token; retry in {wait:.0f} s", retry_after_s=wait + 1)
        received = await _receive(request, intake)
        recorded, bundle_id, new = await asyncio.to_thread(intake.store, received, key, slurm)
    except Refused as exc:
        log.warning("upload from %s refused (%s): %s", request.remote, exc.status, exc.message)
        return _refusal(exc)
    repeat = request.app[REPEAT]
    if repeat is not None and recorded.hosts:
        task = asyncio.create_task(repeat.check(sorted(recorded.hosts)))  # type: ignore[attr-defined]
        request.app[TASKS].add(task)
        task.add_done_callback(request.app[TASKS].discard)
    body = {
        "incident": recorded.incident_key,
        "bundle": bundle_id,
        "url": f"/incidents/{recorded.incident_key}",
        "new_incident": recorded.new_incident,
        "stored": new,
    }
    return web.json_response(body, status=201 if new else 200)


def _uploader(request: web.Request, intake: Intake) -> int:
    if not intake.tokens:
        raise Refused(401, "this server takes no uploads: no upload token configured (NCCLWATCH_UPLOAD_TOKEN)")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    who = which_token(given.strip(), intake.tokens) if scheme.lower() == "bearer" else None
    if who is None:
        raise Refused(401, "an upload token is required" if not given else "wrong upload token")
    return who


def _header(request: web.Request, name: str, pattern: Any) -> str | None:
    value = request.headers.get(name)
    if value is not None and not pattern.fullmatch(value):
        raise Refused(400, f"{name}: {value[:80]!r} is not of the form {pattern.pattern}")
    return value


async def _receive(request: web.Request, intake: Intake) -> Path:
    """The body into a dot-file of the incoming folder, refused past ``max_bytes`` whatever Content-Length said."""
    folder = await asyncio.to_thread(intake.incoming)
    path = folder / f"{secrets.token_hex(8)}.upload"
    handle = await asyncio.to_thread(path.open, "wb")
    total = 0
    try:
        async for chunk in request.content.iter_chunked(1 << 20):
            total += len(chunk)
            if total > intake.max_bytes:
                raise Refused(413, f"not stored: over the limit of {intake.max_bytes} bytes")
            await asyncio.to_thread(handle.write, chunk)
    except BaseException:
        handle.close()
        path.unlink(missing_ok=True)
        raise
    handle.close()
    return path


# -- reading ---------------------------------------------------------------------------------------------------------


def _filters(request: web.Request) -> dict[str, Any]:
    query = request.query
    found: dict[str, Any] = {k: query[k] or None for k in ("job", "host", "verdict") if k in query}
    for name in ("since", "until"):
        if query.get(name):
            at = epoch(query[name])
            if at is None:
                raise web.HTTPBadRequest(text=f"{name}: expected an ISO 8601 time or date, got {query[name]!r}")
            found[name] = at
    if query.get("limit"):
        if not query["limit"].isdigit():
            raise web.HTTPBadRequest(text=f"limit: expected a number, got {query['limit']!r}")
        found["limit"] = int(query["limit"])
    return found


async def incidents_json(request: web.Request) -> web.Response:
    rows = await asyncio.to_thread(request.app[INTAKE].index.incidents, **_filters(request))
    return web.json_response(rows)


async def incident_json(request: web.Request) -> web.Response:
    found = await asyncio.to_thread(request.app[INTAKE].index.incident, request.match_info["key"])
    if found is None:
        return web.json_response({"error": f"no incident {request.match_info['key']!r}"}, status=404)
    return web.json_response(found)


def _hosts_limit(request: web.Request) -> int:
    given = request.query.get("limit", "")
    if given and not given.isdigit():
        raise web.HTTPBadRequest(text=f"limit: expected a number, got {given!r}")
    return int(given) if given else HOSTS_SHOWN


async def hosts_json(request: web.Request) -> web.Response:
    host = request.query.get("host") or None
    index = request.app[INTAKE].index
    rows = await asyncio.to_thread(index.hosts, None, host, _hosts_limit(request))
    return web.json_response([hosts_entry_json(row) for row in rows])


def hosts_entry_json(row: dict[str, Any]) -> dict[str, Any]:
    """A host's entry as ``/api/hosts`` gives it: times in ISO 8601 UTC (as a report's), each also as Unix seconds
    under ``<name>_unix`` for tools that compute with them.  The index, and the hosts page, keep the seconds."""
    entry = {**row, "last_at": _iso_or_none(row["last_at"]), "last_at_unix": row["last_at"]}
    entry["actions"] = [{**a, "at": _iso_or_none(a["at"]), "at_unix": a["at"]} for a in row["actions"]]
    return entry


def _iso_or_none(at: float | None) -> str | None:
    return None if at is None else iso(at)


async def incidents_page(request: web.Request) -> web.Response:
    filters = _filters(request)
    rows = await asyncio.to_thread(request.app[INTAKE].index.incidents, **filters)
    return html_response(page_html("ncclwatch incidents", incidents_body(rows, dict(request.query))))


async def incident_page(request: web.Request) -> web.Response:
    key = request.match_info["key"]
    found = await asyncio.to_thread(request.app[INTAKE].index.incident, key)
    if found is None:
        body = f"<h1>404: no incident {esc(key)}</h1><p><a href='/incidents'>all incidents</a></p>"
        return html_response(page_html("ncclwatch: 404", body), 404)
    bundles = request.app[BUNDLES]
    shown: tuple[str, dict[str, Any], list[tuple[str, int]]] | None = None
    for part in found["parts"]:  # the first readable report of the incident's parts is shown
        path = bundles.path_of(part["bundle_id"])
        if path is not None:
            try:
                report, files = await asyncio.to_thread(bundles.detail, path)
            except Exception:  # noqa: BLE001 - an unreadable part: the next one, and its download stays
                continue
            shown = (part["bundle_id"], report, files)
            break
    return html_response(page_html(f"ncclwatch: incident {key}", incident_body(found, shown)))


async def hosts_page(request: web.Request) -> web.Response:
    rows = await asyncio.to_thread(request.app[INTAKE].index.hosts, None, None, _hosts_limit(request))
    return html_response(page_html("ncclwatch hosts", hosts_body(rows)))


async def host_page(request: web.Request) -> web.Response:
    host = request.match_info["host"]
    if not HOST_RE.fullmatch(host):
        return html_response(page_html("ncclwatch: 404", f"<h1>404: no host {esc(host)}</h1>"), 404)
    index = request.app[INTAKE].index
    entry = await asyncio.to_thread(index.hosts, None, host)
    rows = await asyncio.to_thread(index.incidents, host=host, limit=200)
    return html_response(page_html(f"ncclwatch: host {host}", host_body(host, entry[0] if entry else None, rows)))
