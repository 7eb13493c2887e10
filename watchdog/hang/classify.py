"""The one classifier: a ``Snapshot`` in, a ``Decision`` out, live and offline alike.

``classify`` runs the stages in this order, each a table of rules (``rules``):

1. the job's finding (``job_rules.job_finding``): per communicator the
   sequence rules (``comm_rules.COMM_RULES``, the first that fires), weighed
   across communicators and refined by ``job_rules.JOB_RULES``; without any
   sequence, ``job_rules.UNSEQUENCED_RULES`` with partial evidence
   (``partial.PARTIAL_RULES``, the most severe);
2. a job that died, not hung: ``failure.FAILURE_RULES``, the first that fires,
   gives the decision (with its Xids);
3. what a running job shows (``live_rules.LIVE_RULES``, each in turn);
4. a pause: no rank inside communication, nothing decided (``paused``);
5. the finding's Xids and culprits' stack frames (``xid.with_xids``, ``with_where``);
6. a busy culprit, held to the progress timeout (``held_busy``);

and pages what is left when its verdict is a hang.  Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ncclwatch.watchdog.events import Stall
from ncclwatch.watchdog.hang.failure import failure_finding
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.live_rules import LIVE_RULES, UNDECIDED, Observed
from ncclwatch.watchdog.hang.rules import refined
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.stacks import IN_COMMUNICATION, Whereabouts
from ncclwatch.watchdog.hang.types import Decision, Fact, Finding
from ncclwatch.watchdog.hang.verdicts import HANG_VERDICTS, Verdict
from ncclwatch.watchdog.hang.xid import with_xids

BUSY_CPU_SHARE = 0.2  # of one core, over the last few seconds
BUSY_IO_BYTES_PER_S = 64 << 10  # a log line now and then is not a checkpoint
WAITING_KINDS = (*IN_COMMUNICATION, "gpu_wait")  # a rank spinning here burns CPU, but it waits: not a checkpoint


def classify(snapshot: Snapshot) -> Decision:
    finding = job_finding(snapshot)
    # A job that died, not hung (issue 44): why it failed, by the failure stage's own rules (hang.failure).
    if (died := failure_finding(snapshot, finding)) is not None:
        return Decision(with_xids(died, snapshot), page=died.verdict in HANG_VERDICTS)
    seen = Observed.of(snapshot)
    finding = refined(LIVE_RULES, seen, finding)
    if (pause := paused(seen, finding)) is not None:
        return pause
    finding = with_where(with_xids(finding, snapshot), seen.where)
    return held_busy(seen, finding) or Decision(finding, page=finding.verdict in HANG_VERDICTS)


def paused(seen: Observed, finding: Finding) -> Decision | None:
    """Nothing moved, no verdict, and no rank is inside communication: a pause (a checkpoint, an evaluation), paged as
    ``progress_stalled`` only past the progress timeout; where the probe could not see the ranks, it says so."""
    stall, where = seen.snapshot.stall, seen.where
    if stall is None or finding.verdict not in UNDECIDED or seen.communicating:
        return None
    unseen = sorted(r for r, w in where.items() if w.kind == "unknown")
    if unseen and finding.verdict == Verdict.inconclusive:
        return _blind(finding, stall, unseen)
    frames = "; ".join(f"rank {r}: {w.frame}" for r, w in sorted(where.items()) if w.frame)[:600]
    paused = Finding(
        verdict=Verdict.progress_stalled,
        summary=f"No rank has made progress for {stall.stalled_for_s:.0f} s and none is inside a collective "
        "(a checkpoint, an evaluation, a data stall, or a hang outside communication).",
        reason=f"Stacks: {frames}" if frames else "No rank is inside a collective.",
        evidence=finding.evidence,
        missing=finding.missing,
    )
    if stall.stalled_for_s >= stall.progress_timeout_s:
        return Decision(paused, page=True)
    return Decision(
        paused,
        page=False,
        held=f"no rank is inside a collective (a pause: checkpoint, evaluation?); progress_stalled is reported after "
        f"{stall.progress_timeout_s:.0f} s without progress",
    )


def _blind(finding: Finding, stall: Stall, unseen: list[int]) -> Decision:
    """Neither stacks nor Flight Recorder say where these ranks are: undecided, and said so."""
    ranks = ", ".join(map(str, unseen))
    undecided = Finding(
        verdict=Verdict.progress_stalled,
        summary=f"No rank has made progress for {stall.stalled_for_s:.0f} s and the probe could not see where rank "
        f"{ranks} is (no stack, no Flight Recorder dump): a hang or a pause cannot be told apart.",
        reason="py-spy or /proc was denied, or Flight Recorder did not answer; the evidence notes say which.",
        evidence=finding.evidence,
        missing=finding.missing + (f"where rank {ranks} is: py-spy needs CAP_SYS_PTRACE or the same user",),
    )
    page = stall.stalled_for_s >= stall.progress_timeout_s
    held = (
        None
        if page
        else f"cannot see where rank {ranks} is (stacks and Flight Recorder unavailable); "
        f"reported after {stall.progress_timeout_s:.0f} s without progress"
    )
    return Decision(undecided, page=page, held=held, blind=True)


def held_busy(seen: Observed, finding: Finding) -> Decision | None:
    """A rank the others wait for that is busy (CPU or I/O moving outside any wait: a checkpoint?) is held until the
    progress timeout instead of paging at the stall timeout."""
    stall = seen.snapshot.stall
    busy = _busy(finding.culprits, seen.snapshot, seen.where) if finding.verdict == Verdict.rank_behind else []
    if stall is None or not busy or stall.stalled_for_s >= stall.progress_timeout_s:
        return None
    return Decision(
        finding,
        page=False,
        held=f"rank {', '.join(map(str, busy))} keeps its peers waiting but is busy (CPU or I/O moving outside any "
        f"collective: a checkpoint?); reported after {stall.progress_timeout_s:.0f} s without progress",
    )


def _busy(culprits: tuple[int, ...], snapshot: Snapshot, where: Mapping[int, Whereabouts]) -> list[int]:
    """Culprits whose CPU time or I/O moved over the last few seconds, outside any wait.

    A rank spinning in a CUDA or NCCL wait burns a core too: its stack (a collective, a GPU
    wait) or Flight Recorder (an operation enqueued and not completed) says it is waiting.
    """
    communicating = _pending_in_flight_recorder(snapshot)
    return [
        w.rank
        for w in snapshot.workers
        if w.rank in culprits
        and w.rank not in communicating
        and where.get(w.rank, Whereabouts("unknown", None)).kind not in WAITING_KINDS
        and ((w.cpu_share or 0) >= BUSY_CPU_SHARE or (w.io_rate or 0) >= BUSY_IO_BYTES_PER_S)
    ]


def _pending_in_flight_recorder(snapshot: Snapshot) -> set[int]:
    return {
        rank.rank
        for comm in snapshot.comms
        if comm.source == "flight_recorder"
        for rank in comm.ranks
        if rank.completed is not None and rank.completed < rank.total
    }


def with_where(finding: Finding, where: Mapping[int, Whereabouts]) -> Finding:
    """Put each culprit's stack frame, and the user's own frame that led there, in the evidence (people look
    there first)."""
    mine = lambda w: f", from {w.user_frame}" if w.user_frame and w.user_frame != w.frame else ""
    extra = tuple(
        Fact("py-spy", f"rank {r}: {where[r].kind} at {where[r].frame}{mine(where[r])}")
        for r in finding.culprits
        if r in where
        and where[r].frame
        and not any(e.source == "py-spy" and e.fact.startswith(f"rank {r}:") for e in finding.evidence)
    )
    return replace(finding, evidence=extra + finding.evidence)
