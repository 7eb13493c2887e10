"""The live rules: what a running job shows refines the job's finding, live and offline alike.

``job_rules.job_finding`` weighs the sequences (NCCL logs, Flight Recorder
dumps, RAS) and job-wide evidence.  What a running job adds (process state,
stacks, GPU signatures, the stall's clock) is in the same snapshot: the live
sidecar folds it in as it probes, and ``ncclwatch analyze`` reads it back
from the run folder's journal or a bundle.  So ``LIVE_RULES`` apply, each in
turn, wherever their inputs exist:

- a dump not among the files given offline blames nobody;
- a worker in state ``T`` is ``process_stopped``; one that exited while its
  peers wait is ``process_dead`` (either ends the stage);
- with the stall's clock and no verdict yet, while some rank communicates:
  ranks all blocked on one side of a send/recv are a ``p2p_deadlock``; a
  rank in its own code while its peers wait in point-to-point ops is behind
  (it never posted its side); otherwise the job is stuck in a collective;
- a stuck collective: GPU signatures name the lead; a lead rank whose GPU
  runs a non-NCCL kernel while its peers spin in NCCL, or never started the
  collective its peers run, is ``gpu_compute_hang``; else the rank whose
  stack is outside the collective its peers sit in is the lead;
- a GPU hang whose GPU spins on one block with no NCCL operation running is
  of the ``spin`` kind;
- ranks "behind" that wait on their GPUs for ranks that ran ahead (a
  collective skipped or out of order), or that each block in ``recv`` (or
  ``send``) while every other rank waits in a collective for one of them:
  one rank that went on is the peer that never posted its side, several
  make the waiting ranks a ``p2p_deadlock``.

``classify`` runs the stages; the pause, the blind probe and the busy
culprit (decisions to hold a page) are its own.  Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from ncclwatch.watchdog.events import STOPPED_STATES, GpuSnapshot, OpState
from ncclwatch.watchdog.hang.comm_p2p import P2P_DEADLOCK_FIX
from ncclwatch.watchdog.hang.gpu_signatures import NCCL_SPIN, ONE_BLOCK_SPIN, lead_from_signatures, rank_signatures
from ncclwatch.watchdog.hang.rules import Rule
from ncclwatch.watchdog.hang.snapshot import CommView, RankView, Snapshot
from ncclwatch.watchdog.hang.stacks import IN_COMMUNICATION, Whereabouts, short_frame, whereabouts
from ncclwatch.watchdog.hang.types import Fact, Finding, RankStatus
from ncclwatch.watchdog.hang.verdicts import HANG_VERDICTS, Verdict

IDLE_SIGNATURES = ("idle", "unknown")
GPM_WINDOW_S = 1.0  # a GPU sample speaks for this long before its time (``probes/nvml.py``'s GPM window)
UNDECIDED = (Verdict.no_hang, Verdict.inconclusive)


@dataclass(frozen=True)
class Observed:
    """What the live rules read: the snapshot, where each rank's Python is (its stack) and what each rank's GPU is
    doing, each read once per classification."""

    snapshot: Snapshot
    where: Mapping[int, Whereabouts]
    signatures: Mapping[int, str]

    @classmethod
    def of(cls, snapshot: Snapshot) -> Observed:
        where = {w.rank: whereabouts(snapshot.stacks.get(w.pid)) for w in snapshot.workers}
        signatures = {rank: sig for rank, (sig, _) in rank_signatures(snapshot).items()}
        return cls(snapshot, where, signatures)

    @cached_property
    def communicating(self) -> list[int]:
        """Ranks inside communication: their stack says so or their GPU spins in NCCL."""
        return sorted(
            r for r, w in self.where.items() if w.kind in IN_COMMUNICATION or self.signatures.get(r) == NCCL_SPIN
        )

    def silent_undecided(self, finding: Finding) -> bool:
        """The stall's clock runs, the sequences decided nothing, and some rank communicates: the stacks decide."""
        return self.snapshot.stall is not None and finding.verdict in UNDECIDED and bool(self.communicating)


LiveRule = Rule[Callable[[Observed, Finding], Finding | None]]


def unblame_absent(seen: Observed, finding: Finding) -> Finding | None:
    """Offline, a dump that is not among the files given says nothing about its rank (only some nodes' files,
    say); only the live watchdog, which asked every rank, may read a missing dump as a rank that cannot answer.
    A journal makes the state live, but a rank that is none of its workers was never asked from there: one node's
    bundle of a two-wrapper job, analyzed alone, named the other node's ranks for leaving no dump."""
    snapshot = seen.snapshot
    known = {w.rank for w in snapshot.workers}
    unasked = [r for r in finding.absent if snapshot.stall is None or r not in known]
    if not unasked or set(finding.culprits) - set(unasked):
        return None
    ranks = ", ".join(map(str, finding.absent))
    return replace(
        finding,
        culprits=(),
        absent=(),
        summary=finding.summary.replace(
            f"rank {ranks} left no Flight Recorder dump.", f"no dump of rank {ranks} was given."
        ),
        reason="Every rank whose dump was given waits in the collective; the ranks not seen cannot be judged.",
        missing=finding.missing
        + (f"rank {ranks}: their Flight Recorder dumps (or the live watchdog's journal) would decide",),
    )


