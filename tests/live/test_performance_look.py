"""The performance look wired into the sidecar, driven tick by tick: scripted dumps, a fake clock, no sleeps.

The sidecar runs with a ``PerfWatch`` whose Flight Recorder dumps are
scripted (built as the parser makes them: gloo entries stay ``scheduled``
with no duration, NCCL ones complete with a kernel duration), whose NCCL
transports come from a real ``TransportReader`` over a debug file, and
whose InfiniBand ports are a fake sysfs tree.  Each test checks what an
operator sees: the look's timing, one log line per finding, /metrics, the
page only when asked for (never a hang report, never a kill), and the
findings in a hang's report.
"""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest
from conftest import DATA, NOW, Clock
from prometheus_client import CollectorRegistry
from support import make_port

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrProcessGroup,
    Heartbeat,
    OpState,
    StackDump,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.report import render_text
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.bundle import live_report, report_markdown
from ncclwatch.watchdog.live.incident import Phase
from ncclwatch.watchdog.live.performance_look import PerfWatch
from ncclwatch.watchdog.live.sidecar import Sidecar
from ncclwatch.watchdog.parsing.transport import parse_transport
from ncclwatch.watchdog.probes.infiniband import read_ib_counters
from ncclwatch.watchdog.server.metrics import HealthCollector
from ncclwatch.watchdog.sinks.alert import trigger_from_finding
from ncclwatch.watchdog.sinks.pagerduty import event_for
from ncclwatch.watchdog.sinks.webhooks import slack_message
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.sources.files import TransportReader

MiB = 1 << 20
INTERVAL = 60.0
RANKS = (0, 1, 2)
STEP_MS = 200.0


class IdleProber:
    """The hang prober; answers with stacks inside a collective when a test makes the job stall."""

    def __init__(self) -> None:
        self.calls = 0

    def prime(self, workers) -> int:  # type: ignore[no-untyped-def]
        return 0

    async def gpus(self) -> list[Event]:
        return []

    def dumps_left(self, workers, since: float) -> list[Event]:  # type: ignore[no-untyped-def]
        return []

    async def probe(
        self,
        workers,
        with_gpus: bool,
        stalled_since: float | None = None,
        peek: bool = False,
        after_proof: bool = False,
    ) -> list[Event]:  # type: ignore[no-untyped-def]
        self.calls += not peek  # a peek (a quiet look below the stall timeout) is no probe
        frame = "all_reduce (torch/distributed/distributed_c10d.py:3252)"
        return [
            StackDump(pid=w.pid, threads=[ThreadStack(name="MainThread", frames=[frame])], cite=Citation(file="py-spy"))
            for w in workers
        ]


class ScriptedDumps:
    """Answers each look with the dumps a test scripted; records which ranks (rank -> pid) each look asked."""

    def __init__(self) -> None:
        self.dumps: list[FrDump] = []
        self.asked: list[dict[int, int]] = []

    async def __call__(self, ranks) -> list[FrDump]:  # type: ignore[no-untyped-def]
        self.asked.append(dict(ranks))
        return [d for d in self.dumps if d.rank in ranks]


class Alerts:
    def __init__(self) -> None:
        self.submitted = []  # type: ignore[var-annotated]

    def submit(self, alert) -> None:  # type: ignore[no-untyped-def]
        self.submitted.append(alert)


def entry(seq: int, op: str, numel: int, created_ns: int, *, duration_ms: float | None) -> FrEntry:
    return FrEntry(
        index=seq,
        pg_id="0",
        collective_seq_id=seq,
        profiling_name=f"x:{op}",
        op=op,
        is_p2p=False,
        input_sizes=[[numel]],
        output_sizes=[[numel]],
        input_dtypes=["Float"],
        output_dtypes=["Float"],
        state=OpState.completed if duration_ms is not None else OpState.scheduled,
        time_created_ns=created_ns,
        duration_ms=duration_ms,
    )


