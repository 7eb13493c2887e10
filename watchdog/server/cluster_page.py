"""The cluster server's pages as HTML strings: incidents across jobs, one incident, the hosts view, one host.

Pure, like ``page.py``: every value from the index (which came from bundles) goes through ``esc``, links
are built from checked ids and keys only, and the pages run no script.  Filters are a plain GET form.
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import quote

from ncclwatch.watchdog.server.page import badge, esc, report_body, size_text

NAV = "<p class='muted'><a href='/incidents'>incidents</a> · <a href='/hosts'>hosts</a> · <a href='/'>bundles</a></p>"
ROLE_TEXT = {"culprit": "culprit", "lost_node": "lost node", "slow_link": "slow link"}


def when(at: float | None) -> str:
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _host_link(host: str) -> str:
    return f"<a href='/hosts/{quote(host, safe='')}'>{esc(host)}</a>"


def _named(named: list[dict[str, str]]) -> str:
    return (
        ", ".join(
            f"{_host_link(n['host'])} <span class='muted'>({ROLE_TEXT.get(n['role'], n['role'])})</span>" for n in named
        )
        or "-"
    )


def _filter_form(query: dict[str, str]) -> str:
    fields = "".join(
        f"<label>{label} <input name='{name}' value='{esc(query.get(name, ''))}' placeholder='{hint}'></label> "
        for name, label, hint in (
            ("job", "job", "any"),
            ("host", "host", "any"),
            ("verdict", "verdict", "any"),
            ("since", "since", "2026-11-01"),
            ("until", "until", "2026-12-01"),
        )
    )
    return (
        f"<form class='filters' method='get' action='/incidents'>{fields}<button type='submit'>Filter</button></form>"
    )


def incidents_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "<table class='incidents'><thead><tr><th>detected (UTC)</th><th>job</th><th>verdict</th>"
        "<th>hosts named</th><th>nodes' bundles</th><th>summary</th></tr></thead><tbody>"
    ]
    for row in rows:
        key = quote(row["incident_key"], safe="")
        job = row["job"] + (f" (Slurm {row['slurm_job']})" if row.get("slurm_job") else "")
        out.append(
            f"<tr data-incident='{esc(row['incident_key'])}'><td class='nowrap mono'>{when(row['at'])}</td>"
            f"<td class='nowrap'><a href='/incidents/{key}'>{esc(job)}</a></td>"
            f"<td class='nowrap'>{badge(row.get('verdict'))}</td><td>{_named(row['named'])}</td>"
            f"<td>{len(row['nodes'])}</td><td>{esc(row.get('summary'))}</td></tr>"
        )
    return "\n".join(out + ["</tbody></table>"])


def incidents_body(rows: list[dict[str, Any]], query: dict[str, str]) -> str:
    head = f"<h1>Incidents <span class='muted'>({len(rows)}{'+' if len(rows) >= 100 else ''})</span></h1>{NAV}"
    form = _filter_form(query)
    if not rows:
        return (
            head + form + "<p class='muted'>No incidents match. They appear here when wrappers upload bundles "
            "(ncclwatch --upload URL).</p>"
        )
    return head + form + incidents_table(rows)


def incident_body(incident: dict[str, Any], shown: tuple[str, dict[str, Any], list[tuple[str, int]]] | None) -> str:
    """The incident, its nodes' bundles, and ``shown``: (bundle id, report, files) of the part whose report is
    shown below them (the first readable one)."""
    job = incident["job"] + (f" (Slurm {incident['slurm_job']})" if incident.get("slurm_job") else "")
    out = [
        f"<h1>{badge(incident.get('verdict'))} {esc(job)}</h1>{NAV}",
        f"<p class='summary'>{esc(incident.get('summary'))}</p>",
        "<dl class='facts'>",
        f"<dt>incident</dt><dd class='mono'>{esc(incident['incident_key'])}</dd>",
        f"<dt>detected</dt><dd>{when(incident['at'])} UTC</dd>",
        f"<dt>hosts named</dt><dd>{_named(incident['named'])}</dd>",
        "</dl>",
        f"<h2>Nodes' bundles ({len(incident['parts'])})</h2>",
        "<table class='parts'><thead><tr><th>host</th><th>verdict</th><th>received (UTC)</th><th>size</th>"
        "<th>bundle</th><th></th></tr></thead><tbody>",
    ]
    for part in incident["parts"]:
        bundle = quote(part["bundle_id"], safe="")
        out.append(
            f"<tr data-bundle='{esc(part['bundle_id'])}'><td>{esc(part.get('host'))}</td>"
            f"<td>{badge(part.get('verdict'))}</td><td class='nowrap mono'>{when(part['received_at'])}</td>"
            f"<td class='nowrap'>{size_text(part['size'])}</td>"
            f"<td><a href='/bundles/{bundle}'>report</a></td><td><a href='/api/bundles/{bundle}'>download</a></td></tr>"
        )
    out.append("</tbody></table>")
    if shown is not None:
        out.append(f"<h2>Report</h2><p class='muted'>from {esc(shown[0])}</p>")
        out.append(report_body(*shown))
    return "\n".join(out)


def _by_verdict(counts: dict[str, int]) -> str:
    return ", ".join(f"{badge(v)} {n}" for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def hosts_body(rows: list[dict[str, Any]]) -> str:
    out = [
        f"<h1>Hosts <span class='muted'>({len(rows)} named in 30 days, repeat hosts first; ?limit= for more)</span>"
        f"</h1>{NAV}",
        "<p class='muted'>Each host named by an incident (its culprit, a lost node, a slow link), repeat hosts "
        "first.</p>",
    ]
    if not rows:
        return "\n".join(out + ["<p class='muted'>No host named yet.</p>"])
    out.append(
        "<table class='hosts'><thead><tr><th>host</th><th>7 days</th><th>30 days</th><th>jobs (7 / 30 days)</th>"
        "<th>by verdict (30 days)</th><th>named as</th><th>last (UTC)</th><th>actions</th></tr></thead><tbody>"
    )
    for row in rows:
        roles = ", ".join(f"{ROLE_TEXT.get(r, r)} {n}" for r, n in sorted(row["roles"].items()))
        repeat = " class='culprit'" if row["jobs_7"] > 1 else ""
        out.append(
            f"<tr{repeat} data-host='{esc(row['host'])}'><td>{_host_link(row['host'])}</td>"
            f"<td>{row['days_7']}</td><td>{row['days_30']}</td><td>{row['jobs_7']} / {row['jobs_30']}</td>"
            f"<td>{_by_verdict(row['by_verdict_30'])}</td><td>{esc(roles) or '-'}</td>"
            f"<td class='nowrap mono'>{when(row['last_at'])}</td><td>{len(row['actions']) or ''}</td></tr>"
        )
    return "\n".join(out + ["</tbody></table>"])


def host_body(host: str, entry: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    out = [f"<h1>Host {esc(host)}</h1>{NAV}"]
    if entry is not None:
        out.append(
            f"<p class='summary'>Named in {entry['days_7']} incident(s) in 7 days ({entry['jobs_7']} job(s)), "
            f"{entry['days_30']} in 30 days ({entry['jobs_30']} job(s)).</p>"
            f"<p>by verdict (30 days): {_by_verdict(entry['by_verdict_30'])}</p>"
        )
        if entry["actions"]:
            out.append(
                "<h2>Actions on repetition</h2><table class='actions'><thead><tr><th>when (UTC)</th>"
                "<th>jobs</th><th>command</th><th>exit</th><th>output</th></tr></thead><tbody>"
            )
            for action in entry["actions"]:
                out.append(
                    f"<tr><td class='nowrap mono'>{when(action['at'])}</td><td>{action['incidents']}: "
                    f"{esc(action['jobs'])}</td><td class='mono'>{esc(action['command'])}</td>"
                    f"<td>{esc(action['exit_status'] if action['exit_status'] is not None else 'none')}</td>"
                    f"<td><pre>{esc(action['output'])}</pre></td></tr>"
                )
            out.append("</tbody></table>")
    out.append(f"<h2>Incidents naming {esc(host)}</h2>")
    out.append(incidents_table(rows) if rows else "<p class='muted'>None in the index.</p>")
    return "\n".join(out)
