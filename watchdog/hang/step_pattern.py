"""The step a communicator repeats, learned from its recorded history, and which side of an even split breaks it.

With two ranks (or any even split) the majority cannot say which side of a
divergence is wrong; the job's own history can. A training step issues the
same collectives every step, so the recorded sequence is a repeating *step*,
but not a strictly periodic string:

- two CUDA streams of one communicator (FSDP2's all_gathers and its
  reduce_scatters) and prefetching may issue independent operations in a
  different order from one step to the next;
- gradient accumulation, pipeline schedules and data-dependent branches give
  a step a variable number of operations;
- identical layers issue identical signatures, so a run of equal operations
  repeats with period one inside the step (the old rule, "shortest period whose
  last two repetitions agree", took that run for the step and named no one).

So the step is learned as a *bag* of operations cut at an anchor: an
operation every step issues exactly once. Cut there, the most recent whole
steps (at least ``MIN_STEPS``) must hold the same set of operations; their
lengths and per-operation counts may vary. Two rules then judge the
operations the sides issued at the divergence (the *candidates*):

- count: with steps of one fixed bag of ``P`` operations, the last ``P - 1``
  operations are a step minus the one due now; a candidate they already hold
  as often as a step issues it belongs to the next step, one they lack is due;
- order: in each whole step, what followed the operation that precedes the
  divergence, at the same occurrence (the 3rd reduce_scatter of the step)?

A candidate is expected when a rule singles it out and the other rule does
not single out another; otherwise nothing decides, and ``why_not`` says why:
no step learned, both orders seen here in earlier steps, an operation that
some older steps issued and the recent ones do not (a branch on data), or
rules that disagree.
Keys are opaque and hashable: an operation's signature, with the user's line
that issued it where Flight Recorder recorded one. Pure functions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

MIN_STEPS = 2  # whole steps that must agree before the step is trusted
MAX_HISTORY = 4096  # operations looked at, the newest (the state holds at most 2 x window per rank)


@dataclass(frozen=True)
class StepShape:
    """A communicator's step: cut where ``anchor`` is issued, the newest whole steps agreeing on their operations."""

    anchor: Hashable
    starts: tuple[int, ...]  # index in the history of each whole step's anchor, then of the current step's
    counts: Mapping[Hashable, tuple[int, int]]  # fewest and most times one whole step issues each operation
    lengths: tuple[int, ...]  # operations in each whole step

    @property
    def fixed(self) -> bool:
        """Every whole step issued the same operations the same number of times."""
        return len(set(self.lengths)) == 1 and all(lo == hi for lo, hi in self.counts.values())

    def period(self) -> str:
        """``16 operations`` or ``14-18 operations``: a step's length."""
        lo, hi = min(self.lengths), max(self.lengths)
        return f"{lo} operations" if lo == hi else f"{lo}-{hi} operations"

    def times(self, key: Hashable) -> str:
        """How often a step issues ``key``: ``once``, ``3 times``, ``1-2 times``."""
        lo, hi = self.counts.get(key, (0, 0))
        if lo == hi:
            return "once" if lo == 1 else f"{lo} times"
        return f"{lo}-{hi} times"


def learn_steps(history: Sequence[Hashable], avoid: Sequence[Hashable] = ()) -> StepShape | None:
    """The step ``history`` repeats, or None when fewer than ``MIN_STEPS`` whole steps agree.

    Each operation issued at least ``MIN_STEPS + 1`` times is tried as the anchor; the cut giving the
    most agreeing whole steps wins (the shortest repeating unit); among equals, an anchor not in
    ``avoid`` (the operations being judged: a cut right at them says nothing about them), then the one
    whose current step started earliest (it shows most of the step in progress).
    """
    history = history[-MAX_HISTORY:]
    positions: dict[Hashable, list[int]] = {}
    for index, key in enumerate(history):
        positions.setdefault(key, []).append(index)
    tried = sorted((where for where in positions.values() if len(where) > MIN_STEPS), key=len, reverse=True)
    best: StepShape | None = None
    best_rank: tuple[int, bool, int] | None = None
    for where in tried:
        if best is not None and len(where) - 1 < len(best.lengths):
            break  # cut at rarer operations, fewer whole steps: none can win
        shape = _cut_at(history, where)
        if shape is None:
            continue
        rank = (len(shape.lengths), shape.anchor not in avoid, -shape.starts[-1])
        if best_rank is None or rank > best_rank:
            best, best_rank = shape, rank
    return best


def _cut_at(history: Sequence[Hashable], where: list[int]) -> StepShape | None:
    """Steps cut at each of ``where`` (one operation's positions): the newest run of whole steps holding one set."""
    bounds = list(zip(where, where[1:]))
    reference = set(history[bounds[-1][0] : bounds[-1][1]])
    run: list[tuple[int, int]] = []
    for start, end in reversed(bounds):
        if set(history[start:end]) != reference:
            break  # an older step unlike the newest (warm-up, an evaluation): the step is learned from the newer
        run.append((start, end))
    if len(run) < MIN_STEPS:
        return None
    run.reverse()
    bags = [Counter(history[start:end]) for start, end in run]
    counts = {key: (min(b[key] for b in bags), max(b[key] for b in bags)) for key in reference}
    current = Counter(history[where[-1] :])
    if any(key not in counts or n > counts[key][1] for key, n in current.items()):
        return None  # the step in progress already left this shape
    return StepShape(
        anchor=history[where[0]],
        starts=tuple(start for start, _ in run) + (where[-1],),
        counts=counts,
        lengths=tuple(end - start for start, end in run),
    )


