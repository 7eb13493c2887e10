"""The sidecars of one job, across nodes: who they are, who leads, what each one saw.

Every node computes the same facts from what torchrun gave its workers
(``Membership``): the store (``MASTER_ADDR:MASTER_PORT``, the agent store
both static and c10d rendezvous run), the run id and restart count (an
elastic restart is a new round, under a new key prefix), the node's rank and
the node count.  Through that store, with a load that grows with the node
count, not its square (``view`` has the rules):

- every ``PUBLISH_S`` (``HOT_S`` while a stall is probed) each sidecar sets
  ``node/<n>``, its ``NodeSummary``, and reads ``view`` with one request;
  the leader alone reads every summary (one ``MULTI_GET``) and publishes the
  view by compare-and-set: about 2 requests per node per round;
- at a stall every node sets ``compact/<n>``, where each of its ranks is;
  the leader reads them all, judges, asks the nodes that decide the verdict
  for ``full/<n>`` (``IncidentView.want``), judges again with the same
  engine and publishes ``verdict``, which the members read and follow;
- after each performance look each node sets ``perf/<n>``
  (``perf_records``) and the leader reads them to judge the whole job;
- evidence and verdict keys are deleted when the incident closes, a new
  round deletes this node's keys of the previous one: the store keeps a
  few keys per node, whatever the job's length.

A store that cannot be reached is said (``SourceDown``); the sidecar judges
alone and asks the other nodes' lifelines (``lifeline``) whether the store's
node is lost and who pages.  Failure mode: every store call raises
``StoreError``; nothing here is silent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from ncclwatch.watchdog.cluster.lifeline import ask
from ncclwatch.watchdog.cluster.payload import Kind, pack, paused_gc, unpack
from ncclwatch.watchdog.cluster.perf_records import PerfRecord
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.cluster.view import (
    LOST_AFTER_S,
    PUBLISH_S,
    Contact,
    IncidentView,
    JobView,
    NodeSummary,
    compose,
    may_lead,
    pager_order,
)
from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision

log = logging.getLogger("ncclwatch")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

EVIDENCE_WAIT_S = 4.0  # how long the leader waits for every node's compact evidence
FULL_WAIT_S = 2.5  # how long it waits for the full evidence it asked for
FULL_NODES = 8  # nodes asked for full evidence at most: the culprits' and the lost ones' come first
# How long the leader's performance look waits for the other nodes' records of the same round; the look runs
# beside the ticks, so this never delays hang detection.  The others look at the same moment.
PERF_WAIT_S = 3.0
# How long the leader, before ending its job (its node serves the store, which goes with it), waits for every
# answering member to show it has the verdict: on the H100 a member that had not read it yet judged alone once
# the store was gone and wrote a conflicting bundle.
HANDOFF_S = 5.0
FOLLOWED_PHASES = frozenset(
    {"paged", "ended"}
)  # a member's summary phase once it follows the verdict (or its job ended)
VERDICT_ROWS = 64  # rank rows a shared verdict carries (culprits first); the leader's bundle has them all
GATHER_POLL_S = 0.2

_DECISION = TypeAdapter(Decision)


@dataclass(frozen=True)
class Membership:
    store_host: str
    store_port: int
    run_id: str
    restart: int
    node_rank: int
    nnodes: int

    @property
    def prefix(self) -> str:
        return self.prefix_of(self.restart)

    def prefix_of(self, restart: int) -> str:
        return f"ncclwatch/{self.run_id}/{restart}/"

    @property
    def job_key(self) -> str:
        """The same on every node of this round: part of the alert's dedup key."""
        run = self.run_id if self.run_id not in ("", "none") else f"{self.store_host}:{self.store_port}"
        return f"{run}/{self.restart}"

    @classmethod
    def of(cls, state: JobState) -> Membership | None:
        """From the current attempt's workers; None on a single node or without torchrun's variables."""
        for worker in state.current_workers():
            seen = worker.seen
            if seen is None or seen.store is None or seen.node_rank is None or not seen.nnodes or seen.nnodes < 2:
                continue
            host, _, port = seen.store.rpartition(":")
            return cls(host, int(port), seen.run_id or "none", seen.restart_count, seen.node_rank, seen.nnodes)
        return None


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


