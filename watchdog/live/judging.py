"""Who judges a stall, and whether a decision proves a hang by itself.

The sidecar asks its ``Judging`` for the decision at every probe (``judge``) and peek (``peek``), and when it
pages, this node's part (``role``: the state the report is taken from, whether the verdict is the job's, whether
this node follows the leader's page, the incident key) and who pages (``page``).  ``NodeJudging`` is one node
alone: its ranks are the job.  Several nodes judge through the job's store (``job_judging.JobJudging``); what only
they do lives in ``nodes.Nodes``, which the sidecar holds only then.

Proof (``Proof``): which decisions prove a hang by themselves, so the incident pages them at once and without a
second look (``incident.py``), and whether the streamed state (NCCL logs, workers' /proc) already holds one before
any probe.  Across nodes a member's proof only opens its incident: the leader still judges the job and pages.

Failure modes: none of its own; a store that fails is the cluster source down (``CLUSTER``), and the judging of
several nodes falls back to this node's ranks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ncclwatch.watchdog.events import STOPPED_STATES, Event, Stall
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState, Worker
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.hang.verdicts import CONCLUSIVE, Verdict
from ncclwatch.watchdog.live.bundle import live_report
from ncclwatch.watchdog.live.job import LiveJob, LiveView
from ncclwatch.watchdog.response.policy import Plan

log = logging.getLogger("ncclwatch")

CLUSTER = "cluster"  # the source the store's reachability is reported under (``SourceDown``, ``LiveJob.down``)


STREAMED_QUIET_S = 1.0  # the streamed state is judged once the job has been silent this long, when events came
# torchrun ends the other workers when one fails (its monitor looks every 0.1 s, then SIGTERM): a rank gone this long
# while its peers live is a hang (it exited 0 early, or its peers outlive it), not a job being torn down.
DEAD_SETTLED_S = 5.0
# A blocking py-spy or a debugger's attach stops a rank (state t) for a moment.  Below the span of the /proc samples
# a worker keeps (hang/state.py: 8, 0.5 s apart), or it would never settle.
STOPPED_SETTLED_S = 2.0
# A rank's GPU in another kernel while its peers' spin in NCCL, for this long of silence: no training kernel runs so
# long, and a rank still autotuning has not issued the collective its peers wait in.
GPU_HANG_SETTLED_S = 15.0
# The same GPU spinning on almost none of its SMs, no NCCL operation running on it (``classify._spinning``): no
# compute kernel looks so; this long of silence is three NVML looks past a step's usual gaps.  On 4 x H200 a GPU
# hang under FSDP2, TP and the pipelines otherwise waited for the stall timeout (8.3-9.4 s).
GPU_SPIN_SETTLED_S = 3.0


def judge_at(state: JobState, at: float) -> Decision:
    return classify(take_snapshot(state, observed_at=at))


class Proof:
    """Which decisions prove a hang by themselves, and whether the streamed state already holds one.

    A decision proves a hang when it pages, its verdict is conclusive in the catalogue (``CONCLUSIVE``) and a
    dead or stopped culprit is settled: gone for DEAD_SETTLED_S, stopped for STOPPED_SETTLED_S (by the /proc samples
    of the node that runs it, shared with the leader; a culprit no state holds samples of is left to the second
    look).  ``streamed`` judges what the sources streamed
    (NCCL logs, the workers' /proc states) without any probe, once the job has been silent STREAMED_QUIET_S and
    only when an event that could change a verdict came since (``LiveJob.revision``) or a culprit settles.
    """

    def __init__(self, live: LiveJob) -> None:
        self.live = live
        self._judged = -1  # the revision last judged
        self._again_at: float | None = None  # a dead or stopped culprit settles then: judge again
        self.slowest_s = 0.0  # the longest streamed judging so far (-v says when it grows past 50 ms)

    def proves(self, decision: Decision, at: float, state: JobState | None = None) -> bool:
        """``state``: the one the decision was judged on, when it is not this node's alone (the leader's, with every
        node's evidence: a stopped rank on another node is settled by that node's /proc samples)."""
        proven_at = self._proven_at(decision, at, state or self.live.state)
        return proven_at is not None and proven_at <= at

    def settles_at(self, decision: Decision, at: float, state: JobState | None = None) -> float | None:
        """When a decision that does not prove the hang yet will: its dead or stopped culprit not so long enough
        at ``at``.  None where it never will by waiting (not conclusive, or no /proc samples of the culprit)."""
        proven_at = self._proven_at(decision, at, state or self.live.state)
        return proven_at if proven_at is not None and at < proven_at < math.inf else None

    def streamed(self, view: LiveView) -> bool:
        if view.stalled_for < STREAMED_QUIET_S or view.stalled_for >= view.stall_timeout:
            return False
        revision, at = self.live.revision, view.observed_at
        if revision == self._judged and (self._again_at is None or at < self._again_at):
            return False
        self._judged, self._again_at = revision, None
        began = time.perf_counter()
        snapshot = take_snapshot(self.live.state, observed_at=at)
        decision = classify(replace(snapshot, stall=None))  # an earlier probe's stall clock says nothing of this one
        self._took(time.perf_counter() - began)
        settled = self._proven_at(decision, at, self.live.state)
        if settled is None:
            return False
        if settled > at:
            self._again_at = settled if settled < math.inf else None
            return False
        log.info(
            "streamed evidence proves a hang after %.1f s of silence: %s %s; looking now",
            view.stalled_for,
            decision.finding.verdict,
            decision.finding.culprits,
        )
        return True

    def _took(self, seconds: float) -> None:
        if seconds > max(self.slowest_s, 0.05):
            log.info("judging the streamed state took %.0f ms", seconds * 1e3)
        self.slowest_s = max(self.slowest_s, seconds)

    def _this_round(self, decision: Decision) -> bool:
        """After an elastic restart the state still holds the old round's sequences (its NCCL logs; its dumps until
        the new round's come): a mismatch proves a hang only from the current round's processes and dumps (else
        the stall timeout and the second look decide, as before any proof).  A process's own state is its round's."""
        state, finding = self.live.state, decision.finding
        current = state.current_round()
        if current == 0 or finding.verdict is not Verdict.collective_mismatch:
            return True
        comm = state.comms.get(finding.comm_key or "")
        if comm is None:
            return False
        if comm.source == "flight_recorder":
            return all(self.live.dumped_in.get((comm.key, seq.rank)) == current for seq in comm.ranks.values())
        pids = {w.pid for w in state.current_workers()}
        return all(seq.proc is not None and seq.proc.pid in pids for seq in comm.ranks.values())

    def _proven_at(self, decision: Decision, at: float, state: JobState) -> float | None:
        """When ``decision`` proves the hang (``math.inf``: not by waiting); None where it never does by itself."""
        if not decision.page or decision.finding.verdict not in CONCLUSIVE or not self._this_round(decision):
            return None
        return self._settled_at(decision, at, state)

    def _settled_at(self, decision: Decision, at: float, state: JobState) -> float:
        """When the decision's dead or stopped culprits have been so long enough, or its stuck GPU held for
        GPU_HANG_SETTLED_S of silence, GPU_SPIN_SETTLED_S where it spins (``at`` for any other verdict)."""
        verdict = decision.finding.verdict
        if verdict is Verdict.gpu_compute_hang:
            held = GPU_SPIN_SETTLED_S if decision.finding.kind == "spin" else GPU_HANG_SETTLED_S
            return self.live.last_progress() + held
        if verdict not in (Verdict.process_dead, Verdict.process_stopped):
            return at
        workers = {w.rank: w for w in state.current_workers()}
        times = []
        for rank in decision.finding.culprits:
            worker = workers.get(rank)
            since = None if worker is None else worker.gone_at if verdict is Verdict.process_dead else _stopped(worker)
            if since is None:
                return math.inf
            times.append(since + (DEAD_SETTLED_S if verdict is Verdict.process_dead else STOPPED_SETTLED_S))
        return max(times, default=at)


def _stopped(worker: Worker) -> float | None:
    """Since when the worker's /proc samples have said stopped (the oldest of the latest run of them)."""
    since = None
    for sample in reversed(worker.samples):
        if sample.state not in STOPPED_STATES:
            break
        since = sample.at
    return since


