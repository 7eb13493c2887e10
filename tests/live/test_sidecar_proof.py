"""Proof pages now, silence waits: the sidecar, tick by tick, before the stall timeout.

The rig of ``test_sidecar_ticks.py`` (a scripted prober, a fake clock, no sleeps).  A job in its warm-up (fewer
than 8 steps: the stall timeout is 300 s) whose evidence proves a hang is paged within seconds, without a
confirming look: ranks at the same position with different collectives in their Flight Recorder dumps (found by a
peek, the gloo case) or in their NCCL logs (the streamed state, no probe needed), a rank gone while its peers live,
a rank stopped.  What only looks like a hang for a moment (a rank behind in its own code, a rank stopped for an
instant by a blocking py-spy, a rank gone while torchrun tears the job down) is not, and a healthy start-up is
peeked at silently, at most every ``PEEK_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import nccl_lines as L
import pytest
from conftest import NOW
from support import torch_store_server
from test_sidecar_ticks import COMM, IN_ALL_REDUCE, IN_TRAIN, SETTINGS, Rig, healthy_job

from ncclwatch.watchdog.cluster.judge import JobEvidence, job_state
from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.cluster.peers import Cluster, Membership
from ncclwatch.watchdog.cluster.store import StoreClient
from ncclwatch.watchdog.cluster.view import IncidentView, JobView, NodeSummary
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrProcessGroup,
    GpuGpm,
    GpuProcess,
    GpuSample,
    GpuSnapshot,
    Heartbeat,
    OpState,
    ProcessState,
    Stall,
    WorkerGone,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import BUSY_IO_BYTES_PER_S
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.incident import Phase
from ncclwatch.watchdog.live.job import PEEK_WARMUP_S, LiveJob
from ncclwatch.watchdog.live.job_judging import Met, gather_compact
from ncclwatch.watchdog.live.judging import (
    DEAD_SETTLED_S,
    GPU_HANG_SETTLED_S,
    GPU_SPIN_SETTLED_S,
    STOPPED_SETTLED_S,
    Proof,
)
from ncclwatch.watchdog.live.nodes import PEEKED_HOT_S, Nodes
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

IN_ALL_GATHER = "all_gather (torch/distributed/distributed_c10d.py:3890)"
DUMP_BYTES = 4 << 20  # a Flight Recorder dump, as a rank writes it


def starting_job(rig: Rig, steps: int = 2) -> None:
    """Three ranks (pids 100-102) that have beaten ``steps`` times, the last at t = 1 s: no rhythm yet."""
    for rank in range(3):
        rig.emit(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW))
    for step in range(steps):
        t = 1.0 - (steps - 1 - step) * 0.2
        rig.at(t)
        rig.emit(*(Heartbeat(pid=100 + r, rank=r, step=step, time=NOW + t) for r in range(3)))
        rig.emit(*(ProcessState(pid=100 + r, rank=r, state="S", cpu_seconds=0.0, at=NOW + t) for r in range(3)))
    rig.tick(1.0)
    view = rig.sidecar.live.view(rig.clock())
    assert view.stall_timeout == SETTINGS.warmup_stall_timeout and view.peek_after == PEEK_WARMUP_S


def fr_dump(rank: int, ops: list[str]) -> FrDump:
    """A gloo Flight Recorder dump: ``ops`` in order, the last one pending."""
    entries = [
        FrEntry(
            index=i,
            pg_id="0",
            collective_seq_id=i + 1,
            profiling_name=f"gloo:{op.lower()}",
            op=op,
            is_p2p=False,
            input_sizes=[[1024]],
            output_sizes=[[1024]],
            input_dtypes=["Float"],
            output_dtypes=["Float"],
            state=OpState.scheduled if i == len(ops) - 1 else OpState.completed,
        )
        for i, op in enumerate(ops)
    ]
    group = FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1, 2])
    return FrDump(rank=rank, version="2.10", process_groups={"0": group}, entries=entries, cite=Citation(file="fr"))


def skipped_all_reduce(rig: Rig) -> None:
    """Rank 1 skipped the step's all_reduce: its all_gather meets its peers' all_reduce (the demo's ``skip``)."""
    rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_GATHER, 102: IN_ALL_REDUCE}
    dumps: list[Event] = [fr_dump(r, ["AllReduce", "AllGather", "AllReduce"]) for r in (0, 2)]
    rig.prober.extra = [*dumps, fr_dump(1, ["AllReduce", "AllGather", "AllGather"])]


def bf16_beside_fp32(rig: Rig) -> None:
    """NCCL's lines of ranks 0-2 (pids 100-102): one step, then rank 1's all_reduce in bf16, its peers' in fp32."""
    for rank in range(3):
        text = L.init(rank, 3, COMM, pid=100 + rank) + L.steps(rank, COMM, 1, pid=100 + rank)
        text += L.op(rank, "AllReduce", 4096, COMM, dtype=9 if rank == 1 else 7, pid=100 + rank)
        rig.emit(*NcclLogParser(f"node1.{100 + rank}").feed(text.encode(), final=True))


