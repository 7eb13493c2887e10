"""Which job, and which run of it, wrote each input of ``ncclwatch analyze``: inputs of two are never merged.

A job's files legitimately come from several hosts and several processes (one
per rank), and after a restart from new processes: a restart round is another
*run* of the same job.  What tells them apart, by input:

- a bundle or a kept run folder: its journal's workers (torchrun's run id,
  ``TORCHELASTIC_RUN_ID``, or under static rendezvous ("none") the store
  ``MASTER_ADDR:MASTER_PORT``; the restart count; hosts and pids; when the
  sidecar saw them).  Every file in it is of that run of that node;
- an NCCL debug file: its ``host:pid`` prefixes and the ``commId`` of its
  communicators (random per communicator: ranks that share one are one run);
- a Flight Recorder dump: when it enqueued each collective (it names no
  process): the ranks of one run enqueue a collective within a step of each
  other, two runs seconds apart at least (``SAME_RUN_NS``).

Inputs that share a container, a ``commId`` or a process are one run; runs
of one job and round whose times overlap are one run (the nodes of a
multi-node job).  ``choose`` then decides: runs of two different jobs are
refused (``MixedJobs``: no one verdict can be right); several runs of one job
(restart rounds) are judged by the newest alone, and the others are set
aside, said in the report; so are a kept run folder's NCCL files whose
processes its journal names as workers of an earlier round.  NCCL logs that no journal names stay with the
judged run: their communicators are their own, so the engine judges each apart
(``JobState.jobs``: "logs of 2 jobs found ... the verdict is the most
severe").  Inputs that carry nothing of their own (py-spy and NVML dumps,
PyTorch's messages) go with the judged run; a Flight Recorder dump goes with
the run whose time it falls in.  Loose dumps of several runs would be read as
one (every run names its default group ``0``): the newest run's are judged.

Failure modes: an input that cannot be read has no identity (the ingest says
why); nothing here raises on bad input.
"""

from __future__ import annotations

import datetime as dt
import lzma
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ncclwatch.watchdog.events import ProcKey, WorkerSeen
from ncclwatch.watchdog.inputs import STDIN, open_input
from ncclwatch.watchdog.parsing import SNIFF_BYTES
from ncclwatch.watchdog.parsing.flight_recorder import collective_times, looks_like_flight_recorder
from ncclwatch.watchdog.parsing.journal import looks_like_journal, parse_journal

STATIC_RUN_ID = "none"  # torchrun's run id under static rendezvous: the same for every job
# Two dumps are of one run when some collective of theirs was enqueued this close on both: the ranks of a run
# issue each collective within a step of each other, and a restart or another launch is seconds later at least.
SAME_RUN_NS = 5_000_000_000


@dataclass
class Identity:
    """What an input, or a run of inputs, says of who wrote it."""

    jobs: set[str] = field(default_factory=set)  # torchrun's run id, else "store <addr:port>"
    rounds: set[int] = field(default_factory=set)  # restart counts
    procs: set[ProcKey] = field(default_factory=set)
    comm_ids: set[str] = field(default_factory=set)
    first: float | None = None  # wall-clock seconds: the earliest and latest moment the input shows
    last: float | None = None
    modified: float | None = None  # the file's mtime: when nothing inside says a time
    journal: bool = False  # a sidecar's journal: its folder is one run of one node
    marks: dict[tuple[str, int], int] = field(default_factory=dict)  # a dump's (group, collective) -> enqueued, ns
    earlier: dict[ProcKey, int] = field(default_factory=dict)  # a journal's workers of its earlier rounds -> round

    def add(self, other: Identity) -> None:
        self.jobs |= other.jobs
        self.rounds |= other.rounds
        self.procs |= other.procs
        self.comm_ids |= other.comm_ids
        self.earlier |= other.earlier
        for moment in (other.first, other.last):
            self.seen(moment)
        if other.modified is not None:
            self.modified = max(self.modified or other.modified, other.modified)

    def seen(self, moment: float | None) -> None:
        if moment is None:
            return
        self.first = moment if self.first is None else min(self.first, moment)
        self.last = moment if self.last is None else max(self.last, moment)

    @property
    def bare(self) -> bool:
        """Nothing that places it in one run."""
        return not (self.jobs or self.procs or self.comm_ids)

    def span(self) -> tuple[float, float] | None:
        if self.first is not None and self.last is not None:
            return self.first, self.last
        return (self.modified, self.modified) if self.modified is not None else None


