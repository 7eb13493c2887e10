"""``--on-hang-exec CMD``: the site's own answer to a hang (cordon a Kubernetes node, open a ticket).

``CMD`` runs through ``/bin/sh -c`` on the node that pages, once per hang,
after the page is out (a slow or failing hook never delays it).  It reads
the verdict as JSON on stdin (``{"response", "why", "bundle", "report"}``,
the report as in report.json) and in environment variables:

    NCCLWATCH_VERDICT         collective_mismatch, process_dead, ...
    NCCLWATCH_CULPRIT_RANKS   comma-separated global ranks ("" when none is named)
    NCCLWATCH_CULPRIT_HOSTS   comma-separated short hostnames of those ranks
    NCCLWATCH_SUSPECT_RANKS   comma-separated global ranks of an even split no evidence decides (one side is
                              wrong; "" when a culprit is named)
    NCCLWATCH_RESPONSE        what ncclwatch does about it: report, kill, restart, drain
    NCCLWATCH_BUNDLE          the bundle's path ("" when it could not be written)
    NCCLWATCH_INCIDENT        the incident's key (the same on every node)
    NCCLWATCH_JOB             the job's name
    NCCLWATCH_HEADLINE        one line: what happened, where, what to do next
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.response.command import Outcome, run_bounded
from ncclwatch.watchdog.response.policy import Plan, culprit_hosts


def hook_environment(
    report: Report, plan: Plan, bundle: Path | None, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    return {
        **base,
        "NCCLWATCH_VERDICT": report.verdict.value,
        "NCCLWATCH_CULPRIT_RANKS": ",".join(map(str, report.culprit_ranks)),
        "NCCLWATCH_CULPRIT_HOSTS": ",".join(culprit_hosts(report)),
        "NCCLWATCH_SUSPECT_RANKS": ",".join(map(str, report.suspect_ranks)),
        "NCCLWATCH_RESPONSE": plan.response.value,
        "NCCLWATCH_BUNDLE": str(bundle) if bundle is not None else "",
        "NCCLWATCH_INCIDENT": report.incident_key or report.hang_started_at or "",
        "NCCLWATCH_JOB": report.job or "",
        "NCCLWATCH_HEADLINE": report.headline or report.summary,
    }


async def run_hook(command: str, report: Report, plan: Plan, bundle: Path | None, timeout_s: float) -> Outcome:
    verdict = {
        "response": plan.response.value,
        "why": plan.why,
        "bundle": str(bundle) if bundle is not None else None,
        "report": report.model_dump(mode="json"),
    }
    stdin = json.dumps(verdict).encode()
    return await run_bounded(
        ["/bin/sh", "-c", command], timeout_s, stdin=stdin, env=hook_environment(report, plan, bundle)
    )
