"""Verdicts from what users hold after a hang: partial logs, PyTorch's own lines, network errors.

No complete NCCL log and no Flight Recorder dump: each rule below reads one
kind of partial evidence and returns a ``Finding`` only when that evidence
decides it; ``decide_partial`` keeps the most severe (``detectors.PRIORITY``),
and otherwise says ``inconclusive`` with exactly what it saw per rank and
which files or settings would decide it.

- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports: PyTorch compared fingerprints;
  the ranks whose own fingerprint differs from the majority are the culprits.
- a dead peer: ``Connection closed by remote peer X`` is a verdict about X,
  not about the rank that printed it; torchrun's summary names ranks that
  died on their own.
- PyTorch's watchdog lines per process group (``pg_status``): a rank that
  never enqueued the SeqNum its peers time out in is behind; ranks timing out
  in one SeqNum with different OpTypes or sizes issued different collectives.
- an InfiniBand completion error names the peer and the adapter of a link.
- NCCL COLL lines without Init lines (``OrphanOps``), aligned by ``opCount``.

Failure mode, by design: one rank's view never names a culprit (its peers'
side is unknown), and sequence numbers of different groups are never compared.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from ncclwatch.watchdog.engine.detectors import PRIORITY, Fact, Finding, RankStatus, Verdict
from ncclwatch.watchdog.engine.partial_rules import Facts, describe_network, judge_groups, judge_orphans, network_finding, reporter
from ncclwatch.watchdog.engine.snapshot import Snapshot
from ncclwatch.watchdog.events import CollectiveFingerprint, NetworkError

TO_DECIDE = {
    "fr": "Flight Recorder dumps of every rank next time: TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_",
    "nccl": "NCCL debug files of every rank next time: NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE=/shared/nccl/%h.%p",
    "detail": "TORCH_DISTRIBUTED_DEBUG=DETAIL to have PyTorch compare every collective across ranks (slower; for a reproduction)",
}


def decide_partial(snapshot: Snapshot) -> Finding | None:
    """The verdict from partial evidence; None when there is none at all."""
    facts = Facts.collect(snapshot)
    if facts.empty:
        return None
    candidates = [f for f in (detail_mismatch(facts), dead_peer(facts), *judge_groups(facts), network_finding(facts), judge_orphans(facts)) if f]
    decided = [f for f in candidates if f.verdict != Verdict.inconclusive]
    if decided:
        best = max(decided, key=lambda f: PRIORITY[f.verdict])  # first of equals: the order above
        return _with_context(best, facts)
    return _inconclusive(facts, [f for f in candidates if f.verdict == Verdict.inconclusive])


def strong_partial(snapshot: Snapshot) -> Finding | None:
    """Partial evidence that outranks an inconclusive sequence finding: a DETAIL mismatch or a dead peer."""
    facts = Facts.collect(snapshot)
    found = detail_mismatch(facts) or dead_peer(facts)
    return _with_context(found, facts) if found else None


def detail_mismatch(facts: Facts) -> Finding | None:
    """PyTorch's DETAIL fingerprints: the ranks whose own fingerprint is the minority are the culprits.

    Each rank's description of itself is authoritative; the "but Rank i"
    side is decoded from a gathered buffer and is garbage when the two
    fingerprints differ in size, so it only stands in for ranks that left no
    report of their own.
    """
    if not facts.fingerprints:
        return None
    own = {fp.rank: fp for fp in facts.fingerprints if fp.self_report}
    for fp in facts.fingerprints:
        decoded = fp.shapes is not None or fp.dtypes is not None  # garbage reads as "SequenceNumber=0OpType=SCATTER"
        if not fp.self_report and decoded and fp.rank not in own:
            own[fp.rank] = fp
    kinds = Counter(_fp_key(fp) for fp in own.values())
    if len(kinds) < 2:
        ranks = sorted(own)
        sample = next(iter(own.values()))
        return Finding(
            verdict=Verdict.collective_mismatch,
            summary=f"PyTorch (TORCH_DISTRIBUTED_DEBUG=DETAIL) detected mismatched collectives; ranks {ranks} report {_fp_text(sample)}; "
            "the other side's report is not in the input.",
            reason="PyTorch checks every collective's fingerprint across ranks before running it and found a difference.",
            culprits=(),
            operation=_fp_text(sample),
            position=sample.seq,
            source="pytorch",
            evidence=tuple(Fact("pytorch", f"rank {fp.rank}: {_fp_text(fp)}", fp.cite) for fp in own.values())[:8],
            missing=("the logs of the other ranks, to tell which side departs",),
        )
    (common, n_common), *rest = kinds.most_common()
    tie = bool(rest) and rest[0][1] == n_common
    culprits = () if tie else tuple(sorted(r for r, fp in own.items() if _fp_key(fp) != common))
    sides = {}
    for rank, fp in sorted(own.items()):
        sides.setdefault(_fp_key(fp), []).append((rank, fp))
    described = "; ".join(f"rank{'s' if len(m) > 1 else ''} {', '.join(str(r) for r, _ in m)}: {_fp_text(m[0][1])}" for m in sides.values())
    seq = next((fp.seq for fp in own.values() if fp.seq), None)
    how = (
        f"ranks {list(culprits)} depart from the majority"
        if culprits
        else "the ranks split evenly, so the fingerprints alone do not say which side is wrong"
    )
    return Finding(
        verdict=Verdict.collective_mismatch,
        summary=f"Ranks issued different collectives at SeqNum {seq}: {described}.",
        reason=f"PyTorch (TORCH_DISTRIBUTED_DEBUG=DETAIL) compared the collectives' fingerprints across ranks; {how}.",
        culprits=culprits,
        position=seq,
        operation=" vs ".join(_fp_text(m[0][1]) for m in sides.values()),
        comm_label="the process group PyTorch checked (DETAIL reports name no group)",
        source="pytorch",
        evidence=tuple(Fact("pytorch", f"rank {r} runs {_fp_text(fp)}", fp.cite) for r, fp in sorted(own.items()))[:12],
        rows=tuple(RankStatus(rank=r, host=None, pid=None, issued=fp.seq, last_op=_fp_text(fp), status="mismatch" if r in culprits else "ok") for r, fp in sorted(own.items())),
    )


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
    evidence = [Fact("torchrun", f"rank {r} exited with code {f.exitcode}{_signal_name(f.exitcode)} (pid {f.pid}, host {f.host})", f.cite) for r, f in sorted(dead.items())]
    evidence += [Fact("network", f"{reporter(e)} lost its connection to peer {e.peer}", e.cite) for e in _first_per(closed, lambda e: (e.peer, e.rank))][:8]
    if peers:
        names = ", ".join(f"{host} ({n} report{'s' if n > 1 else ''})" for host, n in peers.most_common())
        summary = f"Peer {names} closed its NCCL connections: its process most likely died (or its host dropped off the network)."
        if culprits:
            summary = f"Rank {', '.join(map(str, sorted(culprits)))} died. " + summary
    else:
        summary = f"Rank {', '.join(map(str, sorted(culprits)))} exited on its own while its peers waited; torchrun tore the job down."
    return Finding(
        verdict=Verdict.process_dead,
        summary=summary,
        reason="A dead peer is the cause; the ranks that reported the closed connection or timed out were waiting for it.",
        culprits=tuple(sorted(culprits)),
        source="network" if peers else "torchrun",
        evidence=tuple(evidence),
        missing=() if culprits else ("which rank ran on the peer: the peer's own log, or torchrun's summary from its node",),
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
    extra = [Fact("network", describe_network(e), e.cite) for e in facts.network if (e.cite.file, e.cite.line) not in cited][:6]
    return replace(finding, evidence=finding.evidence + tuple(extra), rows=finding.rows or facts.rows())


def _inconclusive(facts: Facts, partial_views: list[Finding]) -> Finding:
    """What was seen per rank, and what would decide it."""
    seen = "; ".join(f.summary for f in partial_views) or facts.summary()
    missing = list(dict.fromkeys(m for f in partial_views for m in f.missing))
    absent = facts.absent_ranks()
    if absent:
        missing.insert(0, f"the logs of rank {', '.join(map(str, absent[:32]))}{' ...' if len(absent) > 32 else ''} (of {facts.world}): the rank the others wait for may be among them")
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
