"""The cluster server's intake on a real server on loopback: the upload token, idempotent grouping of each
node's bundle under one incident, refusals that store nothing, the rate limit, retention."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest
from cluster_bundles import bundle_bytes, node_report
from test_server import TOKEN, Live

from ncclwatch.watchdog.server.app import make_app
from ncclwatch.watchdog.server.cluster import install
from ncclwatch.watchdog.server.incidents import IncidentIndex, named_hosts
from ncclwatch.watchdog.server.intake import Intake, RateLimit, prune

UPLOAD = "upload-only-token"
NOW = time.time()


@pytest.fixture
def cluster(tmp_path: Path):
    servers: list[tuple[Live, IncidentIndex]] = []

    def _cluster(tokens=(UPLOAD,), max_bytes=50 << 20, per_minute=600.0) -> tuple[Live, Path, IncidentIndex]:
        folder = tmp_path / f"server{len(servers)}"
        folder.mkdir()
        index = IncidentIndex(folder / ".incidents.sqlite")
        app = make_app(folder, token=TOKEN)
        install(app, Intake(folder, index, list(tokens), max_bytes, RateLimit(per_minute)))
        servers.append((Live(app), index))
        return servers[-1][0], folder, index

    yield _cluster
    for live, index in servers:
        live.close()
        index.close()


def post(live: Live, data: bytes, token: str | None = UPLOAD, key: str | None = "ncclwatch-hang-train-abc", **h):
    headers = {"X-Ncclwatch-Incident": key} if key else {}
    headers.update(h)
    return live.get("/api/upload", method="POST", token=token, data=data, headers=headers)


def stored(folder: Path) -> list[str]:
    """Everything in the bundle folder but the index itself: what an upload left behind."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and ".incidents.sqlite" not in p.name
    )


class TestUpload:
    def test_each_nodes_bundle_joins_one_incident_and_a_repeat_changes_nothing(self, cluster):
        live, folder, _ = cluster()
        first_id, first = bundle_bytes(node_report("train", "node1", "node2", NOW))
        second_id, second = bundle_bytes(node_report("train", "node2", "node2", NOW + 1))
        assert post(live, first).status == 201
        reply = post(live, second)
        assert reply.status == 201 and reply.json()["url"] == "/incidents/ncclwatch-hang-train-abc"
        assert reply.json()["new_incident"] is False
        again = post(live, first)
        assert again.status == 200 and again.json()["stored"] is False
        incident = live.get("/api/incidents/ncclwatch-hang-train-abc", token=TOKEN).json()
        assert sorted(p["bundle_id"] for p in incident["parts"]) == sorted([first_id, second_id])
        assert incident["named"] == [{"host": "node2", "role": "culprit"}]
        assert stored(folder) == sorted(f"{i}.tar.gz" for i in (first_id, second_id))
        assert live.get(f"/api/bundles/{first_id}", token=TOKEN).body == first  # served as any bundle is
        assert len(live.get("/api/incidents", token=TOKEN).json()) == 1

    def test_without_the_key_header_the_key_is_the_alerts_from_the_report(self, cluster):
        from ncclwatch.watchdog.sinks.alert import dedup_key_for

        live, _, _ = cluster()
        report = node_report("train", "node1", "node2", NOW)
        reply = post(live, bundle_bytes(report)[1], key=None)
        assert reply.status == 201
        assert reply.json()["incident"] == dedup_key_for("train", report.incident_key, None)

    def test_the_read_token_cannot_upload_and_the_upload_token_cannot_read(self, cluster):
        live, folder, _ = cluster()
        data = bundle_bytes(node_report("train", "node1", "node2", NOW))[1]
        refused = post(live, data, token=TOKEN)
        assert refused.status == 401 and refused.json()["error"] == "wrong upload token"
        assert post(live, data, token=None).json()["error"] == "an upload token is required"
        assert stored(folder) == []
        assert post(live, data).status == 201
        for path in ("/api/incidents", "/api/hosts", "/api/bundles", "/incidents", "/hosts"):
            assert live.get(path, token=UPLOAD).status == 401

    def test_a_server_without_upload_tokens_takes_no_uploads_and_says_how(self, cluster):
        live, folder, _ = cluster(tokens=())
        reply = post(live, bundle_bytes(node_report("train", "node1", "node2", NOW))[1])
        assert reply.status == 401 and "NCCLWATCH_UPLOAD_TOKEN" in reply.json()["error"]
        assert stored(folder) == []