def training(
    steps: int, *, late_rank: int | None = None, late_ms: float = 60.0, durations_ms: list[float] | None = None
) -> list[FrDump]:
    """Each rank's dump of ``steps`` steps of a data-parallel job, ``STEP_MS`` apart.

    A step is a 64 MiB gradient all-reduce (16 Mi floats), a 4 KiB loss all-reduce and a
    broadcast.  ``late_rank`` enters each step's first collective ``late_ms``
    after the others (they wait inside it, then all move on together).
    ``durations_ms``: each gradient all-reduce's kernel time (NCCL entries,
    completed); None: gloo entries (scheduled, no time).
    """
    t0 = int(NOW * 1e9)
    dumps = []
    for rank in RANKS:
        entries = []
        for step in range(steps):
            start = t0 + int(step * STEP_MS * 1e6) + rank * 100_000  # ranks 0.1 ms apart: jitter, not a lead
            late = int(late_ms * 1e6) if rank == late_rank else 0
            duration = durations_ms[step] if durations_ms is not None else None
            small = None if durations_ms is None else 0.01
            entries += [
                entry(3 * step + 1, "AllReduce", 16 * MiB, start + late, duration_ms=duration),
                entry(3 * step + 2, "AllReduce", 1024, start + int((late_ms + 5) * 1e6), duration_ms=small),
                entry(3 * step + 3, "Broadcast", 16, start + int((late_ms + 6) * 1e6), duration_ms=small),
            ]
        groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(RANKS))}
        dumps.append(
            FrDump(rank=rank, version="2.10", process_groups=groups, entries=entries, cite=Citation(file=f"fr_{rank}"))
        )
    return dumps


class Rig:
    def __init__(self, settings: Settings = Settings(perf_interval=INTERVAL), **watch) -> None:  # type: ignore[no-untyped-def]
        self.clock = Clock()
        self.dumps = ScriptedDumps()
        self.alerts = Alerts()
        self.prober = IdleProber()
        self.reports: list = []  # type: ignore[type-arg]
        self.perf = PerfWatch(interval=settings.perf_interval, dumps=self.dumps, **watch)
        self.sidecar = Sidecar(
            settings,
            "train",
            sources=[],
            prober=self.prober,
            reporter=self.report,
            out=io.StringIO(),
            dispatcher=self.alerts,
            host="node1",
            clock=self.clock,
            perf=self.perf,  # type: ignore[arg-type]
        )
        assert self.sidecar.performance is not None  # the looks' findings, logged and paged
        self.performance = self.sidecar.performance
        for rank in RANKS:
            self.sidecar.emit(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW))
        self.beaten = 0
        self.tick(0)  # the job starts: the first look is one interval from now

    async def report(self, report, decision, view):  # type: ignore[no-untyped-def]
        self.reports.append(decision)
        return report, None

    def tick(self, seconds: float, beating: bool = True) -> None:
        """Advance to ``seconds``; a healthy job took a step every second until then."""
        if beating:
            while self.beaten <= seconds:
                self.clock.now = NOW + self.beaten
                for r in RANKS:
                    self.sidecar.emit(Heartbeat(pid=100 + r, rank=r, step=self.beaten, time=NOW + self.beaten))
                self.beaten += 1
        self.clock.now = NOW + seconds

        async def both() -> None:  # as the sidecar's run loop and its performance task would
            await self.sidecar.tick()
            await self.performance.tick()

        asyncio.run(both())

    def metric(self, name: str, **labels: str) -> float | None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(HealthCollector(self.sidecar.health, environ={}))
        return registry.get_sample_value(name, {"job_name": "train", "host": "node1", **labels})


def straggler_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("performance: straggler")]


