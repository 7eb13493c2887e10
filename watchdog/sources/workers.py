"""The job's workers: found under torchrun, ranked from their environment, sampled in /proc.

torchrun starts one process per local rank with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT`` in its environment.  The
worker of a rank is the shallowest descendant of torchrun carrying that
``RANK``: data-loader workers and compile subprocesses inherit the variable
but sit deeper.  An elastic restart replaces every worker: new pids, a higher
round; the old ones are reported gone.

The round is the c10d rendezvous's, which ncclwatch's torchrun records in
``NCCLWATCH_RDZV_ROUND`` (the same on every node), else the restart count.
torchrun's count is per node: a node whose torchrun restarts its healthy
workers because another node came back to the rendezvous does not count it,
so its new workers carried the old round's count (two wrappers on an H200:
the leader never saw its new round, and resolved the page only when the job
ended, 61 s after the fault).

Process state comes from psutil (``/proc/<pid>/stat``): ``T`` stopped
(SIGSTOP), ``t`` traced, ``Z`` zombie, ``D`` disk sleep; CPU seconds and I/O
bytes tell a busy rank from an idle one.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass

import psutil

from ncclwatch.watchdog.events import ProcessState, WorkerGone, WorkerSeen
from ncclwatch.watchdog.probes.procfs import main_thread_cpu_seconds
from ncclwatch.watchdog.sources import DownOnce, Emit, PollingSource

# psutil's status names -> the /proc state letters people know.
STATE_LETTERS = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}


@dataclass
class _Worker:
    process: psutil.Process
    rank: int
    exit_seen: bool = False  # /proc said it exited before its pidfd's moment was noted


def _round(environ: dict[str, str]) -> int:
    rendezvous = _int(environ.get("NCCLWATCH_RDZV_ROUND"))
    return rendezvous if rendezvous is not None else _int(environ.get("TORCHELASTIC_RESTART_COUNT")) or 0


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _store(environ: dict[str, str]) -> str | None:
    addr, port = environ.get("MASTER_ADDR"), _int(environ.get("MASTER_PORT"))
    return f"{addr}:{port}" if addr and port else None


class ExitTimes:
    """When each watched process exited, to the millisecond: one pidfd per process (Linux 5.3+), waited on by one
    thread.  The /proc poll sees an exit up to its interval late, and torchrun ends a failed rank's local peers
    about 0.1 s after it (its monitor interval): both often fell in one poll, and which rank died first, the one
    the job waits for, was left to chance (the H200, pipeline x DP on two wrappers, rank 3 killed: ranks 2 and 3
    named).  Where pidfds are not to be had, the poll's time stands."""

    def __init__(self) -> None:
        self._epoll: select.epoll | None = None
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._exited: dict[int, float] = {}  # pid -> when its pidfd became readable
        self._lock = threading.Lock()

    def watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or no pidfd on this kernel
            return
        with self._lock:
            if self._epoll is None:
                self._epoll = select.epoll()
                threading.Thread(target=self._wait, args=(self._epoll,), name="ncclwatch-exits", daemon=True).start()
            self._pids[fd] = pid
            self._epoll.register(fd, select.EPOLLIN)  # epoll_ctl beside a blocked epoll_wait is safe on Linux

    def exited_at(self, pid: int) -> float | None:
        with self._lock:
            return self._exited.pop(pid, None)

    def waiting_for(self, pid: int) -> bool:
        """Its pidfd has not fired yet (the thread may still wait for the GIL to note it)."""
        with self._lock:
            return pid in self._pids.values()

    def _wait(self, epoll: select.epoll) -> None:
        while True:
            ready = epoll.poll()
            now = time.time()
            with self._lock:
                for fd, _ in ready:
                    epoll.unregister(fd)
                    os.close(fd)
                    if (pid := self._pids.pop(fd, None)) is not None:
                        self._exited[pid] = now


