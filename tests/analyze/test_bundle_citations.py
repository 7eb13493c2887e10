"""``analyze`` of a bundle cites the bundle's own paths (``<bundle name>/<path inside>``), never the temporary
folder it was unpacked into (gone when ``analyze`` ends)."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest
from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths

BUNDLES = [
    shared("bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"),
    shared(
        "bundles",
        "nccl-2.28.9-h100-pipeline-missing-send",
        "pipeline_missing_send-vm-20261124T221715Z-node_lost.tar.gz",
    ),
    *sorted(shared("bundles", "demo-cpu-two-jobs").glob("*.tar.gz"))[:1],
]
CITE = re.compile(r"(?P<path>.+?)(?::(?P<line>\d+))?(?: entries\[\d+\])?$")


def _members(bundle: Path) -> dict[str, bytes]:
    with tarfile.open(bundle) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.name.split("-")[0])
def test_every_citation_and_input_of_a_bundle_is_a_path_inside_it(bundle: Path) -> None:
    report = analyze_paths([str(bundle)])
    members = _members(bundle)
    assert "ncclwatch-analyze-" not in report.model_dump_json()
    assert {item.path for item in report.inputs} == set(members)
    cites = [item for item in report.evidence if item.cite]
    assert cites
    for item in cites:
        found = CITE.match(item.cite or "")
        assert found and found["path"] in members, item.cite
        if found["line"] and item.text:
            line = members[found["path"]].decode(errors="replace").splitlines()[int(found["line"]) - 1]
            assert item.text[:200] in line, (item.cite, item.text, line)