class TestLookTiming:
    def test_first_look_one_interval_in_then_one_per_interval_asking_every_rank(self) -> None:
        rig = Rig()
        rig.tick(INTERVAL - 1)
        assert rig.dumps.asked == []
        rig.tick(INTERVAL + 1)
        assert rig.dumps.asked == [{0: 100, 1: 101, 2: 102}]
        rig.tick(INTERVAL + 2)
        rig.tick(2 * INTERVAL)
        assert len(rig.dumps.asked) == 1
        rig.tick(2 * INTERVAL + 1.5)
        assert len(rig.dumps.asked) == 2

    def test_zero_interval_never_looks(self) -> None:
        rig = Rig(Settings(perf_interval=0))
        for second in (1, 61, 600):
            rig.tick(second)
        assert rig.dumps.asked == [] and rig.sidecar.health().perf_findings == ()

    def test_no_look_while_an_incident_is_open(self) -> None:
        rig = Rig()
        rig.tick(20)
        rig.tick(INTERVAL + 1, beating=False)  # nothing moved for 40 s: suspect, probed for a hang
        assert rig.sidecar.incident.phase is not Phase.watching and rig.prober.calls >= 1
        assert rig.dumps.asked == []

    def test_a_look_stuck_waiting_never_holds_the_watch_for_hangs(self) -> None:
        """The sidecar's own run loop: while a look waits (dumps, the other nodes), a stall is still probed."""
        rig = Rig(Settings(perf_interval=INTERVAL, poll_interval=0.01))
        rig.tick(INTERVAL - 1)
        rig.clock.now = NOW + INTERVAL + 1  # a look is due; the job is healthy

        async def run() -> tuple[int, Phase]:
            entered, never = asyncio.Event(), asyncio.Event()

            async def stuck(ranks):  # type: ignore[no-untyped-def]
                entered.set()
                await never.wait()
                return []

            rig.perf.dumps = stuck
            running = asyncio.create_task(rig.sidecar.run())
            await asyncio.wait_for(entered.wait(), 5)
            rig.clock.now += 60  # then nothing moves for a minute
            for _ in range(500):  # the ticks go on beside the stuck look
                if rig.prober.calls:
                    break
                await asyncio.sleep(0.01)
            rig.sidecar.stop()
            await asyncio.wait_for(running, 5)
            return rig.prober.calls, rig.sidecar.incident.phase

        calls, phase = asyncio.run(run())
        assert calls >= 1 and phase is not Phase.watching


