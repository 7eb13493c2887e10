"""NVML snapshots in ncclwatch's own JSON format -> ``GpuSnapshot`` events.

The format is written by the sidecar and by ``tools/capture``: one object
``{"time": unix, "gpus": [...]}`` or a list of them.  A malformed snapshot
is reported as unusable; the others in the same file are kept.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from ncclwatch.watchdog.events import Citation, Event, GpuSample, GpuSnapshot, Unusable


def looks_like_nvml(head: bytes) -> bool:
    return b'"gpus"' in head and b'"util_gpu_pct"' in head


def parse_nvml(data: bytes, name: str) -> list[Event]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return [Unusable(reason=f"NVML snapshot is not valid JSON ({exc})", cite=Citation(file=name))]
    snapshots = doc if isinstance(doc, list) else [doc]
    return [snapshot_from_doc(snap, Citation(file=name, entry=f"[{index}]")) for index, snap in enumerate(snapshots)]


def snapshot_from_doc(snap: object, cite: Citation) -> Event:
    """One decoded snapshot (the sidecar's live sample, or one from a file) -> ``GpuSnapshot`` or ``Unusable``."""
    try:
        gpus = [GpuSample.model_validate(g) for g in snap["gpus"]]  # type: ignore[index]
        return GpuSnapshot(time=float(snap["time"]), gpus=gpus, cite=cite)  # type: ignore[index]
    except (KeyError, TypeError, ValueError, ValidationError) as exc:
        return Unusable(reason=f"malformed NVML snapshot: {exc}", cite=cite)
