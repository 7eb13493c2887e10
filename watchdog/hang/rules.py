"""The shape every hang rule has, and the runners of the stages that order them.

A stage is an ordered tuple of ``Rule(name, fn)``: the order is data, read in
one screen where the stage is defined, and a rule is found there by its name.
Each stage has one shape of rule and one way of running its table:

- ``first_fired``: the first rule that returns a finding gives it (the
  per-communicator sequence rules: a mismatch hides whatever follows it;
  the job without sequences; the failure stage);
- ``fired`` then ``most_severe``: every rule is asked and the most severe
  decided finding wins, the first of equals by the table's order (partial
  evidence, where sources that each saw a part may all speak);
- ``refined``: each rule sees the finding so far and may replace it; a rule
  marked ``last`` that fires ends the stage (the job-wide upgrades, and the
  refinements from what a running job shows).

A rule returns ``None`` where it does not apply: staying quiet is as much its
contract as firing, and each stage's test module has both cases for every row
of its table (``tests/hang/test_rule_tables.py`` walks the tables).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import PRIORITY, Verdict

Fn = TypeVar("Fn", bound=Callable[..., Any])
Subject = TypeVar("Subject")


@dataclass(frozen=True)
class Rule(Generic[Fn]):
    """One row of a stage's table: the rule's name (what tests and DESIGN.md call it) and its function."""

    name: str
    fn: Fn
    last: bool = False  # ``refined``: when it fires, no later rule of the stage runs


def first_fired(rules: Iterable[Rule[Callable[..., Finding | None]]], *given: Any) -> Finding | None:
    """The finding of the first rule that fires on ``given`` (a subject, and for some stages the finding so far);
    None when none does."""
    for rule in rules:
        if (found := rule.fn(*given)) is not None:
            return found
    return None


def fired(rules: Iterable[Rule[Callable[[Subject], Finding | None]]], subject: Subject) -> list[Finding]:
    """Every rule's finding on ``subject``, in the table's order."""
    return [found for rule in rules if (found := rule.fn(subject)) is not None]


def most_severe(findings: Iterable[Finding]) -> Finding | None:
    """The most severe finding that decides something (``verdicts.PRIORITY``), the first of equals; None when every
    one is ``inconclusive``."""
    decided = [f for f in findings if f.verdict != Verdict.inconclusive]
    return max(decided, key=lambda f: PRIORITY[f.verdict]) if decided else None


def refined(
    rules: Iterable[Rule[Callable[[Subject, Finding], Finding | None]]], subject: Subject, finding: Finding
) -> Finding:
    """``finding`` after each rule in turn: one that fires replaces it, and one marked ``last`` ends the stage."""
    for rule in rules:
        if (changed := rule.fn(subject, finding)) is not None:
            finding = changed
            if rule.last:
                break
    return finding
