"""Verdicts from what users hold after a hang: partial logs, PyTorch's own lines, network errors.

No complete NCCL log and no Flight Recorder dump: each rule below reads one
kind of partial evidence and returns a ``Finding`` only when that evidence
decides it; ``partial_finding`` asks every rule of ``PARTIAL_RULES`` and keeps
the most severe (``verdicts.PRIORITY``; the first of equals in the table's
order), and otherwise says ``inconclusive`` with exactly what it saw per rank and
which files or settings would decide it.

- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports: PyTorch compared fingerprints;
  the ranks whose own fingerprint differs from the majority are the culprits.
  A report names the first rank, in rank order, that differs from its author,
  so it places the ranks before that one too; an even split names its
  suspects, and the step the job repeats (its NCCL lines) decides it when
  one side's operation is never in it.
- a dead peer: ``Connection closed by remote peer X`` is a verdict about X,
  not about the rank that printed it; torchrun's summary names ranks that
  died on their own.
- PyTorch's watchdog lines per process group (``pg_status``): a rank that
  never enqueued the SeqNum its peers time out in is behind; ranks timing out
  in one SeqNum with different OpTypes or sizes issued different collectives;
  a rank waiting in a SeqNum its peer reports completed is the divergence,
  told with both SeqNums (a timeout line without a group id joins the only
  group the input names for that).
- an InfiniBand completion error names the peer and the adapter of a link.
- NCCL COLL lines without Init lines (``OrphanOps``), aligned by ``opCount``
  (a count, datatype or operation that differs at one opCount is a mismatch,
  opCount 0 included); with opCount 0 on every line, by the operation each
  process stopped in.  Culprits whose rank no prefix or file name gives are
  named as processes (``Finding.culprit_processes``: host:pid and the GPU of the line).

Failure mode, by design: one rank's view never names a culprit (its peers'
side is unknown), and sequence numbers of different groups are never compared.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace

from ncclwatch.watchdog.events import CollectiveFingerprint, NetworkError
from ncclwatch.watchdog.hang.partial_rules import (
    Facts,
    describe_network,
    network_finding,
    orphan_ops,
    process_groups,
    reporter,
    transport_mismatch,
)
from ncclwatch.watchdog.hang.rules import Rule, fired, first_fired, most_severe
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.step_pattern import learn_steps
from ncclwatch.watchdog.hang.types import Fact, Finding, RankStatus
from ncclwatch.watchdog.hang.verdicts import Verdict

TO_DECIDE = {
    "fr": "Flight Recorder dumps of every rank next time: "
    "TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_",
    "nccl": "NCCL debug files of every rank next time: "
    "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE=/shared/nccl/%h.%p",
    "detail": "TORCH_DISTRIBUTED_DEBUG=DETAIL to have PyTorch compare every collective across ranks "
    "(slower; for a reproduction)",
}


def partial_finding(snapshot: Snapshot) -> Finding | None:
    """The verdict from partial evidence: the most severe of ``PARTIAL_RULES``' findings, else ``inconclusive``
    with what each saw; None when there is no partial evidence at all."""
    facts = Facts.collect(snapshot)
    if facts.empty:
        return None
    found = fired(PARTIAL_RULES, facts)
    best = most_severe(found)
    if best is not None:
        return _with_context(best, facts)
    return _inconclusive(facts, found)


def strong_partial(snapshot: Snapshot) -> Finding | None:
    """Partial evidence that outranks an inconclusive sequence finding: the first of ``STRONG_PARTIAL_RULES`` that
    fires."""
    facts = Facts.collect(snapshot)
    found = first_fired(STRONG_PARTIAL_RULES, facts)
    return _with_context(found, facts) if found else None


def detail_mismatch(facts: Facts) -> Finding | None:
    """PyTorch's DETAIL fingerprints: the ranks whose fingerprint is the minority are the culprits.

    Each rank's description of itself is authoritative; the "but Rank k" side is decoded from a gathered
    buffer and is garbage when the two fingerprints differ in size, so it only stands in for ranks that
    left no report of their own.  PyTorch's check (``ProcessGroupWrapper``) compares the rank's own
    fingerprint with every rank's in rank order and reports the first that differs: a report by rank r
    naming rank k also says that ranks 0 .. k-1 run what r runs, and that k runs something else even
    where its side reads as garbage.  An even split names its suspects, and is decided by the job's own
    repeating step where the NCCL lines record one (``_pattern_decides``).
    """
    if not facts.fingerprints:
        return None
    placed = _placed_fingerprints(facts.fingerprints)
    if not placed:  # only unreadable sides of reports whose authors' own lines are not in the input
        return None
    kinds = Counter(key for key, _ in placed.values())
    (common, n_common), *rest = kinds.most_common()
    if not rest:  # every rank placed runs the same: the other side's report is not in the input
        ranks = sorted(placed)
        sample = next(fp for _, fp in placed.values() if fp is not None)
        return Finding(
            verdict=Verdict.collective_mismatch,
            summary="PyTorch (TORCH_DISTRIBUTED_DEBUG=DETAIL) detected mismatched collectives; "
            f"ranks {ranks} report {_fp_text(sample)}; "
            "the other side's report is not in the input.",
            reason="PyTorch checks every collective's fingerprint across ranks before running it "
            "and found a difference.",
            culprits=(),
            operation=_fp_text(sample),
            position=sample.seq,
            source="pytorch",
            evidence=tuple(
                Fact("pytorch", f"rank {fp.rank}: {_fp_text(fp)}", fp.cite)
                for _, fp in placed.values()
                if fp is not None
            )[:8],
            missing=("the logs of the other ranks, to tell which side departs",),
        )
    tie = rest[0][1] == n_common
    sides: dict[tuple, list[int]] = {}
    for rank, (key, _) in sorted(placed.items()):
        sides.setdefault(key, []).append(rank)
    culprits = () if tie else tuple(sorted(r for r, (key, _) in placed.items() if key != common))
    decided_by = _pattern_decides(sides, placed, facts.history) if tie and len(sides) == 2 else None
    if decided_by is not None:
        culprits, pattern = decided_by
    described = "; ".join(
        f"rank{'s' if len(m) > 1 else ''} {', '.join(map(str, m))}: {_side_text(placed, m)}" for m in sides.values()
    )
    own = [fp for _, fp in placed.values() if fp is not None]
    seq = next((fp.seq for fp in own if fp.seq), None)
    if culprits and decided_by is not None:
        how = (
            f"the ranks split evenly; the job's repeating step ({pattern}) "
            f"never issues what rank {', '.join(map(str, culprits))} issued"
        )
    elif culprits:
        how = f"ranks {list(culprits)} depart from the majority"
    else:
        how = "the ranks split evenly, so the fingerprints alone do not say which side is wrong"
    suspects = (
        "" if culprits else f" Suspects: {' or '.join(_ranks_text(m) for m in sides.values())} (one side departs)."
    )
    return Finding(
        verdict=Verdict.collective_mismatch,
        summary=f"Ranks issued different collectives at SeqNum {seq}: {described}.{suspects}",
        reason=f"PyTorch (TORCH_DISTRIBUTED_DEBUG=DETAIL) compared the collectives' fingerprints across ranks; {how}.",
        culprits=culprits,
        suspects=() if culprits else tuple(sorted(placed)),
        position=seq,
        operation=" vs ".join(_side_text(placed, m) for m in sides.values()),
        comm_label="the process group PyTorch checked (DETAIL reports name no group)",
        source="pytorch",
        evidence=tuple(
            Fact("pytorch", f"rank {fp.rank} runs {_fp_text(fp)}", fp.cite) for fp in sorted(own, key=lambda f: f.rank)
        )[:12],
        missing=()
        if culprits
        else ("the DETAIL reports of the other ranks: each names the first rank that differs from it",),
        rows=tuple(
            RankStatus(
                rank=r,
                host=None,
                pid=None,
                issued=seq,
                last_op=_side_text(placed, [r]),
                status="mismatch" if r in culprits else "suspect" if not culprits else "ok",
            )
            for r in sorted(placed)
        ),
    )


Placed = dict  # rank -> (fingerprint key, the fingerprint that says so; None where inferred or undecoded)


def _placed_fingerprints(fingerprints: list[CollectiveFingerprint]) -> Placed:
    """Every rank the reports place: its own report, then what a report infers (see ``detail_mismatch``)."""
    own = {fp.rank: fp for fp in fingerprints if fp.self_report}
    placed: Placed = {rank: (_fp_key(fp), fp) for rank, fp in own.items()}
    for fp in fingerprints:
        if fp.self_report or fp.rank in own:
            continue
        reporter = own.get(fp.reported_by)
        decoded = fp.shapes is not None or fp.dtypes is not None  # garbage reads as "SequenceNumber=0OpType=SCATTER"
        if decoded:
            placed.setdefault(fp.rank, (_fp_key(fp), fp))
        elif reporter is not None:
            placed.setdefault(fp.rank, (("differs from", reporter.rank), None))
        if reporter is not None:
            for earlier in range(fp.rank):
                placed.setdefault(earlier, (_fp_key(reporter), None))
    return placed


def _side_text(placed: Placed, ranks: list[int]) -> str:
    fp = next((placed[r][1] for r in ranks if placed[r][1] is not None), None)
    if fp is not None:
        return _fp_text(fp)
    key = placed[ranks[0]][0]
    return f"not what rank {key[1]} runs (its side of the report is unreadable)" if key[0] == "differs from" else "?"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# PyTorch's OpType -> the NCCL operation its COLL line prints (a barrier is a one-element all-reduce).
_NCCL_OP = {
    "ALLREDUCE": "AllReduce",
    "ALLREDUCE_COALESCED": "AllReduce",
    "BARRIER": "AllReduce",
    "BROADCAST": "Broadcast",
    "REDUCE": "Reduce",
    "ALLGATHER": "AllGather",
    "_ALLGATHER_BASE": "AllGather",
    "ALLGATHER_COALESCED": "AllGather",
    "REDUCE_SCATTER": "ReduceScatter",
    "_REDUCE_SCATTER_BASE": "ReduceScatter",
    "ALLTOALL": "AlltoAll",
    "ALLTOALL_BASE": "AlltoAll",
    "GATHER": "Gather",
    "SCATTER": "Scatter",
}


def _pattern_decides(
    sides: dict[tuple, list[int]], placed: Placed, history: tuple[str, ...]
) -> tuple[tuple[int, ...], str] | None:
    """An even split of two operations where the step the job repeats (its NCCL lines) issues one and never the other:
    the side that issued the other departs.  The recorded history must reach the mismatch (at least SeqNum - 1
    operations), or it is not the history before it.  None when nothing decides (both or neither in the step)."""
    ops = {}
    for key, ranks in sides.items():
        fp = next((placed[r][1] for r in ranks if placed[r][1] is not None), None)
        if fp is None or _NCCL_OP.get(fp.op) is None:
            return None
        ops[key] = (_NCCL_OP[fp.op], fp.seq, ranks)
    seqs = [seq for _, seq, _ in ops.values() if seq]
    if not seqs or len(history) < max(seqs) - 1:
        return None
    shape = learn_steps(history)
    if shape is None:
        return None
    outside = [ranks for op, _, ranks in ops.values() if op not in shape.counts]
    if len(outside) != 1:
        return None
    return tuple(sorted(outside[0])), f"{shape.period()}: {', '.join(sorted(map(str, shape.counts)))}"


def _fp_key(fp: CollectiveFingerprint) -> tuple:
    return (fp.op, fp.shapes, fp.dtypes)


def _fp_text(fp: CollectiveFingerprint) -> str:
    text = fp.op
    if fp.shapes is not None:
        text += f" shape [{fp.shapes}]"
    if fp.dtypes:
        text += f" {fp.dtypes}"
    return text


def dead_peer(facts: Facts) -> Finding | None:
    """A peer that closed its connections, or a rank torchrun saw die on its own."""
    closed = [e for e in facts.network if e.kind == "connection_closed" and e.peer]
    dead = facts.dead_ranks()
    if not closed and not dead:
        return None
    peers = Counter(e.peer_host for e in closed)
    culprits = set(dead)
    for host in peers:
        culprits |= {r for r, f in facts.failures_by_rank.items() if f.host == host and r in dead}
    evidence = [
        Fact(
            "torchrun",
            f"rank {r} exited with code {f.exitcode}{_signal_name(f.exitcode)} (pid {f.pid}, host {f.host})",
            f.cite,
        )
        for r, f in sorted(dead.items())
    ]
    evidence += [
        Fact("network", f"{reporter(e)} lost its connection to peer {e.peer}", e.cite)
        for e in _first_per(closed, lambda e: (e.peer, e.rank))
    ][:8]
    if peers:
        names = ", ".join(f"{host} ({n} report{'s' if n > 1 else ''})" for host, n in peers.most_common())
        summary = (
            f"Peer {names} closed its NCCL connections: "
            "its process most likely died (or its host dropped off the network)."
        )
        if culprits:
            summary = f"Rank {', '.join(map(str, sorted(culprits)))} died. " + summary
    else:
        summary = (
            f"Rank {', '.join(map(str, sorted(culprits)))} exited on its own while its peers waited; "
            "torchrun tore the job down."
        )
    return Finding(
        verdict=Verdict.process_dead,
        summary=summary,
        reason="A dead peer is the cause; "
        "the ranks that reported the closed connection or timed out were waiting for it.",
        culprits=tuple(sorted(culprits)),
        source="network" if peers else "torchrun",
        evidence=tuple(evidence),
        missing=()
        if culprits
        else ("which rank ran on the peer: the peer's own log, or torchrun's summary from its node",),
    )


PartialRule = Rule[Callable[[Facts], Finding | None]]
# Evidence strong enough to outrank aligned sequences that decide nothing (``job_rules.partial_decides``).
STRONG_PARTIAL_RULES: tuple[PartialRule, ...] = (
    Rule("detail_mismatch", detail_mismatch),
    Rule("transport_mismatch", transport_mismatch),
    Rule("dead_peer", dead_peer),
)
# The stage: every rule is asked, the most severe finding wins (the first of equals in this order).
PARTIAL_RULES: tuple[PartialRule, ...] = (
    *STRONG_PARTIAL_RULES,
    Rule("process_groups", process_groups),
    Rule("network_finding", network_finding),
    Rule("orphan_ops", orphan_ops),
)


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f" ({signal.Signals(-code).name})"
        except ValueError:
            return ""
    return ""


def _first_per(items: Iterable[NetworkError], key) -> list[NetworkError]:  # type: ignore[no-untyped-def]
    seen, out = set(), []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out


def _with_context(finding: Finding, facts: Facts) -> Finding:
    """Network errors and timeouts not already cited, as supporting evidence."""
    cited = {(e.cite.file, e.cite.line) for e in finding.evidence if e.cite}
    extra = [
        Fact("network", describe_network(e), e.cite) for e in facts.network if (e.cite.file, e.cite.line) not in cited
    ][:6]
    return replace(finding, evidence=finding.evidence + tuple(extra), rows=finding.rows or facts.rows())


def _inconclusive(facts: Facts, partial_views: list[Finding]) -> Finding:
    """What was seen per rank, and what would decide it."""
    seen = "; ".join(f.summary for f in partial_views) or facts.summary()
    missing = list(dict.fromkeys(m for f in partial_views for m in f.missing))
    absent = facts.absent_ranks()
    if absent:
        missing.insert(
            0,
            f"the logs of rank {', '.join(map(str, absent[:32]))}{' ...' if len(absent) > 32 else ''} "
            f"(of {facts.world}): the rank the others wait for may be among them",
        )
    elif facts.world is None:
        missing.insert(0, "the other ranks' logs (how many ranks the job had is not in the input)")
    if not facts.has_fr:
        missing.append(TO_DECIDE["fr"])
    if not facts.has_nccl:
        missing.append(TO_DECIDE["nccl"])
    evidence = tuple(e for f in partial_views for e in f.evidence)
    evidence += tuple(Fact("network", describe_network(e), e.cite) for e in facts.network[:6])
    return Finding(
        verdict=Verdict.inconclusive,
        summary=f"Not enough to name a culprit. Seen: {seen}",
        reason="Each fact below is one rank's own view; a verdict needs the other side of the collective.",
        evidence=evidence[:16],
        missing=tuple(dict.fromkeys(missing)),
        rows=facts.rows(),
    )
