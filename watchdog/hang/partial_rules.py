"""The facts partial evidence gives, and the rules that read process groups, links and excerpts.

``Facts`` sorts a snapshot's partial events by kind once; the rules are pure
functions of it, each returning a ``Finding`` (``inconclusive`` when it saw
something that does not decide) or None (nothing of its kind).
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import dataclass, field

from ncclwatch.watchdog.events import (
    Citation,
    CollectiveFingerprint,
    NetworkError,
    OrphanOps,
    PgStatus,
    ProcKey,
    RankLog,
    TransportMismatch,
    WatchdogTimeout,
    WorkerFailure,
)
from ncclwatch.watchdog.hang.pg_status import Group, RankInGroup, build_groups
from ncclwatch.watchdog.hang.rules import most_severe
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import CulpritProcess, Fact, Finding, RankStatus
from ncclwatch.watchdog.hang.verdicts import Verdict

# OpTypes whose NumelIn must be equal on every rank (not all-to-all, gather/scatter, p2p).
SIZED_ALIKE = frozenset(
    {
        "ALLREDUCE",
        "BROADCAST",
        "REDUCE",
        "ALLGATHER",
        "_ALLGATHER_BASE",
        "REDUCE_SCATTER",
        "_REDUCE_SCATTER_BASE",
        "BARRIER",
    }
)
P2P_TYPES = frozenset({"SEND", "RECV", "RECVANYSOURCE", "COALESCED"})
_NOT_DEAD = {-signal.SIGTERM, -signal.SIGINT}  # torchrun's teardown of the healthy ranks


@dataclass(frozen=True)
class MismatchSeen:
    """One transport WARN about two ranks' operations differing: who printed it, what it compared, where."""

    rank: int | None  # the rank that printed it, where the input says
    proc: ProcKey | None
    mismatch: TransportMismatch
    cite: Citation
    source: str  # nccl_log (an NCCL debug file) or network (the same WARN on stderr, or in PyTorch's exception)


