"""What every sequence rule builds its finding with: the communicator's finding, each rank's row, a cited
operation, the ranks named.  Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from ncclwatch.watchdog.events import Citation, OpSig
from ncclwatch.watchdog.hang.snapshot import CommView, RankView
from ncclwatch.watchdog.hang.stacks import call_line
from ncclwatch.watchdog.hang.types import Fact, Finding, OpRef, RankStatus
from ncclwatch.watchdog.hang.verdicts import Verdict


def names(ranks: Sequence[RankView]) -> str:
    ids = sorted(r.rank for r in ranks)
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(map(str, ids))


def op_fact(comm: CommView, rank: RankView, position: int, fact: str) -> Fact:
    if comm.source == "flight_recorder":
        op = rank.details.get(position)
        entry = f"entries[{op.line}]" if op is not None else None
        return Fact(comm.source, fact, Citation(file=rank.file, entry=entry))
    ref = None
    if rank.proc is not None and rank.comm_ptr is not None:
        ref = OpRef(rank.file, rank.proc, rank.comm_ptr, "coll", None, position)
    return Fact(comm.source, fact, Citation(file=rank.file), ref)


def rank_rows(
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


def comm_finding_of(comm: CommView, verdict: Verdict, **fields: object) -> Finding:
    """A finding about one communicator: it names the communicator and the source."""
    return Finding(verdict=verdict, comm_key=comm.key, comm_label=comm.label, source=comm.source, **fields)  # type: ignore[arg-type]
