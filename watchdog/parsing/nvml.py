"""NVML snapshots in ncclwatch's own JSON format -> ``GpuSnapshot`` events.

The format is written by the sidecar and by ``tools/capture``: one object
``{"time": unix, "gpus": [...]}`` or a list of them.  A malformed snapshot
is reported as unusable; the others in the same file are kept.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from ..types import Citation, Event, GpuSample, GpuSnapshot, Unusable


def looks_like_nvml(head: bytes) -> bool:
    return b'"gpus"' in head and b'"util_gpu_pct"' in head


def parse_nvml(data: bytes, name: str) -> list[Event]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return [Unusable(reason=f"NVML snapshot is not valid JSON ({exc})", cite=Citation(file=name))]
    snapshots = doc if isinstance(doc, list) else [doc]
    events: list[Event] = []
    for index, snap in enumerate(snapshots):
        cite = Citation(file=name, entry=f"[{index}]")
        try:
            gpus = [GpuSample.model_validate(g) for g in snap["gpus"]]
            events.append(GpuSnapshot(time=float(snap["time"]), gpus=gpus, cite=cite))
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            events.append(Unusable(reason=f"malformed NVML snapshot: {exc}", cite=cite))
    return events