def new_round(rig: Rig, at: float) -> None:
    """torchrun's restart: ranks 0-2 again as pids 200-202, round 1, their first step at ``at``."""
    rig.emit(*(WorkerGone(pid=100 + r, rank=r, at=NOW + at - 1) for r in range(3)))
    rig.emit(*(WorkerSeen(pid=200 + r, rank=r, restart_count=1, host="node1", at=NOW + at - 0.5) for r in range(3)))
    rig.at(at)
    rig.emit(*(Heartbeat(pid=200 + r, rank=r, step=0, time=NOW + at, restart=1) for r in range(3)))
    rig.prober.frames = {200: IN_ALL_REDUCE, 201: IN_ALL_GATHER, 202: IN_ALL_REDUCE}


class TestProofPagesNow:
    def test_a_mismatch_a_peek_finds_in_the_warm_up_is_paged_without_confirming(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        skipped_all_reduce(rig)
        rig.tick(1.0 + PEEK_WARMUP_S - 0.25)
        assert rig.prober.peeks == 0 and rig.phase is Phase.watching
        rig.tick(1.0 + PEEK_WARMUP_S)  # 2 s of silence, 298 s before the warm-up timeout
        assert rig.prober.peeks == 1 and rig.prober.calls == [True]  # the peek, then one full look: no confirming
        assert rig.phase is Phase.paged
        [paged] = rig.pages
        assert (paged.finding.verdict, paged.finding.culprits) == (Verdict.collective_mismatch, (1,))
        assert rig.alerts.submitted == ["trigger"]

    def test_a_mismatch_in_the_nccl_logs_is_paged_from_the_streamed_state(self, tmp_path: Path) -> None:
        """No probe is needed to see it: one second of silence after rank 1 issued bf16 where its peers issued
        fp32, the streamed state is judged; the look that follows gathers the evidence and pages."""
        rig = Rig(tmp_path)
        starting_job(rig)
        bf16_beside_fp32(rig)
        rig.tick(1.5)
        assert rig.phase is Phase.watching and rig.prober.calls == []
        rig.tick(2.6)  # 1.1 s after the last operation
        assert rig.prober.peeks == 0 and rig.prober.calls == [True] and rig.phase is Phase.paged
        [paged] = rig.pages
        assert (paged.finding.verdict, paged.finding.culprits) == (Verdict.collective_mismatch, (1,))

    def test_a_rank_gone_while_its_peers_live_is_paged_once_torchrun_would_have_ended_them(
        self, tmp_path: Path
    ) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE}
        rig.emit(WorkerGone(pid=102, rank=2, at=NOW + 1.2))
        rig.tick(1.2 + DEAD_SETTLED_S - 0.25)  # a crash torchrun is still tearing down: no page
        assert rig.pages == [] and rig.prober.calls == []
        rig.tick(1.2 + DEAD_SETTLED_S)
        assert rig.prober.calls == [True] and rig.phase is Phase.paged
        assert [(d.finding.verdict, d.finding.culprits) for d in rig.pages] == [(Verdict.process_dead, (2,))]

    def test_a_stopped_rank_is_paged_once_it_stays_stopped(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE}
        for t in (1.5, 2.0, 2.5, 3.0):
            rig.emit(ProcessState(pid=102, rank=2, state="T", cpu_seconds=0.0, at=NOW + t))
            rig.tick(t)
        assert rig.pages == [] and rig.prober.calls == []  # stopped since 1.5 s: settled at 3.5 s
        rig.tick(1.5 + STOPPED_SETTLED_S)
        assert [(d.finding.verdict, d.finding.culprits) for d in rig.pages] == [(Verdict.process_stopped, (2,))]
        assert rig.prober.calls == [True]

    def test_a_busy_culprit_of_a_mismatch_is_paged_never_held(self, tmp_path: Path) -> None:
        """The busy hold ("not paging: rank 1 ... is busy ...; reported after 1800 s") is for a rank behind in its
        own code; a culprit proven wrong is paged whatever its CPU does, and no line says otherwise first."""
        rig = Rig(tmp_path)
        starting_job(rig)
        skipped_all_reduce(rig)
        rig.prober.frames[101] = IN_TRAIN
        for i, t in enumerate((1.5, 2.0, 2.5, 3.0, 3.5)):
            rig.emit(ProcessState(pid=101, rank=1, state="R", cpu_seconds=0.5 * i, at=NOW + t))
            rig.tick(t)
        rig.tick(4.0)
        assert [(d.finding.verdict, d.finding.culprits, d.held) for d in rig.pages] == [
            (Verdict.collective_mismatch, (1,), None)
        ]
        assert "not paging" not in rig.out.getvalue()

    def test_a_conclusive_verdict_at_the_stall_timeout_pages_without_confirming(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig, behind=False)
        skipped_all_reduce(rig)
        rig.tick(25.1)  # straight past the learned timeout (5 s): the suspect path, no peek
        assert rig.prober.peeks == 0 and rig.prober.calls == [True] and rig.phase is Phase.paged
        assert [d.finding.verdict for d in rig.pages] == [Verdict.collective_mismatch]


