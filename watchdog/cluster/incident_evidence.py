"""Incident evidence across nodes: what each node saw at a stall, and what the leader asks of the deciding nodes.

At a stall every node sets ``compact/<n>``, where each of its ranks is; the
leader reads them all (``gather``), opens its incident in the view
(``open_incident``: the others look now), asks the nodes that decide the
verdict for ``full/<n>`` (``IncidentView.want``, reaching back to where the
slowest rank stands), and the members send it once (``full_wanted``,
``full_shared``).  The keys the leader read go once the verdict is published
(``forget_read``) or the incident closes (``close_incident``), with the
verdict: the store keeps a few keys per node, whatever the job's length.

Failure mode: every store call raises ``StoreError``.
"""

from __future__ import annotations

from collections.abc import Callable

from ncclwatch.watchdog.cluster.payload import Kind, pack, unpack
from ncclwatch.watchdog.cluster.peers import Cluster
from ncclwatch.watchdog.cluster.view import IncidentView
from ncclwatch.watchdog.events import Event

EVIDENCE_WAIT_S = 4.0  # how long the leader waits for every node's compact evidence
FULL_WAIT_S = 2.5  # how long it waits for the full evidence it asked for
FULL_NODES = 8  # nodes asked for full evidence at most: the culprits' and the lost ones' come first


class IncidentEvidence:
    """This node's evidence in the store, and the leader's reading of the others'."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._shared_full_for: float | None = None  # the incident this node sent its full evidence for
        self._read_keys: set[str] = set()  # what the leader read during the open incident: deleted at its end

    async def share(self, kind: Kind, events: list[Event], stall_at: float) -> None:
        """This node's evidence; full evidence reaches back to where the leader says the slowest rank stands."""
        cluster = self.cluster
        incident = cluster.view.incident if cluster.view is not None else None
        since = incident.since if kind == "full" and incident is not None else {}
        await cluster.client.set(cluster.key(kind, cluster.me), pack(cluster.me, kind, stall_at, events, since))

    async def gather(
        self,
        kind: Kind,
        wanted: set[int],
        since: float,
        wait_s: float,
        fold: Callable[[int, list[Event]], None] | None = None,
    ) -> dict[int, list[Event]]:
        """``kind`` evidence of each wanted node from a probe at or after ``since``; waits up to ``wait_s``.  Each
        node's events go to ``fold`` as they come (``judge.JobEvidence.add``), while the others are waited for."""

        def parse(node: int, raw: bytes) -> tuple[float, list[Event]] | None:
            payload = unpack(raw, f"node {node} (via the store)")
            return (payload.stall_at, payload.events) if payload is not None else None

        def found_one(node: int, events: list[Event]) -> None:
            if fold is not None:
                fold(node, events)

        found = await self.cluster.gather_keys(kind, wanted, since, wait_s, parse, found_one)
        self._read_keys |= {self.cluster.key(kind, n) for n in found}
        return found

    async def open_incident(
        self,
        opened_at: float,
        want: list[int] | None = None,
        judging: bool = True,
        since: dict[str, int] | None = None,
        started_at: float | None = None,
    ) -> None:
        """The leader's incident, in the view: the others look now; ``want`` asks for full evidence, reaching back
        to ``since`` (``IncidentView.since``), of the silence that began at ``started_at``; not ``judging`` while
        the stall is held (a pause), so the members go back to their usual pace."""
        view = self.cluster.view
        assert view is not None
        incident = view.incident
        if incident is None or incident.opened_at != opened_at:
            incident = IncidentView(opened_at=opened_at, started_at=started_at)
        asked = {"want": want, "since": since or {}} if want is not None else {}
        incident = incident.model_copy(update={"judging": judging, **asked})
        if incident != view.incident:
            await self.cluster.publish_view(view.model_copy(update={"incident": incident, "seq": view.seq + 1}))

    def full_wanted(self, looked_at: float | None) -> float | None:
        """The incident (its opening) whose full evidence the leader asks of this node and has not had yet, where
        this node's latest look (at ``looked_at``; None: none yet) is of the incident's silence: an older look's
        evidence would be passed over by the leader, and this node's next look must still be sent."""
        view, me = self.cluster.view, self.cluster.me
        incident = view.incident if view is not None else None
        if incident is None or me not in incident.want or self._shared_full_for == incident.opened_at:
            return None
        if looked_at is None or (incident.started_at is not None and looked_at < incident.started_at):
            return None
        return incident.opened_at

    def full_shared(self, opened_at: float) -> None:
        self._shared_full_for = opened_at

    async def drop_own(self) -> None:
        """A member that followed the verdict (or whose ranks moved on): its evidence keys are no longer needed."""
        cluster = self.cluster
        await cluster.delete({cluster.key(kind, cluster.me) for kind in ("compact", "full")})

    async def forget_read(self) -> None:
        """Judged (and announced): the members need the verdict only."""
        await self.cluster.delete(self._read_keys)
        self._read_keys = set()

    async def close_incident(self) -> None:
        """The leader's incident is over (progress, or back to watching): its keys and the verdict go."""
        cluster = self.cluster
        await cluster.delete(self._read_keys | {cluster.key("verdict")})
        self._read_keys = set()
        view = cluster.view
        if view is not None and view.incident is not None and cluster.leads():
            await cluster.publish_view(view.model_copy(update={"incident": None, "seq": view.seq + 1}))