def stopped(seen: Observed, finding: Finding) -> Finding | None:
    """A worker in state T (SIGSTOP, a debugger) is the cause."""
    stopped = [w for w in seen.snapshot.workers if w.state in STOPPED_STATES and not w.gone]
    if not stopped:
        return None
    ranks = ", ".join(f"{w.rank} (pid {w.pid})" for w in stopped)
    where = f" {finding.operation} (collective #{finding.position})" if finding.operation else " their next collective"
    return replace(
        finding,
        verdict=Verdict.process_stopped,
        culprits=tuple(w.rank for w in stopped),
        summary=f"Rank {ranks} is stopped (state T: SIGSTOP, or a debugger); its peers wait for it in{where}.",
        reason="A stopped process runs nothing, so its peers wait forever; send SIGCONT, or find who stopped it. "
        + (f"Engine: {finding.summary}" if finding.verdict in HANG_VERDICTS else ""),
        evidence=tuple(Fact("procfs", f"rank {w.rank}: pid {w.pid} in state {w.state}") for w in stopped)
        + finding.evidence,
        missing=tuple(m for m in finding.missing if "which rank" not in m),
    )


def dead(seen: Observed, finding: Finding) -> Finding | None:
    """Ranks gone while others wait.  The first to go is the culprit: torchrun ends a failed rank's local peers
    (their node's part of the job) a moment after it, and another node's ranks wait for all of them."""
    snapshot = seen.snapshot
    gone = [w for w in snapshot.workers if w.gone]
    alive = [w for w in snapshot.workers if not w.gone]
    if not gone or not alive:
        return None  # everyone ended: the job is over, not hung
    first = min((w.gone_at for w in gone if w.gone_at is not None), default=None)
    dead = [w for w in gone if w.gone_at is None or first is None or w.gone_at == first]
    after = [w for w in gone if w not in dead]
    ranks = ", ".join(f"{w.rank} (pid {w.pid})" for w in dead)
    stalled = f"; nothing has moved for {snapshot.stall.stalled_for_s:.0f} s" if snapshot.stall else ""
    followed = ""
    if after and first is not None:
        later = max(w.gone_at for w in after if w.gone_at is not None) - first
        followed = (
            f" Rank {', '.join(str(w.rank) for w in after)} exited after it, within {later:.1f} s (torchrun ends a"
            " failed rank's peers on its node)."
        )
    return replace(
        finding,
        verdict=Verdict.process_dead,
        culprits=tuple(w.rank for w in dead),
        summary=f"Rank {ranks} exited while ranks {', '.join(str(w.rank) for w in alive)} still wait{stalled}."
        + followed,
        reason="A rank that ends without shutting its communicators down leaves its peers waiting forever.",
        evidence=tuple(Fact("procfs", f"rank {w.rank}: pid {w.pid} has exited") for w in dead + after)
        + finding.evidence,
    )


def gpu_compute_hang(seen: Observed, finding: Finding) -> Finding | None:
    """The lead's GPU runs a non-NCCL kernel while its peers spin in NCCL."""
    if finding.verdict != Verdict.stuck_in_collective or not finding.culprits:
        return None
    signatures = seen.signatures
    lead = [signatures.get(r) for r in finding.culprits]
    peers = [sig for r, sig in signatures.items() if r not in finding.culprits]
    if not peers or any(s is None or s in IDLE_SIGNATURES or s == NCCL_SPIN for s in lead) or NCCL_SPIN not in peers:
        return None
    return replace(
        finding,
        verdict=Verdict.gpu_compute_hang,
        summary=f"Rank {', '.join(map(str, finding.culprits))}'s GPU is stuck in a non-NCCL kernel ({lead[0]}) "
        "while its peers "
        f"spin inside {finding.operation or 'the collective'}.",
        reason="Its NCCL kernel is queued behind a kernel that does not finish (a spinning user kernel, a deadlocked "
        "custom op): check the stack for the kernel launched before the collective.",
    )


def stuck_from_stacks(seen: Observed, finding: Finding) -> Finding | None:
    """Nothing moved, the sequences decided nothing, and some rank sits inside a collective: stuck there."""
    if not seen.silent_undecided(finding):
        return None
    in_collective = seen.communicating
    return replace(
        finding,
        verdict=Verdict.stuck_in_collective,
        summary=f"Nothing has moved and rank {', '.join(map(str, in_collective))} sit inside a collective (stacks, GPU "
        "signatures). " + finding.summary,
        missing=finding.missing + ("which operation: NCCL debug files or Flight Recorder dumps",),
    )


