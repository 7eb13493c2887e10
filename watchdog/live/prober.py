"""What the sidecar looks at when a stall is suspected: dumps, stacks, GPUs, in parallel.

``JobProber`` asks every rank that can answer for a Flight Recorder dump,
takes non-blocking py-spy stacks of every rank and (except on the
confirming look, which reuses it) an NVML sample.  Each piece is bounded in
time; one that fails is a missing piece of evidence (logged), never an
exception: the classifier then sees less, and says so ("blind").
A stopped rank is not asked for a dump: it cannot answer, and waiting for
it would only delay the verdict.  Once NCCL has reported a communicator
error in the job's logs (a network WARN: "message truncated", "remote
process exited"), dumps are waited for ``ERRORED_DUMP_WAIT_S``
instead of ``DUMP_WAIT_S``: on the H100 suite no rank answered within 3 s
in that state (torch's watchdog is busy failing the communicator), and the
NCCL logs already hold the sequences the verdict needs.

NCCL RAS is asked once per incident, on its first look, and only when the
job's NCCL version is known and not one whose RAS thread was seen crashing
the job when asked (``RAS_CRASHES``): a watchdog must not kill the job it
watches.  When it is not asked, the report's notes say why, once.

``Probing`` is one probe as the sidecar takes it: the ``Prober``'s events are
folded into the ``LiveJob``; a rank whose Flight Recorder shows more
collectives issued than at the incident's previous look moved, which is
progress (marked in the job), never a hang; the ``Stall`` the decision is
judged at is folded in too and written to the journal with the job's inputs,
so ``ncclwatch analyze`` replays the same decision offline.  Before any
stall, once the job has a rhythm, the ranks are asked for their first dumps,
and the gaps that may cause are excused.  Without a journal nothing is
written.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import STOPPED_STATES, Citation, Event, NcclWarning, Stall, Unusable, WarningCategory
from ncclwatch.watchdog.hang.live_rules import sampled_since
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.incident import Probe
from ncclwatch.watchdog.live.job import MIN_PROGRESS, LiveJob, LiveView
from ncclwatch.watchdog.live.journal import Journal
from ncclwatch.watchdog.live.judging import GPU_HANG_SETTLED_S, GPU_SPIN_SETTLED_S, Judging, Proof
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy
from ncclwatch.watchdog.parsing.ras import parse_ras
from ncclwatch.watchdog.probes.flight_recorder import prime, read_dump, request_dumps, written_since
from ncclwatch.watchdog.probes.nvml import gpu_snapshot

log = logging.getLogger("ncclwatch")

STACK_TIMEOUT_S = 5.0
# A rank's first dump takes 4-5 s (H200: torch symbolises its C++ stacks) and can hold up its training thread;
# the job's gaps in that time are ours, not its rhythm, and do not widen the learned stall timeout.
PRIME_EXCUSE_S = 10.0
DUMP_WAIT_S = 3.0  # a primed rank dumps in 0.02-1 s (H200, H100)
ERRORED_DUMP_WAIT_S = 1.0
RAS_QUERY_S = 4.0  # the whole query; RAS answers in milliseconds when it answers at all
RAS_SERVER_TIMEOUT_S = 3  # how long the RAS server waits for its peers before replying
RAS_FIRST = (2, 24, 0)  # NCCL starts a RAS thread from 2.24
# [first affected, first fixed) -> what was seen.  From NVIDIA/nccl's issues; a range with no
# fixed release ends at the next version, the only one reported, and is to be widened if seen again.
RAS_CRASHES: tuple[tuple[tuple[int, int, int], tuple[int, int, int], str], ...] = (
    (
        (2, 24, 0),
        (2, 27, 3),
        "a RAS report during communicator initialization crashes the process "
        "(NVIDIA/nccl#1669, #1718; fixed in 2.27.3)",
    ),
    (
        (2, 27, 3),
        (2, 29, 2),
        "VERBOSE STATUS can corrupt memory and crash the job (NVIDIA/nccl#1762, fixed in 2.29.2; "
        "2.27.7 also segfaults inside RAS, #1996)",
    ),
    ((2, 29, 7), (2, 29, 8), "a RAS report while a communicator initializes can segfault (NVIDIA/nccl#2346, open)"),
)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")  # "2.28.9+cuda13.0"


def ras_skip_reason(versions: Collection[str]) -> str | None:
    """Why RAS must not be asked for this job's NCCL versions; None when it is safe to ask."""
    if not versions:
        return (
            "not queried: no NCCL version in the job's NCCL logs (a gloo job, or none written yet), "
            "and RAS queries crash several NCCL versions"
        )
    for text in sorted(versions):
        match = _VERSION.match(text)
        if match is None:
            return f"not queried: NCCL version {text!r} could not be read, and RAS queries crash several NCCL versions"
        version = tuple(map(int, match.groups()))
        if version < RAS_FIRST:
            return f"not queried: NCCL {text} has no RAS (2.24+)"
        for first, fixed, seen in RAS_CRASHES:
            if first <= version < fixed:
                return f"not queried: on NCCL {text} {seen}"
    return None


