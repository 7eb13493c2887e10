"""The job's verdict: weigh every communicator's finding and job-wide evidence.

``decide`` picks the most telling communicator finding (``detectors``), then
lets evidence from outside the sequences sharpen it: a rank that died
(torchrun's failure summary, a peer's "Connection closed by localRank") turns
``rank_behind`` into ``process_dead``; GPU signatures name the lead rank of a
``stuck_in_collective`` when sequences cannot; a RAS report stands in when
there is nothing else.  Pure: a ``Snapshot`` in, a ``Finding`` out.
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import replace

from ncclwatch.watchdog.events import Citation, RasCommunicator, RasReport
from ncclwatch.watchdog.hang.detectors import analyze_comm, missing_send_behind_cycle, with_call_sites
from ncclwatch.watchdog.hang.partial import decide_partial, strong_partial
from ncclwatch.watchdog.hang.partial_rules import mismatch_facts
from ncclwatch.watchdog.hang.ras import judge_ras
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.stacks import IN_COMMUNICATION, whereabouts
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import HANG_VERDICTS, PRIORITY, Verdict

NCCL_SPIN = "multi-block kernel (NCCL spin)"
# A kernel that keeps the GPU busy on almost none of its SMs (0.76 % on H200): a spin, NCCL's point-to-point or a
# user kernel waiting on a flag; a real compute kernel fills the SMs or moves DRAM.
ONE_BLOCK_SPIN = "1-block kernel"


def decide(snapshot: Snapshot) -> Finding:
    findings = [analyze_comm(c) for c in snapshot.comms if c.ranks]
    if not findings:
        return _without_sequences(snapshot)
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
    best = with_call_sites(findings[0], findings[1:])
    if best.verdict == Verdict.inconclusive and (strong := strong_partial(snapshot)) is not None:
        return strong  # a DETAIL mismatch or a dead peer decides what aligned sequences could not
    corroborating = [
        Fact(f.source or "?", f"{f.comm_label}: {f.verdict.value}, culprits {list(f.culprits)} — {f.summary}")
        for f in findings[1:]
        if f.verdict in HANG_VERDICTS
    ]
    best = replace(
        best, evidence=best.evidence + tuple(corroborating[:8]), missing=best.missing + _missing_ranks(snapshot)
    )
    if best.verdict == Verdict.rank_behind:
        best = _upgrade_to_dead(snapshot, best)
    if best.verdict == Verdict.stuck_in_collective and not best.culprits:
        best = lead_from_signatures(snapshot, best)
    return _with_job_evidence(snapshot, best)


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


def _upgrade_to_dead(snapshot: Snapshot, finding: Finding) -> Finding:
    dead = _dead_ranks(snapshot)
    if not finding.culprits or not all(r in dead for r in finding.culprits):
        return finding
    names = ", ".join(map(str, finding.culprits))
    return replace(
        finding,
        verdict=Verdict.process_dead,
        summary=f"Rank {names} died: " + finding.summary,
        reason="The rank's process ended without shutting down NCCL, so its peers wait forever. " + finding.reason,
        evidence=tuple(dead[r] for r in finding.culprits) + finding.evidence,
    )


def gpu_signature(util_pct: float | None, sm_util_pct: float | None, dram_bw_pct: float | None = None) -> str:
    """Name what a GPU is doing from NVML (see NCCL-FACTS.md, measured on H200).

    NCCL's spin is a few blocks per channel (18 % of SMs with 24 channels on
    H200) moving no memory; a real compute kernel fills the SMs or moves
    DRAM, so a GPU busy with an evaluation is not mistaken for a collective.
    """
    if util_pct is None:
        return "unknown"
    if util_pct < 5:
        return "idle"
    if sm_util_pct is None:
        return "kernel resident"
    if sm_util_pct < 5:
        return ONE_BLOCK_SPIN
    if sm_util_pct >= 60 or (dram_bw_pct is not None and dram_bw_pct >= 5):
        return "compute kernel"
    return NCCL_SPIN


def rank_signatures(snapshot: Snapshot) -> dict[int, tuple[str, Citation]]:
    """Latest GPU signature per global rank, through the pid a GPU reports.

    NVML measures a whole device, so its signature speaks for a rank only on a GPU that runs that rank's process
    alone. On a shared GPU (several ranks, another job, MPS) it mixes everyone's kernels: on one H200 shared by
    five benchmark jobs, two ranks asleep in an evaluation pause read as "NCCL spin" from the other jobs' spinning
    collectives, and paged stuck_in_collective.
    """
    rank_of_pid = snapshot.rank_of_pid()
    signatures: dict[int, tuple[str, Citation]] = {}
    for snap in snapshot.gpus:
        for gpu in snap.gpus:
            if len(gpu.processes) != 1 or (rank := rank_of_pid.get(gpu.processes[0].pid)) is None:
                continue
            sm = gpu.gpm.sm_util_pct if gpu.gpm else None
            dram = gpu.gpm.dram_bw_util_pct if gpu.gpm else None
            signatures[rank] = (gpu_signature(gpu.util_gpu_pct, sm, dram), snap.cite)
    return signatures


def lead_from_signatures(snapshot: Snapshot, finding: Finding) -> Finding:
    """The rank whose GPU does something else than its peers' is the lead.

    A majority decides; with an even split (always, with two ranks) the ranks
    not spinning in a many-channel NCCL kernel are the lead: their peers wait
    for them inside the collective.
    """
    signatures = rank_signatures(snapshot)
    if len(signatures) < 2:
        return finding
    counts = Counter(sig for sig, _ in signatures.values())
    (common, n_common), *rest = counts.most_common()
    if not rest:
        return finding
    if n_common == rest[0][1]:
        if NCCL_SPIN not in counts:
            return finding
        common = NCCL_SPIN
    odd = sorted(r for r, (sig, _) in signatures.items() if sig != common)
    facts = tuple(Fact("nvml", f"rank {r}: GPU {sig}", c) for r, (sig, c) in sorted(signatures.items()))
    return replace(
        finding,
        culprits=tuple(odd),
        reason=(
            f"Every rank issued the same operations; the GPU of rank {', '.join(map(str, odd))} is doing something "
            f"else ({signatures[odd[0]][0]}) while the others show '{common}': it is the lead."
        ),
        evidence=finding.evidence + facts,
        missing=tuple(m for m in finding.missing if "which rank" not in m),
    )


def _with_job_evidence(snapshot: Snapshot, finding: Finding) -> Finding:
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
    return replace(finding, evidence=finding.evidence + tuple(extra))


def _without_sequences(snapshot: Snapshot) -> Finding:
    """No NCCL log and no Flight Recorder dump: partial evidence (``partial``), RAS, torchrun or nothing."""
    partial = decide_partial(snapshot)
    if partial is not None and partial.verdict != Verdict.inconclusive:
        return partial
    for report in snapshot.ras:
        for comm in report.communicators:
            finding = _from_ras(report, comm)
            if finding is not None:
                return finding
    if partial is not None:
        return partial
    dead = _dead_ranks(snapshot)
    if dead:
        ranks = tuple(sorted(dead))
        return Finding(
            verdict=Verdict.process_dead,
            summary=f"Rank {', '.join(map(str, ranks))} exited on its own; torchrun tore the job down.",
            reason="torchrun's failure summary names it; no NCCL log or Flight Recorder dump was given to say more.",
            culprits=ranks,
            evidence=tuple(dead.values()),
            missing=("NCCL logs or Flight Recorder dumps",),
        )
    return Finding(
        verdict=Verdict.inconclusive,
        summary="Nothing to align: no NCCL log, Flight Recorder dump or RAS report with operation counts was found.",
        missing=(
            "NCCL debug files (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL)",
            "Flight Recorder dumps",
            "an NCCL RAS report",
        ),
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
