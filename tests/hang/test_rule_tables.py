"""Every rule of every stage has its tests: in the stage's test module, a class named after the rule
(``p2p_recv_cycle`` -> ``TestP2pRecvCycle``) with a case where it fires and one whose name says it stays quiet
(``quiet`` in the test's name).  A rule that always answers (its function returns ``Finding``, not
``Finding | None``: a stage's fallback) has nothing to stay quiet about.  A new rule without its tests fails here."""

from __future__ import annotations

import importlib
import inspect
import typing
from types import ModuleType

import pytest

from ncclwatch.watchdog.hang.comm_rules import COMM_RULES
from ncclwatch.watchdog.hang.failure import FAILURE_RULES
from ncclwatch.watchdog.hang.job_rules import JOB_RULES, UNSEQUENCED_RULES
from ncclwatch.watchdog.hang.live_rules import LIVE_RULES
from ncclwatch.watchdog.hang.partial import PARTIAL_RULES
from ncclwatch.watchdog.hang.rules import Rule
from ncclwatch.watchdog.hang.types import Finding

# stage table -> the module that tests it
STAGES: dict[str, tuple[tuple[Rule, ...], str]] = {
    "COMM_RULES": (COMM_RULES, "test_comm_rules"),
    "JOB_RULES": (JOB_RULES, "test_job_rules"),
    "UNSEQUENCED_RULES": (UNSEQUENCED_RULES, "test_job_rules"),
    "PARTIAL_RULES": (PARTIAL_RULES, "test_partial_rules"),
    "FAILURE_RULES": (FAILURE_RULES, "test_failure_rules"),
    "LIVE_RULES": (LIVE_RULES, "test_live_rules"),
}
ROWS = [(stage, rule) for stage, (table, _) in STAGES.items() for rule in table]


def class_name(rule: str) -> str:
    return "Test" + "".join(part.capitalize() for part in rule.split("_"))


def always_answers(rule: Rule) -> bool:
    return typing.get_type_hints(rule.fn).get("return") is Finding


def cases_of(module: ModuleType, rule: Rule) -> list[str]:
    cls = getattr(module, class_name(rule.name), None)
    return [name for name, _ in inspect.getmembers(cls, inspect.isfunction) if name.startswith("test")] if cls else []


@pytest.mark.parametrize(("stage", "rule"), ROWS, ids=[f"{stage}.{rule.name}" for stage, rule in ROWS])
def test_every_rule_has_a_case_that_fires_and_one_that_stays_quiet(stage: str, rule: Rule) -> None:
    module = importlib.import_module(STAGES[stage][1])
    tests = cases_of(module, rule)
    where = f"{module.__name__}.{class_name(rule.name)}"
    assert [t for t in tests if "quiet" not in t], f"{stage} {rule.name}: no case where it fires in {where}"
    if not always_answers(rule):
        assert [t for t in tests if "quiet" in t], f"{stage} {rule.name}: no case where it stays quiet in {where}"


def test_a_rule_name_is_one_rule_within_its_stage() -> None:
    for stage, (table, _) in STAGES.items():
        names = [rule.name for rule in table]
        assert len(names) == len(set(names)), stage


def test_a_rule_without_its_class_is_found() -> None:
    """The walk fails for a rule whose tests do not exist (here, a name no test module has)."""
    module = importlib.import_module("test_comm_rules")
    assert cases_of(module, Rule("never_written", lambda comm: None)) == []
