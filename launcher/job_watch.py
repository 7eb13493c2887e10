"""One job's watch from start to end, as uvicorn's ``Server``: ``startup -> main_loop -> shutdown(end)``.

``JobWatch`` owns what lives as long as the job: the sidecar's task, the metrics textfile writer and the bundle,
status and metrics server.  The launcher (``run.py``) only builds the parts and awaits ``serve``.

- ``startup`` starts the server (a port that cannot be bound is said, and the job runs without it), the textfile
  writer and the sidecar.
- ``main_loop`` waits for torchrun and says how the job ended (``JobEnd``): cleanly, failed, stopped by the user
  (a signal the wrapper passed on), or ended by ncclwatch's own response to a hang (kill, drain).
- ``shutdown`` is bounded and ordered by what each step needs: the other nodes hear of the end first (a failure
  after the store's node went is that node lost), then the sidecar judges a failed job while its files are still
  there, then the sidecar and the server stop, what the job left behind is reaped, the bus-bandwidth check runs
  after a kill, alerts of a job that ended cleanly are resolved, the summary is said, and the run folder goes (the
  bundle holds the evidence).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from aiohttp import web
from prometheus_client import CollectorRegistry

from ncclwatch.launcher.process import JobProcess, exit_status
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import JobEnded, JobOutcome
from ncclwatch.watchdog.hang.report import EXIT_DRAINED, EXIT_KILLED_ON_HANG
from ncclwatch.watchdog.live.responding import Reported
from ncclwatch.watchdog.live.sidecar import Sidecar
from ncclwatch.watchdog.response.policy import Plan, Response
from ncclwatch.watchdog.server.app import make_app, start_server, stop_server
from ncclwatch.watchdog.server.metrics import HealthCollector, TextfileWriter
from ncclwatch.watchdog.sources.job_output import JobOutputSource

SIDECAR_STOP_S = 10.0  # the sidecar's own stop (tasks cancelled, the store left) takes at most this long


@dataclass
class JobWatch:
    settings: Settings
    job: JobProcess
    sidecar: Sidecar
    run_dir: Path
    output: JobOutputSource | None = None  # the job's stderr as it went by
    # The plan that ended the job (``JobResponder.ended``): a kill or drain after a hang, for the exit status.
    ended_by: Callable[[], Plan | None] = lambda: None
    # After a job ncclwatch ended, with the bundle of the hang: the preflight's second bus-bandwidth measurement.
    after_kill: Callable[[Path], Awaitable[None]] | None = None
    out: TextIO = field(default_factory=lambda: sys.stderr)

    def __post_init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._watching: asyncio.Task[None] | None = None

    async def serve(self) -> int:
        """The job's life under watch; the wrapper's exit status."""
        await self.startup()
        end = await self.main_loop()
        await self.shutdown(end)
        return self.exit_status(end)

    async def startup(self) -> None:
        await self._start_operations()
        self._watching = asyncio.create_task(self.sidecar.run(), name="sidecar")

    async def main_loop(self) -> JobEnded:
        returncode = await self.job.wait()
        at = self.sidecar.clock()
        await self.job.output_settled()  # torchrun's failure summary: its last lines, still in the pipe
        if self.output is not None:
            await self.output.caught_up(self.sidecar.emit)
        plan = self.ended_by()
        if plan is not None:
            outcome = JobOutcome.ended
        elif returncode == 0:
            outcome = JobOutcome.clean
        elif self.job.stopped_by is not None:
            outcome = JobOutcome.stopped
        else:
            outcome = JobOutcome.failed
        return JobEnded(outcome=outcome, returncode=returncode, at=at)

    async def shutdown(self, end: JobEnded) -> None:
        sidecar = self.sidecar
        # The other nodes first: a job that failed after the store's node went is that node lost (one page from one
        # survivor), which the failure stage, blind to the other nodes, would read as its own rank's death.
        await sidecar.farewell(job_failed=end.outcome is JobOutcome.failed)
        await sidecar.job_ended(end)
        sidecar.stop()
        if self._watching is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._watching, SIDECAR_STOP_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await stop_server(self._runner)
        leftovers = self.job.reap_orphans()
        self.job.close_stderr()
        if leftovers:
            self._say(f"killed {len(leftovers)} process(es) the job left behind: {leftovers}")
        bundle = next((r.bundle for r in sidecar.reported if r.bundle), None)
        if end.outcome is JobOutcome.ended and self.after_kill is not None and bundle is not None:
            await self.after_kill(bundle)  # the job and its ranks are gone: the GPUs are free again
        if end.outcome is JobOutcome.clean:
            for reported in sidecar.reported:
                sidecar.resolve(reported, "the job ended cleanly")
        if sidecar.performance is not None:
            sidecar.performance.resolve(why="the job ended (a slow link or port may still need a look)")
        for reported in sidecar.reported:
            self._say(_summary(reported))
        self._leave_run_dir()

    def exit_status(self, end: JobEnded) -> int:
        """torchrun's, as a shell gives it; after ncclwatch ended the job, the status of that response."""
        plan = self.ended_by()
        if end.outcome is JobOutcome.ended and plan is not None:
            return EXIT_DRAINED if plan.response is Response.drain else EXIT_KILLED_ON_HANG
        return exit_status(end.returncode)

    async def _start_operations(self) -> None:
        """The job's metrics (server and/or textfile) and bundle API, when configured."""
        settings = self.settings
        registry = CollectorRegistry(auto_describe=False)
        registry.register(HealthCollector(self.sidecar.health))
        if settings.metrics_textfile is not None:
            writer = TextfileWriter().run(registry, settings.metrics_textfile)
            self._tasks.append(asyncio.create_task(writer, name="metrics:textfile"))
        if settings.listen is None:
            return
        app = make_app(settings.bundle_dir, token=settings.token(), registry=registry, health=self.sidecar.health)
        try:
            self._runner, bound = await start_server(app, settings.listen)
        except OSError as exc:
            self._say(f"cannot serve on {settings.listen} ({exc.strerror or exc}); the job runs without it")
            return
        self.sidecar.bundle_base_url = settings.public_url or f"http://{bound}"
        self._say(f"bundles, status and metrics on http://{bound}/")

    def _leave_run_dir(self) -> None:
        """The bundle holds what an incident needs; the run folder stays only when asked for (or given)."""
        if self.settings.keep_run_dir or self.settings.run_dir is not None:
            self._say(f"run folder kept: {self.run_dir}")
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _say(self, text: str) -> None:
        print(f"ncclwatch: {text}", file=self.out, flush=True)


def _summary(reported: Reported) -> str:
    culprits = ", ".join(map(str, reported.report.culprit_ranks)) or "-"
    return f"{reported.report.verdict.value} (culprit rank {culprits}); bundle: {reported.bundle or 'not written'}"