@dataclass
class Facts:
    timeouts: list[WatchdogTimeout] = field(default_factory=list)
    statuses: list[PgStatus] = field(default_factory=list)
    fingerprints: list[CollectiveFingerprint] = field(default_factory=list)
    network: list[NetworkError] = field(default_factory=list)
    rank_logs: list[RankLog] = field(default_factory=list)
    orphans: list[OrphanOps] = field(default_factory=list)
    failures_by_rank: dict[int, WorkerFailure] = field(default_factory=dict)
    world: int | None = None
    has_fr: bool = False
    has_nccl: bool = False
    groups: list[Group] = field(default_factory=list)
    history: tuple[str, ...] = ()  # the longest operation sequence the NCCL lines or dumps recorded (NCCL op names)
    mismatches: list[MismatchSeen] = field(default_factory=list)

    @classmethod
    def collect(cls, snapshot: Snapshot) -> Facts:
        facts = cls(timeouts=list(snapshot.timeouts))
        sort = {
            PgStatus: facts.statuses,
            CollectiveFingerprint: facts.fingerprints,
            NetworkError: facts.network,
            RankLog: facts.rank_logs,
            OrphanOps: facts.orphans,
        }
        for event in snapshot.partial:
            bucket = sort.get(type(event))
            if bucket is not None:
                bucket.append(event)
        for failure in snapshot.failures:
            known = facts.failures_by_rank.get(failure.rank)
            if known is None or (failure.root_cause and not known.root_cause):
                facts.failures_by_rank[failure.rank] = failure
        sizes = [c.nranks for c in snapshot.comms if c.nranks]
        sizes += [o.nranks for o in facts.orphans if o.nranks]
        sizes += [c.nranks for r in snapshot.ras for c in r.communicators if c.nranks]
        facts.world = max(sizes) if sizes else None
        facts.has_fr = any(c.source == "flight_recorder" for c in snapshot.comms)
        facts.has_nccl = any(c.source == "nccl_log" for c in snapshot.comms) or bool(facts.orphans)
        facts.groups = join_contradicted(build_groups(facts.timeouts, facts.statuses))
        facts.history = _op_history(snapshot, facts.orphans)
        facts.mismatches = _mismatches_seen(snapshot, facts.network)
        return facts

    @property
    def empty(self) -> bool:
        return not (
            self.timeouts
            or self.statuses
            or self.fingerprints
            or self.network
            or self.orphans
            or self.rank_logs
            or self.mismatches
        )

    def diagnosed_ranks(self) -> set[int]:
        """Ranks that printed a PyTorch or network diagnostic of their own: alive when they printed it."""
        ranks = {t.rank for t in self.timeouts} | {s.rank for s in self.statuses}
        ranks |= {f.reported_by for f in self.fingerprints} | {e.rank for e in self.network if e.rank is not None}
        return ranks

    def dead_ranks(self) -> dict[int, WorkerFailure]:
        """Ranks torchrun saw exit on their own (not its SIGTERM), that were not busy reporting an error."""
        diagnosed = self.diagnosed_ranks()
        return {
            r: f
            for r, f in self.failures_by_rank.items()
            if f.exitcode != 0
            and f.exitcode not in _NOT_DEAD
            and r not in diagnosed
            and (f.root_cause or f.exitcode < 0)
        }

    def held_ranks(self) -> set[int]:
        ranks = self.diagnosed_ranks() | {log.rank for log in self.rank_logs}
        return ranks | {o.rank for o in self.orphans if o.rank is not None}

    def absent_ranks(self) -> list[int]:
        if self.world is None:
            return []
        held = self.held_ranks()
        return [r for r in range(self.world) if r not in held]

    def rows(self) -> tuple[RankStatus, ...]:
        """One row per rank: its position in each process group, its errors, or just "log held"."""
        rows: dict[int, dict] = {}
        for group in self.groups:
            for info in group.ranks.values():
                row = rows.setdefault(info.rank, {"detail": []})
                row.setdefault("issued", info.enqueued)
                row.setdefault(
                    "last_op", f"SeqNum {info.waiting} {info.op or ''}".strip() if info.waiting is not None else None
                )
                row.setdefault(
                    "status", "timed out" if info.op else "waiting" if info.waiting is not None else "placed"
                )
                row["detail"].append(f"{group.label}: {info.position()}")
        for error in self.network:
            if error.rank is not None:
                row = rows.setdefault(error.rank, {"detail": []})
                row.setdefault("status", "network error")
                row["detail"].append(
                    f"{error.kind.replace('_', ' ')}" + (f" (peer {error.peer})" if error.peer else "")
                )
        for log in self.rank_logs:
            rows.setdefault(log.rank, {"detail": [], "status": "log held, no diagnostic"})
        return tuple(
            RankStatus(
                rank=r,
                host=None,
                pid=None,
                issued=v.get("issued"),
                last_op=v.get("last_op"),
                status=v.get("status", ""),
                detail="; ".join(dict.fromkeys(v["detail"]))[:300],
            )
            for r, v in sorted(rows.items())
        )

    def summary(self) -> str:
        parts = [f"rank {row.rank}: {row.detail or row.status}" for row in self.rows()[:16]]
        if self.orphans:
            parts.append(f"{len(self.orphans)} NCCL communicator(s) with operation lines but no Init line")
        return "; ".join(parts) or "no rank could be placed"


def _mismatches_seen(snapshot: Snapshot, network: list[NetworkError]) -> list[MismatchSeen]:
    """Transport mismatch WARNs from the NCCL debug files (rank from their Init lines) and from stderr, each line
    once (one file read both ways gives it twice)."""
    seen: dict[tuple[str, int | None], MismatchSeen] = {}
    by_pid = snapshot.rank_of_pid()  # a file cut before its Init lines: the live journal's workers know the pid
    for warning in snapshot.warnings:
        if warning.mismatch is not None:
            rank = snapshot.global_ranks.get(warning.proc, by_pid.get(warning.proc.pid))
            found = MismatchSeen(rank, warning.proc, warning.mismatch, warning.cite, "nccl_log")
            seen.setdefault((warning.cite.file, warning.cite.line), found)
    for error in network:
        if error.mismatch is not None:
            found = MismatchSeen(error.rank, error.proc, error.mismatch, error.cite, "network")
            seen.setdefault((error.cite.file, error.cite.line), found)
    return list(seen.values())


