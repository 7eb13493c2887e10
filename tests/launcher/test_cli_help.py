"""Help that fits a screen (issue 46): each command's ``--help`` is its usage, the options that matter, an example and
where the rest is; ``--help-all`` shows every option, and every option works either way."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from ncclwatch.launcher.cli import analyze_parser, demo_parser, wrap_parser
from ncclwatch.watchdog.server.agent import BUNDLE_DIR_DEFAULT
from ncclwatch.watchdog.server.agent import build_parser as serve_parser

SCREEN = 40  # lines
COMMANDS = {"": wrap_parser, "analyze": analyze_parser, "demo": demo_parser, "serve": serve_parser}


def helped(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")} | {"COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "ncclwatch", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", [*COMMANDS, "preflight"])
def test_each_help_fits_a_screen_and_says_where_the_rest_is(command: str) -> None:
    text = helped(*filter(None, [command]), "--help")
    assert len(text.splitlines()) <= SCREEN, text
    if command != "preflight":  # preflight's help is whole at 36 lines
        assert "--help-all" in text and ("docs/" in text or command == "demo"), text


@pytest.mark.parametrize("command", COMMANDS)
def test_help_all_shows_every_option_the_command_accepts(command: str) -> None:
    text = helped(*filter(None, [command]), "--help-all")
    hidden = {flag for flag in flags(COMMANDS[command](full=True)) if flag not in text}
    assert hidden == set()


@pytest.mark.parametrize("command", COMMANDS)
def test_the_short_parser_accepts_every_option_of_the_full_one(command: str) -> None:
    assert flags(COMMANDS[command]()) == flags(COMMANDS[command](full=True)) | {"--help-all"}


def test_the_wrappers_help_says_the_peek_delay_the_watchdog_runs_on() -> None:
    from ncclwatch.watchdog.live.job import PEEK_WARMUP_S

    said = " ".join(helped("--help-all").split())
    assert f"looks quietly at the ranks after {PEEK_WARMUP_S:g} s" in said


def test_serve_says_where_its_bundle_dir_defaults_to() -> None:
    from ncclwatch.watchdog.config import Settings

    assert str(Settings.model_fields["bundle_dir"].default) == BUNDLE_DIR_DEFAULT
    for text in (helped("serve", "--help"), helped("serve", "--help-all")):
        assert f"(default ./{BUNDLE_DIR_DEFAULT})" in text


def test_network_error_is_in_no_live_default_since_the_live_watchdog_never_gives_it() -> None:
    text = " ".join(helped("--help-all").split())
    defaults = text.split("--restart-on verdicts (default: ", 1)[1].split(")", 1)[0]
    drain = text.split("(--drain-on, default: ", 1)[1].split(")", 1)[0]
    assert "network_error" not in defaults and "network_error" not in drain
    assert "given by ncclwatch analyze alone" in text and "network_error" in text
