"""A rank's I/O is its own, not the dump ncclwatch asked it for.

On the H200, FSDP2, TP and pipeline ranks asleep in Python wrote the Flight Recorder dump the first look asked
for while the confirming look sampled them: the I/O read as "busy (a checkpoint?)" and every such hang was held
for the progress timeout.  The samples here are /proc readings 0.5 s apart, as the live sidecar takes them.
"""

from __future__ import annotations

from conftest import NOW

from ncclwatch.watchdog.events import ProcessState, Stall, WorkerSeen
from ncclwatch.watchdog.hang.classify import BUSY_IO_BYTES_PER_S
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState

DUMP_BYTES = 4 << 20


def sampled(state: JobState, io_at: dict[float, int]) -> None:
    """Eight samples of pid 10 from NOW, 0.5 s apart, its I/O counter as given (carried forward)."""
    state.apply(WorkerSeen(pid=10, rank=1, world_size=2, host="node1", at=NOW))
    io = 0
    for n in range(8):
        at = NOW + 0.5 * n
        io = io_at.get(at, io)
        state.apply(ProcessState(pid=10, rank=1, state="S", cpu_seconds=0.0, main_cpu_seconds=0.0, io_bytes=io, at=at))


def probed(state: JobState, began: float, ended: float) -> None:
    state.apply(Stall(at=ended, stalled_for_s=10, stall_timeout_s=5, progress_timeout_s=1800, probe_began_at=began))


def io_rate(state: JobState) -> float | None:
    return take_snapshot(state, observed_at=NOW + 4).workers[0].io_rate


def test_the_dump_a_probe_asked_for_is_not_the_ranks_io() -> None:
    state = JobState()
    probed(state, NOW + 1.0, NOW + 1.6)
    sampled(state, {NOW + 1.5: DUMP_BYTES})  # written between the samples at 1.0 and 1.5 s
    assert (io_rate(state) or 0) < BUSY_IO_BYTES_PER_S


def test_io_outside_any_probe_is_the_ranks() -> None:
    state = JobState()
    probed(state, NOW + 1.0, NOW + 1.6)
    sampled(state, {NOW + 3.0: DUMP_BYTES})  # a checkpoint writing after the dump settled
    assert (io_rate(state) or 0) >= BUSY_IO_BYTES_PER_S


def test_without_probes_every_span_counts() -> None:
    state = JobState()
    sampled(state, {NOW + 1.5: DUMP_BYTES})
    assert (io_rate(state) or 0) >= BUSY_IO_BYTES_PER_S