def _op_history(snapshot: Snapshot, orphans: list[OrphanOps]) -> tuple[str, ...]:
    """One rank's recorded operations in order, from the job's largest communicator (the default group's, as a
    rule): what the job repeats, for a DETAIL report that cannot say which side departs."""
    candidates = [
        (comm.nranks, len(r.window), tuple(sig.op for sig in r.window)) for comm in snapshot.comms for r in comm.ranks
    ]
    candidates += [(o.nranks or 0, len(o.last), tuple(sig.op for _, sig, _ in o.last)) for o in orphans]
    return max(candidates, default=(0, 0, ()))[2]


# --------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------


# SeqNums apart within which a line without a group id is taken as the default group's: a rank behind in one group
# stops within the few collectives of the step its peers are in.
JOIN_WINDOW = 8


def join_contradicted(groups: list[Group]) -> list[Group]:
    """Timeouts without a group id joined to the only group the input names, where they are that group's.

    From torch 2.4 a timeout line names no group; its rank's failure line does, and a posted excerpt often
    lacks it (and logs of two torch versions mix the two forms).  ``pg_status`` joins such a line to the only
    named group when a rank of it waits in the same SeqNum; here also when

    - a rank of it reports that SeqNum as its last completed: its peer finished the call this rank still waits
      in and went on, the divergence itself (another group's numbers would match only by chance);
    - that group is the default group (PG ID 0, default_pg) and the line's SeqNum is within ``JOIN_WINDOW`` of
      the group's: a line without an id is the default group's unless the input shows another, and another
      group's numbers (a tensor-parallel group's 212 beside the default group's 1001) are rarely that close;
    - the line times out in the same kind of call as a rank of that group: OpType, NumelIn and Timeout(ms) alike.

    Then SeqNums apart compare: the rank with the lower one is behind.  Never with two named groups, nor when
    one rank's unnamed lines show two SeqNums (several groups that cannot be told apart).
    """
    named = [g for g in groups if g.key is not None]
    unnamed = next((g for g in groups if g.key is None), None)
    if len(named) != 1 or unnamed is None or unnamed.ambiguous:
        return groups
    (group,) = named
    done = {i.completed for i in group.ranks.values() if i.completed is not None}
    calls = {(i.op, i.numel_in, i.timeout_ms) for i in group.ranks.values() if i.op is not None}
    seqs = [i.waiting for i in group.ranks.values() if i.waiting is not None]
    near = lambda seq: group.default and any(abs(seq - other) <= JOIN_WINDOW for other in seqs)  # noqa: E731
    joining = {
        r: i
        for r, i in unnamed.ranks.items()
        if r not in group.ranks
        and i.waiting is not None
        and (i.waiting in done or near(i.waiting) or (i.op, i.numel_in, i.timeout_ms) in calls)
    }
    if not joining:
        return groups
    joined = Group(
        group.key,
        group.label,
        ranks={**group.ranks, **joining},
        desc=group.desc,
        joined=tuple(sorted(joining)),
    )
    rest = Group(None, unnamed.label, ranks={r: i for r, i in unnamed.ranks.items() if r not in joining})
    return [joined] + ([rest] if rest.ranks else [])


def process_groups(facts: Facts) -> Finding | None:
    """PyTorch's watchdog lines, per process group: the most severe group's finding; where no group decides, one
    ``inconclusive`` finding with what each group showed, in turn."""
    findings = [_group_finding(group, facts) for group in facts.groups]
    if len(findings) < 2:
        return findings[0] if findings else None
    return most_severe(findings) or Finding(
        verdict=Verdict.inconclusive,
        summary="; ".join(f.summary for f in findings),
        source="pytorch",
        evidence=tuple(e for f in findings for e in f.evidence),
        missing=tuple(m for f in findings for m in f.missing),
    )


