"""``ncclwatch [OPTIONS] torchrun ...``: run the job as torchrun would, with the sidecar beside it.

The wiring only: make the run folder, with ``--preflight`` measure the node's bus bandwidth (``busbw``), start
torchrun with the injected environment (its own output, signals forwarded, its stderr read as it goes by:
``sources/job_output.py``), build the sidecar with its sources, prober, bundle writer and response, and hand all of
it to ``JobWatch`` (``job_watch.py``), which owns the job's life from there: startup, the wait, and the shutdown
(the verdict of a failed job, the summary, the run folder) up to the wrapper's exit status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp

from ncclwatch.launcher import busbw
from ncclwatch.launcher.command import max_restarts_of, torchrun_log_dir
from ncclwatch.launcher.env import RunDirs, injected_env
from ncclwatch.launcher.job_watch import JobWatch
from ncclwatch.launcher.process import JobProcess
from ncclwatch.launcher.respond import JobResponder, start_notes
from ncclwatch.watchdog.cluster.peers import Cluster, Membership
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.live.bundle import BundleWriter
from ncclwatch.watchdog.live.job import LiveView
from ncclwatch.watchdog.live.journal import Journal
from ncclwatch.watchdog.live.performance_look import PerfWatch, perf_watch
from ncclwatch.watchdog.live.prober import JobProber, comm_errored
from ncclwatch.watchdog.live.runfolder import make_run_folder
from ncclwatch.watchdog.live.sidecar import Reporter, Sidecar
from ncclwatch.watchdog.live.supervision import Source
from ncclwatch.watchdog.probes.procfs import listens_on
from ncclwatch.watchdog.sinks.delivery import Dispatcher, sinks_from_settings, spool_dir_for
from ncclwatch.watchdog.sources.files import HeartbeatSource, NcclFileSource
from ncclwatch.watchdog.sources.job_output import JobOutputSource
from ncclwatch.watchdog.sources.kmsg import KmsgSource
from ncclwatch.watchdog.sources.nvml import NvmlSource
from ncclwatch.watchdog.sources.workers import WorkerSource

log = logging.getLogger("ncclwatch")


def run_job(command: list[str], settings: Settings, job_name: str) -> int:
    return asyncio.run(_run(command, settings, job_name))


async def _run(command: list[str], settings: Settings, job_name: str) -> int:
    async with Alerts(settings) as alerts:
        return await _watch(command, settings, job_name, alerts)


class Alerts:
    """The alert dispatcher for the job's lifetime; after the job, undelivered alerts are retried (bounded)."""

    QUIET_S = 3.0  # a delivery that takes longer than this after the job is announced

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None

    async def __aenter__(self) -> Alerts:
        self.session = aiohttp.ClientSession()
        sinks = sinks_from_settings(self.settings, self.session)
        if sinks:
            self.dispatcher = Dispatcher(sinks, spool_dir_for(self.settings))
            await self.dispatcher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.dispatcher is not None:
            await self._deliver_before_exit(self.dispatcher)
            await self.dispatcher.close()
        if self.session is not None:
            await self.session.close()

    async def _deliver_before_exit(self, dispatcher: Dispatcher) -> None:
        """Retry for ``alert_drain_timeout`` s, saying so; Ctrl-C or SIGTERM stops the wait, never the alerts.

        Whatever is left stays in the spool (under a file lock only while this
        process sends it), where ``ncclwatch serve`` on the node delivers it.
        """
        budget = self.settings.alert_drain_timeout
        if await dispatcher.drain(min(self.QUIET_S, budget)):
            return
        spool = spool_dir_for(self.settings)
        if budget > self.QUIET_S:
            print(
                f"ncclwatch: {dispatcher.pending()} alert(s) not delivered yet (the receiver does not answer); "
                f"retrying for up to {budget:g} s (--alert-drain-timeout); Ctrl-C stops waiting",
                file=sys.stderr,
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            drained = asyncio.create_task(dispatcher.drain(budget - self.QUIET_S))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({drained, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if drained.done() and drained.result():
                print("ncclwatch: alerts delivered", file=sys.stderr, flush=True)
                return
            drained.cancel()
        print(
            f"ncclwatch: {dispatcher.pending()} alert(s) still not delivered; they wait in {spool}: "
            "`ncclwatch serve` on this node (the systemd agent) sends them as soon as the receiver answers, "
            "else the next job here does",
            file=sys.stderr,
            flush=True,
        )


def _sidecar(
    settings: Settings,
    dirs: RunDirs,
    torchrun_pid: int,
    job_name: str,
    host: str,
    reporter: Reporter,
    dispatcher: Dispatcher | None,
    prober: JobProber | None = None,
    perf: PerfWatch | None = None,
    responder: JobResponder | None = None,
    output: JobOutputSource | None = None,
    bundle_for: Callable[[Report, LiveView], Path | None] | None = None,
) -> Sidecar:
    """The sidecar with its real sources, prober, journal and performance look."""
    poll = settings.poll_interval
    sources: list[Source] = [
        WorkerSource(torchrun_pid, interval=poll, host=host),
        NcclFileSource(dirs.nccl, interval=poll),
        HeartbeatSource(dirs.hb, interval=poll),
        NvmlSource(),
        KmsgSource(host=host),  # the GPU driver's Xids, where this user may read the kernel log
    ]
    if output is not None:
        sources.append(output)
    prober = prober or JobProber(dirs.fr, settings.pyspy, ras_port=settings.ras_port)

    def join_cluster(membership: Membership, host: str) -> Cluster:
        return Cluster(membership, host, serves_store=listens_on(torchrun_pid, membership.store_port))

    sidecar = Sidecar(
        settings,
        job_name,
        sources,
        prober,
        reporter,
        journal=Journal(dirs.journal),
        out=sys.stderr,
        dispatcher=dispatcher,
        host=host,
        join_cluster=join_cluster,
        perf=perf,
        responder=responder,
        bundle_for=bundle_for or (lambda report, view: None),
    )
    # RAS is asked only on NCCL versions known to survive it: the versions the job's NCCL logs name.
    prober.nccl_versions = lambda: {p.nccl_version for p in sidecar.live.state.procs.values() if p.nccl_version}
    prober.nccl_errored = lambda: comm_errored(sidecar.live.state.warnings)
    prober.nccl_logged = lambda: any(dirs.nccl.iterdir())
    return sidecar


async def _watch(command: list[str], settings: Settings, job_name: str, alerts: Alerts) -> int:
    root = make_run_folder(settings)  # on disk, with its space cap (issue 45); says where when that may hurt
    dirs = RunDirs.create(root)
    job = JobProcess()
    baseline = await busbw.before_job(dirs.root) if settings.preflight else None
    env = injected_env(os.environ, dirs, wrapper_pid=os.getpid())
    output = JobOutputSource(dirs.root / "output")
    job.start(command, env, hide_shutdown_noise=settings.on_hang != "report", stderr_tap=output.feed)
    job.forward_signals(asyncio.get_running_loop())
    max_restarts = max_restarts_of(command, os.environ)
    for note in start_notes(settings, max_restarts):
        print(f"ncclwatch: {note}", file=sys.stderr, flush=True)
    responder = JobResponder(settings, job, max_restarts)

    host = socket.gethostname().split(".")[0]
    log_dir = torchrun_log_dir(command)
    prober = JobProber(dirs.fr, settings.pyspy, ras_port=settings.ras_port)
    perf = perf_watch(settings.perf_interval, dirs.fr, dirs.nccl)
    write_bundle = BundleWriter(
        settings,
        dirs.root,
        job_name,
        host,
        Path(log_dir) if log_dir else None,
        prober.unanswered,
        perf.findings,
        prober.ras_withheld,
        [busbw.bundle_note(settings.on_hang)] if settings.preflight else [],
    )
    sidecar = _sidecar(
        settings,
        dirs,
        job.pid,
        job_name,
        host,
        write_bundle,
        alerts.dispatcher,
        prober,
        perf,
        responder,
        output,
        write_bundle.bundle_for,
    )

    async def after_kill(bundle: Path) -> None:
        await busbw.after_kill(baseline, bundle)

    watch = JobWatch(
        settings,
        job,
        sidecar,
        dirs.root,
        output,
        ended_by=lambda: responder.ended,
        after_kill=after_kill if settings.preflight else None,
    )
    return await watch.serve()
