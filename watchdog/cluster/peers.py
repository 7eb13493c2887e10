"""The sidecars of one job, across nodes: who they are, who leads, what each one saw.

Every node computes the same facts from what torchrun gave its workers
(``Membership``): the store (``MASTER_ADDR:MASTER_PORT``, the agent store
both static and c10d rendezvous run), the run id and restart count (an
elastic restart is a new round, under a new key prefix), the node's rank and
the node count.  Through that store:

- every ``PUBLISH_S`` each sidecar sets ``node/<n>``, a compact
  ``NodeSummary`` (its ranks, when they last moved, its incident phase), and
  reads the others': a few hundred bytes per node, so steady state stays
  under 10 KB/s per sidecar at 64 nodes (bench/cluster.py measures it);
- the leader is the lowest node rank whose summary is fresh: a rule every
  node computes alike, so losing the leader makes the next node lead;
- when a stall is probed, each sidecar sets ``evidence/<n>``: the probe's
  inputs in the journal format (workers, /proc samples, stacks, GPU sample,
  Flight Recorder dumps trimmed to their last entries, the newest collectives
  of each rank's NCCL log with their absolute positions), and every sidecar
  gathers the others' to judge the whole job with the same engine.

A store that cannot be reached is said (``SourceDown``) and the sidecar
judges alone ("degraded"); it never stays silent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.engine.state import JobState
from ncclwatch.watchdog.events import Event, FrDump, FrEntry, StackDump
from ncclwatch.watchdog.parsing.journal import HEADER, JOURNALED, journal_line, parse_journal

log = logging.getLogger("ncclwatch")

PUBLISH_S = 2.5
LOST_AFTER_S = 7.5  # three missed summaries: that node's sidecar is gone (or its whole node is frozen)
EVIDENCE_WAIT_S = 4.0  # how long a probe waits for the other nodes' evidence
FR_ENTRIES_SHARED = 32  # per process group: enough to align the pending collective across nodes
FR_FRAMES_SHARED = 4  # entries (the newest) that keep their recorded stack
STACK_FRAMES_SHARED = 24
TAIL_SHARED = 64  # newest collectives per rank and NCCL communicator: the divergence is near the end


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
        return f"ncclwatch/{self.run_id}/{self.restart}/"

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


class NodeSummary(BaseModel):
    node: int
    host: str
    at: float  # when it was published (the publisher's clock)
    ranks: list[int]
    last_progress: float
    phase: str
    world_size: int | None = None


def fresh(summary: NodeSummary, now: float) -> bool:
    return now - summary.at <= LOST_AFTER_S


def leader_of(summaries: dict[int, NodeSummary], me: int, now: float) -> int:
    """The lowest node rank with a fresh summary (this node counts as fresh)."""
    return min([me] + [n for n, s in summaries.items() if fresh(s, now)])


def shareable(events: Iterable[Event]) -> list[Event]:
    """What travels, trimmed: the newest Flight Recorder entries per group, the innermost stack frames.

    Only the journal's kinds travel (a probe's notes about what it could not read stay on its node).
    """
    out: list[Event] = []
    for event in events:
        if type(event).__name__ not in JOURNALED:
            continue
        if isinstance(event, FrDump):
            out.append(event.model_copy(update={"entries": _newest_entries(event.entries)}))
        elif isinstance(event, StackDump):
            threads = [t.model_copy(update={"frames": t.frames[:STACK_FRAMES_SHARED]}) for t in event.threads]
            out.append(event.model_copy(update={"threads": threads}))
        else:
            out.append(event)
    return out


def _newest_entries(entries: list[FrEntry]) -> list[FrEntry]:
    by_pg: dict[str, list[FrEntry]] = {}
    for entry in entries:
        by_pg.setdefault(entry.pg_id, []).append(entry)
    kept: list[FrEntry] = []
    for group in by_pg.values():
        newest = group[-FR_ENTRIES_SHARED:]
        cut = len(newest) - FR_FRAMES_SHARED
        kept += [e if i >= cut else e.model_copy(update={"frames": []}) for i, e in enumerate(newest)]
    return sorted(kept, key=lambda e: e.index)


def encode(events: Iterable[Event]) -> bytes:
    return (HEADER.decode() + "\n" + "\n".join(journal_line(e) for e in events)).encode()


class Cluster:
    """This sidecar's side of the exchange; one store connection, requests serialised."""

    def __init__(self, membership: Membership, host: str, clock: Callable[[], float] = time.time,
                 client: StoreClient | None = None) -> None:  # fmt: skip
        self.membership = membership
        self.host = host
        self.clock = clock
        self.client = client or StoreClient(membership.store_host, membership.store_port)
        self.summaries: dict[int, NodeSummary] = {}  # the other nodes', as last read

    @property
    def me(self) -> int:
        return self.membership.node_rank

    def key(self, what: str, node: int) -> str:
        return f"{self.membership.prefix}{what}/{node}"

    async def exchange(self, summary: NodeSummary) -> None:
        """Publish this node's summary and read every other node's (raises StoreError)."""
        await self.client.set(self.key("node", self.me), summary.model_dump_json().encode())
        for node in range(self.membership.nnodes):
            if node == self.me:
                continue
            raw = await self.client.get(self.key("node", node))
            if raw is None:
                continue
            try:
                self.summaries[node] = NodeSummary.model_validate_json(raw)
            except ValidationError:
                log.warning("node %s published a summary that does not validate; ignored", node)

    def leader(self) -> int:
        return leader_of(self.summaries, self.me, self.clock())

    def peer_suspects(self) -> bool:
        """Some other node's sidecar is probing a stall (its latest fresh summary says so)."""
        now = self.clock()
        return any(s.phase in ("suspect", "confirming", "paged") and fresh(s, now) for s in self.summaries.values())

    def lost(self) -> dict[int, NodeSummary | None]:
        """Nodes whose sidecar has not published for LOST_AFTER_S (None: never published this round)."""
        now = self.clock()
        return {
            node: self.summaries.get(node)
            for node in range(self.membership.nnodes)
            if node != self.me and (node not in self.summaries or not fresh(self.summaries[node], now))
        }

    async def share_evidence(self, events: list[Event], stall_at: float) -> None:
        payload = encode(shareable(events))
        await self.client.set(self.key("evidence", self.me), payload)
        await self.client.set(self.key("evidence-at", self.me), repr(stall_at).encode())

    def answering(self) -> set[int]:
        """The other nodes whose sidecars publish: their evidence is worth waiting for."""
        return {n for n in range(self.membership.nnodes) if n != self.me and n not in self.lost()}

    async def gather_evidence(self, since: float) -> dict[int, list[Event]]:
        """Every answering node's evidence taken at or after ``since``; waits up to EVIDENCE_WAIT_S for it."""
        deadline = self.clock() + EVIDENCE_WAIT_S
        wanted = self.answering()
        found: dict[int, list[Event]] = {}
        while True:
            for node in sorted(wanted - set(found)):
                at = await self.client.get(self.key("evidence-at", node))
                if at is None or float(at) < since:
                    continue
                raw = await self.client.get(self.key("evidence", node))
                if raw is not None:
                    found[node] = parse_journal(raw, f"node {node} (via the store)")
            if set(found) >= wanted or self.clock() >= deadline:
                return found
            await asyncio.sleep(0.2)


async def exchange_or_degrade(cluster: Cluster, summary: NodeSummary) -> str | None:
    """One exchange; the reason it failed, or None."""
    try:
        await cluster.exchange(summary)
    except StoreError as exc:
        return str(exc)
    return None