def _group_finding(group: Group, facts: Facts) -> Finding:
    infos = sorted(group.ranks.values(), key=lambda i: i.rank)
    if group.ambiguous:
        seqs = "; ".join(f"rank {i.rank}: SeqNum {sorted(i.seqs)}" for i in infos if i.rank in group.ambiguous)
        return _seen(
            group,
            infos,
            f"{seqs}: several process groups whose lines carry no group id; their sequence numbers are not compared",
            (
                "lines with process-group ids (torch 2.4+ prints '[PG ID n PG GUID g(name) Rank r]'), "
                "or Flight Recorder dumps",
            ),
        )
    waiting = [i for i in infos if i.waiting is not None]
    if not waiting:
        return _seen(group, infos, f"{group.label}: " + "; ".join(f"rank {i.rank}: {i.position()}" for i in infos), ())
    top = max(i.waiting for i in waiting)  # type: ignore[type-var]
    at_top = [i for i in waiting if i.waiting == top]
    mismatch = _op_mismatch(group, at_top, top)
    if mismatch is not None:
        return mismatch
    behind = [
        i for i in infos if (i.enqueued is not None and i.enqueued < top) or (i.waiting is not None and i.waiting < top)
    ]
    if behind and len(behind) < len(infos):
        return _behind(group, behind, at_top, top)
    op = at_top[0].op or "?"
    ranks = [i.rank for i in at_top]
    if facts.world is not None and set(range(facts.world)) <= set(ranks):
        return Finding(
            verdict=Verdict.stuck_in_collective,
            summary=f"Every rank ({facts.world}) timed out in SeqNum {top} ({op}) on {group.label}: "
            "all entered it and it never completed.",
            reason="PyTorch's watchdog on every rank gave up on the same collective; "
            "the lead is in NCCL or the network, not in the ranks' order.",
            position=top,
            operation=op,
            comm_label=group.label,
            source="pytorch",
            evidence=tuple(Fact("pytorch", f"rank {i.rank}: {i.position()}", i.cites[0]) for i in at_top[:12]),
            missing=(
                "Flight Recorder dumps (started vs scheduled names the late rank), or the network errors of each rank",
            ),
        )
    return _seen(
        group, infos, f"{group.label}: ranks {ranks} wait in SeqNum {top} ({op}); no rank is seen behind it", ()
    )


def _op_mismatch(group: Group, at_top: list[RankInGroup], top: int) -> Finding | None:
    kinds: dict[tuple, list[RankInGroup]] = {}
    for info in at_top:
        if info.op is None or info.op in P2P_TYPES:
            return None
        kinds.setdefault((info.op, info.numel_in if info.op in SIZED_ALIKE else None), []).append(info)
    if len(kinds) < 2:
        return None
    ordered = sorted(kinds.items(), key=lambda kv: -len(kv[1]))
    tie = len(ordered[0][1]) == len(ordered[1][1])
    culprits = () if tie else tuple(sorted(i.rank for _, members in ordered[1:] for i in members))
    text = lambda key: f"{key[0]}" + (f" NumelIn={key[1]}" if key[1] is not None else "")  # noqa: E731
    sides = "; ".join(f"rank {', '.join(str(i.rank) for i in m)}: {text(k)}" for k, m in ordered)
    return Finding(
        verdict=Verdict.collective_mismatch,
        summary=f"At SeqNum {top} on {group.label} ranks issued different collectives: {sides}.",
        reason="PyTorch numbers a group's collectives alike on every rank; "
        "the same number with another type or size is another call. "
        + (
            "The ranks split evenly: which side is wrong is not in these lines."
            if tie
            else "The minority departs from the others."
        ),
        culprits=culprits,
        suspects=tuple(sorted(i.rank for i in at_top)) if tie else (),
        position=top,
        operation=" vs ".join(text(k) for k, _ in ordered),
        comm_label=group.label,
        source="pytorch",
        evidence=tuple(Fact("pytorch", f"rank {i.rank}: {i.position()}", i.cites[0]) for i in at_top[:12]),
    )


