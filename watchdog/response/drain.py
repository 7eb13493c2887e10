"""Take a node out of the scheduler's hands after a hang that blames its hardware.

Slurm: ``scontrol update NodeName=<host> State=DRAIN Reason=...``.  Running
jobs on the node finish (ours is ended by the wrapper); no new job lands on
it until an admin resumes it.  The node's name is the culprit's short
hostname, which is Slurm's ``NodeName`` on the usual clusters.
"""

from __future__ import annotations

from collections.abc import Sequence

from ncclwatch.watchdog.response.command import Outcome, run_bounded

SCONTROL_TIMEOUT_S = 30.0
REASON_MAX = 200  # Slurm keeps a reason of any length; sinfo -R shows the start


def drain_reason(verdict: str, incident: str | None) -> str:
    return f"ncclwatch: {verdict} {incident or ''}".strip()[:REASON_MAX]


async def drain_slurm(hosts: Sequence[str], reason: str, scontrol: str = "scontrol") -> Outcome:
    """One ``scontrol update`` for every host (a comma list is one Slurm hostlist)."""
    argv = [scontrol, "update", f"NodeName={','.join(hosts)}", "State=DRAIN", f"Reason={reason}"]
    return await run_bounded(argv, SCONTROL_TIMEOUT_S)
