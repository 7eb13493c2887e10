"""A page builds the live report once: the response is planned from it, and the bundle writer adds to it.

The sidecar (tests/live/test_sidecar_ticks.py's rig, its scripted job) with a responder and the real
``BundleWriter``; evidence collection is replaced by nothing, so the bundle holds only the report.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from test_sidecar_ticks import SETTINGS, Rig, healthy_job, stuck_frames

from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live import bundle, judging
from ncclwatch.watchdog.live.bundle import BundleWriter
from ncclwatch.watchdog.live.incident import CONFIRM_S, Phase
from ncclwatch.watchdog.response.policy import Plan, Response

WRITER_NOTE = "said in every report of this run"


class PlanRecorder:
    """The ``Responder``: plans to leave the job running, and keeps the report each plan was made from."""

    restarts = 0

    def __init__(self) -> None:
        self.planned: list[Report] = []

    def plan(self, report: Report, restarts_done: int) -> Plan:
        self.planned.append(report)
        return Plan(Response.report, "report only")

    def follow(self, response: str, why: str, restarts_done: int) -> Plan:
        raise AssertionError("a single node never follows a leader")

    async def carry_out(self, plan, report, bundle_path, workers, pages):  # type: ignore[no-untyped-def]
        return []


@pytest.fixture
def live_report_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The job of each ``live_report`` call, wherever the sidecar (``judging.page_report``) or the bundle writer
    makes one."""
    builds: list[str] = []
    original = bundle.live_report

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        builds.append(kwargs["job"])
        return original(*args, **kwargs)

    async def no_evidence(context):  # type: ignore[no-untyped-def]
        return []

    monkeypatch.setattr(bundle, "live_report", counted)
    monkeypatch.setattr(judging, "live_report", counted)
    monkeypatch.setattr(bundle, "collect_all", no_evidence)
    return builds


def test_a_page_builds_the_live_report_once_and_the_bundle_holds_it(
    tmp_path: Path, live_report_builds: list[str]
) -> None:
    rig = Rig(tmp_path)
    responder = PlanRecorder()
    settings = SETTINGS.model_copy(update={"bundle_dir": tmp_path / "bundles"})
    writer = BundleWriter(settings, tmp_path / "run", "train", "node1", notes=[WRITER_NOTE])
    rig.sidecar.reporter, rig.sidecar.responding.responder = writer, responder
    healthy_job(rig)
    stuck_frames(rig)
    rig.tick(25.1)
    rig.tick(25.1 + CONFIRM_S)
    assert rig.phase is Phase.paged
    assert live_report_builds == ["train"]
    [planned] = responder.planned
    [reported] = rig.sidecar.reported
    assert (planned.verdict, planned.culprit_ranks) == (Verdict.rank_behind, [2])
    assert reported.bundle is not None
    with tarfile.open(reported.bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
        kept = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    assert (kept["verdict"], kept["culprit_ranks"], kept["headline"]) == ("rank_behind", [2], planned.headline)
    assert kept["ranks"] == [row.model_dump(mode="json") for row in planned.ranks]
    assert kept["notes"][-1] == WRITER_NOTE and reported.report.response == "the job is left running"
