"""Prometheus metrics: one collector that reads the job's ``Health`` at scrape time, and a textfile writer.

``HealthCollector`` keeps no copy of the state: every ``collect`` calls
``health()`` (the sidecar's ``Sidecar.health``) and turns the plain values into
metric families, so a scrape always sees the latest state.  Register it on an
injected ``CollectorRegistry``; ``/metrics`` and ``TextfileWriter`` render
that registry.

Names are ``ncclwatch_<what>_<unit>``; labels, where they apply:

* ``job_name``: the job's name (``--job-name``, default the training
  script's).  Not ``job``: Prometheus gives every scraped series its target's
  ``job`` label and renames a clashing one to ``exported_job``
  (``honor_labels: false``, the default), and node_exporter's textfile
  series would all read ``job="node"``.  kube-state-metrics names its Jobs
  ``job_name`` for the same reason.
* ``host``: the node whose sidecar reports (``Health.host``).
* ``slurm_job_id``: only when the process runs under Slurm (``SLURM_JOB_ID``),
  as the alerts do.
* ``rank`` (global rank), ``communicator`` (a human label), ``source``,
  ``verdict``, ``culprit_ranks`` (comma-separated, empty when none),
  ``op`` (NCCL's spelling), ``port`` (``mlx5_0/1``), and on
  ``ncclwatch_perf_finding_info`` ``kind``, ``key``, ``ranks``, ``links``.

Failure modes guarded here:

* ``health()`` raises, or a ``Health`` holds something that cannot be
  rendered: ``collect`` never raises (a raise fails the whole scrape, and with
  it every other collector on the registry).  It yields ``ncclwatch_up 0`` and
  ``ncclwatch_collector_errors_total`` instead, and logs the first failure
  with its traceback.
* Two ranks or two communicators with one label set would make a duplicate
  series, which makes Prometheus reject the whole scrape: the first is kept.
* ``collect`` must run on the thread that owns the sidecar's state (the
  asyncio loop): ``LiveJob`` holds plain dicts that the loop mutates, and a
  walk from another thread can raise "dictionary changed size during
  iteration".  So ``TextfileWriter`` renders on the loop and only writes the
  file in a worker thread; a ``/metrics`` handler must likewise call
  ``generate_latest`` on the loop, never in an executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ncclwatch.watchdog.live.health import Health
from ncclwatch.watchdog.slowness.findings import PerfKind

log = logging.getLogger("ncclwatch")

JOB_LABEL = "job_name"
# The sidecar's sources (launcher/run.py _sidecar); Health names only those that are down.
SOURCES: tuple[str, ...] = ("workers", "nccl_log", "heartbeat", "nvml", "kmsg", "job_output")


class HealthCollector(Collector):
    """The job's ``Health`` as metric families, read at scrape time.

    ``health`` (``Sidecar.health``) returns None while there is no job yet:
    then only ``ncclwatch_up 1`` and the error counter are exported.
    """

    def __init__(
        self,
        health: Callable[[], Health | None],
        *,
        sources: Sequence[str] = SOURCES,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self._health = health
        self._sources = tuple(sources)
        self._slurm_job_id = environ.get("SLURM_JOB_ID") or None
        self._lock = threading.Lock()
        self.errors = 0
        self._failing = False
        # The job labels of the last good read: ncclwatch_up and the error counter carry them, so two
        # jobs' textfiles on one node never export the same series (node_exporter would fail the scrape).
        self._identity: dict[str, str] = {}

    def describe(self) -> Iterable[Metric]:
        """Every family's name, without calling ``health()``: registering two on one registry fails loudly."""
        for name, kind in _FAMILIES.items():
            yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, _HELP[name])

    def collect(self) -> Iterable[Metric]:
        try:
            health = self._health()
            families = [] if health is None else self._families(health)
        except Exception:
            with self._lock:
                self.errors += 1
                first = not self._failing
                self._failing = True
            if first:  # every scrape fails alike until it recovers: one traceback, not one per scrape
                log.warning("metrics: reading the job's health failed; exporting ncclwatch_up 0", exc_info=True)
            else:
                log.debug("metrics: reading the job's health failed again", exc_info=True)
            return self._self_metrics(up=False)
        with self._lock:
            self._failing = False
            if health is not None:
                self._identity = self._labels(health)
        return families + self._self_metrics(up=True)

    # -- families ---------------------------------------------------------

    def _labels(self, health: Health) -> dict[str, str]:
        labels = {JOB_LABEL: health.job, "host": health.host}
        if self._slurm_job_id:
            labels["slurm_job_id"] = self._slurm_job_id
        return labels

    def _families(self, health: Health) -> list[Metric]:
        base = self._labels(health)
        out = _Families(base)
        for pos in health.positions:
            out.add("ncclwatch_rank_last_op_position", pos.position, communicator=pos.communicator, rank=str(pos.rank))
        for r in health.ranks:
            rank = str(r.rank)
            if r.heartbeat_age_s is not None:
                out.add("ncclwatch_heartbeat_age_seconds", max(0.0, r.heartbeat_age_s), rank=rank)
            if r.progress_age_s is not None:
                out.add("ncclwatch_progress_age_seconds", max(0.0, r.progress_age_s), rank=rank)
            if r.step is not None:
                out.add("ncclwatch_rank_step", r.step, rank=rank)
            if r.state is not None:
                out.add("ncclwatch_rank_process_stopped", 1 if r.state == "T" else 0, rank=rank)
        out.add("ncclwatch_hang", 1 if health.hang else 0)
        out.add("ncclwatch_stalled_seconds", max(0.0, health.stalled_for_s))
        out.add("ncclwatch_stall_timeout_seconds", health.stall_timeout_s)
        if health.verdict is not None:
            culprits = ",".join(str(c) for c in sorted(health.culprits))
            out.add("ncclwatch_verdict_info", 1, verdict=health.verdict, culprit_ranks=culprits)
        out.add("ncclwatch_bundles_written", health.bundles_written)
        out.add("ncclwatch_restarts", health.restarts)
        down = {entry.partition(":")[0].strip() for entry in health.sources_down}
        for source in sorted(set(self._sources) | down):
            out.add("ncclwatch_source_up", 0 if source in down else 1, source=source)
        _perf_series(out, health)
        return out.families()

    def _self_metrics(self, *, up: bool) -> list[Metric]:
        with self._lock:
            identity, errors = dict(self._identity), self.errors
        names, values = list(identity), list(identity.values())
        up_family = GaugeMetricFamily("ncclwatch_up", _HELP["ncclwatch_up"], labels=names)
        up_family.add_metric(values, 1 if up else 0)
        errors_family = CounterMetricFamily(
            "ncclwatch_collector_errors", _HELP["ncclwatch_collector_errors"], labels=names
        )
        errors_family.add_metric(values, errors)
        return [up_family, errors_family]


