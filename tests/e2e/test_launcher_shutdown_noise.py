"""``launcher.shutdown_noise``: torchrun's answer to ``--on-hang kill`` is hidden, nothing else.

The fixtures are torchrun's real stderr (torch 2.13, 2 gloo ranks of
``launcher/demo_job.py``, run bare): ``torchrun-sigterm-2.13.txt`` with the
``skip`` fault, SIGTERMed by hand after the fault line; ``torchrun-child-failed-2.13.txt``
with the ``exit`` fault (a real crash: worker tracebacks, torchrun's own
``Sending process ... closing signal`` line and ``ChildFailedError``).
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import FIXTURES
from support import demo, run_watched

from ncclwatch.launcher.shutdown_noise import MAX_HELD_LINES, ShutdownNoiseFilter, StderrRelay
from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

SIGTERMED = (FIXTURES / "torchrun-sigterm-2.13.txt").read_bytes()
CRASHED = (FIXTURES / "torchrun-child-failed-2.13.txt").read_bytes()
# The job's output before the kill, and torchrun's whole answer to the SIGTERM.
BEFORE, ANSWER = SIGTERMED.split(b"fault 'skip' at step 10\n")
BEFORE += b"fault 'skip' at step 10\n"
NOTICE = (
    b"ncclwatch: torchrun's shutdown traceback and 3 shutdown log lines hidden "
    b"(its answer to being stopped by ncclwatch after a hang)\n"
)


def filtered(*parts: bytes, chunk: int = 1 << 16, armed_at: int = 1) -> bytes:
    """``parts`` fed in ``chunk``-sized pieces, the filter armed after part ``armed_at`` (never: -1)."""
    noise = ShutdownNoiseFilter()
    out = []
    for index, part in enumerate(parts):
        if index == armed_at:
            noise.arm_after(0)
        out += [noise.feed(part[at : at + chunk]) for at in range(0, len(part), chunk)]
    return b"".join(out) + noise.finish()


def test_the_fixture_is_torchruns_answer_to_sigterm() -> None:
    assert ANSWER.startswith(b"W") and b"Received 15 death signal, shutting down workers\n" in ANSWER
    assert ANSWER.count(b"closing signal SIGTERM\n") == 2
    assert ANSWER.endswith(b"SignalException: Process 28991 got signal: 15\n")


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 16])
def test_torchruns_answer_is_hidden_and_everything_before_passes_byte_for_byte(chunk: int) -> None:
    assert filtered(BEFORE, ANSWER, chunk=chunk) == BEFORE + NOTICE


@pytest.mark.parametrize("chunk", [1, 13, 1 << 16])
def test_a_real_crash_passes_whole_even_after_the_kill(chunk: int) -> None:
    assert filtered(CRASHED, chunk=chunk, armed_at=0) == CRASHED
    assert filtered(BEFORE, ANSWER, CRASHED, chunk=chunk) == BEFORE + NOTICE + CRASHED
    assert filtered(BEFORE, CRASHED, ANSWER, chunk=chunk) == BEFORE + CRASHED + NOTICE


def test_without_the_kill_nothing_is_filtered() -> None:
    assert filtered(BEFORE, ANSWER, CRASHED, armed_at=-1) == BEFORE + ANSWER + CRASHED


def test_output_written_before_the_decision_passes() -> None:
    noise = ShutdownNoiseFilter()
    noise.arm_after(len(ANSWER) + 10)  # already in the pipe when the wrapper decided
    assert noise.feed(ANSWER) + noise.feed(b"012345678\n" + ANSWER) + noise.finish() == ANSWER + b"012345678\n" + NOTICE


def test_a_line_begun_before_the_decision_passes_whole() -> None:
    received = b"W1123 api.py:753] Received 15 death signal, shutting down workers\n"
    noise = ShutdownNoiseFilter()
    shown = noise.feed(received[:20])
    noise.arm_after(0)
    assert shown + noise.feed(received[20:] + received) + noise.finish() == received + NOTICE.replace(
        b"shutdown traceback and 3 shutdown log lines", b"1 shutdown log line"
    )


def test_tracebacks_that_are_not_torchruns_answer_pass_in_order() -> None:
    traceback = ANSWER[ANSWER.index(b"Traceback") :]
    other_signal = traceback.replace(b"got signal: 15", b"got signal: 2")  # not the signal the wrapper sent
    too_long = traceback.replace(b"    main()\n", b"    main()\n" * MAX_HELD_LINES)
    for text in (other_signal, too_long):
        assert filtered(b"", text) == text
    # Chained: the first traceback is a real error; only the last, torchrun's SignalException, is hidden.
    real_error = traceback[: traceback.rindex(b"torch.distributed")] + b"RuntimeError: boom\n"
    during = b"\nDuring handling of the above exception, another exception occurred:\n\n"
    only_traceback = NOTICE.replace(b" and 3 shutdown log lines", b"")
    assert filtered(b"", real_error + during + traceback) == real_error + during + only_traceback


def test_a_cut_off_traceback_is_let_out_at_the_end() -> None:
    head = ANSWER[: ANSWER.index(b"    run(args)")] + b"  File"
    assert filtered(b"", head).endswith(head[head.index(b"Traceback") :])


def test_the_relay_hides_only_what_is_written_after_hide_shutdown_noise() -> None:
    read_end, write_end = os.pipe()
    relay = StderrRelay(out_fd=write_end)
    assert not relay.is_terminal
    os.write(relay.child_fd, ANSWER)  # in the pipe, read or not, when the wrapper decides: passes
    relay.hide_shutdown_noise()
    os.write(relay.child_fd, ANSWER + CRASHED[:50])
    relay.close_child_end()
    relay.close()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as shown:
        assert shown.read() == ANSWER + NOTICE + CRASHED[:50]


# A stand-in for torchrun: says what its stderr is (again when the size
# changes), and answers SIGTERM as torchrun does: a log line and a SignalException.
FAKE_TORCHRUN = r"""
import os, signal, sys, time
class SignalException(Exception):
    pass
