"""What ``ncclwatch torchrun`` injects: the environment rules, the worker's
``sitecustomize`` (heartbeat hook, Flight Recorder responder, chaining) and
``ncclwatch.beat``.  Everything past the pure rules runs in real child
processes: the code under test runs at interpreter start-up."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, wait_for
from support import free_port

from ncclwatch.launcher.env import RunDirs, inject_dir, injected_env
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.probes.flight_recorder import QUIET_REQUEST

HB_KEYS = {"pid", "rank", "local_rank", "restart", "step", "time", "beats"}


@pytest.fixture
def dirs(tmp_path: Path) -> RunDirs:
    return RunDirs.create(tmp_path / "run")


def run_python(code: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with exactly ``env`` (plus PATH/HOME); ``cwd`` comes first on its sys.path."""
    full = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        cwd=cwd,
        timeout=60,
        capture_output=True,
        text=True,
        check=False,
    )


def worker_env(dirs: RunDirs, **extra: str) -> dict[str, str]:
    """What a torchrun worker of ``ncclwatch torchrun`` sees, for rank 1."""
    env = injected_env({"PYTHONPATH": str(REPO)}, dirs)
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", TORCHELASTIC_RESTART_COUNT="2")
    env.update(extra)
    return env


def heartbeats(dirs: RunDirs) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(dirs.hb.glob("*.json"))]


# --- environment rules (pure) ------------------------------------------------


