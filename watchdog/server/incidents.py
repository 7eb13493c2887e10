"""The cluster server's index of uploaded bundles: incidents across jobs, the nodes' parts, the hosts they name.

One incident is one hang of one job: every node of the job uploads its bundle under the same incident key
(the alert's dedup key), and each bundle is one *part*.  The hosts an incident names (the culprit ranks'
hosts, a lost node, the hosts of a slow link) are rows of ``named``; the hosts view and
``ncclwatch_host_incidents_total{host,verdict}`` read them.

Storage: SQLite from the standard library (embedded, nothing to run), one connection behind a lock; every
method blocks, so the server calls them from a thread (``asyncio.to_thread``), never on the event loop.  The
schema and the queries are plain SQL (TEXT, BIGINT, DOUBLE PRECISION, no SQLite-only function, ``?``
placeholders, which a PostgreSQL driver spells ``%s``), so that a larger site could run them on PostgreSQL.

Times are Unix seconds (``DOUBLE PRECISION``): when the hang was detected (the report's ``detected_at``),
else when the part arrived.  A job is its name plus its Slurm job id when the uploader knew one: two runs of
one script outside Slurm count as one job.

``host_totals`` is a counter, never decremented: retention removes bundles and their rows, not what the
metric has counted.

The hosts view reads ``host_summary``: one row per host, its counts over 7 and 30 days as of ``computed_at``,
rewritten in the transaction that records or removes a part naming the host, and valid until ``valid_until``
(when the first incident it counts leaves its 7- or 30-day window).  A read recomputes only the rows no longer
valid at its ``now`` (a few; a read of an earlier time recomputes the rows computed after it), then reads
the first rows in the view's order through an index: no aggregation over 10,000 incidents per request.

Failure modes: a report whose fields do not fit is read through ``view.report_view`` by the caller, so
``record`` gets JSON types; host names that are not host names (``HOST_RE``) are not indexed, so nothing a
bundle says reaches a command line or a label unchecked.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
JOB_MAX = 200
LOST_NODE_RE = re.compile(r"\bNode (?:\d+ \(([^)]+)\)(?:, )?)+")  # cluster/judge.py: "Node 0 (gpu3), 2 (gpu5)"
_LOST_HOSTS_RE = re.compile(r"\d+ \(([^)]+)\)")
ROLES = ("culprit", "lost_node", "slow_link")
DAY_S = 86400.0
LIST_MAX = 500
HOSTS_SHOWN = 200  # the hosts view's default: the repeat hosts are first, the tail is hosts named once
FOREVER = 1e300  # host_summary.valid_until of a host that nothing counts for: no window ever changes it
_SUMMARY = "host, days_7, days_30, jobs_7, jobs_30, last_at, by_verdict_7, by_verdict_30, roles"

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS incidents (
        incident_key TEXT PRIMARY KEY, job TEXT NOT NULL, slurm_job TEXT, verdict TEXT, summary TEXT,
        at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS incidents_at ON incidents (at)",
    "CREATE INDEX IF NOT EXISTS incidents_job ON incidents (job, at)",
    """CREATE TABLE IF NOT EXISTS parts (
        bundle_id TEXT PRIMARY KEY, incident_key TEXT NOT NULL REFERENCES incidents (incident_key),
        host TEXT, verdict TEXT, size BIGINT NOT NULL, sha256 TEXT NOT NULL, received_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS parts_incident ON parts (incident_key)",
    "CREATE INDEX IF NOT EXISTS parts_received ON parts (received_at)",
    # The incident's job, time and verdict are repeated here (kept equal by ``record``) so that the hosts view
    # is one aggregation over one table: the join cost 100 ms at 10,000 incidents.
    """CREATE TABLE IF NOT EXISTS named (
        incident_key TEXT NOT NULL REFERENCES incidents (incident_key), host TEXT NOT NULL, role TEXT NOT NULL,
        bundle_id TEXT NOT NULL, job TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, verdict TEXT,
        PRIMARY KEY (incident_key, host, role, bundle_id))""",
    "CREATE INDEX IF NOT EXISTS named_host ON named (host, at)",
    "CREATE INDEX IF NOT EXISTS named_at ON named (at)",
    # One row per (host, incident), whatever number of its nodes' bundles named the host: what the hosts view
    # counts, without COUNT(DISTINCT) over ``named`` (37 -> 12 ms at 10,000 incidents).
    """CREATE TABLE IF NOT EXISTS host_incidents (
        host TEXT NOT NULL, incident_key TEXT NOT NULL, job TEXT NOT NULL, at DOUBLE PRECISION NOT NULL,
        verdict TEXT NOT NULL, culprit INTEGER NOT NULL, lost_node INTEGER NOT NULL, slow_link INTEGER NOT NULL,
        PRIMARY KEY (host, incident_key))""",
    "CREATE INDEX IF NOT EXISTS host_incidents_at ON host_incidents (at, host)",
    # Per host, the hosts view's row as of computed_at (``_refresh_hosts``); the verdicts and roles as JSON text.
    """CREATE TABLE IF NOT EXISTS host_summary (
        host TEXT PRIMARY KEY, days_7 INTEGER NOT NULL, days_30 INTEGER NOT NULL, jobs_7 INTEGER NOT NULL,
        jobs_30 INTEGER NOT NULL, last_at DOUBLE PRECISION, by_verdict_7 TEXT NOT NULL, by_verdict_30 TEXT NOT NULL,
        roles TEXT NOT NULL, computed_at DOUBLE PRECISION NOT NULL, valid_until DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS host_summary_rank ON host_summary (days_7 DESC, days_30 DESC, last_at DESC, host)",
    "CREATE INDEX IF NOT EXISTS host_summary_valid ON host_summary (valid_until)",
    """CREATE TABLE IF NOT EXISTS host_totals (
        host TEXT NOT NULL, verdict TEXT NOT NULL, total BIGINT NOT NULL, PRIMARY KEY (host, verdict))""",
    """CREATE TABLE IF NOT EXISTS repeat_state (host TEXT PRIMARY KEY, above INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS repeat_actions (
        host TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, incidents INTEGER NOT NULL, jobs TEXT NOT NULL,
        command TEXT NOT NULL, exit_status INTEGER, output TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS repeat_actions_host ON repeat_actions (host, at)",
)


def epoch(value: object) -> float | None:
    """An ISO 8601 time (the report's) as Unix seconds; None when it is not one."""
    if not isinstance(value, str):
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


def named_hosts(report: dict[str, Any]) -> set[tuple[str, str]]:
    """(host, role) the report names: its culprit ranks' hosts, a lost node's host, a slow link's hosts."""
    found: set[tuple[str, str]] = set()
    culprits = {r for r in report.get("culprit_ranks") or [] if isinstance(r, int)}
    lost = report.get("verdict") == "node_lost"
    role = "lost_node" if lost else "culprit"
    for row in report.get("ranks") or []:
        if isinstance(row, dict) and row.get("rank") in culprits:
            found.add((row.get("host"), role))
    for process in report.get("culprit_processes") or []:
        if isinstance(process, dict):
            found.add((process.get("host"), role))
    if lost and (named := LOST_NODE_RE.search(str(report.get("summary") or ""))):
        found |= {(host, "lost_node") for host in _LOST_HOSTS_RE.findall(named.group(0))}
    for note in report.get("performance") or []:
        if isinstance(note, dict) and note.get("kind") == "slow_link":
            found |= {(host, "slow_link") for host in note.get("hosts") or []}
    return {(h, r) for h, r in found if isinstance(h, str) and HOST_RE.fullmatch(h)}


@dataclasses.dataclass(frozen=True)
class Part:
    """One node's bundle of an incident, as the intake read it."""

    bundle_id: str
    incident_key: str
    report: dict[str, Any]  # report_view's
    size: int
    sha256: str
    slurm_job: str | None = None


@dataclasses.dataclass(frozen=True)
class Recorded:
    incident_key: str
    new_incident: bool
    replaced: bool  # this node's part was there already (an amended bundle, or a retry)
    hosts: frozenset[str]


class IncidentIndex:
    """The SQLite index (see the module docstring).  Thread-safe; every method blocks."""

    def __init__(self, path: Path, clock: Any = time.time) -> None:
        self.path = path
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._lock = threading.Lock()
        with self._lock:
            for statement in SCHEMA:
                self._db.execute(statement)
            self.totals = {(h, v): n for h, v, n in self._db.execute("SELECT host, verdict, total FROM host_totals")}
            missing = self._db.execute(  # an index written before host_summary existed
                "SELECT DISTINCT host FROM host_incidents WHERE host NOT IN (SELECT host FROM host_summary)"
            ).fetchall()
            if missing:
                with self._transaction():
                    self._refresh_hosts({h for (h,) in missing}, self.clock())

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        cursor = self._db.execute(sql, tuple(params))
        names = [c[0] for c in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    # -- writing --------------------------------------------------------------------------------------------------

    def record(self, part: Part) -> Recorded:
        """Index one node's bundle under its incident (created with the first part); idempotent per bundle."""
        report, now = part.report, self.clock()
        at = epoch(report.get("detected_at")) or epoch(report.get("analyzed_at")) or now
        job = str(report.get("job") or "unknown-job")[:JOB_MAX]
        verdict = report.get("verdict") if isinstance(report.get("verdict"), str) else None
        hosts = named_hosts(report)
        with self._lock, self._transaction():
            known = self._db.execute(
                "SELECT verdict FROM incidents WHERE incident_key = ?", (part.incident_key,)
            ).fetchone()
            if known is None:
                self._db.execute(
                    "INSERT INTO incidents (incident_key, job, slurm_job, verdict, summary, at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (part.incident_key, job, part.slurm_job, verdict, report.get("summary"), at, now),
                )
            else:
                self._db.execute(
                    "UPDATE incidents SET updated_at = ?, verdict = COALESCE(verdict, ?), at = CASE WHEN at > ? "
                    "THEN ? ELSE at END WHERE incident_key = ?",
                    (now, verdict, at, at, part.incident_key),
                )
            replaced = self._db.execute("SELECT 1 FROM parts WHERE bundle_id = ?", (part.bundle_id,)).fetchone()
            self._forget_part(part.bundle_id)
            self._db.execute(
                "INSERT INTO parts (bundle_id, incident_key, host, verdict, size, sha256, received_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (part.bundle_id, part.incident_key, report.get("host"), verdict, part.size, part.sha256, now),
            )
            incident_verdict = verdict if known is None else (known[0] or verdict)
            affected = self._hosts_of(part.incident_key) | {h for h, _ in hosts}
            for host, role in sorted(hosts):
                first = not self._db.execute(
                    "SELECT 1 FROM named WHERE incident_key = ? AND host = ?", (part.incident_key, host)
                ).fetchone()
                self._db.execute(
                    "INSERT INTO named (incident_key, host, role, bundle_id, job, at, verdict) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (part.incident_key, host, role, part.bundle_id, "", at, incident_verdict),
                )
                if first:
                    self._count(host, incident_verdict or "unknown")
            self._db.execute(  # the incident's job, time and verdict, as they now stand, on every naming of it
                "UPDATE named SET job = (SELECT job || COALESCE(' (Slurm ' || slurm_job || ')', '') FROM incidents "
                "WHERE incident_key = ?), at = (SELECT at FROM incidents WHERE incident_key = ?), "
                "verdict = (SELECT verdict FROM incidents WHERE incident_key = ?) WHERE incident_key = ?",
                (part.incident_key,) * 4,
            )
            self._summarize(part.incident_key)
            self._refresh_hosts(affected, now)
        return Recorded(part.incident_key, known is None, replaced is not None, frozenset(h for h, _ in hosts))

    def _count(self, host: str, verdict: str) -> None:
        total = self.totals.get((host, verdict), 0) + 1
        self._db.execute("DELETE FROM host_totals WHERE host = ? AND verdict = ?", (host, verdict))
        self._db.execute("INSERT INTO host_totals (host, verdict, total) VALUES (?, ?, ?)", (host, verdict, total))
        self.totals[(host, verdict)] = total

    def _summarize(self, incident_key: str) -> None:
        """The incident's rows of ``host_incidents`` from its rows of ``named``."""
        self._db.execute("DELETE FROM host_incidents WHERE incident_key = ?", (incident_key,))
        self._db.execute(
            "INSERT INTO host_incidents (host, incident_key, job, at, verdict, culprit, lost_node, slow_link) "
            "SELECT host, incident_key, MAX(job), MAX(at), COALESCE(MAX(verdict), 'unknown'), "
            "MAX(CASE WHEN role = 'culprit' THEN 1 ELSE 0 END), MAX(CASE WHEN role = 'lost_node' THEN 1 ELSE 0 END), "
            "MAX(CASE WHEN role = 'slow_link' THEN 1 ELSE 0 END) FROM named WHERE incident_key = ? "
            "GROUP BY host, incident_key",
            (incident_key,),
        )

    def _hosts_of(self, incident_key: str) -> set[str]:
        rows = self._db.execute("SELECT host FROM host_incidents WHERE incident_key = ?", (incident_key,))
        return {host for (host,) in rows}

    def _refresh_hosts(self, hosts: Iterable[str], now: float) -> None:
        """Each host's ``host_summary`` row from its ``host_incidents`` as of ``now`` (gone with its last row)."""
        week, month = now - 7 * DAY_S, now - 30 * DAY_S
        for host in sorted(set(hosts)):
            rows = self._db.execute(
                "SELECT verdict, at, job, culprit, lost_node, slow_link FROM host_incidents WHERE host = ?", (host,)
            ).fetchall()
            self._db.execute("DELETE FROM host_summary WHERE host = ?", (host,))
            if not rows:
                continue
            entry = _host_entry(host)
            jobs_7, jobs_30 = set(), set()
            valid_until = float("inf")
            for verdict, at, job, *by_role in rows:
                if at < month:
                    continue  # out of both windows for good: time only moves on
                entry["days_30"] += 1
                entry["by_verdict_30"][verdict] = entry["by_verdict_30"].get(verdict, 0) + 1
                jobs_30.add(job)
                entry["last_at"] = max(entry["last_at"] or at, at)
                for role, flag in zip(ROLES, by_role):
                    if flag:
                        entry["roles"][role] = entry["roles"].get(role, 0) + 1
                if at >= week:
                    entry["days_7"] += 1
                    entry["by_verdict_7"][verdict] = entry["by_verdict_7"].get(verdict, 0) + 1
                    jobs_7.add(job)
                valid_until = min(valid_until, at + (7 if at >= week else 30) * DAY_S)
            self._db.execute(
                "INSERT INTO host_summary (host, days_7, days_30, jobs_7, jobs_30, last_at, by_verdict_7, "
                "by_verdict_30, roles, computed_at, valid_until) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    host,
                    entry["days_7"],
                    entry["days_30"],
                    len(jobs_7),
                    len(jobs_30),
                    entry["last_at"],
                    json.dumps(entry["by_verdict_7"], sort_keys=True),
                    json.dumps(entry["by_verdict_30"], sort_keys=True),
                    json.dumps(entry["roles"], sort_keys=True),
                    now,
                    min(valid_until, FOREVER),
                ),
            )

    def _forget_part(self, bundle_id: str) -> None:
        self._db.execute("DELETE FROM named WHERE bundle_id = ?", (bundle_id,))
        self._db.execute("DELETE FROM parts WHERE bundle_id = ?", (bundle_id,))

    def remove_part(self, bundle_id: str) -> None:
        """A bundle deleted (retention): its rows go, and its incident with its last part."""
        with self._lock, self._transaction():
            row = self._db.execute("SELECT incident_key FROM parts WHERE bundle_id = ?", (bundle_id,)).fetchone()
            self._forget_part(bundle_id)
            if row is not None:
                affected = self._hosts_of(row[0])
                self._summarize(row[0])
                self._refresh_hosts(affected, self.clock())
            if (
                row is not None
                and not self._db.execute("SELECT 1 FROM parts WHERE incident_key = ?", (row[0],)).fetchone()
            ):
                self._db.execute("DELETE FROM named WHERE incident_key = ?", (row[0],))
                self._db.execute("DELETE FROM incidents WHERE incident_key = ?", (row[0],))

    def _transaction(self) -> Any:
        db = self._db

        class Transaction:
            def __enter__(self) -> None:
                db.execute("BEGIN")

            def __exit__(self, kind: object, *rest: object) -> None:
                db.execute("COMMIT" if kind is None else "ROLLBACK")

        return Transaction()

    # -- reading --------------------------------------------------------------------------------------------------

    def parts_by_age(self) -> list[tuple[str, float, int]]:
        """(bundle_id, received_at, size) of every part, oldest first: what retention walks."""
        with self._lock:
            return list(self._db.execute("SELECT bundle_id, received_at, size FROM parts ORDER BY received_at"))

    def incidents(
        self,
        *,
        job: str | None = None,
        host: str | None = None,
        verdict: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Newest first, filtered; each with its parts' hosts and the hosts it names."""
        where, params = [], []
        for clause, value in (
            ("i.job = ?", job),
            ("i.verdict = ?", verdict),
            ("i.at >= ?", since),
            ("i.at < ?", until),
            ("i.incident_key IN (SELECT incident_key FROM named WHERE host = ?)", host),
        ):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = "SELECT i.incident_key, i.job, i.slurm_job, i.verdict, i.summary, i.at FROM incidents i"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY i.at DESC, i.incident_key LIMIT ?"
        with self._lock:
            rows = self._rows(sql, [*params, max(1, min(limit, LIST_MAX))])
            self._attach(rows)
        return rows

    def _attach(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        keys = [r["incident_key"] for r in rows]
        marks = ", ".join("?" * len(keys))
        parts: dict[str, list[str]] = {k: [] for k in keys}
        for key, node in self._db.execute(
            f"SELECT incident_key, host FROM parts WHERE incident_key IN ({marks}) ORDER BY host", keys
        ):
            parts[key].append(node)
        named: dict[str, set[tuple[str, str]]] = {k: set() for k in keys}
        for key, host, role in self._db.execute(
            f"SELECT incident_key, host, role FROM named WHERE incident_key IN ({marks})", keys
        ):
            named[key].add((host, role))
        for row in rows:
            row["nodes"] = parts[row["incident_key"]]
            row["named"] = [{"host": h, "role": r} for h, r in sorted(named[row["incident_key"]])]

    def incident(self, key: str) -> dict[str, Any] | None:
        """One incident with every part (bundle id, host, verdict, size, received) and the hosts it names."""
        with self._lock:
            rows = self._rows(
                "SELECT incident_key, job, slurm_job, verdict, summary, at, updated_at FROM incidents "
                "WHERE incident_key = ?",
                [key],
            )
            if not rows:
                return None
            self._attach(rows)
            rows[0]["parts"] = self._rows(
                "SELECT bundle_id, host, verdict, size, sha256, received_at FROM parts WHERE incident_key = ? "
                "ORDER BY host, bundle_id",
                [key],
            )
        return rows[0]

    def hosts(
        self, now: float | None = None, host: str | None = None, limit: int = HOSTS_SHOWN
    ) -> list[dict[str, Any]]:
        """Per host named in the last 30 days: incidents over 7 and 30 days, by verdict and by role, jobs; repeat
        hosts first (most incidents in 7 days, then 30).  An incident counts once per host, however many of its
        nodes' bundles named the host.  Hosts with ``--on-repeat`` actions are there too."""
        now = self.clock() if now is None else now
        limit = max(1, limit)
        only, extra = (" AND host = ?", [host]) if host is not None else ("", [])
        with self._lock:
            stale = self._db.execute(
                "SELECT host FROM host_summary WHERE (valid_until <= ? OR computed_at > ?)" + only, [now, now, *extra]
            ).fetchall()
            if stale:  # an incident left a window since (or the view is of an earlier time)
                with self._transaction():
                    self._refresh_hosts({h for (h,) in stale}, now)
            found = {
                row["host"]: row
                for row in self._rows(
                    f"SELECT {_SUMMARY} FROM host_summary WHERE days_30 > 0{only} "
                    "ORDER BY days_7 DESC, days_30 DESC, last_at DESC, host LIMIT ?",
                    [*extra, limit],
                )
            }
            actions = self._rows(
                "SELECT host, at, incidents, jobs, command, exit_status, output FROM repeat_actions"
                + (" WHERE host = ?" if host is not None else "")
                + " ORDER BY at",
                extra,
            )
            acted = sorted({a["host"] for a in actions} - found.keys())
            for name in acted:  # a host acted on, ranked below the first ``limit``, or no longer named
                rows = self._rows(f"SELECT {_SUMMARY} FROM host_summary WHERE days_30 > 0 AND host = ?", [name])
                found[name] = rows[0] if rows else None
        entries: dict[str, dict[str, Any]] = {}
        for name, row in found.items():
            entry = entries[name] = _host_entry(name)
            if row is not None:
                entry.update({k: row[k] for k in ("days_7", "days_30", "jobs_7", "jobs_30", "last_at")})
                entry.update({k: json.loads(row[k]) for k in ("by_verdict_7", "by_verdict_30", "roles")})
        for action in actions:
            entries[action["host"]]["actions"].append(action)
        ranked = sorted(entries.values(), key=lambda e: (-e["days_7"], -e["days_30"], -(e["last_at"] or 0), e["host"]))
        return ranked[:limit]

    # -- repetition -----------------------------------------------------------------------------------------------

    def jobs_naming(self, host: str, since: float) -> list[str]:
        """The distinct jobs whose incidents since ``since`` name ``host``."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT job FROM host_incidents WHERE host = ? AND at >= ?", (host, since))
            return sorted(job for (job,) in rows)

    def crossed(self, host: str, above: bool) -> bool:
        """Record whether ``host`` is at or over the threshold; True when it has just crossed it (was under)."""
        with self._lock, self._transaction():
            row = self._db.execute("SELECT above FROM repeat_state WHERE host = ?", (host,)).fetchone()
            before = bool(row[0]) if row else False
            if before != above:
                self._db.execute("DELETE FROM repeat_state WHERE host = ?", (host,))
                self._db.execute("INSERT INTO repeat_state (host, above) VALUES (?, ?)", (host, int(above)))
        return above and not before

    def hosts_above(self) -> list[str]:
        """Hosts last seen at or over the threshold: a sliding window may have taken them under it since."""
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT host FROM repeat_state WHERE above = 1")]

    def add_action(
        self, host: str, incidents: int, jobs: list[str], command: str, status: int | None, out: str
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO repeat_actions (host, at, incidents, jobs, command, exit_status, output) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (host, self.clock(), incidents, ", ".join(jobs), command, status, out),
            )


def _host_entry(host: str) -> dict[str, Any]:
    return {
        "host": host,
        "days_7": 0,
        "days_30": 0,
        "by_verdict_7": {},
        "by_verdict_30": {},
        "roles": {},
        "jobs_7": 0,
        "jobs_30": 0,
        "last_at": None,
        "actions": [],
    }