def gpu_hang_of_rank_1(rig: Rig) -> None:
    """NCCL Flight Recorder (with timing): ranks 0 and 2's GPUs run all_reduce #3, rank 1's has it only queued
    behind a kernel of its own; each rank a GPU alone, rank 1's spinning on one block (NVML, as on the H200s)."""
    dumps = [fr_dump(r, ["AllReduce"] * 3) for r in range(3)]
    for dump in dumps:
        last = dump.entries[-1]
        state = OpState.scheduled if dump.rank == 1 else OpState.started
        dump.entries[-1] = last.model_copy(update={"profiling_name": "nccl:all_reduce", "state": state})
    rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_TRAIN, 102: IN_ALL_REDUCE}
    rig.prober.extra = list(dumps)

    def sample() -> GpuSnapshot:
        gpus = [
            GpuSample(
                index=r,
                util_gpu_pct=100,
                gpm=GpuGpm(sm_util_pct=0.76 if r == 1 else 18.2),
                processes=[GpuProcess(pid=100 + r)],
            )
            for r in range(3)
        ]
        return GpuSnapshot(time=rig.clock(), gpus=gpus, cite=Citation(file="nvml (live)"))

    rig.prober.gpu_samples = [sample]


class TestGpuHang:
    def test_a_gpu_spinning_in_its_own_kernel_is_paged_once_it_has_spun_for_a_while(self, tmp_path: Path) -> None:
        """The peek sees the GPU hang from Flight Recorder, samples the GPUs (a peek does not, otherwise), finds
        rank 1's spinning on one block with no NCCL operation running: proof once it has held GPU_SPIN_SETTLED_S."""
        rig = Rig(tmp_path)
        starting_job(rig)
        gpu_hang_of_rank_1(rig)
        rig.tick(1.0 + PEEK_WARMUP_S)
        assert rig.prober.peeks == 1 and rig.prober.sampled == 1 and rig.pages == []
        rig.tick(1.0 + GPU_SPIN_SETTLED_S - 0.1)
        assert rig.prober.peeks == 1 and rig.pages == []
        rig.tick(1.0 + GPU_SPIN_SETTLED_S)  # the peek again, when it settles: proof, the full look, the page
        # The full look takes no GPU sample of its own: the peek's, of this silence, serves (as a confirming look's).
        assert rig.prober.peeks == 2 and rig.prober.calls == [False] and rig.phase is Phase.paged
        [paged] = rig.pages
        assert (paged.finding.verdict, paged.finding.culprits, paged.finding.kind) == (
            Verdict.gpu_compute_hang,
            (1,),
            "spin",
        )

    def test_a_peeks_gpu_sample_that_ends_past_the_settling_proves_at_once(self, tmp_path: Path) -> None:
        """NVML's GPM sample takes a second: a peek 2 s into the silence ends its sample at 3 s, when the spin has
        settled.  The proof is judged then, not at the look's start, and the page follows in the same tick (on 4 x
        H200 a second peek came 0.5-0.9 s later, then the full look with a GPU sample of its own, 1.0-1.4 s)."""
        rig = Rig(tmp_path)
        starting_job(rig)
        gpu_hang_of_rank_1(rig)
        [sample] = rig.prober.gpu_samples

        def over_a_second() -> Event:
            rig.clock.now += 1.0  # the GPM window
            return sample()

        rig.prober.gpu_samples = [over_a_second]
        rig.tick(1.0 + PEEK_WARMUP_S)
        assert rig.prober.peeks == 1 and rig.prober.sampled == 1 and rig.prober.calls == [False]
        [paged] = rig.pages
        assert (paged.finding.culprits, paged.finding.kind) == ((1,), "spin")

    def test_a_peek_that_sees_no_gpu_hang_does_not_wait_for_its_gpu_sample(self, tmp_path: Path) -> None:
        """Every peek samples the GPUs beside its look; a mismatch it proves is paged without that sample."""
        rig = Rig(tmp_path)
        starting_job(rig)
        skipped_all_reduce(rig)

        async def never() -> list[Event]:
            await asyncio.Event().wait()
            return []

        rig.prober.gpus = never  # type: ignore[method-assign]
        rig.tick(1.0 + PEEK_WARMUP_S)
        assert [(d.finding.verdict, d.finding.culprits) for d in rig.pages] == [(Verdict.collective_mismatch, (1,))]

    def test_progress_during_the_peeks_gpu_sample_proves_nothing(self, tmp_path: Path) -> None:
        """A rank that moved while the GPUs were sampled was not hung at the sample's end."""
        rig = Rig(tmp_path)
        starting_job(rig)
        gpu_hang_of_rank_1(rig)
        [sample] = rig.prober.gpu_samples

        def while_rank_1_steps() -> Event:
            rig.clock.now += 1.0
            rig.emit(Heartbeat(pid=101, rank=1, step=2, time=rig.clock()))
            return sample()

        rig.prober.gpu_samples = [while_rank_1_steps]
        rig.tick(1.0 + PEEK_WARMUP_S)
        assert rig.prober.peeks == 1 and rig.pages == [] and rig.phase is Phase.watching

    def test_without_a_spin_it_waits_for_gpu_hang_settled_s(self, tmp_path: Path) -> None:
        """No NVML (or a GPU busy on its SMs: a long kernel): the same hang proves itself only after 15 s."""
        rig = Rig(tmp_path)
        starting_job(rig)
        gpu_hang_of_rank_1(rig)
        rig.prober.gpu_samples = []
        for t in (1.0 + PEEK_WARMUP_S, 1.0 + GPU_SPIN_SETTLED_S, 10.0, 1.0 + GPU_HANG_SETTLED_S - 0.1):
            rig.tick(t)
        assert rig.pages == [] and rig.prober.calls == []
        rig.tick(1.0 + GPU_HANG_SETTLED_S)
        assert [(d.finding.verdict, d.finding.culprits, d.finding.kind) for d in rig.pages] == [
            (Verdict.gpu_compute_hang, (1,), None)
        ]


