"""Bundles uploaded to the cluster server: checked, stored, indexed; and retention.

An upload is ``POST /api/upload`` with the bundle (tar.gz) as the body and ``Authorization: Bearer <upload
token>``: a token that may upload and nothing else (the read token cannot upload, the upload token cannot
read).  ``X-Ncclwatch-Incident`` carries the incident key (the alert's dedup key: the same on every node of
the job); without it the key is derived from the report as the alert derives it.  ``X-Ncclwatch-Slurm-Job``
tells jobs of one name apart.

Checked before anything is stored (``check_archive``), on a copy in ``<bundle_dir>/.incoming/`` that no
listing shows: the size (``Content-Length`` first, then the bytes as they come), the gzip stream whole and
under ``UNPACKED_MAX_BYTES`` unpacked, a tar of regular files and folders only (no links, devices or FIFOs),
every member under one top folder named like a bundle (``<job>-<host>-<time>-<verdict>``, ``app.ID_RE``),
no absolute name and no ``..``, at most ``FILES_MAX`` members, and ``<top>/report.json`` a JSON object with
a verdict.  Nothing is unpacked and nothing from a bundle is run.  A refusal is ``Refused`` (HTTP status,
a sentence saying what was wrong); the copy is removed.

Idempotent: the bundle's file name is its top folder, so the same node's bundle uploaded again replaces its
part (a retry, or the bundle amended with what was done); other nodes' bundles of the same hang join the
incident as more parts.

Retention (``prune``): parts older than ``max_age_s`` go, then the oldest until the total fits ``max_bytes``;
each file is removed with its index rows.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import hmac
import json
import logging
import os
import re
import tarfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from ncclwatch.watchdog.server.app import FILES_MAX, ID_RE, REPORT_MAX_BYTES, SUFFIX
from ncclwatch.watchdog.server.incidents import IncidentIndex, Part, Recorded
from ncclwatch.watchdog.server.view import report_view
from ncclwatch.watchdog.sinks.alert import dedup_key_for

log = logging.getLogger("ncclwatch.server")

UNPACKED_MAX_BYTES = 4 << 30  # a bundle is tails and dumps; a gzip that unpacks past this is a bomb, not a bundle
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,160}")  # the alert's dedup key (delivery.py's spool names need the same)
SLURM_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
INCOMING = ".incoming"
_READ = 1 << 20


class Refused(Exception):
    """An upload not stored: ``status`` (400, 401, 413, 429) and what was wrong, for the uploader."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


def check_archive(path: Path) -> tuple[str, dict[str, Any]]:
    """The bundle id (its top folder) and its report.json; raises ``Refused(400, why)``."""
    _check_gzip(path)
    top: str | None = None
    report: dict[str, Any] | None = None
    count = 0
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                count += 1
                if count > FILES_MAX:
                    raise Refused(400, f"not a bundle: more than {FILES_MAX} members")
                parts = _member_parts(member)
                top = top or parts[0]
                if parts[0] != top:
                    raise Refused(400, f"not a bundle: members under {top!r} and {parts[0]!r} (one top folder)")
                if parts[1:] == ("report.json",):
                    report = _report(tar, member)
    except tarfile.TarError as exc:
        raise Refused(400, f"not a bundle: not a tar archive ({exc})") from None
    if top is None:
        raise Refused(400, "not a bundle: the archive is empty")
    if not ID_RE.fullmatch(top) or top.endswith(".partial"):
        raise Refused(400, f"not a bundle: top folder {top!r} is not a bundle name ([A-Za-z0-9][A-Za-z0-9_.-]*)")
    if report is None:
        raise Refused(400, f"not a bundle: no {top}/report.json")
    return top, report


def _check_gzip(path: Path) -> None:
    """The whole stream decompresses (CRC checked at its end) to under ``UNPACKED_MAX_BYTES``."""
    total = 0
    try:
        with gzip.open(path, "rb") as stream:
            while chunk := stream.read(_READ):
                total += len(chunk)
                if total > UNPACKED_MAX_BYTES:
                    raise Refused(413, f"not stored: unpacks to over {UNPACKED_MAX_BYTES >> 30} GiB")
    except (OSError, EOFError, zlib.error) as exc:
        raise Refused(400, f"not a bundle: not a whole gzip stream ({exc})") from None


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    kind = (
        "a symbolic link"
        if member.issym()
        else "a hard link"
        if member.islnk()
        else None
        if member.isfile() or member.isdir()
        else "a device, FIFO or other special file"
    )
    if kind is not None:
        raise Refused(400, f"not a bundle: member {member.name!r} is {kind}")
    name = PurePosixPath(member.name)
    parts = tuple(p for p in name.parts if p != ".")
    if name.is_absolute() or ".." in parts or not parts or "\\" in member.name:
        raise Refused(400, f"not a bundle: member {member.name!r} names a path outside the bundle")
    return parts