def answer(signum, frame):
    print("W1123 api.py:753] Received 15 death signal, shutting down workers", file=sys.stderr, flush=True)
    raise SignalException(f"Process {os.getpid()} got signal: {signum}")
signal.signal(signal.SIGTERM, answer)
size = None
while True:
    if os.get_terminal_size(2) != size:
        size = os.get_terminal_size(2)
        print(f"terminal {size.columns}x{size.lines}", file=sys.stderr, flush=True)
    time.sleep(0.05)
"""

# The wrapper's part, with SIGUSR1 standing for the verdict of --on-hang kill.
DRIVER = r"""
import asyncio, os, signal, sys
from ncclwatch.launcher.process import JobProcess, exit_status
async def main():
    job = JobProcess()
    job.start([sys.executable, "-c", sys.argv[1]], dict(os.environ), hide_shutdown_noise=True)
    loop = asyncio.get_running_loop()
    job.forward_signals(loop)
    loop.add_signal_handler(signal.SIGUSR1, job.terminate, 5.0)
    returncode = await job.wait()
    job.reap_orphans()
    job.close_stderr()
    print("driver: done", file=sys.stderr, flush=True)
    return exit_status(returncode)
sys.exit(asyncio.run(main()))
"""


def test_on_a_terminal_the_job_keeps_a_terminal_of_its_size_and_the_notice_is_dim() -> None:
    pid, fd = pty.fork()
    if pid == 0:
        try:
            termios.tcsetwinsize(0, (24, 100))
            os.execv(sys.executable, [sys.executable, "-c", DRIVER, FAKE_TORCHRUN])
        finally:
            os._exit(127)
    shown, resized, stopped, deadline = b"", False, False, time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    shown += os.read(fd, 4096)
                except OSError:  # EIO: the terminal's last process exited
                    break
            if not resized and b"terminal 100x24" in shown:
                termios.tcsetwinsize(fd, (30, 120))  # the terminal sends SIGWINCH to the driver
                resized = True
            if not stopped and b"terminal 120x30" in shown:
                os.kill(pid, signal.SIGUSR1)
                stopped = True
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert b"terminal 100x24" in shown and b"terminal 120x30" in shown, shown
    assert b"Traceback" not in shown and b"death signal" not in shown, shown
    notice = b"\x1b[2mncclwatch: torchrun's shutdown traceback and 1 shutdown log line hidden"
    assert shown.index(notice) < shown.index(b"driver: done"), shown
    assert os.waitstatus_to_exitcode(status) == 1  # Python's status for an uncaught exception, as torchrun's


def run_two_ranks(tmp_path: Path, fault: str) -> subprocess.CompletedProcess[str]:
    """The real wrapper with ``--on-hang kill`` on 2 gloo ranks of the demo job."""
    return run_watched(tmp_path, demo(fault), "--on-hang", "kill", nproc=2)


def test_after_the_kill_the_verdict_is_the_last_word(tmp_path: Path) -> None:
    done = run_two_ranks(tmp_path, "skip")
    assert done.returncode == EXIT_KILLED_ON_HANG, done.stderr[-3000:]
    stderr = done.stderr
    assert "OMP_NUM_THREADS" in stderr and "[demo] rank 1: fault 'skip' at step 10" in stderr  # before the kill
    assert "COLLECTIVE MISMATCH — culprit rank 1" in stderr
    for noise in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert noise not in stderr, stderr[-3000:]
    ending = stderr.index("ncclwatch: ending the job: --on-hang kill")
    notice = stderr.index("ncclwatch: torchrun's shutdown traceback and ")
    assert ending < notice < stderr.index("ncclwatch: collective_mismatch (culprit rank 1)")


def test_a_crash_under_on_hang_kill_still_shows_torchruns_error(tmp_path: Path) -> None:
    done = run_two_ranks(tmp_path, "exit")
    assert done.returncode == 1, done.stderr[-3000:]  # torchrun's own, as before
    for shown in ("Traceback (most recent call last):", "ChildFailedError", "exitcode  : 3"):
        assert shown in done.stderr, done.stderr[-3000:]
    assert "hidden" not in done.stderr
