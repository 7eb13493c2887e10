"""The hosts view reads per-host rows kept current when parts are recorded or removed (``host_summary``).

Its answer is the aggregation over every incident that names the host (what the view computed per request
before), at any time: after uploads, replaced parts, retention, and as incidents leave the 7- and 30-day
windows.  And its work per request does not grow with the incidents: the SQLite instructions a read runs
are counted (deterministic, no clock), for the same hosts with ten times the incidents.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from cluster_bundles import node_report

from ncclwatch.watchdog.server.incidents import DAY_S, ROLES, IncidentIndex, Part
from ncclwatch.watchdog.server.view import report_view

NOW = 1_800_000_000.0
VERDICTS = ("collective_mismatch", "rank_behind", "node_lost")


def reference(index: IncidentIndex, now: float) -> list[dict[str, Any]]:
    """The hosts view computed from scratch over ``host_incidents`` (one row per host and incident)."""
    week, month = now - 7 * DAY_S, now - 30 * DAY_S
    found: dict[str, dict[str, Any]] = {}
    rows = index._db.execute(
        "SELECT host, verdict, at, job, culprit, lost_node, slow_link FROM host_incidents WHERE at >= ?", (month,)
    )
    jobs: dict[str, tuple[set[str], set[str]]] = {}
    for host, verdict, at, job, *by_role in rows:
        entry = found.setdefault(
            host, {"host": host, "days_7": 0, "days_30": 0, "by_verdict_7": {}, "by_verdict_30": {}, "roles": {}}
        )
        entry["days_30"] += 1
        entry["by_verdict_30"][verdict] = entry["by_verdict_30"].get(verdict, 0) + 1
        entry["last_at"] = max(entry.get("last_at", at), at)
        for role, flag in zip(ROLES, by_role):
            entry["roles"][role] = entry["roles"].get(role, 0) + flag
        entry["roles"] = {r: n for r, n in entry["roles"].items() if n}
        seven, thirty = jobs.setdefault(host, (set(), set()))
        thirty.add(job)
        if at >= week:
            entry["days_7"] += 1
            entry["by_verdict_7"][verdict] = entry["by_verdict_7"].get(verdict, 0) + 1
            seven.add(job)
    for host, (seven, thirty) in jobs.items():
        found[host]["jobs_7"], found[host]["jobs_30"] = len(seven), len(thirty)
    return sorted(found.values(), key=lambda e: (-e["days_7"], -e["days_30"], -e["last_at"], e["host"]))


def shown(index: IncidentIndex, now: float) -> list[dict[str, Any]]:
    keep = ("host", "days_7", "days_30", "by_verdict_7", "by_verdict_30", "roles", "jobs_7", "jobs_30", "last_at")
    return [{k: e[k] for k in keep} for e in index.hosts(now=now, limit=10_000)]


def fill(index: IncidentIndex, incidents: int, hosts: int, seed: int = 3, start: int = 0) -> list[str]:
    """``incidents`` over the last 40 days, two nodes' parts each, culprits among ``hosts``; the bundle ids."""
    rng = random.Random(seed)
    names = [f"h{n:03d}" for n in range(hosts)]
    bundles = []
    for n in range(start, start + incidents):
        at = NOW - rng.uniform(0, 40) * DAY_S
        culprit, verdict, job = rng.choice(names), rng.choice(VERDICTS), f"job{rng.randrange(max(1, incidents // 3))}"
        for node in (culprit, rng.choice(names)):
            report = node_report(job, node, culprit, at, verdict=verdict).model_dump(mode="json")
            if rng.random() < 0.2:
                report["performance"] = [{"kind": "slow_link", "hosts": [culprit, rng.choice(names)]}]
            bundle = f"{job}-{node}-{n}"
            index.record(Part(bundle, f"incident-{n}", report_view(report), 1000, "0" * 64))
            bundles.append(bundle)
    return bundles


def test_the_view_is_the_aggregation_after_uploads_retention_and_as_windows_slide(tmp_path: Path) -> None:
    now = [NOW]
    index = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: now[0])
    bundles = fill(index, 300, 40)
    assert shown(index, NOW) == reference(index, NOW) != []
    rng = random.Random(5)
    for bundle in rng.sample(bundles, 150):  # retention, some incidents losing one of their two parts
        index.remove_part(bundle)
    assert shown(index, NOW) == reference(index, NOW)
    fill(index, 40, 40, seed=9, start=280)  # more parts of some incidents (their time, verdict change), new ones
    for days in (0.5, 3, 8, 25, 31, 45):  # incidents leave the 7- and 30-day windows
        now[0] = NOW + days * DAY_S
        assert shown(index, now[0]) == reference(index, now[0]), days
    assert shown(index, NOW) == reference(index, NOW)  # a view of an earlier time
    index.close()
    reopened = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: NOW)
    assert shown(reopened, NOW) == reference(reopened, NOW)


def test_an_index_written_before_the_summary_gets_it_when_opened(tmp_path: Path) -> None:
    index = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: NOW)
    fill(index, 50, 10)
    index._db.execute("DELETE FROM host_summary")  # as an index of the previous version has none
    index.close()
    reopened = IncidentIndex(tmp_path / "i.sqlite", clock=lambda: NOW)
    assert shown(reopened, NOW) == reference(reopened, NOW) != []


def read_work(index: IncidentIndex) -> int:
    """SQLite virtual-machine instructions (in hundreds) of one hosts view, once nothing is stale."""
    index.hosts(now=NOW)
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    index._db.set_progress_handler(count, 100)
    index.hosts(now=NOW)
    index._db.set_progress_handler(None, 100)
    return steps[0]


def test_a_read_does_not_grow_with_the_incidents(tmp_path: Path) -> None:
    small = IncidentIndex(tmp_path / "small.sqlite", clock=lambda: NOW)
    fill(small, 100, 30)
    large = IncidentIndex(tmp_path / "large.sqlite", clock=lambda: NOW)
    fill(large, 1000, 30)
    assert read_work(large) < 2 * read_work(small), (read_work(small), read_work(large))
