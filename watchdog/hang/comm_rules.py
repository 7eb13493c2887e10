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

``job_rules.job_finding`` then weighs the communicators against each other and
against job-wide evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Literal

from ncclwatch.watchdog.events import NCCL_DTYPES, Citation, OpSig, OpState
from ncclwatch.watchdog.hang.rules import Rule, first_fired
from ncclwatch.watchdog.hang.snapshot import CommView, PeerView, RankView
from ncclwatch.watchdog.hang.stacks import call_line, short_frame, split_frame, user_frame
from ncclwatch.watchdog.hang.step_pattern import Expectation, expected_next, skipped_one
from ncclwatch.watchdog.hang.types import Fact, Finding, OpRef, RankStatus
from ncclwatch.watchdog.hang.verdicts import Verdict

MAX_SKEW = 16  # how far apart two ranks' sequences may be realigned
# A collective every rank completed in different datatypes is the divergence when a collective this close after it
# is still pending somewhere (``_first_divergence``): NCCL moved bytes of one type as the other, and the stream of
# bytes between the ranks no longer lines up.
DTYPE_STALL_WITHIN = 4


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def names(ranks: Sequence[RankView]) -> str:
    ids = sorted(r.rank for r in ranks)
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(map(str, ids))


def _op_evidence(comm: CommView, rank: RankView, position: int, fact: str) -> Fact:
    if comm.source == "flight_recorder":
        op = rank.details.get(position)
        entry = f"entries[{op.line}]" if op is not None else None
        return Fact(comm.source, fact, Citation(file=rank.file, entry=entry))
    ref = None
    if rank.proc is not None and rank.comm_ptr is not None:
        ref = OpRef(rank.file, rank.proc, rank.comm_ptr, "coll", None, position)
    return Fact(comm.source, fact, Citation(file=rank.file), ref)


def _rows(
    comm: CommView,
    status: Callable[[RankView], tuple[str, str]],
    position: int | None = None,
    site_at: Callable[[RankView], int] | None = None,
) -> tuple[RankStatus, ...]:
    """Each rank's row; with ``position`` (or ``site_at``, a position per rank), the user's line that issued its
    operation there (Flight Recorder)."""
    rows = []
    # The ranks of a job mostly share their last operation and its call site: each is described once (a row for
    # each of 32,768 ranks at 4,096 nodes).
    described: dict[OpSig, str] = {}
    sites: dict[tuple[str, ...], str | None] = {}
    for rank in comm.ranks:
        last = rank.window[-1] if rank.window else None
        if last is not None and last not in described:
            described[last] = last.describe()
        text, detail = status(rank)
        at = site_at(rank) if site_at is not None else position
        op = rank.details.get(at) if at is not None else None
        if op is not None and op.frames not in sites:
            sites[op.frames] = call_line(op.frames)
        rows.append(
            RankStatus(
                rank=rank.rank,
                host=rank.proc.host if rank.proc else None,
                pid=rank.proc.pid if rank.proc else None,
                issued=rank.total,
                last_op=described[last] if last is not None else None,
                status=text,
                detail=detail,
                call_site=sites[op.frames] if op is not None else None,
            )
        )
    return tuple(sorted(rows, key=attrgetter("rank")))


def _comm_finding(comm: CommView, verdict: Verdict, **fields: object) -> Finding:
    """A finding about one communicator: it names the communicator and the source."""
    return Finding(verdict=verdict, comm_key=comm.key, comm_label=comm.label, source=comm.source, **fields)  # type: ignore[arg-type]


def _realign(longer: Sequence[OpSig], other: Sequence[OpSig]) -> int | None:
    """Smallest k such that ``longer[k:]`` lines up with ``other`` (both from the divergence)."""
    for skew in range(1, MAX_SKEW + 1):
        span = min(len(longer) - skew, len(other))
        if span >= 1 and tuple(longer[skew : skew + span]) == tuple(other[:span]):
            return skew
    return None


# --------------------------------------------------------------------------
# 1. collectives aligned by position
# --------------------------------------------------------------------------