class TestSilenceWaits:
    def test_the_last_rounds_nccl_lines_prove_nothing_after_a_restart(self, tmp_path: Path) -> None:
        """torchrun restarted the job (``--on-hang restart``, or its ranks crashed): the state still holds the old
        round's NCCL lines, and the new round starting up is silent: no proof, the warm-up timeout holds."""
        rig = Rig(tmp_path)
        starting_job(rig)
        bf16_beside_fp32(rig)
        rig.tick(2.6)
        assert [d.finding.verdict for d in rig.pages] == [Verdict.collective_mismatch]
        new_round(rig, at=4.0)
        for t in range(5, 40):
            rig.tick(float(t))
        assert rig.prober.peeks == 2 and len(rig.pages) == 1 and rig.phase is Phase.watching

    def test_the_last_rounds_dumps_prove_nothing_until_this_rounds_do(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        skipped_all_reduce(rig)
        rig.tick(1.0 + PEEK_WARMUP_S)
        assert [d.finding.verdict for d in rig.pages] == [Verdict.collective_mismatch]
        new_round(rig, at=5.0)
        # The new round's ranks answer before their process group exists: empty dumps; the old round's stay.
        rig.prober.extra = [fr_dump(r, []) for r in range(3)]
        for t in range(6, 12):
            rig.tick(float(t))
        assert rig.prober.peeks == 2 and len(rig.pages) == 1
        rig.prober.extra = [fr_dump(r, ["AllReduce", "AllReduce"]) for r in (0, 2)] + [fr_dump(1, ["AllGather"] * 2)]
        rig.tick(29.0)  # this round's own dumps disagree: proof
        assert [d.finding.verdict for d in rig.pages] == [Verdict.collective_mismatch] * 2

    def test_a_rank_behind_at_start_up_is_peeked_at_silently_every_peek_every_s(self, tmp_path: Path) -> None:
        """Rank 2 still compiling while its peers wait in the first all_reduce: not proof; nothing is said."""
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE, 102: IN_TRAIN}
        for t in range(2, 60):
            rig.tick(float(t))
        assert rig.prober.peeks == 3  # at 4 s, 24 s, 44 s of the run
        assert rig.prober.calls == [] and rig.pages == [] and rig.phase is Phase.watching
        assert rig.out.getvalue() == ""

    def test_a_peek_then_the_learned_timeout_takes_the_regular_path(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        healthy_job(rig)  # a 1 s rhythm: a peek at 2 s of silence, the stall timeout at 5 s
        rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE, 102: IN_TRAIN}
        rig.tick(22.0)
        assert rig.prober.peeks == 1 and rig.prober.calls == [] and rig.phase is Phase.watching
        rig.tick(25.1)
        # rank_behind is no proof, so it waits for the stall timeout; there the probe sees what the peek saw 3 s
        # before, with nothing moved in between: the peek was the first look, and no confirming look follows
        assert rig.prober.calls == [True]
        assert [(d.finding.verdict, d.finding.culprits) for d in rig.pages] == [(Verdict.rank_behind, (2,))]

    def test_progress_after_a_peek_is_a_new_silence(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE, 102: IN_TRAIN}
        rig.tick(4.0)
        assert rig.prober.peeks == 1
        rig.emit(*(Heartbeat(pid=100 + r, rank=r, step=2, time=NOW + 5) for r in range(3)))
        rig.tick(5.0)
        rig.tick(8.0)
        assert rig.prober.peeks == 2 and rig.pages == []

    def test_a_rank_stopped_for_an_instant_is_not_paged(self, tmp_path: Path) -> None:
        """A blocking py-spy (state t) or a debugger's attach, then the rank runs on."""
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.emit(ProcessState(pid=102, rank=2, state="t", cpu_seconds=0.0, at=NOW + 1.5))
        rig.tick(1.5)
        rig.emit(ProcessState(pid=102, rank=2, state="S", cpu_seconds=0.0, at=NOW + 2.0))
        for t in (2.0, 2.5, 3.0, 3.5, 4.0, 4.5):
            rig.tick(t)
        assert rig.pages == [] and rig.prober.calls == []

    def test_a_crash_torchrun_tears_down_is_not_paged(self, tmp_path: Path) -> None:
        rig = Rig(tmp_path)
        starting_job(rig)
        rig.emit(WorkerGone(pid=102, rank=2, at=NOW + 1.2))
        rig.tick(1.5)
        rig.emit(*(WorkerGone(pid=100 + r, rank=r, at=NOW + 1.6) for r in range(2)))
        for t in (2.0, 4.0, 8.0):
            rig.tick(t)
        assert rig.pages == [] and rig.prober.calls == [] and rig.prober.peeks == 0


