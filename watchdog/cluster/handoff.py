"""The verdict hand-off: the leader publishes the job's verdict, every member reads and follows it.

The leader sets ``verdict`` (``SharedVerdict``: the decision, trimmed to
``VERDICT_ROWS`` rank rows, and the response every node carries out) and
announces its key in the view; a member reads it once (``read``), and a key
announced but not read (``unread``) says the leader judged and paged while
this node could not read it.  The leader's node serves the store: before its
job ends, the leader waits up to ``HANDOFF_S`` until every answering member's
summary shows it follows (``handed_off``).

Failure mode: every store call raises ``StoreError``; a verdict that does not
validate is logged and not followed (the member judges on its own).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from pydantic import BaseModel, TypeAdapter, ValidationError

from ncclwatch.watchdog.cluster.incident_evidence import IncidentEvidence
from ncclwatch.watchdog.cluster.peers import GATHER_POLL_S, Cluster, parse_model
from ncclwatch.watchdog.cluster.view import NodeSummary
from ncclwatch.watchdog.hang.types import Decision

log = logging.getLogger("ncclwatch")

# How long the leader, before ending its job (its node serves the store, which goes with it), waits for every
# answering member to show it has the verdict: on the H100 a member that had not read it yet judged alone once
# the store was gone and wrote a conflicting bundle.
HANDOFF_S = 5.0
FOLLOWED_PHASES = frozenset(
    {"paged", "ended"}
)  # a member's summary phase once it follows the verdict (or its job ended)
VERDICT_ROWS = 64  # rank rows a shared verdict carries (culprits first); the leader's bundle has them all

_DECISION = TypeAdapter(Decision)


class SharedVerdict(BaseModel):
    key: str
    opened_at: float
    decision: bytes  # Decision as JSON (a dataclass: pydantic's TypeAdapter)
    response: str | None = None  # what every node does about it (``response.policy.Response``); None: report only
    why: str = ""


@dataclass(frozen=True)
class LeaderVerdict:
    """The leader's verdict as a member reads it, with the response every node carries out."""

    key: str
    decision: Decision
    response: str | None = None
    why: str = ""


def trimmed(decision: Decision) -> Decision:
    """A verdict small enough for every node to read: the culprits' rows first, at most VERDICT_ROWS."""
    finding = decision.finding
    if len(finding.rows) <= VERDICT_ROWS:
        return decision
    culprits = set(finding.culprits)
    rows = sorted(finding.rows, key=lambda r: r.rank not in culprits)[:VERDICT_ROWS]
    note = f"{len(finding.rows) - VERDICT_ROWS} more rank rows in the leader's bundle"
    return replace(
        decision,
        finding=replace(finding, rows=tuple(sorted(rows, key=lambda r: r.rank)), missing=finding.missing + (note,)),
    )


class VerdictHandoff:
    """The leader's side (``publish``, ``handed_off``) and a member's (``read``, ``unread``, ``hurry``)."""

    def __init__(self, cluster: Cluster, evidence: IncidentEvidence) -> None:
        self.cluster = cluster
        self.evidence = evidence  # its keys go once the verdict is out
        self._read: set[str] = set()

    async def publish(self, key: str, decision: Decision, response: str | None = None, why: str = "") -> None:
        """The leader's verdict for the open incident, and the response to it, for every member to follow."""
        cluster = self.cluster
        assert cluster.view is not None and cluster.view.incident is not None
        incident = cluster.view.incident
        shared = SharedVerdict(
            key=key,
            opened_at=incident.opened_at,
            decision=_DECISION.dump_json(trimmed(decision)),
            response=response,
            why=why,
        )
        await cluster.client.set(cluster.key("verdict"), shared.model_dump_json().encode())
        self._read.add(key)
        judged = incident.model_copy(update={"verdict": key, "judging": False})
        await cluster.publish_view(cluster.view.model_copy(update={"incident": judged, "seq": cluster.view.seq + 1}))
        await self.evidence.forget_read()

    async def read(self) -> LeaderVerdict | None:
        """The leader's verdict, once per incident key, when the view announces one this node has not read."""
        announced = self.unread()
        if announced is None:
            return None
        raw = await self.cluster.client.peek(self.cluster.key("verdict"))
        shared = parse_model(SharedVerdict, raw) if raw is not None else None
        if shared is None or shared.key != announced:
            return None
        self._read.add(shared.key)
        try:
            return LeaderVerdict(shared.key, _DECISION.validate_json(shared.decision), shared.response, shared.why)
        except ValidationError:
            log.warning("the leader's verdict does not validate; this node judges on its own")
            return None

    def unread(self) -> str | None:
        """The verdict key the view announces and this node has not read: the leader judged and paged it."""
        view = self.cluster.view
        incident = view.incident if view is not None else None
        if incident is None or incident.verdict is None or incident.verdict in self._read:
            return None
        return incident.verdict

    def hurry(self) -> bool:
        """Exchange at HOT_S: the leader while any node probes (it must hear them), a member while the leader
        judges (a request for its full evidence, then the verdict, come within a second) or its verdict is
        unread."""
        cluster = self.cluster
        view = cluster.view
        if view is None:
            return False
        if cluster.leads():
            return view.probing_count > 0 or view.incident is not None
        pending = view.incident is not None and (view.incident.judging or self.unread() is not None)
        return pending and cluster.view_fresh()

    async def handed_off(self, wait_s: float = HANDOFF_S) -> list[int]:
        """The leader, before ending its job: wait up to ``wait_s`` until every answering member's summary shows it
        follows the verdict; the members still not showing it (raises StoreError)."""
        cluster = self.cluster
        deadline = cluster.clock() + wait_s
        while True:
            members = sorted(cluster.answering())
            raws = await cluster.client.multi_get([cluster.key("node", n) for n in members]) if members else []
            summaries = [parse_model(NodeSummary, raw) if raw is not None else None for raw in raws]
            waiting = [n for n, s in zip(members, summaries) if s is None or s.phase not in FOLLOWED_PHASES]
            if not waiting or cluster.clock() >= deadline:
                return waiting
            await asyncio.sleep(GATHER_POLL_S)
