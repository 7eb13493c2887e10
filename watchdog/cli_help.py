"""Help that fits a screen: ``--help`` shows a command's options that matter, ``--help-all`` every one.

Each command builds its parser with ``full`` False or True; without ``full``, the options not named in its
``shown`` set keep working but are left out of the help (argparse's ``SUPPRESS``), and ``--help-all`` prints the
parser built with ``full``.  Used by ``ncclwatch`` and its subcommands (``launcher/cli.py``) and by
``ncclwatch serve`` (``server/agent.py``).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Collection
from typing import Any

HELP_COLUMNS = 78  # the descriptions' width
OPTION_COLUMNS = 100  # the options' lines: an option and its summary on one line where they fit, as the verdict screen


def formatter(prog: str) -> argparse.HelpFormatter:
    """Descriptions as written, options one to a line where they fit."""
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32, width=OPTION_COLUMNS)


def paragraph(text: str, indent: str = "") -> str:
    """Filled to the help's width; an option's name (``--restart-on``) is never split at its hyphens."""
    return textwrap.fill(
        text,
        HELP_COLUMNS,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def shown_help(flag: str, text: str, shown: Collection[str] | None) -> str:
    """``text``, or argparse's SUPPRESS where ``shown`` (the short help's options) does not name ``flag``."""
    return text if shown is None or flag in shown else argparse.SUPPRESS


class HelpAll(argparse.Action):
    """``--help-all``: print the help of the parser built with every option, and exit 0 (as ``--help`` does)."""

    def __init__(self, option_strings: list[str], dest: str, full: Callable[[], argparse.ArgumentParser], **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)
        self.full = full

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        self.full().print_help()
        parser.exit()


def add_help_all(parser: argparse.ArgumentParser, full: Callable[[], argparse.ArgumentParser] | None) -> None:
    """``--help-all`` on a short parser (``full``: how to build the full one); on the full one, nothing."""
    if full is not None:
        parser.add_argument("--help-all", action=HelpAll, full=full, help="every option, and the details")
