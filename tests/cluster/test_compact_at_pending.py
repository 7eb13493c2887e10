"""Compact evidence keeps where each rank stands, not only its newest entries (``payload._at_oldest_pending``).

A real capture: the H200's ``mismatch_fr`` (2 ranks, rank 1 skipped step 15's collectives; its AllReduce #82 has
another count than rank 0's).  Each rank's dump as another node shares it at the leader's peek, judged as the
leader judges the job.
"""

from __future__ import annotations

from conftest import FIXTURES

from ncclwatch.watchdog.cluster.incident_evidence import FULL_NODES
from ncclwatch.watchdog.cluster.judge import focus
from ncclwatch.watchdog.cluster.payload import FR_ENTRIES_COMPACT, pack, unpack
from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Decision
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

DUMPS = FIXTURES / "nccl-2.28.9-2gpu" / "mismatch_fr" / "fr"


def judged(kind: str | None) -> Decision:
    state = JobState()
    for node, path in enumerate(sorted(DUMPS.glob("nccl_trace_rank_*"))):
        events = parse_flight_recorder(path.read_bytes(), path.name)
        if kind is not None:  # through the store: packed by its node, unpacked by the leader
            payload = unpack(pack(node, kind, 0.0, events), f"node {node}")  # type: ignore[arg-type]
            assert payload is not None
            events = payload.events
        for event in events:
            state.apply(event)
    return classify(take_snapshot(state, 1e12))


def test_the_divergence_behind_a_rank_that_ran_ahead_travels_in_compact_evidence() -> None:
    whole = judged(None).finding
    assert (whole.verdict, whole.culprits, whole.position) == (Verdict.collective_mismatch, (1,), 82)
    peek = judged("compact")
    # The newest four entries alone start at #84 on rank 0 and #86 on rank 1: "rank 0 never entered #85"
    assert peek.finding.verdict is Verdict.collective_mismatch and peek.finding.position == 82, peek.finding.summary
    # Without their history the sides split evenly: both are suspects, and both nodes are asked for their full
    # evidence (asked for none, the leader paged the split with no culprit on the H200)
    assert peek.page and peek.finding.culprits == () and focus(peek, {0: 0, 1: 1}, set(), FULL_NODES) == [0, 1]
    full = judged("full").finding
    assert (full.verdict, full.culprits) == (whole.verdict, whole.culprits)


def test_compact_stays_small_where_the_oldest_pending_is_among_the_newest() -> None:
    events = parse_flight_recorder((DUMPS / "nccl_trace_rank_0").read_bytes(), "rank0")
    payload = unpack(pack(0, "compact", 0.0, events), "node 0")
    assert payload is not None
    (dump,) = [e for e in payload.events if isinstance(e, FrDump)]
    positions = [(e.collective_seq_id, e.op) for e in dump.entries]
    # #83 is rank 0's oldest pending: #81 and #82 before it, then up to six in all, merged with the newest four
    assert positions[0] == (81, "AllReduce") and len(dump.entries) <= FR_ENTRIES_COMPACT + 3


def step_one_dtype(rank: int, enqueued: int) -> FrDump:
    """The H200's two-wrapper dtype fault at step 1 (bench/gpu_job.py, rank 1's log: "failure detected at work
    sequence id: 15 (BROADCAST) ... last enqueued work: 22, last completed work: 14"): all_reduces #1-#13 in Float,
    #14 in BFloat16 on rank 1 (completed on both: NCCL moved bytes, it does not check types), the broadcast #15
    hung, and the host queued up to ``enqueued`` behind it."""

    def entry(seq: int, op: str, dtype: str, done: bool) -> FrEntry:
        return FrEntry(
            index=seq - 1,
            pg_id="0",
            collective_seq_id=seq,
            profiling_name=f"nccl:{op.lower()}",
            op=op,
            is_p2p=False,
            input_sizes=[[1024]],
            input_dtypes=[dtype],
            state=OpState.completed if done else OpState.scheduled,
        )

    entries = [entry(seq, "AllReduce", "Float", True) for seq in range(1, 14)]
    entries.append(entry(14, "AllReduce", "BFloat16" if rank == 1 else "Float", True))
    entries.append(entry(15, "Broadcast", "Float", False))
    entries += [entry(seq, "AllReduce", "Float", False) for seq in range(16, enqueued + 1)]
    return FrDump(
        rank=rank,
        version="2.10",
        process_groups={"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1])},
        entries=entries,
        cite=Citation(file=f"nccl_trace_rank_{rank}"),
    )


def test_a_dtype_changed_at_step_one_is_named_across_nodes_from_compact_evidence() -> None:
    state = JobState()
    for node, dump in enumerate([step_one_dtype(0, enqueued=17), step_one_dtype(1, enqueued=22)]):
        payload = unpack(pack(node, "compact", 0.0, [dump]), f"node {node}")
        assert payload is not None
        (shared,) = payload.events
        assert shared.entries[0].collective_seq_id == 13  # type: ignore[attr-defined]  # two before the pending #15
        for event in payload.events:
            state.apply(event)
    finding = classify(take_snapshot(state, 1e12)).finding
    assert (finding.verdict, finding.culprits, finding.position) == (Verdict.collective_mismatch, (1,), 14)