@dataclass(frozen=True)
class Role:
    """This node's part in a decision: the state it was judged on, and whose page it is."""

    state: JobState  # the state the decision was judged on (the report's; the proof's clock reads its samples)
    job_wide: bool = False  # the verdict stands for the whole job, and one node pages it
    follows: bool = False  # the verdict is the leader's, and the leader pages it
    key: str | None = None  # the incident key, the same on every node for one hang (None: this node's own)


class Judging(Protocol):
    """Who judges a stall, and who pages it: this node (``NodeJudging``) or the whole job
    (``job_judging.JobJudging``).  What only several nodes do (the exchange, following the leader's verdict, the
    hand-off before the job ends) is ``nodes.Nodes``', which the sidecar holds only when it joins other nodes."""

    async def judge(self, stall: Stall, probed: list[Event]) -> Decision: ...
    async def peek(self, stall: Stall, probed: list[Event]) -> Decision: ...  # a quiet look: only proof counts
    def role(self, decision: Decision) -> Role: ...
    # Who pages: None where this node does, else the line it says instead (a job-wide verdict is published first).
    async def page(self, decision: Decision, role: Role, plan: Plan | None) -> Callable[[], str] | None: ...


def page_report(
    role: Role, decision: Decision, view: LiveView, job: str, host: str, started_at: float, at: float
) -> Report:
    """The report of a page: from the state the decision was judged on, under the incident's key."""
    snapshot = take_snapshot(role.state, observed_at=at)
    report = live_report(
        decision.finding, snapshot, view, job=job, host=host, started_at=started_at, held=decision.held
    )
    return report.model_copy(update={"incident_key": role.key})


class NodeJudging:
    """One node: its ranks are the whole job; it judges them, and it pages."""

    def __init__(self, live: LiveJob) -> None:
        self.live = live

    async def judge(self, stall: Stall, probed: list[Event]) -> Decision:
        return judge_at(self.live.state, stall.at)

    async def peek(self, stall: Stall, probed: list[Event]) -> Decision:
        return judge_at(self.live.state, stall.at)

    def role(self, decision: Decision) -> Role:
        return Role(self.live.state)

    async def page(self, decision: Decision, role: Role, plan: Plan | None) -> Callable[[], str] | None:
        """This node pages: no other node."""
        return None