def check_collectives(comm: CommView) -> Finding | None:
    ranks = [r for r in comm.ranks if r.window or r.base]
    if len(ranks) < 2:
        return None
    diverged = _first_divergence(ranks)
    if diverged is not None:
        return _mismatch(comm, ranks, *diverged)
    return _behind(comm, ranks)


def _first_divergence(ranks: list[RankView]) -> tuple[int, dict[OpSig | None, list[RankView]]] | None:
    start = max(r.base for r in ranks)
    digests = {r.comm_rank: r.digest_at(start) for r in ranks}
    known = {d for d in digests.values() if d is not None}
    if len(known) > 1:
        # They disagreed before the oldest operation still held: group by history.
        by_digest: dict[int | None, list[RankView]] = {}
        for r in ranks:
            by_digest.setdefault(digests[r.comm_rank], []).append(r)
        return start, {r.at(start): members for members in by_digest.values() for r in members[:1]}
    # Ranks in step (some behind, none apart) hold from ``start`` a prefix of the longest's operations: one comparison
    # a rank, not one a rank and position (32,768 ranks at 4,096 nodes).
    longest = max(ranks, key=attrgetter("total"))
    ahead = longest.window[start - longest.base :]
    if all(r.window[start - r.base :] == ahead[: max(r.total - start, 0)] for r in ranks):
        return None
    apart: int | None = None  # the first of a run of completed differences, until the ranks agree again
    typed: int | None = None  # the latest completed collective whose ranks passed different datatypes
    for position in range(start, longest.total):
        here = [r for r in ranks if r.total > position]
        if len(here) < 2:
            break
        sigs = [r.window[position - r.base] for r in here]  # every base <= start <= position
        if sigs.count(sigs[0]) == len(sigs):
            apart = None  # in step again, unshifted: each completed difference before was one call recorded apart
        elif not _one_call_completed(list(zip(here, sigs)), position):
            near = typed if typed is not None and position - typed <= DTYPE_STALL_WITHIN else None
            return _split_at(ranks, min(p for p in (near, apart, position) if p is not None))
        else:
            apart = position if apart is None else apart
            typed = position if _dtypes_only(sigs) else typed
    near = typed if typed is not None and _pending_soon_after(ranks, typed) else None
    apart = apart if apart is not None and _pending_after(ranks, apart) else None
    if apart is not None or near is not None:
        return _split_at(ranks, min(p for p in (near, apart) if p is not None))
    return None


def _pending_after(ranks: list[RankView], position: int) -> bool:
    """Some rank issued an operation after ``position`` that it has not completed.

    A run of completed differences with nothing pending after it holds nothing up: the H200, a tensor-parallel job
    still importing its modules 3 s after its set-up scatter, the only collective so far, completed on both ranks
    (and read, before the scatter's chunk was compared, as sizes 65536 against 0)."""
    return any(r.state_at(p) is not OpState.completed for r in ranks for p in range(position + 1, r.total))


def _dtypes_only(sigs: list[OpSig | None]) -> bool:
    """Every rank says a datatype, they differ, and nothing else does: never by design (a scatter's root and the
    others differ in size, not type)."""
    known = [s for s in sigs if s is not None and s.dtype is not None]
    return (
        len(known) == len(sigs)
        and len({s.dtype for s in known}) > 1
        and len({s._replace(dtype=None) for s in known}) == 1
    )


def _pending_soon_after(ranks: list[RankView], position: int) -> bool:
    """Some rank issued a collective within DTYPE_STALL_WITHIN after ``position`` that it has not completed.

    The H200, two wrappers, rank 1 all_reducing its losses in float32 where rank 0 passes bfloat16 at step 1: both
    completed all_reduce #14, and the broadcast #15 after it hung on both.  A dtype difference further back did not
    stop the job there, and one after which every rank completed all it issued (a checkpoint's pause) holds nothing
    now: neither is the stall's cause."""
    after = range(position + 1, position + 1 + DTYPE_STALL_WITHIN)
    return any(p < r.total and r.state_at(p) is not OpState.completed for r in ranks for p in after)