def _behind(group: Group, behind: list[RankInGroup], at_top: list[RankInGroup], top: int) -> Finding:
    names = ", ".join(str(i.rank) for i in behind)
    op = at_top[0].op or "?"
    finished = [
        (i, peer)
        for i in behind
        for peer in at_top
        if i.waiting is not None and peer.completed is not None and peer.completed >= i.waiting
    ]
    diverged = " ".join(
        f"They diverged: rank {i.rank} still waits in SeqNum {i.waiting} ({i.op or '?'}), "
        f"which rank {peer.rank} completed before entering SeqNum {top}."
        for i, peer in finished[:1]
    )
    waits = "; ".join(
        f"rank {i.rank} waits in SeqNum {i.waiting}, {top - i.waiting} before" for i in behind if i.waiting is not None
    )
    shown = {i.rank for i in behind + at_top}
    joined = [r for r in group.joined if r in shown]
    unnamed = (
        f" Rank {', '.join(map(str, joined))}'s line names no process group: compared on {group.label}."
        if joined
        else ""
    )
    evidence = [Fact("pytorch", f"rank {i.rank}: {i.position()}", i.cites[0]) for i in at_top[:6]]
    evidence += [Fact("pytorch", f"rank {i.rank}: {i.position()}", i.cites[0]) for i in behind[:6]]
    return Finding(
        verdict=Verdict.rank_behind,
        summary=f"Rank {names} never entered SeqNum {top} ({op}) on {group.label}; "
        f"rank {', '.join(str(i.rank) for i in at_top)} wait in it"
        + (f" ({waits})." if waits and not diverged else ".")
        + (f" {diverged}" if diverged else "")
        + unnamed,
        reason="The behind rank's own watchdog line places it before that collective (its last enqueued work is lower, "
        "or its NCCL call for it never returned), so its peers wait for it.",
        culprits=tuple(i.rank for i in behind),
        position=top,
        operation=op,
        comm_label=group.label,
        source="pytorch",
        evidence=tuple(evidence),
        missing=("where the behind rank's Python is: its traceback in its stderr, or py-spy dump --pid <pid>",),
    )


def _seen(group: Group, infos: list[RankInGroup], text: str, missing: tuple[str, ...]) -> Finding:
    cites: list[Citation] = [i.cites[0] for i in infos if i.cites]
    return Finding(
        verdict=Verdict.inconclusive,
        summary=text,
        comm_label=group.label,
        source="pytorch",
        evidence=tuple(
            Fact("pytorch", f"rank {i.rank}: {i.position()} ({group.label})", c)
            for i, c in zip(infos, cites, strict=False)
        )[:8],
        missing=missing,
    )


# --------------------------------------------------------------------------
# NCCL's own mismatch warnings
# --------------------------------------------------------------------------


def transport_mismatch(facts: Facts) -> Finding | None:
    """NCCL's transport caught two ranks' operations differing (``message truncated``, ``collective mismatch
    error``): a collective mismatch, with the ranks and sizes of the line.  NCCL fails the communicator with
    ncclInvalidUsage then, so the job crashes or hangs without Flight Recorder dumps.  One line does not say which
    side departs (the sender skipped a collective, or the receiver added one): both are suspects.  The peer is a
    rank only where the job has two ranks (the other one); otherwise it is named by its address.
    """
    if not facts.mismatches:
        return None
    first = facts.mismatches[0]
    reporter, peer_rank = first.rank, _peer_rank(first, facts.world)
    suspects = tuple(sorted({r for r in (reporter, peer_rank) if r is not None}))
    transport = "socket" if first.mismatch.transport == "socket" else "InfiniBand"
    return Finding(
        verdict=Verdict.collective_mismatch,
        summary=f"NCCL's {transport} transport caught two ranks' operations differing: "
        f"{describe_mismatch(first, peer_rank)}. NCCL failed the communicator (invalid usage).",
        reason="NCCL's transport checks each message against the receive its peer posted; a message larger than the "
        "receive means the two ranks run different operations there (a collective skipped or added, or another "
        "size). The line does not say which side departs.",
        suspects=suspects,
        operation=f"{first.mismatch.sent_bytes} bytes sent vs {first.mismatch.posted_bytes} bytes posted",
        source=first.source,
        evidence=tuple(
            Fact(m.source, describe_mismatch(m, _peer_rank(m, facts.world)), m.cite) for m in facts.mismatches[:8]
        ),
        missing=(
            "which side departs: both ranks' NCCL debug files (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL) or "
            "Flight Recorder dumps (TORCH_NCCL_DUMP_ON_TIMEOUT=1 dumps on this error too)",
        ),
    )


