"""Where each rank stood in each process group, from PyTorch's watchdog lines.

PyTorch numbers the collectives of a process group (``SeqNum``) the same on
every member, so ranks of one group can be compared by it: the rank that
never enqueued the collective the others time out in is the one they wait
for.  Groups must never be compared with each other: a rank prints one
watchdog line per group, and a rank of a job with a data-parallel and a
tensor-parallel group shows two unrelated sequence numbers.

Group identity: the ``[PG ID i PG GUID g(name) Rank r]`` prefix (2.4+; the
GUID is the same on every member).  From 2.4 the timeout line itself has
only ``[Rank r]``; the ``failure detected by watchdog at work sequence id: s``
line of the same rank and sequence number names its group.  Older lines name
no group: they form one group ``None``, which is ``ambiguous`` as soon as one
rank shows two different sequence numbers in it (then it is several groups
that cannot be told apart, and nothing in it is compared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ncclwatch.watchdog.events import Citation, PgStatus, WatchdogTimeout


@dataclass
class RankInGroup:
    """One rank's position in one process group."""

    rank: int
    waiting: int | None = None  # the SeqNum it timed out or failed in
    op: str | None = None  # OpType of that collective
    numel_in: int | None = None
    numel_out: int | None = None
    timeout_ms: int | None = None  # the timeout of that collective's group (Timeout(ms)=)
    enqueued: int | None = None  # last enqueued SeqNum
    completed: int | None = None  # last completed SeqNum
    seqs: set[int] = field(default_factory=set)  # every SeqNum it reported waiting in (ambiguity check)
    cites: list[Citation] = field(default_factory=list)

    def position(self) -> str:
        parts = []
        if self.waiting is not None:
            parts.append(f"waits in SeqNum {self.waiting}" + (f" {self.op}" if self.op else ""))
        if self.enqueued is not None:
            parts.append(f"last enqueued {self.enqueued}")
        if self.completed is not None:
            parts.append(f"last completed {self.completed}")
        return ", ".join(parts) or "no position"


@dataclass
class Group:
    key: str | None  # GUID or id; None: lines that name no group
    label: str
    ranks: dict[int, RankInGroup] = field(default_factory=dict)
    desc: str | None = None  # the group's name in the prefix: "default_pg"
    joined: tuple[int, ...] = ()  # ranks whose lines named no group, joined to this one (``partial_rules``)

    @property
    def default(self) -> bool:
        """The default process group: PG ID 0, GUID 0, or named default_pg (the first group a job makes)."""
        return self.key == "0" or self.desc == "default_pg"

    @property
    def ambiguous(self) -> list[int]:
        """Ranks with several sequence numbers in a group of unnamed lines: several groups mixed."""
        if self.key is not None:
            return []
        return sorted(r.rank for r in self.ranks.values() if len(r.seqs) > 1)

    def rank(self, rank: int) -> RankInGroup:
        return self.ranks.get(rank) or self.ranks.setdefault(rank, RankInGroup(rank))


def build_groups(timeouts: list[WatchdogTimeout], statuses: list[PgStatus]) -> list[Group]:
    """Per process group, each rank's position; a timeout joins the group its failure line names."""
    groups: dict[str | None, Group] = {}
    named_failure: dict[tuple[int, int], PgStatus] = {
        (s.rank, s.seq): s for s in statuses if s.pg is not None and s.seq is not None
    }

    def group(key: str | None, desc: str | None) -> Group:
        known = groups.get(key)
        if known is None or (key is not None and desc and known.desc is None):
            label = (
                "lines without a process-group id"
                if key is None
                else f"process group {key}" + (f" ({desc})" if desc else "")
            )
            groups[key] = Group(key, label, ranks=known.ranks if known else {}, desc=desc if key else None)
        return groups[key]

    for status in statuses:
        pg = status.pg
        if pg is None and status.seq is not None and (status.rank, status.seq) in named_failure:
            pg = named_failure[(status.rank, status.seq)].pg
        info = group(pg, status.pg_desc).rank(status.rank)
        if status.seq is not None:
            info.seqs.add(status.seq)
            info.waiting = status.seq if info.waiting is None else min(info.waiting, status.seq)
        if status.last_enqueued is not None:
            info.enqueued = status.last_enqueued if info.enqueued is None else max(info.enqueued, status.last_enqueued)
        if status.last_completed is not None:
            info.completed = (
                status.last_completed if info.completed is None else min(info.completed, status.last_completed)
            )
        info.cites.append(status.cite)
    named = {s.pg: s for s in named_failure.values()}
    for timeout in timeouts:
        pg = timeout.pg
        paired = named_failure.get((timeout.rank, timeout.seq))
        if pg is None and paired is None and len(named) == 1:
            # An excerpt cut before this rank's failure line: its timeout joins the only group the
            # input names when another rank of that group waits in the same SeqNum (never with two groups).
            only = next(iter(named.values()))
            if any(s.seq == timeout.seq for s in named_failure.values()):
                paired = only
        if pg is None and paired is not None:
            pg = paired.pg
        info = group(pg, timeout.pg_desc or (paired.pg_desc if paired else None)).rank(timeout.rank)
        info.seqs.add(timeout.seq)
        if info.waiting is None or timeout.seq <= info.waiting:
            info.waiting, info.op = timeout.seq, timeout.op
            info.numel_in, info.numel_out = timeout.numel_in, timeout.numel_out
            info.timeout_ms = timeout.timeout_ms
        info.cites.insert(0, timeout.cite)
    return [groups[k] for k in sorted(groups, key=lambda k: (k is None, str(k)))]