def test_the_streamed_state_is_judged_only_when_something_came(tmp_path: Path) -> None:
    """Heartbeats, GPU samples and /proc samples that change nothing do not make it judge again; 8 ranks x 10,000
    NCCL operations are judged in milliseconds (6 ms on the 2-core CI machine)."""
    live = LiveJob(SETTINGS, started_at=NOW)
    for rank in range(8):
        live.apply(WorkerSeen(pid=100 + rank, rank=rank, host="node1", at=NOW), NOW)
        text = L.init(rank, 8, COMM, pid=100 + rank) + L.steps(rank, COMM, 2500, pid=100 + rank)
        for event in NcclLogParser(f"node1.{100 + rank}").feed(text.encode(), final=True):
            live.apply(event, NOW)
        live.apply(ProcessState(pid=100 + rank, rank=rank, state="S", cpu_seconds=1.0, at=NOW), NOW)
    proof = Proof(live)
    judged: list[float] = []
    original = proof._took
    proof._took = lambda seconds: (judged.append(seconds), original(seconds))  # type: ignore[method-assign]
    assert not proof.streamed(live.view(NOW + 0.5))  # not silent for a second yet
    began = time.perf_counter()
    assert not proof.streamed(live.view(NOW + 2))
    assert len(judged) == 1 and time.perf_counter() - began < 1.0
    live.apply(ProcessState(pid=100, rank=0, state="R", cpu_seconds=2.0, at=NOW + 2.5), NOW + 2.5)
    assert not proof.streamed(live.view(NOW + 3)) and len(judged) == 1
    live.apply(ProcessState(pid=100, rank=0, state="T", cpu_seconds=2.0, at=NOW + 3.5), NOW + 3.5)
    assert not proof.streamed(live.view(NOW + 4)) and len(judged) == 2  # stopped: judged, not settled yet
    assert not proof.streamed(live.view(NOW + 4.5)) and len(judged) == 2
    live.apply(ProcessState(pid=100, rank=0, state="T", cpu_seconds=2.0, at=NOW + 5.5), NOW + 5.5)
    assert proof.streamed(live.view(NOW + 3.5 + STOPPED_SETTLED_S)) and len(judged) == 3  # settled: judged again


def joined(rig: Rig, cluster: Cluster) -> Nodes:
    """The rig's sidecar joins the other nodes, met through ``cluster`` (the workers named the store)."""
    rig.sidecar.nodes = nodes = Nodes(rig.sidecar, cluster)
    rig.sidecar.judging = nodes.judging
    return nodes


def member_of_two(rig: Rig, port: int) -> tuple[Cluster, Nodes]:
    """The rig's sidecar as node 1 of 2, met through the store on ``port`` (the workers named it); node 0 leads."""
    membership = Membership("127.0.0.1", port, "job", 0, 1, 2)
    cluster = Cluster(membership, "node1", clock=rig.clock, client=StoreClient("127.0.0.1", port, timeout_s=5))
    nodes = joined(rig, cluster)
    cluster.view, cluster._view_changed_at = JobView(leader=0, term=0, seq=1, nnodes=2), NOW + 1
    return cluster, nodes


