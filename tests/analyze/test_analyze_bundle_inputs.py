"""``ncclwatch analyze`` on a bundle: the journal read as a journal, ncclwatch's own output skipped and said.

The real bundles are the two the live sidecar wrote on an H100 (tests/fixtures/bundles); their journals
carry NVML samples, which once made the journal sniff as a broken NVML snapshot, and their report.md
quotes NCCL lines, which once counted as operations of the job.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import Citation, GpuSample, GpuSnapshot
from ncclwatch.watchdog.hang.report import InputFile
from ncclwatch.watchdog.live.bundle import report_files
from ncclwatch.watchdog.parsing import sniff
from ncclwatch.watchdog.parsing.journal import HEADER, journal_line

BUNDLES = (
    shared("bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"),
    shared(
        "bundles",
        "nccl-2.28.9-h100-pipeline-missing-send",
        "pipeline_missing_send-vm-20261124T221715Z-node_lost.tar.gz",
    ),
)
OWN_OUTPUT = ("report.json", "report.md", "evidence.json")


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


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda path: path.parent.name)
def test_a_bundles_own_report_and_evidence_index_are_skipped_and_said(bundle: Path) -> None:
    report = analyze_paths([str(bundle)])
    for name in OWN_OUTPUT:
        entry = input_named(report.inputs, name)
        assert entry.kinds == [] and entry.note and entry.note.startswith("skipped: ncclwatch's own"), (name, entry)
    assert len([item for item in report.inputs if item.note and "ncclwatch's own" in item.note]) == len(OWN_OUTPUT)


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda path: path.parent.name)
def test_a_bundles_env_and_proc_records_are_named_for_what_they_are(bundle: Path) -> None:
    """Not "training output, tracebacks" (issue 46): the lines of env/rankN.txt and proc/rankN.txt are the rank's
    environment and /proc state as the bundle keeps them."""
    report = analyze_paths([str(bundle)])
    records = {f"{Path(i.path).parent.name}/": i.note or "" for i in report.inputs if "/rank" in i.path[-12:]}
    said = {folder: note for folder, note in records.items() if folder in ("env/", "proc/")}
    assert said and all("training output" not in note for note in said.values()), said
    assert all(("environment" if folder == "env/" else "/proc state") in note for folder, note in said.items())


def test_a_report_given_alone_says_it_is_ncclwatchs_own_and_adds_nothing(tmp_path: Path) -> None:
    """Also the report as the writer makes it now, not only as the fixture bundles froze it."""
    with tarfile.open(BUNDLES[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
        (tmp_path / "kept-report.json").write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    for name, text in report_files(analyze_paths([str(BUNDLES[0])])).items():
        (tmp_path / f"fresh-{name}").write_text(text)
    given = sorted(str(path) for path in tmp_path.iterdir())
    report = analyze_paths(given)
    assert [item.path for item in report.inputs] == given
    for item in report.inputs:
        assert item.kinds == [] and item.note and "ncclwatch's own report, not evidence" in item.note, item
    assert report.verdict.value == "inconclusive"


def test_json_that_is_not_ncclwatchs_report_is_still_read(tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    nvml.write_text('{"tool": "nvidia-smi", "time": 1.0, "gpus": [{"index": 0, "util_gpu_pct": 100.0}]}')
    assert analyze_paths([str(nvml)]).inputs[0].kinds == ["nvml"]
