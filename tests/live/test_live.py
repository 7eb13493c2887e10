"""The live pieces, tick by tick: file sources, the learned stall timeout, the live verdict.

Sources read real files in tmp_path (NCCL's exact line format from
nccl_lines); ``LiveJob`` and ``classify`` get literal events with an explicit
clock, so every rule is checked at the second it should fire, and a "stays
quiet" case sits next to each "fires" case.
"""

from __future__ import annotations

import json
from pathlib import Path

import nccl_lines as L
import pytest
from conftest import NOW

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    GpuGpm,
    GpuProcess,
    GpuSample,
    GpuSnapshot,
    Heartbeat,
    OpBatch,
    ProcessState,
    StackDump,
    Stall,
    ThreadStack,
    Unusable,
    WorkerGone,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.job import MIN_PROGRESS, LiveJob
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.sources.files import HeartbeatSource, NcclFileSource

COMM = "0x5583d3a1f0e0"
SETTINGS = Settings(stall_timeout_floor=5.0, warmup_stall_timeout=300.0, progress_timeout=600.0, poll_interval=0.25)


def collect(source) -> list[Event]:  # type: ignore[no-untyped-def]
    events: list[Event] = []
    source.poll(events.append)
    return events


# -- sources ------------------------------------------------------------------


class TestNcclFileSource:
    def test_partial_line_waits_for_its_end(self, tmp_path: Path) -> None:
        log = tmp_path / "node1.1000"
        text = L.init(0, 2, COMM, pid=1000) + L.op(0, "AllReduce", 1024, COMM, pid=1000)
        log.write_text(text[:-30])
        source = NcclFileSource(tmp_path)
        first = [e for e in collect(source) if isinstance(e, OpBatch)]
        assert sum(len(e.sigs) for e in first) == 0
        log.write_text(text)
        second = [e for e in collect(source) if isinstance(e, OpBatch)]
        assert [s.op for e in second for s in e.sigs] == ["AllReduce"]

    def test_nothing_new_emits_nothing(self, tmp_path: Path) -> None:
        (tmp_path / "node1.1000").write_text(L.init(0, 2, COMM, pid=1000) + L.steps(0, COMM, 2, pid=1000))
        source = NcclFileSource(tmp_path)
        assert collect(source)
        assert collect(source) == []

    def test_truncated_file_is_read_again_and_said(self, tmp_path: Path) -> None:
        log = tmp_path / "node1.1000"
        log.write_text(L.init(0, 2, COMM, pid=1000) + L.steps(0, COMM, 5, pid=1000))
        source = NcclFileSource(tmp_path)
        collect(source)
        log.write_text(L.init(0, 2, COMM, pid=1000) + L.steps(0, COMM, 1, pid=1000))
        events = collect(source)
        assert any(isinstance(e, Unusable) and "truncated" in e.reason for e in events)
        assert sum(len(e.sigs) for e in events if isinstance(e, OpBatch)) == len(L.STEP)

    def test_missing_folder_is_source_down_once(self, tmp_path: Path) -> None:
        source = NcclFileSource(tmp_path / "absent")
        assert [type(e).__name__ for e in collect(source)] == ["SourceDown"]
        assert collect(source) == []


class TestHeartbeatSource:
    def test_changed_file_gives_one_heartbeat(self, tmp_path: Path) -> None:
        beat = {"pid": 7, "rank": 1, "local_rank": 1, "restart": 0, "step": 3, "time": NOW, "beats": 4}
        (tmp_path / "7.json").write_text(json.dumps(beat))
        source = HeartbeatSource(tmp_path)
        assert collect(source) == [Heartbeat(pid=7, rank=1, step=3, time=NOW, restart=0, beats=4)]
        assert collect(source) == []

    def test_malformed_file_is_ignored(self, tmp_path: Path) -> None:
        (tmp_path / "7.json").write_text('{"pid": 7, "rank": ')
        assert collect(HeartbeatSource(tmp_path)) == []


# -- the learned stall timeout -------------------------------------------------


def worker(job: LiveJob, pid: int, rank: int, at: float, restart: int = 0) -> None:
    job.apply(WorkerSeen(pid=pid, rank=rank, host="node1", at=at, restart_count=restart), at)