def comm_errored(warnings: Sequence[NcclWarning]) -> bool:
    """Whether NCCL reported a network failure of a communicator (its WARN lines), so dumps are unlikely."""
    return any(warning.category is WarningCategory.network for warning in warnings)


class Prober(Protocol):
    async def probe(
        self,
        workers: Sequence[WorkerView],
        with_gpus: bool,
        stalled_since: float | None = None,
        peek: bool = False,
        after_proof: bool = False,
    ) -> list[Event]: ...

    def prime(self, workers: Sequence[WorkerView]) -> int: ...

    async def gpus(self) -> list[Event]: ...  # one GPU sample now (none without NVML)

    def dumps_left(self, workers: Sequence[WorkerView], since: float) -> list[Event]: ...


class JobProber:
    def __init__(
        self,
        fr_dir: Path,
        pyspy: str | None,
        ras_port: int | None = None,
        nccl_versions: Callable[[], Collection[str]] = tuple,
        nccl_errored: Callable[[], bool] = bool,
        nccl_logged: Callable[[], bool] = lambda: True,
    ) -> None:
        """``ras_port`` None: never ask RAS; ``nccl_versions``: the job's NCCL versions as its logs say them;
        ``nccl_errored``: whether those logs reported a communicator error (shortens the wait for dumps);
        ``nccl_logged``: whether NCCL wrote any debug file (no: a job without NCCL, no RAS to speak of)."""
        self.fr_dir = fr_dir
        self.pyspy = pyspy
        self.ras_port = ras_port
        self.nccl_versions = nccl_versions
        self.nccl_errored = nccl_errored
        self.nccl_logged = nccl_logged
        self._primed: set[int] = set()  # worker pids whose Flight Recorder was primed
        self._ras_asked_at: tuple[tuple[int, int | None], ...] | None = None  # (pid, step) of each worker then
        self._unanswered: set[int] = set()  # pids whose dump did not come on the last look

    def unanswered(self) -> frozenset[int]:
        """Pids whose Flight Recorder did not answer the latest first look (the bundle does not ask them again)."""
        return frozenset(self._unanswered)

    def prime(self, workers: Sequence[WorkerView]) -> int:
        """Ask each rank for one dump while healthy: the first is slow (seconds), later ones fast.
        How many ranks were asked now (0: all were before)."""
        ranks = {w.rank: w.pid for w in workers if not w.gone}
        if self._primed >= set(ranks.values()):
            return 0
        self._primed |= set(ranks.values())
        asked = prime(self.fr_dir, ranks)
        log.info("primed Flight Recorder of %d rank(s)", asked)
        return asked

    async def gpus(self) -> list[Event]:
        snapshot = await gpu_snapshot()
        return [snapshot] if snapshot is not None else []

    async def probe(
        self,
        workers: Sequence[WorkerView],
        with_gpus: bool,
        stalled_since: float | None = None,
        peek: bool = False,
        after_proof: bool = False,
    ) -> list[Event]:
        """``stalled_since``: when the job last moved; a rank whose dump does not come is read from a dump of it
        already on disk that was written after that (``written_since``), and the report says so.

        ``peek``: a look at a job that may well be healthy (``incident.py``): dumps through ncclwatch's quiet door
        (nothing printed into the job's output), stacks, no GPU sample, no RAS; it leaves no mark on what the
        incident's looks remember (the ranks that did not answer).

        ``after_proof``: the look right after a peek that proved the hang. Every rank dumped through the quiet door
        a second ago, so a rank that does not answer within ``ERRORED_DUMP_WAIT_S`` is read from that dump: on the
        H200, two wrappers, a dtype mismatch, rank 0 was busy with PyTorch's own dump and the page waited the
        whole ``DUMP_WAIT_S`` (3 s of the 6.4-7.0 s to the page) for an answer that never came."""
        alive = [w for w in workers if not w.gone]
        answering = {w.rank: w.pid for w in alive if w.state not in STOPPED_STATES}
        if peek:
            dumps, stacks = await asyncio.gather(
                request_dumps(self.fr_dir, answering, DUMP_WAIT_S, quiet=True),
                asyncio.gather(*(self._stack(w.pid) for w in alive)),
                return_exceptions=True,
            )
            found = [read_dump(path) for path in dumps[0].values()] if isinstance(dumps, tuple) else []
            return [e for events in found + (stacks if isinstance(stacks, list) else []) for e in events]
        if not with_gpus:
            # The confirming look, a second after the first: a rank that could not dump then (its
            # communicator errored, it holds the GIL) will not now; waiting again only delays the page.
            answering = {rank: pid for rank, pid in answering.items() if pid not in self._unanswered}
        dumps, stacks, gpus, ras = await asyncio.gather(
            request_dumps(
                self.fr_dir, answering, ERRORED_DUMP_WAIT_S if after_proof or self.nccl_errored() else DUMP_WAIT_S
            ),
            asyncio.gather(*(self._stack(w.pid) for w in alive)),
            gpu_snapshot() if with_gpus else asyncio.sleep(0),
            self._ras(alive) if with_gpus else asyncio.sleep(0, []),
            return_exceptions=True,
        )
        events: list[Event] = list(ras) if isinstance(ras, list) else []
        if isinstance(dumps, tuple):
            fresh, errors = dumps
            for path in fresh.values():
                events += read_dump(path)
            for rank, error in errors.items():
                log.info("rank %s: no Flight Recorder dump: %s", rank, error)
            if with_gpus:
                self._unanswered = {answering[rank] for rank in errors}
            if stalled_since is not None:
                unasked = {w.rank: w.pid for w in alive if w.rank not in answering}
                events += self._dumps_on_disk({**unasked, **{r: answering[r] for r in errors}}, stalled_since)
        if isinstance(stacks, list):
            events += [event for found in stacks for event in found]
        if gpus is not None and not isinstance(gpus, BaseException):
            events.append(gpus)
        return events

    def dumps_left(self, workers: Sequence[WorkerView], since: float) -> list[Event]:
        """After the job ended: each rank's dump written since ``since`` (PyTorch's own when NCCL failed its
        communicator, the one the rank wrote as it died of an exception, or a probe's), gone ranks included."""
        return self._dumps_on_disk({w.rank: w.pid for w in workers}, since)

    def _dumps_on_disk(self, ranks: dict[int, int], stalled_since: float) -> list[Event]:
        """Ranks (rank -> pid) whose dump did not come now: their dump written since the stall began, if any."""
        events: list[Event] = []
        for rank, pid in sorted(ranks.items()):
            found = written_since(self.fr_dir, rank, pid, stalled_since)
            if found is None:
                continue
            path, mtime = found
            dump = read_dump(path)
            if not dump:
                continue
            when = time.strftime("%H:%M:%S", time.gmtime(mtime))
            why = (
                f"no Flight Recorder dump came from rank {rank} at this probe; its dump already on disk, written at "
                f"{when} UTC, {mtime - stalled_since:.1f} s after the job last moved, was read instead (PyTorch "
                "writes one by itself when NCCL fails a communicator; a peek writes one too)"
            )
            log.info("%s", why)
            events += [*dump, Unusable(reason=why, cite=Citation(file=str(path)))]
        return events

    async def _ras(self, alive: Sequence[WorkerView]) -> list[Event]:
        """One bounded RAS query per incident (its first look), when this NCCL version is safe to ask.

        The sidecar does not say which incident a look belongs to; no worker's step moving and no
        worker restarting since the last query means the same incident, so it is not asked again.
        """
        if self.ras_port is None:
            return []
        seen = tuple(sorted((w.pid, w.step) for w in alive))
        if seen == self._ras_asked_at:
            return []
        self._ras_asked_at = seen
        if not self._nccl_job():
            return []  # a gloo job: a note on NCCL RAS in its report would only puzzle the reader
        cite = Citation(file=f"NCCL RAS 127.0.0.1:{self.ras_port}")
        why = self.ras_withheld()
        if why is not None:
            log.info("RAS %s", why)
            return [Unusable(reason=why, cite=cite)]
        from ncclwatch.watchdog.probes.ras import query_ras

        data, error = await query_ras(
            self.ras_port, json_format=False, timeout_s=RAS_QUERY_S, server_timeout_s=RAS_SERVER_TIMEOUT_S
        )
        events = parse_ras(data, f"{cite.file} (live)") if data else []
        return events + ([Unusable(reason=error, cite=cite)] if error else [])

    def ras_withheld(self) -> str | None:
        """Why RAS must not be asked now, by the probe or the bundle (None: it may be)."""
        if self.ras_port is None:
            return "not queried: no RAS port configured"
        if not self._nccl_job():
            return "not queried: the job wrote no NCCL log (without NCCL there is no RAS)"
        return ras_skip_reason(self.nccl_versions())

    def _nccl_job(self) -> bool:
        return bool(self.nccl_versions()) or self.nccl_logged()

    async def _stack(self, pid: int) -> list[Event]:
        from ncclwatch.watchdog.probes.pyspy import pyspy_dump

        data, error = await pyspy_dump(pid, native=False, timeout_s=STACK_TIMEOUT_S, pyspy=self.pyspy)
        if data is None:
            log.info("py-spy on pid %s: %s", pid, error)
            return []
        return parse_pyspy(data, f"py-spy pid {pid} (live)")


