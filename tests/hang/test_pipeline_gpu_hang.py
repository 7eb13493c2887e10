"""A pipeline rank whose GPU is held by its own kernel before its next send (real 2 x H200 bundles, GPipe and 1F1B:
tests/fixtures/bundles/nccl-2.28.9-h200x2-pipeline-gpu-hang), paged as stuck with no culprit before."""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = sorted((FIXTURES / "bundles" / "nccl-2.28.9-h200x2-pipeline-gpu-hang").glob("*.tar.gz"))


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.name.split("_gpu_hang")[0])
def test_the_rank_whose_gpu_started_none_of_its_nccl_work_is_named(bundle) -> None:  # type: ignore[no-untyped-def]
    report = analyze_paths([str(bundle)])
    assert (report.verdict, report.culprit_ranks) == (Verdict.gpu_compute_hang, [1]), report.summary
    assert "Rank 1's GPU runs none of the NCCL operations its host enqueued" in report.summary
    assert report.kind == "spin"  # NVML: one block busy on rank 1's GPU, and no NCCL operation running there


def test_two_pipeline_bundles_were_given() -> None:
    assert len(BUNDLES) == 2
