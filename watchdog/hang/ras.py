"""NCCL RAS as one signal for the verdict: which ranks of a ``RasCommunicator`` stand out, and why.

Pure: reads the event the RAS parser made (``parsing/ras.py``), whose rank
statuses and sentences use the vocabulary in ``events`` (``RAS_MISSING``,
``RAS_GROUP_OPS``...).
"""

from __future__ import annotations

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


def ras_outliers(comm: RasCommunicator) -> dict[int, str]:
    """Rank -> why it stands out: missing, dead, in error, or off the majority.

    Majorities come from the named ranks plus the text report's group
    sentences (``3 ranks have launched up to operation 47``), whose members
    NCCL does not name.  With no strict majority (e.g. 2 ranks, 47 vs 48),
    every rank with a known value is returned with "no majority" (and
    "lowest"/"highest") in its reason: RAS alone cannot tell which side is
    wrong.  Ranks absent from a cut-short JSON are not reported.
    """
    reasons: dict[int, list[str]] = {}
    for r in comm.ranks:
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
        _flag_minority(reasons, values, op_groups.get(op, {}), f"{op} launched up to", numeric=True)
    statuses = {r.rank: r.status for r in comm.ranks if r.status in _LIFECYCLE}
    _flag_minority(reasons, statuses, status_groups, "status", numeric=False)
    return {rank: "; ".join(why) for rank, why in sorted(reasons.items())}


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
    reasons: dict[int, list[str]], values: dict[int, object], groups: dict, what: str, *, numeric: bool
) -> None:
    """Add a reason for each named rank whose value is not the strict majority's."""
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
        elif value != top:
            gap = ""
            if numeric:
                gap = f", {'ahead' if value > top else 'behind'} by {abs(value - top)}"  # type: ignore[operator]
            reasons.setdefault(rank, []).append(f"{what} {value}, majority {top} ({top_n} of {total} ranks){gap}")