def _one_call_completed(present: list[tuple[RankView, OpSig | None]], position: int) -> bool:
    """Every rank issued the same collective at ``position`` and Flight Recorder says each completed it.

    The sizes or dtypes it recorded differ, and that may be by design: torch 2.13 gloo, a tensor-parallel set-up's
    scatter, 262144 input elements on the root and none on the other rank (``state._fr_sig`` compares the side every
    rank records alike where that side is known). The ranks met there, so it is no divergence where they agree again
    after it (past a run of such positions: one set-up scatters three weights), and the stall is in what is still
    pending. Where no agreement follows, the first of them stays the divergence: NCCL checks nothing and completes
    what it is given (the 2-GPU capture
    ``mismatch_fr``: all_reduce #82 of 16777216 elements on rank 0 and 4195328 on rank 1, both ``completed``, then
    all_gather against all_reduce, pending). A different collective is another call, completed or not. NCCL's logs
    record no completion, so there every difference counts; gloo leaves its entries ``scheduled`` and its group's
    ``last_completed_collective`` completes them (``state._collectives_completed``).
    """
    one_call = len({sig.op if sig else None for _, sig in present}) == 1
    return one_call and all(rank.state_at(position) is OpState.completed for rank, _ in present)


def _split_at(ranks: list[RankView], position: int) -> tuple[int, dict[OpSig | None, list[RankView]]]:
    groups: dict[OpSig | None, list[RankView]] = {}
    for r in ranks:
        if r.total > position:
            groups.setdefault(r.at(position), []).append(r)
    return position, groups