def p2p_deadlock_from_stacks(seen: Observed, finding: Finding) -> Finding | None:
    """Every live rank blocked in the same side of a point-to-point call (all ``recv``, or all ``send``): nobody
    can post the side they wait for.  The sequences could not say it (gloo's Flight Recorder records no
    send/recv; NCCL's logs name the peers, and ``comm_rules`` reads those), so the stacks do."""
    if not seen.silent_undecided(finding):
        return None
    snapshot, where = seen.snapshot, seen.where
    alive = _alive(snapshot)
    waiting = _waiting_on_one_side(where, alive)
    if len(alive) < 2 or waiting is None or set(waiting[1]) != alive:
        return None
    side, ranks = waiting
    return _deadlocked(finding, snapshot, where, ranks, side, f"Each rank posted {side} first: {P2P_DEADLOCK_FIX}.")


def _deadlocked(
    finding: Finding, snapshot: Snapshot, where: Mapping[int, Whereabouts], ranks: list[int], side: str, reason: str
) -> Finding:
    callers = sorted({short_frame(where[r].user_frame) for r in ranks if where[r].user_frame})  # type: ignore[arg-type]
    called = f", called from {'; '.join(callers)}" if callers else ""
    return replace(
        finding,
        verdict=Verdict.p2p_deadlock,
        culprits=tuple(ranks),
        rows=_with_rows(finding, snapshot, {r: ("culprit", f"in {side}") for r in ranks}),
        summary=f"Point-to-point deadlock: rank {', '.join(map(str, ranks))} all wait in {side}{called}, so none "
        f"reaches the {_OTHER_SIDE[side]} its peer waits for.",
        reason=reason,
        evidence=finding.evidence + tuple(Fact("py-spy", f"rank {r}: {side} at {where[r].frame}") for r in ranks),
        missing=finding.missing + ("which peer each rank waits for: Flight Recorder with NCCL, or NCCL's debug lines",),
    )


_OTHER_SIDE = {"send": "recv", "recv": "send"}


def _alive(snapshot: Snapshot) -> set[int]:
    return {w.rank for w in snapshot.workers if not w.gone}


def _unseen(snapshot: Snapshot) -> list[int]:
    """The job's ranks that no input shows (one node's bundle alone), from the workers' world size."""
    world = max((w.world_size or 0 for w in snapshot.workers), default=0)
    return sorted(set(range(world)) - {w.rank for w in snapshot.workers})


def _waits_for_unseen(finding: Finding, where: Mapping[int, Whereabouts], unseen: list[int]) -> Finding | None:
    """The ranks "behind" wait in point-to-point operations and some of the job's ranks are in no input: the peer
    they wait for may be one of those, so neither they nor a rank seen here is named (pipeline x DP, one node's
    bundle alone: rank 3 waits in a recv for rank 0 on the other node; rank 2, the only other rank seen, was named
    as the one that never posted the send)."""
    if not all(where.get(r) and where[r].kind == "p2p" for r in finding.culprits):
        return None
    names = ", ".join(map(str, finding.culprits))
    absent = ("rank " if len(unseen) == 1 else "ranks ") + ", ".join(map(str, unseen[:16]))
    waits = f"a point-to-point operation ({_wait_frames(where, list(finding.culprits))})"
    return replace(
        finding,
        verdict=Verdict.inconclusive,
        culprits=(),
        summary=f"Rank {names} never entered {finding.operation or 'the collective'} (collective #{finding.position}) "
        f"because it waits in {waits} for a peer; {absent} of the job {'is' if len(unseen) == 1 else 'are'} in no "
        "input given, and that peer may be one of them.",
        reason=f"A rank that waits for its peer is not the cause; the peer is. Engine: {finding.summary}",
        evidence=finding.evidence
        + tuple(Fact("py-spy", f"rank {r}: p2p at {where[r].frame}") for r in finding.culprits),
        missing=finding.missing + (f"{absent}: no input (their bundle, dumps, stacks or logs)",),
    )


def _with_rows(finding: Finding, snapshot: Snapshot, status: Mapping[int, tuple[str, str]]) -> tuple[RankStatus, ...]:
    """The finding's rows with these ranks' (status, detail); a rank its communicator does not hold gets a row of
    its own: the leader's rows travel with its verdict, so every node's bundle then shows each rank the verdict is
    about (a data-parallel group's rows held ranks 2 and 3 only, one deadlocked rank of the pair missing)."""
    workers = {w.rank: w for w in snapshot.workers}
    rows = {row.rank: row for row in finding.rows}
    for rank, (state, detail) in status.items():
        worker = workers.get(rank)
        rows[rank] = replace(rows[rank], status=state, detail=detail) if rank in rows else RankStatus(
            rank=rank, host=worker.host if worker else None, pid=worker.pid if worker else None, issued=None,
            last_op=None, status=state, detail=detail,
        )  # fmt: skip
    return tuple(rows[r] for r in sorted(rows))


def _waiting_on_one_side(where: Mapping[int, Whereabouts], ranks: set[int]) -> tuple[str, list[int]] | None:
    """(side, ranks) when every one of ``ranks`` whose stack names a point-to-point side names the same one."""
    waiting = {r: w.side for r, w in where.items() if r in ranks and w.kind == "p2p" and w.side}
    sides = set(waiting.values())
    return (sides.pop(), sorted(waiting)) if len(sides) == 1 else None