# name -> type; counters are exported with "_total" appended.
_FAMILIES: dict[str, str] = {
    "ncclwatch_rank_last_op_position": "gauge",
    "ncclwatch_heartbeat_age_seconds": "gauge",
    "ncclwatch_progress_age_seconds": "gauge",
    "ncclwatch_rank_step": "gauge",
    "ncclwatch_rank_process_stopped": "gauge",
    "ncclwatch_hang": "gauge",
    "ncclwatch_stalled_seconds": "gauge",
    "ncclwatch_stall_timeout_seconds": "gauge",
    "ncclwatch_verdict_info": "gauge",
    "ncclwatch_bundles_written": "counter",
    "ncclwatch_restarts": "counter",
    "ncclwatch_source_up": "gauge",
    "ncclwatch_comm_bus_bandwidth_bytes_per_second": "gauge",
    "ncclwatch_rank_bus_bandwidth_bytes_per_second": "gauge",
    "ncclwatch_rank_last_arrival_ratio": "gauge",
    "ncclwatch_rank_arrival_lead_seconds": "gauge",
    "ncclwatch_rank_straggler": "gauge",
    "ncclwatch_arrival_skew_seconds": "gauge",
    "ncclwatch_perf_findings": "gauge",
    "ncclwatch_perf_finding_info": "gauge",
    "ncclwatch_ib_port_active": "gauge",
    "ncclwatch_ib_port_rate_bytes_per_second": "gauge",
    "ncclwatch_ib_port_transmit_bytes_per_second": "gauge",
    "ncclwatch_ib_port_receive_bytes_per_second": "gauge",
    "ncclwatch_ib_port_errors": "gauge",
    "ncclwatch_up": "gauge",
    "ncclwatch_collector_errors": "counter",
}

