"""``ncclwatch analyze`` on a bundle: the journal read as a journal.

The real bundles are the two the live sidecar wrote on an H100 (tests/fixtures/bundles); their journals
carry NVML samples, which once made the journal sniff as a broken NVML snapshot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import Citation, GpuSample, GpuSnapshot
from ncclwatch.watchdog.hang.report import InputFile
from ncclwatch.watchdog.parsing import sniff
from ncclwatch.watchdog.parsing.journal import HEADER, journal_line

BUNDLES = (
    shared("bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"),
    shared(
        "bundles", "nccl-2.28.9-h100-pipeline-missing-send", "pipeline_missing_send-vm-20261124T221715Z-node_lost.tar.gz"
    ),
)


def input_named(inputs: list[InputFile], name: str) -> InputFile:
    return next(item for item in inputs if Path(item.path).name == name)


def test_a_journal_carrying_gpu_samples_sniffs_as_a_journal() -> None:
    sample = GpuSnapshot(time=1.0, gpus=[GpuSample(index=0, util_gpu_pct=100.0)], cite=Citation(file="nvml"))
    head = HEADER + b"\n" + journal_line(sample).encode() + b"\n"
    assert [fmt.name for fmt in sniff(head)] == ["journal"]


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda path: path.parent.name)
def test_a_bundles_journal_is_read_as_a_journal_not_as_an_unusable_nvml_snapshot(bundle: Path) -> None:
    report = analyze_paths([str(bundle)])
    assert input_named(report.inputs, "journal.jsonl").kinds == ["journal"]
    assert not [note for note in report.notes if "NVML snapshot" in note]
