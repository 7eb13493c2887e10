"""The job view: the one small record every node reads, and the rules every node computes alike.

Each node sets its own summary (``node/<n>``); only the leader reads them
all, and it publishes ``view``: who leads, which nodes are lost or probing a
stall, which node serves the store, the lowest fresh nodes with their
lifelines (``candidates``), and the open incident (the nodes asked for full
evidence, the verdict once judged).  A member reads the view alone: one
request a round whatever the job's size.  The view's size is bounded
(``LISTED``): a thousand lost nodes are counted, not listed.

Freshness never compares two hosts' clocks: a reader notes on its own
clock when a record last *changed* (``seq`` for the view, ``at`` for a
summary).  Leadership is sticky and moves only by a compare-and-set of the
exact view last read, so two nodes never both take over: when the view
stops changing for ``LOST_AFTER_S``, the lowest fresh node of that view
after the leader may take it over; after twice that, the next; and so on
(``may_lead``).  Pure.
"""

from __future__ import annotations

from pydantic import BaseModel

PUBLISH_S = 2.5
HOT_S = 0.5  # the exchange's period while the leader judges a stall (the leader's: while any node probes)
LOST_AFTER_S = 7.5  # three missed summaries: that node's sidecar is gone (or its whole node is frozen)
LISTED = 32  # lost or probing nodes named in the view; more are counted
CANDIDATES = 8  # the lowest fresh nodes whose lifelines the view carries: who pages when the store is gone
PROBING_PHASES = ("suspect", "confirming", "paged")


class Contact(BaseModel):
    node: int
    host: str
    ranks: list[int] = []
    lifeline: str | None = None  # host:port of its sidecar's lifeline
    at: float | None = None  # its latest summary (its own clock); None: never published


class NodeSummary(BaseModel):
    node: int
    host: str
    at: float  # when it was published (the publisher's clock): a new value means the sidecar is alive
    ranks: list[int]
    last_progress: float
    phase: str  # the incident's phase, or "ended" once this node's workers are gone
    world_size: int | None = None
    started_at: float | None = None  # when its sidecar started (the job's start is the earliest)
    lifeline: str | None = None
    serves_store: bool = False  # this node's torchrun runs the job's store

    def contact(self) -> Contact:
        return Contact(node=self.node, host=self.host, ranks=self.ranks, lifeline=self.lifeline, at=self.at)


class IncidentView(BaseModel):
    opened_at: float  # the leader's clock: names the incident
    # The silence it judges began then (the leader's clock): evidence from an earlier silence is not this one's.
    started_at: float | None = None
    judging: bool = True  # the leader is gathering and judging now (False while a pause is held): members hurry
    want: list[int] = []  # nodes asked for their full evidence
    # NCCL communicator -> the fewest collectives any rank issued on it (compact evidence): full evidence's
    # tails reach back to it, for a rank whose host ran far ahead of the divergence (``payload.shareable``).
    since: dict[str, int] = {}
    verdict: str | None = None  # the incident key, once the leader judged and paged (``verdict`` holds it)


class JobView(BaseModel):
    leader: int
    term: int  # bumped by every takeover
    seq: int  # bumped by every publication: a view that stops changing has lost its leader
    nnodes: int
    joined: int = 0  # nodes that published this round
    started_at: float | None = None  # the earliest sidecar start: the same on every node
    lost: list[Contact] = []
    lost_count: int = 0
    ended: int = 0  # nodes whose workers are gone (not lost: their job ended)
    probing: list[int] = []
    probing_count: int = 0
    store: Contact | None = None  # the node serving the store
    candidates: list[Contact] = []
    incident: IncidentView | None = None

    def lost_nodes(self) -> set[int]:
        return {c.node for c in self.lost}


def may_lead(view: JobView | None, me: int, nnodes: int, stale_s: float) -> bool:
    """May this node take the lead, the view (or its absence) unchanged for ``stale_s`` on its clock?

    Without a view, node k may create it after k x LOST_AFTER_S; with a stale one, the k-th fresh node
    after its leader after k x LOST_AFTER_S.  Several may try at once: the compare-and-set picks one."""
    turn = int(stale_s // LOST_AFTER_S)
    if view is None:
        return me <= turn
    if view.leader == me:
        return True
    if turn < 1:
        return False
    lost = view.lost_nodes()
    order = [n for n in range(nnodes) if n != view.leader and n not in lost]
    return me in order and order.index(me) < turn


def pager_order(view: JobView | None, me: int, lost: set[int]) -> list[Contact]:
    """Who pages when the store is gone: the store's node, then the candidates, lowest first, without the
    nodes found lost; the first of these whose lifeline answers pages (this node counts as answering)."""
    if view is None:
        return []
    seen: dict[int, Contact] = {}
    for contact in ([view.store] if view.store else []) + view.candidates:
        if contact.node not in lost and contact.node not in seen:
            seen[contact.node] = contact
    return sorted(seen.values(), key=lambda c: c.node)


def compose(
    previous: JobView | None,
    me: int,
    nnodes: int,
    summaries: dict[int, NodeSummary],
    fresh: set[int],
    own: NodeSummary,
    since_start_s: float,
) -> JobView:
    """The leader's next view from the summaries it read (``fresh``: those that changed lately)."""
    everyone = {**summaries, me: own}
    alive = fresh | {me}
    ended = {n for n, s in everyone.items() if s.phase == "ended"}
    silent = set(range(nnodes)) - alive - ended
    if since_start_s <= LOST_AFTER_S:  # a node that never published is lost only once the others had time to join
        silent -= set(range(nnodes)) - set(everyone)
    lost = [everyone[n].contact() if n in everyone else Contact(node=n, host="?") for n in sorted(silent)]
    probing = sorted(n for n in alive if n in everyone and everyone[n].phase in PROBING_PHASES)
    store = next((s.contact() for n, s in sorted(everyone.items()) if s.serves_store), None)
    candidates = [everyone[n].contact() for n in sorted(alive - ended) if n in everyone][:CANDIDATES]
    starts = [s.started_at for s in everyone.values() if s.started_at is not None]
    return JobView(
        leader=me,
        term=previous.term if previous else 0,
        seq=previous.seq + 1 if previous else 0,
        nnodes=nnodes,
        joined=len(everyone),
        started_at=min(starts) if starts else None,
        lost=lost[:LISTED],
        lost_count=len(lost),
        ended=len(ended),
        probing=probing[:LISTED],
        probing_count=len(probing),
        store=store,
        candidates=candidates,
        incident=previous.incident if previous else None,
    )