def _report(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict[str, Any]:
    if not member.isfile() or member.size > REPORT_MAX_BYTES:
        raise Refused(400, f"not a bundle: report.json is not a regular file under {REPORT_MAX_BYTES >> 20} MiB")
    stream = tar.extractfile(member)
    try:
        report = json.loads(stream.read()) if stream is not None else None
    except ValueError as exc:
        raise Refused(400, f"not a bundle: report.json is not JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("verdict"), str):
        raise Refused(400, "not a bundle: report.json is not an ncclwatch report (no verdict)")
    return report


@dataclasses.dataclass
class RateLimit:
    """A token bucket per upload token: ``per_minute`` uploads, as a burst or spread out."""

    per_minute: float
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def take(self, who: int) -> float | None:
        """None: allowed (one taken); else the seconds until one is free."""
        now = self.clock()
        level, then = self._buckets.get(who, (self.per_minute, now))
        level = min(self.per_minute, level + (now - then) * self.per_minute / 60.0)
        if level < 1.0:
            self._buckets[who] = (level, now)
            return (1.0 - level) * 60.0 / self.per_minute
        self._buckets[who] = (level - 1.0, now)
        return None


def which_token(given: str, tokens: Sequence[str]) -> int | None:
    """The index of the upload token ``given`` is, compared in constant time against every one; None: none."""
    found = None
    for i, token in enumerate(tokens):
        if hmac.compare_digest(given.encode(), token.encode()) and found is None:
            found = i
    return found


@dataclasses.dataclass
class Intake:
    """Where uploads go: the bundle folder, the index, the limits."""

    bundle_dir: Path
    index: IncidentIndex
    tokens: Sequence[str]
    max_bytes: int
    rate: RateLimit
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def incoming(self) -> Path:
        folder = self.bundle_dir / INCOMING
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def store(self, upload: Path, incident_key: str | None, slurm_job: str | None) -> tuple[Recorded, str, bool]:
        """Check ``upload`` (a file in ``incoming()``), move it into the folder, index it; blocking.

        Returns (what was recorded, the bundle id, whether the bytes were new).  Raises ``Refused``; ``upload``
        is gone either way.
        """
        try:
            bundle_id, raw = check_archive(upload)
            report = report_view(raw)
            key = incident_key or dedup_key_for(
                report.get("job") or "unknown-job",
                report.get("incident_key") or report.get("hang_started_at"),
                slurm_job,
            )
            digest = _sha256(upload)
            final = self.bundle_dir / (bundle_id + SUFFIX)
            with self.lock:  # one node's retries in parallel: one file, one part
                same = final.is_file() and _sha256(final) == digest
                if not same:
                    os.replace(upload, final)
                size = final.stat().st_size
                recorded = self.index.record(Part(bundle_id, key, report, size, digest, slurm_job))
            return recorded, bundle_id, not same
        finally:
            upload.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_READ):
            digest.update(chunk)
    return digest.hexdigest()


def prune(bundle_dir: Path, index: IncidentIndex, *, max_age_s: float, max_bytes: int, now: float) -> list[str]:
    """Remove uploaded bundles past ``max_age_s``, then the oldest until ``max_bytes``; blocking.  Their ids."""
    parts = index.parts_by_age()
    total = sum(size for _, _, size in parts)
    removed: list[str] = []
    for bundle_id, received_at, size in parts:
        if now - received_at <= max_age_s and total <= max_bytes:
            break
        try:
            (bundle_dir / (bundle_id + SUFFIX)).unlink(missing_ok=True)
        except OSError as exc:  # kept, and said: its rows stay with it
            log.error("retention: cannot remove %s: %s", bundle_id, exc)
            continue
        index.remove_part(bundle_id)
        total -= size
        removed.append(bundle_id)
    return removed
