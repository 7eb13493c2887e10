"""The evidence a node shares keeps the op each GPU is running, so the leader tells a rank that ran ahead from the
ranks waiting for it (real H200 bundles: tests/fixtures/bundles/nccl-2.28.9-h200-pp-dp-skip-ran-ahead, paged live as
``rank_behind [0, 1, 2]``)."""

from __future__ import annotations

import pytest
from conftest import FIXTURES
from support import bundle_events

from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict

BUNDLES = FIXTURES / "bundles" / "nccl-2.28.9-h200-pp-dp-skip-ran-ahead"


def node_events(node: int) -> list[Event]:
    (bundle,) = BUNDLES.glob(f"node{node}-*.tar.gz")
    return bundle_events(bundle)


@pytest.mark.parametrize("shared", [None, "compact", "full"])
def test_the_leader_names_the_rank_that_ran_ahead(shared: str | None) -> None:
    state = JobState()
    for node in (0, 1):
        events = node_events(node)
        if shared is not None:  # through the store: packed by its node, unpacked by the leader
            payload = unpack(pack(node, shared, 0.0, events), f"node {node}")  # type: ignore[arg-type]
            assert payload is not None
            events = payload.events
        for event in events:
            state.apply(event)
    finding = classify(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (3,), 201), finding.summary
    assert "ran ahead" in finding.summary