_HELP: dict[str, str] = {
    "ncclwatch_rank_last_op_position": "Operations the rank has issued on the communicator so far "
    "(the last one's 1-based sequence number); ranks that stop agreeing point at the culprit.",
    "ncclwatch_heartbeat_age_seconds": "Seconds since the rank's latest heartbeat step "
    "(optimizer step or ncclwatch.beat).",
    "ncclwatch_progress_age_seconds": "Seconds since the rank last made any progress "
    "(a heartbeat step or an NCCL operation).",
    "ncclwatch_rank_step": "The rank's latest heartbeat step.",
    "ncclwatch_rank_process_stopped": "1 while the rank's process is stopped (/proc state T: SIGSTOP, a debugger).",
    "ncclwatch_hang": "1 while a hang was reported and nothing has moved since.",
    "ncclwatch_stalled_seconds": "Seconds since anything moved on any rank of this node.",
    "ncclwatch_stall_timeout_seconds": "Seconds of no progress after which a stall is probed "
    "(learned from the job, or set).",
    "ncclwatch_verdict_info": "1 while an incident is open, labelled with its verdict and culprit ranks.",
    "ncclwatch_bundles_written": "Root-cause bundles this watchdog has written.",
    "ncclwatch_restarts": "Restarts of the job's workers this watchdog asked torchrun for after a hang "
    "(--on-hang restart).",
    "ncclwatch_source_up": "0 while the source cannot read (NVML missing, RAS unreachable, ...), else 1.",
    "ncclwatch_comm_bus_bandwidth_bytes_per_second": "Median bus bandwidth (nccl-tests' busbw) "
    "of the communicator's recent collectives of at least 1 MiB, per operation.",
    "ncclwatch_rank_bus_bandwidth_bytes_per_second": "Median bus bandwidth of the collectives the rank took part in.",
    "ncclwatch_rank_last_arrival_ratio": "Share of the recent instances of a recurring collective "
    "in which the rank was last by the margin, at the collective where it is so most often.",
    "ncclwatch_rank_arrival_lead_seconds": "How far behind the next rank the rank arrived, on average, "
    "when it was last by the margin (at that same collective).",
    "ncclwatch_rank_straggler": "1 while the rank is reported as a straggler (last by a margin in most recent rounds).",
    "ncclwatch_arrival_skew_seconds": "Last minus first arrival at the latest collective every rank entered.",
    "ncclwatch_perf_findings": "Open findings of each kind: "
    "slow_collective, slow_link, straggler, transport_anomaly, ib_port.",
    "ncclwatch_perf_finding_info": "1 per open finding, labelled with its kind, key, ranks and links.",
    "ncclwatch_ib_port_active": "1 while the InfiniBand port's state is ACTIVE.",
    "ncclwatch_ib_port_rate_bytes_per_second": "The port's link rate (sysfs rate), in bytes per second.",
    "ncclwatch_ib_port_transmit_bytes_per_second": "Bytes the port sent per second over the last window "
    "(port_xmit_data x 4).",
    "ncclwatch_ib_port_receive_bytes_per_second": "Bytes the port received per second over the last window "
    "(port_rcv_data x 4).",
    "ncclwatch_ib_port_errors": "Rise of the port's error counters "
    "(symbol, link downed, receive errors, discards, retries, timeouts) over the last window.",
    "ncclwatch_up": "1 when the collector could read the watchdog's state at this scrape, 0 when it failed.",
    "ncclwatch_collector_errors": "Scrapes at which reading the watchdog's state failed.",
}


