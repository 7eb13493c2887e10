"""sd_notify without libsystemd: tell systemd that the agent is ready, alive, stopping.

The protocol (sd_notify(3)): one datagram of newline-separated ``VAR=VALUE``
assignments to the AF_UNIX socket named in ``$NOTIFY_SOCKET``; a file system
path, or an abstract-namespace name written with a leading ``@`` (sent with a
leading NUL byte).  Outside systemd (``NOTIFY_SOCKET`` unset) every call is a
no-op returning False, so the same code runs in a terminal.

Lifecycle, for ``ncclwatch serve`` under ``Type=notify`` + ``WatchdogSec=``::

    stop = asyncio.Event()
    ... bind the listener ...
    lifecycle = asyncio.create_task(systemd_lifecycle(stop))   # READY=1, then WATCHDOG=1 every WatchdogSec/2
    ... serve until a signal sets stop ...                     # STOPPING=1 once stop is set (or on cancel)

Failure modes: nothing here raises for a missing, gone or full socket (a
notification is advisory; ``notify`` returns False and logs at debug).  The
watchdog pings come from a task on the event loop, so a loop blocked for
``WatchdogSec`` stops them and systemd restarts the agent: that is the point.

Traps: ``STATUS=`` text with a newline would start a new assignment, so
newlines become spaces.  ``WATCHDOG_USEC`` is meant for ``WATCHDOG_PID`` only
when that is set (a child that inherited the environment must not ping).
``NOTIFY_SOCKET`` is left in the environment, so children inherit it; the unit
sets ``NotifyAccess=main`` so systemd ignores anything they send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("ncclwatch")

SEND_TIMEOUT_S = 2.0


def notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send one notification; True when the datagram went out, False outside systemd or on any error."""
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        target = b"\0" + os.fsencode(address[1:])
    elif address.startswith("/"):
        target = os.fsencode(address)
    else:  # vsock:CID:PORT (systemd 254+ in VMs) and anything else: not for a node agent
        log.debug("sd_notify: unsupported NOTIFY_SOCKET %r", address)
        return False
    data = message.encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(target)
            sent = sock.send(data)
    except OSError as exc:
        log.debug("sd_notify %r to %s failed: %s", message, address, exc)
        return False
    return sent == len(data)


def ready(env: Mapping[str, str] = os.environ) -> bool:
    return notify("READY=1", env)


def stopping(env: Mapping[str, str] = os.environ) -> bool:
    return notify("STOPPING=1", env)


def status(text: str, env: Mapping[str, str] = os.environ) -> bool:
    return notify("STATUS=" + _one_line(text), env)


def watchdog_ping(env: Mapping[str, str] = os.environ) -> bool:
    return notify("WATCHDOG=1", env)


def watchdog_interval_s(env: Mapping[str, str] = os.environ) -> float | None:
    """``WatchdogSec=`` in seconds when systemd expects pings from this process, else None."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1_000_000


async def keepalive(interval_s: float, env: Mapping[str, str] = os.environ) -> None:
    """Send ``WATCHDOG=1`` now and every ``interval_s / 2`` (sd_watchdog_enabled(3)'s advice) until cancelled."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")
    while True:
        watchdog_ping(env)
        await asyncio.sleep(interval_s / 2)


async def systemd_lifecycle(
    stop_event: asyncio.Event, *, status_text: str | None = None, env: Mapping[str, str] = os.environ
) -> None:
    """READY=1 now, watchdog pings while ``stop_event`` is unset, STOPPING=1 when it is set (or on cancel).

    Start it once the listener is bound: READY=1 is what ends ``systemctl
    start`` for ``Type=notify``, and units ordered after this one start then.
    """
    notify("READY=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""), env)
    interval = watchdog_interval_s(env)
    pings = asyncio.create_task(keepalive(interval, env), name="sd_notify:watchdog") if interval else None
    try:
        await stop_event.wait()
    finally:
        if pings is not None:
            pings.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pings
        stopping(env)


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())
