"""``launcher.process`` with real torchrun jobs.

``JobProcess`` makes its process a child subreaper, so it never runs inside
pytest: a small driver (``DRIVER``, the wrapper's lifecycle in 20 lines) runs
it in a child process, and the tests look at that process tree with psutil.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, wait_for

from ncclwatch.launcher.process import exit_status

DRIVER = """
import asyncio, json, os, signal, sys
from ncclwatch.launcher.process import JobProcess, exit_status

async def main(argv, out, grace_s):
    job = JobProcess()
    job.start(argv, dict(os.environ))
    loop = asyncio.get_running_loop()
    job.forward_signals(loop)
    loop.add_signal_handler(signal.SIGUSR1, job.terminate, grace_s)  # the tests' "--on-hang kill"

    async def report_children():
        while True:
            if children := job.children():
                with open(out + ".tmp", "w") as f:
                    json.dump({"torchrun": job.pid, "workers": children}, f)
                os.replace(out + ".tmp", out)
            await asyncio.sleep(0.1)

    reporting = asyncio.create_task(report_children())
    returncode = await job.wait()
    reporting.cancel()
    reaped = job.reap_orphans(grace_s)
    print(json.dumps({"returncode": returncode, "reaped": reaped, "subreaper": job.subreaper}), flush=True)
    return exit_status(returncode)

opts = json.loads(sys.argv[1])
if opts.get("no_pidfd"):
    del os.pidfd_open  # an older kernel: wait() polls
