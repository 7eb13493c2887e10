"""The alert: what every sink sends, built once from a report so all sinks say the same thing.

One hang is one incident everywhere: ``dedup_key_for`` derives the key from
the job and the moment the hang began, never from the host, so that when
several nodes' sidecars report the same hang they page once (PagerDuty folds
triggers with one ``dedup_key`` into one alert; the dispatcher drops repeats).

Failure mode guarded here: a summary longer than PagerDuty's 1024 characters
gets the whole event rejected with a 400, which is never retried; so the
summary is truncated by the model itself, whatever built it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, field_validator

if TYPE_CHECKING:  # the report pulls in the whole engine; an alert needs only its fields
    from ncclwatch.watchdog.hang.report import Report
    from ncclwatch.watchdog.slowness.findings import PerfFinding

SUMMARY_MAX = 1024  # PagerDuty's limit on payload.summary
JOB_IN_KEY_MAX = 64  # keeps the key under PagerDuty's 255 characters with room to spare
_UNSAFE = re.compile(r"[^A-Za-z0-9_]+")


class Alert(BaseModel):
    model_config = ConfigDict(frozen=True)

    action: Literal["trigger", "resolve"]
    dedup_key: str
    problem: Literal["hang", "performance"] = "hang"  # performance: slow, a straggler, a transport or port finding
    job: str
    host: str
    verdict: str | None = None
    culprit_ranks: list[int] = []
    suspect_ranks: list[int] = []  # an even split no evidence decides: one side is wrong (culprit_ranks empty)
    communicator: str | None = None
    operation: str | None = None
    position: int | None = None
    summary: str
    reason: str = ""
    bundle_id: str | None = None
    bundle_url: str | None = None
    incident_url: str | None = None  # the incident on the cluster's ncclwatch serve (--upload)
    detected_at: str | None = None
    slurm_job_id: str | None = None
    created_at: float
    report: dict | None = None  # the full report JSON, for the generic webhook

    @field_validator("summary")
    @classmethod
    def _fit(cls, value: str) -> str:
        return value if len(value) <= SUMMARY_MAX else value[: SUMMARY_MAX - 1] + "…"


def _slug(value: str) -> str:
    return _UNSAFE.sub("_", value).strip("_") or "x"


def _instant(value: str) -> str:
    """One spelling per instant, so "…+00:00" and "…Z" from two writers give one key."""
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(dt.UTC)
    return parsed.isoformat(timespec="milliseconds")


def dedup_key_for(job: str, hang_started_at: str | None, slurm_job_id: str | None) -> str:
    """``ncclwatch-hang-<job>[-slurm<id>]-<12 hex>``: same job and hang, same key; no host.

    The readable part is for people scanning PagerDuty; the digest covers the
    exact inputs, so two jobs whose names slug alike still get two keys.
    ``[A-Za-z0-9_-]`` only: the dispatcher uses the key in spool file names.
    """
    started = _instant(hang_started_at) if hang_started_at else ""
    digest = hashlib.sha256(f"{job}\0{slurm_job_id or ''}\0{started}".encode()).hexdigest()[:12]
    slurm = f"-slurm{_slug(slurm_job_id)}" if slurm_job_id else ""
    return f"ncclwatch-hang-{_slug(job)[:JOB_IN_KEY_MAX]}{slurm}-{digest}"


def _headline(verdict: str, culprits: list[int], job: str, host: str, suspects: list[int] | None = None) -> str:
    if not culprits and suspects:
        return f"ncclwatch: {verdict} in {job} on {host}, suspects rank {', '.join(map(str, suspects))}"
    if not culprits:
        who = ""
    elif len(culprits) == 1:
        who = f"rank {culprits[0]} "
    else:
        who = f"ranks {', '.join(map(str, culprits))} "
    return f"ncclwatch: {who}{verdict} in {job} on {host}"


def incident_url(server: str, dedup_key: str) -> str:
    """The incident's page on the cluster's ``ncclwatch serve`` (``--upload``): where the page links to."""
    return f"{server.rstrip('/')}/incidents/{dedup_key}"


def trigger_from_report(
    report: Report,
    *,
    bundle_id: str | None,
    bundle_url: str | None,
    upload_server: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Alert:
    """The page for a verdict; labelled with ``SLURM_JOB_ID`` when the job runs under Slurm; linking the
    incident on ``upload_server`` (the cluster's ``ncclwatch serve``) when bundles are uploaded there."""
    job = report.job or "unknown-job"  # ``ncclwatch analyze`` reports carry no job
    host = report.host or platform.node()
    slurm_job_id = environ.get("SLURM_JOB_ID") or None
    verdict = str(report.verdict)
    dedup_key = dedup_key_for(job, report.incident_key or report.hang_started_at, slurm_job_id)
    return Alert(
        action="trigger",
        dedup_key=dedup_key,
        incident_url=incident_url(upload_server, dedup_key) if upload_server else None,
        job=job,
        host=host,
        verdict=verdict,
        culprit_ranks=list(report.culprit_ranks),
        suspect_ranks=list(report.suspect_ranks),
        communicator=report.communicator,
        operation=report.operation,
        position=report.position,
        # What is done about it comes before the summary, which may be cut to fit.
        summary=f"{_headline(verdict, report.culprit_ranks, job, host, report.suspect_ranks)}"
        + (f" ({report.response})" if report.response else "")
        + f": {report.summary}",
        reason=report.reason,
        bundle_id=bundle_id,
        bundle_url=bundle_url,
        detected_at=report.detected_at,
        slurm_job_id=slurm_job_id,
        created_at=time.time(),
        report=report.model_dump(mode="json"),
    )


def perf_dedup_key(job: str, finding_key: str, run_started_at: float, slurm_job_id: str | None) -> str:
    """``ncclwatch-perf-<job>[-slurm<id>]-<finding key>-<12 hex>``: one page per problem per run of the job.

    The finding's key is stable across looks; the run's start keeps next
    week's run of the same job from being folded into this one (the spool
    remembers keys it sent), and the digest tells apart keys that slug alike.
    """
    digest = hashlib.sha256(f"{job}\0{slurm_job_id or ''}\0{run_started_at:.3f}\0{finding_key}".encode()).hexdigest()[
        :12
    ]
    slurm = f"-slurm{_slug(slurm_job_id)}" if slurm_job_id else ""
    return f"ncclwatch-perf-{_slug(job)[:JOB_IN_KEY_MAX]}{slurm}-{_slug(finding_key)[:JOB_IN_KEY_MAX]}-{digest}"


def trigger_from_finding(
    finding: PerfFinding, *, job: str, host: str, run_started_at: float, environ: Mapping[str, str] = os.environ
) -> Alert:
    """The page for a slow, straggler, transport or port finding (only where the operator asked for it).

    ``verdict`` is the finding's kind, never a hang verdict: receivers that
    route on it tell a slow job from a hung one.
    """
    slurm_job_id = environ.get("SLURM_JOB_ID") or None
    return Alert(
        action="trigger",
        dedup_key=perf_dedup_key(job, finding.key, run_started_at, slurm_job_id),
        problem="performance",
        job=job,
        host=host,
        verdict=finding.kind.value,
        culprit_ranks=list(finding.ranks),
        communicator=finding.communicator,
        summary=f"ncclwatch: {finding.kind.value} in {job} on {host}: {finding.summary}",
        reason=finding.detail,
        slurm_job_id=slurm_job_id,
        created_at=time.time(),
        report=finding.to_dict(),
    )


def resolve_for(trigger: Alert, why: str) -> Alert:
    """Close the incident ``trigger`` opened (same key); the full report stays with the trigger."""
    # model_validate, not model_copy: the copy would skip the summary's truncation.
    return Alert.model_validate(
        trigger.model_dump()
        | {
            "action": "resolve",
            "summary": f"ncclwatch: resolved in {trigger.job} on {trigger.host}: {why}",
            "reason": why,
            "created_at": time.time(),
            "report": None,
        }
    )
