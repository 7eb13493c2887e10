"""RAS probe against a real server on loopback that speaks NCCL's side of the protocol.

The canned reports are real NCCL 2.28.9 replies (2 x H200, tests/data/ras/real-2.28.9-h200x2).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import DATA
from support import RasServer, free_port

from ncclwatch.watchdog.probes import ras
from ncclwatch.watchdog.probes.ras import query_ras

TEXT = (DATA / "ras" / "real-2.28.9-h200x2" / "skip.txt").read_bytes()
JSON = (DATA / "ras" / "real-2.28.9-h200x2" / "skip.json").read_bytes()


@pytest.fixture
def quick_handshake(monkeypatch):
    """A silent connection is given up after 0.3 s instead of 3 s, to keep the tests fast."""
    monkeypatch.setattr(ras, "HANDSHAKE_S", 0.3)


def run(server: RasServer, **kw) -> tuple[bytes | None, str | None]:
    async def go():
        async with server:
            return await query_ras(server.port, **kw)

    return asyncio.run(go())


def test_text_report_with_the_exact_dialogue():
    server = RasServer(TEXT)
    assert run(server, json_format=False) == (TEXT, None)
    assert server.commands == [["CLIENT PROTOCOL 2", "TIMEOUT 5", "VERBOSE STATUS"]]
    assert server.half_closed == [False]  # the client kept its side open until the server closed


def test_json_report_sets_the_format_first():
    server = RasServer(JSON)
    assert run(server, json_format=True, verbose=False, server_timeout_s=2) == (JSON, None)
    assert server.commands == [["CLIENT PROTOCOL 2", "TIMEOUT 2", "SET FORMAT json", "STATUS"]]


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_silent_first_connection_is_retried_on_a_new_one(quick_handshake):
    server = RasServer(TEXT, silent=1)
    started = time.monotonic()
    assert run(server, json_format=False) == (TEXT, None)
    assert time.monotonic() - started < 2.0
    assert [len(c) for c in server.commands] == [0, 3]  # the first got nothing answered


def test_two_silent_connections_give_up(quick_handshake):
    server = RasServer(TEXT, silent=2)
    data, error = run(server, json_format=False)
    assert data is None
    assert error == "no answer to CLIENT PROTOCOL within 0.3 s (on a retry; first try: " + (
        "no answer to CLIENT PROTOCOL within 0.3 s)"
    )
    assert len(server.commands) == 2


def test_refused_port():
    port = free_port()
    data, error = asyncio.run(query_ras(port, json_format=False))
    assert (data, error) == (None, f"no NCCL RAS server on 127.0.0.1:{port}")


def test_not_a_ras_server():
    server = RasServer(TEXT, answers={"CLIENT PROTOCOL 2": "HTTP/1.1 400 Bad Request"})
    assert run(server, json_format=False) == (None, "not a RAS server: answered 'HTTP/1.1 400 Bad Request'")


def test_server_too_old_for_json():
    server = RasServer(JSON, answers={"SET FORMAT json": "ERROR: Unknown command"})
    assert run(server, json_format=True) == (None, "SET FORMAT json answered 'ERROR: Unknown command'")


def test_report_never_closed_times_out_with_what_arrived():
    async def go():
        async def serve(reader, writer):
            for answer in (b"SERVER PROTOCOL 2\n", b"OK\n"):
                await reader.readline()
                writer.write(answer)
            await reader.readline()
            writer.write(TEXT[:100])  # then nothing, the socket open until the client gives up
            await reader.read()
            writer.close()  # Python 3.12+: the server's wait_closed() waits for its connections

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            return await query_ras(server.sockets[0].getsockname()[1], json_format=False, timeout_s=0.5)

    data, error = asyncio.run(go())
    assert data == TEXT[:100]
    assert error == "RAS query timed out after 0.5 s, 100 bytes of report read"
