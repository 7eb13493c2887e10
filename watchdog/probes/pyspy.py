"""``py-spy dump --json`` of one process, bounded, never leaving it stopped.

Two modes (py-spy cannot combine them):

- default, ``--nonblocking``: reads the interpreter's memory while the
  process runs; works on a SIGSTOPped process too; Python frames only.
- ``native=True``: ptrace-attaches and stops every thread while it unwinds
  C/C++/CUDA frames.  A py-spy killed mid-attach (timeout, cancellation)
  can leave the process in group stop: PTRACE_ATTACH queues a SIGSTOP that
  is delivered once the tracer is gone.  So after a native dump, and after
  any timeout, the state is read again and a process that was running before
  and is stopped now gets SIGCONT (after a kill, also one that still reads
  as running: its stop may be pending).  A process stopped *before* (a SIGSTOPped
  culprit) is never attached to and never resumed: it stays as found.

Nothing raises: a missing binary, "Permission Denied" (no CAP_SYS_PTRACE,
another user), a vanished process or a timeout come back as a short error
string.  The second element of the result is an error when the first is
None, and a warning (the SIGCONT) when a dump came back anyway.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

from ncclwatch.watchdog.events import STOPPED_STATES
from ncclwatch.watchdog.probes.procfs import proc_state

ERROR_CHARS = 240


def find_pyspy(explicit: str | None = None) -> str | None:
    """The given path only (no fallback: a wrong explicit path must show), else PATH, else beside python."""
    if explicit is not None:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("py-spy")
    if found:
        return found
    # pip installs py-spy into the interpreter's bin folder, which an unactivated venv keeps off PATH
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if os.access(beside, os.X_OK) else None


async def pyspy_dump(
    pid: int, *, native: bool = False, timeout_s: float = 5.0, pyspy: str | None = None
) -> tuple[bytes | None, str | None]:
    exe = find_pyspy(pyspy)
    if exe is None:
        return None, f"py-spy not found at {pyspy}" if pyspy else "py-spy not found (PATH, beside python)"
    before = proc_state(pid)
    if before is None:
        return None, f"process {pid} not found"
    if native and before in STOPPED_STATES:
        return None, f"process {pid} is stopped (state {before}): native dump not attempted, left as found"
    mode = "--native" if native else "--nonblocking"
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "dump",
            "--pid",
            str(pid),
            "--json",
            mode,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        return None, f"cannot run {exe}: {exc.strerror or exc}"
    out, error, killed = b"", None, False
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        error = _failure(proc.returncode, out, err)
    except TimeoutError:
        error = f"py-spy {mode} timed out after {timeout_s:g} s"
    finally:
        # also on cancellation: py-spy must not outlive us attached to a rank
        if proc.returncode is None:
            killed = True
            proc.kill()
            await proc.wait()
        # a nonblocking py-spy that exited by itself never attached: a stop seen now is not ours to undo
        resumed = _resume_if_left_stopped(pid, before, killed=killed) if native or killed else None
    data = out if error is None else None
    return data, "; ".join(m for m in (error, resumed) if m) or None


def _failure(returncode: int | None, out: bytes, err: bytes) -> str | None:
    if returncode == 0 and out.lstrip().startswith(b"["):
        return None
    lines = [line.strip() for line in err.decode(errors="replace").splitlines() if line.strip()]
    # py-spy prints "Error: <what>", then "Caused by:" and an anyhow backtrace; keep the what and first cause
    head = next((line for line in lines if line.startswith("Error:")), lines[0] if lines else "")
    if "Caused by:" in lines:
        cause = lines.index("Caused by:") + 1
        if cause < len(lines):
            head += f" ({lines[cause].lstrip('0123456789: ')})"
    if not head:
        head = "no JSON on stdout"
    return f"py-spy exited {returncode}: {head.removeprefix('Error: ')}"[:ERROR_CHARS]


def _resume_if_left_stopped(pid: int, before: str, *, killed: bool = False) -> str | None:
    """SIGCONT a process that py-spy left stopped; one that was stopped before stays stopped.

    After killing py-spy mid-attach the queued SIGSTOP may not be delivered
    yet (the process still reads as running): SIGCONT is sent anyway, as it
    discards a pending stop signal, and is harmless to a running process.
    """
    after = proc_state(pid)
    if before in STOPPED_STATES or after is None or not (after in STOPPED_STATES or killed):
        return None
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError as exc:
        return f"process {pid} left in state {after} after py-spy; SIGCONT failed: {exc.strerror}"
    return f"process {pid} left in state {after} after py-spy: sent SIGCONT" if after in STOPPED_STATES else None
