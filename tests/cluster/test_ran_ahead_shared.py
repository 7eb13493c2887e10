"""The evidence a node shares keeps the op each GPU is running, so the leader tells a rank that ran ahead from the
ranks waiting for it (real H200 bundles: tests/fixtures/bundles/nccl-2.28.9-h200-pp-dp-skip-ran-ahead, paged live as
``rank_behind [0, 1, 2]``)."""

from __future__ import annotations

import tarfile

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.classify import judge
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

BUNDLES = FIXTURES / "bundles" / "nccl-2.28.9-h200-pp-dp-skip-ran-ahead"


def node_events(node: int) -> list[Event]:
    """A node's Flight Recorder dumps and NCCL logs, as its sidecar read them."""
    (bundle,) = BUNDLES.glob(f"node{node}-*.tar.gz")
    events: list[Event] = []
    with tarfile.open(bundle) as archive:
        for member in archive.getmembers():
            name = member.name.partition("/")[2]
            if name.startswith("fr/nccl_trace_rank_"):
                events += parse_flight_recorder(archive.extractfile(member).read(), name)  # type: ignore[union-attr]
            elif name.startswith("nccl/"):
                parser = NcclLogParser(name.removeprefix("nccl/"))
                events += parser.feed(archive.extractfile(member).read(), final=True)  # type: ignore[union-attr]
    return events


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
    finding = judge(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits, finding.position) == (Verdict.rank_behind, (3,), 201), finding.summary
    assert "ran ahead" in finding.summary
