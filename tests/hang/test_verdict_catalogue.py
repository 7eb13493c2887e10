"""The verdict catalogue (``hang/verdicts.py``) is the one place a verdict's words live.

The README's three verdict tables are written by hand, so each must list exactly the catalogue's verdicts,
in its order, with its words: a verdict added to the catalogue and not to the README fails here.
"""

from __future__ import annotations

import pytest
from conftest import REPO

from ncclwatch.launcher.cli import ANALYZE_HELP, WRAP_HELP
from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.verdicts import (
    BLOCKED,
    CATALOGUE,
    CONCLUSIVE,
    DRAIN_ON_DEFAULT,
    HANG_VERDICTS,
    PRIORITY,
    RESTART_ON_DEFAULT,
    Verdict,
)

README = REPO / "README.md"

LIVE_TABLE = "| verdict | meaning |"
RESTART_TABLE = "| verdict | restarted by default | why |"
EXIT_TABLE = "| verdict | meaning | exit |"


def described(verdict: Verdict) -> str:
    entry = CATALOGUE[verdict]
    return f"{entry.meaning}. {entry.detail}"


def exit_status(verdict: Verdict) -> int:
    return Report(verdict=verdict, culprit_ranks=[], summary="", analyzed_at="").exit_code


def expected_rows() -> dict[str, list[str]]:
    """Each README table's rows, rendered from the catalogue."""
    hangs = [v for v, entry in CATALOGUE.items() if entry.hang]
    restarted_first = [v for v in hangs if CATALOGUE[v].restart] + [v for v in hangs if not CATALOGUE[v].restart]
    blocked = lambda v: f"when blocked (`{v}{BLOCKED}`)"
    yes_no = lambda v: "yes" if CATALOGUE[v].restart else blocked(v) if CATALOGUE[v].restart_when_blocked else "no"
    why = lambda e: f"{e.restart_why}; {e.restart_when_blocked}" if e.restart_when_blocked else e.restart_why
    return {
        LIVE_TABLE: [f"| `{v}` | {described(v)} |" for v in hangs if CATALOGUE[v].live],
        RESTART_TABLE: [f"| `{v}` | {yes_no(v)} | {why(CATALOGUE[v])} |" for v in restarted_first],
        EXIT_TABLE: [f"| `{v}` | {described(v)} | {exit_status(v)} |" for v in CATALOGUE if CATALOGUE[v].offline],
    }


def table_rows(readme: str, header: str) -> list[str]:
    """The rows under ``header`` (the only table with it), up to the first line that is no table row."""
    lines = readme.splitlines()
    assert lines.count(header) == 1, f"README.md: {lines.count(header)} tables headed {header!r}, expected one"
    start = lines.index(header) + 2  # past the header and its --- line
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def differences(readme: str) -> list[str]:
    """Where the README's tables say other than the catalogue: rows missing from the README, rows it has extra."""
    problems = []
    for header, rows in expected_rows().items():
        found = table_rows(readme, header)
        lacking = [f"{header} lacks: {row}" for row in rows if row not in found]
        extra = [f"{header} has, not in the catalogue: {row}" for row in found if row not in rows]
        misordered = found != rows and not lacking + extra
        problems += lacking + extra + ([f"{header}: rows in another order than the catalogue's"] if misordered else [])
    return problems


def test_every_readme_table_lists_the_catalogues_verdicts_in_its_words() -> None:
    assert differences(README.read_text()) == []


@pytest.mark.parametrize("header", [LIVE_TABLE, RESTART_TABLE, EXIT_TABLE])
def test_a_verdict_missing_from_a_readme_table_is_caught(header: str) -> None:
    readme = README.read_text()
    dropped = table_rows(readme, header)[-1]
    assert f"{header} lacks: {dropped}" in differences(readme.replace(dropped + "\n", ""))


def test_the_readme_names_the_drain_defaults() -> None:
    quoted = [f"`{v}`" for v in DRAIN_ON_DEFAULT]
    spoken = f"{', '.join(quoted[:-1])} and {quoted[-1]}" if len(quoted) > 1 else quoted[0]
    assert f"(`--drain-on`, default {spoken};" in " ".join(README.read_text().split())


def test_the_settings_defaults_are_the_catalogues() -> None:
    fields = Settings.model_fields
    assert fields["restart_on"].get_default(call_default_factory=True) == [
        *(v.value for v in RESTART_ON_DEFAULT),
        *(v.value + BLOCKED for v, e in CATALOGUE.items() if e.restart_when_blocked),
    ]
    assert fields["drain_on"].get_default(call_default_factory=True) == [v.value for v in DRAIN_ON_DEFAULT]


def test_each_help_lists_its_verdicts_with_their_meaning() -> None:
    for help_text, verdicts in ((ANALYZE_HELP, [v for v, e in CATALOGUE.items() if e.offline]),
                                (WRAP_HELP, [v for v, e in CATALOGUE.items() if e.live and e.hang])):  # fmt: skip
        lines = [" ".join(line.split()) for line in help_text.splitlines()]
        assert [v.value for v in verdicts if f"{v.value} {CATALOGUE[v].meaning}" not in lines] == []
    assert all(v.value in ANALYZE_HELP for v in Verdict), "analyze's help names even the verdicts it cannot give"


def test_priorities_rank_every_hang_above_no_hang_above_inconclusive() -> None:
    assert min(PRIORITY[v] for v in HANG_VERDICTS) > PRIORITY[Verdict.no_hang] > PRIORITY[Verdict.inconclusive]


def test_proof_is_what_does_not_go_away_with_a_pause() -> None:
    """Conclusive verdicts page as soon as they are seen and settled (the live incident machine: a dead or stopped
    rank, or a GPU stuck in another kernel, for long enough); the others are a moment a healthy job passes through
    (a rank still compiling, stacks caught a few ms apart) and wait."""
    assert CONCLUSIVE == {
        Verdict.collective_mismatch,
        Verdict.process_dead,
        Verdict.process_stopped,
        Verdict.gpu_compute_hang,
        Verdict.network_error,
        Verdict.node_lost,
        Verdict.collective_timeout,  # given only once the job died of it (hang.failure)
    }
    assert CONCLUSIVE <= HANG_VERDICTS
