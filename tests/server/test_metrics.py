"""Metrics: the collector on literal ``Health`` values, its exposition parsed back, the textfile, the dashboard.

Every value is read back through a real ``CollectorRegistry``
(``get_sample_value``) and the text format through prometheus_client's own
parser, so what is checked is what Prometheus would scrape.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import NOW, REPO
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ncclwatch.watchdog.live.health import CommPosition, Health, RankHealth
from ncclwatch.watchdog.server.metrics import SOURCES, HealthCollector, TextfileError, TextfileWriter
from ncclwatch.watchdog.slowness.engine import CommBandwidth, IbPortHealth, RankPerf
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind

JOB = {"job_name": "train", "host": "node1"}
DASHBOARD = REPO / "dashboards" / "ncclwatch.json"


def rank(r: int, **kw) -> RankHealth:
    healthy = RankHealth(
        rank=r, pid=1000 + r, host="node1", state="S", step=40, heartbeat_age_s=1.5, progress_age_s=0.5
    )
    return replace(healthy, **kw)


def health(**kw) -> Health:
    healthy = Health(
        observed_at=NOW,
        job="train",
        host="node1",
        ranks=(rank(0), rank(1)),
        positions=(CommPosition("commId 0xabc", 0, 120), CommPosition("commId 0xabc", 1, 120)),
        stalled_for_s=0.5,
        stall_timeout_s=12.0,
        hang=False,
        verdict=None,
        culprits=(),
        sources_down=(),
        bundles_written=0,
    )
    return replace(healthy, **kw)


def rich() -> Health:
    """Every optional value present: a hung job with a stopped rank, a down source and a measured bandwidth."""
    return health(
        ranks=(rank(0), rank(1, state="T", step=39, heartbeat_age_s=41.0, progress_age_s=41.0)),
        positions=(
            CommPosition("commId 0xabc", 0, 121),
            CommPosition("commId 0xabc", 1, 120),
            CommPosition("process group 0 (default_pg)", 0, 7),
        ),
        stalled_for_s=41.0,
        hang=True,
        verdict="process_stopped",
        culprits=(1,),
        sources_down=("nvml: NVML library not found",),
        bundles_written=2,
        comm_bandwidth=(CommBandwidth("process group 0 (default_pg)", "AllReduce", 3.2e11),),
        rank_perf=(RankPerf(0, 3.2e11, 0.05, None), RankPerf(1, 3.2e11, 0.9, 0.12, straggler=True)),
        arrival_skew_s=0.13,
        perf_findings=(PERF,),
        ib_ports=(
            IbPortHealth("mlx5_0/1", True, 50e9, 4e10, 3.9e10),
            IbPortHealth("mlx5_1/1", True, 5e9, 1e9, 1e9, errors=12),
        ),
    )


PERF = PerfFinding(
    PerfKind.straggler, "straggler-1", "rank 1 was last in 18 of the last 20 collectives", "look", ranks=(1,)
)


def registry_for(value, **kw) -> tuple[CollectorRegistry, HealthCollector]:
    registry = CollectorRegistry()
    collector = HealthCollector(value if callable(value) else (lambda: value), environ=kw.pop("environ", {}), **kw)
    registry.register(collector)
    return registry, collector


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**JOB, **labels})


def parsed(registry: CollectorRegistry) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """What PromQL can select: sample names (a counter's family 'x' is selected as 'x_total')."""
    return {
        s.name for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples
    }


class TestPerfSeries:
    def test_bandwidth_per_communicator_and_rank(self):
        registry, _ = registry_for(rich())
        assert (
            sample(
                registry,
                "ncclwatch_comm_bus_bandwidth_bytes_per_second",
                communicator="process group 0 (default_pg)",
                op="AllReduce",
            )
            == 3.2e11
        )
        assert sample(registry, "ncclwatch_rank_bus_bandwidth_bytes_per_second", rank="1") == 3.2e11

    def test_stragglers_and_skew(self):
        registry, _ = registry_for(rich())
        assert [sample(registry, "ncclwatch_rank_straggler", rank=r) for r in "01"] == [0, 1]
        assert sample(registry, "ncclwatch_rank_last_arrival_ratio", rank="1") == 0.9
        assert sample(registry, "ncclwatch_rank_arrival_lead_seconds", rank="0") is None  # never last by the margin
        assert sample(registry, "ncclwatch_arrival_skew_seconds") == 0.13

    def test_findings_count_every_kind_and_label_each_one(self):
        registry, _ = registry_for(rich())
        assert sample(registry, "ncclwatch_perf_findings", kind="straggler") == 1
        assert sample(registry, "ncclwatch_perf_findings", kind="transport_anomaly") == 0
        assert (
            sample(registry, "ncclwatch_perf_finding_info", kind="straggler", key="straggler-1", ranks="1", links="")
            == 1
        )

    def test_ib_ports(self):
        registry, _ = registry_for(rich())
        assert sample(registry, "ncclwatch_ib_port_rate_bytes_per_second", port="mlx5_1/1") == 5e9
        assert sample(registry, "ncclwatch_ib_port_errors", port="mlx5_1/1") == 12
        assert sample(registry, "ncclwatch_ib_port_transmit_bytes_per_second", port="mlx5_0/1") == 4e10

    def test_nothing_measured_exports_only_zero_counts(self):
        names = exported_names(registry_for(health())[0])
        assert "ncclwatch_perf_findings" in names
        assert not {
            n for n in names if n.startswith(("ncclwatch_ib_", "ncclwatch_comm_bus", "ncclwatch_rank_straggler"))
        }


class TestRankSeries:
    def test_heartbeat_and_progress_age_step_per_rank(self):
        registry, _ = registry_for(health(ranks=(rank(0), rank(3, heartbeat_age_s=7.25, step=12))))
        assert sample(registry, "ncclwatch_heartbeat_age_seconds", rank="3") == 7.25
        assert sample(registry, "ncclwatch_progress_age_seconds", rank="0") == 0.5
        assert sample(registry, "ncclwatch_rank_step", rank="3") == 12

    def test_unknown_values_are_absent_not_zero(self):
        registry, _ = registry_for(
            health(ranks=(rank(0, heartbeat_age_s=None, step=None, state=None, progress_age_s=None),))
        )
        for name in ("ncclwatch_heartbeat_age_seconds", "ncclwatch_rank_step", "ncclwatch_rank_process_stopped"):
            assert sample(registry, name, rank="0") is None, name
        assert sample(registry, "ncclwatch_progress_age_seconds", rank="0") is None

    def test_state_T_is_stopped(self):
        registry, _ = registry_for(health(ranks=(rank(0, state="T"), rank(1, state="R"))))
        assert sample(registry, "ncclwatch_rank_process_stopped", rank="0") == 1

    def test_running_and_sleeping_ranks_are_not_stopped(self):
        registry, _ = registry_for(health(ranks=(rank(0, state="R"), rank(1, state="S"), rank(2, state="D"))))
        assert [sample(registry, "ncclwatch_rank_process_stopped", rank=str(r)) for r in (0, 1, 2)] == [0, 0, 0]

    def test_last_op_position_per_communicator_and_rank(self):
        registry, _ = registry_for(rich())
        assert sample(registry, "ncclwatch_rank_last_op_position", communicator="commId 0xabc", rank="0") == 121
        assert sample(registry, "ncclwatch_rank_last_op_position", communicator="commId 0xabc", rank="1") == 120
        assert (
            sample(registry, "ncclwatch_rank_last_op_position", communicator="process group 0 (default_pg)", rank="0")
            == 7
        )

    def test_duplicate_label_sets_keep_one_series(self):
        """Prometheus rejects a whole scrape with a duplicate series; the first one is kept."""
        registry, _ = registry_for(
            health(ranks=(rank(0), rank(0, step=99)), positions=(CommPosition("c", 0, 5), CommPosition("c", 0, 9)))
        )
        assert sample(registry, "ncclwatch_rank_step", rank="0") == 40
        assert sample(registry, "ncclwatch_rank_last_op_position", communicator="c", rank="0") == 5
        family = parsed(registry)["ncclwatch_rank_step"]
        assert len(family.samples) == 1


class TestJobSeries:
    def test_healthy_job_has_no_hang_and_no_verdict(self):
        registry, _ = registry_for(health())
        assert sample(registry, "ncclwatch_hang") == 0
        assert sample(registry, "ncclwatch_stalled_seconds") == 0.5
        assert sample(registry, "ncclwatch_stall_timeout_seconds") == 12.0
        assert "ncclwatch_verdict_info" not in parsed(registry)

    def test_open_incident_exports_verdict_and_culprits(self):
        registry, _ = registry_for(health(hang=True, verdict="rank_behind", culprits=(5, 3)))
        assert sample(registry, "ncclwatch_hang") == 1
        assert sample(registry, "ncclwatch_verdict_info", verdict="rank_behind", culprit_ranks="3,5") == 1

    def test_held_incident_has_verdict_without_hang(self):
        registry, _ = registry_for(health(verdict="progress_stalled", culprits=()))
        assert sample(registry, "ncclwatch_hang") == 0
        assert sample(registry, "ncclwatch_verdict_info", verdict="progress_stalled", culprit_ranks="") == 1

    def test_bundles_written_is_a_counter(self):
        registry, _ = registry_for(health(bundles_written=3))
        assert sample(registry, "ncclwatch_bundles_written_total") == 3
        assert parsed(registry)["ncclwatch_bundles_written"].type == "counter"

    def test_restarts_is_a_counter(self):
        registry, _ = registry_for(health(restarts=2))
        assert sample(registry, "ncclwatch_restarts_total") == 2
        assert parsed(registry)["ncclwatch_restarts"].type == "counter"

    def test_source_up_names_every_source_and_zero_for_down_ones(self):
        registry, _ = registry_for(health(sources_down=("nvml: NVML library not found", "gpu_probe: gone")))
        assert sample(registry, "ncclwatch_source_up", source="nvml") == 0
        assert sample(registry, "ncclwatch_source_up", source="gpu_probe") == 0  # not a known source: still exported
        for source in set(SOURCES) - {"nvml"}:
            assert sample(registry, "ncclwatch_source_up", source=source) == 1, source

    def test_known_sources_are_the_sidecars(self, tmp_path):
        from ncclwatch.launcher.run import _sidecar
        from ncclwatch.watchdog.config import Settings
        from ncclwatch.watchdog.live.runfolder import RunDirs
        from ncclwatch.watchdog.sources.job_output import JobOutputSource

        async def reporter(*_):  # never called
            return None

        dirs = RunDirs.create(tmp_path / "run")
        output = JobOutputSource(dirs.root / "output")
        sidecar = _sidecar(Settings(), dirs, 1, "train", "node1", reporter, None, output=output)
        assert tuple(s.name for s in sidecar.sources) == SOURCES
        # RAS is not polled (queries crash some NCCL versions): the prober asks it once per incident.
        assert "ras" not in SOURCES and sidecar.prober.ras_port == Settings().ras_port

    def test_slurm_job_id_labels_every_job_series_under_slurm(self):
        registry, _ = registry_for(rich(), environ={"SLURM_JOB_ID": "4711"})
        families = parsed(registry)
        for name in ("ncclwatch_hang", "ncclwatch_rank_step", "ncclwatch_verdict_info", "ncclwatch_up"):
            assert all(s.labels.get("slurm_job_id") == "4711" for s in families[name].samples), name

    def test_no_slurm_label_outside_slurm(self):
        families = parsed(registry_for(rich())[0])
        assert not any("slurm_job_id" in s.labels for f in families.values() for s in f.samples)

    def test_exposition_parses_with_the_types_and_labels_prometheus_sees(self):
        families = parsed(registry_for(rich())[0])
        assert families["ncclwatch_hang"].type == "gauge"
        assert families["ncclwatch_collector_errors"].type == "counter"
        assert all(re.fullmatch(r"ncclwatch_[a-z0-9_]+", name) for name in families)
        labels = {k for f in families.values() for s in f.samples for k in s.labels}
        assert "job" not in labels and "instance" not in labels  # those are Prometheus's target labels
        assert {"job_name", "host", "rank", "communicator", "verdict", "culprit_ranks", "source"} <= labels


class TestCollectorGuards:
    def test_no_job_yet_exports_only_up(self):
        registry, _ = registry_for(None)
        assert set(parsed(registry)) == {"ncclwatch_up", "ncclwatch_collector_errors"}
        assert registry.get_sample_value("ncclwatch_up") == 1

    def test_health_that_raises_gives_up_0_and_counts_errors_never_raises(self):
        def broken() -> Health:
            raise RuntimeError("dictionary changed size during iteration")

        registry, collector = registry_for(broken)
        generate_latest(registry)
        text = generate_latest(registry).decode()
        assert collector.errors == 2
        assert "ncclwatch_hang" not in text
        assert registry.get_sample_value("ncclwatch_up") == 0  # a third scrape
        assert registry.get_sample_value("ncclwatch_collector_errors_total") == 4  # counted before it is exported

    def test_an_unrenderable_health_is_guarded_too(self):
        registry, collector = registry_for(health(ranks=(rank(0, step="forty"),)))
        assert registry.get_sample_value("ncclwatch_up") == 0
        assert "ncclwatch_rank_step" not in parsed(registry)
        assert collector.errors >= 1

    def test_other_collectors_on_the_registry_still_export(self):
        from prometheus_client import Gauge

        registry, _ = registry_for(lambda: 1 / 0)
        Gauge("other_thing", "another collector", registry=registry).set(7)
        assert registry.get_sample_value("other_thing") == 7

    def test_recovery_exports_up_1_with_the_job_labels(self):
        calls = []

        def flaky() -> Health:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return health()

        registry, _ = registry_for(flaky)
        assert registry.get_sample_value("ncclwatch_up") == 0
        assert sample(registry, "ncclwatch_up") == 1
        assert sample(registry, "ncclwatch_collector_errors_total") == 1

    def test_two_collectors_on_one_registry_are_refused(self):
        registry, _ = registry_for(health())
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(HealthCollector(lambda: health()))


class TestTextfile:
    def test_path_must_end_in_prom(self, tmp_path):
        with pytest.raises(TextfileError, match=r"must end in \.prom"):
            TextfileWriter.check_path(tmp_path / "ncclwatch.txt")
        with pytest.raises(TextfileError, match="NCCLWATCH_METRICS_TEXTFILE"):
            asyncio.run(TextfileWriter().run(registry_for(health())[0], tmp_path / "ncclwatch.prom.tmp"))

    def test_written_file_parses_is_readable_by_others_and_leaves_no_temporary(self, tmp_path):
        path = tmp_path / "ncclwatch_train.prom"
        registry, _ = registry_for(rich())
        TextfileWriter().write(registry, path)
        families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
        assert families["ncclwatch_hang"].samples[0].value == 1
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask
        assert [p.name for p in tmp_path.iterdir()] == [path.name]

    def test_run_rewrites_with_fresh_state_and_removes_the_file_at_exit(self, tmp_path):
        path = tmp_path / "ncclwatch_train.prom"
        state = {"health": health(stalled_for_s=1.0)}
        registry, _ = registry_for(lambda: state["health"])

        async def scenario() -> list[float]:
            seen = []
            task = asyncio.create_task(TextfileWriter().run(registry, path, every_s=0.05))
            for stalled in (1.0, 9.0):
                state["health"] = health(stalled_for_s=stalled)
                await _until(lambda want=stalled: path.exists() and _value(path, "ncclwatch_stalled_seconds") == want)
                seen.append(_value(path, "ncclwatch_stalled_seconds"))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return seen

        assert asyncio.run(scenario()) == [1.0, 9.0]
        assert not path.exists()

    def test_missing_folder_is_retried_not_fatal(self, tmp_path):
        folder = tmp_path / "textfile_collector"
        path = folder / "ncclwatch.prom"
        registry, _ = registry_for(health())

        async def scenario() -> None:
            task = asyncio.create_task(TextfileWriter(remove_on_exit=False).run(registry, path, every_s=0.05))
            await asyncio.sleep(0.15)
            assert not task.done()
            folder.mkdir()
            await _until(path.exists)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
        assert path.exists()  # remove_on_exit=False keeps it


async def _until(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _value(path: Path, name: str) -> float | None:
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            if s.name == name:
                return s.value
    return None


class TestDashboard:
    @pytest.fixture(scope="class")
    @classmethod
    def dashboard(cls) -> dict:
        return json.loads(DASHBOARD.read_text())

    @staticmethod
    def targets(dashboard: dict) -> list[tuple[str, str]]:
        return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]

    def test_loads_with_a_prometheus_datasource_variable_and_job_host_variables(self, dashboard):
        assert 36 <= dashboard["schemaVersion"] <= 41
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["DS_PROMETHEUS"]["type"] == "datasource"
        assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
        assert {"job", "host"} <= variables.keys()
        for panel in dashboard["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]

    def test_has_the_operator_panels(self, dashboard):
        kinds = {p["title"]: p["type"] for p in dashboard["panels"]}
        assert kinds["Hang"] == "stat"
        assert kinds["Open incident: verdict and culprit ranks"] == "table"
        assert kinds["Heartbeat age per rank"] == "timeseries"
        assert kinds["Last operation position per rank and communicator"] == "timeseries"
        assert kinds["Stalled vs stall timeout"] == "timeseries"
        assert {"Processes stopped", "Bundles written", "Sources up"} <= kinds.keys()
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))

    def test_every_expression_uses_only_metrics_the_collector_exports(self, dashboard):
        exported = exported_names(registry_for(rich(), environ={"SLURM_JOB_ID": "1"})[0])
        for title, expr in self.targets(dashboard):
            used = set(re.findall(r"\bncclwatch_[a-z0-9_]+", expr))
            assert used, f"{title}: {expr} selects no ncclwatch metric"
            assert used <= exported, f"{title}: {sorted(used - exported)} not exported"

    def test_every_label_in_an_expression_is_exported(self, dashboard):
        families = parsed(registry_for(rich(), environ={"SLURM_JOB_ID": "1"})[0])
        labels = {k for f in families.values() for s in f.samples for k in s.labels}
        for title, expr in self.targets(dashboard):
            in_selectors = re.findall(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", expr)
            in_grouping = [w for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for w in re.findall(r"\w+", group)]
            assert set(in_selectors + in_grouping) <= labels, f"{title}: {expr}"
        for variable in dashboard["templating"]["list"]:
            query = variable.get("definition", "")
            for metric, label in re.findall(r"label_values\((\w+)[^,]*,\s*(\w+)\)", query):
                assert metric in families and label in labels, query
