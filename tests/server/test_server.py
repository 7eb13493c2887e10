"""The bundle server over real HTTP: the app on 127.0.0.1, real aiohttp clients, real bundles.

Bundles are made the way the sidecar makes them: a report (here from
``analyze_paths`` on the 4xH200 ``skip`` capture: rank 3 skipped the step's
collectives), report.md, evidence files, one top folder, packed under a
dot-name and renamed.
"""

from __future__ import annotations

import asyncio
import functools
import http.cookies
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yarl
from conftest import CAPTURES, REPO
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.report import EvidenceFile, Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.bundle import report_markdown
from ncclwatch.watchdog.live.health import Health, RankHealth
from ncclwatch.watchdog.server.app import COOKIE, BundleIndex, make_app, start_server, stop_server

SKIP = CAPTURES / "nccl-2.28.9-h200x4" / "skip"
TOKEN = "s3cret-token-for-tests"
BUNDLE = "h200x4-skip-20261121T234100Z-collective_mismatch"


@functools.cache
def skip_report() -> Report:
    report = analyze_paths([str(SKIP)])
    assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [3])
    return report


def make_bundle(bundle_dir: Path, name: str = BUNDLE, report: Report | None = None, mtime: float | None = None) -> Path:
    """A bundle in write_bundle's layout, with stacks and Flight Recorder dumps from the capture."""
    report = report or skip_report()
    staging = bundle_dir.parent / f"staging-{name}" / name
    pids = sorted(p.name.split(".")[1] for p in (SKIP / "pyspy").glob("pyspy.*.json"))
    records = []
    for rank, pid in enumerate(pids):
        (staging / "stacks").mkdir(parents=True, exist_ok=True)
        shutil.copy(SKIP / "pyspy" / f"pyspy.{pid}.json", staging / "stacks" / f"rank{rank}.json")
        records.append(EvidenceFile(name="stacks", paths=[f"stacks/rank{rank}.json"], rank=rank, duration_s=0.41))
    shutil.copytree(SKIP / "fr", staging / "fr")
    records.append(EvidenceFile(name="flight_recorder", paths=sorted(f"fr/{p.name}" for p in (SKIP / "fr").iterdir())))
    records.append(EvidenceFile(name="ras", error="no NCCL RAS server on 127.0.0.1:28028", duration_s=0.01))
    report = report.model_copy(
        update={"job": report.job or "h200x4-skip", "host": report.host or "vm", "evidence_files": records}
    )
    (staging / "evidence.json").write_text(json.dumps({"records": [r.model_dump() for r in records]}))
    (staging / "report.json").write_text(report.model_dump_json(indent=2))
    (staging / "report.md").write_text(report_markdown(report))
    bundle_dir.mkdir(parents=True, exist_ok=True)
    final, partial = bundle_dir / f"{name}.tar.gz", bundle_dir / f".{name}.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(staging, arcname=name)
    os.replace(partial, final)
    shutil.rmtree(staging.parent)
    if mtime is not None:
        os.utime(final, (mtime, mtime))
    return final


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def cookie(self) -> http.cookies.Morsel[str] | None:
        jar = http.cookies.SimpleCookie()
        for value in self.headers.getall("Set-Cookie", []):
            jar.load(value)
        return jar.get(COOKIE)


