"""A live bundle's citations name the bundle's own files (``nccl/vm.714:812``, ``fr/<dump> entries[66]``), not the
sidecar's run folder, which is gone when the job ends; a log's copy is its tail, so a line counts from the copy's
first line.  Real NCCL debug files of a real hang (``tests/fixtures/nccl-2.28.9-2gpu/mismatch``)."""

from __future__ import annotations

import asyncio
import re
import shutil
import tarfile
from pathlib import Path

from conftest import NOW, shared

from ncclwatch.watchdog.evidence.base import EvidenceContext
from ncclwatch.watchdog.evidence.logs import collect_nccl_logs
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.report import Report, build_report
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.inputs import ingest_file
from ncclwatch.watchdog.live.bundle import write_bundle

LOGS = shared("nccl-2.28.9-2gpu", "mismatch", "nccl")
CITE = re.compile(r"(?P<path>[^: ]+)(?::(?P<line>\d+))?(?P<rest>.*)$")


def _bundle(tmp_path: Path, tail_bytes: int) -> tuple[Report, dict[str, bytes]]:
    """The live bundle of the mismatch hang, its sidecar's NCCL files cut to their last ``tail_bytes``."""
    run_dir = tmp_path / "run"
    shutil.copytree(LOGS, run_dir / "nccl")
    state = JobState()
    for path in sorted((run_dir / "nccl").iterdir()):
        ingest_file(state, str(path))
    state.finish()
    snapshot = take_snapshot(state, observed_at=NOW)
    finding = classify(snapshot).finding
    assert finding.verdict is Verdict.collective_mismatch
    report = build_report(finding, snapshot, inputs=[], cited={})

    async def collect(folder: Path) -> list:  # type: ignore[type-arg]
        context = EvidenceContext(out_dir=folder, run_dir=run_dir, ranks=(), pyspy=None, tail_bytes=tail_bytes)
        return await collect_nccl_logs(context)

    staging = tmp_path / "bundles" / ".job-vm-x-collective_mismatch"
    staging.mkdir(parents=True)
    bundle, report = asyncio.run(write_bundle(report, finding, staging, tmp_path / "bundles", collect))
    with tarfile.open(bundle) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    assert Report.model_validate_json(members["report.json"]).evidence == report.evidence
    return report, members


def test_cited_lines_are_found_at_their_number_in_the_bundles_tail_of_the_log(tmp_path: Path) -> None:
    report, members = _bundle(tmp_path, tail_bytes=24_000)
    cited = [item for item in report.evidence if item.cite and ":" in item.cite]
    assert len(cited) >= 2
    for item in cited:
        found = CITE.match(item.cite or "")
        assert found and found["path"].startswith("nccl/") and found["path"] in members, item.cite
        lines = members[found["path"]].decode().splitlines()
        assert len(lines) < len((LOGS / Path(found["path"]).name).read_text().splitlines())  # a tail: lines cut
        assert item.text and lines[int(found["line"]) - 1].startswith(item.text[:200]), item.cite
    assert str(tmp_path) not in members["report.json"].decode() + members["report.md"].decode()


def test_a_line_older_than_the_tail_is_cited_by_the_bundles_file_and_its_number_in_the_whole_file(
    tmp_path: Path,
) -> None:
    report, members = _bundle(tmp_path, tail_bytes=300)
    cited = [item for item in report.evidence if item.cite and item.cite.startswith("nccl/")]
    assert cited
    for item in cited:
        found = re.fullmatch(r"(nccl/\S+) \(line (\d+) of the whole file, older than the tail kept\)", item.cite or "")
        assert found and found[1] in members, item.cite
        whole = (LOGS / Path(found[1]).name).read_text().splitlines()
        assert item.text and whole[int(found[2]) - 1].startswith(item.text[:200])