sys.exit(asyncio.run(main(opts["argv"], opts["out"], opts.get("grace_s", 1.0))))
"""

# A worker that says it is up (its pid, in <out dir>/up_<rank>), then
# misbehaves as MODE says.
WORKER = """
import os, signal, sys, time
rank, mode, out = os.environ["RANK"], os.environ["MODE"], os.environ["OUT"]
if mode == "daemon" and rank == "0":
    # Double fork + setsid: a daemon outside every group torchrun knows of.
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(f"{out}/daemon", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
            os._exit(0)
        os._exit(0)
    os.waitpid(first, 0)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(f"{out}/up_{rank}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"{out}/up_{rank}.tmp", f"{out}/up_{rank}")
if mode == "fail" and rank == "1":
    sys.exit(3)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Job:
    """A driver running a 2-worker torchrun job; kills the whole tree if a test fails."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.dir = tmp_path
        (tmp_path / "worker.py").write_text(WORKER)
        (tmp_path / "driver.py").write_text(DRIVER)
        self.argv = [
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "--monitor-interval=0.1",
            str(tmp_path / "worker.py"),
        ]
        self.env = {**os.environ, "MODE": mode, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
        self.proc: subprocess.Popen[str] | None = None
        self.seen: set[int] = set()

    def bare(self) -> int:
        return subprocess.run(self.argv, env=self.env, capture_output=True, timeout=60, check=False).returncode

    def start(self, **opts) -> None:
        arg = json.dumps({"argv": self.argv, "out": str(self.dir / "children.json"), **opts})
        self.proc = subprocess.Popen(
            [sys.executable, str(self.dir / "driver.py"), arg],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def tree(self) -> dict:
        """Wait for both workers to be up; the driver's view of the tree."""
        wait_for(lambda: all((self.dir / f"up_{r}").exists() for r in (0, 1)), 40, "workers up")
        up = {int((self.dir / f"up_{r}").read_text()) for r in (0, 1)}

        def report() -> dict | None:
            # The driver rewrites it every 0.1 s: on a loaded machine the one there may predate a worker.
            path = self.dir / "children.json"
            tree = json.loads(path.read_text()) if path.exists() else None
            return tree if tree is not None and up <= set(tree["workers"]) else None

        wait_for(lambda: report() is not None, 10, "the driver's report of both workers")
        tree = report()
        self.seen |= {tree["torchrun"], *tree["workers"]}
        return tree

    def finish(self) -> tuple[int, dict]:
        out, err = self.proc.communicate(timeout=40)
        assert out, err[-3000:]
        return self.proc.returncode, json.loads(out.splitlines()[-1])

    def cleanup(self) -> None:
        pids = set(self.seen)
        for name in ("up_0", "up_1", "daemon"):
            if (self.dir / name).exists():
                pids.add(int((self.dir / name).read_text()))
        if self.proc is not None and self.proc.poll() is None:
            pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
            self.proc.kill()
            self.proc.wait()
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


@pytest.fixture
def job_factory(tmp_path: Path):
    jobs: list[Job] = []

    def make(mode: str) -> Job:
        jobs.append(Job(tmp_path, mode))
        return jobs[-1]

    yield make
    for job in jobs:
        job.cleanup()


@pytest.mark.parametrize("returncode, status", [(0, 0), (1, 1), (3, 3), (-15, 143), (-9, 137), (-2, 130)])
def test_exit_status_is_what_a_shell_reports(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status


@pytest.mark.parametrize("no_pidfd", [False, True], ids=["pidfd", "polling"])
@pytest.mark.parametrize("command, status", [("exit 7", 7), ("kill -TERM $$", 143), ("kill -KILL $$", 137)])
def test_wrapper_exits_as_the_shell_reports_its_child(
    tmp_path: Path, command: str, status: int, no_pidfd: bool
) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    opts = {"argv": ["sh", "-c", command], "out": str(tmp_path / "children.json"), "no_pidfd": no_pidfd}
    bare = subprocess.run(["sh", "-c", f"sh -c '{command}'; exit $?"], timeout=10, check=False)
    wrapped = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), json.dumps(opts)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert wrapped.returncode == bare.returncode == status


def test_worker_failure_exits_as_bare_torchrun(job_factory) -> None:
    job = job_factory("fail")
    bare = job.bare()
    job.start()
    status, result = job.finish()
    assert status == bare == 1  # torchrun reports a failed worker as 1, whatever its own code
    assert result["returncode"] == 1 and result["reaped"] == [] and result["subreaper"]


def test_sigterm_is_forwarded_and_no_worker_survives(job_factory) -> None:
    job = job_factory("sleep")
    job.start()
    tree = job.tree()
    assert len(tree["workers"]) == 2
    job.proc.send_signal(signal.SIGTERM)
    status, result = job.finish()
    # torchrun turns SIGTERM into an exception and exits 1 after stopping its workers.
    assert status == result["returncode"] == 1
    assert result["reaped"] == []
    assert all(gone(pid) for pid in [tree["torchrun"], *tree["workers"]])


def test_orphans_of_a_killed_torchrun_are_reaped(job_factory) -> None:
    job = job_factory("daemon")
    job.start()
    tree = job.tree()
    wait_for((job.dir / "daemon").exists, 5, "the daemon")
    daemon = int((job.dir / "daemon").read_text())
    os.kill(tree["torchrun"], signal.SIGKILL)  # torchrun dies without stopping its workers
    status, result = job.finish()
    assert status == 137 and result["returncode"] == -9
    # The workers and the double-forked daemon (which ignores SIGTERM, so it
    # took the SIGKILL after the grace) were found through the subreaper.
    assert result["reaped"] == sorted([*tree["workers"], daemon])
    assert all(gone(pid) for pid in result["reaped"])


def test_terminate_kills_a_job_that_ignores_sigterm(job_factory) -> None:
    job = job_factory("stubborn")
    job.start(grace_s=1.0)
    tree = job.tree()
    started = time.monotonic()
    job.proc.send_signal(signal.SIGUSR1)  # the driver calls job.terminate(1.0)
    status, result = job.finish()
    # torchrun would wait its own 30 s shutdown timeout for the workers; the
    # grace cuts it short and SIGKILLs torchrun and the workers.
    assert time.monotonic() - started < 10
    assert status == 137 and result["returncode"] == -9
    # The workers died with torchrun; reap_orphans only reaps their zombies
    # (a worker still dying as it looks may count as signalled).
    assert set(result["reaped"]) <= set(tree["workers"])
    assert all(gone(pid) for pid in [tree["torchrun"], *tree["workers"]])


READ_STDIN = """
import os, time
line = input()
print(f"rank {os.environ['RANK']} read {line!r}", flush=True)
time.sleep(60)
"""


def on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[bytes, int]:
    """Run ``argv`` on a new pseudo-terminal; type a line once the worker is up, then Ctrl-C.

    Returns what the terminal showed and the exit status.
    """
    pid, fd = pty.fork()
    if pid == 0:
        os.execvpe(argv[0], argv, env)
    shown, typed, interrupted, deadline = b"", False, False, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # EIO: the terminal's last process exited
                    break
                shown += data
            if not typed and (Path(env["OUT"]) / "up_0").exists():
                os.write(fd, b"hello\n")
                typed = True
            if not interrupted and b"read 'hello'" in shown:
                os.write(fd, b"\x03")  # the terminal sends SIGINT to its foreground group
                interrupted = True
    finally:
        process = psutil.Process(pid)
        try:
            process.wait(timeout=10)
        except psutil.TimeoutExpired:
            for child in [*process.children(recursive=True), process]:
                child.kill()
        os.close(fd)
    return shown, process.wait()


def test_on_a_terminal_workers_read_stdin_and_ctrl_c_ends_the_job_as_bare(tmp_path: Path) -> None:
    # torchrun's own group is not the terminal's foreground group under the
    # wrapper; reading stdin still works (the workers' sessions have no
    # controlling terminal) and Ctrl-C reaches torchrun through forwarding.
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nopen(os.environ['OUT'] + '/up_0', 'w').close()\n" + READ_STDIN)
    (tmp_path / "driver.py").write_text(DRIVER)
    argv = ["torchrun", "--standalone", "--nproc-per-node=1", "--monitor-interval=0.1", str(worker)]
    wrapped = [sys.executable, str(tmp_path / "driver.py"), json.dumps({"argv": argv, "out": str(tmp_path / "c.json")})]
    for name, command in (("bare", argv), ("wrapped", wrapped)):
        out = tmp_path / name
        out.mkdir()
        shown, status = on_a_terminal(command, {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)})
        seen = shown.decode(errors="replace")[-2000:]
        assert b"rank 0 read 'hello'" in shown, f"{name}: {seen}"
        assert status == 1, f"{name} exited {status}: {seen}"  # torchrun turns SIGINT into an exception: 1
