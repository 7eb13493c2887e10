"""Real aiohttp receivers on loopback for the alert tests: a ``Receiver`` that answers with scripted ``Reply``s
and records what it was sent, ``alert()`` to build one, ``run`` for a coroutine under a deadline."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Self

from aiohttp import web
from conftest import NOW

from ncclwatch.watchdog.sinks.alert import Alert


def run(coro, timeout_s: float = 10.0):
    """Every test is bounded: a hung delivery fails the test instead of the run."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@dataclass
class Reply:
    status: int = 200
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Seen:
    status: int  # what the receiver answered
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class Receiver:
    """A real HTTP server on 127.0.0.1: answers from a script (the last reply repeats), records every request."""

    def __init__(self, *replies: Reply, port: int = 0) -> None:
        self.replies = list(replies) or [Reply()]
        self.seen: list[Seen] = []
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        self.seen.append(Seen(reply.status, request.path, dict(request.headers), body))
        await asyncio.sleep(reply.delay_s)
        return web.Response(status=reply.status, text=reply.text, headers=reply.headers)


def alert(**changes) -> Alert:
    base = {
        "action": "trigger",
        "dedup_key": "ncclwatch-hang-train-0123456789ab",
        "job": "train",
        "host": "node1",
        "verdict": "collective_mismatch",
        "culprit_ranks": [3],
        "communicator": "0x7f3a (world, 8 ranks)",
        "operation": "AllReduce sum 4096 x float32",
        "position": 42,
        "summary": "ncclwatch: rank 3 collective_mismatch in train on node1: rank 3 issued Broadcast, others AllReduce",
        "reason": "rank 3 skipped an AllReduce",
        "bundle_id": "b-20261122-100000",
        "bundle_url": "http://node1:9464/bundles/b-20261122-100000",
        "detected_at": "2026-11-22T10:00:05.000+00:00",
        "created_at": NOW,
        "report": {"verdict": "collective_mismatch"},
    }
    return Alert(**(base | changes))
