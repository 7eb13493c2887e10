"""The cluster server's reading side on a real server: incidents across jobs with filters, one incident with
its nodes' bundles, the hosts view (7 and 30 days, repeat hosts first), /api/hosts and the metric."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest
from cluster_bundles import bundle_bytes, node_report
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_server import TOKEN, Live

from ncclwatch.watchdog.server.app import make_app
from ncclwatch.watchdog.server.cluster import HostIncidentsCollector, install
from ncclwatch.watchdog.server.incidents import IncidentIndex
from ncclwatch.watchdog.server.intake import Intake, RateLimit

UPLOAD = "upload-only-token"
NOW = time.time()
DAY = 86400.0


@pytest.fixture
def live(tmp_path: Path):
    index = IncidentIndex(tmp_path / ".incidents.sqlite")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostIncidentsCollector(index))
    app = make_app(tmp_path, token=TOKEN, registry=registry)
    install(app, Intake(tmp_path, index, [UPLOAD], 50 << 20, RateLimit(6000)))
    server = Live(app)
    yield server
    server.close()
    index.close()


def upload(live: Live, job: str, node: str, culprit: str, days_ago: float, key: str, **kw) -> str:  # type: ignore[no-untyped-def]
    name, data = bundle_bytes(node_report(job, node, culprit, NOW - days_ago * DAY, **kw))
    reply = live.get("/api/upload", method="POST", token=UPLOAD, data=data, headers={"X-Ncclwatch-Incident": key})
    assert reply.status == 201, reply.text
    return name


@pytest.fixture
def history(live: Live) -> Live:
    """gpu7 is the culprit of three jobs' hangs this week; gpu2 of one 20 days ago; job-c hung twice."""
    upload(live, "job-a", "gpu1", "gpu7", 1, "key-a")
    upload(live, "job-a", "gpu7", "gpu7", 1, "key-a")  # the same hang, the other node's bundle
    upload(live, "job-b", "gpu3", "gpu7", 2, "key-b")
    upload(live, "job-c", "gpu4", "gpu7", 3, "key-c1", verdict="rank_behind")
    upload(live, "job-c", "gpu4", "gpu2", 20, "key-c2")
    upload(live, "job-d", "gpu5", "gpu9", 45, "key-old")  # past the 30-day view, still in the list
    return live


class TestIncidents:
    def test_newest_first_with_each_nodes_part(self, history):
        rows = history.get("/api/incidents", token=TOKEN).json()
        assert [r["incident_key"] for r in rows] == ["key-a", "key-b", "key-c1", "key-c2", "key-old"]
        assert rows[0]["nodes"] == ["gpu1", "gpu7"] and rows[0]["named"] == [{"host": "gpu7", "role": "culprit"}]

    @pytest.mark.parametrize(
        ("query", "keys"),
        [
            ("job=job-c", ["key-c1", "key-c2"]),
            ("host=gpu7", ["key-a", "key-b", "key-c1"]),
            ("verdict=rank_behind", ["key-c1"]),
            ("host=gpu7&job=job-b", ["key-b"]),
            (f"since={time.strftime('%Y-%m-%d', time.gmtime(NOW - 10 * DAY))}", ["key-a", "key-b", "key-c1"]),
            (f"until={time.strftime('%Y-%m-%d', time.gmtime(NOW - 10 * DAY))}", ["key-c2", "key-old"]),
        ],
    )
    def test_filters(self, history, query, keys):
        rows = history.get(f"/api/incidents?{query}", token=TOKEN).json()
        assert [r["incident_key"] for r in rows] == keys

    def test_a_bad_time_filter_is_400_naming_it(self, history):
        reply = history.get("/api/incidents?since=yesterday", token=TOKEN)
        assert reply.status == 400 and "since" in reply.text

    def test_the_incident_page_lists_each_nodes_bundle_to_download_and_shows_the_report(self, history):
        page = history.get("/incidents/key-a", token=TOKEN)
        assert page.status == 200
        assert page.text.count("<tr data-bundle='job-a-gpu") == 2 and "/api/bundles/job-a-gpu7-" in page.text
        assert "<h2>Report</h2>" in page.text and "different collective" in page.text
        assert history.get("/incidents/nope", token=TOKEN).status == 404
        assert history.get("/api/incidents/nope", token=TOKEN).status == 404


class TestHosts:
    def test_repeat_hosts_first_over_7_and_30_days_by_verdict(self, history):
        hosts = history.get("/api/hosts", token=TOKEN).json()
        assert [h["host"] for h in hosts] == ["gpu7", "gpu2"]  # gpu9's incident is older than 30 days
        gpu7 = hosts[0]
        assert (gpu7["days_7"], gpu7["days_30"], gpu7["jobs_7"], gpu7["jobs_30"]) == (3, 3, 3, 3)
        assert gpu7["by_verdict_7"] == {"collective_mismatch": 2, "rank_behind": 1}
        assert gpu7["roles"] == {"culprit": 3}  # key-a named it in two nodes' bundles: one incident
        assert (hosts[1]["days_7"], hosts[1]["days_30"]) == (0, 1)
        assert [h["host"] for h in history.get("/api/hosts?host=gpu2", token=TOKEN).json()] == ["gpu2"]
        assert [h["host"] for h in history.get("/api/hosts?limit=1", token=TOKEN).json()] == ["gpu7"]

    def test_last_at_is_iso_8601_utc_with_the_unix_seconds_beside_it(self, history):
        for host in history.get("/api/hosts", token=TOKEN).json():
            said = dt.datetime.fromisoformat(host["last_at"])
            assert said.utcoffset() == dt.timedelta(0), host["last_at"]
            assert said.timestamp() == int(host["last_at_unix"])

    def test_the_pages_link_hosts_and_incidents(self, history):
        page = history.get("/hosts", token=TOKEN).text
        assert page.index("data-host='gpu7'") < page.index("data-host='gpu2'")
        host = history.get("/hosts/gpu7", token=TOKEN).text
        assert "Named in 3 incident(s) in 7 days (3 job(s))" in host and host.count("data-incident=") == 3
        listing = history.get("/incidents?host=gpu7", token=TOKEN).text
        assert listing.count("data-incident=") == 3 and "href='/hosts/gpu7'" in listing

    def test_bundle_text_is_escaped_on_every_page(self, live):
        upload(live, "<img src=x onerror=alert(1)>", "gpu1", "gpu7", 1, "key-x")
        for path in ("/incidents", "/incidents/key-x", "/hosts/gpu7"):
            text = live.get(path, token=TOKEN).text
            assert "<img src=x" not in text and "&lt;img src=x" in text

    def test_the_metric_counts_incidents_per_host_and_verdict(self, history):
        text = history.get("/metrics").text
        samples = {
            (s.labels["host"], s.labels["verdict"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "ncclwatch_host_incidents"
            for s in family.samples
            if s.name == "ncclwatch_host_incidents_total"
        }
        assert samples == {
            ("gpu7", "collective_mismatch"): 2,
            ("gpu7", "rank_behind"): 1,
            ("gpu2", "collective_mismatch"): 1,
            ("gpu9", "collective_mismatch"): 1,
        }
