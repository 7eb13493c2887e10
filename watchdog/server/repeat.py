"""``--on-repeat N/DAYS --on-repeat-exec CMD``: act when a host keeps being named.

When a host is named (culprit, lost node, slow link) in incidents of N different jobs within the last DAYS
days, the command runs once: at the crossing, not at every incident after it.  The host re-arms when the
window slides it under N again (``recheck``, with retention, and at its next naming).  Each run is recorded
on the host's page: when, how many jobs, the command, its exit status and the end of its output.

The command is the operator's, run by ``/bin/sh -c``; what comes from bundles (the host name, job names)
reaches it only in environment variables and as JSON on stdin, never in the command line:
``NCCLWATCH_HOST``, ``NCCLWATCH_REPEAT_JOBS`` (their count), ``NCCLWATCH_REPEAT_DAYS``.  Host names are
checked (``incidents.HOST_RE``) before they are indexed, so ``scontrol update NodeName="$NCCLWATCH_HOST"
State=DRAIN Reason=ncclwatch`` is safe to write.

Failure modes: a command that fails or outlives ``timeout_s`` (killed) is recorded as such and logged;
the crossing is not retried (a drain that failed needs a person, and the host's page says so).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence

from ncclwatch.watchdog.server.incidents import DAY_S, IncidentIndex

log = logging.getLogger("ncclwatch.server")
OUTPUT_KEEP = 2000  # characters of the command's output kept on the host's page


@dataclasses.dataclass
class Repeat:
    index: IncidentIndex
    count: int
    days: float
    command: str
    timeout_s: float = 60.0
    clock: Callable[[], float] = time.time

    async def check(self, hosts: Sequence[str]) -> None:
        """After an upload: run the command for each of ``hosts`` that has just crossed the threshold."""
        for host in hosts:
            jobs = await asyncio.to_thread(self.index.jobs_naming, host, self.clock() - self.days * DAY_S)
            if await asyncio.to_thread(self.index.crossed, host, len(jobs) >= self.count):
                await self.run(host, jobs)

    async def recheck(self) -> None:
        """Re-arm hosts the window has taken under the threshold."""
        for host in await asyncio.to_thread(self.index.hosts_above):
            jobs = await asyncio.to_thread(self.index.jobs_naming, host, self.clock() - self.days * DAY_S)
            if len(jobs) < self.count:
                await asyncio.to_thread(self.index.crossed, host, False)

    async def run(self, host: str, jobs: list[str]) -> None:
        env = os.environ | {
            "NCCLWATCH_HOST": host,
            "NCCLWATCH_REPEAT_JOBS": str(len(jobs)),
            "NCCLWATCH_REPEAT_DAYS": f"{self.days:g}",
        }
        facts = {"host": host, "jobs": jobs, "threshold": self.count, "days": self.days}
        log.warning(
            "%s named in incidents of %d jobs within %g days: running %s", host, len(jobs), self.days, self.command
        )
        status: int | None = None
        try:
            process = await asyncio.create_subprocess_shell(
                self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            output = f"could not start: {exc}"
        else:
            try:
                out, _ = await asyncio.wait_for(process.communicate(json.dumps(facts).encode()), self.timeout_s)
                status, output = process.returncode, out.decode(errors="replace")
            except TimeoutError:
                process.kill()
                await process.wait()
                output = f"killed after {self.timeout_s:g} s"
        if status != 0:
            log.error("--on-repeat-exec for %s: %s", host, f"exit {status}" if status is not None else output)
        await asyncio.to_thread(
            self.index.add_action, host, len(jobs), jobs, self.command, status, output[-OUTPUT_KEEP:]
        )
