"""The page goes out before its bundle is written (live/sidecar.py): the upload waits for the file, within reason."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from ncclwatch.watchdog.sinks.alert import Alert
from ncclwatch.watchdog.sinks.upload import BUNDLE_WRITE_S, UploadSink

NOW = 1_800_000_000.0


def page(created_at: float) -> Alert:
    return Alert(
        action="trigger",
        dedup_key="train|hang",
        job="train",
        host="node1",
        summary="rank 1 hangs",
        bundle_id="train-node1-20270115T080000Z-rank_behind",
        created_at=created_at,
    )


def send(alert: Alert, bundle_dir: Path) -> tuple[bool, str]:
    async def go() -> tuple[bool, str]:
        async with aiohttp.ClientSession() as session:
            # Nothing listens there: a send that got past the file would fail on the network instead.
            sink = UploadSink(session, "http://127.0.0.1:9", "token", bundle_dir, clock=lambda: NOW)
            delivery = await sink.send(alert)
            return delivery.retry, delivery.detail

    return asyncio.run(go())


def test_a_bundle_still_being_written_is_retried(tmp_path: Path) -> None:
    assert send(page(NOW - 5), tmp_path) == (True, "the bundle is still being written")


def test_a_bundle_that_never_came_is_given_up(tmp_path: Path) -> None:
    retry, detail = send(page(NOW - BUNDLE_WRITE_S - 1), tmp_path)
    assert not retry and detail.startswith("the bundle cannot be read")