def hostile(kind: str) -> bytes:
    """A gzip tarball carrying ``kind`` besides a valid report."""
    report = node_report("train", "node1", "node2", NOW)
    name = bundle_bytes(report)[0]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:

        def add(member_name: str, data: bytes = b"x", **attrs) -> None:  # type: ignore[no-untyped-def]
            member = tarfile.TarInfo(member_name)
            member.size = len(data) if not attrs else 0
            for k, v in attrs.items():
                setattr(member, k, v)
            tar.addfile(member, io.BytesIO(data) if not attrs else None)

        if kind != "no report":
            add(f"{name}/report.json", report.model_dump_json().encode())
        else:
            add(f"{name}/report.md", b"# a report without its report.json")
        if kind == "symlink":
            add(f"{name}/stacks", type=tarfile.SYMTYPE, linkname="/etc")
        elif kind == "hardlink":
            add(f"{name}/passwd", type=tarfile.LNKTYPE, linkname="/etc/passwd")
        elif kind == "device":
            add(f"{name}/dev", type=tarfile.CHRTYPE)
        elif kind == "dotdot":
            add(f"{name}/../../evil.sh")
        elif kind == "absolute":
            add("/etc/cron.d/evil")
        elif kind == "two tops":
            add("other-folder/report.json")
    return buffer.getvalue()


class TestRefusals:
    @pytest.mark.parametrize(
        ("kind", "says"),
        [
            ("symlink", "is a symbolic link"),
            ("hardlink", "is a hard link"),
            ("device", "is a device"),
            ("dotdot", "outside the bundle"),
            ("absolute", "outside the bundle"),
            ("two tops", "one top folder"),
            ("no report", "/report.json"),
        ],
    )
    def test_a_hostile_archive_is_refused_with_why_and_nothing_stored(self, cluster, kind, says):
        live, folder, index = cluster()
        reply = post(live, hostile(kind))
        assert reply.status == 400 and says in reply.json()["error"], reply.json()
        assert stored(folder) == [] and index.incidents() == []

    @pytest.mark.parametrize(
        ("data", "says"),
        [
            (b"not a tarball at all", "not a whole gzip stream"),
            (bundle_bytes(node_report("t", "a", "b", NOW))[1][:-200], "not a whole gzip stream"),  # cut short
            # mtime=0: the bytes name the test, and pytest-xdist's workers must collect the same names
            (__import__("gzip").compress(b"plain text, no tar", mtime=0), "not a tar archive"),
        ],
    )
    def test_a_corrupt_upload_is_refused_and_nothing_stored(self, cluster, data, says):
        live, folder, index = cluster()
        reply = post(live, data)
        assert reply.status == 400 and says in reply.json()["error"], reply.json()
        assert stored(folder) == [] and index.incidents() == []

    def test_a_report_that_is_no_report_is_refused(self, cluster):
        live, folder, _ = cluster()
        _, data = bundle_bytes(node_report("t", "a", "b", NOW), extra={"report.json": b'{"hello": 1}'})
        reply = post(live, data)
        assert reply.status == 400 and "no verdict" in reply.json()["error"]
        assert stored(folder) == []

    def test_over_the_size_limit_is_413_whatever_content_length_says(self, cluster):
        live, folder, _ = cluster(max_bytes=100_000)
        data = bundle_bytes(node_report("t", "a", "b", NOW), padding=200_000)[1]
        assert post(live, data).status == 413

        async def chunks():  # no Content-Length: the bytes are counted as they come
            for start in range(0, len(data), 65536):
                yield data[start : start + 65536]

        reply = post(live, chunks())
        assert reply.status == 413 and "over the limit" in reply.json()["error"]
        assert stored(folder) == []

    def test_a_bad_incident_key_header_is_refused(self, cluster):
        live, folder, _ = cluster()
        reply = post(live, bundle_bytes(node_report("t", "a", "b", NOW))[1], key="../../etc")
        assert reply.status == 400 and "X-Ncclwatch-Incident" in reply.json()["error"]
        assert stored(folder) == []

    def test_each_token_is_rate_limited_with_retry_after(self, cluster):
        live, _, _ = cluster(tokens=(UPLOAD, "second-token"), per_minute=2)
        data = bundle_bytes(node_report("t", "a", "b", NOW))[1]
        assert [post(live, data).status for _ in range(2)] == [201, 200]
        limited = post(live, data)
        assert limited.status == 429 and int(limited.headers["Retry-After"]) >= 1
        assert post(live, data, token="second-token").status == 200  # another token has its own bucket


