"""Is that node's sidecar alive?  Asked only when the job's store is gone.

When the store dies, every other node loses it at once and the sidecars can
no longer meet, so they cannot tell "the node hosting the store died" (page:
``node_lost``) from "its job ended and torchrun took the store with it" (no
page: torchrun reports its own failures).  Each sidecar of a multi-node job
therefore answers on a TCP port of its own (``Lifeline``), announced in its
summary: a connection gets one line, ``ncclwatch <node> running|ended``, and
is closed.  A node that answers is alive; one that refuses (its wrapper was
killed) or says nothing within ``ASK_TIMEOUT_S`` (frozen, cut off) is lost.
The same answers pick, without a store, the one node that pages (the
lowest candidate of the last job view that answers).

Every sidecar keeps answering ``ended`` for ``LINGER_S`` after its torchrun
exits, so a node whose own job failed a moment later still finds it alive;
``STORE_GONE_LINGER_S`` once the store is gone, because then the survivors,
whose torchruns end seconds apart, elect the one that pages by who answers.
Failure mode: ``ask`` never raises; no answer is None.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

ASK_TIMEOUT_S = 1.0
LINGER_S = 3.0
STORE_GONE_LINGER_S = 15.0


class Lifeline:
    """The answering side: started once the job spans nodes, closed when the wrapper ends."""

    def __init__(self, node: int, state: Callable[[], str]) -> None:
        self.node = node
        self.state = state  # "running" or "ended"
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "0.0.0.0") -> int:
        self._server = await asyncio.start_server(self._answer, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.write(f"ncclwatch {self.node} {self.state()}\n".encode())
            await writer.drain()
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None


async def ask(address: str, timeout_s: float = ASK_TIMEOUT_S) -> str | None:
    """``running`` or ``ended`` from the sidecar at ``host:port``; None when it does not answer."""
    host, _, port = address.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (OSError, TimeoutError, ValueError):
        return None
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (OSError, TimeoutError):
        line = b""
    finally:
        writer.close()
    words = line.decode(errors="replace").split()
    return words[2] if len(words) == 3 and words[0] == "ncclwatch" else None
