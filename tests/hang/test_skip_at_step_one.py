"""A collective skipped at step 1 on two ranks: one step of history names the rank that skipped it where that step
shows the order (``step_pattern.skipped_one``), and nothing is named where it does not.  Real bundles:
tests/fixtures/bundles/gloo-2.13-cpu-two-wrappers-skip-at-step-1."""

from __future__ import annotations

import tarfile

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.cluster.payload import pack, unpack
from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.step_pattern import skipped_one
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

BUNDLES = FIXTURES / "bundles" / "gloo-2.13-cpu-two-wrappers-skip-at-step-1"


def test_the_rank_that_skipped_at_step_one_is_named_from_step_zero() -> None:
    report = analyze_paths([str(p) for p in sorted(BUNDLES.glob("*.tar.gz"))])
    assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [0]), report.summary
    assert "followed by AllReduce count=128 BFloat16 at gpu_job.py:210 and then Broadcast" in report.reason


def test_the_order_decides_only_where_every_time_before_agrees() -> None:
    # W, K, Y once: the side at Y skipped K
    assert skipped_one(["a", "W", "K", "Y", "b", "W"], ["K", "Y"]) == "K"
    assert skipped_one(["a", "W", "K", "Y", "b", "W"], ["Y", "K"]) == "K"
    # W was followed by K once and by Y once: nothing decides
    assert skipped_one(["W", "K", "Y", "W", "Y", "K", "W"], ["K", "Y"]) is None
    # K came next, but Y did not come right after it: the other side may have issued an extra operation
    assert skipped_one(["W", "K", "Z", "Y", "W"], ["K", "Y"]) is None
    # W never issued before, or three sides
    assert skipped_one(["a", "b", "W"], ["K", "Y"]) is None
    assert skipped_one(["W", "K", "Y", "W"], ["K", "Y", "Z"]) is None


def dump_of(node: int) -> list[Event]:
    (bundle,) = BUNDLES.glob(f"node{node}-*.tar.gz")
    with tarfile.open(bundle) as archive:
        (member,) = [m for m in archive.getmembers() if "/fr/ncclwatch_trace_" in m.name]
        return parse_flight_recorder(archive.extractfile(member).read(), member.name)  # type: ignore[union-attr]


@pytest.mark.parametrize("shared", ["compact", "full"])
def test_the_leader_names_it_from_the_other_nodes_shared_entries(shared: str) -> None:
    """Live, the leader holds its own rank's whole dump and the other node's shared entries, whose call sites are
    kept for the newest few only: the order is read by signature (paged with no culprit before)."""
    state = JobState()
    payload = unpack(pack(1, shared, 0.0, dump_of(1)), "node 1")  # type: ignore[arg-type]
    assert payload is not None
    for event in [*dump_of(0), *payload.events]:
        state.apply(event)
    finding = classify(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, (0,)), finding.summary


STEP_60 = FIXTURES / "bundles" / "gloo-2.13-cpu-two-wrappers-skip-at-step-60"


def step_60_dump(node: int, stacks: bool) -> list[Event]:
    (bundle,) = STEP_60.glob(f"node{node}-*.tar.gz")
    with tarfile.open(bundle) as archive:
        (member,) = [m for m in archive.getmembers() if "/fr/ncclwatch_trace_" in m.name]
        events = parse_flight_recorder(archive.extractfile(member).read(), member.name)  # type: ignore[union-attr]
    if stacks:
        return events
    # As a peek's dump: the quiet door answers it without stack traces.
    return [e.model_copy(update={"entries": [x.model_copy(update={"frames": []}) for x in e.entries]}) for e in events]


@pytest.mark.parametrize("shared", ["compact", "full"])
def test_the_step_decides_where_the_other_nodes_entries_carry_no_stacks(shared: str) -> None:
    """Rank 0 skipped an all_reduce at step 60; the leader held its own rank's dump with stacks and the other node's
    peek dump without: the same operation with a line and without one is one operation to the step rule (7 of 7
    paged with no culprit before)."""
    state = JobState()
    payload = unpack(pack(1, shared, 0.0, step_60_dump(1, stacks=False)), "node 1")  # type: ignore[arg-type]
    assert payload is not None
    for event in [*step_60_dump(0, stacks=True), *payload.events]:
        state.apply(event)
    finding = classify(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, (0,)), finding.summary
    assert "the step this communicator repeats decides" in finding.reason


def test_both_step_60_bundles_name_the_rank_that_skipped() -> None:
    report = analyze_paths([str(p) for p in sorted(STEP_60.glob("*.tar.gz"))])
    assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [0]), report.summary