def mismatch_facts(snapshot: Snapshot) -> list[Fact]:
    """The transport mismatch WARNs of a job whose verdict came from its sequences, described with their ranks and
    sizes (``job_rules.job_evidence`` cites them beside the finding)."""
    if not any(w.mismatch for w in snapshot.warnings) and not any(
        isinstance(e, NetworkError) and e.mismatch for e in snapshot.partial
    ):
        return []
    facts = Facts.collect(snapshot)
    return [
        Fact(m.source, f"NCCL's transport: {describe_mismatch(m, _peer_rank(m, facts.world))}", m.cite)
        for m in facts.mismatches[:4]
    ]


def _peer_rank(seen: MismatchSeen, world: int | None) -> int | None:
    return 1 - seen.rank if world == 2 and seen.rank in (0, 1) else None


def describe_mismatch(seen: MismatchSeen, peer_rank: int | None = None) -> str:
    """``rank 0 received 131072 bytes from peer 192.0.2.2<36764> (rank 1) where it had posted 65536``."""
    m = seen.mismatch
    who = (
        f"rank {seen.rank}"
        if seen.rank is not None
        else (f"process {seen.proc.host}:{seen.proc.pid}" if seen.proc else "a rank")
    )
    peer = f"peer {m.peer}" if m.peer else "its peer"
    if peer_rank is not None:
        peer += f" (rank {peer_rank})"
    if m.reporter_sends:
        return f"{who} sends {m.sent_bytes} bytes to {peer}, which posted a receive of {m.posted_bytes}"
    return f"{who} received {m.sent_bytes} bytes from {peer} where it had posted {m.posted_bytes}"


# --------------------------------------------------------------------------
# links
# --------------------------------------------------------------------------


def network_finding(facts: Facts) -> Finding | None:
    """An InfiniBand completion error: the link between the reporter and the named peer failed."""
    errors = [e for e in facts.network if e.kind == "ib_completion"]
    if not errors:
        return None
    # IBV_WC_WR_FLUSH_ERR (5) only says the queue pair was already broken: the first other error is the cause.
    errors.sort(key=lambda e: e.status == 5)
    first = errors[0]
    peers = Counter(e.peer_host for e in errors)
    on = {f.host: r for r, f in facts.failures_by_rank.items()}
    culprits = tuple(sorted({on[h] for h in peers if h in on}))
    peer_text = ", ".join(f"{h} ({n})" for h, n in peers.most_common())
    return Finding(
        verdict=Verdict.network_error,
        summary=f"InfiniBand link failure: {describe_network(first)}. Peers named: {peer_text}.",
        reason="NCCL's InfiniBand transport got a failed completion: the link to that peer (its adapter, cable, "
        "switch port, or the peer itself) broke, and every collective through it waits.",
        culprits=culprits,
        source="network",
        operation=first.status_name,
        evidence=tuple(Fact("network", describe_network(e), e.cite) for e in errors[:8]),
        missing=(
            "which rank ran on the peer host (its log or torchrun's summary from that node)",
            (
                "the adapters' counters on both hosts: "
                "/sys/class/infiniband/<hca>/ports/1/counters (link_downed, symbol_error)"
            ),
        ),
    )


def reporter(error: NetworkError) -> str:
    if error.rank is not None:
        return f"rank {error.rank}"
    if error.proc is not None:
        return f"process {error.proc.host}:{error.proc.pid}"
    return "a rank"