class Cluster:
    """This sidecar's side of the exchange; one store connection, requests serialised."""

    def __init__(
        self,
        membership: Membership,
        host: str,
        clock: Callable[[], float] = time.time,
        client: StoreClient | None = None,
        serves_store: bool = False,
    ) -> None:
        self.membership = membership
        self.host = host
        self.clock = clock
        self.client = client or StoreClient(membership.store_host, membership.store_port)
        self.serves_store = serves_store
        self.lifeline_port: int | None = None  # once the sidecar's lifeline listens
        self.view: JobView | None = None
        self._view_raw: bytes | None = None
        self._joined_at = clock()
        self._view_changed_at = self._joined_at
        self.summaries: dict[int, NodeSummary] = {}  # the others', as the leader last read them
        self._changed_at: dict[int, float] = {}  # node -> when its summary last changed (this clock)
        self._read_at: float | None = None  # when the leader last read every summary (this clock)
        self._cleaned = False
        self._shared_full_for: float | None = None  # the incident this node sent its full evidence for
        self._verdicts_read: set[str] = set()
        self._evidence_keys: set[str] = set()  # what the leader read during the open incident: deleted at its end
        self._perf_left_out: set[int] = set()

    @property
    def me(self) -> int:
        return self.membership.node_rank

    def key(self, what: str, node: int | None = None) -> str:
        return f"{self.membership.prefix}{what}" + (f"/{node}" if node is not None else "")

    # -- every round -------------------------------------------------------

    async def exchange(self, summary: NodeSummary) -> None:
        """Publish this node's summary and read the view; the leader also reads every summary and publishes
        the next view (raises StoreError)."""
        summary = await self.publish_summary(summary)
        if not self._cleaned:
            await self._forget_previous_round()
        self._note_view(await self.client.peek(self.key("view")))
        if may_lead(self.view, self.me, self.membership.nnodes, self.clock() - self._view_changed_at):
            await self._lead(summary)

    async def publish_summary(self, summary: NodeSummary) -> NodeSummary:
        """Set this node's summary, with its lifeline, and return it as set; alone (without the view), a member
        says at once that it follows the verdict (``handed_off``), before its bundle takes seconds."""
        address = self.client.local_address()  # the address facing the store: the others reach this node there
        lifeline = f"{address}:{self.lifeline_port}" if address and self.lifeline_port else None
        summary = summary.model_copy(update={"lifeline": lifeline, "serves_store": self.serves_store})
        await self.client.set(self.key("node", self.me), summary.model_dump_json().encode())
        return summary

    def _note_view(self, raw: bytes | None) -> None:
        if raw == self._view_raw:
            return
        try:
            view = JobView.model_validate_json(raw) if raw is not None else None
        except ValidationError:
            log.warning("the job view in the store does not validate; ignored")
            return
        if self.view is not None and view is not None and view.leader != self.view.leader:
            log.info("node %d leads the sidecars now (was node %d)", view.leader, self.view.leader)
        self.view, self._view_raw, self._view_changed_at = view, raw, self.clock()

    async def _lead(self, own: NodeSummary) -> None:
        others = [n for n in range(self.membership.nnodes) if n != self.me]
        now = self.clock()
        if self.view is not None and self.view.leader != self.me:
            # Taking over: the old leader fell silent when its view stopped changing, not at this first read.
            self._changed_at.setdefault(self.view.leader, self._view_changed_at)
        self._read_at = now
        for node, raw in zip(others, await self.client.multi_get([self.key("node", n) for n in others])):
            summary = _parse(NodeSummary, raw) if raw is not None else None
            if summary is None:
                continue
            previous = self.summaries.get(node)
            if previous is None and node in self._changed_at:
                pass  # seeded at the takeover; a changed summary from now on says it is alive
            elif previous is None or previous.at != summary.at:
                self._changed_at[node] = now
            self.summaries[node] = summary
        fresh = {n for n, at in self._changed_at.items() if now - at <= LOST_AFTER_S}
        previous = self.view if self.view is not None and self.view.leader == self.me else None
        view = compose(previous, self.me, self.membership.nnodes, self.summaries, fresh, own, now - self._joined_at)
        if previous is None:  # taking over (or the first view): a new term
            view = view.model_copy(
                update={
                    "term": self.view.term + 1 if self.view else 0,
                    "seq": self.view.seq + 1 if self.view else 0,
                    "incident": self.view.incident if self.view else None,
                }
            )
        await self._publish(view)

    async def _publish(self, view: JobView) -> bool:
        """Compare-and-set against the view last read: False (and that view noted) when another node's won."""
        raw = view.model_dump_json().encode()
        current = await self.client.compare_set(self.key("view"), self._view_raw or b"", raw)
        self._note_view(current)
        return current == raw

    async def _forget_previous_round(self) -> None:
        """An elastic restart is a new round: this node's keys of the round before go (and the view, by its
        node 0)."""
        restart = self.membership.restart
        if restart > 0:
            old = self.membership.prefix_of(restart - 1)
            names = [f"{what}/{self.me}" for what in ("node", "compact", "full", "perf")]
            names += ["view", "verdict"] if self.me == 0 else []
            await self._delete({old + name for name in names})
        self._cleaned = True  # only once every delete went through: a failed one is tried again next round

    # -- what every node asks of the view ----------------------------------

    def leader(self) -> int:
        return self.view.leader if self.view is not None else 0

    def leads(self) -> bool:
        return self.view is not None and self.view.leader == self.me

    def peer_suspects(self) -> bool:
        """Another node probes a stall, or the leader opened an incident: this node looks too."""
        view = self.view
        if view is None or self.clock() - self._view_changed_at > LOST_AFTER_S:
            return False
        return view.incident is not None or any(n != self.me for n in view.probing)

    def hurry(self) -> bool:
        """Exchange at HOT_S: the leader while any node probes (it must hear them), a member while the leader
        judges (a request for its full evidence, then the verdict, come within a second)."""
        view = self.view
        if view is None:
            return False
        if self.leads():
            return view.probing_count > 0 or view.incident is not None
        pending = view.incident is not None and (view.incident.judging or self.unread_verdict() is not None)
        return pending and self.clock() - self._view_changed_at <= LOST_AFTER_S

    def lost(self) -> dict[int, Contact]:
        """Nodes whose sidecar stopped publishing (``at`` None: never published this round).

        The leader's view was composed at its last read of the summaries; a node silent since is lost now, by the
        clock ``answering`` reads, so that every node is one or the other (CI, a frozen node: the leader judged
        between the two, waited for nobody, named nobody lost, and paged ``stuck_in_collective`` without a
        culprit)."""
        lost = {c.node: c for c in self.view.lost} if self.view is not None else {}
        if self.leads():
            for node in sorted(set(self._changed_at) - self.answering()):
                summary = self.summaries.get(node)
                if summary is not None and summary.phase != "ended":
                    lost.setdefault(node, summary.contact())
        return lost

    def answering(self) -> set[int]:
        """The other nodes whose sidecars publish and whose jobs run: their evidence is worth waiting for."""
        now = self._silence_clock()
        return {
            n for n, at in self._changed_at.items() if now - at <= LOST_AFTER_S and self.summaries[n].phase != "ended"
        }

    def _silence_clock(self) -> float:
        """Now, for how long a node has been silent: at most one round past the leader's last read of the
        summaries.  A leader whose own exchange fell behind (a loaded machine) has not read what the others
        published since, and would take them all for silent."""
        now = self.clock()
        return min(now, self._read_at + PUBLISH_S) if self._read_at is not None else now

    def ended(self) -> set[int]:
        """The other nodes whose jobs ended here (their workers gone): one that failed left its last evidence."""
        return {n for n, summary in self.summaries.items() if n != self.me and summary.phase == "ended"}

    def job_started_at(self, own: float) -> float:
        """When the job's first sidecar started: the same on every node, so a page keyed on it deduplicates
        whichever node sends it."""
        started = self.view.started_at if self.view is not None else None
        return min(own, started) if started is not None else own

    # -- at a stall ---------------------------------------------------------

    async def share(self, kind: Kind, events: list[Event], stall_at: float) -> None:
        """This node's evidence; full evidence reaches back to where the leader says the slowest rank stands."""
        incident = self.view.incident if self.view is not None else None
        since = incident.since if kind == "full" and incident is not None else {}
        await self.client.set(self.key(kind, self.me), pack(self.me, kind, stall_at, events, since))

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

        found = await self._gather(kind, wanted, since, wait_s, parse, found_one)
        self._evidence_keys |= {self.key(kind, n) for n in found}
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
        assert self.view is not None
        incident = self.view.incident
        if incident is None or incident.opened_at != opened_at:
            incident = IncidentView(opened_at=opened_at, started_at=started_at)
        asked = {"want": want, "since": since or {}} if want is not None else {}
        incident = incident.model_copy(update={"judging": judging, **asked})
        if incident != self.view.incident:
            await self._publish(self.view.model_copy(update={"incident": incident, "seq": self.view.seq + 1}))

    def full_wanted(self, looked_at: float | None) -> float | None:
        """The incident (its opening) whose full evidence the leader asks of this node and has not had yet, where
        this node's latest look (at ``looked_at``; None: none yet) is of the incident's silence: an older look's
        evidence would be passed over by the leader, and this node's next look must still be sent."""
        incident = self.view.incident if self.view is not None else None
        if incident is None or self.me not in incident.want or self._shared_full_for == incident.opened_at:
            return None
        if looked_at is None or (incident.started_at is not None and looked_at < incident.started_at):
            return None
        return incident.opened_at

    def full_shared(self, opened_at: float) -> None:
        self._shared_full_for = opened_at

    async def publish_verdict(self, key: str, decision: Decision, response: str | None = None, why: str = "") -> None:
        """The leader's verdict for the open incident, and the response to it, for every member to follow."""
        assert self.view is not None and self.view.incident is not None
        incident = self.view.incident
        shared = SharedVerdict(
            key=key,
            opened_at=incident.opened_at,
            decision=_DECISION.dump_json(trimmed(decision)),
            response=response,
            why=why,
        )
        await self.client.set(self.key("verdict"), shared.model_dump_json().encode())
        self._verdicts_read.add(key)
        judged = incident.model_copy(update={"verdict": key, "judging": False})
        await self._publish(self.view.model_copy(update={"incident": judged, "seq": self.view.seq + 1}))
        await self._delete(self._evidence_keys)  # judged (and announced): the members need the verdict only
        self._evidence_keys = set()

    async def read_verdict(self) -> LeaderVerdict | None:
        """The leader's verdict, once per incident key, when the view announces one this node has not read."""
        announced = self.unread_verdict()
        if announced is None:
            return None
        raw = await self.client.peek(self.key("verdict"))
        shared = _parse(SharedVerdict, raw) if raw is not None else None
        if shared is None or shared.key != announced:
            return None
        self._verdicts_read.add(shared.key)
        try:
            return LeaderVerdict(shared.key, _DECISION.validate_json(shared.decision), shared.response, shared.why)
        except ValidationError:
            log.warning("the leader's verdict does not validate; this node judges on its own")
            return None

    def unread_verdict(self) -> str | None:
        """The verdict key the view announces and this node has not read: the leader judged and paged it."""
        incident = self.view.incident if self.view is not None else None
        if incident is None or incident.verdict is None or incident.verdict in self._verdicts_read:
            return None
        return incident.verdict

    async def handed_off(self, wait_s: float = HANDOFF_S) -> list[int]:
        """The leader, before ending its job: wait up to ``wait_s`` until every answering member's summary shows it
        follows the verdict; the members still not showing it (raises StoreError)."""
        deadline = self.clock() + wait_s
        while True:
            members = sorted(self.answering())
            raws = await self.client.multi_get([self.key("node", n) for n in members]) if members else []
            summaries = [_parse(NodeSummary, raw) if raw is not None else None for raw in raws]
            waiting = [n for n, s in zip(members, summaries) if s is None or s.phase not in FOLLOWED_PHASES]
            if not waiting or self.clock() >= deadline:
                return waiting
            await asyncio.sleep(GATHER_POLL_S)

    async def drop_own_evidence(self) -> None:
        """A member that followed the verdict: its evidence keys are no longer needed."""
        await self._delete({self.key(kind, self.me) for kind in ("compact", "full")})

    async def close_incident(self) -> None:
        """The leader's incident is over (progress, or back to watching): its keys and the verdict go."""
        await self._delete(self._evidence_keys | {self.key("verdict")})
        self._evidence_keys = set()
        if self.view is not None and self.view.incident is not None and self.leads():
            await self._publish(self.view.model_copy(update={"incident": None, "seq": self.view.seq + 1}))

    async def _delete(self, keys: set[str]) -> None:
        await self.client.delete_many(sorted(keys))

    # -- without the store --------------------------------------------------

    async def store_node_lost(self) -> Contact | None:
        """The node serving the store, when the store is gone and that node's lifeline does not answer."""
        store = self.view.store if self.view is not None else None
        if store is None or store.node == self.me or store.lifeline is None:
            return None
        return store if await ask(store.lifeline) is None else None

    async def pages_alone(self, lost: set[int]) -> bool:
        """Without the store: does this node page?  The first node of ``pager_order`` that answers does; if
        none of them answers (all lost at once), every survivor does, under one dedup key."""
        for contact in pager_order(self.view, self.me, lost):
            if contact.node == self.me:
                return True
            if contact.lifeline is not None and await ask(contact.lifeline) is not None:
                return False
        return True

    # -- performance looks --------------------------------------------------

    async def exchange_perf(self, record: PerfRecord, interval: float) -> dict[int, PerfRecord] | None:
        """Publish this node's performance record; the other nodes' when this node leads, else None."""
        await self.client.set(self.key("perf", self.me), record.model_dump_json().encode())
        return await self.gather_perf(record.at, interval) if self.leads() else None

    async def gather_perf(self, look_at: float, interval: float) -> dict[int, PerfRecord]:
        """The other nodes' performance records for the leader's look at ``look_at``.

        Looks are aligned to the same wall-clock grid on every node (``PerfWatch``), so each answering node's
        record of this round (newer than half an interval ago) is waited for, up to PERF_WAIT_S; a node that
        did not publish this round gives its latest if it is at most two intervals old.  Older or none: left
        out, said once.
        """

        def parse(node: int, raw: bytes) -> tuple[float, PerfRecord] | None:
            record = _parse(PerfRecord, raw)
            if record is None:
                log.warning("node %s published a performance record that does not validate; ignored", node)
            return (record.at, record) if record is not None else None

        found = await self._gather("perf", self.answering(), look_at - interval / 2, PERF_WAIT_S, parse)
        others = {n for n in range(self.membership.nnodes) if n != self.me}
        found |= await self._gather("perf", others - set(found), look_at - 2 * interval, 0.0, parse)
        left_out = others - set(found)
        if newly := sorted(left_out - self._perf_left_out):
            log.warning(
                "performance look: node(s) %s published no record in two intervals: the job-wide view "
                "leaves their ranks out",
                ", ".join(map(str, newly)),
            )
        self._perf_left_out = left_out
        return found

    async def _gather(
        self,
        what: str,
        wanted: set[int],
        since: float,
        wait_s: float,
        parse: Callable[[int, bytes], tuple[float, T] | None],
        found_one: Callable[[int, T], None] = lambda node, value: None,
    ) -> dict[int, T]:
        """``what`` of each wanted node, versioned at or after ``since``: one MULTI_GET a poll, up to ``wait_s``;
        ``found_one`` sees each as it is found."""
        deadline = self.clock() + wait_s
        found: dict[int, T] = {}
        while True:
            pending = sorted(wanted - set(found))
            values = await self.client.multi_get([self.key(what, n) for n in pending])
            with paused_gc():  # one poll's values decoded at once, between two awaits
                for node, raw in zip(pending, values):
                    parsed = parse(node, raw) if raw is not None else None
                    if parsed is not None and parsed[0] >= since:
                        found[node] = parsed[1]
                        found_one(node, parsed[1])
            if set(found) >= wanted or self.clock() >= deadline:
                return found
            await asyncio.sleep(GATHER_POLL_S)


def _parse(model: type[M], raw: bytes) -> M | None:
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        return None


async def exchange_or_degrade(cluster: Cluster, summary: NodeSummary) -> str | None:
    """One exchange; the reason it failed, or None."""
    try:
        await cluster.exchange(summary)
    except StoreError as exc:
        return str(exc)
    return None
