"""``ncclwatch analyze --entries``: the Flight Recorder entries behind a verdict, filtered and printed.

What fr_trace's ``--just_print_entries --selected-ranks --pg-filters`` does,
from the dumps ``analyze`` already read: per rank and process group, the
newest entries, one row each (rank, position, group, op, state, sizes,
dtype, the user's call site) and, with ``stack``, every frame Flight Recorder
recorded.  States are the ones the verdict was judged on: a member of a
coalesced group (``batch_isend_irecv``) takes its marker's, and a completion
that only the communicator's abort made is undone (``parsing.flight_recorder``).

Failure modes: a ``--pg`` or ``--rank`` that names nothing in the dumps is
said in one line naming what the dumps hold; nothing here raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ncclwatch.watchdog.events import FrDump, FrEntry, OpState, group_label
from ncclwatch.watchdog.hang.stacks import short_frame, user_frame
from ncclwatch.watchdog.parsing.flight_recorder import effective_states

HEADER = ("rank", "position", "process group", "op", "state", "sizes", "dtype", "call site")


@dataclass(frozen=True)
class EntryFilter:
    """Which entries to print: process groups by id or description, global ranks, the newest ``last`` of each
    rank and group (0: all)."""

    pgs: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    last: int = 20


@dataclass(frozen=True)
class Row:
    rank: int | None
    entry: FrEntry
    state: OpState
    group: str

    def cells(self) -> tuple[str, ...]:
        e = self.entry
        position = f"p2p #{e.p2p_seq_id}" if e.is_p2p else f"#{e.collective_seq_id}" if e.collective_seq_id else "-"
        op = e.op + (f" {'to' if e.op == 'Send' else 'from'} {e.peer}" if e.is_p2p and e.peer is not None else "")
        sizes = ",".join("x".join(map(str, shape)) or "scalar" for shape in e.input_sizes) or "-"
        mine = user_frame([str(f) for f in e.frames])
        return (
            "?" if self.rank is None else str(self.rank),
            position,
            self.group,
            op,
            self.state.value,
            sizes,
            ",".join(dict.fromkeys(e.input_dtypes)) or "-",
            short_frame(mine) if mine else "-",
        )


def select(dumps: Iterable[FrDump], chosen: EntryFilter) -> tuple[list[Row], list[str]]:
    """The rows the filter picks, rank by rank, oldest first; and a line per filter that names nothing."""
    dumps = sorted(dumps, key=lambda d: (d.rank is None, d.rank or 0))
    said: list[str] = []
    rows: list[Row] = []
    groups_seen: set[str] = set()
    named: set[str] = set()  # the --pg values that matched a group
    for dump in dumps:
        groups_seen |= {group_label(pg, g.desc) for pg, g in dump.process_groups.items()}
        if chosen.ranks and dump.rank not in chosen.ranks:
            continue
        states = effective_states(dump)
        kept: dict[str, list[Row]] = {}
        for entry, state in zip(dump.entries, states, strict=True):
            group = dump.process_groups.get(entry.pg_id)
            desc = group.desc if group else None
            if chosen.pgs:
                hits = {p for p in chosen.pgs if p in (entry.pg_id, desc)}
                if not hits:
                    continue
                named |= hits
            kept.setdefault(entry.pg_id, []).append(Row(dump.rank, entry, state, group_label(entry.pg_id, desc)))
        for group_rows in kept.values():
            rows.extend(group_rows[-chosen.last :] if chosen.last else group_rows)
    if not dumps:
        return [], ["no Flight Recorder dump among the inputs: --entries, --rank and --pg print dumps' entries"]
    ranks = {d.rank for d in dumps}
    if missing := [r for r in chosen.ranks if r not in ranks]:
        held = ", ".join(str(r) for r in sorted(r for r in ranks if r is not None)) or "none"
        said.append(f"no Flight Recorder dump of rank {', '.join(map(str, missing))} (dumps of rank {held})")
    if unknown := [p for p in chosen.pgs if p not in named]:
        held = "; ".join(sorted(groups_seen)) or "none"
        said.append(f"no process group {', '.join(unknown)} in the dumps given (they hold {held})")
    return rows, said


def render(rows: Sequence[Row], stack: bool = False) -> str:
    """The rows as a table; with ``stack``, each row's frames (innermost first) under it."""
    if not rows:
        return "(no Flight Recorder entry matches)"
    table = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER) - 1)]
    lines = []
    for index, line in enumerate(table):
        lines.append("  ".join([*(cell.ljust(width) for cell, width in zip(line, widths, strict=False)), line[-1]]))
        if stack and index:
            lines.extend(f"      {frame}" for frame in rows[index - 1].entry.frames)
    return "\n".join(lines)


__all__ = ["EntryFilter", "Row", "render", "select"]
