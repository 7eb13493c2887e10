"""sd_notify against a real AF_UNIX datagram socket, as systemd's would be: a path, and the abstract namespace."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from ncclwatch.watchdog.server import sdnotify


class Receiver:
    """The service manager's end: a bound datagram socket and the NOTIFY_SOCKET value that names it."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock, self.address = sock, address
        self.env = {"NOTIFY_SOCKET": address}

    def messages(self, timeout_s: float = 2.0) -> list[str]:
        """Every datagram waiting now (waiting up to timeout_s for the first)."""
        out = []
        self.sock.settimeout(timeout_s)
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except (TimeoutError, BlockingIOError):
                return out
            self.sock.settimeout(0.05)

    def nothing(self) -> bool:
        return self.messages(timeout_s=0.1) == []


@pytest.fixture(params=["path", "abstract"])
def receiver(request, tmp_path) -> Iterator[Receiver]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = tmp_path / "notify"
        sock.bind(str(path))
        address = str(path)
    else:
        name = f"ncclwatch-test-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name.encode())
        address = "@" + name
    try:
        yield Receiver(sock, address)
    finally:
        sock.close()


class TestNotify:
    def test_ready_stopping_status_ping_arrive_as_sent(self, receiver):
        assert sdnotify.ready(receiver.env)
        assert sdnotify.status("serving 3 bundles", receiver.env)
        assert sdnotify.watchdog_ping(receiver.env)
        assert sdnotify.stopping(receiver.env)
        assert receiver.messages() == ["READY=1", "STATUS=serving 3 bundles", "WATCHDOG=1", "STOPPING=1"]

    def test_status_newlines_cannot_start_another_assignment(self, receiver):
        sdnotify.status("bad\nREADY=1", receiver.env)
        assert receiver.messages() == ["STATUS=bad READY=1"]

    def test_outside_systemd_is_a_quiet_false(self):
        assert sdnotify.notify("READY=1", {}) is False
        assert sdnotify.ready({"NOTIFY_SOCKET": ""}) is False

    def test_a_socket_that_is_gone_is_false_not_an_error(self, tmp_path):
        assert sdnotify.ready({"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False
        assert sdnotify.ready({"NOTIFY_SOCKET": "@ncclwatch-nobody-" + uuid.uuid4().hex}) is False

    def test_unsupported_address_is_false(self):
        assert sdnotify.ready({"NOTIFY_SOCKET": "vsock:2:1234"}) is False
        assert sdnotify.ready({"NOTIFY_SOCKET": "relative/path"}) is False


class TestWatchdogInterval:
    def test_from_watchdog_usec(self):
        assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0

    def test_for_this_pid_only(self):
        assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
        assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None

    @pytest.mark.parametrize("usec", [None, "", "0", "-5", "soon"])
    def test_absent_or_bad_is_none(self, usec):
        env = {} if usec is None else {"WATCHDOG_USEC": usec}
        assert sdnotify.watchdog_interval_s(env) is None

    def test_bad_pid_is_none(self):
        assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "init"}) is None


class TestKeepalive:
    def test_pings_every_half_interval(self, receiver):
        async def run() -> None:
            task = asyncio.create_task(sdnotify.keepalive(0.2, receiver.env))
            await asyncio.sleep(0.45)  # pings at 0, 0.1, 0.2, 0.3, 0.4
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        pings = receiver.messages()
        assert set(pings) == {"WATCHDOG=1"}
        assert 3 <= len(pings) <= 6  # 5 on time; fewer when a loaded machine oversleeps

    def test_interval_must_be_positive(self):
        with pytest.raises(ValueError):
            asyncio.run(sdnotify.keepalive(0))


class TestLifecycle:
    def test_ready_pings_then_stopping_when_stop_is_set(self, receiver):
        env = {**receiver.env, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}

        async def run() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(sdnotify.systemd_lifecycle(stop, status_text="serving", env=env))
            await asyncio.sleep(0.25)
            stop.set()
            await asyncio.wait_for(task, 2)

        asyncio.run(run())
        messages = receiver.messages()
        assert messages[0] == "READY=1\nSTATUS=serving"
        assert messages[-1] == "STOPPING=1"
        assert messages[1:-1] and set(messages[1:-1]) == {"WATCHDOG=1"}

    def test_no_watchdog_configured_means_no_pings(self, receiver):
        async def run() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(sdnotify.systemd_lifecycle(stop, env=receiver.env))
            await asyncio.sleep(0.1)
            stop.set()
            await task

        asyncio.run(run())
        assert receiver.messages() == ["READY=1", "STOPPING=1"]

    def test_cancelled_still_says_stopping_and_stops_pinging(self, receiver):
        env = {**receiver.env, "WATCHDOG_USEC": "100000"}

        async def run() -> None:
            task = asyncio.create_task(sdnotify.systemd_lifecycle(asyncio.Event(), env=env))
            await asyncio.sleep(0.12)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.15)  # a ping task left behind would send again here

        asyncio.run(run())
        messages = receiver.messages()
        assert messages[0] == "READY=1" and messages[-1] == "STOPPING=1"
        assert receiver.nothing()

    def test_outside_systemd_just_waits_for_stop(self):
        async def run() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(sdnotify.systemd_lifecycle(stop, env={"WATCHDOG_USEC": "100000"}))
            await asyncio.sleep(0.05)
            assert not task.done()
            stop.set()
            await asyncio.wait_for(task, 1)

        asyncio.run(run())