class TestStraggler:
    def test_reported_once_in_the_log_health_and_metrics_and_not_paged(self, caplog: pytest.LogCaptureFixture) -> None:
        rig = Rig()
        rig.dumps.dumps = training(30, late_rank=2)  # gloo: arrivals only
        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            rig.tick(INTERVAL + 1)
            rig.tick(2 * INTERVAL + 1)
        (line,) = straggler_lines(caplog)
        assert (
            "rank 2 (node1) was last in 20 of the last 20 collectives at AllReduce (64.0 MiB) of process group 0"
            in line
        )
        assert "on average 60 ms after the next rank" in line
        health = rig.sidecar.health()
        assert [f.key for f in health.perf_findings] == ["straggler-2"]
        perf = {p.rank: p for p in health.rank_perf}
        assert (
            perf[2].straggler
            and perf[2].last_arrival_share == 1.0
            and perf[2].arrival_lead_s == pytest.approx(0.06, abs=1e-3)
        )
        assert not perf[0].straggler and perf[0].last_arrival_share == 0.0
        assert perf[2].busbw_bytes_per_s is None and health.comm_bandwidth == ()  # gloo records no durations
        assert health.arrival_skew_s == pytest.approx(0.0002)  # the latest collective, a broadcast all enter together
        assert (
            rig.metric("ncclwatch_rank_straggler", rank="2") == 1
            and rig.metric("ncclwatch_rank_straggler", rank="0") == 0
        )
        assert rig.metric("ncclwatch_perf_findings", kind="straggler") == 1
        assert rig.alerts.submitted == [] and rig.reports == []

    def test_late_at_one_of_three_collectives_is_late_at_that_collective(self) -> None:
        """Over all collectives the straggler is last in a third of them; per collective, in all of its rounds."""
        rig = Rig()
        rig.dumps.dumps = training(30, late_rank=1)
        rig.tick(INTERVAL + 1)
        rig.tick(2 * INTERVAL + 1)
        assert [f.ranks for f in rig.sidecar.health().perf_findings] == [(1,)]

    def test_one_look_is_not_consistently_last(self, caplog: pytest.LogCaptureFixture) -> None:
        rig = Rig()
        rig.dumps.dumps = training(30, late_rank=2)
        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            rig.tick(INTERVAL + 1)
            assert rig.sidecar.health().perf_findings == () and straggler_lines(caplog) == []
            assert not any(p.straggler for p in rig.sidecar.health().rank_perf)
            rig.dumps.dumps = training(30)  # the next window is even: never told
            rig.tick(2 * INTERVAL + 1)
            rig.dumps.dumps = training(30, late_rank=2)
            rig.tick(3 * INTERVAL + 1)
            assert straggler_lines(caplog) == []
            rig.tick(4 * INTERVAL + 1)  # two looks in a row
        assert len(straggler_lines(caplog)) == 1

    def test_an_even_job_has_no_straggler(self) -> None:
        rig = Rig()
        start = int((NOW - 5) * 1e9)
        for dump in training(30):  # after the model's broadcast at start-up, where rank 2 came 1 s late once
            startup = entry(0, "Broadcast", 4, start + (10**9 if dump.rank == 2 else 0), duration_ms=None)
            rig.dumps.dumps.append(dump.model_copy(update={"entries": [startup, *dump.entries]}))
        rig.tick(INTERVAL + 1)
        health = rig.sidecar.health()
        assert health.perf_findings == () and not any(p.straggler for p in health.rank_perf)
        late_once = next(
            p for p in health.rank_perf if p.rank == 2
        )  # last by 1 s at a one-off: not a share of anything
        assert late_once.last_arrival_share == 0.0 and late_once.arrival_lead_s is None
        assert rig.metric("ncclwatch_perf_findings", kind="straggler") == 0

    def test_paged_once_with_the_finding_key_when_asked_and_never_as_a_hang(self) -> None:
        rig = Rig(Settings(perf_interval=INTERVAL, page_on_straggler=True, on_hang="kill"))
        rig.dumps.dumps = training(30, late_rank=2)
        rig.tick(INTERVAL + 1)
        rig.tick(2 * INTERVAL + 1)
        (alert,) = rig.alerts.submitted
        assert (alert.action, alert.problem, alert.verdict, alert.culprit_ranks) == (
            "trigger",
            "performance",
            "straggler",
            [2],
        )
        assert alert.dedup_key.startswith("ncclwatch-perf-train-straggler_2-")
        assert rig.reports == [] and rig.sidecar.reported == []  # no hang report, so --on-hang kill never applies
        assert event_for(alert, "key")["payload"]["severity"] == "warning"
        assert slack_message(alert)["blocks"][0]["text"]["text"] == "Performance: straggler in train"

    def test_its_page_is_resolved_once_two_looks_in_a_row_no_longer_see_it(self) -> None:
        rig = Rig(Settings(perf_interval=INTERVAL, page_on_straggler=True))
        rig.dumps.dumps = training(30, late_rank=2)
        rig.tick(INTERVAL + 1)
        rig.tick(2 * INTERVAL + 1)
        rig.dumps.dumps = training(30)  # rank 2 caught up
        rig.tick(3 * INTERVAL + 1)
        assert [a.action for a in rig.alerts.submitted] == ["trigger"]  # one look may miss a rank's dump
        rig.tick(4 * INTERVAL + 1)
        trigger, resolve = rig.alerts.submitted
        assert (resolve.action, resolve.dedup_key) == ("resolve", trigger.dedup_key)
        rig.performance.resolve()  # the job ends: nothing left open to resolve
        assert len(rig.alerts.submitted) == 2

    def test_a_page_still_open_when_the_job_ends_is_resolved(self) -> None:
        rig = Rig(Settings(perf_interval=INTERVAL, page_on_straggler=True))
        rig.dumps.dumps = training(30, late_rank=2)
        rig.tick(INTERVAL + 1)
        rig.tick(2 * INTERVAL + 1)
        rig.performance.resolve(why="the job ended")
        trigger, resolve = rig.alerts.submitted
        assert (resolve.action, resolve.dedup_key, resolve.reason) == ("resolve", trigger.dedup_key, "the job ended")

    def test_another_run_of_the_job_pages_again(self) -> None:
        from ncclwatch.watchdog.slowness.stragglers import last_arrivals, stragglers

        (finding,) = stragglers(last_arrivals([{0: i, 1: i + 0.5} for i in range(20)]))
        keys = {
            trigger_from_finding(finding, job="train", host="node1", run_started_at=t, environ={}).dedup_key
            for t in (NOW, NOW)
        }
        assert len(keys) == 1
        assert (
            trigger_from_finding(finding, job="train", host="node1", run_started_at=NOW + 86400, environ={}).dedup_key
            not in keys
        )


