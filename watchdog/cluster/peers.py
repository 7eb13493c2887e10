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
- after each performance look, each sidecar sets ``perf/<n>``, its ranks'
  newest collectives (``perf_records``), and the leader reads the others'
  to judge the job's arrival skew, stragglers, bandwidth and slow links.

A store that cannot be reached is said (``SourceDown``) and the sidecar
judges alone ("degraded"); it never stays silent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ncclwatch.watchdog.cluster.perf_records import PerfRecord
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.engine.state import JobState
from ncclwatch.watchdog.events import Event, FrDump, FrEntry, StackDump
from ncclwatch.watchdog.parsing.journal import HEADER, JOURNALED, journal_line, parse_journal

log = logging.getLogger("ncclwatch")

T = TypeVar("T")

PUBLISH_S = 2.5
LOST_AFTER_S = 7.5  # three missed summaries: that node's sidecar is gone (or its whole node is frozen)
EVIDENCE_WAIT_S = 4.0  # how long a probe waits for the other nodes' evidence
# How long the leader's performance look waits for the other nodes' records of the same round; it holds the
# tick (hang detection) that long at most, once per perf_interval.  The others look at the same moment.
PERF_WAIT_S = 3.0
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
    started_at: float | None = None  # when its sidecar started (the job's start is the earliest)


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
        self._perf_left_out: set[int] = set()  # nodes the latest job-wide performance look went without

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
        return await self._gather("evidence", self.answering(), since, EVIDENCE_WAIT_S,
                                  lambda node, raw: parse_journal(raw, f"node {node} (via the store)"))  # fmt: skip

    async def share_perf(self, record: PerfRecord) -> None:
        await self.client.set(self.key("perf", self.me), record.model_dump_json().encode())
        await self.client.set(self.key("perf-at", self.me), repr(record.at).encode())

    async def exchange_perf(self, record: PerfRecord, interval: float) -> dict[int, PerfRecord] | None:
        """Publish this node's performance record; the other nodes' when this node leads, else None."""
        await self.share_perf(record)
        return await self.gather_perf(record.at, interval) if self.leader() == self.me else None

    async def gather_perf(self, look_at: float, interval: float) -> dict[int, PerfRecord]:
        """The other nodes' performance records for the leader's look at ``look_at``.

        Looks are aligned to the same wall-clock grid on every node (``PerfWatch``), so each answering node's
        record of this round (newer than half an interval ago) is waited for, up to PERF_WAIT_S; a node that
        did not publish this round gives its latest if it is at most two intervals old.  Older or none: left
        out, said once.
        """
        found = await self._gather("perf", self.answering(), look_at - interval / 2, PERF_WAIT_S, _perf_record)
        others = {n for n in range(self.membership.nnodes) if n != self.me}
        found |= await self._gather("perf", others - set(found), look_at - 2 * interval, 0.0, _perf_record)
        left_out = others - set(found)
        if newly := sorted(left_out - self._perf_left_out):
            log.warning("performance look: node(s) %s published no record in two intervals: the job-wide view "
                        "leaves their ranks out", ", ".join(map(str, newly)))  # fmt: skip
        self._perf_left_out = left_out
        return {node: record for node, record in found.items() if record is not None}

    async def _gather(
        self, what: str, wanted: set[int], since: float, wait_s: float, parse: Callable[[int, bytes], T]
    ) -> dict[int, T]:
        """``what`` of each wanted node, published at or after ``since`` (its ``<what>-at`` key); waits up to
        ``wait_s`` for all of them."""
        deadline = self.clock() + wait_s
        found: dict[int, T] = {}
        while True:
            for node in sorted(wanted - set(found)):
                at = await self.client.get(self.key(f"{what}-at", node))
                if at is None or float(at) < since:
                    continue
                raw = await self.client.get(self.key(what, node))
                if raw is not None:
                    found[node] = parse(node, raw)
            if set(found) >= wanted or self.clock() >= deadline:
                return found
            await asyncio.sleep(0.2)

    def job_started_at(self, own: float) -> float:
        """When the job's first sidecar started, as far as this one has heard: the same on every node, so a
        page keyed on it deduplicates whichever node sends it."""
        return min([own] + [s.started_at for s in self.summaries.values() if s.started_at is not None])


def _perf_record(node: int, raw: bytes) -> PerfRecord | None:
    try:
        return PerfRecord.model_validate_json(raw)
    except ValidationError:
        log.warning("node %s published a performance record that does not validate; ignored", node)
        return None


async def exchange_or_degrade(cluster: Cluster, summary: NodeSummary) -> str | None:
    """One exchange; the reason it failed, or None."""
    try:
        await cluster.exchange(summary)
    except StoreError as exc:
        return str(exc)
    return None
