"""The response to a paged hang: planned, carried out, written into the bundle, and a restart followed.

A page is a ``Reported``: the report as written, its bundle, and the alert that progress resolves.
The plan is the leader's when this node follows its job-wide verdict (every node carries out the same response
on its own ranks), else the policy's on this node's report of the hang (``Responder.plan``, which
``launcher/respond.py`` implements with the means to act: kill, restart, drain, the user's hook).  What was done
is added to the report and to the bundle already written.  After a restart there is nothing to watch until
torchrun starts the new round (its workers are a fresh incident); the new round's first progress resolves the
page.

Failure modes: an action that raises is logged, and the watch goes on (the page is out); a bundle that cannot be
amended keeps the report as written at the page, and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ncclwatch.watchdog.cluster.handoff import LeaderVerdict
from ncclwatch.watchdog.hang.report import ActionRecord, Report
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.live.bundle import amend_bundle
from ncclwatch.watchdog.live.incident import WATCHING, Incident, Phase
from ncclwatch.watchdog.live.job import LiveJob
from ncclwatch.watchdog.response.policy import Plan, Response
from ncclwatch.watchdog.sinks.alert import Alert, trigger_from_report

log = logging.getLogger("ncclwatch")


@dataclass
class Reported:
    """A paged incident: what was said, where the bundle is, the alert to resolve."""

    started_at: float
    decision: Decision
    report: Report
    bundle: Path | None = None
    alert: Alert | None = None  # the trigger sent, so that progress can resolve it

    def trigger(self, bundle_base_url: str | None, upload_server: str | None = None) -> Alert:
        """The page's alert, linking the bundle: through the bundle API where it is served, else as a file; and
        the incident on the cluster's server when bundles are uploaded there (``upload_server``)."""
        bundle = self.bundle
        bundle_id = bundle.name.removesuffix(".tar.gz") if bundle else None
        if bundle_id and bundle_base_url:
            url = f"{bundle_base_url.rstrip('/')}/bundles/{bundle_id}"
        else:
            url = bundle.resolve().as_uri() if bundle else None
        return trigger_from_report(self.report, bundle_id=bundle_id, bundle_url=url, upload_server=upload_server)


class Responder(Protocol):
    """What to do about a paged hang, and doing it (``launcher/respond.py``): restart, kill, drain, hook."""

    restarts: int

    def plan(self, report: Report, restarts_done: int) -> Plan: ...

    def follow(self, response: str, why: str, restarts_done: int) -> Plan: ...

    async def carry_out(
        self, plan: Plan, report: Report, bundle: Path | None, workers: Sequence[int], pages: bool
    ) -> list[ActionRecord]: ...


@dataclass
class Restarting:
    """A restart asked for: the paged incident, resolved once every rank of the new round has trained."""

    reported: Reported
    at: float  # when the workers were ended
    round: int  # torchrun's restart count of the round that hung
    number: int | None
    of: int | None


class Responding:
    """This node's response to its pages; with no ``Responder``, a page is only reported."""

    def __init__(
        self,
        responder: Responder | None,
        live: LiveJob,
        clock: Callable[[], float],
        say: Callable[[str], None],
        resolve: Callable[[Reported, str], None],
    ) -> None:
        self.responder = responder
        self.live = live
        self.clock = clock
        self.say = say
        self.resolve = resolve  # closes a page (its alert)
        self.restarting: Restarting | None = None  # a restart asked for, until the new round moves

    def restarts(self) -> int:
        return self.responder.restarts if self.responder is not None else 0

    def plan(self, report: Report, followed: LeaderVerdict | None) -> Plan | None:
        """The response: the leader's when following its verdict (``followed``), else the policy's on this
        node's report of the hang."""
        if self.responder is None:
            return None
        restarts_done = self.live.state.restarts_seen()
        if followed is not None and followed.response is not None:
            return self.responder.follow(followed.response, followed.why, restarts_done)
        return self.responder.plan(report, restarts_done)

    async def respond(self, plan: Plan, reported: Reported, workers: Sequence[int], pager: bool) -> None:
        """Carry the plan out on ``workers`` (pids); what was done goes into the report, the bundle and, for a
        restart, the watch.  ``pager``: this node paged, so it alone drains and runs the hook."""
        assert self.responder is not None
        if plan.response is not Response.report:
            self.say(plan.headline() if plan.response is Response.kill else f"{plan.headline()}: {plan.why}")
        try:
            actions = await self.responder.carry_out(plan, reported.report, reported.bundle, workers, pager)
        except Exception:  # the page is out; a failed action is logged, never the end of the watch
            log.exception("carrying out %s failed", plan.response.value)
            return
        reported.report = reported.report.model_copy(update={"actions": [*reported.report.actions, *actions]})
        if reported.bundle is not None and actions:
            try:
                await amend_bundle(reported.bundle, reported.report)
            except OSError as exc:
                log.warning("could not add what was done to the bundle %s: %s", reported.bundle, exc)
        if plan.response is Response.restart:
            hung_round = self.live.state.current_round()
            self.restarting = Restarting(reported, self.clock(), hung_round, plan.restart_number, plan.max_restarts)

    def after_restart(self, incident: Incident) -> Incident | None:
        """The incident to watch on with; None while a restart's old round is still the one seen (its workers,
        dying: their silence is ours).  Once torchrun starts the new round, a page still open gives way to a
        fresh incident, and the page is resolved once every rank of the new round has trained (``trained_since``): a
        round whose ranks are up but fail to set up NCCL is not "training again"."""
        restart = self.restarting
        if restart is None:
            return incident
        if self.live.state.current_round() <= restart.round:
            return None
        if incident.phase is Phase.paged:
            incident = WATCHING
            self.say(f"restart {restart.number} of {restart.of}: the new round's ranks are up; watching them")
        if self.live.trained_since(restart.at, restart.round):
            self.restarting = None
            self.resolve(restart.reported, f"training again after restart {restart.number} of {restart.of}")
            self.say(f"training again after restart {restart.number} of {restart.of}")
        return incident
