"""The job-wide rules: every communicator's finding weighed, then what evidence from outside the sequences adds.

``job_finding`` asks the sequence rules (``comm_rules``) for each
communicator's finding and weighs them: the most telling one, by the
verdict's priority, a mismatch that names its culprit, a rank behind that
waits in nothing else, NCCL's logs over dumps.  Then ``JOB_RULES`` refine it
in turn (a rank that died turns ``rank_behind`` into ``process_dead``; GPU
signatures name the lead rank of a ``stuck_in_collective`` when sequences
cannot; PyTorch's, NCCL's and RAS's own lines are cited).  A job with no
sequence at all (no NCCL log, no Flight Recorder dump) is read by
``UNSEQUENCED_RULES`` instead, the first that fires: partial evidence
(``partial``), a RAS report, torchrun's failure summary.  Pure: a
``Snapshot`` in, a ``Finding`` out.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, replace

from ncclwatch.watchdog.events import RasCommunicator, RasReport
from ncclwatch.watchdog.hang.comm_collectives import with_call_sites
from ncclwatch.watchdog.hang.comm_p2p import missing_send_behind_cycle
from ncclwatch.watchdog.hang.comm_rules import comm_finding
from ncclwatch.watchdog.hang.gpu_signatures import lead_from_signatures
from ncclwatch.watchdog.hang.partial import partial_finding, strong_partial
from ncclwatch.watchdog.hang.partial_rules import mismatch_facts
from ncclwatch.watchdog.hang.ras import judge_ras
from ncclwatch.watchdog.hang.rules import Rule, first_fired, refined
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.stacks import IN_COMMUNICATION, whereabouts
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import HANG_VERDICTS, PRIORITY, Verdict


@dataclass(frozen=True)
class Weighed:
    """What the job-wide rules read: the job, and the communicators' findings less telling than the one refined."""

    snapshot: Snapshot
    others: tuple[Finding, ...]


def job_finding(snapshot: Snapshot) -> Finding:
    """The job's finding: the most telling communicator's, refined by ``JOB_RULES``; without any sequence, the
    first of ``UNSEQUENCED_RULES`` that fires."""
    findings = [comm_finding(c) for c in snapshot.comms if c.ranks]
    if not findings:
        found = first_fired(UNSEQUENCED_RULES, snapshot)
        assert found is not None, "nothing_to_align always gives a finding"
        return found
    ranked = _weigh(snapshot, findings)
    best = with_call_sites(ranked[0], ranked[1:])
    return refined(JOB_RULES, Weighed(snapshot, tuple(ranked[1:])), best)


def _weigh(snapshot: Snapshot, findings: list[Finding]) -> list[Finding]:
    """The communicators' findings, most telling first."""
    logs = [f for f in findings if f.source == "nccl_log"]
    if logs and all(f.verdict == Verdict.no_hang for f in logs):
        # NCCL logs run to the job's end; dumps are snapshots of a moment,
        # and ranks of a running job are always at slightly different points.
        findings = logs
    # A mismatch that names its culprit wins over one that cannot (one source's history may decide an even split
    # that the other's does not: Flight Recorder tells two all_reduces of one size apart by their lines).
    decided = lambda f: f.verdict == Verdict.collective_mismatch and bool(f.culprits)
    # A rank behind on one communicator that waits in a collective of another is held there, not the cause: FSDP2 +
    # TP on 2 x 2 gloo ranks, rank 3 asleep, rank 1 waits in its dp group's all_gather for rank 3 and so is "behind"
    # in its tp group, where rank 0 waits for it. Only what is pending decides: the rank waiting in nothing is named.
    # gloo records no send/recv, so a rank held in a pipeline's point-to-point wait shows it in its stack only (pipeline
    # x DP on 2 x 2 gloo ranks, rank 0 asleep: rank 3 waits in recv for it and is behind in its dp group, as rank 0
    # is in its own; which of the two was named followed the order the nodes' evidence came in).
    pending = _pending_collectives(snapshot)
    behind = {r for f in findings if f.verdict == Verdict.rank_behind for r in f.culprits}
    communicating = _communicating(snapshot, behind) if len(behind) > 1 else set()
    waits_elsewhere = lambda f: any(pending.get(r, set()) - {f.comm_key} or r in communicating for r in f.culprits)
    idle = lambda f: f.verdict == Verdict.rank_behind and not waits_elsewhere(f)
    findings.sort(
        key=lambda f: (PRIORITY[f.verdict], decided(f), idle(f), f.source == "nccl_log", bool(f.culprits)), reverse=True
    )
    if (counted := missing_send_behind_cycle(findings)) is not None:  # outranks the cycle it explains
        findings.remove(counted)
        findings.insert(0, counted)
    return findings