def test_a_member_nodes_proof_opens_its_incident_and_leaves_the_page_to_the_leader(tmp_path: Path) -> None:
    """Several nodes: the peek judges this node's ranks; its proof opens the incident (the leader sees the node
    probing and judges the job), the full look shares this node's evidence, and nothing is paged from here."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    starting_job(rig)
    cluster, _ = member_of_two(rig, store.port)
    skipped_all_reduce(rig)
    rig.tick(1.0 + PEEK_WARMUP_S)
    assert rig.prober.peeks == 1 and rig.prober.calls == [True]
    assert rig.phase is Phase.suspect and rig.pages == [] and rig.alerts.submitted == []
    assert "node 0 judges the whole job; waiting for its verdict" in rig.out.getvalue()
    reader = StoreClient("127.0.0.1", store.port, timeout_s=5)  # the leader's side (the rig's client has its loop)
    assert asyncio.run(reader.get(cluster.key("compact", 1))) is not None  # this node's evidence, for the leader


def test_a_members_peek_is_its_full_evidence_when_the_leader_asks_before_its_own_probe(tmp_path: Path) -> None:
    """The leader's peek proved the hang and asks this node for its full evidence; this node's own probe comes only
    at its stall timeout.  What its peek of the same silence saw is sent at once (two wrappers on the H200, a dtype
    mismatch at step 1: the leader waited 2.5 s for it).  A look of an earlier silence is not sent."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    starting_job(rig)
    cluster, nodes = member_of_two(rig, store.port)
    rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_ALL_REDUCE, 102: IN_ALL_REDUCE}  # nothing proven here
    rig.tick(1.0 + PEEK_WARMUP_S)
    assert rig.prober.peeks == 1 and rig.phase is Phase.watching  # a quiet peek, shared
    assert nodes._hot()  # the leader's ask may come next: it is read within HOT_S, not PUBLISH_S
    rig.at(1.0 + PEEK_WARMUP_S + PEEKED_HOT_S)
    assert not nodes._hot()

    def asked(started_at: float) -> bytes | None:
        incident = IncidentView(opened_at=NOW + 4, want=[1], started_at=NOW + started_at)
        cluster.view = JobView(leader=0, term=0, seq=2, nnodes=2, incident=incident)
        asyncio.run(nodes._follow(nodes.met))
        reader = StoreClient("127.0.0.1", store.port, timeout_s=5)  # one a loop, as the rig's
        return asyncio.run(reader.get(cluster.key("full", 1)))

    assert asked(started_at=3.5) is None  # the silence the leader judges began after this peek: not its evidence
    shared = asked(started_at=1.0)
    assert shared is not None
    payload = unpack(shared, "node 1")
    assert payload is not None and payload.kind == "full" and payload.stall_at == NOW + 1.0 + PEEK_WARMUP_S


def test_a_rank_stopped_on_another_node_is_proven_by_that_node_s_samples(tmp_path: Path) -> None:
    """The leader judges a stopped rank that runs on another node: this node's state has no /proc samples of it (the
    second look decided, 3 s later on two wrappers), the job's state, with that node's shared samples, settles it."""
    live = LiveJob(SETTINGS, started_at=NOW)
    live.apply(WorkerSeen(pid=100, rank=0, host="node0", at=NOW), NOW)
    job = JobState()
    job.apply(WorkerSeen(pid=100, rank=0, host="node0", at=NOW))
    job.apply(WorkerSeen(pid=200, rank=1, host="node1", at=NOW))
    stopped = Decision(Finding(Verdict.process_stopped, "rank 1 is stopped", culprits=(1,)), page=True)
    proof = Proof(live)
    job.apply(ProcessState(pid=200, rank=1, state="T", cpu_seconds=1.0, at=NOW + 1))
    assert not proof.proves(stopped, NOW + 1 + STOPPED_SETTLED_S / 2, job)  # not stopped long enough yet
    job.apply(ProcessState(pid=200, rank=1, state="T", cpu_seconds=1.0, at=NOW + 1 + STOPPED_SETTLED_S))
    assert proof.proves(stopped, NOW + 1 + STOPPED_SETTLED_S, job)
    assert not proof.proves(stopped, NOW + 1 + STOPPED_SETTLED_S)  # this node's own state alone: no samples of it


