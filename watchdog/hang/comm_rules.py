"""The sequence rules: one communicator's aligned operations in, a ``Finding`` out.

Per communicator, the first rule of ``COMM_RULES`` that fires gives the
finding (``comm_finding``); the order is the table's:

1. ``collectives``: align every rank's collectives by position.  At the first
   position where ranks issued different operations -> ``collective_mismatch``
   (not where they issued one collective, recorded with other sizes, that
   Flight Recorder says every one completed, when they agree again after it);
   otherwise, if some ranks issued fewer -> ``rank_behind``.
2. point to point: a send r->p must meet the matching recv on p from r.
   Flight Recorder's counts are relative, so there only the order of the ops
   still pending is read: two ranks each first waiting in a recv from the
   other (``p2p_recv_cycle``), a rank waiting in a recv from a peer that went
   past its send (``p2p_recv_never_sent``); NCCL's logs count every send and
   recv, compared pairwise, never position by position (``p2p_log_pairs``).
3. ``completion``: every rank issued the same operations; Flight Recorder
   says whether the last completed (``stuck_in_collective`` / ``no_hang``);
   NCCL's log only says when the job shut its communicators down.  It always
   gives a finding.

The collectives rule lives in ``comm_collectives``, the point-to-point rules
in ``comm_p2p``, what they build findings with in ``comm_findings``;
``completion`` and the table are here.  ``job_rules.job_finding`` then weighs
the communicators against each other and against job-wide evidence.
"""

from __future__ import annotations

from collections.abc import Callable

from ncclwatch.watchdog.events import OpState
from ncclwatch.watchdog.hang.comm_collectives import check_collectives
from ncclwatch.watchdog.hang.comm_findings import comm_finding_of, names, op_fact, rank_rows
from ncclwatch.watchdog.hang.comm_p2p import p2p_log_pairs, p2p_recv_cycle, p2p_recv_never_sent
from ncclwatch.watchdog.hang.rules import Rule, first_fired
from ncclwatch.watchdog.hang.snapshot import CommView, RankView
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict


def check_completion(comm: CommView) -> Finding:
    """Every rank issued the same operations: did the last one complete?"""
    ranks = list(comm.ranks)
    total = max((r.total for r in ranks), default=0)
    if ranks and all(r.end == "destroy" for r in ranks):
        return comm_finding_of(
            comm,
            Verdict.no_hang,
            summary=f"Every rank issued the same {total} collectives on {comm.label} and destroyed it cleanly.",
            evidence=tuple(Fact(comm.source, f"{r.name} destroyed the communicator", r.end_cite) for r in ranks[:4]),
            rows=rank_rows(comm, lambda r: ("ok", "destroyed")),
        )
    if comm.source == "flight_recorder":
        return _fr_completion(comm, ranks, total)
    aborted = [r for r in ranks if r.end == "abort"]
    if aborted:
        return comm_finding_of(
            comm,
            Verdict.stuck_in_collective,
            summary=(
                f"Every rank issued the same {total} collectives on {comm.label}, and {names(aborted)} aborted it: "
                "an operation did not complete (PyTorch's watchdog aborts on timeout)."
            ),
            reason="Sequences agree; nothing in NCCL's log names a lead rank.",
            position=total or None,
            operation=(ranks[0].at(total - 1).describe() if total and ranks[0].at(total - 1) else None),
            evidence=tuple(Fact(comm.source, f"{r.name} aborted the communicator", r.end_cite) for r in aborted),
            missing=("which rank stalled first: add Flight Recorder dumps, py-spy stacks or NVML samples",),
        )
    return comm_finding_of(
        comm,
        Verdict.inconclusive,
        summary=f"Every rank issued the same {total} collectives on {comm.label}; "
        "the log does not say whether the last completed.",
        reason="NCCL logs an operation when it is enqueued, never when it completes, "
        "and no rank shut the communicator down.",
        missing=("completion state: a Flight Recorder dump, or the live watchdog's timing",),
        rows=rank_rows(comm, lambda r: ("?", "no end line")),
    )


