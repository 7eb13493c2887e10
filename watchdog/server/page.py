"""The page, as HTML strings from a report's JSON (a dict, read leniently: any ncclwatch version's bundle).

Pure: no I/O but the two templates beside this file.  Every value from a
bundle goes through ``esc``; the page runs no script.
"""

from __future__ import annotations

import html
import string
from collections import Counter
from functools import cache
from importlib import resources
from typing import Any

PENDING = {"scheduled", "started"}  # Flight Recorder states of an operation not completed
MAX_COLUMNS = 12
LABEL_W, COL_W, BOX_W, TOP, ROW_H, BOX_H = 128, 150, 140, 52, 66, 54


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


@cache
def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page_html(title: str, body: str, where: str = "") -> str:
    return string.Template(_asset("page.html")).substitute(
        title=esc(title), style=_asset("style.css"), where=esc(where), body=body
    )


def size_text(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return str(size)


def badge(verdict: object) -> str:
    name = verdict if isinstance(verdict, str) and verdict else "unknown"
    return f'<span class="badge {esc(name)}">{esc(name.replace("_", " "))}</span>'


def listing_body(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<h1>No bundles yet</h1><p class='muted'>A bundle appears here when the watchdog catches a hang.</p>"
    out = [
        f"<h1>Bundles <span class='muted'>({len(rows)})</span></h1>",
        "<table class='bundles'><thead><tr>",
        "<th>created (UTC)</th><th>job</th><th>verdict</th><th>culprit</th><th>summary</th><th>size</th><th></th>",
        "</tr></thead><tbody>",
    ]
    for row in rows:
        bundle_id = esc(row["id"])
        culprits = ", ".join(map(str, row.get("culprit_ranks") or [])) or "-"
        summary = esc(row.get("summary")) if not row.get("error") else f"<span class='error'>{esc(row['error'])}</span>"
        created = str(row.get("created") or "").replace("T", " ").removesuffix("+00:00")
        out.append(
            f"<tr class='{'broken' if row.get('error') else ''}'><td class='nowrap mono'>{esc(created)}</td>"
            f"<td class='nowrap'><a href='/bundles/{bundle_id}'>{esc(row.get('job') or row['id'])}</a></td>"
            f"<td class='nowrap'>{badge(row.get('verdict'))}</td><td>{esc(culprits)}</td><td>{summary}</td>"
            f"<td class='nowrap'>{size_text(row.get('size') or 0)}</td>"
            f"<td><a href='/api/bundles/{bundle_id}'>download</a></td></tr>"
        )
    return "\n".join(out + ["</tbody></table>"])


def report_body(bundle_id: str, report: dict[str, Any], files: list[tuple[str, int]]) -> str:
    culprits = [r for r in report.get("culprit_ranks") or [] if isinstance(r, int)]
    quoted = esc(bundle_id)
    head = badge(report.get("verdict"))
    dims = [d for d in report.get("mesh_dims") or [] if isinstance(d, str)]
    places = {r.get("rank"): _mesh_place(dims, r.get("mesh")) for r in report.get("ranks") or [] if isinstance(r, dict)}
    if culprits:
        named = ", ".join(f"{r} ({places[r]})" if places.get(r) else str(r) for r in culprits)  # "3 (dp 1, tp 1)"
        head += f" <span class='culprit-tag'>culprit rank {esc(named)}</span>"
    out = [
        f"<p><a href='/'>&larr; all bundles</a></p><h1>{head}</h1>",
        f"<p class='summary'>{esc(report.get('summary'))}</p>",
        f"<p class='reason'>{esc(report.get('reason'))}</p>" if report.get("reason") else "",
        _facts(report),
        (
            f"<div class='actions'><a href='/api/bundles/{quoted}'>download the bundle (tar.gz)</a>"
            f"<a href='/api/bundles/{quoted}/report'>report.json</a></div>"
        ),
        "<h2>Timeline</h2>",
        timeline_svg(report),
        "<h2>Ranks</h2>",
        _ranks_table(report.get("ranks") or [], set(culprits), dims),
        "<h2>Evidence</h2>",
        _evidence(report.get("evidence") or []),
        "<div class='cols'><div><h2>Evidence collected</h2>",
        _evidence_files(report.get("evidence_files") or []),
        "</div><div><h2>Files in this bundle</h2>",
        _files(files),
        "</div></div>",
    ]
    for title, key in (("Could not see", "missing"), ("Notes", "notes")):
        if report.get(key):
            out += [f"<h2>{title}</h2><ul>", *(f"<li>{esc(item)}</li>" for item in report[key]), "</ul>"]
    return "\n".join(out)


def _facts(report: dict[str, Any]) -> str:
    operation = report.get("operation")
    if operation and report.get("position"):
        operation = f"{operation} (collective #{report['position']} on {report.get('communicator')})"
    stall = report.get("stall_timeout_s")
    facts = [
        ("job", report.get("job")),
        ("host", report.get("host")),
        ("operation", operation),
        ("hang started", report.get("hang_started_at")),
        ("detected", report.get("detected_at") or report.get("analyzed_at")),
        ("stall timeout", f"{stall:g} s" if isinstance(stall, (int, float)) else None),
        ("NCCL", ", ".join(map(str, report.get("nccl_versions") or [])) or None),
        ("ncclwatch", report.get("version")),
    ]
    return "<dl class='facts'>" + "".join(f"<dt>{k}</dt><dd>{esc(v)}</dd>" for k, v in facts if v) + "</dl>"


RANK_COLUMNS = (
    "rank",
    "mesh",
    "host",
    "pid",
    "state",
    "step",
    "issued",
    "status",
    "detail",
    "stack",
    "gpu",
    "last_progress_at",
)


def _mesh_place(dims: list[str], mesh: Any) -> str | None:
    """``dp 1, tp 1``: a row's place in the job's DeviceMesh (``RankRow.mesh``), in ``mesh_dims`` order."""
    if not isinstance(mesh, dict) or not mesh:
        return None
    return ", ".join(f"{dim} {mesh.get(dim, '?')}" for dim in dims or list(mesh))


def _ranks_table(rows: list[dict[str, Any]], culprits: set[int], dims: list[str] | None = None) -> str:
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return "<p class='muted'>No per-rank rows in this report.</p>"
    rows = [{**r, "mesh": _mesh_place(dims or [], r.get("mesh"))} for r in rows]  # after the rank: "dp 1, tp 1"
    columns = [c for c in RANK_COLUMNS if c in ("rank", "status") or any(r.get(c) not in (None, "") for r in rows)]
    out = [
        "<table class='ranks'><thead><tr>",
        *(f"<th>{esc(c.replace('_', ' '))}</th>" for c in columns),
        "</tr></thead><tbody>",
    ]
    for row in rows:
        culprit = row.get("rank") in culprits
        attrs = (
            f" class='culprit' data-culprit='true' data-rank='{esc(row.get('rank'))}'"
            if culprit
            else f" data-rank='{esc(row.get('rank'))}'"
        )
        cells = [esc(row.get(c)) + (" (culprit)" if c == "rank" and culprit else "") for c in columns]
        out.append(f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(out + ["</tbody></table>"])


def _evidence(items: list[dict[str, Any]]) -> str:
    if not items:
        return "<p class='muted'>None.</p>"
    out = ["<ul class='evidence'>"]
    for item in items:
        if not isinstance(item, dict):
            continue
        cite = f"<br><code>{esc(item['cite'])}</code>" if item.get("cite") else ""
        text = f"<pre>{esc(str(item['text'])[:600])}</pre>" if item.get("text") else ""
        out.append(
            f"<li><span class='source'>{esc(item.get('source'))}</span> {esc(item.get('fact'))}{cite}{text}</li>"
        )
    return "\n".join(out + ["</ul>"])


def _evidence_files(records: list[dict[str, Any]]) -> str:
    if not records:
        return "<p class='muted'>No collection records (a report from <code>ncclwatch analyze</code>).</p>"
    out = ["<table><thead><tr><th>collector</th><th>rank</th><th>result</th><th>s</th></tr></thead><tbody>"]
    for rec in records:
        if not isinstance(rec, dict):
            continue
        result = (
            f"<span class='error'>{esc(rec['error'])}</span>"
            if rec.get("error")
            else esc(", ".join(rec.get("paths") or []) or "-")
        )
        note = f" <span class='muted'>({esc(rec['note'])})</span>" if rec.get("note") else ""
        duration = rec.get("duration_s")
        seconds = f"{duration:.2f}" if isinstance(duration, (int, float)) else ""
        out.append(
            f"<tr><td>{esc(rec.get('name'))}</td><td>{esc(rec.get('rank'))}</td><td>{result}{note}</td><td>{seconds}</td></tr>"
        )
    return "\n".join(out + ["</tbody></table>"])


def _files(files: list[tuple[str, int]]) -> str:
    if not files:
        return "<p class='muted'>No files.</p>"
    rows = "".join(f"<tr><td class='mono'>{esc(name)}</td><td>{size_text(size)}</td></tr>" for name, size in files)
    return f"<table><thead><tr><th>file</th><th>size</th></tr></thead><tbody>{rows}</tbody></table>"


# -- the timeline picture ---------------------------------------------------------------------------------------------


def _cells(report: dict[str, Any]) -> dict[int, dict[int, tuple[str, str | None]]]:
    """rank -> position -> (operation, Flight Recorder state)."""
    cells: dict[int, dict[int, tuple[str, str | None]]] = {}
    for row in report.get("timeline") or []:
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("rank"), int)
            or not isinstance(row.get("first_position"), int)
        ):
            continue
        states = list(row.get("states") or [])
        ops = [str(op) for op in row.get("ops") or []]
        states += [None] * (len(ops) - len(states))
        cells[row["rank"]] = {row["first_position"] + i: (op, states[i]) for i, op in enumerate(ops)}
    return cells


def _expected(cells: dict[int, dict[int, tuple[str, str | None]]], culprits: set[int]) -> dict[int, str]:
    """Per position, what most ranks issued (the culprits' vote counts only when no one else has one)."""
    expected = {}
    for position in {p for row in cells.values() for p in row}:
        votes = Counter(row[position][0] for rank, row in cells.items() if position in row and rank not in culprits)
        votes = votes or Counter(row[position][0] for row in cells.values() if position in row)
        expected[position] = votes.most_common(1)[0][0]
    return expected


def timeline_svg(report: dict[str, Any]) -> str:
    """Each rank's last operations as boxes on one position axis.

    The culprit's row and the verdict's position are marked.
    """
    cells = _cells(report)
    if not cells:
        return (
            "<p class='muted'>No timeline in this report "
            "(it comes from an older ncclwatch, or no communicator was named).</p>"
        )
    culprits = {r for r in report.get("culprit_ranks") or [] if isinstance(r, int)}
    expected = _expected(cells, culprits)
    last = {rank: max(row) for rank, row in cells.items()}
    everything = sorted({p for row in cells.values() for p in row})
    focus = report.get("position") if isinstance(report.get("position"), int) else None
    if focus is None:
        focus = next(
            (p for p in everything if any(p in row and row[p][0] != expected[p] for row in cells.values())), None
        )
    end = max(everything) if focus is None else min(max(everything), focus + 2)
    positions = list(range(max(min(everything), end - MAX_COLUMNS + 1), end + 1))
    ranks = sorted(cells)
    width, height = LABEL_W + COL_W * len(positions) + 8, TOP + ROW_H * len(ranks) + 6
    x_of = {p: LABEL_W + COL_W * i for i, p in enumerate(positions)}
    diverged = focus is not None and any(focus in row and row[focus][0] != expected[focus] for row in cells.values())
    out = [
        (
            f'<div class="timeline-wrap"><svg class="timeline" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'aria-labelledby="timeline-title" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'font-family="system-ui, DejaVu Sans, sans-serif">'
        ),
        (
            f'<title id="timeline-title">Last operations of each rank on '
            f"{esc(report.get('communicator') or 'the communicator')}, aligned by sequence number</title>"
        ),
    ]
    for i, rank in enumerate(ranks):
        if rank in culprits:
            y = TOP + ROW_H * i
            out.append(f'<rect class="culprit-band" x="0" y="{y}" width="{width}" height="{ROW_H}" fill="#fdecec"/>')
            out.append(f'<rect x="0" y="{y}" width="5" height="{ROW_H}" fill="#c62828"/>')
    if focus in x_of:
        x = x_of[focus]
        out.append(
            f'<rect class="focus" x="{x}" y="18" width="{COL_W}" height="{height - 18}" '
            'fill="#fff4c2" fill-opacity="0.75"/>'
        )
        label = "diverges here" if diverged else "pending here"
        out.append(
            f'<text x="{x + COL_W / 2}" y="13" text-anchor="middle" font-size="12" font-weight="700" '
            f'fill="#8a5a00">{label}</text>'
        )
    for p, x in x_of.items():
        weight, color = ("700", "#8a5a00") if p == focus else ("400", "#5b6573")
        out.append(
            f'<text x="{x + COL_W / 2}" y="{TOP - 10}" text-anchor="middle" font-size="13" '
            f'font-weight="{weight}" fill="{color}">#{p}</text>'
        )
    for i, rank in enumerate(ranks):
        out.append(_rank_row(rank, i, cells[rank], positions, x_of, expected, rank in culprits, last[rank]))
    out.append("</svg>")
    out.append(
        "<div class='legend'><span class='done'>completed</span>"
        "<span class='pending'>pending (scheduled/started)</span>"
        "<span class='differs'>differs from its peers</span><span class='absent'>not issued</span>"
        "<span class='unknown'>state not known</span><span class='focus'>the verdict's position</span>"
        "<span class='culprit'>culprit rank</span></div>"
        "<p class='muted'>Operations are aligned by their sequence number on the communicator (the n-th collective of "
        "every rank is compared; NCCL's opCount is not used). Hover a box for its full signature.</p></div>"
    )
    return "\n".join(out)


def _rank_row(
    rank: int,
    i: int,
    row: dict[int, tuple[str, str | None]],
    positions: list[int],
    x_of: dict[int, int],
    expected: dict[int, str],
    culprit: bool,
    last: int,
) -> str:
    y = TOP + ROW_H * i
    mid = y + ROW_H / 2
    label_color, weight = ("#c62828", "700") if culprit else ("#1d2430", "600")
    marks = ' class="rank culprit" data-culprit="true"' if culprit else ' class="rank"'
    out = [f'<g{marks} data-rank="{rank}">']
    out.append(
        f'<text x="14" y="{mid - (3 if culprit else -5)}" font-size="14" font-weight="{weight}" '
        f'fill="{label_color}">rank {rank}</text>'
    )
    if culprit:
        out.append(f'<text x="14" y="{mid + 14}" font-size="11.5" font-weight="700" fill="#c62828">CULPRIT</text>')
    for position in positions:
        x, top = x_of[position] + (COL_W - BOX_W) / 2, y + (ROW_H - BOX_H) / 2
        if position not in row:
            if position > last:  # the others issued it; this rank has not
                out.append(
                    f'<g class="op absent"><title>#{position}: not issued by rank {rank}</title>'
                    f'<rect x="{x}" y="{top}" width="{BOX_W}" height="{BOX_H}" rx="5" fill="none" stroke="#8a94a1" '
                    f'stroke-dasharray="5 4"/><text x="{x + BOX_W / 2}" y="{top + BOX_H / 2 + 4}" '
                    'text-anchor="middle" font-size="12" '
                    f'font-style="italic" fill="#6b7480">not issued</text></g>'
                )
            continue
        op, state = row[position]
        differs = op != expected.get(position)
        fill, stroke, stroke_w = (
            ("#fbd5d5", "#c62828", 2.5)
            if differs
            else ("#ffffff", "#b26a00", 2)
            if state in PENDING
            else (("#e4edf8", "#8fb0d6", 1) if state == "completed" else ("#eef0f2", "#a9b1bb", 1))
        )
        name, _, rest = op.partition(" ")
        first, _, more = rest.partition(" ")
        css = "op" + (" differs" if differs else "") + (" pending" if state in PENDING else "")
        out.append(
            f'<g class="{css}"><title>#{position}: {esc(op)}{f" ({esc(state)})" if state else ""}</title>'
            f'<rect x="{x}" y="{top}" width="{BOX_W}" height="{BOX_H}" rx="5" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="{stroke_w}"/>'
            + _fitted(name, x + 8, top + 17, 13, f'font-weight="700" fill="{"#8e1b1b" if differs else "#1d2430"}"')
            + _fitted(first, x + 8, top + 32, 11, 'fill="#4a5361"')
            + _fitted(more, x + 8, top + 46, 11, 'fill="#4a5361"')
            + "</g>"
        )
    out.append("</g>")
    return "".join(out)


def _fitted(text: str, x: float, y: float, size: int, attrs: str) -> str:
    """A line of a box; a long one is cut to 28 characters and squeezed to the box's width (never over a neighbour)."""
    if not text:
        return ""
    text = text if len(text) <= 28 else text[:27] + "…"
    fit = f' textLength="{BOX_W - 14}" lengthAdjust="spacingAndGlyphs"' if len(text) * size * 0.62 > BOX_W - 14 else ""
    return f'<text x="{x}" y="{y}" font-size="{size}"{fit} {attrs}>{esc(text)}</text>'
