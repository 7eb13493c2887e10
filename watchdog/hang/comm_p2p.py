"""The point-to-point sequence rules: a send r->p must meet the matching recv on p from r.

Flight Recorder's counts are relative, so there only the order of the ops still pending is read: two ranks each
first waiting in a recv from the other (``p2p_recv_cycle``), a rank waiting in a recv from a peer that went past
its send (``p2p_recv_never_sent``); NCCL's logs count every send and recv, compared pairwise, never position by
position (``p2p_log_pairs``).  Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ncclwatch.watchdog.events import Citation, OpSig, OpState
from ncclwatch.watchdog.hang.comm_findings import comm_finding_of
from ncclwatch.watchdog.hang.snapshot import CommView, PeerView, RankView
from ncclwatch.watchdog.hang.stacks import short_frame, user_frame
from ncclwatch.watchdog.hang.types import Fact, Finding, OpRef
from ncclwatch.watchdog.hang.verdicts import Verdict


@dataclass(frozen=True)
class _P2pWait:
    """``waiter`` posted its side; ``culprit`` never posted the matching ``missing`` (its #``index``)."""

    waiter: RankView
    culprit: RankView
    missing: Literal["Send", "Recv"]
    index: int
    sig: OpSig | None


def p2p_log_pairs(comm: CommView) -> Finding | None:
    """NCCL's logs: sends r->p against recvs on p from r, counted per pair.

    A mismatch in size or type wins; then a rank waiting on a peer that never posted its side.
    When those waits form a cycle (both ranks recv first), it is a ``p2p_deadlock``: no rank is
    behind, the program's order is wrong.
    """
    if comm.source != "nccl_log":
        return None
    ranks = comm.by_comm_rank()
    waits: list[_P2pWait] = []
    for sender in comm.ranks:
        for peer, sends in sender.sent.items():
            receiver = ranks.get(peer)
            if receiver is None:
                continue
            recvs = receiver.received.get(sender.comm_rank, PeerView(0, 0, (), {}, {}))
            found = _compare_pair(comm, sender, receiver, sends, recvs)
            if isinstance(found, Finding):
                return found
            if found is not None:
                waits.append(found)
    for receiver in comm.ranks:
        for peer, recvs in receiver.received.items():
            sender = ranks.get(peer)
            if sender is not None and receiver.comm_rank not in sender.sent and recvs.count:
                waits.append(_P2pWait(receiver, sender, "Send", 0, recvs.sigs[0] if recvs.sigs else None))
    if not waits:
        return None
    return _p2p_deadlock(comm, waits) or _p2p_behind(comm, waits[0])


def _compare_pair(
    comm: CommView, sender: RankView, receiver: RankView, sends: PeerView, recvs: PeerView
) -> Finding | _P2pWait | None:
    first = max(sends.base, recvs.base)
    last = min(sends.count, recvs.count)
    for index in range(first, last):
        s, r = sends.sigs[index - sends.base], recvs.sigs[index - recvs.base]
        if (s.count, s.dtype) != (r.count, r.dtype):
            return comm_finding_of(
                comm,
                Verdict.collective_mismatch,
                summary=(
                    f"Point-to-point #{index + 1} from {sender.name} to {receiver.name} on {comm.label} "
                    f"does not match: send count={s.count} dtype={s.dtype}, recv count={r.count} dtype={r.dtype}."
                ),
                reason="A send and its matching recv must agree on size and type.",
                culprits=tuple(sorted({sender.rank, receiver.rank})),
                operation=s.describe(),
                evidence=(
                    _p2p_evidence(
                        comm,
                        sender,
                        "Send",
                        receiver.comm_rank,
                        index,
                        f"{sender.name} send #{index + 1}: {s.describe()}",
                    ),
                    _p2p_evidence(
                        comm,
                        receiver,
                        "Recv",
                        sender.comm_rank,
                        index,
                        f"{receiver.name} recv #{index + 1}: {r.describe()}",
                    ),
                ),
            )
    if sends.count > recvs.count:
        return _P2pWait(
            sender,
            receiver,
            "Recv",
            recvs.count,
            sends.sigs[recvs.count - sends.base] if recvs.count >= sends.base else None,
        )
    if recvs.count > sends.count:
        return _P2pWait(
            receiver,
            sender,
            "Send",
            sends.count,
            recvs.sigs[sends.count - recvs.base] if sends.count >= recvs.base else None,
        )
    return None


def _p2p_evidence(
    comm: CommView, rank: RankView, kind: Literal["Send", "Recv"], peer: int, index: int, fact: str
) -> Fact:
    ref = None
    if rank.proc is not None and rank.comm_ptr is not None:
        ref = OpRef(rank.file, rank.proc, rank.comm_ptr, kind, peer, index)
    return Fact(comm.source, fact, Citation(file=rank.file), ref)


def _waiting(comm: CommView, wait: _P2pWait) -> tuple[str, Fact]:
    theirs = "Recv" if wait.missing == "Send" else "Send"
    direction = "to" if wait.missing == "Send" else "from"
    sig = wait.sig.describe() if wait.sig else "?"
    sentence = (
        f"{wait.culprit.name} never posted {wait.missing} #{wait.index + 1} {direction} {wait.waiter.name}; "
        f"{wait.waiter.name} waits in its matching {theirs}."
    )
    fact = f"{wait.waiter.name} posted {theirs} #{wait.index + 1} ({sig})"
    return sentence, _p2p_evidence(comm, wait.waiter, theirs, wait.culprit.comm_rank, wait.index, fact)


def _p2p_behind(comm: CommView, wait: _P2pWait) -> Finding:
    sentence, evidence = _waiting(comm, wait)
    return comm_finding_of(
        comm,
        Verdict.rank_behind,
        summary=f"{sentence.removesuffix('.')} on {comm.label}.",
        reason="Point-to-point operations are matched pairwise; the rank that has not posted its side is at fault.",
        culprits=(wait.culprit.rank,),
        operation=wait.sig.describe() if wait.sig else None,
        evidence=(evidence,),
    )


P2P_DEADLOCK_FIX = "reorder them (one side sends first), or post both with batch_isend_irecv"


def _p2p_deadlock(comm: CommView, waits: list[_P2pWait]) -> Finding | None:
    """Two ranks each waiting for the other's missing side: a cycle of waits."""
    for one in waits:
        other = next(
            (
                w
                for w in waits
                if w.waiter.comm_rank == one.culprit.comm_rank and w.culprit.comm_rank == one.waiter.comm_rank
            ),
            None,
        )
        if other is None:
            continue
        pair = tuple(sorted((one.waiter.rank, one.culprit.rank)))
        (first, one_fact), (second, other_fact) = _waiting(comm, one), _waiting(comm, other)
        return comm_finding_of(
            comm,
            Verdict.p2p_deadlock,
            summary=f"Point-to-point deadlock on {comm.label}: rank {pair[0]} and rank {pair[1]} each wait for "
            f"the other. {first} {second}",
            reason="Each posted the side that waits (e.g. both recv first) and neither posted the side the other "
            f"needs: {P2P_DEADLOCK_FIX}.",
            culprits=pair,
            operation=one.sig.describe() if one.sig else None,
            evidence=(one_fact, other_fact),
        )
    return None


@dataclass(frozen=True)
class _PendingP2p:
    """A rank's first point-to-point op with one peer that has not completed, issued alone (not in a group)."""

    kind: Literal["Send", "Recv"]
    index: int  # among this kind with this peer, from the dump's first entry
    sig: OpSig
    state: OpState
    then: str | None  # the next op with that peer, pending behind it: "Send (scheduled)"
    called_from: str | None  # the user's frame Flight Recorder recorded: "inject (train.py:269)"
    line: int  # its entry's index in the dump: what the rank enqueued after it comes later


def _first_pending(rank: RankView, peer: int, cut_short: bool = False) -> _PendingP2p | None:
    """``cut_short``: an op "completed" only by the communicator's abort (``Op.cut_short``) counts as pending."""
    pending = []  # (Flight Recorder index, kind, index among the kind, op)
    for kind, logs in (("Send", rank.sent), ("Recv", rank.received)):
        log = logs.get(peer)
        if log is None:
            continue
        pending += [
            (op.line, kind, index, op)
            for index, op in log.alone.items()
            if op.state is not OpState.completed or (cut_short and op.cut_short)
        ]
    if not pending:
        return None
    pending.sort(key=lambda p: p[0])
    (line, kind, index, op), behind = pending[0], pending[1:]
    then = f"{behind[0][1]} ({behind[0][3].state})" if behind else None
    mine = user_frame(op.frames)
    return _PendingP2p(kind, index, op.sig, op.state, then, short_frame(mine) if mine else None, line)  # type: ignore[arg-type]


def _pending_fact(comm: CommView, rank: RankView, other: RankView, wait: _PendingP2p) -> Fact:
    behind = f"; behind it: {wait.then}" if wait.then else "; nothing posted behind it"
    called = f", called from {wait.called_from}" if wait.called_from else ""
    return Fact(
        comm.source,
        f"{rank.name}: first pending op with {other.name} is Recv #{wait.index + 1} "
        f"({wait.sig.describe()}, {wait.state}){called}{behind}",
        Citation(file=rank.file),
    )


def _call_sites(waits: Sequence[tuple[RankView, _PendingP2p]]) -> str:
    """`` (rank 0: called from inject (train.py:269); ...)``, where Flight Recorder recorded the user's frame."""
    sites = [f"{rank.name}: called from {wait.called_from}" for rank, wait in waits if wait.called_from]
    return f" ({'; '.join(sites)})" if sites else ""


def p2p_recv_cycle(comm: CommView) -> Finding | None:
    """Flight Recorder: two ranks whose first pending op with each other is a recv from each other.

    A rank's point-to-point ops with one peer run in order on one stream (NCCL, torch.distributed's
    ``send``/``recv``, not ``batch_isend_irecv``, whose group runs as one), so each recv waits for a send that is
    queued behind the other's recv, or was never posted: a deadlock whatever the counts.  Seen on 2 x H200 over
    NVLink: both ranks' ``recv`` and ``send`` returned at once on the host, and the ranks blocked later, at the
    next synchronisation, behind collectives that never started; only these entries tell why.
    """
    if comm.source != "flight_recorder":
        return None
    ranks = comm.by_comm_rank()
    for a in comm.ranks:
        for b_rank in sorted(a.received):
            b = ranks.get(b_rank)
            if b is None or b_rank <= a.comm_rank:
                continue  # each pair once
            mine, theirs = _first_pending(a, b_rank), _first_pending(b, a.comm_rank)
            if mine is None and theirs is None:  # both recvs "completed" by an abort, seconds in (issue 44)
                mine, theirs = _first_pending(a, b_rank, cut_short=True), _first_pending(b, a.comm_rank, cut_short=True)
            if mine is None or theirs is None or mine.kind != "Recv" or theirs.kind != "Recv":
                continue
            pair = tuple(sorted((a.rank, b.rank)))
            return comm_finding_of(
                comm,
                Verdict.p2p_deadlock,
                summary=f"Point-to-point deadlock on {comm.label}: rank {pair[0]} and rank {pair[1]} each wait in a "
                f"recv from the other{_call_sites(((a, mine), (b, theirs)))}, and the send each needs is queued "
                f"behind the other's recv (or was never posted).",
                reason=f"Each posted its recv first (Flight Recorder: the first op still pending between them, on both "
                f"sides): {P2P_DEADLOCK_FIX}.",
                culprits=pair,
                operation=mine.sig.describe(),
                evidence=(_pending_fact(comm, a, b, mine), _pending_fact(comm, b, a, theirs)),
            )
    return None


def p2p_recv_never_sent(comm: CommView) -> Finding | None:
    """Flight Recorder: a rank's first pending op with a peer is a recv, and that peer has nothing pending with it
    though it has enqueued the collective the waiting rank enqueued after that recv: it went past the send (which
    its program posts before that collective) and never posted it.

    On NCCL both hosts run ahead of their GPUs, so neither blocks in the p2p call: seen on the H100 (a pipeline
    whose last stage skipped its last gradient send), stage 0's recv from stage 1 stayed pending with the step's
    all_reduce queued behind it ("scheduled"), while stage 1's all_reduce had started and every send of it had
    completed; both hosts then blocked in ``.item()``.  Read as a collective alone, the rank whose all_reduce never
    started looked like the lead; it waits for the send.  A peer that has not enqueued that collective may still be
    on its way to the send (computing, or stuck before it), as in any healthy step: not named here.
    """
    if comm.source != "flight_recorder":
        return None
    ranks = comm.by_comm_rank()
    for waiter in comm.ranks:
        for peer in sorted(waiter.received):
            sender = ranks.get(peer)
            mine = _first_pending(waiter, peer)
            if (
                sender is None
                or mine is None
                or mine.kind != "Recv"
                or _first_pending(sender, waiter.comm_rank) is not None
            ):
                continue
            after = next((pos for pos, op in sorted(waiter.details.items()) if op.line > mine.line), None)
            if after is None or sender.total <= after:
                continue  # the waiter enqueued no collective after its recv, or the sender has not reached it
            called = f", called from {mine.called_from}" if mine.called_from else ""
            return comm_finding_of(
                comm,
                Verdict.rank_behind,
                summary=f"{sender.name} never posted the Send {waiter.name} waits for on {comm.label}: "
                f"{waiter.name}'s Recv #{mine.index + 1} from it ({mine.sig.describe()}{called}) is pending, and "
                f"{sender.name} went on to collective #{after + 1}, which {waiter.name} enqueued after that Recv, "
                f"with nothing pending towards {waiter.name}.",
                reason="Point-to-point operations are matched pairwise; the rank that went past its side without "
                "posting it is at fault (Flight Recorder: the waiter's first pending op with it is a recv, its own "
                "sends all completed).",
                culprits=(sender.rank,),
                operation=mine.sig.describe(),
                evidence=(
                    _pending_fact(comm, waiter, sender, mine),
                    Fact(
                        comm.source,
                        f"{sender.name}: no send or recv with {waiter.name} pending; collective #{after + 1} "
                        f"enqueued ({sender.state_at(after) or '?'})",
                        Citation(file=sender.file),
                    ),
                ),
            )
    return None


def missing_send_behind_cycle(findings: Sequence[Finding]) -> Finding | None:
    """NCCL's count of a missing send, where Flight Recorder shows a cycle of pending recvs between the same ranks.

    A stage that never posts its send leaves its peer's recv pending; on NCCL both hosts go on enqueueing, so
    the culprit's next recv from that peer queues behind the stuck one and Flight Recorder's first pending ops
    are recvs on both sides (``p2p_recv_cycle``).  NCCL's logs count every send and recv: one direction
    short of a send names the rank that never posted it (``_p2p_behind``, the one ``rank_behind`` without a
    collective position), where a deadlock of order leaves the counts even."""
    cycle = next((f for f in findings if f.verdict == Verdict.p2p_deadlock and f.source == "flight_recorder"), None)
    if cycle is None:
        return None
    return next(
        (
            f
            for f in findings
            if f.source == "nccl_log"
            and f.verdict == Verdict.rank_behind
            and f.position is None
            and f.culprits
            and set(f.culprits) <= set(cycle.culprits)
        ),
        None,
    )