def _fr_completion(comm: CommView, ranks: list[RankView], total: int) -> Finding:
    pending = [r for r in ranks if r.completed is not None and r.completed < r.total]
    if not pending and (unseen := [r for r in ranks if r.unrecorded]):
        return comm_finding_of(
            comm,
            Verdict.inconclusive,
            summary=f"Flight Recorder shows all {total} collectives on {comm.label} completed on every rank, but "
            f"{names(unseen)} issued {max(r.unrecorded for r in unseen)} operations "
            f"{'its dump does' if len(unseen) == 1 else 'their dumps do'} not hold: gloo's "
            "Flight Recorder records no send or recv, and a rank waiting in one looks idle here.",
            reason="Nothing recorded is pending; the operations not recorded cannot be judged.",
            missing=("which send or recv each rank waits in: py-spy stacks (the live watchdog's bundle has them)",),
            rows=rank_rows(comm, lambda r: ("?", f"all recorded completed; {r.unrecorded} not recorded")),
        )
    if not pending:
        return comm_finding_of(
            comm,
            Verdict.no_hang,
            summary=f"Flight Recorder shows all {total} collectives on {comm.label} completed on every rank: "
            "nothing is pending." + (_older_dumps(ranks, total) if any(r.total < total for r in ranks) else ""),
            rows=rank_rows(comm, lambda r: ("ok", "all completed")),
        )
    if (lagging := _completed_elsewhere(comm, ranks, pending)) is not None:
        return lagging
    position = min(r.completed or 0 for r in pending)
    states = {r.comm_rank: r.state_at(position) for r in ranks}
    not_started = [r for r in ranks if states[r.comm_rank] == OpState.scheduled]
    started = [r for r in ranks if states[r.comm_rank] in (OpState.started, OpState.completed)]
    lead = not_started if started and not_started else []
    silent = [r for r in range(comm.nranks) if r not in {x.comm_rank for x in ranks}]
    if silent and len(pending) == len(ranks):
        # Dumps are written by a background thread, so a rank stuck in Python
        # still answers; one that cannot is stopped or dead, and every rank
        # that answered is waiting.
        return _silent_ranks(comm, ranks, silent, position)
    sig = pending[0].at(position)
    evidence = [
        op_fact(comm, r, position, f"{r.name}: collective #{position + 1} is {states[r.comm_rank] or 'absent'}")
        for r in ranks
    ]
    reason = (
        f"{names(lead)} never started the collective its peers are running (Flight Recorder: scheduled vs started)."
        if lead
        else "Every rank enqueued it and none finished; Flight Recorder does not say who is late."
    )
    return comm_finding_of(
        comm,
        Verdict.stuck_in_collective,
        summary=f"Collective #{position + 1} ({sig.describe() if sig else '?'}) on {comm.label} was issued by "
        "every rank and never completed.",
        reason=reason,
        culprits=tuple(sorted(r.rank for r in lead)),
        position=position + 1,
        operation=sig.describe() if sig else None,
        evidence=tuple(evidence),
        missing=()
        if lead
        else ("which rank is late: 'started' states need TORCH_NCCL_ENABLE_TIMING=1; or add NVML samples / stacks",),
        # the call site of the collective each rank is in (Flight Recorder's frames)
        rows=rank_rows(comm, lambda r: (str(states[r.comm_rank] or "?"), f"completed {r.completed}"), position),
    )


# Collectives in which every rank contributes before any rank's part can complete: completed on one rank, every
# rank's part of it ran.  (Not a broadcast, reduce, gather or scatter: a root or a sender may finish first.)
_EVERY_RANK_FIRST = frozenset({"AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Barrier"})


