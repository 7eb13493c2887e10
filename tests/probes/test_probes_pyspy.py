"""py-spy probe against real processes: stacks, stopped ranks left as found, errors as strings."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import sleepers, wait_state

from ncclwatch.watchdog.probes.procfs import proc_state
from ncclwatch.watchdog.probes.pyspy import _resume_if_left_stopped, find_pyspy, pyspy_dump

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")


def frames(data: bytes) -> list[str]:
    return [f["name"] for thread in json.loads(data) for f in thread["frames"]]


def dump(pid: int, **kw) -> tuple[bytes | None, str | None]:
    return asyncio.run(pyspy_dump(pid, **kw))


def test_nonblocking_dump_shows_the_python_frame():
    with sleepers(1) as (proc,):
        data, error = dump(proc.pid)
        assert error is None
        assert "sleeping_here" in frames(data)
        assert json.loads(data)[0]["pid"] == proc.pid


def test_native_dump_shows_the_c_frame_and_leaves_the_process_running():
    with sleepers(1) as (proc,):
        data, error = dump(proc.pid, native=True)
        assert error is None
        names = frames(data)
        assert "sleeping_here" in names and any("sleep" in n and n != "sleeping_here" for n in names)
        assert proc_state(proc.pid) == "S"


def test_stopped_process_nonblocking_dump_works_and_it_stays_stopped():
    with sleepers(1, stopped=(0,)) as (proc,):
        data, error = dump(proc.pid)
        assert error is None and "sleeping_here" in frames(data)
        assert proc_state(proc.pid) == "T"


def test_stopped_process_gets_no_native_dump_and_stays_stopped():
    with sleepers(1, stopped=(0,)) as (proc,):
        data, error = dump(proc.pid, native=True)
        assert data is None and "stopped (state T)" in error and "left as found" in error
        assert proc_state(proc.pid) == "T"


def test_timeout_kills_pyspy_and_leaves_the_process_running():
    with sleepers(1) as (proc,):
        data, error = dump(proc.pid, native=True, timeout_s=0.001)
        assert data is None and "timed out after 0.001 s" in error
        assert wait_state(proc.pid, "S", timeout_s=1.0) == "S"


def test_process_left_stopped_by_the_tool_is_resumed():
    """What a py-spy killed mid-attach leaves behind (a queued SIGSTOP delivered), made real by hand."""
    with sleepers(1) as (proc,):
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_state(proc.pid, "T") == "T"
        message = _resume_if_left_stopped(proc.pid, before="S")
        assert message == f"process {proc.pid} left in state T after py-spy: sent SIGCONT"
        assert wait_state(proc.pid, "S") == "S"


def test_process_stopped_before_is_never_resumed():
    with sleepers(1, stopped=(0,)) as (proc,):
        assert _resume_if_left_stopped(proc.pid, before="T") is None
        assert proc_state(proc.pid) == "T"


def test_missing_tool_and_missing_process_are_error_strings(tmp_path):
    with sleepers(1) as (proc,):
        assert dump(proc.pid, pyspy=str(tmp_path / "py-spy")) == (None, f"py-spy not found at {tmp_path}/py-spy")
    assert dump(proc.pid) == (None, f"process {proc.pid} not found")


def test_tool_failure_is_a_short_error(tmp_path):
    """py-spy on a process that is not Python: its own words, without the backtrace."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        wait_state(sleeper.pid, "S")
        data, error = dump(sleeper.pid)
        assert data is None and error.startswith("py-spy exited 1: ") and "Stack backtrace" not in error
        assert len(error) <= 240
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists(),
    reason="needs root, setpriv and a system python to build the no-CAP_SYS_PTRACE case",
)
def test_no_ptrace_permission_is_an_error_string():
    """Without CAP_SYS_PTRACE, another user's process cannot be read: the probe says so, it does not raise."""
    target = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            "print('ready', flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert target.stdout.readline() == b"ready\n"
        probe = "import asyncio, sys; from watchdog.probes.pyspy import pyspy_dump; "
        probe += f"print(asyncio.run(pyspy_dump({target.pid}, pyspy={find_pyspy()!r})))"
        out = subprocess.run(
            ["setpriv", "--bounding-set", "-sys_ptrace", sys.executable, "-c", probe],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=Path(__file__).parents[2],
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("(None, 'py-spy exited 1: ") and "Permission denied" in out.stdout
    finally:
        target.kill()
        target.wait()
        target.stdout.close()


def test_find_pyspy_explicit_path_has_no_fallback(tmp_path):
    assert find_pyspy(str(tmp_path / "nope")) is None
    assert find_pyspy() is not None


def test_after_a_kill_a_running_process_gets_a_silent_sigcont():
    """After killing py-spy its SIGSTOP may still be queued: SIGCONT discards it, and a running process runs on."""
    with sleepers(1) as (proc,):
        assert _resume_if_left_stopped(proc.pid, before="S", killed=True) is None  # running: nothing to report
        assert proc_state(proc.pid) == "S"