class TestInjectedEnv:
    def test_empty_user_env_gets_everything(self, dirs: RunDirs) -> None:
        env = injected_env({}, dirs)
        assert env == {
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,COLL,DESTROY,ENV",
            "NCCL_DEBUG_FILE": f"{dirs.nccl}/%h.%p",
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_FR_DUMP_TEMP_FILE": f"{dirs.fr}/nccl_trace_rank_",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{dirs.fr}/pipe_",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_ENABLE_TIMING": "1",
            "NCCLWATCH_RUN_DIR": str(dirs.root),
            "PYTHONPATH": str(inject_dir()),
        }

    @pytest.mark.parametrize(
        "name, value",
        [
            ("NCCL_DEBUG", "WARN"),
            ("NCCL_DEBUG_FILE", "/elsewhere/nccl.%h.%p"),
            ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "/elsewhere/pipe_"),
            ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"),
            ("TORCH_NCCL_ENABLE_TIMING", "0"),
        ],
    )
    def test_never_overrides_a_user_setting(self, dirs: RunDirs, name: str, value: str) -> None:
        assert injected_env({name: value}, dirs)[name] == value

    def test_user_variables_pass_through(self, dirs: RunDirs) -> None:
        env = injected_env({"HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "0,1"}, dirs)
        assert env["HOME"] == "/home/u" and env["CUDA_VISIBLE_DEVICES"] == "0,1"

    @pytest.mark.parametrize(
        "user, expected",
        [
            ("INIT", "INIT,COLL,DESTROY,ENV"),
            ("NET,GRAPH", "NET,GRAPH,INIT,COLL,DESTROY,ENV"),
            ("coll,init", "coll,init,DESTROY,ENV"),  # NCCL compares names case-insensitively
            ("INIT,COLL,DESTROY,env", "INIT,COLL,DESTROY,env"),
            (" INIT , NET ", "INIT,NET,COLL,DESTROY,ENV"),
            ("", "INIT,COLL,DESTROY,ENV"),  # set but empty prints nothing at all
            ("ALL", "ALL"),
            ("all", "all"),
            ("NET,ALL", "NET,ALL"),
            ("^NET", "^NET"),  # inverted: adding names would turn them off
            ("^INIT,COLL", "^INIT,COLL"),
        ],
    )
    def test_subsys_is_extended_not_replaced(self, dirs: RunDirs, user: str, expected: str) -> None:
        assert injected_env({"NCCL_DEBUG_SUBSYS": user}, dirs)["NCCL_DEBUG_SUBSYS"] == expected

    @pytest.mark.parametrize("name", ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"])
    def test_either_buffer_size_name_blocks_both(self, dirs: RunDirs, name: str) -> None:
        env = injected_env({name: "50"}, dirs)
        assert env[name] == "50"
        other = ({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} - {name}).pop()
        assert other not in env

    @pytest.mark.parametrize("name", ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
    def test_either_dump_file_name_blocks_both(self, dirs: RunDirs, name: str) -> None:
        env = injected_env({name: "/mine/trace_"}, dirs)
        assert env[name] == "/mine/trace_"
        other = ({"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} - {name}).pop()
        assert other not in env

    def test_pythonpath_is_prepended(self, dirs: RunDirs) -> None:
        env = injected_env({"PYTHONPATH": "/a:/b"}, dirs)
        assert env["PYTHONPATH"] == f"{inject_dir()}:/a:/b"

    def test_run_dir_is_ours(self, dirs: RunDirs) -> None:
        assert injected_env({"NCCLWATCH_RUN_DIR": "/stale"}, dirs)["NCCLWATCH_RUN_DIR"] == str(dirs.root)

    def test_user_env_is_not_modified(self, dirs: RunDirs) -> None:
        user = {"PYTHONPATH": "/a"}
        injected_env(user, dirs)
        assert user == {"PYTHONPATH": "/a"}


def test_run_dirs_are_private(tmp_path: Path) -> None:
    dirs = RunDirs.create(tmp_path / "deep" / "run")
    for path in (dirs.root, dirs.nccl, dirs.fr, dirs.hb):
        assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    assert RunDirs.create(dirs.root) == dirs  # an existing run folder is fine


def test_inject_dir_holds_sitecustomize_and_is_no_package() -> None:
    assert (inject_dir() / "sitecustomize.py").is_file()
    assert not (inject_dir() / "__init__.py").exists()


# --- sitecustomize in a worker -------------------------------------------------


def test_optimizer_steps_beat_without_code_change(dirs: RunDirs) -> None:
    done = run_python(
        """
        import torch
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        opt.step()
        opt.step()
        import sys
        print("loader", type(sys.modules["torch.optim.optimizer"].__loader__).__name__)
        print("shared", "ncclwatch.launcher.heartbeat" in sys.modules)
    """,
        worker_env(dirs),
    )
    assert done.returncode == 0, done.stderr
    # The import hook hands the real loader back: nothing later sees ours.
    assert "loader SourceFileLoader" in done.stdout
    # One heartbeat module for the hook and ncclwatch.beat, so one step count.
    assert "shared True" in done.stdout
    [beat] = heartbeats(dirs)
    assert set(beat) == HB_KEYS
    assert (beat["rank"], beat["local_rank"], beat["restart"]) == (1, 1, 2)
    # Two steps within 0.1 s: the second is skipped by the rate limit, then
    # written at exit, so the file ends on the last step.
    assert (beat["step"], beat["beats"]) == (2, 2)
    assert abs(beat["time"] - time.time()) < 30


def test_a_user_package_named_launcher_is_not_imported(dirs: RunDirs, tmp_path: Path) -> None:
    user = tmp_path / "user"
    (user / "launcher").mkdir(parents=True)
    (user / "launcher" / "__init__.py").write_text("print('user launcher imported')\n")
    done = run_python(
        """
        import sys, torch
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).step()
        print(sorted(name for name in sys.modules if "heartbeat" in name or "launcher" in name))
    """,
        worker_env(dirs, PYTHONPATH=f"{inject_dir()}:{user}"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    # Ours is imported under its own namespace; theirs stays untouched.
    assert done.stdout == "['ncclwatch.launcher', 'ncclwatch.launcher.heartbeat']\n"
    assert [b["step"] for b in heartbeats(dirs)] == [1]


def test_job_without_torch_does_not_import_it(dirs: RunDirs) -> None:
    done = run_python(
        """
        import json, sys
        print("torch" in sys.modules, [type(f).__name__ for f in sys.meta_path][0])
    """,
        worker_env(dirs),
    )
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.split() == ["False", "_AfterImport"]
    assert heartbeats(dirs) == []


def test_torchrun_itself_only_waits_for_the_rendezvous_and_plain_python_is_left_alone(dirs: RunDirs) -> None:
    code = """
        import os, sys
        hooks = [f._name for f in sys.meta_path if type(f).__name__ == "_AfterImport"]
        print(",".join(hooks) or "-", "NCCLWATCH_WORKER_PID" in os.environ)
    """
    torchrun = worker_env(dirs)
    del torchrun["RANK"]
    assert run_python(code, torchrun).stdout.split() == [
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "False",
    ]
    plain = {k: v for k, v in torchrun.items() if k != "NCCLWATCH_RUN_DIR"}
    assert run_python(code, plain).stdout.split() == ["-", "False"]
    assert list(dirs.fr.iterdir()) == []


ROUND_JOB = """
import datetime, os, sys
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # a stale peer address fails, not waits
store = dist.distributed_c10d._get_default_store()
under_every_prefix = store._underlying_non_prefix_store  # where ProcessGroupNCCL raises its dump signal
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if dist.get_rank() == 0:
        store.set("left-by-the-first-round", "stale")
        under_every_prefix.set("exception_dump", "1")  # a watchdog saw its peer die
    dist.barrier()
    sys.exit(1)  # the round fails: torchrun starts the next one
seen = store.check(["left-by-the-first-round"])
signal = under_every_prefix.check(["exception_dump"])
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as out:
    out.write(f"{seen} {os.environ.get('NCCLWATCH_RDZV_ROUND')} {signal}")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("injected", [True, False], ids=["ncclwatch", "plain-torchrun"])
def test_a_restarted_round_does_not_see_the_dead_round_s_store_keys(
    dirs: RunDirs, tmp_path: Path, injected: bool
) -> None:
    """torchrun's c10d rendezvous keeps one store for the workers of every round, with no per-round prefix: plain
    torchrun's second round reads the first round's keys (how a restarted NCCL rank gets the dead round's unique
    id); under ncclwatch each round has its own."""
    job = tmp_path / "job.py"
    job.write_text(ROUND_JOB)
    out = tmp_path / "out"
    out.mkdir()
    env = injected_env({"PYTHONPATH": str(REPO)}, dirs) if injected else {"PYTHONPATH": str(REPO)}
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **env}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    torchrun = subprocess.Popen(
        [*argv, "--monitor-interval=0.2", str(job), str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stderr = torchrun.communicate(timeout=90)[1]
    except subprocess.TimeoutExpired:
        os.killpg(torchrun.pid, signal.SIGKILL)
        stderr = torchrun.communicate()[1] + "\n(the second round hung)"
    seen = {path.name: path.read_text().split() for path in out.iterdir()}
    if not injected:
        # The second round reads the stale key, or never gets that far: gloo dials the addresses the first round's
        # ranks left in the store ("connectFullMesh failed ... Connection refused"), or hangs on one that another
        # process took since.
        assert ["True", "None", "True"] in seen.values() or "Connection refused" in stderr or "hung" in stderr
        return
    assert torchrun.returncode == 0, stderr[-3000:]
    assert sorted(seen) == ["rank0", "rank1"]
    assert {stale for stale, _, _ in seen.values()} == {"False"}
    assert {signal for _, _, signal in seen.values()} == {"False"}
    assert len({round_ for _, round_, _ in seen.values()} - {"None"}) == 1


OWN_STORE_JOB = """
import datetime, os, sys, time
import torch.distributed as dist

# The job's own client of torchrun's store (no env://), under a prefix of its own per restart.
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                    timeout=datetime.timedelta(seconds=60))
round_ = os.environ["NCCLWATCH_RDZV_ROUND"]
dist.init_process_group("gloo", store=dist.PrefixStore(f"job-{round_}", raw), rank=rank, world_size=world)
if round_ == "0":
    dist.barrier()
    if rank == 1:
        sys.exit(1)  # this node's round fails: its torchrun restarts, the other node's follows
    time.sleep(1)
    raw.set("exception_dump", "1")  # what ProcessGroupNCCL's watchdog does once it sees its peer gone
    time.sleep(120)  # outlives its peer until its own torchrun stops it
with open(os.path.join(sys.argv[1], f"rank{rank}"), "w") as out:
    out.write(f"{round_} {raw.check(['exception_dump'])} {os.environ['TORCHELASTIC_RESTART_COUNT']}")
dist.destroy_process_group()
"""


def test_a_dead_round_s_dump_signal_is_gone_before_the_next_round_starts_on_every_node(tmp_path: Path) -> None:
    """Two torchruns (c10d rendezvous, one rank each): the surviving rank of the failed round raises the dump
    signal after its peer is gone, as NCCL's watchdog does; every rank of the next round must start without it,
    whatever store the job built (on two H200 wrappers it made the new round abort)."""
    job = tmp_path / "job.py"
    job.write_text(OWN_STORE_JOB)
    out = tmp_path / "out"
    out.mkdir()
    nodes, port = [], free_port()
    for node in range(2):
        dirs = RunDirs.create(tmp_path / f"node{node}")
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
        env.update(injected_env({"PYTHONPATH": str(REPO)}, dirs))
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=signal"]
        argv += [f"--node-rank={node}", "--max-restarts=1", "--monitor-interval=0.2", str(job), str(out)]
        nodes.append(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True))
    errors = [node.communicate(timeout=150)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-3000:] for e in errors)
    seen = {path.name: path.read_text() for path in out.iterdir()}
    # Node 0's torchrun restarted its healthy worker because node 1 came back to the rendezvous: torchrun counts
    # no restart there (its count stays 0), the rendezvous round is 1 on both (the sidecar goes by the round).
    assert seen == {"rank0": "1 False 0", "rank1": "1 False 1"}


def test_a_worker_s_child_process_is_left_alone(dirs: RunDirs) -> None:
    # A spawned DataLoader or compile worker inherits RANK; its responder
    # would overwrite the rank's dump.  The worker marks itself by pid.
    done = run_python(
        """
        import os, subprocess, sys
        print("worker", os.environ["NCCLWATCH_WORKER_PID"] == str(os.getpid()), flush=True)
        code = "import sys; print('child', [type(f).__name__ for f in sys.meta_path].count('_AfterImport'))"
        subprocess.run([sys.executable, "-c", code], check=True)
    """,
        worker_env(dirs),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["worker", "True", "child", "0"]
    assert len(list(dirs.fr.glob("ncclwatch_pipe.*"))) == 0  # removed at exit, the child made none


def test_fifo_has_no_reader_once_the_worker_is_dead(dirs: RunDirs) -> None:
    # ENXIO on a non-blocking open is how the sidecar tells a dead rank from
    # a slow one, so a forked child (DataLoader with fork) must not keep the
    # worker's read end open.
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import os, sys, time
        pid = os.getpid()
        if os.fork() == 0:
            print(pid, flush=True)  # after the fork handlers ran in this child
            time.sleep(30)
            os._exit(0)
        time.sleep(30)
    """),
        ],
        env={**os.environ, **worker_env(dirs)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pid = int(worker.stdout.readline())
        fifo = dirs.fr / f"ncclwatch_pipe.{pid}"
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # alive: it has a reader
        worker.kill()  # no atexit: the FIFO stays, as after a crash
        worker.wait()
        with pytest.raises(OSError) as err:
            os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        assert err.value.errno == errno.ENXIO
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the forked child too


def test_users_sitecustomize_still_runs(dirs: RunDirs, tmp_path: Path) -> None:
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nMARK = 'user'\nprint('user sitecustomize ran')\n")
    env = worker_env(dirs, PYTHONPATH=f"{inject_dir()}:{user_site}:{REPO}")
    done = run_python(
        """
        import sitecustomize, sys
        print(sitecustomize.MARK, [type(f).__name__ for f in sys.meta_path][0])
    """,
        env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["user sitecustomize ran", "user _AfterImport"]


def test_a_broken_user_sitecustomize_fails_as_without_us(dirs: RunDirs, tmp_path: Path) -> None:
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("raise RuntimeError('user bug')\n")
    code = "print('job ran')"
    bare = run_python(code, {"PYTHONPATH": str(user_site)})
    ours = run_python(code, worker_env(dirs, PYTHONPATH=f"{inject_dir()}:{user_site}"))
    assert ours.stdout == bare.stdout == "job ran\n"
    assert ours.stderr == bare.stderr and "Error in sitecustomize" in bare.stderr


def test_unusable_run_dir_does_not_break_the_worker(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = worker_env(RunDirs(not_a_dir, not_a_dir / "nccl", not_a_dir / "fr", not_a_dir / "hb"))
    done = run_python(
        """
        import ncclwatch
        for step in range(3):
            ncclwatch.beat(step)
        print("job ran")
    """,
        env,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "job ran\n", "")


# --- ncclwatch.beat ------------------------------------------------------------


def test_beat_rate_limit_and_format(dirs: RunDirs) -> None:
    done = run_python(
        """
        import json, os, sys, time
        import ncclwatch
        path = os.path.join(os.environ["NCCLWATCH_RUN_DIR"], "hb", f"{os.getpid()}.json")
        def read():
            with open(path) as f:
                text = f.read()
            assert text.endswith("}\\n") and text.count("\\n") == 1, text
            return json.loads(text)
        before = time.time()
        ncclwatch.beat()                      # the first beat is written at once
        while not os.path.exists(path):
            time.sleep(0.001)
        first = read()
        writes, inode, start = 1, os.stat(path).st_ino, time.monotonic()
        while time.monotonic() - start < 0.5:  # beat flat out: at most one write per 0.1 s
            ncclwatch.beat()
            if (now := os.stat(path).st_ino) != inode:
                writes, inode = writes + 1, now
        last_beat = time.time()
        ncclwatch.beat(10**6)
        time.sleep(0.25)                      # the last beat is not lost to the rate limit
        last = read()
        child = os.fork()
        if child == 0:                        # a forked child neither writes nor hangs at exit
            ncclwatch.beat()
            sys.exit(0)
        os.waitpid(child, 0)
        json.dump({"first": first, "last": last, "writes": writes, "before": before,
                   "last_beat": last_beat, "pid": os.getpid(), "child": child}, sys.stdout)
    """,
        worker_env(dirs),
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    first, last = seen["first"], seen["last"]
    assert set(first) == HB_KEYS
    assert first == dict(first, pid=seen["pid"], rank=1, local_rank=1, restart=2, step=1, beats=1)
    # The file's time is the beat's monotonic moment turned into wall time as it is written: the two clocks' reads
    # are a few microseconds apart (a fresh clone's CI run saw it 0.4 us before ``before``).
    slack = 0.001
    assert seen["before"] - slack <= first["time"] < seen["before"] + 0.05
    assert 2 <= seen["writes"] <= 7
    assert last["step"] == 10**6 and last["beats"] > 1000
    # ``time`` is when the beat happened, not when the flusher wrote it.
    assert seen["last_beat"] - slack <= last["time"] < seen["last_beat"] + 0.05
    assert [p.name for p in dirs.hb.iterdir()] == [f"{seen['pid']}.json"]  # no temporary file, no child's


def test_beat_is_a_no_op_outside_a_worker() -> None:
    done = run_python(
        """
        import threading, ncclwatch
        ncclwatch.beat(); ncclwatch.beat(5)
        print(threading.active_count())
    """,
        {"PYTHONPATH": str(REPO)},
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "1\n", "")  # no flusher thread either


# --- Flight Recorder responder in a real torchrun job --------------------------

FR_JOB = """
import os, sys, time
import torch, torch.distributed as dist
run, rank = os.environ["NCCLWATCH_RUN_DIR"], int(os.environ["RANK"])
dist.init_process_group("gloo")
p = torch.nn.Parameter(torch.ones(2))
torch.optim.SGD([p], lr=0.1).step()
dist.all_reduce(torch.ones(4))
with open(f"{run}/ready_{rank}", "w") as f:
    f.write(str(os.getpid()))
if rank == 1:  # rank 0 waits inside the next all_reduce until the test says go
    deadline = time.monotonic() + 40
    while not os.path.exists(f"{run}/go") and time.monotonic() < deadline:
        time.sleep(0.05)
dist.all_reduce(torch.ones(8))
dist.destroy_process_group()
# The atexit hooks (the responder's among them), not the interpreter's teardown, where torch 2.13's gloo aborted
# rank 0 of this job in 2 of 12 runs ("terminate called without an active exception").
from ncclwatch.launcher.demo_job import leave
leave(0)
"""


def kill_tree(job: subprocess.Popen) -> None:
    """Cleanup after a failed test: workers live in their own sessions, so walk the tree."""
    if job.poll() is None:
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            proc.kill()
        job.wait()


def test_fr_responder_dumps_a_rank_blocked_in_gloo(dirs: RunDirs, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(FR_JOB)
    env = injected_env({**os.environ, "PYTHONPATH": str(REPO)}, dirs)
    argv = ["torchrun", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script)]
    job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: all((dirs.root / f"ready_{r}").exists() for r in (0, 1)), 40, "workers ready")
        pid0 = int((dirs.root / "ready_0").read_text())
        pipes = sorted(p.name for p in dirs.fr.glob("ncclwatch_pipe.*"))
        assert len(pipes) == 2 and f"ncclwatch_pipe.{pid0}" in pipes  # none for torchrun itself
        dump = dirs.fr / "ncclwatch_trace_0"

        def dump_once_inside_the_all_reduce() -> bool:
            # Rank 0 wrote "ready" just before its second all_reduce: on a loaded machine a dump
            # taken at once may predate it, so ask again until the dump shows it enqueued.
            def written() -> tuple[int, int] | None:
                return (dump.stat().st_ino, dump.stat().st_mtime_ns) if dump.exists() else None

            before = written()
            fd = os.open(dirs.fr / f"ncclwatch_pipe.{pid0}", os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x")
            os.close(fd)
            wait_for(lambda: written() not in (None, before), 10, "the dump")
            time.sleep(0.05)  # written by os.replace: whole once it exists
            [fr] = parse_flight_recorder(dump.read_bytes(), dump.name)
            return fr.process_groups["0"].last_enqueued == 2

        wait_for(dump_once_inside_the_all_reduce, 20, "a dump inside rank 0's second all_reduce")
        assert not (dirs.fr / "ncclwatch_trace_1").exists()
        [fr] = parse_flight_recorder(dump.read_bytes(), dump.name)
        assert fr.rank == 0
        assert [(e.op, e.collective_seq_id, e.input_sizes) for e in fr.entries] == [
            ("AllReduce", 1, [[4]]),
            ("AllReduce", 2, [[8]]),
        ]
        # gloo leaves every entry "scheduled"; the group status says where it is.
        default_pg = fr.process_groups["0"]
        assert (default_pg.last_enqueued, default_pg.last_completed) == (2, 1)
        assert all(e["frames"] for e in pickle.loads(dump.read_bytes())["entries"])  # asked with "x": everything
        # The performance look's quiet request ("-"): the same entries, no stack traces.
        before = dump.stat().st_mtime_ns, dump.stat().st_ino
        fd = os.open(dirs.fr / f"ncclwatch_pipe.{pid0}", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, QUIET_REQUEST)
        os.close(fd)
        wait_for(lambda: (dump.stat().st_mtime_ns, dump.stat().st_ino) != before, 10, "the quiet dump")
        time.sleep(0.05)
        quiet = pickle.loads(dump.read_bytes())["entries"]
        assert [e["collective_seq_id"] for e in quiet] == [1, 2] and not any(e.get("frames") for e in quiet)
        (dirs.root / "go").touch()
        output, _ = job.communicate(timeout=40)
    finally:
        kill_tree(job)
    assert job.returncode == 0, output.decode(errors="replace")[-3000:]
    assert sorted(b["rank"] for b in heartbeats(dirs)) == [0, 1]
    assert list(dirs.fr.glob("ncclwatch_pipe.*")) == []  # removed at exit
    assert pickle.loads(dump.read_bytes())["version"]


def test_wrapper_is_named_allowed_tracer_when_given(dirs: RunDirs) -> None:
    assert injected_env({}, dirs, wrapper_pid=4321)["NCCLWATCH_WRAPPER_PID"] == "4321"
    assert "NCCLWATCH_WRAPPER_PID" not in injected_env({}, dirs)