class TestRetention:
    def test_by_age_then_by_size_each_file_with_its_rows(self, tmp_path):
        index = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: NOW)
        intake = Intake(tmp_path, index, [UPLOAD], 1 << 30, RateLimit(60))
        ids = []
        for n, host in enumerate(("n1", "n2", "n3")):
            upload = intake.incoming() / f"u{n}"
            report = node_report(f"job{n}", host, host, NOW - (3 - n) * 86400)
            name, data = bundle_bytes(report, padding=10_000)
            upload.write_bytes(data)
            index.clock = lambda n=n: NOW - (3 - n) * 86400  # received 3, 2, 1 days ago
            intake.store(upload, f"key{n}", None)
            ids.append(name)
        removed = prune(tmp_path, index, max_age_s=2.5 * 86400, max_bytes=1 << 30, now=NOW)
        assert removed == [ids[0]] and not (tmp_path / f"{ids[0]}.tar.gz").exists()
        assert [i["incident_key"] for i in index.incidents()] == ["key2", "key1"]
        size = (tmp_path / f"{ids[2]}.tar.gz").stat().st_size
        assert prune(tmp_path, index, max_age_s=1e9, max_bytes=size, now=NOW) == [ids[1]]
        assert [i["incident_key"] for i in index.incidents()] == ["key2"]
        assert index.hosts(now=NOW)[0]["host"] == "n3" and len(index.hosts(now=NOW)) == 1
        assert index.totals == {
            ("n1", "collective_mismatch"): 1,
            ("n2", "collective_mismatch"): 1,
            ("n3", "collective_mismatch"): 1,
        }  # a counter: retention lowers nothing


class TestNamedHosts:
    def test_a_lost_nodes_host_comes_from_the_leaders_summary(self):
        import json

        report = {
            "verdict": "node_lost",
            "culprit_ranks": [0],
            "ranks": [{"rank": 1, "host": "vm"}],
            "summary": "Node 0 (gpu-a7), 2 (gpu-b1) (ranks 0, 2) stopped answering: its sidecar has not published",
        }
        assert named_hosts(json.loads(json.dumps(report))) == {("gpu-a7", "lost_node"), ("gpu-b1", "lost_node")}

    def test_a_slow_links_hosts_and_no_odd_names(self):
        report = {
            "verdict": "collective_mismatch",
            "culprit_ranks": [1],
            "ranks": [{"rank": 1, "host": "$(reboot)"}],
            "performance": [{"kind": "slow_link", "hosts": ["gpu3", "gpu4"]}, {"kind": "straggler", "hosts": ["x"]}],
        }
        assert named_hosts(report) == {("gpu3", "slow_link"), ("gpu4", "slow_link")}