def _perf_series(out: _Families, health: Health) -> None:
    """Bandwidth, arrival, straggler, finding and InfiniBand series; unknown values are absent, not zero."""
    for comm in health.comm_bandwidth:
        out.add(
            "ncclwatch_comm_bus_bandwidth_bytes_per_second",
            comm.busbw_bytes_per_s,
            communicator=comm.communicator,
            op=comm.op,
        )
    for perf in health.rank_perf:
        rank = str(perf.rank)
        for name, value in (
            ("ncclwatch_rank_bus_bandwidth_bytes_per_second", perf.busbw_bytes_per_s),
            ("ncclwatch_rank_last_arrival_ratio", perf.last_arrival_share),
            ("ncclwatch_rank_arrival_lead_seconds", perf.arrival_lead_s),
        ):
            if value is not None:
                out.add(name, value, rank=rank)
        out.add("ncclwatch_rank_straggler", 1 if perf.straggler else 0, rank=rank)
    if health.arrival_skew_s is not None:
        out.add("ncclwatch_arrival_skew_seconds", max(0.0, health.arrival_skew_s))
    kinds = Counter(f.kind.value for f in health.perf_findings)
    for kind in PerfKind:
        out.add("ncclwatch_perf_findings", kinds.get(kind.value, 0), kind=kind.value)
    for f in health.perf_findings:
        out.add(
            "ncclwatch_perf_finding_info",
            1,
            kind=f.kind.value,
            key=f.key,
            ranks=",".join(map(str, f.ranks)),
            links=",".join(f.links),
        )
    for port in health.ib_ports:
        out.add("ncclwatch_ib_port_active", 1 if port.active else 0, port=port.port)
        out.add("ncclwatch_ib_port_errors", port.errors, port=port.port)
        for name, value in (
            ("ncclwatch_ib_port_rate_bytes_per_second", port.rate_bytes_per_s),
            ("ncclwatch_ib_port_transmit_bytes_per_second", port.xmit_bytes_per_s),
            ("ncclwatch_ib_port_receive_bytes_per_second", port.rcv_bytes_per_s),
        ):
            if value is not None:
                out.add(name, value, port=port.port)


class _Families:
    """Families in a fixed order, one sample per label set (a duplicate series fails the whole scrape)."""

    def __init__(self, base: Mapping[str, str]) -> None:
        self._base = dict(base)
        self._samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    def add(self, name: str, value: float, **labels: str) -> None:
        key = tuple({**self._base, **labels}.items())
        self._samples.setdefault(name, {}).setdefault(key, float(value))

    def families(self) -> list[Metric]:
        out: list[Metric] = []
        for name, samples in self._samples.items():
            names = [k for k, _ in next(iter(samples))]
            family = (CounterMetricFamily if _FAMILIES[name] == "counter" else GaugeMetricFamily)(
                name, _HELP[name], labels=names
            )
            for key, value in samples.items():
                family.add_metric([v for _, v in key], value)
            out.append(family)
        return out


# -- node_exporter textfile ------------------------------------------------


class TextfileError(ValueError):
    """A textfile path node_exporter would never read; the message names the setting."""


class TextfileWriter:
    """Writes a registry to a ``.prom`` file every few seconds for node_exporter's textfile collector.

    Each write renders on the calling (loop) thread, then writes a temporary
    file beside the target and renames it over the target in a worker thread,
    so node_exporter never reads half a file and a slow disk never blocks the
    loop.  The file is made mode 0644 (less the umask): node_exporter runs as
    another user, and a 0600 temporary file renamed into place would be
    unreadable to it.  A failed write (folder missing, disk full) is logged
    once per distinct error and tried again next time; it never ends the loop.

    ``remove_on_exit``: when ``run`` ends (cancelled at shutdown) the file is
    removed, so a finished job does not keep exporting its last state (a hang
    included) for as long as node_exporter runs.
    """

    def __init__(self, *, remove_on_exit: bool = True) -> None:
        self.remove_on_exit = remove_on_exit
        self._last_error: str | None = None

    @staticmethod
    def check_path(path: Path | str) -> Path:
        path = Path(path)
        if path.suffix != ".prom":
            raise TextfileError(
                f"--metrics-textfile / NCCLWATCH_METRICS_TEXTFILE: {str(path)!r} must end in .prom "
                "(node_exporter's textfile collector reads only *.prom files)"
            )
        return path

    def write(self, registry: CollectorRegistry, path: Path | str) -> None:
        """One render and atomic write, on this thread."""
        _write_atomic(self.check_path(path), generate_latest(registry))

    async def run(self, registry: CollectorRegistry, path: Path, every_s: float = 15.0) -> None:
        path = self.check_path(path)
        if every_s <= 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        try:
            while True:
                data = generate_latest(registry)  # on the loop: the collector reads loop-owned state
                try:
                    await asyncio.to_thread(_write_atomic, path, data)
                    self._last_error = None
                except OSError as exc:
                    if str(exc) != self._last_error:
                        log.warning(
                            "metrics textfile %s: cannot write (%s); trying again every %.0f s", path, exc, every_s
                        )
                    self._last_error = str(exc)
                await asyncio.sleep(every_s)
        finally:
            if self.remove_on_exit:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("metrics textfile %s: cannot remove (%s)", path, exc)


def _write_atomic(path: Path, data: bytes) -> None:
    # Not "<name>.prom.tmp": node_exporter globs *.prom, so a temporary name must not end in .prom.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
