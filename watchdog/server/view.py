"""A report.json as the page may trust it: validated with the report's own model, odd fields dropped.

Bundles come from any ncclwatch version, or from a hand-edited or damaged
file, so the model is relaxed only where an older or newer writer differs
(a verdict this version does not know, fields it did not write), and every
value that does not fit is removed rather than shown: ``culprit_ranks: 5``
becomes ``[]``, a timeline row whose ``ops`` is a number is dropped, a
non-string path leaves the list.  ``report_view`` never raises; what it drops
is listed in the view's ``notes`` (the page shows them), so nothing is
silently hidden.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from ncclwatch.watchdog.hang.report import Report

_PRUNE_ROUNDS = 64  # each round removes every value the last validation named


class ReportView(Report):
    """The report model, relaxed where writers of other versions differ."""

    verdict: str | None = None  # type: ignore[assignment]  # a newer version's verdict still shows
    culprit_ranks: list[int] = []
    summary: str = ""
    analyzed_at: str | None = None  # type: ignore[assignment]
    version: str | None = None  # type: ignore[assignment]


def report_view(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a JSON object) -> the same report with every value the model refuses removed, as JSON types."""
    data = copy.deepcopy(raw)
    dropped: list[str] = []
    for _ in range(_PRUNE_ROUNDS):
        try:
            view = ReportView.model_validate(data)
        except ValidationError as exc:
            locations = sorted({tuple(e["loc"]) for e in exc.errors()}, key=_order, reverse=True)  # last items first
            if not any(_prune(data, loc) for loc in locations):
                break
            dropped += [".".join(map(str, loc)) for loc in locations if loc]
            continue
        result = view.model_dump(mode="json")
        if dropped:
            result["notes"] = [
                *result["notes"],
                f"not shown, malformed in report.json: {', '.join(list(dict.fromkeys(dropped))[:20])}",
            ]
        return result
    return ReportView(notes=["report.json could not be read as a report"]).model_dump(mode="json")


def _order(loc: tuple[Any, ...]) -> tuple[tuple[int, Any], ...]:
    return tuple((0, key) if isinstance(key, int) else (1, str(key)) for key in loc)


def _prune(data: Any, loc: tuple[Any, ...]) -> bool:
    """Remove the value at ``loc`` (or the nearest container holding it); whether anything was removed."""
    for depth in range(len(loc), 0, -1):
        parent = _at(data, loc[: depth - 1])
        key = loc[depth - 1]
        if isinstance(parent, dict) and key in parent:
            del parent[key]
            return True
        if isinstance(parent, list) and isinstance(key, int) and 0 <= key < len(parent):
            del parent[key]
            return True
    return False


def _at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            data = data[key]
        else:
            return None
    return data