def _mismatch(
    comm: CommView, ranks: list[RankView], position: int, groups: dict[OpSig | None, list[RankView]]
) -> Finding:
    """The minority is the culprit; with an even split, the step the communicator repeats decides (``step_pattern``)."""
    reference = max(ranks, key=lambda r: position - r.base)
    before = range(reference.base, position)
    # Lines only where every operation compared has its stack: a peek's dumps carry none, and another node's shared
    # entries keep theirs for the newest few.  Two gloo wrappers, rank 0 skipping an all_reduce at step 60: the
    # leader's own rank had lines, the other node's (its peek's dump) none, so neither side's operation was "what
    # the step issues", and 7 of 7 were paged with no culprit.
    lined = all(_stack_recorded(m[0], position) for m in groups.values()) and all(
        _stack_recorded(reference, p) for p in before
    )
    keys = {sig: _key(members[0], position, lined) for sig, members in groups.items()}
    history = [_key(reference, p, lined) for p in before]
    step = expected_next(history, list(keys.values()))
    sizes = sorted((len(m) for m in groups.values()), reverse=True)
    by_step = next((sig for sig, key in keys.items() if key == step.expected), None)
    explained = step.expected is not None
    if len(sizes) == 1 or sizes[0] > sizes[1]:
        good_sig = max(groups, key=lambda s: len(groups[s]))
        how = "it is in the minority at that position"
        explained = explained and by_step == good_sig
        if explained:
            how += f": {_step_line(step, keys, groups, good_sig)}"
    elif explained:
        good_sig = by_step
        how = (
            "the ranks split evenly and the step this communicator repeats decides: "
            f"{_step_line(step, keys, groups, good_sig)}"
        )
    else:
        good_sig = _dtype_precedent(ranks, position, groups)
        explained = good_sig is not None
        if explained:
            changed = _dtype_name(next(s for s in groups if s != good_sig))  # type: ignore[arg-type]
            how = (
                f"the ranks split evenly, and every rank issued {good_sig.describe()} before it "  # type: ignore[union-attr]
                f"where no rank ever passed {changed}"
            )
        # By signature: another node's shared entries keep their call site only for the newest few.
        elif step.shape is None and (due := skipped_one([k[0] for k in history], list(keys))) is not None:
            good_sig, explained = due, True
            then = next(sig for sig in keys if sig != due)
            how = (
                f"the ranks split evenly, and every time before, {_describe(history[-1])} was followed by "
                f"{_describe(keys[due])} and then {_describe(keys[then])}: the other side skipped "
                f"{_describe(keys[due])}"
            )
    decided = len(sizes) == 1 or sizes[0] > sizes[1] or explained
    culprits = [r for s, members in groups.items() if s != good_sig for r in members] if decided else []
    good = groups[good_sig] if decided else []
    evidence = [
        _op_evidence(
            comm,
            members[0],
            position,
            f"{names(members)} issued {sig.describe() if sig else '?'} as collective "
            f"#{position + 1}{_called_from(members[0], position)}",
        )
        for sig, members in groups.items()
    ]
    culprit_sig = next((s for s in groups if s != good_sig), None)
    operation = (good_sig or culprit_sig or OpSig("?", None, None, None, None)).describe()
    kind = "dtype" if culprits and _dtype_only(culprit_sig, good_sig) else None
    if kind == "dtype":
        theirs, expected = _dtype_name(culprit_sig), _dtype_name(good_sig)  # type: ignore[arg-type]
        summary = (
            f"{names(culprits)} {'passes' if len(culprits) == 1 else 'pass'} {theirs} where {names(good)} "
            f"{'passes' if len(good) == 1 else 'pass'} {expected} to {operation.replace(f' {expected}', '')} "
            f"(collective #{position + 1} on {comm.label})."
        )
        reason = (
            "A dtype mismatch: the same collective with the same count in another datatype (NCCL checks neither, "
            f"and moves bytes of one type as the other or waits for bytes that never come). Culprit because {how}."
        )
        missing: tuple[str, ...] = ()
    elif culprits:
        summary = (
            f"{names(culprits)} issued {culprit_sig.describe() if culprit_sig else '?'} as collective #{position + 1} "
            f"on {comm.label}, where {names(good)} issued {operation}."
        )
        reason = f"Culprit because {how}.{'' if explained else _skew_note(position, culprits[0], good[0])}"
        missing = ()
    else:
        sides = "; ".join(f"{names(members)} issued {_describe(keys[sig])}" for sig, members in groups.items())
        suspects = "Both sides are suspects" if len(groups) == 2 else "Every side is a suspect"
        summary = f"Ranks split evenly at collective #{position + 1} on {comm.label}: {sides}. {suspects}."
        reason = f"No culprit: the ranks split evenly and {step.why_not}."
        missing = (f"which side is wrong: {step.would_decide}",)
    status_of = {r.comm_rank: ("diverged" if r in culprits else "waiting" if culprits else "suspect") for r in ranks}
    return _comm_finding(
        comm,
        Verdict.collective_mismatch,
        summary=summary,
        reason=reason,
        culprits=tuple(sorted(r.rank for r in culprits)),
        suspects=() if culprits else tuple(sorted(r.rank for members in groups.values() for r in members)),
        position=position + 1,
        operation=operation,
        evidence=tuple(evidence),
        missing=missing,
        rows=_rows(comm, lambda r: (status_of.get(r.comm_rank, "?"), _at_text(r, position)), position),
        kind=kind,
    )


def _dtype_precedent(ranks: list[RankView], position: int, groups: dict[OpSig | None, list[RankView]]) -> OpSig | None:
    """Two sides of an even split that differ only in datatype, where every rank issued one side's exact collective
    earlier and no rank ever issued the other's: that one is right, the side that changed its datatype is wrong.

    Decides before any step repeats (a dtype bug at step 1 of a 2-rank job: step 0 issued the collective on both
    ranks in the right datatype); an operation seen before in both datatypes decides nothing."""
    if len(groups) != 2:
        return None
    one, other = groups
    if not _dtype_only(one, other):
        return None
    earlier = [set(r.window[: max(0, position - r.base)]) for r in ranks]
    for right, changed in ((one, other), (other, one)):
        if all(right in issued for issued in earlier) and not any(changed in issued for issued in earlier):
            return right
    return None


def _dtype_only(sig: OpSig | None, other: OpSig | None) -> bool:
    """Both say a datatype, and it is all that differs."""
    if sig is None or other is None or sig.dtype is None or other.dtype is None:
        return False
    return sig.dtype != other.dtype and sig._replace(dtype=other.dtype) == other