def identify(name: str, stdin_spool: dict[str, str], dumps: bool = False) -> Identity:
    """What ``name`` says of its job and run: from a journal, the head of an NCCL debug file, or (``dumps``) the
    entry times of a Flight Recorder dump (parsed whole, so only when several runs must be told apart)."""
    found = Identity()
    try:
        if name != STDIN:
            found.modified = os.stat(name).st_mtime
        with open_input(name, stdin_spool) as (handle, _):
            head = handle.read(SNIFF_BYTES)
            if looks_like_journal(head):
                found.journal = True
                _from_journal(found, head + handle.read(), name)
            elif looks_like_flight_recorder(head):
                if dumps:
                    _from_dump(found, head + handle.read())
            elif b" NCCL " in head:
                _from_nccl(found, head)
    except (OSError, EOFError, lzma.LZMAError):
        pass  # the ingest says why it cannot be read
    return found


def _from_journal(found: Identity, data: bytes, name: str) -> None:
    """A run folder's journal runs on across restarts: the run is its latest round's (the bundle was written for
    that round's hang), from that round's first worker on."""
    events = parse_journal(data, name)
    workers = [e for e in events if isinstance(e, WorkerSeen)]
    if not workers:
        return
    latest = max(w.restart_count for w in workers)
    for worker in workers:
        if worker.restart_count < latest:
            found.earlier[ProcKey(worker.host, worker.pid)] = worker.restart_count
        else:
            found.procs.add(ProcKey(worker.host, worker.pid))
            if worker.run_id and worker.run_id != STATIC_RUN_ID:
                found.jobs.add(worker.run_id)
            elif worker.store:
                found.jobs.add(f"store {worker.store}")
    found.rounds.add(latest)
    began = min(w.at for w in workers if w.restart_count == latest)
    for event in events:
        moment = getattr(event, "at", None)
        if moment is not None and moment >= began:
            found.seen(moment)


# NCCL's line prefix ``host:pid:tid [cudaDev] NCCL``, wherever a launcher's own prefix put it in the line; the
# host tried only where a name starts, at most 253 characters (a 1 MiB run of name characters is one try, not 1 M)
_NCCL_PROC = re.compile(rb"(?<![\w.-])([\w.-]{1,253}):(\d+):\d+ \[\d+\] NCCL ")
_COMM_ID = re.compile(rb"commId (0x[0-9a-fA-F]+)")


def _from_nccl(found: Identity, head: bytes) -> None:
    """The processes and communicators of the Init lines in ``head`` (where a process's NCCL lines begin), or the
    first NCCL line's process in an excerpt without them: a few regular expressions, not the parser, since every
    NCCL log of a large job is read this way before it is ingested."""
    for line in _init_lines(head):
        proc, comm = _NCCL_PROC.search(line), _COMM_ID.search(line)
        if proc is not None:
            found.procs.add(ProcKey(proc[1].decode(errors="replace"), int(proc[2])))
        if comm is not None:
            found.comm_ids.add(comm[1].decode())
    if not found.procs and (first := _NCCL_PROC.search(head)) is not None:
        found.procs.add(ProcKey(first[1].decode(errors="replace"), int(first[2])))


def _init_lines(head: bytes) -> Iterator[bytes]:
    """Each line that names a commId."""
    at = head.find(b"commId 0x")
    while at != -1:
        end = head.find(b"\n", at)
        yield head[head.rfind(b"\n", 0, at) + 1 : end if end != -1 else None]
        at = head.find(b"commId 0x", end) if end != -1 else -1


def _from_dump(found: Identity, data: bytes) -> None:
    found.marks = collective_times(data)
    for created in (min(found.marks.values(), default=None), max(found.marks.values(), default=None)):
        found.seen(created / 1e9 if created is not None else None)


