"""NCCL RAS as one signal for the verdict: which ranks of a ``RasCommunicator`` stand out, and why.

Pure: reads the event the RAS parser made (``parsing/ras.py``), whose rank
statuses and sentences use the vocabulary in ``events`` (``RAS_MISSING``,
``RAS_GROUP_OPS``...).
"""

from __future__ import annotations

from dataclasses import dataclass

from ncclwatch.watchdog.events import (
    RAS_DEAD,
    RAS_DIFFERENT_OPS,
    RAS_DIFFERENT_STATUS,
    RAS_GROUP_OPS,
    RAS_GROUP_STATUS,
    RAS_MISSING,
    RasCommunicator,
)

# NCCL's own lifecycle statuses, compared across ranks; ours (missing, dead) and errors are reasons by themselves.
_LIFECYCLE = frozenset({"NOCOMM", "UNKNOWN", "INIT", "RUNNING", "FINALIZE", "ABORT"})


@dataclass(frozen=True)
class RasJudgement:
    """Which ranks of a ``RasCommunicator`` stand out, and whether RAS alone can blame them.

    ``reasons``: rank -> why it stands out.  ``suspects``: those of them RAS names only as "one of these": the
    sides of an even split, or the ranks behind a few that got one collective further; the others are culprits.
    ``ahead``: the ranks that got one collective further than all the others (not culprits), when that is why.
    """

    reasons: dict[int, str]
    suspects: tuple[int, ...] = ()
    ahead: tuple[int, ...] = ()

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(r for r in sorted(self.reasons) if r not in self.suspects)


def ras_outliers(comm: RasCommunicator) -> dict[int, str]:
    """Rank -> why it stands out: missing, dead, in error, or off the majority (``judge_ras``)."""
    return judge_ras(comm).reasons


def judge_ras(comm: RasCommunicator) -> RasJudgement:
    """Rank -> why it stands out: missing, dead, in error, or off the majority.

    Majorities come from the named ranks plus the text report's group
    sentences (``3 ranks have launched up to operation 47``), whose members
    NCCL does not name.  With no strict majority (e.g. 2 ranks, 47 vs 48),
    every rank with a known value is returned with "no majority" (and
    "lowest"/"highest") in its reason, as a suspect: RAS alone cannot tell
    which side is wrong.  Where a few ranks (two or more) are exactly one
    collective ahead of all the others, they finished their part of the
    collective the others have not and launched the next: the rank at fault
    is among those behind, who are the suspects (named by the complement of
    the few where the text report leaves them unnamed).  Ranks absent from a
    cut-short JSON are not reported.
    """
    reasons: dict[int, list[str]] = {}
    suspects: set[int] = set()  # named only as "one of these"
    blamed: set[int] = set()  # named by a reason of their own
    ahead: set[int] = set()
    for r in comm.ranks:
        if r.status in (RAS_DEAD, RAS_MISSING) or (r.status and r.status.startswith("ERROR")):
            blamed.add(r.rank)
        if r.status == RAS_DEAD:
            reasons.setdefault(r.rank, []).append("process considered dead by RAS (unreachable)")
        elif r.status == RAS_MISSING:
            reasons.setdefault(r.rank, []).append("no answer to RAS (process unresponsive or stopped)")
        elif r.status and r.status.startswith("ERROR"):
            reasons.setdefault(r.rank, []).append(r.status.lower().replace("error: ", "reported ", 1))
    op_groups, status_groups = _message_groups(comm.messages)
    ops = dict.fromkeys([op for r in comm.ranks for op in r.collective_counts] + list(op_groups))
    for op in ops:
        values = {r.rank: r.collective_counts[op] for r in comm.ranks if op in r.collective_counts}
        groups = op_groups.get(op, {})
        few = _few_one_ahead(values, groups, comm.nranks)
        if few is not None:
            behind, count = few
            further = sorted(r for r, v in values.items() if v == count + 1)
            for rank in behind:
                reasons.setdefault(rank, []).append(
                    f"{op} launched up to {count}, one behind rank {', '.join(map(str, further))}: those finished "
                    f"their part of {op} {count} and launched the next; the rank they wait for is among the "
                    f"{len(behind)} at {count}"
                )
            ahead |= set(further)
            suspects |= set(behind)
            continue
        _flag_minority(reasons, (suspects, blamed), values, groups, f"{op} launched up to", numeric=True)
    statuses = {r.rank: r.status for r in comm.ranks if r.status in _LIFECYCLE}
    _flag_minority(reasons, (suspects, blamed), statuses, status_groups, "status", numeric=False)
    return RasJudgement(
        reasons={rank: "; ".join(why) for rank, why in sorted(reasons.items())},
        suspects=tuple(sorted(suspects - blamed)),
        ahead=tuple(sorted(ahead)),
    )


