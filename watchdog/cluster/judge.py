"""The whole job's verdict from every node's evidence: the same engine, more inputs.

``job_state`` folds the other nodes' shared evidence into a fresh state and
unions this node's (each rank's sequence lives on one node, so the union
is exact).  ``focus`` picks the nodes whose full evidence decides the
verdict.  ``with_lost_nodes`` turns a node whose sidecar stopped answering,
while the others' ranks wait, into ``node_lost`` naming that node and its
ranks.  ``degraded`` says, in the verdict itself, that a sidecar judged
alone.  ``incident_key`` is what every node derives alike for one hang, so
that two nodes paging the same hang page once: a lost node is one key per
round whoever sees it (the leader through the store, or the other side of a
partition through lifelines).  Pure.
"""

from __future__ import annotations

from dataclasses import replace

from ncclwatch.watchdog.cluster.peers import Membership
from ncclwatch.watchdog.cluster.view import LOST_AFTER_S, Contact
from ncclwatch.watchdog.events import Event, Stall
from ncclwatch.watchdog.hang.classify import Decision
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Fact
from ncclwatch.watchdog.hang.verdicts import PRIORITY, Verdict


def job_state(local: JobState, remote: dict[int, list[Event]], stall: Stall) -> JobState:
    merged = JobState(window=local.window)
    for events in remote.values():
        for event in events:
            merged.apply(event)
    merged.merge(local)
    merged.stall = stall
    return merged


def focus(decision: Decision, nodes_of: dict[int, int], lost: set[int], limit: int) -> list[int]:
    """The nodes whose full evidence decides: the culprits' and absent ranks', then those of ranks whose row
    differs from the most common one (behind, diverged), at most ``limit``; never a lost node (it cannot answer).

    A rank behind where the others' operation at its position is unknown (``?``) asks the others' nodes too:
    their compact tails began after that position, their hosts having run ahead (on the H100, FSDP2 across two
    wrappers: the rank that skipped a collective enqueued 157 more), and only their full evidence tells a rank
    behind from ranks that diverged.  With two ranks the most common row is a tie, so this was left to chance."""
    finding = decision.finding
    statuses = [row.status for row in finding.rows]
    usual = max(set(statuses), key=statuses.count) if statuses else None
    unseen = finding.verdict == Verdict.rank_behind and finding.operation == "?"
    ahead = [row.rank for row in finding.rows if row.rank not in finding.culprits] if unseen else []
    ranks = [*finding.culprits, *finding.absent, *(row.rank for row in finding.rows if row.status != usual), *ahead]
    chosen: list[int] = []
    for rank in ranks:
        node = nodes_of.get(rank)
        if node is not None and node not in lost and node not in chosen:
            chosen.append(node)
    return chosen[:limit]


SILENT = "its sidecar has not published for over {s:.0f} s while the other nodes' ranks wait"
STORE_GONE = "it served the job's store, which is gone, and its sidecar does not answer"


def with_lost_nodes(
    decision: Decision, lost: dict[int, Contact], remote: dict[int, list[Event]], why: str = SILENT
) -> Decision:
    """A node that neither publishes nor shares evidence while ranks wait is the job's problem, unless a
    fault at least as strong (``PRIORITY``: a mismatch, a dead process) is named elsewhere.  What waiting on
    a lost node looks like (a neighbour behind in enqueued collectives, ranks stuck in one) is its symptom:
    on 8 GPU nodes a frozen node 4 was first paged as ``rank_behind [5]`` (``why``: how it was found lost)."""
    gone = {node: summary for node, summary in lost.items() if node not in remote}
    if not gone:
        return decision
    finding = decision.finding
    lost_ranks = sorted(r for s in gone.values() for r in s.ranks)
    stronger = PRIORITY.get(finding.verdict, 0) >= PRIORITY[Verdict.node_lost]
    if stronger and finding.culprits and not set(finding.culprits) <= set(lost_ranks):
        return decision
    nodes = ", ".join(_node(n, s) for n, s in sorted(gone.items()))
    ranks = f" (ranks {', '.join(map(str, lost_ranks))})" if lost_ranks else ""
    lost = replace(
        finding,
        verdict=Verdict.node_lost,
        culprits=tuple(lost_ranks),
        summary=f"Node {nodes}{ranks} stopped answering: {why.format(s=LOST_AFTER_S)}.",
        reason="The whole node is frozen, cut off the network, or its sidecar died; its ranks cannot be seen. "
        "Check the node (console, dmesg, its network) first. "
        + (f"Engine on the rest: {finding.summary}" if finding.summary else ""),
        evidence=tuple(
            Fact("cluster", f"node {_node(n, s)}: last summary {'never' if s.at is None else f'at {s.at:.0f}'}")
            for n, s in sorted(gone.items())
        )
        + finding.evidence,
    )
    return Decision(lost, page=True)


def degraded(decision: Decision, why: str) -> Decision:
    """Judged from this node's ranks alone: said in the verdict, never hidden."""
    note = f"could not reach the other nodes' sidecars ({why}): judged from this node's ranks only"
    return replace(decision, finding=replace(decision.finding, missing=decision.finding.missing + (note,)))


def unread_verdict(decision: Decision, leader: int, key: str) -> Decision:
    """A member that lost the store after the leader announced its verdict, unread: the leader judged the whole job
    and paged it; this node's own view, judged alone, is said to be only that (it may well differ: it lacks the
    other nodes' ranks)."""
    finding = decision.finding
    note = (
        f"the job-wide verdict: node {leader}'s bundle and page ({key}); the store went away before this node read it"
    )
    summary = (
        f"Node {leader} judged the whole job and paged it ({key}); its store went away before this node read "
        f"that verdict. This node's ranks alone: {finding.summary}"
    )
    return replace(decision, finding=replace(finding, summary=summary, missing=finding.missing + (note,)))


def incident_key(membership: Membership, decision: Decision) -> str:
    """Job round + what stalled: the same on every node that judges the same evidence."""
    finding = decision.finding
    if finding.verdict is Verdict.node_lost:
        return f"{membership.job_key}|node_lost"
    if finding.comm_label and finding.position is not None:
        what = f"{finding.comm_label}#{finding.position}"
    else:
        what = f"{finding.verdict.value}:{','.join(map(str, finding.culprits))}"
    return f"{membership.job_key}|{what}"


def _node(node: int, contact: Contact) -> str:
    return f"{node} ({contact.host})" if contact.host != "?" else str(node)
