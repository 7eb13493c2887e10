"""WorkerSource against a real process tree shaped like torchrun's.

A small "launcher" process starts workers with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``) on
command; worker 0 starts a child of its own that inherits ``RANK`` (a
data-loader worker), which must not be taken for a rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ncclwatch.watchdog.events import Event, ProcessState, WorkerGone, WorkerSeen
from ncclwatch.watchdog.sources.workers import WorkerSource

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys
    WORKER = "import subprocess, sys, time\\n" \\
        "if sys.argv[1] == '0': subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\\n" \\
        "time.sleep(60)"
    children = []
    for line in sys.stdin:
        restart, world, *rdzv_round = line.split()
        for rank in range(int(world)):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, TORCHELASTIC_RESTART_COUNT=restart
            )
            if rdzv_round:  # as ncclwatch's torchrun exports the c10d rendezvous's round
                env["NCCLWATCH_RDZV_ROUND"] = rdzv_round[0]
            children.append(subprocess.Popen([sys.executable, "-c", WORKER, str(rank)], env=env))
        print("started", flush=True)
    """
)


@pytest.fixture
def launcher():
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield process
    import psutil

    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    process.wait()


def start(launcher, restart: int, world: int, rdzv_round: int | None = None) -> None:  # type: ignore[no-untyped-def]
    launcher.stdin.write(f"{restart} {world}{'' if rdzv_round is None else f' {rdzv_round}'}\n")
    launcher.stdin.flush()
    assert launcher.stdout.readline().strip() == "started"
    time.sleep(0.5)  # let worker 0 start its data-loader child


def poll(source: WorkerSource) -> list[Event]:
    events: list[Event] = []
    source.poll(events.append)
    return events


def test_workers_found_with_ranks_and_loader_children_ignored(launcher) -> None:  # type: ignore[no-untyped-def]
    start(launcher, restart=0, world=2)
    source = WorkerSource(launcher.pid, sample_every=0.0, host="node1")
    events = poll(source)
    seen = sorted((e.rank, e.world_size, e.restart_count) for e in events if isinstance(e, WorkerSeen))
    assert seen == [(0, 2, 0), (1, 2, 0)]
    assert sorted(e.rank for e in events if isinstance(e, ProcessState)) == [0, 1]
    assert not [e for e in poll(source) if isinstance(e, WorkerSeen)]  # found once


def test_stopped_worker_is_state_t_and_killed_one_is_gone(launcher) -> None:  # type: ignore[no-untyped-def]
    start(launcher, restart=0, world=2)
    source = WorkerSource(launcher.pid, sample_every=0.0, host="node1")
    pids = {e.rank: e.pid for e in poll(source) if isinstance(e, WorkerSeen)}
    os.kill(pids[1], signal.SIGSTOP)
    try:
        time.sleep(0.2)
        states = {e.rank: e.state for e in poll(source) if isinstance(e, ProcessState)}
        assert states == {0: "S", 1: "T"}
    finally:
        os.kill(pids[1], signal.SIGCONT)
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.2)
    gone = [e for e in poll(source) if isinstance(e, WorkerGone)]
    assert [(e.rank, e.pid) for e in gone] == [(0, pids[0])]


def test_restart_brings_new_pids_with_a_higher_count(launcher) -> None:  # type: ignore[no-untyped-def]
    start(launcher, restart=0, world=1)
    source = WorkerSource(launcher.pid, sample_every=0.0, host="node1")
    first = [e for e in poll(source) if isinstance(e, WorkerSeen)]
    os.kill(first[0].pid, signal.SIGKILL)
    start(launcher, restart=1, world=1)
    events = poll(source)
    assert [(e.rank, e.restart_count) for e in events if isinstance(e, WorkerSeen)] == [(0, 1)]
    assert [e.pid for e in events if isinstance(e, WorkerGone)] == [first[0].pid]


def test_the_rendezvous_round_tells_rounds_apart_where_this_nodes_restart_count_does_not(launcher) -> None:  # type: ignore[no-untyped-def]
    """c10d: torchrun restarts healthy workers when another node rejoins without counting a restart."""
    start(launcher, restart=0, world=1, rdzv_round=0)
    source = WorkerSource(launcher.pid, sample_every=0.0, host="node0")
    first = [e for e in poll(source) if isinstance(e, WorkerSeen)]
    assert [e.restart_count for e in first] == [0]
    os.kill(first[0].pid, signal.SIGKILL)
    start(launcher, restart=0, world=1, rdzv_round=1)  # the count stayed 0; the round did not
    assert [(e.rank, e.restart_count) for e in poll(source) if isinstance(e, WorkerSeen)] == [(0, 1)]


def test_two_exits_in_one_poll_keep_their_order_and_their_own_times(launcher) -> None:  # type: ignore[no-untyped-def]
    """torchrun ends a failed rank's local peers about 0.1 s after it: both exits fall in one poll, and the rank
    that died first must still be told from the one ended after it (the pidfd's moment, not the poll's)."""
    start(launcher, restart=0, world=2)
    source = WorkerSource(launcher.pid, sample_every=0.0, host="node1")
    pids = {e.rank: e.pid for e in poll(source) if isinstance(e, WorkerSeen)}
    time.sleep(0.1)  # the exit watcher's thread is waiting
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    time.sleep(0.15)
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.2)
    gone = {e.rank: e.at for e in poll(source) if isinstance(e, WorkerGone)}
    assert sorted(gone) == [0, 1]
    assert abs(gone[1] - killed_at) < 0.05 and 0.1 < gone[0] - gone[1] < 0.3
