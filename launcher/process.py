"""Run torchrun as a child so the job behaves as it would under torchrun alone.

The process tree ``ncclwatch torchrun ...`` makes::

    ncclwatch (this process; child subreaper)
    └── torchrun          own process group (pgid = its pid), our session
        ├── worker rank 0 own session (torchrun starts workers with start_new_session)
        └── worker rank 1 own session

Traps this module handles, each seen on torch 2.13:

* Workers are not in torchrun's process group: torchrun's ``Popen`` uses
  ``start_new_session=True``.  ``killpg(torchrun)`` reaches torchrun only, and a
  terminal's Ctrl-C never reaches workers directly under plain torchrun
  either; torchrun forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to them itself.
* torchrun in its own group no longer gets the terminal's signals (they go
  to the foreground group, ours), so ``forward_signals`` passes them on.
  The workers' sessions have no controlling terminal, so a worker reading
  stdin (``breakpoint()``) works as under plain torchrun.
* A SIGKILLed torchrun leaves its workers running (no parent-death signal).
  As a child subreaper we inherit such orphans instead of init, so
  ``reap_orphans`` can find them by walking our own descendants.
* torchrun exits 1 whatever code a worker failed with (a worker exiting 3
  gives 1) and 1 on SIGTERM; only a signal that kills torchrun itself gives a
  negative ``returncode``, which ``exit_status`` maps to 128+N as a shell does.
* torchrun answers the SIGTERM of ``terminate`` with a ~30-line traceback;
  started with ``hide_shutdown_noise``, its stderr goes through a relay that
  hides that answer only (``launcher/shutdown_noise.py``).

The job's processes are told from the caller's own helpers by process group:
everything the job starts is outside ours (torchrun's group, the workers'
sessions), so a helper the sidecar starts (py-spy) is never reaped as long as
it stays in our process group.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

import psutil

from ncclwatch.launcher.shutdown_noise import StderrRelay

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_POLL_S = 0.05


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to this process instead of init (Linux 3.4+).

    False where ``prctl`` is missing or refuses; ``reap_orphans`` then still
    finds torchrun's process group, but not workers orphaned by a dead torchrun.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


EXIT_NOT_FOUND = 127  # as a shell: the command was not found
EXIT_NOT_EXECUTABLE = 126  # as a shell: found, but it cannot be run


def launch_problem(argv: Sequence[str], path: str | None = None) -> tuple[int, str] | None:
    """Why ``argv[0]`` cannot be started, with the status a shell would give; None when it can.

    Checked before anything starts, so that a torchrun missing from ``PATH`` (the environment that has torch
    not activated) is one line, not a traceback from ``Popen``.  ``path``: the ``PATH`` searched (default ours).
    """
    program = argv[0]
    if "/" not in program:
        if shutil.which(program, path=path) is None:
            return EXIT_NOT_FOUND, (
                f"{program} not found on PATH (activate the environment that has torch, or give its full path)"
            )
        return None
    if not os.path.exists(program):
        return EXIT_NOT_FOUND, f"{program} not found"
    if os.path.isdir(program) or not os.access(program, os.X_OK):
        return EXIT_NOT_EXECUTABLE, f"{program} cannot be run (not an executable file)"
    return None


def exit_status(returncode: int) -> int:
    """The status a shell reports for a child with this ``Popen.returncode`` (-N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


class JobProcess:
    """torchrun (or any launcher command) as our child; see the module docstring.

    Use from an asyncio loop: ``start``, ``forward_signals(loop)``, ``await
    wait()``, then ``reap_orphans()``.
    """

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._stderr: StderrRelay | None = None
        self._hide_shutdown_noise = False
        self.subreaper = False
        self.stopped_by: int | None = None  # the first signal the user sent us, passed on: the job was stopped

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        hide_shutdown_noise: bool = False,
        stderr_tap: Callable[[bytes], None] | None = None,
    ) -> int:
        """Spawn ``argv`` with ``env`` in its own process group; return its pid.

        stdin, stdout and the working folder are ours, unchanged; stderr
        reaches ours through a ``StderrRelay`` (call ``close_stderr`` at the
        end) that passes every byte to ``stderr_tap`` too and, with
        ``hide_shutdown_noise`` (``--on-hang kill``), hides torchrun's answer
        to ``terminate``.  Without either, stderr is ours directly.  Raises
        ``OSError`` (``FileNotFoundError`` for a missing command) as
        ``subprocess.Popen`` does.
        """
        if self._popen is not None:
            raise RuntimeError("JobProcess already started")
        self.subreaper = become_subreaper()
        self._hide_shutdown_noise = hide_shutdown_noise
        relayed = hide_shutdown_noise or stderr_tap is not None
        self._stderr = StderrRelay(tap=stderr_tap) if relayed else None
        # process_group=0: setpgid(0, 0) in the child before exec, so the
        # group exists before torchrun can start anything.
        try:
            stderr = None if self._stderr is None else self._stderr.child_fd
            self._popen = subprocess.Popen(argv, env=env, process_group=0, stderr=stderr)
        finally:
            if self._stderr is not None:
                self._stderr.close_child_end()
        return self._popen.pid

    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        """``Popen.returncode``: None while running, -N if killed by signal N."""
        return self._started().poll()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError("JobProcess not started")
        return self._popen

    async def wait(self) -> int:
        """Wait for torchrun without blocking the loop; its ``returncode`` (Python semantics).

        Uses a pidfd (Linux 5.3+) so the loop wakes when torchrun exits; on
        older kernels it polls every 50 ms.  No thread: a thread blocked in
        ``waitpid`` would hold up ``asyncio.run``'s executor shutdown.
        """
        popen = self._started()
        if popen.poll() is not None:
            return popen.returncode
        pidfd_open = getattr(os, "pidfd_open", None)
        try:
            pidfd = pidfd_open(popen.pid) if pidfd_open else None
        except OSError:
            pidfd = None
        if pidfd is None:
            while popen.poll() is None:
                await asyncio.sleep(_POLL_S)
            return popen.returncode
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return popen.wait()

    def forward_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Pass SIGINT, SIGTERM, SIGHUP and SIGQUIT on to torchrun, which passes them to workers.

        A terminal's new size goes to the job's pseudo-terminal, when it has one.
        """
        for sig in FORWARDED_SIGNALS:
            loop.add_signal_handler(sig, self._pass_on, sig)
        if self._stderr is not None and self._stderr.is_terminal:
            loop.add_signal_handler(signal.SIGWINCH, self._stderr.copy_window_size)

    def _pass_on(self, sig: int) -> None:
        """A signal the user sent the wrapper: the job is being stopped, which is no incident."""
        if self.stopped_by is None and self.returncode is None:
            self.stopped_by = sig
        self.send_signal(sig)

    async def output_settled(self, quiet_s: float = 0.2, max_s: float = 1.5) -> None:
        """Wait (at most ``max_s``) until the job's stderr has ended or been quiet ``quiet_s``: after torchrun
        exits, the last lines it and the ranks wrote (its failure summary) are still in the pipe."""
        if self._stderr is None:
            return
        deadline = time.monotonic() + max_s
        while not self._stderr.quiet(quiet_s) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)

    def send_signal(self, sig: int) -> None:
        """Signal torchrun if it still runs (never a reaped, possibly reused pid)."""
        popen = self._started()
        if popen.poll() is None:
            try:
                os.kill(popen.pid, sig)
            except ProcessLookupError:
                pass

    def children(self) -> list[int]:
        """torchrun's direct children, i.e. the workers of the current restart; [] once torchrun is gone."""
        try:
            return [child.pid for child in psutil.Process(self.pid).children()]
        except psutil.Error:
            return []

    def end_workers(self, pids: Sequence[int]) -> list[int]:
        """SIGKILL these workers and what they started (dataloader workers), torchrun left running.

        torchrun's agent sees the worker group fail and, with restarts left,
        starts it again.  SIGKILL, not SIGTERM: a rank hung in NCCL may hang
        again in its exit handlers, a stopped one would not act on SIGTERM,
        and the evidence is already captured.  Only torchrun's own children
        are signalled, each with its session (torchrun starts every worker in
        a session of its own, so its pid is its process group).  Returns the
        pids signalled.
        """
        ended = []
        for pid in sorted(set(pids) & set(self.children())):
            try:
                if _pgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                ended.append(pid)
            except ProcessLookupError:
                pass
        return ended

    def terminate(self, grace_s: float) -> None:
        """SIGTERM torchrun now; after ``grace_s``, SIGKILL whatever of the job is left.

        Returns at once (the SIGKILL is scheduled on the running loop), so the
        caller keeps awaiting ``wait()``.  The SIGKILL covers torchrun's group
        and every descendant outside our group: workers (own sessions) that a
        stuck torchrun would never kill.  What torchrun prints in answer is
        hidden if started with ``hide_shutdown_noise``.
        """
        if self._stderr is not None and self._hide_shutdown_noise:
            self._stderr.hide_shutdown_noise()
        self.send_signal(signal.SIGTERM)
        asyncio.get_running_loop().call_later(grace_s, self._kill_leftovers)

    def _kill_leftovers(self) -> None:
        _send(self._leftovers(), signal.SIGKILL)

    def reap_orphans(self, grace_s: float = 5.0) -> list[int]:
        """After torchrun has exited: SIGTERM what is left of the job, SIGKILL it after ``grace_s``.

        Left over are our descendants outside our process group (workers a
        SIGKILLed torchrun orphaned, daemons they double-forked, which the
        subreaper made ours) and members of torchrun's group.  Zombies among
        them are reaped, not counted.  Returns the pids signalled, sorted.
        Blocks up to ``grace_s`` + 1 s: call it at shutdown, or through
        ``asyncio.to_thread``.  Call it after ``wait()``: torchrun itself,
        if still running, counts as left over.
        """
        procs = [proc for proc in self._leftovers() if not _exited(proc)]
        _send(procs, signal.SIGTERM)
        alive = _wait_exited(procs, grace_s)
        _send(alive, signal.SIGKILL)
        _wait_exited(alive, 1.0)
        # Children of the processes just killed were reparented to us in the
        # meantime, some already dead: reap those zombies too.
        for proc in self._leftovers():
            _exited(proc)
        return sorted(proc.pid for proc in procs)

    def close_stderr(self) -> None:
        """After ``reap_orphans``: the job's last stderr output, relayed before the caller says more (if relayed)."""
        if self._stderr is not None:
            self._stderr.close()

    def _leftovers(self) -> list[psutil.Process]:
        """The job's processes still present (zombies included, so waiting reaps them)."""
        me, ours, group = os.getpid(), os.getpgrp(), self.pid
        found: dict[int, psutil.Process] = {}
        try:
            descendants = psutil.Process(me).children(recursive=True)
        except psutil.Error:
            descendants = []
        for proc in descendants:
            if _pgid(proc.pid) not in (ours, None):
                found[proc.pid] = proc
        # torchrun's group is scanned too, for when we are not a subreaper and
        # its orphaned members are no longer our descendants.  While any of
        # them lives the number stays their group id, and Linux hands out pids
        # in sequence, so no unrelated group takes the number in between.
        for proc in psutil.process_iter():
            if proc.pid != me and proc.pid not in found and _pgid(proc.pid) == group:
                found[proc.pid] = proc
        return list(found.values())


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _send(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil checks the pid still names the same process
        except psutil.Error:
            pass


def _exited(proc: psutil.Process) -> bool:
    """True once ``proc`` is gone or a zombie; a zombie child of ours is reaped on the way.

    Not ``psutil.wait_procs``: for a process that is not our child it polls
    until the pid disappears, and a zombie whose parent we just killed stays
    until we reap it, so it would wait out the whole timeout.
    """
    try:
        if proc.status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    try:
        os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:
        pass  # someone else's zombie: its parent reaps it, or we do once it is reparented
    return True


def _wait_exited(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for every process to exit; the ones still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [proc for proc in procs if not _exited(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(_POLL_S)