def describe_network(error: NetworkError) -> str:
    who = reporter(error)
    if error.kind == "ib_completion":
        what = f"InfiniBand completion error {error.status}" + (
            f" ({error.status_name}: {error.meaning})"
            if error.meaning
            else f" ({error.status_name})"
            if error.status_name
            else ""
        )
        return f"{who}: {what} from peer {error.peer}" + (f" on {error.device}" if error.device else "")
    if error.kind == "connection_closed":
        return f"{who}: connection closed by peer {error.peer}"
    if error.kind == "remote_error":
        return f"{who}: NCCL remote error (a peer exited or the network failed)"
    return f"{who}: {error.kind.replace('_', ' ')}: {(error.cite.text or '')[:160]}"


# --------------------------------------------------------------------------
# NCCL excerpts without Init lines
# --------------------------------------------------------------------------


def orphan_ops(facts: Facts) -> Finding | None:
    """NCCL COLL lines without Init lines, aligned by opCount per communicator size: the first that decides."""
    if not facts.orphans:
        return None
    by_size: dict[int | None, dict[ProcKey, list[OrphanOps]]] = {}
    for orphan in facts.orphans:
        by_size.setdefault(orphan.nranks, {}).setdefault(orphan.proc, []).append(orphan)
    findings = [_align_orphans(size, procs) for size, procs in by_size.items()]
    decided = [f for f in findings if f.verdict != Verdict.inconclusive]
    return decided[0] if decided else findings[0]


def _who(orphan: OrphanOps) -> str:
    where = f"{orphan.proc.host}:{orphan.proc.pid}"
    if orphan.rank is not None:
        return f"rank {orphan.rank} ({where})"
    return f"process {_process(orphan)}"


def _process(orphan: OrphanOps) -> CulpritProcess:
    return CulpritProcess(host=orphan.proc.host, pid=orphan.proc.pid, cuda_dev=orphan.cuda_dev)


def _named(orphans: list[OrphanOps]) -> dict:
    """Culprits as ``Finding`` fields: ranks where a prefix or file name gave them, else the processes."""
    return {
        "culprits": tuple(sorted(o.rank for o in orphans if o.rank is not None)),
        "culprit_processes": tuple(_process(o) for o in orphans if o.rank is None),
    }


def _align_orphans(size: int | None, procs: dict[ProcKey, list[OrphanOps]]) -> Finding:
    label = f"communicator of {size} ranks" if size else "communicator of unknown size"
    single = [slots[0] for slots in procs.values() if len(slots) == 1 and slots[0].last]
    seen = "; ".join(
        f"{_who(o)}: {o.count} ops, last {o.last[-1][1].describe()} opCount {o.last[-1][0]:#x}" for o in single[:12]
    )
    missing = ("NCCL logs from their start (the Init lines name each rank and communicator)",)
    if len(single) < 2:
        return Finding(
            Verdict.inconclusive,
            summary=f"NCCL operations without Init lines ({label}): {seen or 'several communicators per process'}",
            missing=missing,
        )
    mismatch = _orphan_mismatch(label, single)
    if mismatch is not None:
        return mismatch
    last = {o.proc: o.last[-1][0] for o in single}
    if not any(last.values()):
        return Finding(
            Verdict.inconclusive,
            summary=f"NCCL operations without Init lines ({label}), opCount 0 on every line "
            f"(NCCL 2.27.3+ single node): cannot align. {seen}",
            missing=missing,
        )
    top = max(last.values())
    behind = [o for o in single if last[o.proc] < top]
    if not behind:
        return Finding(
            Verdict.inconclusive,
            summary=f"NCCL operations without Init lines ({label}) all end at opCount {top:#x}: {seen}",
            missing=missing,
        )
    ahead = [o for o in single if last[o.proc] == top]
    return Finding(
        verdict=Verdict.rank_behind,
        summary=f"{', '.join(_who(o) for o in behind)} stopped at an earlier opCount than "
        f"{', '.join(_who(o) for o in ahead)} (last {top:#x}, {ahead[0].last[-1][1].describe()}) on the {label}.",
        reason="NCCL numbers a communicator's launches alike on every rank (opCount); each file is taken to run to its "
        "rank's last operation, so the rank that stopped earlier is the one the others wait for. No Init line: ranks "
        "come from prefixes or file names.",
        operation=ahead[0].last[-1][1].describe(),
        source="nccl_log",
        evidence=tuple(
            Fact(
                "nccl_log",
                f"{_who(o)}: last operation {o.last[-1][1].describe()} at opCount {o.last[-1][0]:#x}",
                Citation(file=o.file, line=o.last[-1][2]),
            )
            for o in single[:12]
        ),
        missing=missing,
        **_named(behind),
    )