class Live:
    """An app served on 127.0.0.1:0 by start_server in a loop thread; ``get`` is a real aiohttp client request."""

    def __init__(self, app: aiohttp.web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.bound = self.call(start_server(app, "127.0.0.1:0"))
        self.base = f"http://{self.bound}"
        self.session = self.call(self._session())

    @staticmethod
    async def _session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())  # cookies only where a test sends them

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def get(self, path: str, *, token: str | None = None, raw: bool = False, method: str = "GET", **kw: Any) -> Reply:
        headers = dict(kw.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        url = yarl.URL(self.base + path, encoded=True) if raw else self.base + path

        async def go() -> Reply:
            async with self.session.request(method, url, headers=headers, allow_redirects=False, **kw) as response:
                return Reply(response.status, CIMultiDict(response.headers), await response.read())

        return self.call(go())

    def close(self) -> None:
        self.call(self.session.close())
        self.call(stop_server(self.runner))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def bundle_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "bundles"
    make_bundle(folder)
    return folder


@pytest.fixture
def serve():
    servers: list[Live] = []

    def _serve(bundle_dir: Path, **kw: Any) -> Live:
        kw.setdefault("token", TOKEN)
        servers.append(Live(make_app(bundle_dir, **kw)))
        return servers[-1]

    yield _serve
    for server in servers:
        server.close()


class TestAuth:
    def test_without_a_configured_token_the_api_and_page_refuse_and_say_how(self, serve, bundle_dir):
        live = serve(bundle_dir, token=None)
        for path in ("/api/bundles", f"/api/bundles/{BUNDLE}", f"/api/bundles/{BUNDLE}/report"):
            reply = live.get(path, token="anything")
            assert reply.status == 401 and reply.headers["WWW-Authenticate"].startswith("Bearer")
            assert "NCCLWATCH_API_TOKEN" in reply.json()["how"] and "--token-file" in reply.json()["how"]
        for path in ("/", f"/bundles/{BUNDLE}", f"/?bundle={BUNDLE}&token=anything"):
            reply = live.get(path)
            assert reply.status == 401 and reply.headers["Content-Type"].startswith("text/html")
            assert "NCCLWATCH_API_TOKEN" in reply.text and "--token-file" in reply.text and BUNDLE not in reply.text
            assert reply.cookie() is None

    def test_healthz_and_metrics_answer_without_a_configured_token(self, serve, bundle_dir):
        live = serve(bundle_dir, token=None)
        assert (live.get("/healthz").status, live.get("/healthz").text) == (200, "ok\n")
        assert live.get("/metrics").status == 200

    def test_missing_or_wrong_token_is_401_and_the_right_one_passes(self, serve, bundle_dir):
        live = serve(bundle_dir)
        wrong = ["", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), f" {TOKEN}x", "Bearer"]
        for path in ("/api/bundles", f"/api/bundles/{BUNDLE}/report", f"/api/bundles/{BUNDLE}"):
            assert live.get(path).status == 401
            for token in wrong:
                assert live.get(path, token=token).status == 401, token
            assert live.get(path, headers={"Authorization": f"Basic {TOKEN}"}).status == 401
            assert live.get(path, headers={"Authorization": TOKEN}).status == 401
            assert live.get(path, token=TOKEN).status == 200
            assert live.get(path, headers={"Authorization": f"bearer {TOKEN}"}).status == 200

    def test_the_api_does_not_take_the_token_in_the_address(self, serve, bundle_dir):
        live = serve(bundle_dir)
        assert live.get(f"/api/bundles?token={TOKEN}").status == 401

    def test_the_page_trades_a_query_token_for_an_httponly_strict_cookie(self, serve, bundle_dir):
        live = serve(bundle_dir)
        reply = live.get(f"/bundles/{BUNDLE}?token={TOKEN}")
        assert reply.status == 303 and reply.headers["Location"] == f"/bundles/{BUNDLE}"
        cookie = reply.cookie()
        assert cookie is not None and cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
        assert TOKEN not in cookie.value  # an HMAC of the token, not the token
        assert live.get(f"/?bundle={BUNDLE}&token={TOKEN}").headers["Location"] == f"/?bundle={BUNDLE}"
        with_cookie = {"Cookie": f"{COOKIE}={cookie.value}"}
        page = live.get(f"/bundles/{BUNDLE}", headers=with_cookie)
        assert page.status == 200 and "collective mismatch" in page.text
        assert live.get(f"/api/bundles/{BUNDLE}", headers=with_cookie).status == 200  # the page's download link
        tampered = cookie.value[:-1] + ("1" if cookie.value.endswith("0") else "0")  # a hex digit that differs
        assert live.get("/", headers={"Cookie": f"{COOKIE}={tampered}"}).status == 401

    def test_a_wrong_query_token_is_401_with_a_form_and_no_cookie(self, serve, bundle_dir):
        live = serve(bundle_dir)
        reply = live.get(f"/?bundle={BUNDLE}&token=nope")
        assert reply.status == 401 and reply.cookie() is None
        assert '<form class="token"' in reply.text and f'name="bundle" value="{BUNDLE}"' in reply.text

    def test_metrics_requires_the_token_when_closed(self, serve, bundle_dir):
        live = serve(bundle_dir, metrics_open=False)
        assert live.get("/metrics").status == 401
        assert live.get("/metrics", token="wrong").status == 401
        assert live.get("/metrics", token=TOKEN).status == 200
        assert live.get("/healthz").status == 200


