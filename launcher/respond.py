"""The wrapper's answer to a paged hang: the policy's plan, carried out on this node's job.

Every node carries out the same response on its own ranks (the leader's plan
travels with its verdict): restart ends this node's workers and torchrun's
agents start the whole group again through the rendezvous; kill and drain
end this node's torchrun.  Only the node that pages drains the culprit's node
and runs the user's hook, once per hang, after the page.

Each step is an ``ActionRecord`` for report.json, and a line on the terminal,
except ending the job: the page's own line says that (``ending the job: ...``).
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ncclwatch.launcher.process import JobProcess
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.hang.report import ActionRecord, Report
from ncclwatch.watchdog.hang.verdicts import BLOCKED, Verdict
from ncclwatch.watchdog.response.drain import drain_reason, drain_slurm
from ncclwatch.watchdog.response.hook import run_hook
from ncclwatch.watchdog.response.policy import HangSignature, Plan, Policy, Response, plan

KILL_GRACE_S = 10.0


def policy_of(settings: Settings, max_restarts: int) -> Policy:
    return Policy(
        on_hang=settings.on_hang,
        max_restarts=max_restarts,
        restart_on=frozenset(Verdict(n) for n in settings.restart_on if not n.endswith(BLOCKED)),
        restart_blocked=frozenset(Verdict(n.removesuffix(BLOCKED)) for n in settings.restart_on if n.endswith(BLOCKED)),
        drain=settings.drain,
        drain_on=frozenset(map(Verdict, settings.drain_on)),
    )


def start_notes(settings: Settings, max_restarts: int) -> list[str]:
    """Said once at start: settings that cannot do what they ask for."""
    notes = []
    if settings.on_hang == "restart" and max_restarts <= 0:
        notes.append(
            "--on-hang restart: torchrun has no --max-restarts, so it cannot restart the workers; "
            "a hang ends the job as with --on-hang kill (give torchrun --max-restarts=N)"
        )
    if settings.drain != "none" and settings.on_hang == "report":
        notes.append(
            f"--drain {settings.drain} acts only with --on-hang kill or restart: this job is left running after a hang"
        )
    return notes


class JobResponder:
    """The policy with this node's memory of restarts, and the means to act on its job."""

    def __init__(self, settings: Settings, job: JobProcess, max_restarts: int, out: TextIO = sys.stderr) -> None:
        self.settings = settings
        self.job = job
        self.policy = policy_of(settings, max_restarts)
        self.out = out
        self.restarted: list[HangSignature] = []  # hangs answered by a restart, oldest first (the loop guard)
        self.restarts = 0  # restarts this wrapper asked for
        self.ended: Plan | None = None  # the plan that ended the job, for the exit status

    def plan(self, report: Report, restarts_done: int) -> Plan:
        return plan(report, self.policy, restarts_done, self.restarted)

    def follow(self, response: str, why: str, restarts_done: int) -> Plan:
        """The leader's plan, numbered with this node's own restarts."""
        chosen = Response(response)
        if chosen is Response.restart:
            return Plan(chosen, why, restart_number=restarts_done + 1, max_restarts=self.policy.max_restarts)
        return Plan(chosen, why)

    async def carry_out(
        self, chosen: Plan, report: Report, bundle: Path | None, workers: Sequence[int], pages: bool
    ) -> list[ActionRecord]:
        """End what the plan ends at once; then, where this node pages, drain and run the hook (bounded)."""
        actions: list[ActionRecord] = []
        if chosen.response is Response.restart:
            ended = self.job.end_workers(workers) if self.job.returncode is None else []
            if chosen.signature is not None:
                self.restarted.append(chosen.signature)
            self.restarts += 1
            detail = (
                f"ended workers {', '.join(map(str, ended))}; torchrun restarts them "
                f"(restart {chosen.restart_number} of {chosen.max_restarts})"
            )
            actions.append(self._record("restart", bool(ended), detail if ended else "no worker was running"))
        elif chosen.ends_job and self.job.returncode is None:
            self.job.terminate(grace_s=KILL_GRACE_S)
            self.ended = chosen
            # Recorded, not said: the page's line ("ending the job: ...", ``Responding.respond``) said it.
            actions.append(self._record("kill", True, f"ended the job: {chosen.why}", say=False))
        if pages and chosen.response is Response.drain and self.settings.drain == "slurm":
            # The incident: its key on several nodes, else the bundle that holds it (its name has host and time).
            incident = report.incident_key or (
                bundle.name.removesuffix(".tar.gz") if bundle else report.hang_started_at
            )
            outcome = await drain_slurm(chosen.drain_hosts, drain_reason(report.verdict.value, incident))
            hosts = ", ".join(chosen.drain_hosts)
            actions.append(
                self._record("drain", outcome.ok, f"{hosts}: " + outcome.describe("scontrol update State=DRAIN"))
            )
        if pages and self.settings.on_hang_exec:
            outcome = await run_hook(self.settings.on_hang_exec, report, chosen, bundle, self.settings.hook_timeout)
            actions.append(self._record("hook", outcome.ok, outcome.describe("--on-hang-exec")))
        return actions

    def _record(self, kind: str, ok: bool, detail: str, say: bool = True) -> ActionRecord:
        if say:
            print(f"ncclwatch: {kind}: {detail}" + ("" if ok else " (failed)"), file=self.out, flush=True)
        at = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        return ActionRecord(kind=kind, at=at, ok=ok, detail=detail)