def _few_one_ahead(values: dict[int, int], groups: dict[int, int], nranks: int | None) -> tuple[list[int], int] | None:
    """(the ranks behind, their count) where two or more ranks, a minority, are one collective ahead of all the rest.

    One rank alone one ahead is left to the minority rule: a rank that issued one extra collective looks so
    (tools/capture's "extra": 3 ranks at 47, the extra one at 48, and it is the culprit).  The ranks behind are
    named in the JSON, or in the text report are the complement of the named few among ``nranks``; none where
    that does not add up (the few are still not blamed).
    """
    tally: dict[int, int] = dict(groups)
    for value in values.values():
        if value not in groups:
            tally[value] = tally.get(value, 0) + 1
    if len(tally) != 2:
        return None
    low, high = sorted(tally)
    total = sum(tally.values())
    if high != low + 1 or not 2 <= tally[high] < tally[low]:
        return None
    behind = sorted(r for r, v in values.items() if v == low)
    if len(behind) < tally[low]:  # the text report names the few, not the many: they are the others
        named_high = {r for r, v in values.items() if v == high}
        adds_up = nranks == total and len(named_high) == tally[high]
        behind = sorted(set(range(total)) - named_high) if adds_up else []
    return behind, low


def _message_groups(messages: list[str]) -> tuple[dict[str, dict[int, int]], dict[str, int]]:
    """The text report's unnamed groups: op -> {value: n ranks}, status -> n ranks."""
    ops: dict[str, dict[int, int]] = {}
    statuses: dict[str, int] = {}
    op = None
    for line in messages:
        if m := RAS_DIFFERENT_OPS.match(line):
            op = "Collective" if m.group(1) == "collective" else m.group(1)
        elif RAS_DIFFERENT_STATUS.match(line):
            op = None
        elif (m := RAS_GROUP_OPS.match(line)) and op is not None:
            ops.setdefault(op, {})[int(m.group(2) or 0)] = int(m.group(1))
        elif m := RAS_GROUP_STATUS.match(line):
            statuses[m.group(2)] = int(m.group(1))
    return ops, statuses


def _flag_minority(
    reasons: dict[int, list[str]],
    named: tuple[set[int], set[int]],
    values: dict[int, object],
    groups: dict,
    what: str,
    *,
    numeric: bool,
) -> None:
    """Add a reason for each named rank whose value is not the strict majority's; ``named``: the suspects (every
    side of a tie) and the blamed (the minority) so far, added to."""
    suspects, blamed = named
    tally = dict(groups)
    for value in values.values():
        if value not in groups:  # named members of an announced group are already counted
            tally[value] = tally.get(value, 0) + 1
    if len(tally) < 2:
        return
    ranked = sorted(tally.items(), key=lambda kv: (-kv[1], kv[0]))  # values of one call share a type
    (top, top_n), total = ranked[0], sum(tally.values())
    tie = ranked[1][1] == top_n
    spread = ", ".join(f"{n} at {v}" for v, n in ranked)
    for rank, value in values.items():
        if tie:
            # Trap: lowest is not "the culprit": a rank stuck in Python launches
            # fewer, but one that skipped a collective launches more.
            side = ""
            if numeric and value in (min(tally), max(tally)):  # type: ignore[type-var]
                side = ", lowest" if value == min(tally) else ", highest"  # type: ignore[type-var]
            reasons.setdefault(rank, []).append(f"{what} {value}{side}; no majority ({spread})")
            suspects.add(rank)
        elif value != top:
            gap = ""
            if numeric:
                gap = f", {'ahead' if value > top else 'behind'} by {abs(value - top)}"  # type: ignore[operator]
            reasons.setdefault(rank, []).append(f"{what} {value}, majority {top} ({top_n} of {total} ranks){gap}")
            blamed.add(rank)