def test_a_leaders_proving_peek_asks_the_deciding_nodes_for_their_full_evidence_at_once(tmp_path: Path) -> None:
    """The leader's peek proved a mismatch whose culprit runs on node 1: the incident it opens asks node 1 for its
    full evidence now, before the leader's own look (a second's wait for fresh dumps), so that evidence is in the
    store when the probe judges.  A culprit on the leader's own node asks nobody."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    membership = Membership("127.0.0.1", store.port, "job", 0, 0, 2)  # node 0 of 2: the leader
    cluster = Cluster(membership, "node0", clock=rig.clock, client=StoreClient("127.0.0.1", store.port, timeout_s=5))
    nodes = joined(rig, cluster)
    nodes.judging.job_state, nodes.judging.peeked_nodes = JobState(), {2: 1, 3: 1}
    rig.sidecar.incident = replace(rig.sidecar.incident, phase=Phase.suspect, started_at=NOW + 1, opened_at=NOW + 3)

    def proved(culprits: tuple[int, ...]) -> JobView:
        cluster.view, cluster._view_raw = JobView(leader=0, term=0, seq=1, nnodes=2), None
        found = Decision(Finding(Verdict.collective_mismatch, "s", culprits=culprits), page=True)
        asyncio.run(nodes.proved(found))
        return cluster.view

    assert proved((1,)).incident is None  # rank 1 runs here: its evidence is the leader's own
    incident = proved((3,)).incident
    assert incident is not None and incident.want == [1] and incident.opened_at == NOW + 3
    assert incident.started_at == NOW + 1  # node 1 sends what it saw of this silence only


def test_a_member_withdraws_its_peeks_evidence_once_its_ranks_move_again(tmp_path: Path) -> None:
    """A member's peek during a slow step is not evidence of the silence that follows: once its ranks move, the
    evidence it shared goes, so the leader's next peek waits for this node's look at the new silence (CPU, two
    wrappers, a collective skipped at step 1: the leader took the old look for the new silence and peeked again
    20 s later)."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    starting_job(rig)
    cluster, nodes = member_of_two(rig, store.port)

    def shared() -> bytes | None:
        reader = StoreClient("127.0.0.1", store.port, timeout_s=5)  # one a loop, as the rig's
        return asyncio.run(reader.get(cluster.key("compact", 1)))

    def tick(seconds: float) -> None:
        cluster.client = StoreClient("127.0.0.1", store.port, timeout_s=5)  # each tick runs its own loop
        rig.tick(seconds)

    rig.prober.frames = {100: IN_TRAIN, 101: IN_TRAIN, 102: IN_TRAIN}  # a slow step: nothing proven
    tick(1.0 + PEEK_WARMUP_S)
    assert rig.prober.peeks == 1 and shared() is not None
    tick(3.5)  # silent still: the look stands
    assert shared() is not None
    rig.emit(*(Heartbeat(pid=100 + r, rank=r, step=2, time=NOW + 3.6) for r in range(3)))
    tick(3.75)
    assert shared() is None and nodes.judging.shared == []