class TestBundles:
    def test_listing_newest_first_with_the_report_fields(self, serve, bundle_dir):
        older = skip_report().model_copy(update={"verdict": Verdict.rank_behind, "culprit_ranks": [1], "job": "older"})
        make_bundle(bundle_dir, "older-20260101T000000Z-rank_behind", older, mtime=time.time() - 3600)
        rows = serve(bundle_dir).get("/api/bundles", token=TOKEN).json()
        assert [r["id"] for r in rows] == [BUNDLE, "older-20260101T000000Z-rank_behind"]
        first = rows[0]
        assert (first["job"], first["verdict"], first["culprit_ranks"], first["error"]) == (
            "h200x4-skip",
            "collective_mismatch",
            [3],
            None,
        )
        assert first["size"] == (bundle_dir / f"{BUNDLE}.tar.gz").stat().st_size
        assert first["created"].endswith("+00:00") and rows[1]["created"] < first["created"]
        assert rows[1]["verdict"] == "rank_behind" and rows[1]["culprit_ranks"] == [1]

    def test_partials_dot_files_and_other_names_are_not_bundles(self, serve, bundle_dir):
        shutil.copy(bundle_dir / f"{BUNDLE}.tar.gz", bundle_dir / f".{BUNDLE}-2.tar.gz.partial")
        shutil.copy(bundle_dir / f"{BUNDLE}.tar.gz", bundle_dir / ".hidden.tar.gz")
        shutil.copy(bundle_dir / f"{BUNDLE}.tar.gz", bundle_dir / "notes.txt")
        (bundle_dir / ".spool").mkdir()
        (bundle_dir / "folder.tar.gz").mkdir()
        assert [r["id"] for r in serve(bundle_dir).get("/api/bundles", token=TOKEN).json()] == [BUNDLE]

    def test_broken_bundles_are_listed_with_an_error_never_a_500(self, serve, bundle_dir):
        good = (bundle_dir / f"{BUNDLE}.tar.gz").read_bytes()
        (bundle_dir / "garbage-20260101T000000Z-rank_behind.tar.gz").write_bytes(b"not a tar at all")
        (bundle_dir / "truncated.tar.gz").write_bytes(good[: len(good) // 2])
        (bundle_dir / "empty.tar.gz").write_bytes(b"")
        noreport = bundle_dir.parent / "noreport"
        noreport.mkdir()
        (noreport / "evidence.json").write_text("{}")
        with tarfile.open(bundle_dir / "noreport.tar.gz", "w:gz") as tar:
            tar.add(noreport, arcname="noreport")
        live = serve(bundle_dir)
        rows = {r["id"]: r for r in live.get("/api/bundles", token=TOKEN).json()}
        assert rows[BUNDLE]["error"] is None
        for name in ("garbage-20260101T000000Z-rank_behind", "truncated", "empty", "noreport"):
            assert rows[name]["verdict"] is None and rows[name]["error"], name
            assert live.get(f"/api/bundles/{name}/report", token=TOKEN).status == 422
            assert live.get(f"/bundles/{name}", token=TOKEN).status == 422
        assert rows["garbage-20260101T000000Z-rank_behind"]["job"] == "garbage"  # from the name
        assert live.get("/", token=TOKEN).status == 200

    def test_a_missing_bundle_folder_is_an_empty_list(self, serve, tmp_path):
        live = serve(tmp_path / "not-yet")
        assert live.get("/api/bundles", token=TOKEN).json() == []
        assert "No bundles yet" in live.get("/", token=TOKEN).text

    def test_summaries_are_cached_by_mtime_and_size(self, serve, bundle_dir, monkeypatch):
        from ncclwatch.watchdog.server import app as server

        reads: list[Path] = []
        real = server.read_bundle
        monkeypatch.setattr(server, "read_bundle", lambda path, **kw: (reads.append(path), real(path, **kw))[1])
        live = serve(bundle_dir)
        for _ in range(3):
            live.get("/api/bundles", token=TOKEN)
        assert len(reads) == 1
        make_bundle(bundle_dir, BUNDLE, skip_report().model_copy(update={"job": "rewritten"}))
        assert live.get("/api/bundles", token=TOKEN).json()[0]["job"] == "rewritten" and len(reads) == 2

    def test_report_is_the_bundles_report_json(self, serve, bundle_dir):
        reply = serve(bundle_dir).get(f"/api/bundles/{BUNDLE}/report", token=TOKEN)
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("application/json")
        report = Report.model_validate(reply.json())
        assert (report.verdict.value, report.culprit_ranks, report.position) == ("collective_mismatch", [3], 82)
        assert [row.rank for row in report.timeline] == [0, 1, 2, 3]

    def test_download_is_the_file_as_an_attachment(self, serve, bundle_dir, tmp_path):
        reply = serve(bundle_dir).get(f"/api/bundles/{BUNDLE}", token=TOKEN, headers={"Accept-Encoding": "gzip, br"})
        assert reply.status == 200 and reply.body == (bundle_dir / f"{BUNDLE}.tar.gz").read_bytes()
        assert reply.headers["Content-Type"] == "application/gzip" and "Content-Encoding" not in reply.headers
        assert reply.headers["Content-Disposition"] == f'attachment; filename="{BUNDLE}.tar.gz"'
        (tmp_path / "got.tar.gz").write_bytes(reply.body)
        with tarfile.open(tmp_path / "got.tar.gz") as tar:
            assert f"{BUNDLE}/report.json" in tar.getnames()

    def test_head_gives_the_size_without_the_body(self, serve, bundle_dir):
        reply = serve(bundle_dir).get(f"/api/bundles/{BUNDLE}", token=TOKEN, method="HEAD")
        assert reply.status == 200 and reply.body == b""
        assert int(reply.headers["Content-Length"]) == (bundle_dir / f"{BUNDLE}.tar.gz").stat().st_size

    def test_unknown_bundle_is_404(self, serve, bundle_dir):
        live = serve(bundle_dir)
        assert live.get("/api/bundles/nope", token=TOKEN).status == 404
        assert live.get("/api/bundles/nope/report", token=TOKEN).status == 404
        assert live.get("/bundles/nope", token=TOKEN).status == 404


TRAVERSALS = [
    "/api/bundles/..%2Fsecret",
    "/api/bundles/%2e%2e%2fsecret",
    "/api/bundles/%2E%2E%2Fsecret",
    "/api/bundles/%2e%2e/secret",
    "/api/bundles/../secret",
    "/api/bundles/..%5Csecret",
    "/api/bundles/..\\secret",
    "/api/bundles/%2Ftmp%2Fsecret",
    "/api/bundles//etc/passwd",
    "/api/bundles/%2Fetc%2Fpasswd",
    "/api/bundles/secret%00",
    "/api/bundles/%00",
    "/api/bundles/..%252Fsecret",
    "/api/bundles/%c0%ae%c0%ae%2fsecret",
    "/api/bundles/..%2F..%2F..%2Fetc%2Fpasswd",
    "/api/bundles/%2e%2e%2fsecret/report",
    "/api/bundles/..%2Fsecret/report",
    "/api/bundles/outside-link",
    "/api/bundles/outside-link/report",
    "/api/bundles/.hidden",
    "/api/bundles/.%2e%2fsecret",
    "/api/bundles/x.partial",
    "/api/bundles/secret%0A",
    "/bundles/..%2Fsecret",
    "/bundles/%2e%2e%2fsecret",
    "/bundles/outside-link",
    "/?bundle=../secret",
    "/?bundle=%2E%2E%2Fsecret",
    "/?bundle=..%2Fsecret",
    "/?bundle=/etc/passwd",
    "/?bundle=%2Fetc%2Fpasswd",
    "/?bundle=outside-link",
    "/?bundle=..%5Csecret",
    "/?bundle=secret%00",
    "/api/bundles/" + "a" * 202,
    "/api/bundles/%20secret",
]


class TestIds:
    @pytest.fixture
    def live(self, serve, tmp_path, bundle_dir):
        secret = skip_report().model_copy(update={"summary": "SECRET-OUTSIDE-THE-FOLDER"})
        make_bundle(tmp_path, "secret", secret)  # tmp_path/secret.tar.gz, beside the bundle folder
        (bundle_dir / "outside-link.tar.gz").symlink_to(tmp_path / "secret.tar.gz")
        (bundle_dir / "alias.tar.gz").symlink_to(bundle_dir / f"{BUNDLE}.tar.gz")
        (bundle_dir / "x.partial.tar.gz").write_bytes((tmp_path / "secret.tar.gz").read_bytes())
        return serve(bundle_dir)

    @pytest.mark.parametrize("raw", TRAVERSALS)
    def test_no_spelling_reaches_a_file_outside(self, live, raw, tmp_path):
        reply = live.get(raw, token=TOKEN, raw=True)
        assert reply.status in (400, 404), (raw, reply.status, reply.text[:200])
        secret = (tmp_path / "secret.tar.gz").read_bytes()
        assert b"SECRET-OUTSIDE" not in reply.body and secret not in reply.body and b"root:" not in reply.body

    def test_links_inside_the_folder_are_served_and_outside_ones_not_listed(self, live):
        ids = [r["id"] for r in live.get("/api/bundles", token=TOKEN).json()]
        assert "outside-link" not in ids and "x.partial" not in ids and {"alias", BUNDLE} <= set(ids)
        assert live.get("/api/bundles/alias/report", token=TOKEN).json()["culprit_ranks"] == [3]

    def test_index_rejects_bad_ids(self, tmp_path, bundle_dir):
        index = BundleIndex(bundle_dir)
        (tmp_path / "secret.tar.gz").write_bytes(b"x")
        assert index.path_of(BUNDLE) == (bundle_dir / f"{BUNDLE}.tar.gz").resolve()
        for bad in (
            "../secret",
            "..",
            ".",
            "",
            "a/../../secret",
            "/etc/passwd",
            f"{BUNDLE}\x00",
            f"{BUNDLE}\n",
            "..\\secret",
            f"{BUNDLE}/",
            f".{BUNDLE}",
            f"{BUNDLE}.tar.gz.partial",
            "x.partial",
            "a" * 202,
            "é",
        ):
            assert index.path_of(bad) is None, repr(bad)


class TestPage:
    def test_listing_page_links_each_bundle(self, serve, bundle_dir):
        page = serve(bundle_dir).get("/", token=TOKEN)
        assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
        assert f"href='/bundles/{BUNDLE}'" in page.text and f"href='/api/bundles/{BUNDLE}'" in page.text
        assert (
            "script-src" not in page.headers["Content-Security-Policy"]
            and "default-src 'none'" in page.headers["Content-Security-Policy"]
        )
        assert page.headers["Cache-Control"] == "no-store"

    def test_report_page_has_the_verdict_the_timeline_and_the_culprit_row(self, serve, bundle_dir):
        live = serve(bundle_dir)
        page = live.get(f"/bundles/{BUNDLE}", token=TOKEN).text
        assert page == live.get(f"/?bundle={BUNDLE}", token=TOKEN).text
        for needle in (
            "collective mismatch",
            "culprit rank 3",
            skip_report().summary[:40],
            '<svg class="timeline"',
            'class="rank culprit" data-culprit="true" data-rank="3"',
            "diverges here",
            "#82",
            "class='culprit' data-culprit='true' data-rank='3'",
            "stacks/rank3.json",
            "no NCCL RAS server",
            "fr/nccl_trace_rank_3",
            "report.json",
            "Evidence",
        ):
            assert needle in page, needle
        assert page.count('class="op differs') >= 1

    def test_bundle_values_are_escaped(self, serve, tmp_path):
        evil = skip_report().model_copy(
            update={"summary": "<script>alert(1)</script>", "job": "<img src=x onerror=alert(1)>"}
        )
        make_bundle(tmp_path / "b", "evil", evil)
        live = serve(tmp_path / "b")
        for path in ("/", "/bundles/evil"):
            text = live.get(path, token=TOKEN).text
            assert "<script>" not in text and "<img src=x" not in text and "&lt;script&gt;" in text


class TestMetricsAndHealth:
    def test_metrics_expose_the_injected_registry(self, serve, bundle_dir):
        registry = CollectorRegistry()
        gauge = Gauge(
            "ncclwatch_rank_progress_age_seconds", "since progress", ["rank", "host", "pid"], registry=registry
        )
        gauge.labels("3", "vm", "1170").set(12.5)
        reply = serve(bundle_dir, registry=registry).get("/metrics")
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(reply.text)}
        (sample,) = families["ncclwatch_rank_progress_age_seconds"].samples
        assert (sample.labels, sample.value) == ({"rank": "3", "host": "vm", "pid": "1170"}, 12.5)

    def test_metrics_without_a_registry_are_empty(self, serve, bundle_dir):
        reply = serve(bundle_dir).get("/metrics")
        assert reply.status == 200 and list(text_string_to_metric_families(reply.text)) == []

    def test_a_failing_collector_is_a_503_not_a_dead_server(self, serve, bundle_dir):
        class Broken:
            def collect(self):
                raise RuntimeError("state went away")

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Broken())
        live = serve(bundle_dir, registry=registry)
        assert live.get("/metrics").status == 503 and live.get("/healthz").status == 200

    def test_healthz_gives_health_as_json(self, serve, bundle_dir):
        health = Health(
            observed_at=1.0,
            job="train",
            host="node1",
            ranks=(RankHealth(0, 4242, "node1", "S", 7, 0.5, 0.5),),
            positions=(),
            stalled_for_s=0.5,
            stall_timeout_s=5.0,
            hang=False,
            verdict=None,
            culprits=(),
            sources_down=("ras",),
            bundles_written=0,
        )
        reply = serve(bundle_dir, token=None, health=lambda: health).get("/healthz")
        body = reply.json()
        assert reply.status == 200 and body["status"] == "ok"
        assert body["health"]["ranks"][0]["pid"] == 4242 and body["health"]["sources_down"] == ["ras"]

    def test_healthz_says_when_health_fails(self, serve, bundle_dir):
        reply = serve(bundle_dir, health=lambda: 1 / 0).get("/healthz")
        assert reply.status == 503 and reply.json()["status"] == "error"