def _dtype_name(sig: OpSig) -> str:
    return NCCL_DTYPES.get(sig.dtype or "", sig.dtype or "?")


def _stack_recorded(rank: RankView, position: int) -> bool:
    op = rank.details.get(position)
    return op is not None and bool(op.frames)


def _key(rank: RankView, position: int, lined: bool) -> tuple[OpSig | None, str | None]:
    """What the step is learned from: the signature, and where ``lined`` the user's line Flight Recorder recorded for
    it (two all_reduces of one size from two lines of the script are two operations)."""
    op = rank.details.get(position) if lined else None
    mine = user_frame(op.frames) if op is not None else None
    return rank.at(position), short_frame(mine) if mine else None


def _describe(key: Hashable) -> str:
    """``AllReduce count=1 Float at train.py:71``, or the signature alone where no line was recorded."""
    sig, frame = key  # type: ignore[misc]  # a _key
    text = sig.describe() if sig is not None else "?"
    if frame:
        _, path, line = split_frame(frame)
        text += f" at {path}:{line}" if line else f" in {path}"
    return text


def _step_line(
    step: Expectation,
    keys: dict[OpSig | None, Hashable],
    groups: dict[OpSig | None, list[RankView]],
    good_sig: OpSig | None,
) -> str:
    """One clause per wrong side: what it skipped or issued instead, and how the learned step says so."""
    shape = step.shape
    if shape is None or step.expected is None:
        return ""
    expected = keys[good_sig]
    clauses = []
    for sig, members in groups.items():
        if sig == good_sig:
            continue
        theirs = keys[sig]
        if step.rule == "order":
            clauses.append(
                f"{names(members)} issued {_describe(theirs)} where, in {step.votes.get(expected, 0)} of the last "
                f"{len(shape.lengths)} steps, {_describe(step.after)} was followed by {_describe(expected)} "
                "and never by it"
            )
        elif theirs in shape.counts:
            clauses.append(
                f"{names(members)} skipped {_describe(expected)}, which every step issues {shape.times(expected)}; it "
                f"is already at {_describe(theirs)}, which this step already issued: the next step's"
            )
        else:
            clauses.append(
                f"{names(members)} issued {_describe(theirs)}, which no step issues, where the step still owes "
                f"{_describe(expected)}"
            )
    return "; ".join(clauses) + f" (a step: {shape.period()}, {len(shape.lengths)} whole steps agree)"


def _skew_note(position: int, culprit: RankView, good: RankView) -> str:
    """Where no step was learned: whether the culprit skipped or added operations, by shortest edit."""
    c, g = culprit, good
    ahead = _realign(c.window[position - c.base :], g.window[position - g.base :])
    behind = _realign(g.window[position - g.base :], c.window[position - c.base :])
    if ahead is not None and (behind is None or ahead <= behind):
        return (
            f" Aligned by shortest edit, {c.name} has {ahead} operation(s) here that {g.name} lacks: "
            "it skipped operations the others issued, or added its own."
        )
    if behind is not None:
        return (
            f" Aligned by shortest edit, {c.name} lacks {behind} operation(s) that {g.name} issued here: "
            "it skipped them."
        )
    return ""


def with_call_sites(finding: Finding, others: Sequence[Finding]) -> Finding:
    """A mismatch judged from NCCL's logs, with each rank's call site from a Flight Recorder finding of the same
    divergence (NCCL's log records no frames). The same divergence: both name, rank by rank, the same operation."""
    if finding.verdict != Verdict.collective_mismatch or any(row.call_site for row in finding.rows):
        return finding
    op_of = lambda row: row.detail.partition(": ")[2].partition(" ")[0]
    mine = {row.rank: op_of(row) for row in finding.rows}
    for other in others:
        if other.verdict != Verdict.collective_mismatch or other.source != "flight_recorder":
            continue
        theirs = {row.rank: row for row in other.rows}
        if mine.keys() <= theirs.keys() and all(op_of(theirs[r]) == op for r, op in mine.items()):
            rows = tuple(replace(row, call_site=theirs[row.rank].call_site) for row in finding.rows)
            return replace(finding, rows=rows)
    return finding


