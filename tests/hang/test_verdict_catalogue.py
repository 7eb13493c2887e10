"""The verdict catalogue (``hang/verdicts.py``) is the one place a verdict's words live.

The README's verdict table (a line a verdict) and the docs' three (live verdicts in docs/watching.md, restarts in
docs/restart-and-drain.md, analyze's exit statuses in docs/analyze.md) are written by hand, so each must list
exactly the catalogue's verdicts, in its order, with its words: a verdict added to the catalogue and not to the
docs fails here.
"""

from __future__ import annotations

import pytest
from conftest import REPO

from ncclwatch.launcher.cli import ANALYZE_HELP, wrap_help
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
    RESTART_WHEN_BLOCKED,
    Verdict,
)

README = REPO / "README.md"
README_TABLE = "| verdict | what it means | given by | restarted | drained | analyze exit |"
LIVE_TABLE = "| verdict | meaning |"
RESTART_TABLE = "| verdict | restarted by default | why |"
EXIT_TABLE = "| verdict | meaning | exit |"
# Where each table lives.
PAGES = {
    README_TABLE: README,
    LIVE_TABLE: REPO / "docs" / "watching.md",
    RESTART_TABLE: REPO / "docs" / "restart-and-drain.md",
    EXIT_TABLE: REPO / "docs" / "analyze.md",
}
DRAIN_PAGE = REPO / "docs" / "restart-and-drain.md"


def described(verdict: Verdict) -> str:
    entry = CATALOGUE[verdict]
    return f"{entry.meaning}. {entry.detail}"


def exit_status(verdict: Verdict) -> int:
    return Report(verdict=verdict, culprit_ranks=[], summary="", analyzed_at="").exit_code


def readme_row(verdict: Verdict) -> str:
    """The README's line for a verdict: its meaning, who gives it, what is done by default, analyze's status."""
    entry = CATALOGUE[verdict]
    given = ", ".join(who for who, gives in (("live", entry.live), ("analyze", entry.offline)) if gives)
    restarted = "yes" if verdict in RESTART_ON_DEFAULT else "when blocked" if verdict in RESTART_WHEN_BLOCKED else "no"
    drained = "yes" if verdict in DRAIN_ON_DEFAULT else "no"
    status = exit_status(verdict) if entry.offline else "-"
    done = (restarted, drained) if entry.hang else ("-", "-")
    return f"| `{verdict}` | {entry.meaning} | {given} | {done[0]} | {done[1]} | {status} |"


def expected_rows() -> dict[str, list[str]]:
    """Each table's rows, rendered from the catalogue."""
    hangs = [v for v, entry in CATALOGUE.items() if entry.hang]
    live_hangs = [v for v in hangs if CATALOGUE[v].live]  # --on-hang restart acts on what the live watchdog gives
    restarted_first = [v for v in live_hangs if v in RESTART_ON_DEFAULT] + [
        v for v in live_hangs if v not in RESTART_ON_DEFAULT
    ]
    blocked = lambda v: f"when blocked (`{v}{BLOCKED}`)"
    yes_no = lambda v: "yes" if v in RESTART_ON_DEFAULT else blocked(v) if CATALOGUE[v].restart_when_blocked else "no"
    why = lambda e: f"{e.restart_why}; {e.restart_when_blocked}" if e.restart_when_blocked else e.restart_why
    return {
        README_TABLE: [readme_row(v) for v in CATALOGUE],
        LIVE_TABLE: [f"| `{v}` | {described(v)} |" for v in live_hangs],
        RESTART_TABLE: [f"| `{v}` | {yes_no(v)} | {why(CATALOGUE[v])} |" for v in restarted_first],
        EXIT_TABLE: [f"| `{v}` | {described(v)} | {exit_status(v)} |" for v in CATALOGUE if CATALOGUE[v].offline],
    }


def table_rows(text: str, header: str) -> list[str]:
    """The rows under ``header`` (the only table with it), up to the first line that is no table row."""
    lines = text.splitlines()
    assert lines.count(header) == 1, f"{lines.count(header)} tables headed {header!r}, expected one"
    start = lines.index(header) + 2  # past the header and its --- line
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def differences(pages: dict[str, str]) -> list[str]:
    """Where the tables say other than the catalogue: rows missing, rows extra, rows in another order."""
    problems = []
    for header, rows in expected_rows().items():
        found = table_rows(pages[header], header)
        lacking = [f"{header} lacks: {row}" for row in rows if row not in found]
        extra = [f"{header} has, not in the catalogue: {row}" for row in found if row not in rows]
        misordered = found != rows and not lacking + extra
        problems += lacking + extra + ([f"{header}: rows in another order than the catalogue's"] if misordered else [])
    return problems


def pages() -> dict[str, str]:
    return {header: path.read_text() for header, path in PAGES.items()}


def test_every_table_lists_the_catalogues_verdicts_in_its_words() -> None:
    assert differences(pages()) == []


def test_the_readme_has_the_verdict_table_once_and_no_other() -> None:
    readme = README.read_text().splitlines()
    assert readme.count(README_TABLE) == 1
    assert not [header for header in (LIVE_TABLE, RESTART_TABLE, EXIT_TABLE) if header in readme]


@pytest.mark.parametrize("header", list(PAGES))
def test_a_verdict_missing_from_a_table_is_caught(header: str) -> None:
    texts = pages()
    dropped = table_rows(texts[header], header)[-1]
    assert f"{header} lacks: {dropped}" in differences({**texts, header: texts[header].replace(dropped + "\n", "")})


def test_the_docs_name_the_drain_defaults() -> None:
    quoted = [f"`{v}`" for v in DRAIN_ON_DEFAULT]
    spoken = f"{', '.join(quoted[:-1])} and {quoted[-1]}" if len(quoted) > 1 else quoted[0]
    assert f"(`--drain-on`, default {spoken};" in " ".join(DRAIN_PAGE.read_text().split())


def test_the_settings_defaults_are_the_catalogues() -> None:
    fields = Settings.model_fields
    assert fields["restart_on"].get_default(call_default_factory=True) == [
        *(v.value for v in RESTART_ON_DEFAULT),
        *(v.value + BLOCKED for v, e in CATALOGUE.items() if e.restart_when_blocked),
    ]
    assert all(CATALOGUE[v].live for v in (*RESTART_ON_DEFAULT, *DRAIN_ON_DEFAULT)), (
        "a live default the live side never gives"
    )
    assert fields["drain_on"].get_default(call_default_factory=True) == [v.value for v in DRAIN_ON_DEFAULT]


def test_each_help_lists_its_verdicts_with_their_meaning() -> None:
    for help_text, verdicts in ((ANALYZE_HELP, [v for v, e in CATALOGUE.items() if e.offline]),
                                (wrap_help(), [v for v, e in CATALOGUE.items() if e.live and e.hang])):  # fmt: skip
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
