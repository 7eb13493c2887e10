"""Run an outside command with a deadline: the scheduler's (``scontrol``) or the user's hook."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TAIL_CHARS = 400  # of its output, kept for the report


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: not started, or killed at the deadline
    output: str  # stdout and stderr, the last TAIL_CHARS
    error: str | None = None  # why it did not run to the end

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0

    def describe(self, name: str) -> str:
        said = f": {self.output.strip()}" if self.output.strip() else ""
        if self.error is not None:
            return f"{name} {self.error}{said}"
        return f"{name} exit {self.returncode}{said}"


async def run_bounded(
    argv: Sequence[str], timeout_s: float, stdin: bytes = b"", env: Mapping[str, str] | None = None
) -> Outcome:
    """Run ``argv`` in a session of its own; at the deadline SIGKILL its whole process group."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except OSError as exc:
        return Outcome(None, "", f"could not start ({exc.strerror or exc})")
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate(stdin)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return Outcome(None, "", f"still running after {timeout_s:g} s: killed")
    return Outcome(proc.returncode, out.decode(errors="replace")[-TAIL_CHARS:])