@dataclass
class Run:
    """Inputs of one run of one job: their indices, what they say together, and a name for a person."""

    members: list[int]
    identity: Identity
    where: str  # the bundle, run folder or first file it came from
    dumps_only: bool = False  # loose Flight Recorder dumps, told apart by their collectives' times alone

    def describe(self) -> str:
        who = self.identity
        parts = []
        if who.jobs:
            parts.append("job " + ", ".join(sorted(_short(j) for j in who.jobs)))
        if who.rounds:
            parts.append("restart round " + ", ".join(map(str, sorted(who.rounds))))
        hosts = sorted({p.host for p in who.procs})
        if hosts:
            parts.append("host" + ("s " if len(hosts) > 1 else " ") + ", ".join(hosts[:4]) + _more(hosts, 4))
        pids = sorted({p.pid for p in who.procs})
        if pids:
            parts.append("pid" + ("s " if len(pids) > 1 else " ") + ", ".join(map(str, pids[:6])) + _more(pids, 6))
        span = who.span()
        if span is not None:
            parts.append(_utc(span[0]) + ("" if _utc(span[1]) == _utc(span[0]) else f" to {_utc(span[1])}"))
        return f"{self.where} ({'; '.join(parts) or 'nothing says which job'})"


def _short(job: str) -> str:
    return job if job.startswith("store ") or len(job) <= 13 else job[:8]


def _more(items: Sequence[object], shown: int) -> str:
    return f" and {len(items) - shown} more" if len(items) > shown else ""


