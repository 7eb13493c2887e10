"""The sidecars of one job, across nodes: who they are, who leads, the view they share.

Every node computes the same facts from what torchrun gave its workers
(``Membership``): the store (``MASTER_ADDR:MASTER_PORT``, the agent store
both static and c10d rendezvous run), the run id and restart count (an
elastic restart is a new round, under a new key prefix), the node's rank and
the node count.  Through that store, with a load that grows with the node
count, not its square (``view`` has the rules), every ``PUBLISH_S``
(``HOT_S`` while a stall is probed) each sidecar sets ``node/<n>``, its
``NodeSummary``, and reads ``view`` with one request; the leader alone reads
every summary (one ``MULTI_GET``) and publishes the view by compare-and-set:
about 2 requests per node per round.  A new round deletes this node's keys of
the previous one.

``Cluster`` is that exchange (the view, who leads, who answers); the roles at a
stall speak through it, each in its module:

- ``incident_evidence``: every node sets ``compact/<n>`` at a stall; the
  leader reads them all, asks the nodes that decide for ``full/<n>``
  (``IncidentView.want``); the keys go when the incident closes;
- ``handoff``: the leader publishes ``verdict``, the members read and follow
  it, and the leader waits for them before its job (and the store) ends;
- ``lost``: which nodes are lost, and without the store who pages;
- ``perf_sharing``: ``perf/<n>`` after each performance look, read by the
  leader.

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
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ncclwatch.watchdog.cluster.payload import paused_gc
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.cluster.view import (
    LOST_AFTER_S,
    PUBLISH_S,
    JobView,
    NodeSummary,
    compose,
    may_lead,
)
from ncclwatch.watchdog.hang.state import JobState

log = logging.getLogger("ncclwatch")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

GATHER_POLL_S = 0.2


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


class Cluster:
    """This sidecar's side of the view exchange; one store connection, requests serialised.  The roles at a stall
    (``incident_evidence``, ``handoff``, ``lost``, ``perf_sharing``) speak through it."""

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
        self.changed_at: dict[int, float] = {}  # node -> when its summary last changed (this clock)
        self._read_at: float | None = None  # when the leader last read every summary (this clock)
        self._cleaned = False

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
            self.changed_at.setdefault(self.view.leader, self._view_changed_at)
        self._read_at = now
        for node, raw in zip(others, await self.client.multi_get([self.key("node", n) for n in others])):
            summary = parse_model(NodeSummary, raw) if raw is not None else None
            if summary is None:
                continue
            previous = self.summaries.get(node)
            if previous is None and node in self.changed_at:
                pass  # seeded at the takeover; a changed summary from now on says it is alive
            elif previous is None or previous.at != summary.at:
                self.changed_at[node] = now
            self.summaries[node] = summary
        fresh = {n for n, at in self.changed_at.items() if now - at <= LOST_AFTER_S}
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
        await self.publish_view(view)

    async def publish_view(self, view: JobView) -> bool:
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
            await self.delete({old + name for name in names})
        self._cleaned = True  # only once every delete went through: a failed one is tried again next round

    # -- what every node asks of the view ----------------------------------

    def leader(self) -> int:
        return self.view.leader if self.view is not None else 0

    def leads(self) -> bool:
        return self.view is not None and self.view.leader == self.me

    def view_fresh(self) -> bool:
        """The view changed within LOST_AFTER_S: its leader still publishes it."""
        return self.clock() - self._view_changed_at <= LOST_AFTER_S

    def peer_suspects(self) -> bool:
        """Another node probes a stall, or the leader opened an incident: this node looks too."""
        view = self.view
        if view is None or not self.view_fresh():
            return False
        return view.incident is not None or any(n != self.me for n in view.probing)

    def answering(self) -> set[int]:
        """The other nodes whose sidecars publish and whose jobs run: their evidence is worth waiting for."""
        now = self._silence_clock()
        return {
            n for n, at in self.changed_at.items() if now - at <= LOST_AFTER_S and self.summaries[n].phase != "ended"
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

    async def delete(self, keys: set[str]) -> None:
        await self.client.delete_many(sorted(keys))

    async def gather_keys(
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


def parse_model(model: type[M], raw: bytes) -> M | None:
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
