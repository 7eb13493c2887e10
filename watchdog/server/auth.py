"""Who may read bundles: the bearer token, the page's session cookie, and keeping the token out of logs.

A bundle holds stack traces, environments and command lines, so the API and
the page are never served without a token: with none configured they answer
401 saying how to set one.  With one, a request needs ``Authorization: Bearer
<token>`` (compared in constant time) or the page cookie.  A browser opens the
page once as ``/?token=<token>``: the answer is a 303 to the same path on this
server without the token (never to another origin: ``//host/`` and ``/\\host``
are folded to a local path), setting an HttpOnly, SameSite=Strict cookie
``<expiry>.<HMAC of the token and the expiry>``: never the token, and refused
after ``COOKIE_MAX_AGE_S`` whatever the browser keeps; rotating the token ends
every session.

Failure mode guarded: aiohttp logs a request it cannot parse (a request line
over 8190 bytes) with the line itself, token included.  ``RedactTokens`` is
installed on aiohttp's loggers and rewrites ``token=...`` and ``Bearer ...``
in every record, traceback included, before any handler formats it.

Uploads (``POST /api/upload``) pass to their handler, which takes the upload token only: the read token
cannot upload, and the upload token reads nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ncclwatch.watchdog.server.page import esc, page_html

COOKIE = "ncclwatch_session"
UPLOAD_PATH = "/api/upload"
COOKIE_MAX_AGE_S = 12 * 3600
NO_TOKEN = (
    "ncclwatch serves no bundles without a token: bundles hold stack traces and environments. "
    "Set one: NCCLWATCH_API_TOKEN=<secret>, or --token-file FILE (its first line), and restart."
)
HOW = "send 'Authorization: Bearer <token>'; in a browser, open /?token=<token> once (it sets a cookie)"
_SECRETS = re.compile(r"(token=|Bearer\s+)[^\s&'\"\\)]+", re.IGNORECASE)
_AIOHTTP_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal", "ncclwatch.access")


@dataclasses.dataclass(frozen=True)
class Auth:
    token: str | None
    metrics_open: bool
    clock: Callable[[], float] = time.time

    def cookie(self) -> str:
        """A fresh session value: its expiry and an HMAC binding the expiry to the token."""
        expires = int(self.clock()) + COOKIE_MAX_AGE_S
        return f"{expires}.{self._mac(expires)}"

    def _mac(self, expires: int) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), f"ncclwatch page cookie v2|{expires}".encode(), hashlib.sha256).hexdigest()

    def cookie_valid(self, value: str) -> bool:
        stamp, _, mac = value.partition(".")
        if self.token is None or not stamp.isdigit() or int(stamp) <= self.clock():
            return False
        return hmac.compare_digest(mac.encode(), self._mac(int(stamp)).encode())

    def matches(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def admits(self, request: web.Request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.matches(given.strip()):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and self.cookie_valid(cookie)


AUTH = web.AppKey("auth", Auth)


def is_page(request: web.Request) -> bool:
    return not request.path.startswith("/api/") and request.path != "/metrics"


def local_target(request: web.Request) -> str:
    """The address without ``token``, as a path on this server: ``//evil.example/`` becomes ``/evil.example/``."""
    url = request.rel_url.without_query_params("token")
    path = "/" + url.raw_path.lstrip("/\\")
    return path + (f"?{url.raw_query_string}" if url.raw_query_string else "")


@web.middleware
async def require_token(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """/healthz and open /metrics pass; the page trades ?token= for a cookie; the rest needs the token."""
    auth = request.app[AUTH]
    if request.path == "/healthz" or (request.path == "/metrics" and auth.metrics_open):
        return await handler(request)
    if request.path == UPLOAD_PATH and request.method == "POST":  # its own, write-only token (server/intake.py)
        return await handler(request)
    if auth.token is None:
        return refuse(request, NO_TOKEN, form=False)
    if is_page(request) and "token" in request.query:
        if not auth.matches(request.query["token"]):
            return refuse(request, "wrong token", form=True)
        # Trade the token in the address (history, logs) for a cookie, and show the address without it.
        response = web.Response(status=303, headers={"Location": local_target(request)})
        response.set_cookie(
            COOKIE,
            auth.cookie(),
            max_age=COOKIE_MAX_AGE_S,
            httponly=True,
            samesite="Strict",
            path="/",
            secure=request.secure,
        )
        return response
    if auth.admits(request):
        return await handler(request)
    return refuse(
        request, "a token is required" if "Authorization" not in request.headers else "wrong token", form=True
    )


def refuse(request: web.Request, message: str, *, form: bool) -> web.Response:
    """401: JSON for the API and /metrics, a page (with a token form, when a token is configured) for the rest."""
    headers = {"WWW-Authenticate": 'Bearer realm="ncclwatch"'}
    if not is_page(request):
        return web.json_response({"error": message, "how": HOW if form else NO_TOKEN}, status=401, headers=headers)
    body = f"<h1>401: {esc(message)}</h1><p>{esc(HOW if form else NO_TOKEN)}</p>"
    if form:  # a GET form back to this address: keeps its other parameters (?bundle=), adds token=
        kept = "".join(
            f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">' for k, v in request.query.items() if k != "token"
        )
        body += (
            f'<form class="token" method="get" action="{esc(local_target(request).partition("?")[0])}">{kept}'
            '<input type="password" name="token" placeholder="API token" autocomplete="current-password" required>'
            '<button type="submit">Open</button></form>'
        )
    return web.Response(text=page_html("ncclwatch: 401", body), content_type="text/html", status=401, headers=headers)


def redact(text: str) -> str:
    return _SECRETS.sub(r"\1<redacted>", text)


class RedactTokens(logging.Filter):
    """Rewrites a record's message and traceback with tokens redacted (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        record.msg, record.args = redact(message), None
        return True


def install_log_redaction() -> None:
    """Once per process: every aiohttp logger (and ours) redacts tokens."""
    for name in _AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
