"""Bundles as nodes of real jobs write them (``live/bundle.py``'s layout and names), for the cluster server's
tests and its benchmark: one top folder ``<job>-<host>-<time>-<verdict>`` holding report.json and evidence."""

from __future__ import annotations

import datetime as dt
import io
import os
import tarfile
from pathlib import Path

from ncclwatch.watchdog.hang.report import RankRow, Report
from ncclwatch.watchdog.live.bundle import bundle_name, report_markdown


def node_report(job: str, host: str, culprit_host: str, at: float, verdict: str = "collective_mismatch") -> Report:
    """A 4-rank job over two hosts (ranks 0-1 on ``host``'s side, 2-3 on the culprit's); rank 3 is the culprit."""
    stamp = dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
    return Report(
        verdict=verdict,
        culprit_ranks=[3],
        summary=f"rank 3 on {culprit_host} issued a different collective",
        ranks=[RankRow(rank=r, host=host if r < 2 else culprit_host, pid=100 + r) for r in range(4)],
        analyzed_at=stamp,
        job=job,
        host=host,
        hang_started_at=stamp,
        detected_at=stamp,
        incident_key=f"{job}/0|{verdict}",
    )


def bundle_bytes(report: Report, *, padding: int = 0, extra: dict[str, bytes] | None = None) -> tuple[str, bytes]:
    """(bundle id, the tar.gz) for ``report``; ``padding`` bytes of incompressible evidence make a big one."""
    at = dt.datetime.fromisoformat(report.detected_at or report.analyzed_at).timestamp()
    name = bundle_name(report.job or "job", report.host or "host", at, str(report.verdict))
    files = {"report.json": report.model_dump_json(indent=2).encode(), "report.md": report_markdown(report).encode()}
    if padding:
        files["nccl/rank0.log"] = os.urandom(padding)
    files.update(extra or {})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        folder = tarfile.TarInfo(name)
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for inner, data in files.items():
            member = tarfile.TarInfo(f"{name}/{inner}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return name, buffer.getvalue()


def write_bundle_file(folder: Path, report: Report, **kw) -> Path:  # type: ignore[no-untyped-def]
    name, data = bundle_bytes(report, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.tar.gz"
    path.write_bytes(data)
    return path