@dataclass(frozen=True)
class Expectation:
    """Which candidate the step expects next, by which rule; or why nothing decides and what would."""

    expected: Hashable | None
    shape: StepShape | None
    rule: Literal["count", "order"] | None = None
    after: Hashable | None = None  # the operation just before the divergence (order rule)
    votes: Mapping[Hashable, int] = field(default_factory=dict)  # what followed it in earlier steps
    why_not: str = ""
    would_decide: str = ""


def expected_next(history: Sequence[Hashable], candidates: Sequence[Hashable]) -> Expectation:
    """The candidate the step ``history`` repeats expects next, if exactly one
    (``candidates``: each side's operation)."""
    history = history[-MAX_HISTORY:]
    shape = learn_steps(history, avoid=candidates)
    if shape is None:
        return Expectation(
            None,
            None,
            why_not=f"no step repeats in the recorded history before it (fewer than {MIN_STEPS} whole steps agree)",
            would_decide="a longer history, if the job ran whole steps before it: NCCL debug logs from the job's "
            "start, or a larger TORCH_FR_BUFFER_SIZE",
        )
    older = [key for key in candidates if key not in shape.counts and key in history]
    if older:
        return Expectation(
            None,
            shape,
            why_not="an operation the recent steps do not issue was issued in earlier ones (a branch on data?)",
            would_decide="the code: when that operation is meant to run, and whether every rank takes that branch",
        )
    after, votes = history[-1], _followers(history, shape)
    seen = [key for key in candidates if votes.get(key)]
    if len(seen) > 1:
        return Expectation(
            None,
            shape,
            after=after,
            votes=votes,
            why_not="earlier steps issued these operations in either order here (two streams, or a branch on data)",
            would_decide="the code at both call sites: whether their order may differ between ranks (it must not "
            "on one communicator)",
        )
    # A sliding window is blind to a swap at its edge; the order vote above has ruled that out.
    by_count = _by_count(history, shape, candidates)
    by_order = seen[0] if seen and votes[seen[0]] >= MIN_STEPS else None
    if by_count is not None and by_order is not None and by_count != by_order:
        return Expectation(
            None,
            shape,
            after=after,
            votes=votes,
            why_not="the step's counts and its order point at different sides",
            would_decide="the code at both call sites: which one every rank should reach here",
        )
    if by_count is not None:
        return Expectation(by_count, shape, "count", after, votes)
    if by_order is not None:
        return Expectation(by_order, shape, "order", after, votes)
    in_step = [key for key in candidates if key in shape.counts]
    if len(in_step) == len(candidates):
        why = "every step issues both, and neither its counts nor its order tell which comes first here"
    else:
        why = "neither operation is what the step issues at this point"
    return Expectation(
        None,
        shape,
        after=after,
        votes=votes,
        why_not=why,
        would_decide="the code at both call sites: which one every rank should reach here (a branch on the rank "
        "or on data before them)",
    )


def skipped_one(history: Sequence[Hashable], candidates: Sequence[Hashable]) -> Hashable | None:
    """Where no step is learned yet (one step in the history): the candidate ``K`` such that, every time the last
    operation ``W`` was issued before, ``K`` came next and the other candidate right after it (``W, K, Y``).  The
    side at ``Y`` skipped ``K``.  Two gloo ranks, one skipping an all_reduce at step 1: step 0 had shown the order
    once, and the ranks split evenly with no culprit."""
    if len(candidates) != 2 or not history:
        return None
    after = history[-1]
    followers = {
        (history[i + 1], history[i + 2] if i + 2 < len(history) else None)
        for i in range(len(history) - 1)
        if history[i] == after
    }
    if len(followers) != 1:
        return None
    ((next_one, then),) = followers
    one, other = candidates
    for expected, skipped_to in ((one, other), (other, one)):
        if next_one == expected and then == skipped_to:
            return expected
    return None


def _by_count(history: Sequence[Hashable], shape: StepShape, candidates: Sequence[Hashable]) -> Hashable | None:
    """With steps of one fixed bag of P operations: the one candidate the last P - 1 operations lack."""
    if not shape.fixed or len(candidates) < 2:
        return None
    period = shape.lengths[0]
    held = Counter(history[len(history) - period + 1 :]) if period > 1 else Counter()
    due = [key for key in candidates if held[key] < shape.counts.get(key, (0, 0))[1]]
    return due[0] if len(due) == 1 else None


def _followers(history: Sequence[Hashable], shape: StepShape) -> dict[Hashable, int]:
    """What followed the last operation's occurrence (its n-th in the step in progress) in each whole step."""
    after = history[-1]
    nth = history[shape.starts[-1] :].count(after)
    votes: Counter[Hashable] = Counter()
    for start, end in zip(shape.starts, shape.starts[1:]):
        seen = 0
        for index in range(start, end):
            if history[index] == after:
                seen += 1
                if seen == nth:
                    votes[history[index + 1]] += 1
                    break
    return dict(votes)
