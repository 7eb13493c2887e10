"""The failure stage: a job that died, not hung.  Which rank departed first, and why.

Runs when the job ended failed (``JobEnded``, torchrun's summary) or a rank exited non-zero of its own cause;
a job that ended cleanly, was stopped by the user, or was ended by ncclwatch's own response is none of its
business.  ``FAILURE_RULES`` are tried in order, each ``fn(snapshot, finding) -> Finding | None`` with
``finding`` the sequences' verdict (``job_rules.job_finding``); the first that answers decides:

- ``sequences_mismatch``: the sequences (NCCL logs, Flight Recorder) found a ``collective_mismatch``: it names the
  rank that issued the different operation, not the rank whose transport caught it and aborted first;
- ``died_of_its_own``: the first rank that died of its own cause (a Python exception, CUDA OOM, a CUDA error, a
  signal such as SIGKILL or SIGSEGV, an exit code with no peer to blame) is ``process_dead``, in
  ``live_rules.dead``'s shape; an exception its own code raised (``ValueError`` in the user's file) or an exit it
  chose (``sys.exit(3)``) is said to be the user's, not a collective fault (``kind``);
- ``transport_mismatch``: a transport caught two ranks' operations differing (gloo's size enforce, NCCL's
  ``message truncated``): ``collective_mismatch``; the reporter is a suspect, not the culprit (the victim posts
  the smaller buffer as often as the culprit does);
- ``timed_out``: ranks timed out in a collective (PyTorch's watchdog, gloo): ``collective_timeout`` naming the
  ranks that did not time out (they never entered it);
- ``root_cause``: otherwise torchrun's root cause, as ``process_dead``.

Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ncclwatch.watchdog.events import FailureKind, JobOutcome, RankExited, RankFailure
from ncclwatch.watchdog.hang.rules import Rule, first_fired
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

# Signals torchrun (or the user, through it) sends to end the ranks: a rank ended by one did not fail of itself.
TEARDOWN_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
# What a rank's own output says it died of, its own cause (its peers' failures say they waited for it).
OWN_CAUSES = (FailureKind.out_of_memory, FailureKind.cuda_error, FailureKind.exception)
WAITED = (FailureKind.peer_gone, FailureKind.collective_timeout, FailureKind.size_mismatch, FailureKind.nccl_error)
SIGNAL_MEANING = {
    "SIGKILL": "killed by SIGKILL (the kernel's OOM killer, see dmesg, or a scheduler or user)",
    "SIGSEGV": "crashed with SIGSEGV (a segmentation fault in native code: a custom op, a driver, a library)",
    "SIGBUS": "crashed with SIGBUS (a bad memory access: shared memory too small, a truncated mmap'd file)",
    "SIGABRT": "aborted (SIGABRT: a C++ exception or assertion)",
    "SIGFPE": "crashed with SIGFPE",
    "SIGILL": "crashed with SIGILL",
}

FailureRule = Rule[Callable[[Snapshot, Finding], Finding | None]]


def job_failed(snapshot: Snapshot) -> bool:
    """The job ended failed, or a rank exited non-zero of its own accord (not torchrun's teardown)."""
    ended = snapshot.ended
    if ended is not None:
        return ended.outcome is JobOutcome.failed
    return any(_failed_itself(e) for e in snapshot.exits)


def failure_finding(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """Why the job died, by the first rule of ``FAILURE_RULES`` that answers; None when the job did not fail."""
    if not job_failed(snapshot):
        return None
    return first_fired(FAILURE_RULES, snapshot, finding)


def _failed_itself(exited: RankExited) -> bool:
    return exited.exitcode != 0 and exited.signal not in TEARDOWN_SIGNALS


def _by_rank(snapshot: Snapshot) -> dict[int | None, list[RankFailure]]:
    """Each rank's failures.  A line without a rank (C++'s ``terminate called ... what(): ...``, gloo's enforce,
    printed without torch's prefix) is the aborted rank's, where exactly one rank died of SIGABRT."""
    aborted = [e.rank for e in snapshot.exits if e.signal == "SIGABRT"]
    by_rank: dict[int | None, list[RankFailure]] = {}
    for failure in snapshot.rank_failures:
        rank = aborted[0] if failure.rank is None and len(aborted) == 1 else failure.rank
        by_rank.setdefault(rank, []).append(failure)
    return by_rank


def _ranks(snapshot: Snapshot) -> set[int]:
    """The job's ranks as far as torchrun's summary and the workers seen say."""
    return {e.rank for e in snapshot.exits} | {w.rank for w in snapshot.workers}


def _departures(snapshot: Snapshot) -> tuple[Fact, ...]:
    """What each rank's output and exit say, for the evidence: who aborted first, and of what."""
    facts = [
        Fact("stderr", f"rank {f.rank if f.rank is not None else '?'}: {f.kind.value}: {f.detail[:200]}", f.cite)
        for f in snapshot.rank_failures
    ]
    for exited in sorted(snapshot.exits, key=lambda e: (not e.root_cause, e.rank)):
        how = f"signal {exited.signal}" if exited.signal else f"exit code {exited.exitcode}"
        first = " (torchrun's root cause: the first observed failure)" if exited.root_cause else ""
        facts.append(Fact("torchrun", f"rank {exited.rank} ended with {how}{first}", exited.cite))
    return tuple(facts)


def sequences_mismatch(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """The sequences name who issued the different operation; the job's death is added to its evidence."""
    if finding.verdict is not Verdict.collective_mismatch:
        return None
    aborted = sorted(f.rank for f in snapshot.rank_failures if f.kind in WAITED and f.rank is not None)
    said = f" The job then died: rank {', '.join(map(str, dict.fromkeys(aborted)))} aborted in it." if aborted else ""
    return replace(finding, summary=finding.summary + said, evidence=finding.evidence + _departures(snapshot))


def _own_cause(snapshot: Snapshot) -> list[tuple[int, str, RankFailure | None, RankExited | None]]:
    """(rank, kind, its failure line, its exit) of every rank that died of its own cause, first first."""
    by_rank = _by_rank(snapshot)
    exits = {e.rank: e for e in snapshot.exits}
    found = []
    for rank in sorted({r for r in by_rank if r is not None} | set(exits)):
        failures = by_rank.get(rank, [])
        exited = exits.get(rank)
        own = next((f for kind in OWN_CAUSES for f in failures if f.kind is kind), None)
        if own is not None:
            kind = "user_exception" if own.own_code else own.kind.value
            found.append((rank, kind, own, exited))
        elif any(f.kind in WAITED for f in failures) or exited is None or not _failed_itself(exited):
            continue
        elif exited.signal is not None:
            found.append((rank, "signal", None, exited))
        else:
            found.append((rank, "exit", None, exited))
    # torchrun's root cause first, then by time where known
    found.sort(key=lambda d: (not (d[3] is not None and d[3].root_cause), _when(d[2], d[3])))
    return found


def _when(failure: RankFailure | None, exited: RankExited | None) -> float:
    times = [t for t in (failure.at if failure else None, exited.at if exited else None) if t is not None]
    return min(times, default=float("inf"))


def died_of_its_own(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """The first rank that died of its own cause is ``process_dead`` (``live_rules.dead``'s shape)."""
    dead = _own_cause(snapshot)
    if not dead:
        return None
    rank, kind, failure, exited = dead[0]
    if kind == "exit":
        return _chose_to_stop(rank, exited, snapshot, finding)  # type: ignore[arg-type]
    where = f" in {failure.frame}" if failure is not None and failure.frame else ""
    if kind == "user_exception":
        what = f"raised {failure.detail}{where}: its own code raised it, not a collective"  # type: ignore[union-attr]
    elif failure is not None:
        what = f"died of {failure.kind.value.replace('_', ' ')}: {failure.detail}{where}"
    else:  # a signal
        what = SIGNAL_MEANING.get(exited.signal or "", f"ended by {exited.signal}")  # type: ignore[union-attr]
    others = sorted({f.rank for f in snapshot.rank_failures if f.rank not in (None, rank) and f.kind in WAITED})
    then = f" Rank {', '.join(map(str, others))} then failed waiting for it." if others else ""
    return replace(
        finding,
        verdict=Verdict.process_dead,
        culprits=(rank,),
        kind=kind,
        summary=f"Rank {rank} {what}; the job died of it.{then}",
        reason="The first rank to die of its own cause ended the job; its peers' errors (a closed connection, a "
        "timeout) say they were waiting for it.",
        evidence=_departures(snapshot),
        suspects=(),
    )


def _chose_to_stop(rank: int, exited: RankExited, snapshot: Snapshot, finding: Finding) -> Finding:
    """The first rank to go exited with a code of its own, no exception, no signal, no error line (``sys.exit(3)``):
    the program chose to stop, and its peers' errors only say they lost it.  No incident (issue 44)."""
    return replace(
        finding,
        verdict=Verdict.no_hang,
        culprits=(),
        suspects=(),
        kind="exit",
        summary=f"Rank {rank} exited with code {exited.exitcode} of its own (sys.exit or os._exit in its code; no "
        "exception, signal or error printed): the program chose to stop, so this is no incident.",
        reason="A rank's own exit with no error is the program's decision; the other ranks' errors (a closed "
        "connection, a timeout) say only that they lost it.",
        evidence=_departures(snapshot),
    )


def transport_mismatch(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """A transport caught two ranks' operations differing: a mismatch whose side stderr alone cannot tell."""
    caught = [f for f in snapshot.rank_failures if f.kind is FailureKind.size_mismatch]
    if not caught:
        return None
    reporters = sorted(
        r for r, failures in _by_rank(snapshot).items() if r is not None and any(f in caught for f in failures)
    )
    ranks = ", ".join(map(str, reporters)) or "a rank"
    if (singled := _singled_out(snapshot, finding, reporters)) is not None:
        return singled
    return replace(
        finding,
        verdict=Verdict.collective_mismatch,
        culprits=(),
        suspects=tuple(reporters),
        summary=f"The transport of rank {ranks} caught two ranks' operations differing and aborted the job: "
        f"{caught[0].detail[:200]}",
        reason="The rank whose receive was too small reports it, whether it or its peer issued the other "
        "operation: the Flight Recorder dumps or NCCL logs of the ranks say which rank departed.",
        evidence=_departures(snapshot),
        missing=("which rank issued the different operation: the ranks' Flight Recorder dumps or NCCL logs",),
    )


def _singled_out(snapshot: Snapshot, finding: Finding, reporters: list[int]) -> Finding | None:
    """The one rank that caught the mismatch is also the one the sequences set apart from all the others (3 ranks or
    more): the others agree with each other, so the operation that differed was the reporter's.  gloo aborts the
    reporter in C++ (no dump of its last operations); its peers' dumps, written as they died, still agree."""
    world = _ranks(snapshot)
    if len(reporters) != 1 or len(world) < 3 or tuple(finding.culprits) != tuple(reporters):
        return None
    if finding.verdict not in (Verdict.stuck_in_collective, Verdict.rank_behind, Verdict.collective_mismatch):
        return None
    rank = reporters[0]
    others = ", ".join(str(r) for r in sorted(world) if r != rank)
    return replace(
        finding,
        verdict=Verdict.collective_mismatch,
        culprits=(rank,),
        suspects=(),
        summary=f"Rank {rank} issued an operation that differs from ranks {others}, which agree with each other; its "
        "transport caught the sizes differing and aborted the job.",
        reason="Ranks that all agree did not depart; the one rank the sequences set apart, which also caught the "
        "mismatch, did.",
        evidence=finding.evidence + _departures(snapshot),
    )


def timed_out(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """Ranks timed out in a collective: the ranks that did not never entered it."""
    timeouts = [f for f in snapshot.rank_failures if f.kind is FailureKind.collective_timeout and f.rank is not None]
    if not timeouts:
        return None
    waited = sorted({f.rank for f in timeouts})  # type: ignore[type-var]
    world = _ranks(snapshot) | set(waited)
    behind = tuple(finding.culprits) if finding.verdict is Verdict.rank_behind and finding.culprits else ()
    never = behind or tuple(sorted(world - set(waited)))
    first = timeouts[0]
    op = f" {first.op} (sequence number {first.seq})" if first.op else " their collective"
    named = f"rank {', '.join(map(str, never))} never entered it" if never else "every rank timed out in it"
    return replace(
        finding,
        verdict=Verdict.collective_timeout,
        culprits=never,
        operation=finding.operation or (f"{first.op} #{first.seq}" if first.op else None),
        summary=f"Rank {', '.join(map(str, waited))} timed out in{op} and the job died; {named}.",
        reason="A collective completes only when every rank of the group has entered it: the ranks that timed out "
        "waited for the others.",
        evidence=_departures(snapshot) + finding.evidence,
    )


def root_cause(snapshot: Snapshot, finding: Finding) -> Finding | None:
    """torchrun's first observed failure, where nothing else tells."""
    first = next((e for e in snapshot.exits if e.root_cause), None)
    if first is None:
        return None
    said = [f.kind for f in _by_rank(snapshot).get(first.rank, [])]
    if said and all(kind is FailureKind.peer_gone for kind in said):
        return None  # it only lost a peer (on another node, out of this output's sight): not the cause
    how = f"signal {first.signal}" if first.signal else f"exit code {first.exitcode}"
    return replace(
        finding,
        verdict=Verdict.process_dead,
        culprits=(first.rank,),
        kind="signal" if first.signal else "exit",
        summary=f"Rank {first.rank} failed first ({how}, torchrun's root cause); its output says no more.",
        reason="torchrun's first observed failure; no rank's output names another cause.",
        evidence=_departures(snapshot),
    )


FAILURE_RULES: tuple[FailureRule, ...] = (
    Rule("sequences_mismatch", sequences_mismatch),
    Rule("died_of_its_own", died_of_its_own),
    Rule("transport_mismatch", transport_mismatch),
    Rule("timed_out", timed_out),
    Rule("root_cause", root_cause),
)