def test_the_dumps_any_nodes_looks_asked_for_are_not_its_ranks_io_on_the_leader(tmp_path: Path) -> None:
    """Pipeline x DP on two wrappers (4 x H200): rank 3, asleep in Python on node 1, wrote the dump its node's peek
    asked for.  The leader judged from node 1's later look, whose clock gave only its own span, read the write as the
    rank's I/O and held the hang as "busy (a checkpoint?)" until the run was ended.  A member shares its earlier looks
    with its clock; the leader's own looks count for its own ranks in the job's state too."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    starting_job(rig)
    _, nodes = member_of_two(rig, store.port)
    rig.prober.frames = {100: IN_ALL_REDUCE, 101: IN_TRAIN, 102: IN_ALL_REDUCE}
    peeked_at = 1.0 + PEEK_WARMUP_S
    rig.tick(peeked_at)  # node 1's peek: its ranks dump now
    assert rig.prober.peeks == 1

    def asleep_and_dumping(state: JobState, pid: int, rank: int, dumped_after: float) -> None:
        """Samples 0.5 s apart from t = 2: no CPU, and one dump written just after ``dumped_after``."""
        for n in range(8):
            at = 2.0 + 0.5 * n
            io = DUMP_BYTES if at > dumped_after else 0
            state.apply(ProcessState(pid=pid, rank=rank, state="S", cpu_seconds=0.0, main_cpu_seconds=0.0,
                                     io_bytes=io, at=NOW + at))  # fmt: skip

    member = rig.sidecar.live.state
    asleep_and_dumping(member, 101, 1, dumped_after=peeked_at)
    later = Stall(
        at=NOW + 5.6, stalled_for_s=4.6, stall_timeout_s=300, progress_timeout_s=1800, probe_began_at=NOW + 5.5
    )
    member.apply(later)
    shared = unpack(pack(1, "full", later.at, nodes.judging.compact([], later)), "node 1")
    assert shared is not None

    local = JobState()  # the leader's node: rank 3 dumped for the leader's own look
    local.apply(WorkerSeen(pid=300, rank=3, host="node0", at=NOW))
    asleep_and_dumping(local, 300, 3, dumped_after=4.0)
    local.apply(
        Stall(at=NOW + 4.2, stalled_for_s=3.2, stall_timeout_s=5, progress_timeout_s=1800, probe_began_at=NOW + 4)
    )
    leaders = Stall(at=NOW + 6, stalled_for_s=5, stall_timeout_s=5, progress_timeout_s=1800)
    workers = take_snapshot(job_state(local, {1: shared.events}, leaders), observed_at=NOW + 6).workers
    rates = {w.rank: w.io_rate for w in workers if w.rank in (1, 3)}
    assert all((rate or 0) < BUSY_IO_BYTES_PER_S for rate in rates.values()), rates


def test_a_member_whose_job_failed_leaves_the_leader_which_of_its_ranks_went_first(tmp_path: Path) -> None:
    """Pipeline x DP on two wrappers (the H200): rank 3 died, node 1's torchrun ended rank 2 a moment later and then
    its node; ranks 0 and 1 on the leader's node wait for them.  The member's last evidence says which rank went
    first, and the leader names it (it named both ranks stuck in a collective, from older evidence)."""
    pytest.importorskip("torch.distributed")
    store = torch_store_server()
    rig = Rig(tmp_path)
    rig.emit(*(WorkerSeen(pid=200 + rank, rank=rank, host="node1", at=NOW) for rank in (2, 3)))
    rig.emit(WorkerGone(pid=203, rank=3, at=NOW + 5.0), WorkerGone(pid=202, rank=2, at=NOW + 5.12))
    rig.at(6.0)
    member = Cluster(
        Membership("127.0.0.1", store.port, "job", 0, 1, 2),
        "node1",
        clock=rig.clock,
        client=StoreClient("127.0.0.1", store.port, timeout_s=5),
    )
    nodes = joined(rig, member)
    member.view, member._view_changed_at = JobView(leader=0, term=0, seq=1, nnodes=2), NOW + 5
    rig.sidecar.drain()  # the sidecar folds its queue before its farewell (``Sidecar.farewell``)
    assert asyncio.run(nodes.farewell(job_failed=True, paged=False)) is None

    leader = Cluster(
        Membership("127.0.0.1", store.port, "job", 0, 0, 2),
        "node0",
        clock=rig.clock,
        client=StoreClient("127.0.0.1", store.port, timeout_s=5),
    )
    leader.summaries = {
        1: NodeSummary(node=1, host="node1", at=NOW + 6, ranks=[], last_progress=NOW + 4, phase="ended")
    }
    local = JobState()
    for rank in (0, 1):
        local.apply(WorkerSeen(pid=100 + rank, rank=rank, host="node0", at=NOW))
    evidence = JobEvidence(local, Stall(at=NOW + 12, stalled_for_s=7, stall_timeout_s=5, progress_timeout_s=600))
    assert list(asyncio.run(gather_compact(Met.of(leader), set(), NOW + 5, 0.0, evidence))) == [1]
    finding = evidence.judge().finding
    assert (finding.verdict, finding.culprits) == (Verdict.process_dead, (3,)), finding.summary
    assert "Rank 2 exited after it, within 0.1 s" in finding.summary


def test_a_gpu_stuck_in_another_kernel_proves_the_hang_once_it_has_held_for_a_while() -> None:
    """A rank's GPU in a non-NCCL kernel while its peers spin: one look cannot tell it from a long kernel, so it
    waits for the stall timeout; held for GPU_HANG_SETTLED_S of silence it proves the hang by itself (the H200: DDP
    and a compiled model hung 1.5 s into training, and the warm-up timeout was 300 s)."""
    live = LiveJob(SETTINGS, started_at=NOW)
    for rank in (0, 1):
        live.apply(WorkerSeen(pid=100 + rank, rank=rank, host="node0", at=NOW), NOW)
        live.apply(Heartbeat(pid=100 + rank, rank=rank, step=3, time=NOW + 1), NOW + 1)
    stuck = Decision(Finding(Verdict.gpu_compute_hang, "rank 1's GPU is stuck", culprits=(1,)), page=True)
    proof = Proof(live)
    settled = live.last_progress() + GPU_HANG_SETTLED_S
    assert not proof.proves(stuck, settled - 0.5) and proof.settles_at(stuck, settled - 0.5) == settled
    assert proof.proves(stuck, settled)
    # Spinning on almost none of its SMs, no NCCL operation running: no compute kernel looks so, proof sooner.
    spinning = Decision(replace(stuck.finding, kind="spin"), page=True)
    spun = live.last_progress() + GPU_SPIN_SETTLED_S
    assert spun < settled and not proof.proves(spinning, spun - 0.5) and proof.settles_at(spinning, spun - 0.5) == spun
    assert proof.proves(spinning, spun)
