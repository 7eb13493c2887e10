"""Ask NCCL's RAS thread (NCCL 2.24+) for its status report.

Every NCCL process of the job listens on 127.0.0.1:28028 (SO_REUSEPORT) and
speaks a line protocol (src/ras/client_support.cc; real 2.28.9 replies)::

    > CLIENT PROTOCOL 2          < SERVER PROTOCOL 2
    > TIMEOUT <s>                < OK      how long the server waits for its peers
    > SET FORMAT json            < OK      2.28.7+, only when JSON is asked for
    > VERBOSE STATUS | STATUS    < the report, then the server closes the socket

The client must not half-close its side after sending (shutdown(SHUT_WR)):
the report would be lost, so the socket is only closed once the server has.

Errors (kept inside; ``query_ras`` returns their ``reason`` as a string)::

    RasQueryError(reason, fatal)
      fatal=False  the handshake got no answer or the server closed before it:
                   the connection landed on a process that cannot answer (a
                   SIGSTOPped rank still completes TCP handshakes) and a new
                   connection may reach another one -> retried once
      fatal=True   refused (no NCCL process here), a wrong answer, or a
                   server too old for JSON -> returned at once
"""

from __future__ import annotations

import asyncio
import contextlib

RAS_PORT = 28028
HANDSHAKE_S = 3.0  # a live RAS thread answers in milliseconds
MAX_REPORT_BYTES = 64 << 20  # bounds memory if something other than NCCL holds the port


class RasQueryError(Exception):
    def __init__(self, reason: str, *, fatal: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


async def query_ras(
    port: int = RAS_PORT,
    host: str = "127.0.0.1",
    *,
    json_format: bool,
    verbose: bool = True,
    timeout_s: float = 8.0,
    server_timeout_s: int = 5,
) -> tuple[bytes | None, str | None]:
    """(report bytes, None), or (what arrived or None, error); never raises.

    The report is returned raw: NCCL 2.28.9 was seen to send malformed JSON,
    ``watchdog.parsing.ras`` copes with it.
    """
    commands = [f"TIMEOUT {server_timeout_s}"]
    if json_format:
        commands.append("SET FORMAT json")
    request = "VERBOSE STATUS" if verbose else "STATUS"
    report = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            try:
                await _dialogue(host, port, commands, request, report)
            except RasQueryError as exc:
                if exc.fatal:
                    raise
                report.clear()
                try:  # a new connection may land on another process
                    await _dialogue(host, port, commands, request, report)
                except RasQueryError as again:
                    raise RasQueryError(f"{again.reason} (on a retry; first try: {exc.reason})") from None
        return bytes(report), None
    except RasQueryError as exc:
        return bytes(report) or None, exc.reason
    except TimeoutError:
        got = f", {len(report)} bytes of report read" if report else ""
        return bytes(report) or None, f"RAS query timed out after {timeout_s:g} s{got}"


async def _dialogue(host: str, port: int, commands: list[str], request: str, report: bytearray) -> None:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        raise RasQueryError(f"no NCCL RAS server on {host}:{port}") from None
    except OSError as exc:
        raise RasQueryError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    try:
        writer.write(b"CLIENT PROTOCOL 2\n")
        try:
            answer = await asyncio.wait_for(reader.readline(), HANDSHAKE_S)
        except TimeoutError:
            raise RasQueryError(f"no answer to CLIENT PROTOCOL within {HANDSHAKE_S:g} s", fatal=False) from None
        if not answer:
            raise RasQueryError("server closed before answering CLIENT PROTOCOL", fatal=False)
        if not answer.startswith(b"SERVER PROTOCOL"):
            raise RasQueryError(f"not a RAS server: answered {_show(answer)}")
        for command in commands:
            writer.write(command.encode() + b"\n")
            answer = await reader.readline()
            if answer.strip() != b"OK":
                raise RasQueryError(f"{command} answered {_show(answer)}")
        writer.write(request.encode() + b"\n")
        while chunk := await reader.read(65536):
            report += chunk
            if len(report) > MAX_REPORT_BYTES:
                raise RasQueryError(f"report larger than {MAX_REPORT_BYTES} bytes: cut")
    except (OSError, ValueError) as exc:  # reset mid-dialogue; ValueError: an answer line over 64 KiB
        raise RasQueryError(f"RAS connection failed: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


def _show(line: bytes) -> str:
    return repr(line.decode(errors="replace").strip()[:120]) if line else "nothing (connection closed)"