def _utc(moment: float) -> str:
    return dt.datetime.fromtimestamp(moment, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def group_runs(identities: Sequence[Identity], containers: Sequence[str | None], names: Sequence[str]) -> list[Run]:
    """The runs among the inputs (``containers``: the bundle or run folder each came in, None for a loose file);
    bare inputs outside any container are left out (``choose`` places them)."""
    parent = list(range(len(identities)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        parent[find(i)] = find(j)

    first_of: dict[object, int] = {}
    for index, (who, container) in enumerate(zip(identities, containers)):
        keys: list[object] = [("container", container)] if container is not None else []
        keys += [("comm", c) for c in who.comm_ids] + [("proc", p) for p in who.procs]
        for key in keys:
            union(index, first_of.setdefault(key, index))
    components: dict[int, list[int]] = {}
    for index, (who, container) in enumerate(zip(identities, containers)):
        if container is not None or not who.bare:
            components.setdefault(find(index), []).append(index)
    runs = []
    for members in components.values():
        together = Identity()
        for index in members:
            together.add(identities[index])
        runs.append(Run(members, together, containers[members[0]] or _files([names[i] for i in members])))
    dumps = [i for i, who in enumerate(identities) if containers[i] is None and who.bare and who.marks]
    for members in _dump_runs(dumps, identities):
        together = Identity()
        for index in members:
            together.add(identities[index])
        runs.append(Run(members, together, _files([names[i] for i in members]), dumps_only=True))
    return _join_nodes(runs)


def _dump_runs(dumps: list[int], identities: Sequence[Identity]) -> list[list[int]]:
    """Loose Flight Recorder dumps by run: a dump joins the first run with a collective it enqueued within
    ``SAME_RUN_NS`` of when that run did; one that shares no collective with a run is not told apart from it."""
    runs: list[tuple[list[int], dict[tuple[str, int], int]]] = []
    for index in dumps:
        marks = identities[index].marks
        home = next((run for run in runs if _same_dumps(marks, run[1])), None)
        if home is None:
            runs.append(([index], dict(marks)))
        else:
            home[0].append(index)
            for key, created in marks.items():
                home[1].setdefault(key, created)
    return [members for members, _ in runs]


def _same_dumps(marks: dict[tuple[str, int], int], run: dict[tuple[str, int], int]) -> bool:
    common = marks.keys() & run.keys()
    return not common or min(abs(marks[key] - run[key]) for key in common) < SAME_RUN_NS


def _files(names: list[str]) -> str:
    """Loose files as a person finds them: the one file, or the folder they share and how many."""
    if len(names) == 1:
        return names[0]
    shared = os.path.commonpath(names) if all(n != STDIN for n in names) else ""
    return f"{shared or names[0]}/ ({len(names)} files)"


def _join_nodes(runs: list[Run]) -> list[Run]:
    """Runs of one job and round whose times overlap are its nodes: one run."""
    joined: list[Run] = []
    for run in sorted(runs, key=lambda r: r.members[0]):
        into = next((j for j in joined if _same_run(j.identity, run.identity)), None)
        if into is None:
            joined.append(run)
            continue
        into.members += run.members
        into.identity.add(run.identity)
        into.where += f", {run.where}"
    return joined


def _same_run(a: Identity, b: Identity) -> bool:
    if not (a.jobs & b.jobs) or a.rounds != b.rounds or a.first is None or b.first is None:
        return False
    return a.first <= (b.last or b.first) and b.first <= (a.last or a.first)


EXIT_MIXED_JOBS = 5  # analyze: the inputs hold files of different jobs, so no report (beside hang/report.py's)


class MixedJobs(ValueError):
    """Inputs of two or more different jobs: refused, with the runs named."""

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = list(runs)
        described = "; ".join(run.describe() for run in runs)
        super().__init__(
            f"inputs of {len(runs)} different jobs, not judged together: {described}. Give one job's files at a time"
        )


@dataclass
class Choice:
    """Which inputs are set aside and why, and what the report says of it; the others are judged."""

    set_aside: dict[int, str]  # input index -> note
    note: str | None


def choose(runs: Sequence[Run], identities: Sequence[Identity]) -> Choice:
    """Runs a journal names: of different jobs, ``MixedJobs``; of one job, the newest (its latest restart round,
    then the latest time) is judged and the others set aside, and so are the files of a run folder's earlier
    rounds.  Everything else is judged with it: NCCL logs that no journal names keep their own communicators
    (the engine judges each apart and says how many jobs it found), and a Flight Recorder dump goes with the
    run whose time it falls in."""
    rounds = _earlier_rounds(runs, identities)
    named = [run for run in runs if run.identity.jobs]
    if len(named) <= 1:
        dumps = _newest_dumps([run for run in runs if run.dumps_only])
        return Choice(rounds.set_aside | dumps.set_aside, "; ".join(filter(None, (rounds.note, dumps.note))) or None)
    jobs = [frozenset(run.identity.jobs) for run in named]
    if not frozenset.intersection(*jobs):
        raise MixedJobs(named)
    newest = max(named, key=_recency)
    others = [run for run in named if run is not newest]
    set_aside = {index: f"set aside: of an older run, {run.describe()}" for run in others for index in run.members}
    for index in sorted(set(range(len(identities))) - set_aside.keys() - set(newest.members)):
        span = identities[index].span() if identities[index].first is not None else None
        elsewhere = next((run for run in others if _overlaps(span, run.identity.span())), None)
        if elsewhere is not None and not _overlaps(span, newest.identity.span()):
            set_aside[index] = f"set aside: its times fall in an older run, {elsewhere.describe()}"
    note = (
        f"the inputs hold {len(named)} restart rounds of one job: judged the newest, {newest.describe()}; "
        f"set aside {len(set_aside)} input(s) of " + "; ".join(run.describe() for run in others)
    )
    return Choice(rounds.set_aside | set_aside, "; ".join(filter(None, (rounds.note, note))))


def _earlier_rounds(runs: Sequence[Run], identities: Sequence[Identity]) -> Choice:
    """A run folder's journal runs on across restarts, and its NCCL files of every round lie side by side
    (``nccl/<host>.<pid>``): the files whose processes are all workers of an earlier round are set aside."""
    set_aside: dict[int, str] = {}
    said = []
    for run in runs:
        earlier = run.identity.earlier
        old = [i for i in run.members if identities[i].procs and identities[i].procs <= earlier.keys()]
        for index in old:
            number = max(earlier[proc] for proc in identities[index].procs)
            set_aside[index] = (
                f"set aside: of restart round {number}, its processes the journal's workers of that round; "
                f"round {max(run.identity.rounds)} is judged"
            )
        if old:
            said.append(f"{run.where}: {len(old)} file(s) of earlier restart rounds set aside")
    return Choice(set_aside, "; ".join(said) or None)


def _newest_dumps(runs: list[Run]) -> Choice:
    """Loose Flight Recorder dumps of several runs: process groups are named alike in every run (``0``), so
    they would be read as one; the newest run's dumps are judged, the others set aside."""
    if len(runs) <= 1:
        return Choice({}, None)
    newest = max(runs, key=_recency)
    others = [run for run in runs if run is not newest]
    set_aside = {
        index: f"set aside: a Flight Recorder dump of an older run, {run.describe()}"
        for run in others
        for index in run.members
    }
    note = (
        f"the Flight Recorder dumps are of {len(runs)} runs (the same collectives enqueued "
        f"{SAME_RUN_NS / 1e9:g} s or more apart): judged the newest, {newest.describe()}; set aside "
        + "; ".join(run.describe() for run in others)
    )
    return Choice(set_aside, note)


def _recency(run: Run) -> tuple[int, float]:
    span = run.identity.span()
    return max(run.identity.rounds, default=0), span[1] if span else float("-inf")


def _overlaps(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]
