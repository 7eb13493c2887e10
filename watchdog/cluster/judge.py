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

from ncclwatch.watchdog.cluster.payload import paused_gc
from ncclwatch.watchdog.cluster.peers import Membership
from ncclwatch.watchdog.cluster.view import LOST_AFTER_S, Contact
from ncclwatch.watchdog.events import (
    Event,
    FrDump,
    ProcessState,
    SequenceTail,
    StackDump,
    Stall,
    WorkerGone,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import RankViews, Snapshot, take_snapshot
from ncclwatch.watchdog.hang.state import JobState, Worker
from ncclwatch.watchdog.hang.types import Decision, Fact
from ncclwatch.watchdog.hang.verdicts import PRIORITY, Verdict


def job_state(local: JobState, remote: dict[int, list[Event]], stall: Stall) -> JobState:
    merged = JobState(window=local.window)
    for events in remote.values():
        for event in events:
            merged.apply(event)
    merged.merge(local)
    merged.stall = stall
    return merged


Slot = tuple[object, ...]  # a place in ``JobState`` that one node's events fill: a pid, a rank of a communicator, ...
# Events whose place is a node's own (its workers, stacks, dumps, tails): its full evidence replaces them in place.
_PLACED = (WorkerSeen, WorkerGone, ProcessState, StackDump, FrDump, SequenceTail)


class JobEvidence:
    """The leader's state of the whole job at one stall, built as the evidence comes: ``job_state``'s result
    without rebuilding it.

    Each node's compact evidence is folded in as ``Cluster.gather`` finds it (``add``), while the slower
    nodes are waited for; this node's own state is unioned once, at the first ``judge``.  A node's full
    evidence then replaces its compact evidence in place (its workers, stacks, dumps and tails: the places no
    other node fills), and only the second judge runs again: at 1,024 nodes the state was built twice from
    every node's events.  Where in-place replacement could differ from ``job_state`` on the same evidence
    (another node or this one fills one of its places, it created a communicator, its other events changed,
    a node new since the first judge) the state is built again from all of it; the result is the same."""

    def __init__(self, local: JobState, stall: Stall) -> None:
        self.local, self.stall = local, stall
        self.remote: dict[int, list[Event]] = {}
        self.nodes_of: dict[int, int] = {}  # rank -> node, from the workers each node shares
        self._state = JobState(window=local.window)
        self._owner: dict[Slot, int] = {}  # slot -> the node whose events filled it first
        self._shared: set[Slot] = set()  # slots two sources fill
        self._created: dict[str, int] = {}  # communicator -> the node whose events created it
        self._merged = False  # this node's state is unioned in
        self._local_mark: tuple = ()  # what this node's state held then (``_mark``)
        self._rebuild = False
        self._views = RankViews()  # the second judgement reads again only the ranks whose evidence changed

    def add(self, node: int, events: list[Event]) -> None:
        """A node's evidence: folded now when it is new, replaced in place when the node shared before."""
        with paused_gc():
            previous = self.remote.get(node)
            self.remote[node] = events
            self.nodes_of.update((e.rank, node) for e in events if type(e) is WorkerSeen)  # as ``_BY_PID``
            if previous is None and not self._merged:
                self._fold(node, events)
            elif previous is None or not self._replaceable(node, previous, events):
                self._rebuild = True
            else:
                self._replace(previous, events)

    def state(self) -> JobState:
        """``job_state`` of this node's state and every node's evidence so far.  Where this node's own state gained
        a worker, a stack, a sequence, ... since it was unioned in (its sources go on while the leader waits for
        full evidence), the state is built again, as ``job_state`` would from it now."""
        if self._merged and _mark(self.local) != self._local_mark:
            self._rebuild = True
        if self._rebuild:
            self._state, self._rebuild, self._merged = job_state(self.local, self.remote, self.stall), False, True
            self._local_mark = _mark(self.local)
        elif not self._merged:
            self._state.merge(self.local)
            self._state.stall, self._merged, self._local_mark = self.stall, True, _mark(self.local)
            self._shared |= _slots(self.local) & self._owner.keys()
        return self._state

    def snapshot(self) -> Snapshot:
        """``take_snapshot`` of ``state()``; a rank whose evidence did not change since the last keeps its view."""
        return take_snapshot(self.state(), observed_at=self.stall.at, views=self._views)

    def judge(self) -> Decision:
        with paused_gc():
            return classify(self.snapshot())

    def _fold(self, node: int, events: list[Event]) -> None:
        before = set(self._state.comms)
        for event in events:
            self._state.apply(event)
        for key in self._state.comms.keys() - before:
            self._created[key] = node
        for slot in _event_slots(events):
            owner = self._owner.setdefault(slot, node)
            if owner != node:
                self._shared.add(slot)

    def _replaceable(self, node: int, previous: list[Event], events: list[Event]) -> bool:
        slots = _event_slots(events)
        return (
            slots == _event_slots(previous)
            and not slots & self._shared
            and not any(self._created.get(slot[1]) == node for slot in slots if slot[0] == "comm")
            and [e for e in previous if not isinstance(e, _PLACED)] == [e for e in events if not isinstance(e, _PLACED)]
            and all(e.rank is not None for e in events if isinstance(e, FrDump))
            and [e.cite for e in previous if isinstance(e, FrDump)] == [e.cite for e in events if isinstance(e, FrDump)]
        )

    def _replace(self, previous: list[Event], events: list[Event]) -> None:
        """The places of ``previous`` (one node's, no one else's) refilled from ``events``, each where it was."""
        state = self._state
        for event in previous:
            if isinstance(event, (WorkerSeen, WorkerGone, ProcessState)):
                state.workers[event.pid] = Worker(pid=event.pid)
        scratch = JobState(window=state.window)  # a shared tail never replaces a rank's: built aside, put in place
        for event in events:
            if isinstance(event, SequenceTail):
                scratch.apply(event)
                state.comms[event.comm_key].ranks[event.comm_rank] = scratch.comms[event.comm_key].ranks[
                    event.comm_rank
                ]
            elif isinstance(event, _PLACED):
                state.apply(event)


# The journal's kinds by exact type: they are never subclassed, and ``type(e) in`` is a set lookup where
# ``isinstance`` on a pydantic model runs its metaclass's check (0.1 us each, a third of this walk over 4,095 nodes').
_BY_PID = frozenset({WorkerSeen, WorkerGone, ProcessState})


def _event_slots(events: list[Event]) -> set[Slot]:
    slots: set[Slot] = set()
    for event in events:
        kind = type(event)
        if kind in _BY_PID:
            slots.add(("pid", event.pid))  # type: ignore[attr-defined]
        elif kind is StackDump:
            slots.add(("stack", event.pid))  # type: ignore[attr-defined]
        elif kind is SequenceTail:
            slots.add(("comm", event.comm_key, event.comm_rank))  # type: ignore[attr-defined]
        elif kind is FrDump:
            dump: FrDump = event  # type: ignore[assignment]
            slots.add(("file", dump.cite.file))
            for pg_id in {entry.pg_id for entry in dump.entries}:
                group = dump.process_groups.get(pg_id)
                members = group.ranks if group and group.ranks else []
                rank = members.index(dump.rank) if dump.rank in members else dump.rank
                slots.add(("comm", f"fr:{pg_id}", rank))
    return slots


def _mark(state: JobState) -> tuple:
    """What ``JobState.merge`` takes from a node's state, by identity and count: another mark, another union.  (What
    changes inside an object it takes, as a sequence's newest operations, shows in the union through that object.)"""
    return (
        tuple((key, id(comm), tuple(map(id, comm.ranks.values()))) for key, comm in state.comms.items()),
        tuple(map(id, state.procs.values())),
        tuple(map(id, state.stacks.values())),
        tuple(map(id, state.workers.values())),
        *map(len, (state.warnings, state.peer_closed, state.timeouts, state.failures, state.partial, state.notes)),
        tuple(map(id, state.ras)),  # these two are trimmed to the latest few: their length may stay
        tuple(map(id, state.gpus)),
        id(state.stall),
    )


def _slots(state: JobState) -> set[Slot]:
    """The places a node's own state fills (its workers, stacks, dumps, and every rank of its communicators)."""
    slots: set[Slot] = {("pid", pid) for pid in state.workers} | {("stack", pid) for pid in state.stacks}
    slots |= {("file", file) for file in state.fr_dumps}
    return slots | {("comm", key, rank) for key, comm in state.comms.items() for rank in comm.ranks}


def focus(decision: Decision, nodes_of: dict[int, int], lost: set[int], limit: int) -> list[int]:
    """The nodes whose full evidence decides: the culprits', absent and suspect ranks', then those of ranks whose row
    differs from the most common one (behind, diverged), at most ``limit``; never a lost node (it cannot answer).

    A rank behind where the others' operation at its position is unknown (``?``) asks the others' nodes too:
    their compact tails began after that position, their hosts having run ahead (on the H100, FSDP2 across two
    wrappers: the rank that skipped a collective enqueued 157 more), and only their full evidence tells a rank
    behind from ranks that diverged.  With two ranks the most common row is a tie, so this was left to chance."""
    finding = decision.finding
    # The usual row is the peers' (the culprits' rows are asked for anyway), and a tie is broken by name: with two
    # ranks it was left to set order, and a stopped rank 0 on the leader's node asked rank 1's node for nothing
    # the verdict needed in some runs (the H200, two wrappers: 2.5 s more to the page).
    statuses = [row.status for row in finding.rows if row.rank not in finding.culprits] or [
        row.status for row in finding.rows
    ]
    usual = max(sorted(set(statuses)), key=statuses.count) if statuses else None
    unseen = finding.verdict == Verdict.rank_behind and finding.operation == "?"
    ahead = [row.rank for row in finding.rows if row.rank not in finding.culprits] if unseen else []
    ranks = [
        *finding.culprits,
        *finding.absent,
        *finding.suspects,  # an even split: only the ranks' history (their full evidence) may tell which side erred
        *(row.rank for row in finding.rows if row.status != usual),
        *ahead,
    ]
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
