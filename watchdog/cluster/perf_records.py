"""What each node's performance look measured, in the form the nodes share it: ``perf/<node>`` in the store.

A process group spanning nodes is seen in part by every node, so arrival
skew, stragglers, bandwidth and slow links of such a group can only be
judged by one reader of every node's entries: the leader (``peers``).
After each look a node publishes a ``PerfRecord``: per process group its
member count and description, and per rank the newest ``ENTRIES_SHARED``
collectives as rows ``(collective_seq_id, time_created_ns, duration_ms,
state, op, bytes)``; plus its hosts and each rank's links
(``slowness.links.rank_links``), so the leader's findings name the other
nodes' links; and what NCCL chose on this node (its ranks' init lines,
``events.RankTransport``) with the node's InfiniBand ports that are up, so the
leader compares transports across nodes (a node on sockets among IB nodes,
fewer channels or HCAs than its peers): a node alone only sees its own.
``at`` (the look's time, the publisher's clock) versions it.

Size: 8 ranks of one group, 64 NCCL rows each (durations, 64 MiB sizes),
encode to 31.5 KB of JSON, about 61 bytes a row
(``tests/cluster/test_cluster_perf.py`` holds it under 40 KB): one set per
``perf_interval`` per node, and the leader reads one per other node (64
nodes: 2 MB a minute). NCCL's choices add 0.44-0.5 KB per process and
communicator (the recorded 2-node IB/socket log and the real H200 capture),
so 8 ranks in 3 communicators add about 12 KB. Completion times are left out:
across hosts, completion minus the last arrival would mix two clocks. Pure
apart from pydantic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel

from ncclwatch.watchdog.events import OpState, ProcKey, RankTransport, group_label
from ncclwatch.watchdog.slowness.bandwidth import RankEntry

# Per group and rank.  The straggler detector reads the last 20 rounds of one recurring collective
# (stragglers.last_arrivals' window) and a data-parallel step issues about three collectives per group
# (gradients, loss, a broadcast): 64 entries cover those 20 rounds; slow collectives and links need 6.
ENTRIES_SHARED = 64

Row = tuple[int, int, float | None, OpState, str, int | None]  # seq, created_ns, duration_ms, state, op, nbytes


class GroupRecord(BaseModel):
    nranks: int | None = None  # the group's member count, where a dump listed it
    desc: str | None = None
    ranks: dict[int, list[Row]]  # global rank -> its newest entries, oldest first


class PerfRecord(BaseModel):
    node: int
    host: str
    at: float  # the look's time (the publisher's clock): the record's version
    hosts: dict[int, str]  # global rank -> host
    links: dict[int, list[str]]  # global rank -> the NICs its traffic goes through
    groups: dict[str, GroupRecord]
    transport: list[RankTransport] = []  # NCCL's choices per process and communicator
    global_ranks: list[tuple[ProcKey, int]] = []  # NCCL's process -> global rank (the transport facts' ranks)
    ib_active: list[str] = []  # this node's InfiniBand ports that are up (sysfs)

    def rank_entries(self) -> list[RankEntry]:
        return [
            RankEntry(
                rank=rank,
                pg=pg,
                seq=seq,
                op=op,
                created_ns=created,
                state=state,
                nbytes=nbytes,
                nranks=group.nranks,
                duration_ms=duration,
            )
            for pg, group in self.groups.items()
            for rank, rows in group.ranks.items()
            for seq, created, duration, state, op, nbytes in rows
        ]

    def labels(self) -> dict[str, str]:
        return {pg: group_label(pg, group.desc) for pg, group in self.groups.items()}


def perf_record(
    node: int,
    host: str,
    at: float,
    entries: Iterable[RankEntry],
    *,
    descs: Mapping[str, str | None],
    hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
    transport: Sequence[RankTransport] = (),
    global_ranks: Mapping[ProcKey, int] = {},
    ib_active: Sequence[str] = (),
) -> PerfRecord:
    """This node's look as it travels: the newest ``ENTRIES_SHARED`` entries per group and rank."""
    groups: dict[str, GroupRecord] = {}
    for e in sorted(entries, key=lambda e: e.seq):
        group = groups.setdefault(e.pg, GroupRecord(nranks=e.nranks, desc=descs.get(e.pg), ranks={}))
        group.ranks.setdefault(e.rank, []).append((e.seq, e.created_ns, e.duration_ms, e.state, e.op, e.nbytes))
    for group in groups.values():
        group.ranks = {rank: rows[-ENTRIES_SHARED:] for rank, rows in group.ranks.items()}
    return PerfRecord(
        node=node,
        host=host,
        at=at,
        hosts=dict(hosts),
        links={r: list(ls) for r, ls in links.items()},
        groups=groups,
        transport=list(transport),
        global_ranks=list(global_ranks.items()),
        ib_active=list(ib_active),
    )