def _completed_elsewhere(comm: CommView, ranks: list[RankView], pending: list[RankView]) -> Finding | None:
    """No rank waits on this communicator when each op a rank has not completed is one that another rank completed
    and that completes on no rank alone: its record lags (gloo marks a collective completed after its work is done;
    NCCL's watchdog polls the GPU), its part is done.  Two wrappers of gloo ranks, every rank asleep in a checkpoint-
    like pause: rank 2's dump held DDP's all-reduce #54 'scheduled' while ranks 0, 1 and 3 had it 'completed' and
    rank 2 itself was in the pause past it; it was paged as stuck_in_collective, rank 2 never started it."""
    lags: list[tuple[RankView, int]] = []
    for rank in pending:
        for position in range(rank.completed or 0, rank.total):
            if rank.state_at(position) == OpState.completed:
                continue
            sig = rank.at(position)
            done = any(r is not rank and r.state_at(position) == OpState.completed for r in ranks)
            if sig is None or sig.op not in _EVERY_RANK_FIRST or not done:
                return None
            lags.append((rank, position))
    if not lags:
        return None
    shown = "; ".join(f"{r.name}'s #{p + 1}" for r, p in lags[:4]) + (" ..." if len(lags) > 4 else "")
    return comm_finding_of(
        comm,
        Verdict.no_hang,
        summary=f"Nothing waits on {comm.label}: the only collectives a rank has not recorded as completed ({shown}) "
        "completed on another rank, and such a collective completes on no rank before every rank's part has run.",
        reason="A rank's record lags its work: its dump was taken before the completion was recorded.",
        evidence=tuple(
            op_fact(comm, r, p, f"{r.name}: collective #{p + 1} is {r.state_at(p)}, completed on another rank")
            for r, p in lags[:4]
        ),
        rows=rank_rows(comm, lambda r: ("ok", f"completed {r.completed}")),
    )


def _older_dumps(ranks: list[RankView], total: int) -> str:
    """Dumps of a running job taken at different moments: the newest holds collectives the others' do not yet."""
    newest = [r for r in ranks if r.total == total]
    low, high = min(r.total for r in ranks), max(r.total for r in ranks if r.total < total)
    held = str(low) if low == high else f"{low}-{high}"
    return (
        f" The dump of {names(newest)} is the newest; the others' were taken earlier (they hold {held} "
        "collectives), and a collective completes on no rank alone."
    )


def _silent_ranks(comm: CommView, ranks: list[RankView], silent: list[int], position: int) -> Finding:
    sig = ranks[0].at(position)
    members = comm.members
    culprits = tuple(members[r] if r < len(members) else r for r in silent)
    return comm_finding_of(
        comm,
        Verdict.stuck_in_collective,
        summary=(
            f"Every rank that answered waits in collective #{position + 1} ({sig.describe() if sig else '?'}) "
            f"on {comm.label}; rank {', '.join(map(str, culprits))} left no Flight Recorder dump."
        ),
        reason="A rank stuck in Python still dumps (a background thread writes it); "
        "one that cannot is stopped or dead.",
        culprits=culprits,
        position=position + 1,
        operation=sig.describe() if sig else None,
        evidence=tuple(
            op_fact(comm, r, position, f"{r.name}: collective #{position + 1} is {r.state_at(position)}") for r in ranks
        ),
        missing=(f"Flight Recorder dumps of rank {', '.join(map(str, culprits))}",),
        absent=culprits,
    )


# The stage: the first rule that fires gives the communicator's finding; ``completion`` always does.
COMM_RULES: tuple[Rule[Callable[[CommView], Finding | None]], ...] = (
    Rule("collectives", check_collectives),
    Rule("p2p_recv_cycle", p2p_recv_cycle),
    Rule("p2p_recv_never_sent", p2p_recv_never_sent),
    Rule("p2p_log_pairs", p2p_log_pairs),
    Rule("completion", check_completion),
)


def comm_finding(comm: CommView) -> Finding:
    """The communicator's finding: the first rule of ``COMM_RULES`` that fires."""
    found = first_fired(COMM_RULES, comm)
    assert found is not None, "completion always gives a finding"
    return found
