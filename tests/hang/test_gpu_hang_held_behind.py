"""A rank whose GPU never started a collective because it waits in another NCCL operation is held, not hung: the
rank its GPU waits for is named (real 4 x H200 FSDP2 x TP bundles:
tests/fixtures/bundles/nccl-2.28.9-h200x4-fsdp2-tp-gpu-hang, paged ``gpu_compute_hang [1]`` before)."""

from __future__ import annotations

import pytest
from conftest import FIXTURES
from support import bundle_events

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.hang.classify import judge
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


@pytest.mark.parametrize("shared", ["compact", "full"])
def test_the_leader_follows_the_waits_in_what_the_node_shares(shared: str) -> None:
    """Flight Recorder's states alone, packed by the node and unpacked by the leader (no NVML there)."""
    payload = unpack(pack(0, shared, 0.0, bundle_events(BUNDLES[0])), "node 0")  # type: ignore[arg-type]
    assert payload is not None
    state = JobState()
    for event in payload.events:
        state.apply(event)
    finding = judge(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits) == (Verdict.gpu_compute_hang, (3,)), finding.summary


def test_two_bundles_were_given() -> None:
    assert len(BUNDLES) == 2