def behind_peers_in_p2p(seen: Observed, finding: Finding) -> Finding | None:
    """Ranks wait in point-to-point ops (a pipeline schedule's batched wait, a ``recv``) while others are in their
    own code: those never posted the side their peers wait for.  gloo's Flight Recorder records no send/recv and a
    stack names no peer, so the ranks outside any communication are named (torch 2.13, Schedule1F1B: stage 0 in
    ``_wait_batch_p2p`` while stage 1 slept in the user's code read as a pause, paged after 30 minutes)."""
    if not seen.silent_undecided(finding):
        return None
    snapshot, where = seen.snapshot, seen.where
    waiting = [r for r, w in sorted(where.items()) if w.kind == "p2p"]
    behind = [r for r, w in sorted(where.items()) if w.kind == "python"]
    if not waiting or not behind:
        return None
    waiters, culprits = ", ".join(map(str, waiting)), ", ".join(map(str, behind))
    frames = "; ".join(f"rank {r}: {where[r].frame}" for r in behind[:4])
    return replace(
        finding,
        verdict=Verdict.rank_behind,
        culprits=tuple(behind),
        operation="send/recv",
        rows=_with_rows(
            finding,
            snapshot,
            {
                **{r: ("waiting", f"in {short_frame(where[r].frame)}") for r in waiting if where[r].frame},
                **{r: ("culprit", "in its own code") for r in behind},
            },
        ),  # fmt: skip
        summary=f"Rank {culprits} is in its own code ({frames}) while rank {waiters} waits in point-to-point "
        f"operations ({_wait_frames(where, waiting)}): it never posted the send or recv they wait for.",
        reason="Point-to-point operations are matched pairwise and nothing has moved: a rank that stays outside any "
        f"communication while its peers wait is behind. This backend records no peer of a send or recv, so rank "
        f"{culprits} (outside any communication) is named. Engine: {finding.summary}",
        evidence=finding.evidence + tuple(Fact("py-spy", f"rank {r}: p2p at {where[r].frame}") for r in waiting),
        missing=finding.missing + ("which peer each rank waits for: Flight Recorder with NCCL, or NCCL's debug lines",),
    )


def _wait_frames(where: Mapping[int, Whereabouts], ranks: list[int]) -> str:
    return "; ".join(sorted({short_frame(where[r].frame) for r in ranks if where[r].frame}))  # type: ignore[arg-type]


def p2p_wait_from_stacks(seen: Observed, finding: Finding) -> Finding | None:
    """Ranks "behind" in collectives that block in ``recv`` (or ``send``) are not late: they wait for a peer.

    Who can that peer be?  Not a rank waiting in a collective for one of them, unless it went on without
    posting its side (a pipeline stage that never sent its gradient back was paged as the stage waiting for
    it).  So, over the whole job (a communicator's rows show only its members): with exactly one rank
    outside the waiting ones, all blocked in collectives, that rank is the peer that never posted its side;
    with two or more ranks waiting on one side and more than one rank ahead, one missing send explains no
    wait: the waiting ranks wait for each other, a ``p2p_deadlock`` (2 x 2 gloo ranks, pipeline x data
    parallel on two nodes: ranks 1 and 2 both in ``recv`` first, their data-parallel peers 0 and 3 in the
    all-reduce, were paged ``rank_behind [1, 2]`` with the all-reduce over every rank, ``rank_behind [3]``,
    the only rank ahead in its group, with the all-reduce over each stage's).  gloo's Flight Recorder records
    no send/recv and a stack names no peer; NCCL's logs name the peer (``comm_rules``)."""
    if finding.verdict != Verdict.rank_behind or not finding.culprits:
        return None
    snapshot, where = seen.snapshot, seen.where
    if unseen := _unseen(snapshot):
        return _waits_for_unseen(finding, where, unseen)
    alive = _alive(snapshot)
    waiting = _waiting_on_one_side(where, alive)
    if waiting is None or not set(finding.culprits) <= set(waiting[1]):
        return None
    side, waiters = waiting
    others = sorted(alive - set(waiters))
    in_collective = {r for r in others if where.get(r) and where[r].kind == "collective"}
    in_collective |= {row.rank for row in finding.rows if row.rank in others and row.status == "waiting"}
    if set(others) != in_collective:
        return None  # a rank outside any wait may yet post the side they wait for
    if len(others) == 1:
        return _missing_side(finding, where, waiters, others[0], side)
    if len(waiters) < 2:
        return None
    names = ", ".join(map(str, waiters))
    went_on = f" in {finding.operation} (collective #{finding.position})" if finding.operation else ""
    ahead = (
        f" Rank {', '.join(map(str, others))} wait{went_on} for them: blaming those would take each of them having "
        f"skipped a {_OTHER_SIDE[side]}, while rank {names} posting {side} first to each other explains every wait."
        if others else ""
    )  # fmt: skip
    # The collective the others wait in is not where the deadlock is: the report names the waiting side.
    shown = {row.rank for row in finding.rows}
    rows = _with_rows(finding, snapshot, {r: ("waiting", f"in {short_frame(where[r].frame)}")
                                          for r in others if r not in shown and where[r].frame})  # fmt: skip
    return _deadlocked(
        replace(finding, comm_key=None, comm_label=None, position=None, operation=side, rows=rows),
        snapshot,
        where,
        waiters,
        side,
        f"Each of rank {names} posted {side} first: {P2P_DEADLOCK_FIX}.{ahead} This backend records no peer of a "
        f"send or recv, so which peer each waits for is not known. Engine: {finding.summary}",
    )