class TestServer:
    def test_start_on_port_0_reports_the_port_and_stop_closes_it(self, bundle_dir):
        async def go() -> tuple[str, bool]:
            runner, bound = await start_server(make_app(bundle_dir, token=TOKEN), "127.0.0.1:0")
            async with aiohttp.ClientSession() as session, session.get(f"http://{bound}/healthz") as reply:
                assert reply.status == 200
            await stop_server(runner)
            host, port = bound.rsplit(":", 1)
            with socket.socket() as sock:
                return bound, sock.connect_ex((host, int(port))) != 0

        bound, closed = asyncio.run(go())
        assert bound.startswith("127.0.0.1:") and not bound.endswith(":0") and closed


def serve_process(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``ncclwatch serve`` as a user starts it; returns the process and the URL it printed."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")} | (env or {})
    process = subprocess.Popen(
        [sys.executable, "-m", "ncclwatch", "serve", "--listen", "127.0.0.1:0", *args],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()  # type: ignore[union-attr]
    if "http://" not in line:
        process.kill()
        raise AssertionError(f"no URL printed: {line!r} {process.stderr.read()}")  # type: ignore[union-attr]
    return process, line.split("http://", 1)[1].split()[0].rstrip("/")


class TestServeCommand:
    def test_serves_with_the_env_token_and_exits_0_on_sigterm(self, bundle_dir):
        process, address = serve_process("--bundle-dir", str(bundle_dir), env={"NCCLWATCH_API_TOKEN": TOKEN})

        async def go() -> tuple[int, list[dict[str, Any]], str]:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
                async with session.get(f"http://{address}/api/bundles") as listing:
                    rows = await listing.json()
                async with session.get(f"http://{address}/metrics") as metrics:
                    return listing.status, rows, await metrics.text()

        try:
            status, rows, metrics = asyncio.run(go())
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(15)
        assert status == 200 and rows[0]["id"] == BUNDLE
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert families["ncclwatch_bundles"].samples[0].labels == {"verdict": "collective_mismatch"}
        assert code == 0, process.stderr.read()  # type: ignore[union-attr]

    def test_token_file_and_no_token_warning(self, bundle_dir, tmp_path):
        (tmp_path / "token").write_text(f"{TOKEN}\n")
        for args, expect in ((("--token-file", str(tmp_path / "token")), 200), ((), 401)):
            process, address = serve_process("--bundle-dir", str(bundle_dir), *args)

            async def go(address: str = address) -> int:
                bearer = {"Authorization": f"Bearer {TOKEN}"}
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://{address}/api/bundles", headers=bearer) as r,
                ):
                    return r.status

            try:
                assert asyncio.run(go()) == expect
            finally:
                process.send_signal(signal.SIGTERM)
                assert process.wait(15) == 0
            if expect == 401:
                assert "no token configured" in process.stderr.read()  # type: ignore[union-attr]

    def test_an_address_in_use_exits_2_with_a_message(self, bundle_dir):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ncclwatch",
                    "serve",
                    "--bundle-dir",
                    str(bundle_dir),
                    "--listen",
                    f"127.0.0.1:{port}",
                ],
                check=False,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
        assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr

    def test_help_teaches_the_page_auth_and_curl(self):
        command = [sys.executable, "-m", "ncclwatch", "serve", "--help-all"]
        done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0
        for word in (
            "timeline",
            "NCCLWATCH_API_TOKEN",
            "--token-file",
            "?token=",
            "curl -H",
            "--metrics-token",
            "127.0.0.1:9464",
        ):
            assert word in done.stdout, word
