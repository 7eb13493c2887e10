"""The ``collectives`` sequence rule: every rank's collectives aligned by position.

At the first position where ranks issued different operations -> ``collective_mismatch`` (the minority is the
culprit; with an even split the step the communicator repeats decides, ``step_pattern``), not where they issued
one collective, recorded with other sizes, that Flight Recorder says every one completed, when they agree again
after it; otherwise, if some ranks issued fewer -> ``rank_behind``.  Pure.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from operator import attrgetter

from ncclwatch.watchdog.events import NCCL_DTYPES, OpSig, OpState
from ncclwatch.watchdog.hang.comm_findings import comm_finding_of, names, op_fact, rank_rows
from ncclwatch.watchdog.hang.snapshot import CommView, RankView
from ncclwatch.watchdog.hang.stacks import short_frame, split_frame, user_frame
from ncclwatch.watchdog.hang.step_pattern import Expectation, expected_next, skipped_one
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

MAX_SKEW = 16  # how far apart two ranks' sequences may be realigned
# A collective every rank completed in different datatypes is the divergence when a collective this close after it
# is still pending somewhere (``_first_divergence``): NCCL moved bytes of one type as the other, and the stream of
# bytes between the ranks no longer lines up.
DTYPE_STALL_WITHIN = 4


def realign(longer: Sequence[OpSig], other: Sequence[OpSig]) -> int | None:
    """Smallest k such that ``longer[k:]`` lines up with ``other`` (both from the divergence)."""
    for skew in range(1, MAX_SKEW + 1):
        span = min(len(longer) - skew, len(other))
        if span >= 1 and tuple(longer[skew : skew + span]) == tuple(other[:span]):
            return skew
    return None


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
        op_fact(
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
    return comm_finding_of(
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
        rows=rank_rows(comm, lambda r: (status_of.get(r.comm_rank, "?"), _at_text(r, position)), position),
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
    ahead = realign(c.window[position - c.base :], g.window[position - g.base :])
    behind = realign(g.window[position - g.base :], c.window[position - c.base :])
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
        op_fact(
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
        evidence.append(op_fact(comm, r, low - 1, fact) if low else Fact(comm.source, f"{r.name} issued no collective"))
    evidence += [Fact(comm.source, f"{r.name} ended the communicator ({r.end})", r.end_cite) for r in ended]
    return comm_finding_of(
        comm,
        Verdict.rank_behind,
        summary=summary,
        reason=reason,
        culprits=tuple(sorted(r.rank for r in culprits)),
        position=low + 1,
        operation=operation,
        evidence=tuple(evidence),
        rows=rank_rows(
            comm,
            lambda r: ("behind" if r.total == low else "waiting" if r.total == top else "behind", f"issued {r.total}"),
            # Flight Recorder's frames: where the others entered the collective they wait in, and where each rank
            # behind issued its last one (it never reached the next)
            site_at=lambda r: low if r.total > low else _last_with_frames(r, r.total - 1),
        ),
    )