def beats(job: LiveJob, pid: int, rank: int, times: list[float], first_step: int = 0) -> None:
    for step, at in enumerate(times, start=first_step):
        job.apply(Heartbeat(pid=pid, rank=rank, step=step, time=at), at)


class TestStallTimeout:
    def test_warmup_timeout_until_the_job_shows_its_rhythm(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        beats(job, 10, 0, [NOW + i for i in range(MIN_PROGRESS)])  # MIN_PROGRESS - 1 gaps
        assert job.stall_timeout(NOW + 10) == SETTINGS.warmup_stall_timeout
        beats(job, 10, 0, [NOW + MIN_PROGRESS], first_step=MIN_PROGRESS)
        assert job.stall_timeout(NOW + 10) == SETTINGS.stall_timeout_floor

    def test_slow_job_gets_a_longer_timeout(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        beats(job, 10, 0, [NOW + 4 * i for i in range(12)])
        assert job.stall_timeout(NOW + 50) == 3 * 4 + 2 * SETTINGS.poll_interval

    def test_a_gap_the_watchdog_caused_is_not_learned(self) -> None:
        """A 2.4 s step while the first Flight Recorder dump ran (seen on the H100: stall timeouts of 8 s, pages
        2 s late) is the watchdog's doing; the same step outside that window is the job's and widens the timeout."""
        times = [NOW + 0.1 * i for i in range(20)] + [NOW + 1.9 + 2.4] + [NOW + 4.3 + 0.1 * i for i in range(1, 10)]
        excused, plain = LiveJob(SETTINGS, started_at=NOW), LiveJob(SETTINGS, started_at=NOW)
        for job in (excused, plain):
            worker(job, 10, 0, NOW)
            beats(job, 10, 0, times)
        excused.excuse(NOW + 2.0, 10.0)
        assert excused.learned_gap(NOW + 6)[0] == pytest.approx(0.1, abs=1e-3)
        assert excused.stall_timeout(NOW + 6) == SETTINGS.stall_timeout_floor
        assert plain.learned_gap(NOW + 6)[0] == pytest.approx(2.4, abs=1e-3)

    def test_the_first_steps_are_warm_up_and_not_learned_once_the_job_has_a_rhythm(self) -> None:
        """Seen on the H100 suite: the first step took 2.6 s (NCCL connecting on first use), every later one 0.1 s;
        the learned stall timeout was 8.2 s instead of the 5 s floor, and the page came 3 s late."""
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        times = [NOW, NOW + 2.6] + [NOW + 2.6 + 0.1 * i for i in range(1, 20)]
        beats(job, 10, 0, times)
        assert job.learned_gap(NOW + 5)[0] == pytest.approx(0.1, abs=1e-3)
        assert job.stall_timeout(NOW + 5) == SETTINGS.stall_timeout_floor

    def test_warm_up_gaps_count_while_there_are_no_others(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        beats(job, 10, 0, [NOW + 1, NOW + 4])  # the first step only: 3 s, all there is to learn from
        assert job.learned_gap(NOW + 5)[0] == pytest.approx(3.0, abs=1e-3)

    def test_a_fast_job_first_read_many_steps_in_has_shown_its_progress(self) -> None:
        """H100, a pipeline job: NCCL's log moved during set-up, then the heartbeat was first read at step 60 (its
        61st beat, 0.3 s into training) and the job hung there: 4 advances counted, so the 300 s warm-up timeout
        held the page.  The beat count says 60 steps passed."""
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 1000, 0, NOW)
        for event in NcclLogParser("node1.1000").feed(
            (L.init(0, 2, COMM, pid=1000) + L.steps(0, COMM, 1, pid=1000)).encode(), final=True
        ):
            job.apply(event, NOW + 2)
        job.apply(Heartbeat(pid=1000, rank=0, step=60, time=NOW + 2.3, beats=61), NOW + 2.4)
        assert job.learned_gap(NOW + 3) == (pytest.approx(0.3, abs=1e-3), 61)
        assert job.stall_timeout(NOW + 3) == SETTINGS.stall_timeout_floor

    def test_a_first_read_counts_the_beats_before_it(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        job.apply(Heartbeat(pid=10, rank=0, step=60, time=NOW + 1, beats=61), NOW + 1)
        job.apply(Heartbeat(pid=10, rank=0, step=64, time=NOW + 1.1, beats=65), NOW + 1.1)
        assert job.learned_gap(NOW + 2) == (pytest.approx(0.1, abs=1e-3), 64)

    def test_steps_a_heartbeat_shows_count_when_nccl_moved_later_in_the_same_poll(self) -> None:
        """4 x H200, the compiled model stuck at step 200: 200 steps in under 2 s after its compile, 7 advances
        counted, and the page waited for the 300 s warm-up timeout.  Each poll stamped NCCL's new operations at
        the poll's time and the heartbeat at the hook's own, a little earlier, so every heartbeat looked older than
        the latest progress and its steps were dropped."""
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 1000, 0, NOW)
        parser = NcclLogParser("node1.1000")
        for event in parser.feed(L.init(0, 2, COMM, pid=1000).encode()):
            job.apply(event, NOW)
        for poll in range(1, 8):
            now = NOW + 0.25 * poll
            for event in parser.feed(L.steps(0, COMM, 1, pid=1000).encode()):
                job.apply(event, now)
            job.apply(Heartbeat(pid=1000, rank=0, step=30 * poll, time=now - 0.05, beats=30 * poll + 1), now)
        assert job.learned_gap(NOW + 2)[1] >= 7 * 30
        assert job.stall_timeout(NOW + 2) == SETTINGS.stall_timeout_floor

    def test_explicit_timeout_wins(self) -> None:
        job = LiveJob(Settings(stall_timeout=42), started_at=NOW)
        assert job.stall_timeout(NOW) == 42

    def test_restart_retires_the_old_workers(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        beats(job, 10, 0, [NOW + 1])
        worker(job, 20, 0, NOW + 30, restart=1)
        assert [w.pid for w in job.state.current_workers()] == [20]
        assert job.last_progress() == NOW + 30  # the new attempt's start, not the old progress

    def test_restarts_are_counted_from_the_first_round_seen(self) -> None:
        """A c10d rendezvous's rounds need not start at 0 (an etcd store keeps a reused run id's)."""
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW, restart=3)
        assert (job.state.current_round(), job.state.restarts_seen()) == (3, 0)
        worker(job, 20, 0, NOW + 30, restart=4)
        assert (job.state.current_round(), job.state.restarts_seen()) == (4, 1)

    def test_a_restarted_attempt_keeps_the_jobs_rhythm_once_it_moves(self) -> None:
        """Seen in CI on a loaded machine: the restarted ranks were first read at step 11, already stuck; on their
        own they showed no gap, and the warm-up timeout (300 s) held the page back past the test's 150 s."""
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 10, 0, NOW)
        beats(job, 10, 0, [NOW + 0.1 * i for i in range(20)], first_step=1)
        worker(job, 20, 0, NOW + 30, restart=1)
        assert job.stall_timeout(NOW + 35) == SETTINGS.warmup_stall_timeout  # starting up: no step yet
        beats(job, 20, 0, [NOW + 36], first_step=11)
        assert job.stall_timeout(NOW + 40) == SETTINGS.stall_timeout_floor  # the first attempt's 0.1 s steps

    def test_nccl_operations_are_progress(self) -> None:
        job = LiveJob(SETTINGS, started_at=NOW)
        worker(job, 1000, 0, NOW)
        for event in NcclLogParser("node1.1000").feed(
            (L.init(0, 2, COMM, pid=1000) + L.steps(0, COMM, 1, pid=1000)).encode(), final=True
        ):
            job.apply(event, NOW + 3)
        assert job.last_progress() == NOW + 3
        assert job.view(NOW + 3).signals == {"nccl_log"}


# -- the live verdict ------------------------------------------------------------


def stack(pid: int, *frames: str) -> StackDump:
    return StackDump(
        pid=pid, threads=[ThreadStack(name="MainThread", frames=list(frames))], cite=Citation(file="py-spy")
    )


IN_ALL_REDUCE = "all_reduce (torch/distributed/distributed_c10d.py:3252)"
SLEEPING = "main (train.py:105)"


def three_ranks(at: float, states: tuple[str, str, str] = ("S", "S", "S"), cpu: float = 0.0) -> LiveJob:
    """Three ranks that beat every second for 20 s, then stopped at ``at``."""
    job = LiveJob(SETTINGS, started_at=NOW)
    for rank in range(3):
        worker(job, 100 + rank, rank, NOW)
        beats(job, 100 + rank, rank, [NOW + i for i in range(21)])
        for i, t in enumerate((at - 2, at - 1, at)):
            job.apply(
                ProcessState(pid=100 + rank, rank=rank, state=states[rank], cpu_seconds=cpu * i * (rank == 2), at=t), t
            )
    return job


def decided(job: LiveJob, now: float, stacks: list[StackDump], logs: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    for name, text in (logs or {}).items():
        for event in NcclLogParser(name).feed(text.encode(), final=True):
            job.apply(event, NOW)
    for dump in stacks:
        job.apply(dump, now)
    stall = Stall(
        at=now,
        stalled_for_s=now - job.last_progress(),
        stall_timeout_s=job.stall_timeout(now),
        progress_timeout_s=SETTINGS.progress_timeout,
    )
    job.apply(stall, now)
    return classify(take_snapshot(job.state, observed_at=now))


def behind_logs() -> dict[str, str]:
    """Ranks 0 and 1 issued one more step than rank 2 (pids 100-102)."""
    return {
        f"node1.{100 + r}": L.init(r, 3, COMM, pid=100 + r) + L.steps(r, COMM, 5 if r == 2 else 6, pid=100 + r)
        for r in range(3)
    }


class TestClassify:
    def test_stopped_rank_is_process_stopped(self) -> None:
        job = three_ranks(NOW + 20, states=("S", "S", "T"))
        decision = decided(job, NOW + 27, [stack(100, IN_ALL_REDUCE), stack(101, IN_ALL_REDUCE)], behind_logs())
        assert decision.page
        assert decision.finding.verdict == Verdict.process_stopped
        assert decision.finding.culprits == (2,)

    def test_rank_behind_and_idle_pages(self) -> None:
        job = three_ranks(NOW + 20)
        stacks = [stack(100, IN_ALL_REDUCE), stack(101, IN_ALL_REDUCE), stack(102, SLEEPING)]
        decision = decided(job, NOW + 27, stacks, behind_logs())
        assert decision.page
        assert decision.finding.verdict == Verdict.rank_behind
        assert decision.finding.culprits == (2,)
        assert any("python at main (train.py:105)" in e.fact for e in decision.finding.evidence)

    def test_rank_behind_but_busy_is_held_until_the_progress_timeout(self) -> None:
        job = three_ranks(NOW + 20, cpu=1.0)  # rank 2 burns a core: writing a checkpoint
        stacks = [stack(100, IN_ALL_REDUCE), stack(101, IN_ALL_REDUCE), stack(102, "save (torch/serialization.py:900)")]
        decision = decided(job, NOW + 27, stacks, behind_logs())
        assert not decision.page
        assert "busy" in (decision.held or "")
        late = decided(job, NOW + 20 + SETTINGS.progress_timeout, stacks)
        assert late.page and late.finding.verdict == Verdict.rank_behind

    def test_pause_outside_collectives_is_not_a_hang(self) -> None:
        job = three_ranks(NOW + 20)
        decision = decided(job, NOW + 27, [stack(100 + r, SLEEPING) for r in range(3)])
        assert not decision.page
        assert decision.finding.verdict == Verdict.progress_stalled
        assert "no rank is inside a collective" in (decision.held or "")

    def test_pause_past_the_progress_timeout_is_progress_stalled(self) -> None:
        job = three_ranks(NOW + 20)
        decision = decided(job, NOW + 21 + SETTINGS.progress_timeout, [stack(100 + r, SLEEPING) for r in range(3)])
        assert decision.page
        assert decision.finding.verdict == Verdict.progress_stalled

    def test_lead_from_stacks_when_sequences_agree(self) -> None:
        job = three_ranks(NOW + 20)
        stacks = [stack(100, IN_ALL_REDUCE), stack(101, IN_ALL_REDUCE), stack(102, SLEEPING)]
        decision = decided(job, NOW + 27, stacks)  # no NCCL logs, no dumps: only stacks
        assert decision.page
        assert decision.finding.verdict == Verdict.stuck_in_collective
        assert decision.finding.culprits == (2,)

    def test_gpu_wait_alone_is_not_a_collective(self) -> None:
        job = three_ranks(NOW + 20)
        waiting = "synchronize (torch/cuda/__init__.py:1083)"
        decision = decided(job, NOW + 27, [stack(100 + r, waiting) for r in range(3)])
        assert not decision.page


def same_logs() -> dict[str, str]:
    """Every rank issued the same six steps (pids 100-102)."""
    return {f"node1.{100 + r}": L.init(r, 3, COMM, pid=100 + r) + L.steps(r, COMM, 6, pid=100 + r) for r in range(3)}


def gpus_at(at: float, util_and_sm: list[tuple[float, float]]) -> GpuSnapshot:
    """One NVML sample: GPU r runs pid 100 + r with the given GPU-Util and GPM SM util."""
    gpus = [
        GpuSample(index=r, util_gpu_pct=util, gpm=GpuGpm(sm_util_pct=sm), processes=[GpuProcess(pid=100 + r)])
        for r, (util, sm) in enumerate(util_and_sm)
    ]
    return GpuSnapshot(time=at, gpus=gpus, cite=Citation(file="nvml"))


class TestClassifyMore:
    def test_rank_that_exited_while_peers_wait_is_process_dead(self) -> None:
        job = three_ranks(NOW + 20)
        job.apply(WorkerGone(pid=102, rank=2, at=NOW + 21), NOW + 21)
        decision = decided(job, NOW + 27, [stack(100, IN_ALL_REDUCE), stack(101, IN_ALL_REDUCE)], behind_logs())
        assert decision.page
        assert decision.finding.verdict == Verdict.process_dead
        assert decision.finding.culprits == (2,)

    def test_everyone_gone_is_not_a_hang(self) -> None:
        job = three_ranks(NOW + 20)
        for rank in range(3):
            job.apply(WorkerGone(pid=100 + rank, rank=rank, at=NOW + 21), NOW + 21)
        assert decided(job, NOW + 27, []).finding.verdict != Verdict.process_dead

    def test_lead_gpu_in_a_foreign_kernel_is_gpu_compute_hang(self) -> None:
        job = three_ranks(NOW + 20)
        job.apply(gpus_at(NOW + 26, [(100, 18.18), (100, 18.18), (100, 0.76)]), NOW + 26)
        stacks = [stack(100 + r, "synchronize (torch/cuda/__init__.py:1083)") for r in range(3)]
        decision = decided(job, NOW + 27, stacks, same_logs())
        assert decision.page
        assert decision.finding.verdict == Verdict.gpu_compute_hang
        assert decision.finding.culprits == (2,)

    def test_lead_gpu_idle_stays_stuck_in_collective(self) -> None:
        job = three_ranks(NOW + 20)
        job.apply(gpus_at(NOW + 26, [(100, 18.18), (100, 18.18), (0, 0)]), NOW + 26)
        decision = decided(job, NOW + 27, [stack(100 + r, IN_ALL_REDUCE) for r in range(3)], same_logs())
        assert decision.finding.verdict == Verdict.stuck_in_collective
        assert decision.finding.culprits == (2,)


def test_gloo_dump_completion_comes_from_the_group_status() -> None:
    """gloo's entries stay 'scheduled' (torch 2.13); pg_status.last_completed_collective says what finished."""
    from ncclwatch.watchdog.hang.state import JobState
    from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

    path = Path(__file__).parents[1] / "data" / "flight_recorder" / "torch2.13_gloo_pickle_rank_0"
    dump = parse_flight_recorder(path.read_bytes(), "ncclwatch_trace_0")[0]
    assert all(e.state.value == "scheduled" for e in dump.entries)
    state = JobState()
    state.apply(dump)
    assert {key: (seq.total, seq.completed) for key, c in state.comms.items() for seq in c.ranks.values()} == {
        "fr:0": (6, 6),
        "fr:1": (1, 1),
    }