def _called_from(rank: RankView, position: int) -> str:
    """ ", called from step (train.py:105)": the user's line Flight Recorder recorded for this operation."""
    op = rank.details.get(position)
    mine = user_frame(op.frames) if op is not None else None
    return f", called from {short_frame(mine)}" if mine else ""


def _last_with_frames(rank: RankView, position: int) -> int | None:
    """The latest position at or before ``position`` whose op Flight Recorder recorded a user frame for (a
    collective issued from C++, as DDP's bucket all_reduce from the autograd thread, records none)."""
    for at in range(position, rank.base - 1, -1):
        op = rank.details.get(at)
        if op is not None and user_frame(op.frames):
            return at
    return None


def _at_text(rank: RankView, position: int) -> str:
    sig = rank.at(position)
    return f"#{position + 1}: {sig.describe()}" if sig else f"did not reach #{position + 1}"


def _behind(comm: CommView, ranks: list[RankView]) -> Finding | None:
    totals = {r.comm_rank: r.total for r in ranks}
    top = max(totals.values())
    low = min(totals.values())
    if top == low:
        return None
    culprits = [r for r in ranks if r.total == low]
    ahead = max(ranks, key=lambda r: r.total)
    if all(r.state_at(low) is OpState.completed for r in ranks if r.total > low):
        # A collective completes on no rank alone: the ranks "behind" took part in it, their dumps were taken
        # earlier (a running job's dumps, rank by rank: the H200 x4 healthy capture had rank 1 ten collectives
        # ahead, every one completed).  What is still pending, if anything, decides.
        return None
    missing = ahead.at(low)
    operation = missing.describe() if missing else "?"
    others_behind = [r for r in ranks if low < r.total < top]
    ended = [r for r in culprits if r.end is not None]
    summary = (
        f"{names(culprits)} never entered collective #{low + 1} ({operation}) on {comm.label}: "
        f"{'they' if len(culprits) > 1 else 'it'} issued {low} collectives, {names([ahead])} issued {top}."
    )
    reason = "Sequences agree up to there; the others wait in that collective for the ranks that never issued it."
    if ended:
        reason += f" {names(ended)} shut the communicator down ({ended[0].end}) first."
    if others_behind:
        reason += f" {names(others_behind)} are also behind, probably waiting on the culprit elsewhere."
    evidence = [
        _op_evidence(
            comm,
            ahead,
            low,
            f"{names([ahead])} issued {operation} as collective #{low + 1}{_called_from(ahead, low)}",
        )
    ]
    for r in culprits:
        last = r.at(low - 1)
        fact = f"{r.name}'s last collective is #{low}" + (f" ({last.describe()})" if last else "")
        where = _last_with_frames(r, low - 1)
        if where is not None and where != low - 1:
            fact += f"; its last with a Python stack, #{where + 1}{_called_from(r, where)}"
        elif where is not None:
            fact += _called_from(r, where)
        evidence.append(
            _op_evidence(comm, r, low - 1, fact) if low else Fact(comm.source, f"{r.name} issued no collective")
        )
    evidence += [Fact(comm.source, f"{r.name} ended the communicator ({r.end})", r.end_cite) for r in ended]
    return _comm_finding(
        comm,
        Verdict.rank_behind,
        summary=summary,
        reason=reason,
        culprits=tuple(sorted(r.rank for r in culprits)),
        position=low + 1,
        operation=operation,
        evidence=tuple(evidence),
        rows=_rows(
            comm,
            lambda r: ("behind" if r.total == low else "waiting" if r.total == top else "behind", f"issued {r.total}"),
            # Flight Recorder's frames: where the others entered the collective they wait in, and where each rank
            # behind issued its last one (it never reached the next)
            site_at=lambda r: low if r.total > low else _last_with_frames(r, r.total - 1),
        ),
    )


