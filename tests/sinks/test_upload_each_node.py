"""Every node of a job uploads its own bundle; only one pages (live/sidecar.py ``_page``).

Two nodes' dispatchers share one spool (shared storage): the paging node submits its alert to every sink, the
other node submits its own alert of the same incident to the upload sink alone (``each_node_only``).  One page
goes out; both bundles go up under the same incident key, neither taken for a repeat of the other.
"""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
from receiver import Receiver, Reply, alert, run

from ncclwatch.watchdog.sinks.delivery import Dispatcher, ident_of
from ncclwatch.watchdog.sinks.upload import UploadSink
from ncclwatch.watchdog.sinks.webhooks import WebhookSink

FAST = (0.01, 0.02, 0.05)
KEY = "ncclwatch-hang-train-0123456789ab"


def node_alert(host: str):  # type: ignore[no-untyped-def]
    # Paged now: an upload older than --upload-spool-days is given up before it is sent.
    return alert(host=host, bundle_id=f"train-{host}-20261122T100005Z-collective_mismatch", created_at=time.time())


def test_each_node_uploads_its_bundle_and_one_page_goes_out(tmp_path: Path) -> None:
    spool, bundles = tmp_path / "spool", tmp_path / "bundles"
    bundles.mkdir()
    for host in ("node1", "node2"):
        (bundles / f"{node_alert(host).bundle_id}.tar.gz").write_bytes(f"bundle of {host}".encode())

    async def go():  # type: ignore[no-untyped-def]
        async with Receiver(Reply(200)) as pages, Receiver(Reply(201)) as server:
            async with aiohttp.ClientSession() as session:
                for host, only in (("node1", False), ("node2", True)):  # node1 pages, node2 follows it
                    sinks = [WebhookSink(session, pages.url), UploadSink(session, server.url, "t", bundles)]
                    dispatcher = Dispatcher(sinks, spool, backoff_s=FAST)
                    await dispatcher.start()
                    dispatcher.submit(node_alert(host), each_node_only=only)
                    assert await dispatcher.drain(5)
                    await dispatcher.close()
            return pages.seen, server.seen

    paged, uploaded = run(go())
    assert [(s.json()["host"], s.json()["action"]) for s in paged] == [("node1", "trigger")]
    assert sorted(s.body.decode() for s in uploaded) == ["bundle of node1", "bundle of node2"]
    assert {s.headers["X-Ncclwatch-Incident"] for s in uploaded} == {KEY}
    assert sorted(p.name for p in (spool / "sent").iterdir()) == [
        f"upload.trigger.{KEY}.node1",
        f"upload.trigger.{KEY}.node2",
        f"webhook.trigger.{KEY}",
    ]


def test_a_repeat_of_one_nodes_upload_is_still_ignored(tmp_path: Path) -> None:
    assert ident_of(node_alert("node1"), each_node=True) == ident_of(node_alert("node1"), each_node=True)
    assert ident_of(node_alert("node1"), each_node=True) != ident_of(node_alert("node2"), each_node=True)
    assert ident_of(node_alert("node1")) == ident_of(node_alert("node2")) == f"trigger.{KEY}"  # one page per hang
    odd = ident_of(alert(host="gpu1.cluster.example"), each_node=True)
    assert odd.startswith(f"trigger.{KEY}.sha256_")  # never a dot or a slash of a host in a file name
