"""A rank whose GPU never started a collective because it waits in another NCCL operation is held, not hung: the
rank its GPU waits for is named (real 4 x H200 FSDP2 x TP bundles:
tests/fixtures/bundles/nccl-2.28.9-h200x4-fsdp2-tp-gpu-hang, paged ``gpu_compute_hang [1]`` before).  Its GPU spins on
almost none of its SMs with no NCCL operation running: the ``spin`` kind, which proves the hang sooner."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES
from support import bundle_events

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = sorted((FIXTURES / "bundles" / "nccl-2.28.9-h200x4-fsdp2-tp-gpu-hang").glob("*.tar.gz"))


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.name.rsplit("-", 2)[1])
def test_the_gpu_at_the_end_of_the_waits_is_named(bundle) -> None:  # type: ignore[no-untyped-def]
    report = analyze_paths([str(bundle)])
    assert (report.verdict, report.culprit_ranks) == (Verdict.gpu_compute_hang, [3]), report.summary
    assert "rank 1's GPU waits for rank 3 in AllGather" in report.summary
    rows = {row.rank: row.status for row in report.ranks}
    assert rows[3] == "stuck" and rows[1] == "waiting", rows
    assert report.kind == "spin" and "it spins on almost none of the GPU's SMs" in report.headline


def edited(bundle: Path, tmp_path: Path, edit: Callable[[dict], None]) -> Path:  # type: ignore[type-arg]
    """The bundle unpacked, ``edit`` applied to each GPU sample it holds (its NVML file and its journal's)."""
    with tarfile.open(bundle) as archive:  # by hand: extractall's filter= is not in every Python 3.11
        for member in archive.getmembers():
            if member.isfile():
                (tmp_path / member.name).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / member.name).write_bytes(archive.extractfile(member).read())  # type: ignore[union-attr]
    (folder,) = tmp_path.iterdir()
    nvml = folder / "gpu" / "nvml.json"
    doc = json.loads(nvml.read_text())
    edit(doc)
    nvml.write_text(json.dumps(doc))
    journal = folder / "journal.jsonl"
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    for event in events:
        if event.get("event") == "GpuSnapshot":
            edit(event)
    journal.write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def computing(doc: dict) -> None:  # type: ignore[type-arg]
    """Rank 3's GPU fills its SMs and moves memory: a long compute kernel."""
    busy = {"sm_util_pct": 85.0, "sm_occupancy_pct": 40.0, "dram_bw_util_pct": 30.0, "any_tensor_util_pct": 60.0}
    for gpu in doc["gpus"]:
        if gpu["index"] == 3:
            gpu["gpm"] = busy


def before_the_silence(doc: dict) -> None:  # type: ignore[type-arg]
    """Sampled a minute earlier: the NVML source's sample may show the GPU before the job fell silent."""
    doc["time"] -= 60


@pytest.mark.parametrize("edit", [computing, before_the_silence], ids=lambda f: f.__name__)
def test_no_spin_from_a_gpu_busy_on_its_sms_or_a_sample_before_the_silence(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    report = analyze_paths([str(edited(BUNDLES[0], tmp_path, edit))])
    assert (report.verdict, report.culprit_ranks, report.kind) == (Verdict.gpu_compute_hang, [3], None), report.summary


@pytest.mark.parametrize("shared", ["compact", "full"])
def test_the_leader_follows_the_waits_in_what_the_node_shares(shared: str) -> None:
    """Flight Recorder's states alone, packed by the node and unpacked by the leader (no NVML there)."""
    payload = unpack(pack(0, shared, 0.0, bundle_events(BUNDLES[0])), "node 0")  # type: ignore[arg-type]
    assert payload is not None
    state = JobState()
    for event in payload.events:
        state.apply(event)
    finding = classify(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits) == (Verdict.gpu_compute_hang, (3,)), finding.summary


def test_two_bundles_were_given() -> None:
    assert len(BUNDLES) == 2
