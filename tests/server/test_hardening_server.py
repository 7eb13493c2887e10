"""The bundle server under odd reports and hostile clients (issue 13): no 500, no token in a log,
no open redirect, no idle connection kept, no session that never ends.  Real servers on loopback.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import tarfile
import time
from pathlib import Path

import pytest
from test_server import TOKEN, Live

from ncclwatch.watchdog.server import app as app_module
from ncclwatch.watchdog.server.app import COOKIE, make_app
from ncclwatch.watchdog.server.auth import COOKIE_MAX_AGE_S, Auth

ODD_ID = "odd-20261123T120000Z-rank_behind"
ODD_REPORT = {
    "verdict": "rank_behind",
    "culprit_ranks": 5,
    "summary": "rank 2 never entered all_reduce #7",
    "analyzed_at": "2026-11-23T12:00:00+00:00",
    "job": "odd",
    "ranks": [{"rank": 0, "status": "waiting"}, {"rank": "two", "status": 3}],
    "timeline": [
        {"rank": 0, "first_position": 5, "ops": 12},
        {"rank": 1, "first_position": 5, "ops": ["AllReduce 4 f32"]},
    ],
    "evidence": [{"source": "nccl", "fact": "rank 2 issued 6"}, "not a dict"],
    "evidence_files": [{"name": "stacks", "paths": [7, None, "stacks/rank0.json"]}],
    "missing": "everything",
    "position": "seven",
}


def write_bundle(folder: Path, bundle_id: str, report: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report).encode()
    with tarfile.open(folder / f"{bundle_id}.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(f"{bundle_id}/report.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def live(tmp_path: Path):
    write_bundle(tmp_path, ODD_ID, ODD_REPORT)
    server = Live(make_app(tmp_path, token=TOKEN))
    yield server
    server.close()


class TestOddReports:
    def test_odd_field_types_render_what_they_can_and_never_500(self, live):
        page = live.get(f"/bundles/{ODD_ID}", token=TOKEN)
        assert page.status == 200
        assert "rank 2 never entered all_reduce #7" in page.text and "AllReduce" in page.text
        assert "stacks/rank0.json" in page.text and "malformed in report.json" in page.text
        assert "culprit_ranks" in page.text  # named among what was left out

    def test_the_listing_and_the_raw_report_still_answer(self, live):
        [row] = live.get("/api/bundles", token=TOKEN).json()
        assert row["culprit_ranks"] == [] and row["verdict"] == "rank_behind" and row["error"] is None
        assert live.get("/", token=TOKEN).status == 200
        assert live.get(f"/api/bundles/{ODD_ID}/report", token=TOKEN).json()["culprit_ranks"] == 5  # the file, as is

    @pytest.mark.parametrize("report", [{}, {"verdict": 3, "summary": ["x"], "timeline": "no"}, {"ranks": [[1]]}])
    def test_reports_missing_or_mistyped_everywhere_still_render(self, report, tmp_path: Path):
        write_bundle(tmp_path, "x-20261123T120000Z-unknown", report)
        server = Live(make_app(tmp_path, token=TOKEN))
        try:
            assert server.get("/bundles/x-20261123T120000Z-unknown", token=TOKEN).status == 200
            assert server.get("/", token=TOKEN).status == 200
        finally:
            server.close()


class TestTokensNeverLogged:
    def test_an_over_long_request_line_is_logged_without_its_token(self, live, caplog):
        host, port = live.bound.rsplit(":", 1)
        with caplog.at_level(logging.DEBUG), socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET /?token=" + TOKEN.encode() + b"&pad=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.")
        time.sleep(0.2)  # the server thread logs after answering
        logged = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
        assert "8190" in logged  # the error path did log
        assert TOKEN not in logged


class TestRedirect:
    @pytest.mark.parametrize(
        "path", ["//evil.example/", "///evil.example/", "/\\evil.example/", "/%2F%2Fevil.example/"]
    )
    def test_the_token_trade_redirects_only_to_a_path_here(self, live, path):
        reply = live.get(f"{path}?token={TOKEN}&bundle=b", raw=True)
        assert reply.status == 303
        location = reply.headers["Location"]
        assert location.startswith("/") and not location.startswith(("//", "/\\")) and TOKEN not in location
        assert location.endswith("?bundle=b")

    def test_the_token_form_posts_to_a_path_here(self, live):
        reply = live.get("//evil.example/?token=wrong", raw=True)
        assert reply.status == 401 and 'action="/evil.example/"' in reply.text


def closed_by_server(sock: socket.socket) -> bool:
    try:
        while data := sock.recv(4096):  # what is left of an answer, then the end
            assert data.startswith(b"HTTP/1.1")
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class TestIdleConnections:
    def test_half_open_and_idle_connections_are_closed(self, tmp_path: Path, monkeypatch):
        monkeypatch.setattr(app_module, "IDLE_TIMEOUT_S", 1.0)
        server = Live(make_app(tmp_path, token=TOKEN))
        host, port = server.bound.rsplit(":", 1)
        try:
            idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
            partial = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
            for sock in partial:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            kept = socket.create_connection((host, int(port)), timeout=5)
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then kept alive
            time.sleep(3)
            for sock in [*idle, *partial, kept]:
                sock.settimeout(0.5)
                assert closed_by_server(sock)
                sock.close()
        finally:
            server.close()


class TestSessionCookie:
    def test_the_cookie_expires_whatever_the_browser_keeps(self):
        now = [1_800_000_000.0]
        auth = Auth(token=TOKEN, metrics_open=True, clock=lambda: now[0])
        cookie = auth.cookie()
        assert auth.cookie_valid(cookie) and TOKEN not in cookie
        now[0] += COOKIE_MAX_AGE_S + 1
        assert not auth.cookie_valid(cookie)

    def test_a_moved_expiry_or_another_token_is_refused(self):
        auth = Auth(token=TOKEN, metrics_open=True)
        stamp, _, mac = auth.cookie().partition(".")
        assert not auth.cookie_valid(f"{int(stamp) + 10 * COOKIE_MAX_AGE_S}.{mac}")
        assert not Auth(token="rotated", metrics_open=True).cookie_valid(f"{stamp}.{mac}")

    def test_an_expired_cookie_is_401_over_http(self, live):
        old = Auth(token=TOKEN, metrics_open=True, clock=lambda: time.time() - COOKIE_MAX_AGE_S - 60).cookie()
        assert live.get("/", headers={"Cookie": f"{COOKIE}={old}"}).status == 401
        fresh = live.get(f"/?token={TOKEN}").cookie()
        assert live.get("/", headers={"Cookie": f"{COOKIE}={fresh.value}"}).status == 200