class WorkerSource(PollingSource):
    """Finds torchrun's workers, follows restarts, samples their state every ``sample_every`` s."""

    name = "workers"

    def __init__(
        self, torchrun_pid: int, interval: float = 0.25, sample_every: float = 0.5, host: str | None = None
    ) -> None:
        self.torchrun_pid = torchrun_pid
        self.interval = interval
        self.sample_every = sample_every
        self.host = host or socket.gethostname().split(".")[0]
        self._workers: dict[int, _Worker] = {}
        self._ignored: set[int] = set()
        self._last_sample = 0.0
        self._down = DownOnce(self.name)
        self._exits = ExitTimes()

    def poll(self, emit: Emit) -> None:
        now = time.time()
        try:
            root = psutil.Process(self.torchrun_pid)
            descendants = root.children(recursive=True)
        except psutil.Error as exc:
            self._down(emit, f"torchrun (pid {self.torchrun_pid}) is gone: {exc}")
            descendants = []
        self._discover(descendants, emit, now)
        self._forget_gone(emit, now)
        if now - self._last_sample >= self.sample_every:
            self._last_sample = now
            for worker in self._workers.values():
                if worker.exit_seen:
                    continue  # gone, its WorkerGone due at the next poll
                state = sample(worker.process, worker.rank)
                if state is not None:
                    emit(state)

    def _discover(self, descendants: list[psutil.Process], emit: Emit, now: float) -> None:
        candidates: dict[int, tuple[psutil.Process, dict[str, str], int]] = {}
        for process in descendants:
            if process.pid in self._workers or process.pid in self._ignored:
                continue
            try:
                environ = process.environ()
                ppid = process.ppid()
            except psutil.Error:
                continue  # just exited, or not ours to read; tried again next poll
            if _int(environ.get("RANK")) is not None:
                candidates[process.pid] = (process, environ, ppid)
        self._ignored &= {p.pid for p in descendants}  # pids get reused
        ranked = set(self._workers) | self._ignored | set(candidates)
        for pid, (process, environ, ppid) in sorted(candidates.items()):
            if ppid in ranked:
                self._ignored.add(pid)  # a child of a worker (data loader, compile): same RANK, not a rank
                continue
            rank = _int(environ.get("RANK"))
            assert rank is not None
            self._workers[pid] = _Worker(process, rank)
            self._exits.watch(pid)
            emit(
                WorkerSeen(
                    pid=pid,
                    rank=rank,
                    local_rank=_int(environ.get("LOCAL_RANK")),
                    world_size=_int(environ.get("WORLD_SIZE")),
                    restart_count=_round(environ),
                    host=self.host,
                    at=now,
                    node_rank=_int(environ.get("GROUP_RANK")),
                    nnodes=_int(environ.get("GROUP_WORLD_SIZE")),
                    store=_store(environ),
                    run_id=environ.get("TORCHELASTIC_RUN_ID"),
                )
            )

    def _forget_gone(self, emit: Emit, now: float) -> None:
        for pid, worker in list(self._workers.items()):
            try:
                gone = worker.process.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                exited = self._exits.exited_at(pid)
                if exited is None and not worker.exit_seen and self._exits.waiting_for(pid):
                    worker.exit_seen = True  # its exact moment comes by the next poll: two exits in one poll stay apart
                    continue
                del self._workers[pid]
                emit(WorkerGone(pid=pid, rank=worker.rank, at=min(exited, now) if exited is not None else now))


def sample(process: psutil.Process, rank: int) -> ProcessState | None:
    try:
        with process.oneshot():
            status = process.status()
            times = process.cpu_times()
            try:
                io = process.io_counters()
                io_bytes = io.read_bytes + io.write_bytes
            except (psutil.AccessDenied, AttributeError):
                io_bytes = None
    except psutil.Error:
        return None
    return ProcessState(
        pid=process.pid,
        rank=rank,
        state=STATE_LETTERS.get(status, "?"),
        cpu_seconds=times.user + times.system,
        io_bytes=io_bytes,
        at=time.time(),
        main_cpu_seconds=main_thread_cpu_seconds(process.pid),
    )