class TestBandwidthTransportsAndPorts:
    def test_bandwidth_per_communicator_and_rank_and_a_slow_collective_naming_its_link(self, tmp_path: Path) -> None:
        nccl = tmp_path / "nccl"
        nccl.mkdir()
        (nccl / "node1.4100").write_bytes((DATA / "transport" / "healthy-ib.log").read_bytes())
        rig = Rig(transport=TransportReader(nccl).facts)
        rig.dumps.dumps = training(12, durations_ms=[2.0] * 9 + [40.0] * 3)
        rig.tick(INTERVAL + 1)
        health = rig.sidecar.health()
        busbw = 64 * MiB * 2 * 2 / 3 / 2e-3  # nccl-tests: all-reduce factor 2(n-1)/n, 2 ms
        (comm,) = health.comm_bandwidth
        assert (comm.communicator, comm.op) == ("process group 0 (default_pg)", "AllReduce")
        assert comm.busbw_bytes_per_s == pytest.approx(busbw)
        assert rig.metric(
            "ncclwatch_comm_bus_bandwidth_bytes_per_second", communicator="process group 0 (default_pg)", op="AllReduce"
        ) == pytest.approx(busbw)
        assert {p.rank: p.busbw_bytes_per_s for p in health.rank_perf} == {r: pytest.approx(busbw) for r in RANKS}
        (slow,) = [f for f in health.perf_findings if f.kind is PerfKind.slow_collective]
        assert slow.ranks == RANKS and slow.measured == pytest.approx(busbw / 20)
        assert slow.links == ("mlx5_0/1", "mlx5_1/1")  # from NCCL's init and channel lines

    def test_a_group_with_ranks_on_another_node_is_not_judged_from_this_node(self) -> None:
        """Its kernels here include waiting for the ranks elsewhere: a remote straggler is not a slow link."""
        rig = Rig()
        dumps = training(12, durations_ms=[2.0] * 9 + [40.0] * 3)
        groups = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1, 2, 3])}  # rank 3 runs on node2
        rig.dumps.dumps = [d.model_copy(update={"process_groups": groups}) for d in dumps]
        rig.tick(INTERVAL + 1)
        health = rig.sidecar.health()
        assert health.perf_findings == () and health.comm_bandwidth == () and health.rank_perf == ()

    def test_a_node_on_sockets_among_infiniband_nodes(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        nccl = tmp_path / "nccl"
        nccl.mkdir()
        (nccl / "both.log").write_bytes((DATA / "transport" / "socket-fallback-node2.log").read_bytes())
        rig = Rig(transport=TransportReader(nccl).facts)
        with caplog.at_level(logging.WARNING, logger="ncclwatch"):
            rig.tick(INTERVAL + 1)
        found = {f.key: f for f in rig.sidecar.health().perf_findings}
        assert set(found) == {"transport-network-node2", "transport-hcas-node2"}
        assert found["transport-network-node2"].ranks == (2, 3) and found["transport-hcas-node2"].links == (
            "mlx5_0",
            "mlx5_1",
        )
        said = [r.getMessage() for r in caplog.records]
        assert (
            "performance: transport_anomaly: NCCL on ranks 2, 3 (node2) uses network Socket "
            "while the other nodes use IB" in said
        )
        assert rig.alerts.submitted == []  # page_on_transport is off

    def test_infiniband_ports_state_rate_and_error_counters_between_looks(self, tmp_path: Path) -> None:
        sysfs = tmp_path / "infiniband"
        make_port(sysfs, "mlx5_0", link_layer="InfiniBand")
        make_port(sysfs, "mlx5_1", link_layer="InfiniBand")
        rig = Rig(Settings(perf_interval=INTERVAL, page_on_slow=True), ib_ports=lambda: read_ib_counters(sysfs))
        rig.tick(INTERVAL + 1)
        assert rig.sidecar.health().perf_findings == ()
        assert rig.metric("ncclwatch_ib_port_active", port="mlx5_1/1") == 1
        assert rig.metric("ncclwatch_ib_port_rate_bytes_per_second", port="mlx5_1/1") == 50e9
        make_port(
            sysfs, "mlx5_1", link_layer="InfiniBand", counters__symbol_error=7, counters__port_xmit_data=1000 + 60 * 250
        )
        rig.tick(2 * INTERVAL + 1)
        (finding,) = rig.sidecar.health().perf_findings
        assert finding.key == "ib_port-errors-node1-mlx5_1/1" and "symbol_error +7" in finding.summary
        assert rig.metric("ncclwatch_ib_port_errors", port="mlx5_1/1") == 7
        assert rig.metric("ncclwatch_ib_port_transmit_bytes_per_second", port="mlx5_1/1") == pytest.approx(1000.0)
        assert [a.verdict for a in rig.alerts.submitted] == ["ib_port"]  # page_on_slow covers port findings


class TestTransportReader:
    def test_reads_on_from_where_it_stopped_and_starts_over_on_a_new_file(self, tmp_path: Path) -> None:
        text = (DATA / "transport" / "socket-fallback-node2.log").read_bytes()
        path = tmp_path / "node.log"
        half = text.index(b"\n", len(text) // 2) + 5  # mid-line: the rest comes with the next read
        path.write_bytes(text[:half])
        reader = TransportReader(tmp_path)
        first = reader.facts()
        with path.open("ab") as handle:
            handle.write(text[half:])
        assert reader.facts() == parse_transport(text) != first
        path.unlink()
        path.write_bytes(text[:half])  # re-created (a new inode): read from its start
        assert reader.facts() == parse_transport(text[: text.rindex(b"\n", 0, half) + 1])

    def test_a_missing_folder_has_no_facts(self, tmp_path: Path) -> None:
        assert TransportReader(tmp_path / "absent").facts() == []


def test_a_hang_report_carries_the_latest_findings(tmp_path: Path) -> None:
    rig = Rig()
    rig.dumps.dumps = training(30, late_rank=2)
    rig.tick(INTERVAL + 1)
    rig.tick(2 * INTERVAL + 1)
    view = rig.sidecar.live.view(rig.clock())
    snapshot = take_snapshot(rig.sidecar.live.state, observed_at=rig.clock())
    finding = Finding(Verdict.rank_behind, "rank 2 is behind", culprits=(2,))
    report = live_report(
        finding, snapshot, view, job="train", host="node1", started_at=NOW, performance=rig.perf.findings()
    )
    (note,) = report.performance
    assert (note.kind, note.key, note.ranks, note.hosts) == ("straggler", "straggler-2", [2], ["node1"])
    assert type(report).model_validate_json(report.model_dump_json()).performance == report.performance
    text = render_text(report)
    assert "performance (slow, not hung):\n  - [straggler] rank 2 (node1) was last in 20 of the last 20" in text
    assert "## Performance (slow, not hung)\n\n- [straggler] rank 2 (node1)" in report_markdown(report)
    quiet = live_report(finding, snapshot, view, job="train", host="node1", started_at=NOW)
    assert quiet.performance == [] and "performance" not in render_text(quiet)