Issued = dict  # process -> (signature, line) of the operations compared


def _orphan_mismatch(label: str, single: list[OrphanOps]) -> Finding | None:
    """Different operations where the processes' lines align: at one opCount, or, with opCount 0 on every line,
    at the operation each process stopped in."""
    if any(oc for o in single for oc, _, _ in o.last):
        found = _differ_at_opcount(single)
        where = f"opCount {found[0]:#x}" if found else ""
    else:
        found = _differ_at_the_end(single)
        where = "the last operation of each (opCount 0 on every line: NCCL 2.27.3+ single node)"
    if found is None:
        return None
    issued: Issued = found[1]
    sigs = Counter(sig for sig, _ in issued.values())
    (good, n_good), (_, n_next) = sigs.most_common(2)
    tie = n_good == n_next
    odd = [] if tie else [o for o in single if issued[o.proc][0] != good]
    return Finding(
        verdict=Verdict.collective_mismatch,
        summary=f"At {where} on the {label}: "
        + "; ".join(f"{_who(o)} issued {issued[o.proc][0].describe()}" for o in single),
        reason="Ranks of one communicator launch the same operation at the same opCount "
        "(count, datatype and operation alike). "
        + ("The ranks split evenly: which side is wrong is not in these lines." if tie else "The minority departs."),
        operation=" vs ".join(s.describe() for s in sigs),
        source="nccl_log",
        evidence=tuple(
            Fact(
                "nccl_log", f"{_who(o)}: {issued[o.proc][0].describe()}", Citation(file=o.file, line=issued[o.proc][1])
            )
            for o in single
        )[:12],
        suspects=tuple(sorted(o.rank for o in single if o.rank is not None)) if tie else (),
        **_named(odd),
    )


def _differ_at_opcount(single: list[OrphanOps]) -> tuple[int, Issued] | None:
    """The first opCount every process printed where their operations differ, the n-th of one launch compared with the
    n-th (a group of operations shares a launch).  opCount 0 counts: it is the first launch of a communicator.  A full
    window's first opCount is left out when lines came before it (``nccl_excerpt`` keeps the last ``KEEP``)."""
    launches = []
    for o in single:
        ops: dict[int, list[tuple]] = {}
        for oc, sig, line in o.last:
            ops.setdefault(oc, []).append((sig, line))
        if o.count > len(o.last):
            ops.pop(o.last[0][0], None)
        launches.append(ops)
    for oc in sorted(set.intersection(*(set(ops) for ops in launches))):
        if len({len(ops[oc]) for ops in launches}) > 1:
            continue
        for nth in range(len(launches[0][oc])):
            issued = {o.proc: ops[oc][nth] for o, ops in zip(single, launches, strict=True)}
            if len({sig for sig, _ in issued.values()}) > 1:
                return oc, issued
    return None


def _differ_at_the_end(single: list[OrphanOps]) -> tuple[int, Issued] | None:
    """With every line at opCount 0 nothing aligns but the end: the operation each process stopped in.  A difference
    there is a mismatch only when no side's operation is in another's window: a process behind (or ahead) stops in an
    operation its peers issued at another point."""
    issued = {o.proc: (o.last[-1][1], o.last[-1][2]) for o in single}
    if len({sig for sig, _ in issued.values()}) < 2:
        return None
    windows = {o.proc: {sig for _, sig, _ in o.last} for o in single}
    for o in single:
        mine = issued[o.proc][0]
        if any(mine in windows[other.proc] for other in single if issued[other.proc][0] != mine):
            return None
    return 0, issued
