"""The alert built from a report: one key per hang, a summary that names the culprit and fits PagerDuty."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.sinks.alert import SUMMARY_MAX, Alert, dedup_key_for, resolve_for, trigger_from_report

HANG = "2026-11-22T10:00:00.000+00:00"


def report(**changes) -> Report:
    base = {
        "verdict": Verdict.collective_mismatch,
        "culprit_ranks": [3],
        "communicator": "0x7f3a (world, 8 ranks)",
        "position": 42,
        "operation": "AllReduce sum 4096 x float32",
        "summary": "rank 3 issued Broadcast where the others issued AllReduce",
        "reason": "rank 3 skipped an AllReduce",
        "analyzed_at": "2026-11-22T10:00:05+00:00",
        "job": "train",
        "host": "node1",
        "hang_started_at": HANG,
        "detected_at": "2026-11-22T10:00:05.000+00:00",
    }
    return Report(**(base | changes))


def trigger(environ=None, **changes) -> Alert:
    return trigger_from_report(
        report(**changes), bundle_id="b-1", bundle_url="http://node1:9464/bundles/b-1", environ=environ or {}
    )


class TestDedupKey:
    def test_same_job_and_hang_give_the_same_key(self):
        assert dedup_key_for("train", HANG, "881") == dedup_key_for("train", HANG, "881")

    def test_host_is_not_in_the_key_so_nodes_page_once(self):
        assert trigger(host="node1").dedup_key == trigger(host="node7").dedup_key

    def test_another_hang_or_slurm_job_gets_another_key(self):
        key = dedup_key_for("train", HANG, "881")
        assert dedup_key_for("train", "2026-11-22T11:00:00.000+00:00", "881") != key
        assert dedup_key_for("train", HANG, "882") != key
        assert dedup_key_for("train", HANG, None) != key

    def test_one_instant_spelled_two_ways_is_one_key(self):
        assert dedup_key_for("train", "2026-11-22T10:00:00Z", None) == dedup_key_for("train", HANG, None)

    def test_names_that_slug_alike_still_differ(self):
        assert dedup_key_for("my job", HANG, None) != dedup_key_for("my_job", HANG, None)

    def test_key_is_readable_safe_and_short(self):
        key = dedup_key_for("llama/70b pretrain " * 20, HANG, "881")
        assert key.startswith("ncclwatch-hang-llama_70b_pretrain_")
        assert "-slurm881-" in key
        assert re.fullmatch(r"[A-Za-z0-9_-]+", key) and len(key) <= 255


class TestTrigger:
    def test_summary_names_culprit_verdict_job_and_host(self):
        assert trigger().summary == (
            "ncclwatch: rank 3 collective_mismatch in train on node1: "
            "rank 3 issued Broadcast where the others issued AllReduce"
        )

    def test_several_culprits_are_all_named(self):
        assert trigger(culprit_ranks=[3, 5]).summary.startswith("ncclwatch: ranks 3, 5 collective_mismatch in train")

    def test_no_culprit_names_no_rank(self):
        assert trigger(verdict=Verdict.inconclusive, culprit_ranks=[]).summary.startswith(
            "ncclwatch: inconclusive in train on node1: "
        )

    def test_long_summary_is_cut_to_1024_with_an_ellipsis(self):
        summary = trigger(summary="x" * 5000).summary
        assert len(summary) == SUMMARY_MAX and summary.endswith("…")

    def test_short_summary_is_kept_whole(self):
        assert not trigger().summary.endswith("…")

    def test_fields_come_from_the_report(self):
        alert = trigger()
        assert (alert.action, alert.verdict, alert.culprit_ranks, alert.position) == (
            "trigger",
            "collective_mismatch",
            [3],
            42,
        )
        assert (alert.bundle_id, alert.bundle_url) == ("b-1", "http://node1:9464/bundles/b-1")
        assert alert.report["operation"] == "AllReduce sum 4096 x float32"
        assert alert.reason == "rank 3 skipped an AllReduce"

    def test_slurm_job_id_labels_the_alert_and_its_key(self):
        alert = trigger(environ={"SLURM_JOB_ID": "881"})
        assert alert.slurm_job_id == "881"
        assert alert.dedup_key == dedup_key_for("train", HANG, "881")

    def test_outside_slurm_there_is_no_label(self):
        assert trigger(environ={}).slurm_job_id is None

    def test_an_analyze_report_without_job_still_alerts(self):
        alert = trigger(job=None, hang_started_at=None)
        assert alert.job == "unknown-job" and alert.host == "node1"

    def test_alert_round_trips_through_json(self):
        alert = trigger()
        assert Alert.model_validate_json(alert.model_dump_json()) == alert


class TestResolve:
    def test_resolve_closes_the_same_incident(self):
        opened = trigger()
        closed = resolve_for(opened, "progress resumed")
        assert (closed.action, closed.dedup_key, closed.reason) == ("resolve", opened.dedup_key, "progress resumed")
        assert closed.summary == "ncclwatch: resolved in train on node1: progress resumed"
        assert closed.report is None and opened.report is not None

    def test_resolve_summary_is_cut_too(self):
        closed = resolve_for(trigger(), "y" * 2000)
        assert len(closed.summary) == SUMMARY_MAX and closed.summary.endswith("…")

    def test_alerts_are_frozen(self):
        with pytest.raises(ValidationError):
            trigger().action = "resolve"
