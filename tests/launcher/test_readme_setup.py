"""The README's set-up (issue 31): its first command installs torch's CPU build before the package (the public
index alone pulls several GB of CUDA packages) and runs the demo; the exit status it announces before the
command is the one the demo gives; it says where ``ncclwatch`` is; the test command comes second."""

from __future__ import annotations

import re

from conftest import REPO

from ncclwatch.watchdog.hang.report import EXIT_KILLED_ON_HANG

SETUP = REPO.joinpath("README.md").read_text().split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```bash\n(.*?)```", SETUP, re.S)


def test_the_first_command_takes_torchs_cpu_build_before_the_package_then_runs_the_demo() -> None:
    first = BLOCKS[0].strip()
    steps = first.split(" && ")
    torch = next(i for i, step in enumerate(steps) if "torch==2.13.0" in step)
    package = next(i for i, step in enumerate(steps) if "-e '.[test]'" in step)
    assert "--index-url https://download.pytorch.org/whl/cpu" in steps[torch] and torch < package
    assert 'torch==2.13.0"' in REPO.joinpath("pyproject.toml").read_text()  # the pin the command installs
    assert steps[0] == "python3 -m venv .venv" and steps[-1] == ".venv/bin/ncclwatch demo"
    assert BLOCKS[1].strip() == "bash .ci/run"


def test_the_demos_exit_status_and_where_ncclwatch_is_are_said_before_they_matter() -> None:
    before, after = SETUP.split("```bash", 1)
    words = " ".join(before.split())
    assert f"exits with status {EXIT_KILLED_ON_HANG}**" in words and "not a failed set-up" in words
    assert "COLLECTIVE MISMATCH — culprit rank 2" in words
    assert "source .venv/bin/activate" in after.split("bash .ci/run")[0]
