"""The first run (issue 13): help that shows defaults and the demo's faults, an error that names every
subcommand, and a demo that leaves no temp folder behind and prints no NumPy warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ncclwatch.launcher.cli import SUBCOMMANDS, main


def ncclwatch(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ncclwatch", *args], capture_output=True, text=True, check=False, **kw)


def test_help_shows_the_defaults(capsys):
    try:
        main(["--help-all"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: ncclwatch-bundles)", "(default: 1800)", "(default: 30)", "(default: 120)"):
        assert default in text


def test_demo_help_lists_every_fault_with_what_it_does():
    done = ncclwatch("demo", "--help")
    for line in ("python_stuck  sleeps in Python forever", "sigstop       stops itself", "skip          skips"):
        assert line in done.stdout


def test_not_torchrun_names_every_subcommand():
    done = ncclwatch("foo")
    assert done.returncode == 2
    assert all(name in done.stderr for name in SUBCOMMANDS) and "serve" in done.stderr


def test_demo_removes_its_run_folder_and_prints_no_numpy_warning(tmp_path: Path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = ncclwatch("demo", "--bundle-dir", str(tmp_path / "bundles"), env=env, cwd=tmp_path, timeout=240)
    assert done.returncode == 3, done.stderr[-3000:]
    assert list((tmp_path / "bundles").glob("*.tar.gz"))
    assert not list(tmp_path.glob("ncclwatch-*")), "run folder left in TMPDIR"
    assert "Failed to initialize NumPy" not in done.stderr + done.stdout
