"""The live verdict: the engine's finding, sharpened by what only a running job shows.

Called when nothing has moved for the stall timeout.  ``decide`` (the same
engine ``ncclwatch analyze`` runs) reads sequences, dumps and samples; this
adds process state, stacks and time:

- a worker in state ``T`` is ``process_stopped``; one that exited while its
  peers wait is ``process_dead``;
- a lead rank whose GPU runs a non-NCCL kernel while its peers spin in NCCL
  is ``gpu_compute_hang``;
- when sequences agree and no source says who is late, the rank whose stack
  is outside the collective its peers sit in is the lead;
- when no rank is inside a collective, the job is paused (checkpoint,
  evaluation): not a hang; ``progress_stalled`` only past the progress timeout;
- a rank the others wait for that is busy (CPU or I/O moving: writing a
  checkpoint while the others wait in a barrier) is held until the progress
  timeout instead of paging at the stall timeout.

Pure: snapshot, live view and settings in; a ``Decision`` out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.engine.detectors import HANG_VERDICTS, Evidence, Finding, Verdict
from ncclwatch.watchdog.live.job import LiveView
from ncclwatch.watchdog.engine.snapshot import Snapshot
from ncclwatch.watchdog.engine.stacks import Whereabouts, whereabouts
from ncclwatch.watchdog.engine.verdict import NCCL_SPIN, decide, lead_from_signatures, rank_signatures

BUSY_CPU_SHARE = 0.2  # of one core, over the last few seconds
BUSY_IO_BYTES_PER_S = 64 << 10  # a log line now and then is not a checkpoint
IDLE_SIGNATURES = ("idle", "unknown")


@dataclass(frozen=True)
class Decision:
    finding: Finding
    page: bool  # report and alert now
    held: str | None = None  # why a hang-like state is not paged yet


def classify(snapshot: Snapshot, view: LiveView, settings: Settings) -> Decision:
    where = {r.rank: whereabouts(snapshot.stacks.get(r.pid)) for r in view.ranks}
    rank_of_pid = {r.pid: r.rank for r in view.ranks}
    signatures = {rank: sig for rank, (sig, _) in rank_signatures(snapshot, rank_of_pid).items()}
    finding = decide(snapshot)
    special = _stopped(view, finding) or _dead(view, finding)
    if special is not None:
        return Decision(_with_where(special, where), page=True)
    if finding.verdict in (Verdict.no_hang, Verdict.inconclusive):
        # A rank is inside a collective when its stack says so or its GPU spins in NCCL.
        in_collective = sorted(r for r, w in where.items() if w.kind == "collective" or signatures.get(r) == NCCL_SPIN)
        if not in_collective:
            return _pause(finding, view, settings, where)
        finding = _stuck_from_stacks(finding, in_collective)
    if finding.verdict == Verdict.stuck_in_collective:
        if not finding.culprits:
            finding = lead_from_signatures(snapshot, finding, rank_of_pid)
        finding = _gpu_compute_hang(finding, signatures) or _lead_from_stacks(finding, where)
    finding = _with_where(finding, where)
    busy = _busy(finding.culprits, view) if finding.verdict == Verdict.rank_behind else []
    if busy and view.stalled_for < settings.progress_timeout:
        return Decision(
            finding,
            page=False,
            held=f"rank {', '.join(map(str, busy))} keeps its peers waiting but is busy (CPU or I/O moving: a checkpoint?); "
            f"reported after {settings.progress_timeout:.0f} s without progress",
        )
    return Decision(finding, page=finding.verdict in HANG_VERDICTS)


def _stopped(view: LiveView, finding: Finding) -> Finding | None:
    stopped = [r for r in view.ranks if r.state == "T" and not r.gone]
    if not stopped:
        return None
    ranks = ", ".join(f"{r.rank} (pid {r.pid})" for r in stopped)
    where = f" {finding.operation} (collective #{finding.position})" if finding.operation else " their next collective"
    return replace(
        finding,
        verdict=Verdict.process_stopped,
        culprits=tuple(r.rank for r in stopped),
        summary=f"Rank {ranks} is stopped (state T: SIGSTOP, or a debugger); its peers wait for it in{where}.",
        reason="A stopped process runs nothing, so its peers wait forever; send SIGCONT, or find who stopped it. "
        + (f"Engine: {finding.summary}" if finding.verdict in HANG_VERDICTS else ""),
        evidence=tuple(Evidence("procfs", f"rank {r.rank}: pid {r.pid} in state T") for r in stopped) + finding.evidence,
        missing=tuple(m for m in finding.missing if "which rank" not in m),
    )


def _dead(view: LiveView, finding: Finding) -> Finding | None:
    gone = [r for r in view.ranks if r.gone]
    alive = [r for r in view.ranks if not r.gone]
    if not gone or not alive:
        return None  # everyone ended: the job is over, not hung
    ranks = ", ".join(f"{r.rank} (pid {r.pid})" for r in gone)
    return replace(
        finding,
        verdict=Verdict.process_dead,
        culprits=tuple(r.rank for r in gone),
        summary=f"Rank {ranks} exited while ranks {', '.join(str(r.rank) for r in alive)} still wait; nothing has moved for "
        f"{view.stalled_for:.0f} s.",
        reason="A rank that ends without shutting its communicators down leaves its peers waiting forever.",
        evidence=tuple(Evidence("procfs", f"rank {r.rank}: pid {r.pid} has exited") for r in gone) + finding.evidence,
    )


def _gpu_compute_hang(finding: Finding, signatures: Mapping[int, str]) -> Finding | None:
    if not finding.culprits:
        return None
    lead = [signatures.get(r) for r in finding.culprits]
    peers = [sig for r, sig in signatures.items() if r not in finding.culprits]
    if not peers or any(s is None or s in IDLE_SIGNATURES or s == NCCL_SPIN for s in lead) or NCCL_SPIN not in peers:
        return None
    return replace(
        finding,
        verdict=Verdict.gpu_compute_hang,
        summary=f"Rank {', '.join(map(str, finding.culprits))}'s GPU is stuck in a non-NCCL kernel ({lead[0]}) while its peers "
        f"spin inside {finding.operation or 'the collective'}.",
        reason="Its NCCL kernel is queued behind a kernel that does not finish (a spinning user kernel, a deadlocked "
        "custom op): check the stack for the kernel launched before the collective.",
    )


def _stuck_from_stacks(finding: Finding, in_collective: list[int]) -> Finding:
    return replace(
        finding,
        verdict=Verdict.stuck_in_collective,
        summary=f"Nothing has moved and rank {', '.join(map(str, in_collective))} sit inside a collective (stacks, GPU "
        "signatures). " + finding.summary,
        missing=finding.missing + ("which operation: NCCL debug files or Flight Recorder dumps",),
    )


def _lead_from_stacks(finding: Finding, where: Mapping[int, Whereabouts]) -> Finding:
    """Sequences agree and nothing else names the lead: the rank outside the collective is it."""
    if finding.culprits:
        return finding
    inside = [r for r, w in where.items() if w.kind == "collective"]
    outside = [r for r, w in where.items() if w.kind == "python"]
    if not inside or not outside:
        return finding
    frames = "; ".join(f"rank {r}: {where[r].frame}" for r in outside[:4])
    return replace(
        finding,
        culprits=tuple(outside),
        reason=f"Ranks {', '.join(map(str, inside))} wait inside a collective while rank {', '.join(map(str, outside))} "
        f"is in Python elsewhere ({frames}): it is the lead.",
        evidence=finding.evidence + tuple(Evidence("py-spy", f"rank {r}: {w.kind} at {w.frame}") for r, w in sorted(where.items())),
    )


def _pause(finding: Finding, view: LiveView, settings: Settings, where: Mapping[int, Whereabouts]) -> Decision:
    frames = "; ".join(f"rank {r}: {w.frame}" for r, w in sorted(where.items()) if w.frame)[:600]
    paused = Finding(
        verdict=Verdict.progress_stalled,
        summary=f"No rank has made progress for {view.stalled_for:.0f} s and none is inside a collective "
        "(a checkpoint, an evaluation, a data stall, or a hang outside communication).",
        reason=f"Stacks: {frames}" if frames else "No rank is inside a collective.",
        evidence=finding.evidence,
        missing=finding.missing,
    )
    if view.stalled_for >= settings.progress_timeout:
        return Decision(paused, page=True)
    return Decision(
        paused,
        page=False,
        held=f"no rank is inside a collective (a pause: checkpoint, evaluation?); progress_stalled is reported after "
        f"{settings.progress_timeout:.0f} s without progress",
    )


def _busy(culprits: tuple[int, ...], view: LiveView) -> list[int]:
    """Culprits whose CPU time or I/O moved over the last few seconds."""
    return [
        r.rank
        for r in view.ranks
        if r.rank in culprits and ((r.cpu_share or 0) >= BUSY_CPU_SHARE or (r.io_rate or 0) >= BUSY_IO_BYTES_PER_S)
    ]


def _with_where(finding: Finding, where: Mapping[int, Whereabouts]) -> Finding:
    """Put each culprit's stack frame in the evidence (people look there first)."""
    extra = tuple(
        Evidence("py-spy", f"rank {r}: {where[r].kind} at {where[r].frame}")
        for r in finding.culprits
        if r in where and where[r].frame and not any(e.source == "py-spy" and e.fact.startswith(f"rank {r}:") for e in finding.evidence)
    )
    return replace(finding, evidence=extra + finding.evidence)