def _missing_side(
    finding: Finding, where: Mapping[int, Whereabouts], waiting: list[int], culprit: int, side: str
) -> Finding:
    """The one rank that went on to a collective without posting the side ``waiting`` wait for."""
    waiters = ", ".join(map(str, waiting))
    callers = sorted({short_frame(where[r].user_frame) for r in waiting if where[r].user_frame})  # type: ignore[arg-type]
    called = f" (called from {'; '.join(callers)})" if callers else ""
    went_on = f"{finding.operation} (collective #{finding.position})" if finding.operation else "its next collective"
    rows = tuple(replace(row, status="waiting", detail=f"in {side}") if row.rank in waiting
                 else replace(row, status="culprit", detail=f"in {went_on}") if row.rank == culprit else row
                 for row in finding.rows)  # fmt: skip
    return replace(
        finding,
        culprits=(culprit,),
        summary=f"Rank {culprit} never posted the {_OTHER_SIDE[side]} that rank {waiters} waits for in {side}{called}: "
        f"it went on to {went_on}, which rank {waiters} cannot reach.",
        reason="Point-to-point operations are matched pairwise; the rank that has not posted its side is at fault. "
        f"The only rank ahead of rank {waiters} is named: this backend records no peer of a send or recv. "
        f"Engine: {finding.summary}",
        evidence=finding.evidence + tuple(Fact("py-spy", f"rank {r}: {side} at {where[r].frame}") for r in waiting),
        rows=rows,
        missing=finding.missing + ("which peer each rank waits for: Flight Recorder with NCCL, or NCCL's debug lines",),
    )


def lead_from_stacks(seen: Observed, finding: Finding) -> Finding | None:
    """Sequences agree and nothing else names the lead: the rank outside the collective is it."""
    if finding.verdict != Verdict.stuck_in_collective or finding.culprits:
        return None
    where = seen.where
    inside = [r for r, w in where.items() if w.kind == "collective"]
    outside = [r for r, w in where.items() if w.kind == "python"]
    if not inside or not outside:
        return None
    frames = "; ".join(f"rank {r}: {where[r].frame}" for r in outside[:4])
    return replace(
        finding,
        culprits=tuple(outside),
        reason=f"Ranks {', '.join(map(str, inside))} wait inside a collective "
        f"while rank {', '.join(map(str, outside))} "
        f"is in Python elsewhere ({frames}): it is the lead.",
        evidence=finding.evidence
        + tuple(Fact("py-spy", f"rank {r}: {w.kind} at {w.frame}") for r, w in sorted(where.items())),
    )


def ran_ahead(seen: Observed, finding: Finding) -> Finding | None:
    """The ranks "behind" wait on their GPUs in their last collective, which the ranks ahead issued too but whose
    GPU never started it, held in an operation the others never reached: the ranks ahead departed from the order
    (a collective skipped, or issued out of order), and with NCCL their hosts ran on.

    H200, NCCL 2.28.9: a pipeline stage that skipped the loss all_reduce at step 200 issued nine more, which line up
    with its peer's pending one position for position, while its GPU sat in the next step's p2p group, which waits
    for that peer (paged ``rank_behind [0]``, the peer); FSDP2 x TP with rank 3 skipping: ranks 0-2 started in
    default-pg #201, rank 3 scheduled there and held in mesh_dp #1609 (``rank_behind [0, 1, 2]``).  A rank whose GPU
    runs no NCCL operation is left to ``never_started_on_gpu`` (a compute kernel that never ends)."""
    if finding.verdict != Verdict.rank_behind or not finding.culprits or finding.position is None:
        return None
    snapshot = seen.snapshot
    comm = _fr_comm(snapshot, finding)
    if comm is None or finding.position < 2:
        return None
    last = finding.position - 2  # 0-based: the behind ranks' last collective, where they wait
    states = {r.rank: r.state_at(last) for r in comm.ranks}
    ahead = sorted(r for r in states if r not in finding.culprits)
    if not ahead or any(states[r] != OpState.started for r in finding.culprits):
        return None
    if any(states[r] != OpState.scheduled for r in ahead) or not all(map(_GpuWaits(snapshot).holds, ahead)):
        return None
    names, waiting = ", ".join(map(str, ahead)), ", ".join(map(str, finding.culprits))
    sigs = (r.at(last) for r in comm.ranks if r.rank in finding.culprits)
    sig = next((s for s in sigs if s is not None), None)
    operation = sig.describe() if sig is not None else finding.operation
    status = {r: ("behind", f"never started #{last + 1} on its GPU") for r in ahead}
    status |= {r: ("waiting", f"waits in #{last + 1}") for r in finding.culprits}
    wait = "waits" if len(finding.culprits) == 1 else "wait"
    return replace(
        finding,
        culprits=tuple(ahead),
        position=last + 1,
        operation=operation,
        rows=_with_rows(finding, snapshot, status),
        summary=f"Rank {names} never started collective #{last + 1} ({operation or 'the collective'}) on its GPU, "
        f"which rank {waiting} {wait} in: it ran ahead, its GPU held by operations it issued after that its peers "
        "never reached.",
        reason="Flight Recorder: the ranks that issued fewer collectives are not behind in their code, they wait in "
        f"#{last + 1} (started); rank {names} issued it too, but its GPU never started it (scheduled) and waits in a "
        "later operation instead. It departed from the order its peers issue in: a collective skipped before "
        f"#{last + 1}, or issued out of order (with NCCL a call returns at enqueue, so its later ones line up with "
        f"the peers' pending one). Engine: {finding.summary}",
    )


