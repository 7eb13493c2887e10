"""The command line as a new user meets it (issue 31): a missing torchrun, a missing script, a bare ``ncclwatch``,
a bad analyze option, the demo's help against its parser, a missing bundle folder for ``serve``, and a kill said
once.  Each is one line of ours, never a traceback."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from ncclwatch.launcher import demo_job
from ncclwatch.launcher.cli import SUBCOMMANDS, demo_command, demo_parser, missing_script, ours_after_torchrun
from ncclwatch.launcher.respond import JobResponder
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.responding import Reported, Responding
from ncclwatch.watchdog.response.policy import Plan, Response

NOT_FOUND = "ncclwatch: torchrun not found on PATH (activate the environment that has torch, or give its full path)\n"


def ncclwatch(*args: str, path: str | None = None, **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "ncclwatch", *args], capture_output=True, text=True, env=env, timeout=120, **kw
    )


class TestTorchrunNotFound:
    def test_torchrun_missing_from_path_is_one_line_and_127(self, tmp_path: Path) -> None:
        (tmp_path / "bin").mkdir()
        done = ncclwatch("torchrun", "--standalone", "train.py", path=str(tmp_path / "bin"), cwd=tmp_path)
        assert (done.returncode, done.stderr, done.stdout) == (127, NOT_FOUND, "")

    def test_a_full_path_that_is_not_there_or_not_a_program(self, tmp_path: Path) -> None:
        done = ncclwatch(str(tmp_path / "venv" / "bin" / "torchrun"), "train.py", cwd=tmp_path)
        assert (done.returncode, done.stderr) == (
            127,
            f"ncclwatch: {tmp_path / 'venv' / 'bin' / 'torchrun'} not found\n",
        )
        (tmp_path / "torchrun").write_text("not a program\n")
        done = ncclwatch(str(tmp_path / "torchrun"), "train.py", cwd=tmp_path)
        assert done.returncode == 126 and "cannot be run" in done.stderr and "Traceback" not in done.stderr


class TestMissingScript:
    def test_a_missing_script_is_our_one_line_and_torchrun_never_starts(self, tmp_path: Path) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "torchrun"  # leaves a mark if it is started at all
        fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\nexit 1\n")
        fake.chmod(0o755)
        done = ncclwatch(
            "--bundle-dir",
            str(tmp_path / "b"),
            "torchrun",
            "--standalone",
            "nope.py",
            path=f"{bin_dir}:{os.environ['PATH']}",
            cwd=tmp_path,
        )
        assert (done.returncode, done.stderr) == (2, f"ncclwatch: training script not found: nope.py (in {tmp_path})\n")
        assert not (tmp_path / "started").exists()

    def test_the_script_is_checked_only_where_it_is_a_path(self, tmp_path: Path) -> None:
        os.chdir(tmp_path)
        (tmp_path / "train.py").write_text("")
        assert missing_script(["torchrun", "--nproc_per_node=2", "nope.py", "--lr", "1"]) == "nope.py"
        assert missing_script(["python3", "-m", "torch.distributed.run", "--standalone", "nope.py"]) == "nope.py"
        assert missing_script(["/venv/bin/torchrun", "--nnodes=2", "train.py", "--cfg", "nope.py"]) is None
        assert missing_script(["torchrun", "-m", "pkg.train", "--cfg", "nope.py"]) is None
        assert missing_script(["torchrun", "--no-python", "nope.py"]) is None
        assert missing_script(["torchrun", "--standalone", "run.sh"]) is None


class TestOptionAfterTorchrun:
    def test_an_ncclwatch_option_among_torchruns_is_named_with_where_it_belongs(self, tmp_path: Path) -> None:
        (tmp_path / "train.py").write_text("")
        done = ncclwatch("torchrun", "--nproc_per_node=2", "--on-hang", "kill", "train.py", cwd=tmp_path)
        assert (done.returncode, done.stderr) == (
            2,
            "ncclwatch: --on-hang is an option of ncclwatch, not of torchrun: put it before torchrun "
            "(ncclwatch --on-hang ... torchrun ...)\n",
        )

    def test_only_torchruns_part_is_looked_at(self) -> None:
        ours = {"--on-hang", "--config", "--bundle-dir"}
        assert ours_after_torchrun(["torchrun", "--bundle-dir=/b", "train.py"], ours) == "--bundle-dir"
        assert (
            ours_after_torchrun(["python3", "-m", "torch.distributed.run", "--config", "x", "t.py"], ours) == "--config"
        )
        assert ours_after_torchrun(["torchrun", "--standalone", "train.py", "--config", "c.toml"], ours) is None
        assert ours_after_torchrun(["torchrun", "--nnodes", "2", "train", "--config", "c.toml"], ours) is None
        assert ours_after_torchrun(["torchrun", "--no-python", "run.sh", "--on-hang"], ours) is None


class TestUsage:
    def test_ncclwatch_alone_is_a_short_usage_with_every_command(self) -> None:
        done = ncclwatch()
        assert done.returncode == 2 and done.stdout == ""
        lines = done.stderr.splitlines()
        assert len(lines) <= 15, done.stderr
        assert lines[0].startswith("usage: ncclwatch [OPTIONS] torchrun")
        assert all(any(line.lstrip().startswith(name) for line in lines) for name in SUBCOMMANDS), done.stderr
        assert lines[-1].startswith("ncclwatch --help for the options that matter, --help-all for every one")

    def test_the_usage_line_names_every_subcommand(self) -> None:
        usage = ncclwatch("--help").stdout.split("\n\n", 1)[0]
        assert all(name in usage for name in SUBCOMMANDS), usage

    def test_a_bad_analyze_option_gets_analyzes_own_usage_and_error(self, tmp_path: Path) -> None:
        done = ncclwatch("analyze", str(tmp_path), "--bogus")
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and lines[0].startswith("usage: ncclwatch analyze ")
        assert lines[-1] == "ncclwatch analyze: error: unrecognized arguments: --bogus"


class TestDemoHelp:
    def test_every_option_the_fault_list_names_is_accepted(self) -> None:
        parser = demo_parser()
        accepted = {flag for action in parser._actions for flag in action.option_strings}
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", parser.epilog or ""))
        assert "--pause-s" in named and named - accepted == set()

    def test_pause_s_reaches_the_demo_job(self) -> None:
        command = demo_command(demo_parser().parse_args(["--fault", "pause", "--pause-s", "3"]))
        script = command.index(demo_job.__file__)
        job = demo_job.parse_args(command[script + 1 :])
        assert (job.fault, job.pause_s) == ("pause", 3.0)


class TestServeBundleDir:
    def test_a_missing_bundle_folder_is_created_and_said(self, tmp_path: Path) -> None:
        folder = tmp_path / "var" / "bundles"
        env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
        process = subprocess.Popen(
            [sys.executable, "-m", "ncclwatch", "serve", "--bundle-dir", str(folder), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            first = process.stdout.readline()  # type: ignore[union-attr]
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(15)
        stderr = process.stderr.read()  # type: ignore[union-attr]
        assert "http://" in first and code == 0, stderr
        assert f"ncclwatch serve: created the bundle folder {folder} (it did not exist)" in stderr
        assert folder.is_dir()

    def test_a_bundle_dir_that_is_a_file_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("")
        done = ncclwatch("serve", "--bundle-dir", str(tmp_path / "file"), "--listen", "127.0.0.1:0")
        assert (done.returncode, done.stderr) == (
            2,
            f"ncclwatch serve: --bundle-dir {tmp_path / 'file'} is not a folder\n",
        )


class FakeJob:
    returncode = None

    def __init__(self) -> None:
        self.terminated = False

    def terminate(self, grace_s: float) -> None:
        self.terminated = True


def test_a_kill_is_said_once(tmp_path: Path) -> None:
    out = io.StringIO()
    job = FakeJob()
    responder = JobResponder(Settings(on_hang="kill", bundle_dir=tmp_path), job, 0, out=out)  # type: ignore[arg-type]
    say = lambda text: print(f"ncclwatch: {text}", file=out)  # noqa: E731  (the sidecar's _say)
    responding = Responding(responder, SimpleNamespace(), lambda: 0.0, say, lambda *_: None)  # type: ignore[arg-type]
    report = Report(verdict=Verdict.rank_behind, culprit_ranks=[1], summary="", analyzed_at="")
    reported = Reported(started_at=0.0, decision=None, report=report)  # type: ignore[arg-type]
    asyncio.run(responding.respond(Plan(Response.kill, "--on-hang kill"), reported, [], True))
    assert job.terminated and out.getvalue() == "ncclwatch: ending the job: --on-hang kill\n"
    assert [(a.kind, a.detail) for a in reported.report.actions] == [("kill", "ended the job: --on-hang kill")]