def _pending_collectives(snapshot: Snapshot) -> dict[int, set[str | None]]:
    """Rank -> the communicators where Flight Recorder shows it issued a collective that has not completed."""
    pending: dict[int, set[str | None]] = {}
    for comm in snapshot.comms:
        for rank in comm.ranks:
            if rank.completed is not None and rank.completed < rank.total:
                pending.setdefault(rank.rank, set()).add(comm.key)
    return pending


def _communicating(snapshot: Snapshot, ranks: set[int]) -> set[int]:
    """Those of ``ranks`` whose stack shows them waiting in communication (a collective, a send or a recv)."""
    return {
        w.rank
        for w in snapshot.workers
        if w.rank in ranks and whereabouts(snapshot.stacks.get(w.pid)).kind in IN_COMMUNICATION
    }


def _missing_ranks(snapshot: Snapshot) -> tuple[str, ...]:
    """Ranks a communicator has but no input showed: their side is unknown."""
    missing = []
    for comm in snapshot.comms:
        seen = {r.comm_rank for r in comm.ranks}
        absent = [r for r in range(comm.nranks) if r not in seen]
        if absent:
            what = "no log" if comm.source == "nccl_log" else "no dump"
            ranks = ", ".join(map(str, absent[:16])) + (" ..." if len(absent) > 16 else "")
            missing.append(f"{comm.label}: {what} for rank {ranks} (of {comm.nranks}); a culprit may hide there")
    return tuple(missing)


def _dead_ranks(snapshot: Snapshot) -> dict[int, Fact]:
    """Ranks that died on their own: torchrun's summary (not its teardown SIGTERM), peers' logs."""
    timed_out = {t.rank for t in snapshot.timeouts}
    dead: dict[int, Fact] = {}
    for failure in snapshot.failures:
        if failure.exitcode == -signal.SIGTERM or failure.rank in timed_out:
            continue  # torchrun's teardown of healthy ranks, or PyTorch's abort after a timeout
        if failure.root_cause or failure.exitcode != 0:
            dead.setdefault(
                failure.rank,
                Fact(
                    "torchrun",
                    f"rank {failure.rank} exited with code {failure.exitcode} (pid {failure.pid})",
                    failure.cite,
                ),
            )
    for closed in snapshot.peer_closed:
        for comm in snapshot.comms:
            comm_rank = comm.local_ranks.get((closed.proc.host, closed.local_rank))
            rank = next((r for r in comm.ranks if r.comm_rank == comm_rank), None)
            if rank is not None and rank.end is None:
                dead.setdefault(
                    rank.rank,
                    Fact(
                        "nccl_log",
                        f"a peer's NCCL proxy saw {rank.name}'s connection close (local rank {closed.local_rank})",
                        closed.cite,
                    ),
                )
    return dead


# --------------------------------------------------------------------------
# the rules, in JOB_RULES' order
# --------------------------------------------------------------------------


def partial_decides(job: Weighed, finding: Finding) -> Finding | None:
    """Aligned sequences that decide nothing give way to a DETAIL mismatch, NCCL's transport catching a mismatch, or
    a dead peer (``partial.strong_partial``), as it stands: the other rules refine sequence findings."""
    return strong_partial(job.snapshot) if finding.verdict == Verdict.inconclusive else None


