"""What to do about a paged hang: end the job, restart it, drain the culprit's node.  Pure: no I/O.

A restart helps when the cause goes away with the processes: a link that
flapped, a process that died or was stopped, a GPU kernel that never
finished, an NCCL error.  It cannot help when the program itself diverged:
a collective mismatch from a branch on the rank, or a p2p pattern that
deadlocks, recurs at the same step after every restart and burns the
allocation.  The verdict catalogue's ``restart`` (``hang/verdicts.py``) is
that split, with the words said for each verdict, and the user can change
it (``--restart-on``).

The loop guard is what keeps a wrong guess cheap: a hang whose signature
(verdict, operation, the culprit's line of code, step) equals one that a
restart was already tried on is not transient, whatever the policy says.

Draining is for hardware: the node stays bad after a restart, so the job
is ended with ``EXIT_DRAINED`` and a requeue lands on other nodes.  The
catalogue's ``drain`` names the verdicts that blame a node by default
(``--drain-on``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from ncclwatch.watchdog.events import BLOCKED_STATES
from ncclwatch.watchdog.hang.report import STACK_ARROW, Report
from ncclwatch.watchdog.hang.verdicts import CATALOGUE, Verdict


class Response(StrEnum):
    report = "report"  # leave the job running
    kill = "kill"  # end torchrun: the job exits EXIT_KILLED_ON_HANG
    restart = "restart"  # end the workers: torchrun's agent starts them again (every node, through the rendezvous)
    drain = "drain"  # drain the culprit's node, then end the job: EXIT_DRAINED


@dataclass(frozen=True)
class HangSignature:
    """What makes two hangs "the same hang" for the loop guard."""

    verdict: str
    operation: str | None
    frame: str | None  # the culprit's own line that issued the operation (Flight Recorder's), when recorded
    step: int | None  # the culprit's last heartbeat step

    def same_hang(self, other: HangSignature) -> bool:
        """Equal, except that an unknown line (no Flight Recorder call site at one of the two) is no difference,
        and steps one apart are the same step: with NCCL a call returns at enqueue, and whether the host ran on
        into the next optimizer step before it blocked varies (on the H100: step 37, then 36, for one mismatch)."""
        lines_agree = self.frame is None or other.frame is None or self.frame == other.frame
        steps_agree = self.step == other.step or (
            self.step is not None and other.step is not None and abs(self.step - other.step) <= 1
        )
        return (self.verdict, self.operation) == (other.verdict, other.operation) and lines_agree and steps_agree

    def describe(self) -> str:
        parts = [
            self.verdict,
            self.operation,
            f"at {self.frame}" if self.frame else None,
            f"step {self.step}" if self.step is not None else None,
        ]
        return ", ".join(p for p in parts if p)


def signature_of(report: Report) -> HangSignature:
    """The first culprit's line and step; the lowest step of any rank when none is named.

    The line is where the culprit issued the operation, as Flight Recorder recorded it; never where py-spy
    finds the rank: with NCCL a call returns at enqueue and Python runs on, so that differs from one round
    to the next (seen on the H100: the loop guard let a mismatch restart twice).
    """
    rows = {row.rank: row for row in report.ranks}
    culprit = rows.get(report.culprit_ranks[0]) if report.culprit_ranks else None
    frame = culprit.call_site.split(STACK_ARROW)[-1] if culprit is not None and culprit.call_site else None
    if culprit is not None:
        step = culprit.step
    else:
        step = min((row.step for row in report.ranks if row.step is not None), default=None)
    operation = report.operation.split(" ")[0] if report.operation else None
    return HangSignature(report.verdict.value, operation, frame, step)


@dataclass(frozen=True)
class Plan:
    """The response to one paged hang, and why, in words for the page and the terminal."""

    response: Response
    why: str
    restart_number: int | None = None  # 1-based, of ``max_restarts``
    max_restarts: int | None = None
    drain_hosts: tuple[str, ...] = ()
    signature: HangSignature | None = None

    @property
    def ends_job(self) -> bool:
        return self.response in (Response.kill, Response.drain)

    def headline(self) -> str:
        """What the page says was done: "restarting (1 of 3)", "ending the job: recurs after restart"."""
        if self.response is Response.restart:
            return f"restarting ({self.restart_number} of {self.max_restarts})"
        if self.response is Response.drain:
            return f"draining {', '.join(self.drain_hosts)} and ending the job"
        if self.response is Response.kill:
            return f"ending the job: {self.why}"
        return "the job is left running"


@dataclass(frozen=True)
class Policy:
    on_hang: str  # "report", "kill", "restart"
    max_restarts: int  # torchrun's --max-restarts (0 when not given)
    restart_on: frozenset[Verdict]
    drain: str  # "none", "slurm"
    drain_on: frozenset[Verdict]
    restart_blocked: frozenset[Verdict] = frozenset()  # restarted where every culprit is blocked (``..._blocked``)


def blocked_culprits(report: Report) -> list[int]:
    """The culprits, if every one of them is blocked in the kernel rather than running its code; else []."""
    rows = {row.rank: row for row in report.ranks}
    states = [rows[r].state if r in rows else None for r in report.culprit_ranks]
    return list(report.culprit_ranks) if states and all(s in BLOCKED_STATES for s in states) else []


def plan(report: Report, policy: Policy, restarts_done: int, restarted: Sequence[HangSignature]) -> Plan:
    """The response to ``report``.

    ``restarts_done``: torchrun's restart count of the hung round (its
    ``TORCHELASTIC_RESTART_COUNT``: crashes it restarted count too);
    ``restarted``: the signatures of hangs already answered by a restart.
    """
    verdict = report.verdict
    signature = signature_of(report)
    hosts = culprit_hosts(report)
    if policy.drain != "none" and verdict in policy.drain_on and hosts and policy.on_hang != "report":
        why = f"{verdict.value} blames the hardware of {', '.join(hosts)}"
        return Plan(Response.drain, why, drain_hosts=tuple(hosts), signature=signature)
    if policy.on_hang == "report":
        return Plan(Response.report, "--on-hang report", signature=signature)
    if policy.on_hang == "kill":
        return Plan(Response.kill, "--on-hang kill", signature=signature)
    if policy.max_restarts <= 0:
        return Plan(Response.kill, "torchrun was given no --max-restarts", signature=signature)
    if any(signature.same_hang(before) for before in restarted):
        return Plan(Response.kill, f"recurs after restart: not transient ({signature.describe()})", signature=signature)
    entry = CATALOGUE[verdict]
    blocked = verdict not in policy.restart_on and verdict in policy.restart_blocked and blocked_culprits(report)
    if verdict not in policy.restart_on and not blocked:
        # A verdict restarted by default that the user took out of --restart-on: its words say a restart helps.
        why = entry.restart_why if not entry.restart and entry.hang else f"{verdict.value} is not in --restart-on"
        return Plan(Response.kill, f"a restart cannot help: {why}", signature=signature)
    if restarts_done >= policy.max_restarts:
        return Plan(Response.kill, f"restarts used up ({restarts_done} of {policy.max_restarts})", signature=signature)
    if blocked:
        ranks = ", ".join(map(str, blocked))
        why = f"rank {ranks} blocked, not running: {entry.restart_when_blocked}"
    else:
        why = entry.restart_why if entry.restart else f"--restart-on includes {verdict.value}"
    return Plan(
        Response.restart, why, restart_number=restarts_done + 1, max_restarts=policy.max_restarts, signature=signature
    )


def culprit_hosts(report: Report) -> list[str]:
    rows = {row.rank: row for row in report.ranks}
    hosts = [rows[r].host for r in report.culprit_ranks if r in rows and rows[r].host]
    return list(dict.fromkeys(h for h in hosts if h))