# --------------------------------------------------------------------------
# 2. point-to-point, matched pairwise
# --------------------------------------------------------------------------


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
            return _comm_finding(
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
    return _comm_finding(
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
        return _comm_finding(
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
            return _comm_finding(
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
            return _comm_finding(
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


# --------------------------------------------------------------------------
# 3. same operations everywhere: did the last one complete?
# --------------------------------------------------------------------------


def check_completion(comm: CommView) -> Finding:
    ranks = list(comm.ranks)
    total = max((r.total for r in ranks), default=0)
    if ranks and all(r.end == "destroy" for r in ranks):
        return _comm_finding(
            comm,
            Verdict.no_hang,
            summary=f"Every rank issued the same {total} collectives on {comm.label} and destroyed it cleanly.",
            evidence=tuple(Fact(comm.source, f"{r.name} destroyed the communicator", r.end_cite) for r in ranks[:4]),
            rows=_rows(comm, lambda r: ("ok", "destroyed")),
        )
    if comm.source == "flight_recorder":
        return _fr_completion(comm, ranks, total)
    aborted = [r for r in ranks if r.end == "abort"]
    if aborted:
        return _comm_finding(
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
    return _comm_finding(
        comm,
        Verdict.inconclusive,
        summary=f"Every rank issued the same {total} collectives on {comm.label}; "
        "the log does not say whether the last completed.",
        reason="NCCL logs an operation when it is enqueued, never when it completes, "
        "and no rank shut the communicator down.",
        missing=("completion state: a Flight Recorder dump, or the live watchdog's timing",),
        rows=_rows(comm, lambda r: ("?", "no end line")),
    )


def _fr_completion(comm: CommView, ranks: list[RankView], total: int) -> Finding:
    pending = [r for r in ranks if r.completed is not None and r.completed < r.total]
    if not pending and (unseen := [r for r in ranks if r.unrecorded]):
        return _comm_finding(
            comm,
            Verdict.inconclusive,
            summary=f"Flight Recorder shows all {total} collectives on {comm.label} completed on every rank, but "
            f"{names(unseen)} issued {max(r.unrecorded for r in unseen)} operations "
            f"{'its dump does' if len(unseen) == 1 else 'their dumps do'} not hold: gloo's "
            "Flight Recorder records no send or recv, and a rank waiting in one looks idle here.",
            reason="Nothing recorded is pending; the operations not recorded cannot be judged.",
            missing=("which send or recv each rank waits in: py-spy stacks (the live watchdog's bundle has them)",),
            rows=_rows(comm, lambda r: ("?", f"all recorded completed; {r.unrecorded} not recorded")),
        )
    if not pending:
        return _comm_finding(
            comm,
            Verdict.no_hang,
            summary=f"Flight Recorder shows all {total} collectives on {comm.label} completed on every rank: "
            "nothing is pending." + (_older_dumps(ranks, total) if any(r.total < total for r in ranks) else ""),
            rows=_rows(comm, lambda r: ("ok", "all completed")),
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
        _op_evidence(comm, r, position, f"{r.name}: collective #{position + 1} is {states[r.comm_rank] or 'absent'}")
        for r in ranks
    ]
    reason = (
        f"{names(lead)} never started the collective its peers are running (Flight Recorder: scheduled vs started)."
        if lead
        else "Every rank enqueued it and none finished; Flight Recorder does not say who is late."
    )
    return _comm_finding(
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
        rows=_rows(comm, lambda r: (str(states[r.comm_rank] or "?"), f"completed {r.completed}"), position),
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
    return _comm_finding(
        comm,
        Verdict.no_hang,
        summary=f"Nothing waits on {comm.label}: the only collectives a rank has not recorded as completed ({shown}) "
        "completed on another rank, and such a collective completes on no rank before every rank's part has run.",
        reason="A rank's record lags its work: its dump was taken before the completion was recorded.",
        evidence=tuple(
            _op_evidence(comm, r, p, f"{r.name}: collective #{p + 1} is {r.state_at(p)}, completed on another rank")
            for r, p in lags[:4]
        ),
        rows=_rows(comm, lambda r: ("ok", f"completed {r.completed}")),
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
    return _comm_finding(
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
            _op_evidence(comm, r, position, f"{r.name}: collective #{position + 1} is {r.state_at(position)}")
            for r in ranks
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