def corroborated(job: Weighed, finding: Finding) -> Finding | None:
    """The other communicators' hang findings, and the ranks no input showed, beside the finding."""
    corroborating = [
        Fact(f.source or "?", f"{f.comm_label}: {f.verdict.value}, culprits {list(f.culprits)} — {f.summary}")
        for f in job.others
        if f.verdict in HANG_VERDICTS
    ]
    missing = _missing_ranks(job.snapshot)
    if not corroborating and not missing:
        return None
    return replace(finding, evidence=finding.evidence + tuple(corroborating[:8]), missing=finding.missing + missing)


def died(job: Weighed, finding: Finding) -> Finding | None:
    """A rank behind whose every culprit died on its own (torchrun's summary, a peer's log) is ``process_dead``."""
    if finding.verdict != Verdict.rank_behind:
        return None
    dead = _dead_ranks(job.snapshot)
    if not finding.culprits or not all(r in dead for r in finding.culprits):
        return None
    names = ", ".join(map(str, finding.culprits))
    return replace(
        finding,
        verdict=Verdict.process_dead,
        summary=f"Rank {names} died: " + finding.summary,
        reason="The rank's process ended without shutting down NCCL, so its peers wait forever. " + finding.reason,
        evidence=tuple(dead[r] for r in finding.culprits) + finding.evidence,
    )


def lead_from_gpus(job: Weighed, finding: Finding) -> Finding | None:
    """A ``stuck_in_collective`` without a culprit: the rank whose GPU does something else than its peers' is the
    lead (``gpu_signatures.lead_from_signatures``)."""
    if finding.verdict != Verdict.stuck_in_collective or finding.culprits:
        return None
    led = lead_from_signatures(job.snapshot, finding)
    return led if led is not finding else None


def job_evidence(job: Weighed, finding: Finding) -> Finding | None:
    """PyTorch's watchdog timeouts, NCCL's mismatch lines and warnings, RAS's complaints: cited beside the finding."""
    snapshot = job.snapshot
    extra: list[Fact] = []
    for timeout in snapshot.timeouts[:8]:
        extra.append(
            Fact(
                "pytorch",
                f"rank {timeout.rank}: PyTorch watchdog timed out in {timeout.op} (SeqNum {timeout.seq}) "
                f"after {timeout.ran_ms} ms",
                timeout.cite,
            )
        )
    mismatches = mismatch_facts(snapshot)  # with the ranks and sizes of the line
    extra += mismatches
    for warning in [w for w in snapshot.warnings if w.category != "other" and w.mismatch is None][:8]:
        extra.append(Fact("nccl_log", f"NCCL WARN ({warning.category}): {warning.message[:200]}", warning.cite))
    for report in snapshot.ras:
        for comm in report.communicators:
            if comm.status.upper() != "OK":
                text = "; ".join(comm.messages[:3])
                extra.append(Fact("ras", f"RAS {comm.label or comm.comm_hash}: {comm.status}. {text}", report.cite))
    return replace(finding, evidence=finding.evidence + tuple(extra)) if extra else None


# The stage: each rule in turn refines the most telling communicator's finding; ``partial_decides`` ends it.
JOB_RULES: tuple[Rule[Callable[[Weighed, Finding], Finding | None]], ...] = (
    Rule("partial_decides", partial_decides, last=True),
    Rule("corroborated", corroborated),
    Rule("died", died),
    Rule("lead_from_gpus", lead_from_gpus),
    Rule("job_evidence", job_evidence),
)


# --------------------------------------------------------------------------
# no sequence at all: UNSEQUENCED_RULES, the first that fires
# --------------------------------------------------------------------------


def partial_decided(snapshot: Snapshot) -> Finding | None:
    """Partial evidence (``partial``) that decides a verdict."""
    partial = partial_finding(snapshot)
    return partial if partial is not None and partial.verdict != Verdict.inconclusive else None


