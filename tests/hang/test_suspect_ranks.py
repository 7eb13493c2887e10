"""``suspect_ranks``: an even split no evidence decides is data in report.json, the page and the hook (issue 31).

Before, the suspects of such a split were only words in the summary ("Both sides are suspects"), so a hook or a
drain could not act on them.  Each even split the engine knows names every side's ranks as suspects and no culprit;
a decided verdict names its culprit and no suspects.
"""

from __future__ import annotations

from pathlib import Path

import nccl_lines as L
from harness import snapshot_of

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import build_report, render_text
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.response.hook import hook_environment
from ncclwatch.watchdog.response.policy import Plan, Response
from ncclwatch.watchdog.sinks.alert import trigger_from_report
from ncclwatch.watchdog.sinks.pagerduty import event_for
from ncclwatch.watchdog.sinks.webhooks import slack_message

CORPUS = Path(__file__).parents[1] / "fixtures" / "partial"
NOW = 1_800_000_000.0
COMM = "0x5581e4a3c9e0"


def split_logs(first: tuple[str, int], second: tuple[str, int], steps: int = 1) -> dict[str, str]:
    """Two ranks that agree for ``steps`` steps (too few to learn a step from), then issue different collectives."""
    logs = {}
    for rank, (name, count) in enumerate((first, second)):
        text = L.init(rank, 2, COMM) + L.steps(rank, COMM, steps) + L.op(rank, name, count, COMM)
        logs[f"node1.{1000 + rank}"] = text
    return logs


def report_of(logs: dict[str, str]):
    snapshot = snapshot_of(logs)
    finding = classify(snapshot).finding
    return finding, build_report(finding, snapshot, [], {})


class TestEvenSplitFromNcclLogs:
    def test_both_sides_are_suspects_and_no_one_is_the_culprit(self):
        finding, report = report_of(split_logs(("AllReduce", 1), ("AllGather", 1024)))
        assert (finding.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [])
        assert report.suspect_ranks == [0, 1]
        assert report.model_dump(mode="json")["suspect_ranks"] == [0, 1]
        assert "suspects rank 0, 1" in render_text(report).splitlines()[0]

    def test_a_decided_mismatch_has_a_culprit_and_no_suspects(self):
        logs = split_logs(("AllReduce", 1), ("AllGather", 1024))
        logs["node1.1002"] = L.init(2, 3, COMM) + L.steps(2, COMM, 1)
        logs["node1.1002"] += L.op(2, "AllReduce", 1, COMM)
        for name in ("node1.1000", "node1.1001"):
            logs[name] = logs[name].replace("nranks 2", "nranks 3").replace("nRanks 2", "nRanks 3")
        _, report = report_of(logs)
        assert (report.culprit_ranks, report.suspect_ranks) == ([1], [])


class TestEvenSplitFromPartialEvidence:
    def test_detail_fingerprints_split_two_ways(self):
        report = analyze_paths([str(CORPUS / "g09_detail_two_ranks_tie")], now=NOW)
        assert (report.culprit_ranks, report.suspect_ranks) == ([], [0, 1])

    def test_watchdog_lines_of_one_seqnum_with_two_sizes(self):
        report = analyze_paths([str(CORPUS / "g23_ddp_buffer_broadcast_sizes_tie")], now=NOW)
        assert report.culprit_ranks == [] and len(report.suspect_ranks) == 4

    def test_one_ranks_timeout_names_no_suspects(self):
        report = analyze_paths([str(CORPUS / "g04_single_rank_timeout_2.11")], now=NOW)
        assert (report.verdict, report.suspect_ranks) == (Verdict.inconclusive, [])


class TestThePageAndTheHookCarryThem:
    def report(self):
        _, report = report_of(split_logs(("AllReduce", 1), ("AllGather", 1024)))
        return report.model_copy(update={"job": "train", "host": "node1"})

    def test_alert_pagerduty_and_slack(self):
        alert = trigger_from_report(self.report(), bundle_id=None, bundle_url=None, environ={})
        assert (alert.culprit_ranks, alert.suspect_ranks) == ([], [0, 1])
        assert "suspects rank 0, 1" in alert.summary
        details = event_for(alert, "key")["payload"]["custom_details"]
        assert (details["culprit_ranks"], details["suspect_ranks"]) == ([], [0, 1])
        fields = str(slack_message(alert))
        assert "none named; suspects 0, 1" in fields

    def test_hook_environment(self):
        plan = Plan(response=Response.report, why="report only")
        env = hook_environment(self.report(), plan, None, base={})
        assert (env["NCCLWATCH_CULPRIT_RANKS"], env["NCCLWATCH_SUSPECT_RANKS"]) == ("", "0,1")