QUIET_LOG_S = 10.0  # -v: every this many seconds of a quiet job, its stall timeout and why


@dataclass(frozen=True)
class Look:
    """What one probe saw."""

    view: LiveView  # the job with the probe's events folded in
    events: list[Event]  # the probe's own (its Flight Recorder dumps travel to the other nodes)
    stall: Stall  # the moment the decision is judged at
    moved: bool  # a rank moved since the look began, or issued a collective since the incident's previous look


class Probing:
    """The probes of this node's ranks, and how many collectives each rank had issued at the latest one."""

    def __init__(
        self,
        prober: Prober,
        live: LiveJob,
        settings: Settings,
        journal: Journal | None,
        clock: Callable[[], float],
        drain: Callable[[], None] = lambda: None,
    ) -> None:
        """``drain``: folds what the sources sent meanwhile into ``live`` (progress during a look is progress)."""
        self.prober = prober
        self.live = live
        self.settings = settings
        self.journal = journal
        self.clock = clock
        self.drain = drain
        self._positions: dict[int, int] | None = None  # collectives each rank had issued at the last look
        self._positions_of: float | None = None  # the incident (its opening time) those positions belong to
        self._quiet_said = 0.0  # how long the job had been quiet when -v last said so
        self._rhythm_said: bool | None = None  # -v: the timeout said for a job without (False) or with (True) rhythm

    def between_probes(self, view: LiveView) -> None:
        """Every tick of a running job.  Below the stall timeout, once the job has a rhythm: the ranks' first
        dumps, the gaps they may cause excused.  With -v: once at the start and once the rhythm is learned, what
        timeout applies and why; every QUIET_LOG_S of a quiet job, its stall timeout, and why it is not probed
        yet (the warm-up timeout, a long gap)."""
        if view.stalled_for < view.stall_timeout and view.learned_gap is not None:
            if self.prober.prime(view.workers):
                self.live.excuse(view.observed_at, PRIME_EXCUSE_S)
        self._say_timeout(view)
        if view.stalled_for >= self._quiet_said + QUIET_LOG_S:
            self._quiet_said = view.stalled_for
            log.info(
                "quiet for %.0f s; stall timeout %.1f s (learned gap %s, %d advances)",
                view.stalled_for,
                view.stall_timeout,
                view.learned_gap,
                view.advances,
            )
        elif view.stalled_for < QUIET_LOG_S:
            self._quiet_said = 0.0

    def _say_timeout(self, view: LiveView) -> None:
        """-v, once without a rhythm (the start) and once with one: after how much silence a hang is paged."""
        rhythm = view.learned_gap is not None and view.advances >= MIN_PROGRESS
        if self._rhythm_said is rhythm or (self._rhythm_said is not None and self.settings.stall_timeout is not None):
            return
        self._rhythm_said = rhythm
        looks = f", looking for it after {view.peek_after:.0f} s of silence" if view.peek_after is not None else ""
        held = f"a GPU held in another kernel for {GPU_HANG_SETTLED_S:.0f} s, {GPU_SPIN_SETTLED_S:.0f} s where it spins"
        proof = f"or at once when the evidence proves it (a mismatch, a dead or stopped rank, {held}{looks})"
        if self.settings.stall_timeout is not None:
            log.info("a hang is paged after %.0f s of silence (--stall-timeout), %s", view.stall_timeout, proof)
        elif not rhythm:
            log.info(
                "no step rhythm yet: a hang is paged after %.0f s of silence (--warmup-stall-timeout, until the job "
                "has shown %d steps), %s",
                view.stall_timeout,
                MIN_PROGRESS,
                proof,
            )
        else:
            log.info(
                "step rhythm learned (longest gap %.2f s): a hang is paged after %.1f s of silence, %s",
                view.learned_gap,
                view.stall_timeout,
                proof,
            )

    async def look(
        self,
        view: LiveView,
        confirming: bool,
        incident_opened_at: float | None,
        peek: bool = False,
        after_proof: bool = False,
    ) -> Look:
        """Probe the ranks of ``view``; the confirming look reuses the GPU sample.  A peek (``incident.py``) asks
        quietly, is not journaled (it decides nothing unless it proves a hang, and the full look that follows is
        journaled) and leaves the incident's positions alone."""
        if not peek and self._positions_of != incident_opened_at:  # each incident compares from its first look
            self._positions, self._positions_of = None, incident_opened_at
        began = self.clock()
        if peek:
            events = await self.prober.probe(view.workers, with_gpus=False, peek=True)
        else:
            # The look after a proving peek that sampled the GPUs in this silence reuses that sample, as the
            # confirming look does: a GPM sample takes a second of the page.
            with_gpus = not confirming and not (after_proof and self._sampled_since(view.last_progress))
            events = await self.prober.probe(
                view.workers, with_gpus=with_gpus, stalled_since=view.last_progress, after_proof=after_proof
            )
        self.drain()
        now, since = self.clock(), view.last_progress
        for event in events:
            self.live.apply(event, now)
        view = self.live.view(now)
        moved = (not peek and self._moved()) or self.live.moved_since(since)
        stall = Stall(
            at=now,
            stalled_for_s=view.stalled_for,
            stall_timeout_s=view.stall_timeout,
            progress_timeout_s=self.settings.progress_timeout,
            probe_began_at=began,
        )
        self.live.apply(stall, now)
        if peek:
            log.info("peek after %.1f s of silence: %d event(s) in %.2f s", view.stalled_for, len(events), now - began)
        elif self.journal is not None:
            self.journal.record(self.live.state, stall)
        return Look(view, events, stall, moved)

    async def decide(
        self, view: LiveView, probe: Probe, opened_at: float | None, judging: Judging, proof: Proof
    ) -> tuple[Look, Decision, bool]:
        """Look, then judge: a peek this node's ranks (only proof counts, ``incident.py``), a probe as the
        ``Judging`` does (the whole job with several nodes); and whether the decision proves the hang."""
        # A peek samples the GPUs beside its look, and waits for the sample only where it sees a GPU hang: the GPM
        # window (a second) then ends about when a spin settles, not a second after the judging.
        sampling = asyncio.ensure_future(self.prober.gpus()) if probe.peek else None
        try:
            look = await self.look(view, probe.confirming, opened_at, peek=probe.peek, after_proof=probe.after_proof)
            if probe.peek:
                decision = await judging.peek(look.stall, look.events)
            else:
                decision = await judging.judge(look.stall, look.events)
            proven_at = look.stall.at
            finding = decision.finding
            if sampling is not None and finding.verdict is Verdict.gpu_compute_hang and finding.kind is None:
                decision, proven_at = await self._peek_gpus(look, judging, sampling) or (decision, proven_at)
        finally:
            if sampling is not None:
                sampling.cancel()  # a sample no rule asked for is dropped; its thread ends on its own
        proven = proof.proves(decision, proven_at, judging.role(decision).state)
        f = decision.finding
        log.info("%s: %s %s page=%s proven=%s held=%s", "peek" if probe.peek else "probe", f.verdict, f.culprits,
                 decision.page, proven, decision.held)  # fmt: skip
        return look, decision, proven

    async def _peek_gpus(
        self, look: Look, judging: Judging, sampling: asyncio.Future[list[Event]]
    ) -> tuple[Decision, float] | None:
        """A peek that sees a GPU hang judges again with the GPU sample it took (the NVML source's own, up to 6 s old,
        may predate the silence): a GPU spinning on almost none of its SMs proves the hang after GPU_SPIN_SETTLED_S,
        not GPU_HANG_SETTLED_S.  With the time the sample ended, which the proof is judged at where nothing moved
        meanwhile: a peek 2.3 s into the silence ends its sample past the 3 s (on 4 x H200 the hang otherwise waited
        for the next peek, 0.5-0.9 s more)."""
        sampled = await sampling
        if not sampled:
            return None
        self.drain()
        now = self.clock()
        for event in sampled:
            self.live.apply(event, now)
        decision = await judging.peek(look.stall, look.events + sampled)
        return decision, look.stall.at if self.live.moved_since(look.view.last_progress) else now

    def _sampled_since(self, since: float) -> bool:
        return any(sampled_since(g, since) for g in self.live.state.gpus)

    def _moved(self) -> bool:
        """Did any rank issue a collective since the last look (Flight Recorder)?  That is progress."""
        positions: dict[int, int] = {}
        for comm in self.live.state.comms.values():
            if comm.source == "flight_recorder":
                for seq in comm.ranks.values():
                    positions[seq.rank] = positions.get(seq.rank, 0) + seq.total
        before, self._positions = self._positions, positions
        moved = {r for r, n in positions.items() if before is not None and n > before.get(r, n)}
        if moved:
            log.info("ranks %s issued collectives since the last look: progress, not a hang", sorted(moved))
            self.live.mark_progress(moved, self.clock())
        return bool(moved)