def ras_report(snapshot: Snapshot) -> Finding | None:
    """The first RAS communicator whose report says something about its ranks."""
    for report in snapshot.ras:
        for comm in report.communicators:
            finding = _from_ras(report, comm)
            if finding is not None:
                return finding
    return None


def torchrun_dead(snapshot: Snapshot) -> Finding | None:
    """Ranks torchrun's failure summary (or a peer's log) says died on their own."""
    dead = _dead_ranks(snapshot)
    if not dead:
        return None
    ranks = tuple(sorted(dead))
    return Finding(
        verdict=Verdict.process_dead,
        summary=f"Rank {', '.join(map(str, ranks))} exited on its own; torchrun tore the job down.",
        reason="torchrun's failure summary names it; no NCCL log or Flight Recorder dump was given to say more.",
        culprits=ranks,
        evidence=tuple(dead.values()),
        missing=("NCCL logs or Flight Recorder dumps",),
    )


def nothing_to_align(snapshot: Snapshot) -> Finding:
    """Nothing at all to read: says which inputs would decide."""
    return Finding(
        verdict=Verdict.inconclusive,
        summary="Nothing to align: no NCCL log, Flight Recorder dump or RAS report with operation counts was found.",
        missing=(
            "NCCL debug files (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL)",
            "Flight Recorder dumps",
            "an NCCL RAS report",
        ),
    )


# The stage without sequences: the first rule that fires; ``nothing_to_align`` always does.
UNSEQUENCED_RULES: tuple[Rule[Callable[[Snapshot], Finding | None]], ...] = (
    Rule("partial_decided", partial_decided),
    Rule("ras_report", ras_report),
    Rule("partial_undecided", partial_finding),
    Rule("torchrun_dead", torchrun_dead),
    Rule("nothing_to_align", nothing_to_align),
)


def _from_ras(report: RasReport, comm: RasCommunicator) -> Finding | None:
    judged = judge_ras(comm)
    if not judged.reasons and not judged.ahead:
        return None
    culprits = judged.culprits
    name = comm.comm_hash or comm.label
    said = "; ".join(f"rank {r}: {why}" for r, why in sorted(judged.reasons.items()))
    if judged.ahead and not culprits:
        ahead = ", ".join(map(str, judged.ahead))
        among = f"rank {', '.join(map(str, judged.suspects))}" if judged.suspects else "the others (RAS names none)"
        return Finding(
            verdict=Verdict.rank_behind,
            summary=f"NCCL RAS reports {comm.status} on communicator {name}: rank {ahead} launched one collective "
            f"more than all the others; the rank they wait for is among {among}." + (f" {said}" if said else ""),
            reason="RAS counts each rank's launched collectives: the few one ahead finished their part of the "
            "collective the others have not and launched the next, so they are not the culprits; RAS does not say "
            "which of those behind holds the others.",
            suspects=judged.suspects,
            comm_key=comm.comm_hash,
            comm_label=comm.label or comm.comm_hash,
            source="ras",
            evidence=tuple(Fact("ras", m, report.cite) for m in comm.messages[:6]),
            missing=(
                "which of the ranks behind is stuck: their stacks (py-spy dump), NCCL logs or Flight Recorder dumps",
            ),
        )
    return Finding(
        verdict=Verdict.collective_mismatch if comm.status.upper() == "MISMATCH" else Verdict.rank_behind,
        summary=f"NCCL RAS reports {comm.status} on communicator {name}: {said}",
        reason="RAS counts each rank's launched collectives; these ranks differ from the majority."
        if culprits
        else "RAS counts each rank's launched collectives; the ranks split evenly, so RAS alone cannot tell which "
        "side is wrong.",
        culprits=culprits,
        suspects=() if culprits else judged.suspects,
        comm_key=comm.comm_hash,
        comm_label=comm.label or comm.comm_hash,
        source="ras",
        evidence=tuple(Fact("ras", m, report.cite) for m in comm.messages[:6]),
        missing=("NCCL logs or Flight Recorder dumps, to name the operation and its position",),
    )