def _fr_comm(snapshot: Snapshot, finding: Finding) -> CommView | None:
    """The finding's communicator as Flight Recorder shows it (its ops' states), if that is where it comes from."""
    return next((c for c in snapshot.comms if c.key == finding.comm_key and c.source == "flight_recorder"), None)


def _op_states(view: RankView) -> list[OpState]:
    """The states of every operation the rank's Flight Recorder view holds: collectives and point-to-point."""
    peers = (*view.sent.values(), *view.received.values())
    return [*(op.state for op in view.details.values()), *(s for p in peers for s in p.states.values())]


def never_started_on_gpu(seen: Observed, finding: Finding) -> Finding | None:
    """The lead enqueued the collective but its GPU never started it while the peers' GPUs did
    (Flight Recorder with timing): the kernel before it on the stream does not finish.

    Where that kernel is itself an NCCL operation the lead's GPU waits in, the lead is held, not hung: the rank its
    GPU waits for is followed to one whose GPU waits in none (4 x H200, FSDP2 x TP, rank 3's GPU in a kernel that
    never ends: rank 1 "never started" its TP all_reduce because its GPU sat in a DP all-gather with rank 3, and
    rank 1 was paged)."""
    if finding.verdict != Verdict.stuck_in_collective or not finding.culprits or finding.position is None:
        return None
    snapshot = seen.snapshot
    comm = _fr_comm(snapshot, finding)
    if comm is None:
        return None
    states = {r.rank: r.state_at(finding.position - 1) for r in comm.ranks}
    lead = [states.get(r) for r in finding.culprits]
    peers = [s for r, s in states.items() if r not in finding.culprits]
    # A peer that *completed* it proves the lead's GPU ran it too (a collective completes on no rank alone): the
    # lead's "scheduled" is a record behind the fact.  gloo's status lags like that (a sleeping rank read as last
    # completed #44 while past #46) and a CPU pause was paged as a GPU hang; only a peer still running it counts.
    if not peers or any(s != OpState.scheduled for s in lead) or not any(s == OpState.started for s in peers):
        return None
    graph = _GpuWaits(snapshot)
    roots = graph.roots(finding.culprits)
    if not roots:
        return None  # every GPU on the way waits in NCCL: no kernel of ours to blame
    if roots != list(finding.culprits):
        return _held_behind(snapshot, finding, graph, roots)
    ranks = ", ".join(map(str, finding.culprits))
    return replace(
        finding,
        verdict=Verdict.gpu_compute_hang,
        summary=f"Rank {ranks}'s GPU never started {finding.operation or 'the collective'} (#{finding.position}) "
        "that its "
        "peers' GPUs are running: a kernel queued before it does not finish.",
        reason="Flight Recorder (with timing) shows the collective scheduled on rank "
        f"{ranks} and started on its peers: the host enqueued it, the GPU stream is stuck on earlier work (a spinning "
        "or very long kernel, a deadlocked custom op). Check the stack for the kernel launched before the collective.",
    )


