"""Carrying a response out: real processes for the hook and its deadline, a real bundle amended in place."""

from __future__ import annotations

import asyncio
import json
import tarfile
import time
from pathlib import Path

import psutil

from ncclwatch.watchdog.hang.report import ActionRecord, RankRow, Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.bundle import amend_bundle
from ncclwatch.watchdog.response.command import TAIL_CHARS, run_bounded
from ncclwatch.watchdog.response.hook import run_hook
from ncclwatch.watchdog.response.policy import Plan, Response


def hung_report() -> Report:
    rows = [RankRow(rank=0, host="node0", pid=10), RankRow(rank=1, host="node1", pid=11)]
    return Report(
        verdict=Verdict.process_stopped,
        culprit_ranks=[1],
        summary="rank 1 is stopped",
        ranks=rows,
        analyzed_at="2026-11-24T00:00:00+00:00",
        job="train",
        incident_key="run/0|pg0#26",
        headline="ncclwatch: PROCESS STOPPED rank 1 ...",
    )


RESTART = Plan(Response.restart, "the restart replaces the stopped process", restart_number=1, max_restarts=3)


class TestHook:
    def test_the_hook_reads_the_verdict_as_json_on_stdin_and_in_its_environment(self, tmp_path: Path) -> None:
        seen = tmp_path / "seen"
        command = f"cat > {seen}.json; env | grep ^NCCLWATCH_ | sort > {seen}.env"
        outcome = asyncio.run(run_hook(command, hung_report(), RESTART, tmp_path / "b.tar.gz", timeout_s=20))
        assert outcome.ok, outcome
        verdict = json.loads(seen.with_suffix(".json").read_text())
        assert verdict["response"] == "restart" and verdict["report"]["culprit_ranks"] == [1]
        assert verdict["bundle"] == str(tmp_path / "b.tar.gz")
        env = dict(line.split("=", 1) for line in seen.with_suffix(".env").read_text().splitlines())
        assert env["NCCLWATCH_VERDICT"] == "process_stopped" and env["NCCLWATCH_CULPRIT_RANKS"] == "1"
        assert env["NCCLWATCH_CULPRIT_HOSTS"] == "node1" and env["NCCLWATCH_RESPONSE"] == "restart"
        assert env["NCCLWATCH_INCIDENT"] == "run/0|pg0#26" and env["NCCLWATCH_JOB"] == "train"

    def test_a_failing_hook_is_recorded_with_its_status_and_output(self, tmp_path: Path) -> None:
        outcome = asyncio.run(
            run_hook("echo 'kubectl: no such node' >&2; exit 2", hung_report(), RESTART, None, timeout_s=20)
        )
        assert not outcome.ok
        assert outcome.describe("--on-hang-exec") == "--on-hang-exec exit 2: kubectl: no such node"

    def test_a_hook_that_never_reads_its_stdin_still_runs(self) -> None:
        assert asyncio.run(run_hook("exit 0", hung_report(), RESTART, None, timeout_s=20)).ok


class TestDeadline:
    def test_a_command_past_its_deadline_is_killed_with_everything_it_started(self, tmp_path: Path) -> None:
        pids = tmp_path / "pids"
        began = time.monotonic()
        outcome = asyncio.run(run_bounded(["/bin/sh", "-c", f"sleep 300 & echo $! > {pids}; sleep 300"], timeout_s=1.0))
        assert time.monotonic() - began < 10
        assert not outcome.ok and outcome.error == "still running after 1 s: killed"
        child = int(pids.read_text())
        for _ in range(50):  # the grandchild is reaped by init a moment later
            if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the hook's child {child} outlived its deadline")

    def test_a_missing_program_is_an_outcome_not_an_exception(self) -> None:
        outcome = asyncio.run(run_bounded(["/nonexistent/scontrol", "update"], timeout_s=5))
        assert not outcome.ok and outcome.error is not None and outcome.error.startswith("could not start")

    def test_only_the_end_of_a_long_output_is_kept(self) -> None:
        outcome = asyncio.run(run_bounded(["/bin/sh", "-c", "seq 1 100000"], timeout_s=20))
        assert outcome.ok and len(outcome.output) == TAIL_CHARS and outcome.output.endswith("100000\n")


class TestAmendBundle:
    def test_the_bundles_report_gets_what_was_done_and_every_other_file_stays(self, tmp_path: Path) -> None:
        folder = tmp_path / "train-node0-x"
        (folder / "stacks").mkdir(parents=True)
        (folder / "stacks" / "rank1.txt").write_text("Thread 1 (idle)\n")
        report = hung_report()
        (folder / "report.json").write_text(report.model_dump_json())
        (folder / "report.md").write_text("# before\n")
        bundle = tmp_path / "train-node0-x.tar.gz"
        with tarfile.open(bundle, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)
        done = ActionRecord(kind="restart", at="2026-11-24T00:00:01+00:00", ok=True, detail="ended workers 10, 11")
        asyncio.run(
            amend_bundle(bundle, report.model_copy(update={"response": "restarting (1 of 3)", "actions": [done]}))
        )
        with tarfile.open(bundle) as tar:
            names = sorted(tar.getnames())
            amended = json.loads(tar.extractfile("train-node0-x/report.json").read())  # type: ignore[union-attr]
            markdown = tar.extractfile("train-node0-x/report.md").read().decode()  # type: ignore[union-attr]
            stack = tar.extractfile("train-node0-x/stacks/rank1.txt").read().decode()  # type: ignore[union-attr]
        assert names == [
            "train-node0-x",
            "train-node0-x/report.json",
            "train-node0-x/report.md",
            "train-node0-x/stacks",
            "train-node0-x/stacks/rank1.txt",
        ]
        assert (
            amended["response"] == "restarting (1 of 3)" and amended["actions"][0]["detail"] == "ended workers 10, 11"
        )
        assert "## What was done" in markdown and "restart: ended workers 10, 11" in markdown
        assert stack == "Thread 1 (idle)\n"
        assert not list(tmp_path.glob(".*partial"))
