"""The README and docs/ say what the code does (issue 46): every option they name is accepted by the program it
belongs to, every default they state is the code's, the timing they state is the constants the watchdog runs on,
and the README's options table is the short --help's, word for word.  The README once named
``--upload-spool-days``, which no command accepted, and --help said the quiet look came after 3 s where the code
(``PEEK_WARMUP_S``) said 2."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from conftest import REPO

from ncclwatch.launcher.cli import analyze_parser, demo_parser, wrap_parser
from ncclwatch.launcher.help_text import WRAP_OPTIONS, readme_option_rows
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.live import incident, job, judging
from ncclwatch.watchdog.preflight import build_parser as preflight_parser
from ncclwatch.watchdog.server.agent import build_parser as serve_parser

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w/-])--[a-z][a-z0-9_-]*[a-z0-9]")
# Options of other programs the docs show, by program: none of them may be an ncclwatch option.
OTHER_PROGRAMS = {
    "pip": {"--index-url"},
    "sbatch and srun": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time", "--signal",
                        "--requeue", "--kill-on-bad-exit", "--label"},
    "mpirun": {"--tag-output", "--timestamp-output"},
    "py-spy": {"--nonblocking"},
    "torch's fr_trace": {"--mismatch_cap"},
    "useradd": {"--system", "--no-create-home", "--shell"},
    "systemctl": {"--now"},
    "node_exporter": {"--collector"},
    "a training script's own (the redaction's examples, the command's placeholder)": {"--my-args", "--password",
                                                                                       "--token", "--api-key",
                                                                                       "--resume-from-latest"},
}  # fmt: skip


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def ncclwatch_parsers() -> list[argparse.ArgumentParser]:
    return [wrap_parser(), wrap_parser(full=True), analyze_parser(full=True), demo_parser(full=True),
            serve_parser(full=True), preflight_parser()]  # fmt: skip


def named_options() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for option in OPTION.findall(page.read_text()):
            found.setdefault(option, []).append(page.name)
    return found


def spoken(page: Path) -> str:
    return " ".join(page.read_text().split())


def test_every_option_the_docs_name_is_accepted_by_its_program() -> None:
    ours = set().union(*map(flags, ncclwatch_parsers()))
    known = ours | flags(torchrun.get_args_parser()) | set().union(*OTHER_PROGRAMS.values())
    unknown = {option: pages for option, pages in named_options().items() if option not in known}
    assert unknown == {}, "options the docs name that no command accepts"
    assert set().union(*OTHER_PROGRAMS.values()) & ours == set(), "an ncclwatch option listed as another program's"


def test_the_check_catches_an_option_no_command_accepts() -> None:
    ours = set().union(*map(flags, ncclwatch_parsers()))
    assert "--upload-spool-days" in ours and "--upload-spool-day" not in ours
    assert "--upload-spool-day" in OPTION.findall("gives an upload up after `--upload-spool-day` (7)")


def code_default(option: str) -> float | None:
    """The default a command gives ``option``: its Settings field's, else its parser's."""
    field = Settings.model_fields.get(option[2:].replace("-", "_"))
    if field is not None and isinstance(field.default, int | float) and not isinstance(field.default, bool):
        return float(field.default)
    for parser in ncclwatch_parsers():
        for action in parser._actions:
            if option in action.option_strings and isinstance(action.default, int | float):
                return float(action.default)
    return None


NUMBER = r"(\d+(?:\.\d+)?)"
# How the docs state an option's default: "`--x` (7)", "`--x` (default 1800 s)", "(`--x`, 60;", "`--x`, 60 s)",
# "`--x` seconds (default 60;", "`--x` operations per communicator (default 2048)", a table's "| `--x N` | 30 |",
# the README's "| `--x N` | ... (default 1800) |", and "at least 5 s (`--x`)".
DEFAULT_FORMS = (
    re.compile(rf"`(--[a-z-]+)[^`]*` \((?:default:? )?{NUMBER}"),
    re.compile(rf"`(--[a-z-]+)[^`]*`, {NUMBER}(?: s)?[;)]"),
    re.compile(rf"`(--[a-z-]+)[^`]*`[a-z ]{{0,40}}[(,] ?default:? {NUMBER}"),
    re.compile(rf"\| `(--[a-z-]+)[^`]*` \| {NUMBER} \|"),
    re.compile(rf"\| `(--[a-z-]+)[^`|]*` \| [^|]*\(default {NUMBER}\) \|"),
)
DEFAULT_BEFORE = re.compile(rf"{NUMBER} s[a-z -]{{0,45}}\(`(--[a-z-]+)`\)")


def stated_defaults() -> list[tuple[str, str, float]]:
    """(page, option, the default the page states) for every default a page states in one of the forms."""
    stated = []
    for page in PAGES:
        text = spoken(page)
        for form in DEFAULT_FORMS:
            stated += [(page.name, option, float(value)) for option, value in form.findall(text)]
        stated += [(page.name, option, float(value)) for value, option in DEFAULT_BEFORE.findall(text)]
    return stated


def test_every_default_the_docs_state_is_the_codes() -> None:
    stated = stated_defaults()
    assert {option for _, option, _ in stated} >= {"--upload-spool-days", "--progress-timeout", "--perf-interval",
                                                   "--stall-timeout-floor", "--window", "--hook-timeout"}  # fmt: skip
    wrong = [(page, option, said, code_default(option)) for page, option, said in stated
             if code_default(option) is not None and said != code_default(option)]  # fmt: skip
    assert wrong == []


def test_a_wrong_default_would_be_caught() -> None:
    page = "gives an upload up after `--upload-spool-days` (8). Retention: `--retention-days` (90) go"
    found = [(o, float(v)) for form in DEFAULT_FORMS for o, v in form.findall(page)]
    assert ("--upload-spool-days", 8.0) in found and code_default("--upload-spool-days") == 7.0


# The timing the docs state, each with the constant the live watchdog runs on.
TIMING = {
    "docs/watching.md": [
        f"once gone {judging.DEAD_SETTLED_S:g} s",
        f"stopped for {judging.STOPPED_SETTLED_S:g} s",
        f"after {judging.STREAMED_QUIET_S:g} s of silence",
        f"after {job.PEEK_WARMUP_S:g} s of silence before the job has a rhythm",
        f"after {job.PEEK_MULTIPLIER:g} x its longest gap once it has one (at least {job.PEEK_MIN_S:g} s)",
        f"then every {incident.PEEK_EVERY_S:g} s",
        f"held for {judging.GPU_HANG_SETTLED_S:g} s of silence",
        f"or for {judging.GPU_SPIN_SETTLED_S:g} s where NVML",
        f"{job.STALL_MULTIPLIER:g} x the longest gap",
        f"in the last {job.GAP_MEMORY_S / 60:g} minutes",
        f"until the job has shown {job.MIN_PROGRESS} steps",
    ],
}


@pytest.mark.parametrize("page", TIMING)
def test_the_timing_the_docs_state_is_the_watchdogs(page: str) -> None:
    text = spoken(REPO / page)
    assert [phrase for phrase in TIMING[page] if phrase not in text] == []


def test_the_readmes_options_are_the_short_helps_in_its_words() -> None:
    readme = REPO.joinpath("README.md").read_text().splitlines()
    rows = readme_option_rows()
    start = readme.index(rows[0])
    assert readme[start : start + len(rows) + 1][:-1] == rows and not readme[start + len(rows)].startswith("|")
    short = " ".join(wrap_parser().format_help().split())
    assert all(flag in short for flag, _, _ in WRAP_OPTIONS)