class _GpuWaits:
    """Which rank's GPU waits for which, from Flight Recorder's states: a GPU in an NCCL operation (``started``)
    waits for the peers whose GPUs have not started it.  Made where a rule needs it: one pass groups the views by
    rank; a rank's states are read when it is asked about (at 32,768 ranks a rule asks about a few)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._views: dict[int, list[tuple[CommView, RankView]]] = {}
        for comm in snapshot.comms:
            if comm.source == "flight_recorder":
                for view in comm.ranks:
                    self._views.setdefault(view.rank, []).append((comm, view))
        self._holds: dict[int, bool] = {}

    def records(self, rank: int) -> bool:
        """Does Flight Recorder speak for ``rank``?"""
        return rank in self._views

    def holds(self, rank: int) -> bool:
        """Does ``rank``'s GPU sit in an NCCL operation (a collective or p2p Flight Recorder saw start, not
        complete)?"""
        if rank not in self._holds:
            self._holds[rank] = any(OpState.started in _op_states(view) for _, view in self._views.get(rank, []))
        return self._holds[rank]

    @property
    def held(self) -> set[int]:
        """Every rank whose GPU sits in an NCCL operation."""
        return {rank for rank in self._views if self.holds(rank)}

    def waits_for(self, rank: int) -> dict[int, str]:
        """The ranks ``rank``'s GPU waits for, each with the operation it waits in."""
        waited: dict[int, str] = {}
        for comm, mine in self._views.get(rank, []):
            for position, op in mine.details.items():
                if op.state != OpState.started:
                    continue
                for peer in comm.ranks:
                    if peer is not mine and (peer.state_at(position) == OpState.scheduled or peer.total <= position):
                        sig = mine.at(position)
                        what = sig.describe() if sig is not None else "a collective"
                        waited.setdefault(peer.rank, f"{what} (#{position + 1} on {comm.label})")
            by_comm_rank = comm.by_comm_rank()
            for peer_rank, peer in (*mine.sent.items(), *mine.received.items()):
                if OpState.started in peer.states.values() and peer_rank in by_comm_rank:
                    waited.setdefault(by_comm_rank[peer_rank].rank, f"a send/recv on {comm.label}")
        return waited

    def roots(self, leads: tuple[int, ...]) -> list[int]:
        """The ranks at the end of the waits from ``leads``: GPUs that wait in no NCCL operation and whose hosts
        enqueued one (their stream is held by other work)."""
        seen, todo, roots = set(leads), list(leads), set()
        while todo:
            rank = todo.pop()
            if not self.holds(rank):
                if any(_enqueued(view) for _, view in self._views.get(rank, [])):
                    roots.add(rank)
                continue
            for peer in self.waits_for(rank):
                if peer not in seen:
                    seen.add(peer)
                    todo.append(peer)
        return sorted(roots)


def _held_behind(snapshot: Snapshot, finding: Finding, graph: _GpuWaits, roots: list[int]) -> Finding:
    """The lead's GPU waits in NCCL for ``roots``, whose GPUs run none of the NCCL work their hosts enqueued."""
    names, leads = ", ".join(map(str, roots)), ", ".join(map(str, finding.culprits))
    held = graph.held
    waits = [
        f"rank {r}'s GPU waits for rank {p} in {what}"
        for r in sorted(held)
        for p, what in sorted(graph.waits_for(r).items())
        if p in roots
    ]
    return _stream_held(
        snapshot,
        finding,
        roots,
        held,
        summary=f"Rank {names}'s GPU runs none of the NCCL operations its host enqueued; "
        f"{waits[0] if waits else f'rank {leads} waits for it'}: a kernel queued before them does not finish.",
        reason=f"Flight Recorder (with timing): rank {leads} never started {finding.operation or 'the collective'} "
        f"(#{finding.position}) that its peers run, because its GPU waits in another NCCL operation; following "
        f"what each GPU waits for ends at rank {names}, whose GPU started none of the NCCL work its host enqueued. "
        f"{'; '.join(waits)}. Its stream is held by earlier work (a spinning or very long kernel, a deadlocked custom "
        f"op): check the stack for the kernel launched before them. Engine: {finding.summary}",
    )


def stream_held_before_nccl(seen: Observed, finding: Finding) -> Finding | None:
    """No rank is named by the collective's states (every rank's is ``scheduled``), but Flight Recorder with timing
    shows a peer's GPU in an NCCL operation (``started``) of a communicator rank R belongs to, while R's GPU runs no
    NCCL operation at all though R's host enqueued some: a kernel queued before them on R's stream does not finish.

    2 x H200, pipelines (GPipe, 1F1B) whose rank 1 launched a kernel that never ends before its next send: rank 0's
    GPU sat in the recv from rank 1 (its coalesced group ``started``), rank 1's send and all after it ``scheduled``;
    NVML read both GPUs alike (a one-block kernel: NCCL's point-to-point and the spinning kernel), and the page was
    ``stuck_in_collective`` with no culprit on the loss all_reduce both had queued."""
    if finding.verdict != Verdict.stuck_in_collective or finding.culprits:
        return None
    snapshot = seen.snapshot
    recorded = [c for c in snapshot.comms if c.source == "flight_recorder"]
    held = _GpuWaits(snapshot).held
    stuck = sorted(
        {
            v.rank
            for c in recorded
            if any(u.rank in held for u in c.ranks)
            for v in c.ranks
            if v.rank not in held and _enqueued(v)
        }
    )
    if not stuck:
        return None
    names, waiting = ", ".join(map(str, stuck)), ", ".join(map(str, sorted(held)))
    return _stream_held(
        snapshot,
        finding,
        stuck,
        held,
        summary=f"Rank {names}'s GPU runs none of the NCCL operations its host enqueued, while rank {waiting}'s GPU "
        "waits in one with it: a kernel queued before them does not finish.",
        reason="Flight Recorder (with timing): the peers' GPUs started an operation of a communicator rank "
        f"{names} belongs to; rank {names} enqueued its own (scheduled) but its GPU started none, on any "
        "communicator. Its stream is held by earlier work (a spinning or very long kernel, a deadlocked custom op). "
        f"Check the stack for the kernel launched before them. Engine: {finding.summary}",
    )


def spinning(seen: Observed, finding: Finding) -> Finding | None:
    """The ``spin`` kind of a GPU hang: each culprit's GPU spins in a kernel on almost none of its SMs (NVML, on a
    GPU the rank has alone) and Flight Recorder shows no NCCL operation running on it, so the spin is not NCCL's: a
    kernel waiting on something that never comes.  A long compute kernel fills the SMs; this one proves the hang sooner
    (``judging.GPU_SPIN_SETTLED_S``)."""
    if finding.verdict != Verdict.gpu_compute_hang:
        return None
    snapshot = seen.snapshot
    fresh = _fresh_signatures(snapshot)
    if not finding.culprits or any(fresh.get(r) != ONE_BLOCK_SPIN for r in finding.culprits):
        return None
    waits = _GpuWaits(snapshot)
    if any(waits.holds(r) or not waits.records(r) for r in finding.culprits):
        return None
    return replace(finding, kind="spin")


def sampled_since(sample: GpuSnapshot, since: float) -> bool:
    """Does the GPU sample's window lie wholly after ``since`` (it speaks for GPM_WINDOW_S before its time)?"""
    return sample.time - GPM_WINDOW_S >= since


def _fresh_signatures(snapshot: Snapshot) -> dict[int, str]:
    """Signatures from GPU samples taken wholly within the silence the snapshot judges: the NVML source samples every
    few seconds, and its latest may show the GPU before the job fell silent.  None without a stall to judge."""
    stall = snapshot.stall
    if stall is None:
        return {}
    began = stall.at - stall.stalled_for_s
    fresh = tuple(g for g in snapshot.gpus if sampled_since(g, began))
    return {rank: sig for rank, (sig, _) in rank_signatures(replace(snapshot, gpus=fresh)).items()}


def _stream_held(
    snapshot: Snapshot, finding: Finding, stuck: list[int], held: set[int], summary: str, reason: str
) -> Finding:
    """``gpu_compute_hang`` of ``stuck``, whose GPUs run none of the NCCL work their hosts enqueued, while ``held``'s
    GPUs wait in NCCL operations."""
    status = {r: ("stuck", "its GPU runs none of the NCCL operations it enqueued") for r in stuck}
    status |= {r: ("waiting", "its GPU waits in an NCCL operation") for r in held}
    rows = _with_rows(finding, snapshot, status)
    return replace(
        finding, verdict=Verdict.gpu_compute_hang, culprits=tuple(stuck), rows=rows, summary=summary, reason=reason
    )


def _enqueued(view: RankView) -> bool:
    """Did the rank's host enqueue an NCCL operation its GPU has not started (a collective or point-to-point)?"""
    return OpState.scheduled in _op_states(view)


def lead_from_gpus(seen: Observed, finding: Finding) -> Finding | None:
    """A ``stuck_in_collective`` without a culprit: the rank whose GPU does something else than its peers' is the
    lead (``job_rules`` named one only where the sequences said "stuck"; the stacks may have said it since)."""
    if finding.verdict != Verdict.stuck_in_collective or finding.culprits:
        return None
    led = lead_from_signatures(seen.snapshot, finding)
    return led if led is not finding else None


# The stage: each rule in turn refines the job's finding, guarded by the verdict it refines; one marked ``last``
# that fires ends the stage.
LIVE_RULES: tuple[LiveRule, ...] = (
    Rule("unblame_absent", unblame_absent),
    Rule("stopped", stopped, last=True),
    Rule("dead", dead, last=True),
    # no verdict, nothing moved, some rank communicating: the stacks decide
    Rule("p2p_deadlock_from_stacks", p2p_deadlock_from_stacks),
    Rule("behind_peers_in_p2p", behind_peers_in_p2p),
    Rule("stuck_from_stacks", stuck_from_stacks),
    # stuck_in_collective: who leads, and is its GPU hung
    Rule("lead_from_gpus", lead_from_gpus),
    Rule("gpu_compute_hang", gpu_compute_hang),
    Rule("never_started_on_gpu", never_started_on_gpu),
    Rule("stream_held_before_nccl", stream_held_before_nccl),
    Rule("lead_from_stacks", lead_from_stacks),
    # gpu_compute_hang: the spin kind
    Rule("spinning", spinning),
    # rank_behind: the ranks named wait for others
    Rule("ran_ahead", ran_ahead, last=True),
    Rule("p2p_wait_from_stacks", p2p_wait_from_stacks),
)
