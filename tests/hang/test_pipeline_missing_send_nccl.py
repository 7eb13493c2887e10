"""A missing send on real NCCL (H100, torch 2.11, NCCL 2.28.9): the leader never decided; now it names the stage.

``bench/pipeline_job.py --fault=missing_send --fault-rank=1 --fault-step=1500``, two wrappers, one rank each
(tests/fixtures/bundles/nccl-2.28.9-h100-pipeline-missing-send/README.md).  Stage 1 never sent its last gradient
back; both hosts ran ahead and blocked in ``loss.item()``.  Rank 1's dump in node 1's bundle is real: its
all_reduce #1501 ``started``, its sends all completed, and ``pg_status`` says ``last_enqueued_collective`` 1501,
``last_completed_collective`` 7504 (its point-to-point count).  Read as collective numbers, that made the pending
all_reduce "completed": nothing pending anywhere, rank 1 busy (its CPU spins in ``.item()``), so the verdict was
held to the 1800 s progress timeout.  Node 0's evidence was lost with its stderr, so rank 0's dump is rank 1's
real entries turned to what stage 0's program enqueues (``one_step`` with ``warmup`` 1): its last recv from
stage 1 pending, the all_reduce queued behind it.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, OpState
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.comm_p2p import p2p_recv_cycle, p2p_recv_never_sent
from ncclwatch.watchdog.hang.job_rules import job_finding
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.parsing.journal import parse_journal

BUNDLE = next(
    (Path(__file__).parents[1] / "fixtures" / "bundles" / "nccl-2.28.9-h100-pipeline-missing-send").glob("*.tar.gz")
)


def _member(name: str) -> bytes:
    with tarfile.open(BUNDLE) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(name))
        data = tar.extractfile(member)
        assert data is not None
        return data.read()


@pytest.fixture(scope="module")
def rank1() -> FrDump:
    (dump,) = parse_flight_recorder(_member("fr/nccl_trace_rank_1"), "nccl_trace_rank_1")
    assert isinstance(dump, FrDump)
    return dump


def _stage0(rank1: FrDump) -> FrDump:
    """Stage 0's step 1500, from rank 1's real entries of it: send, three (send, recv) groups, recv, all_reduce."""
    entries = rank1.entries
    send = next(e for e in reversed(entries) if e.op == "Send")
    recv = next(e for e in reversed(entries) if e.op == "Recv")
    marker = next(e for e in reversed(entries) if e.op == "Coalesced")
    all_reduces = [e for e in entries if e.op == "AllReduce"]
    done, hung = all_reduces[-2], all_reduces[-1]

    def mine(entry: FrEntry, kind: str, p2p_seq: int, state: OpState) -> FrEntry:
        name = {"Send": "nccl:send 0->1", "Recv": "nccl:recv 0<-1"}.get(kind, entry.profiling_name)
        return entry.model_copy(
            update={
                "p2p_seq_id": p2p_seq,
                "profiling_name": name,
                "peer": 1 if entry.is_p2p else None,
                "state": state,
                "collective_seq_id": 1500,
            }
        )

    step = [done, mine(send, "Send", 7501, OpState.completed)]
    for p2p_seq in (7502, 7503, 7504):  # batch_isend_irecv: members stay scheduled, the marker completes
        step += [
            mine(send, "Send", p2p_seq, OpState.scheduled),
            mine(recv, "Recv", p2p_seq, OpState.scheduled),
            mine(marker, "Coalesced", p2p_seq, OpState.completed),
        ]
    step += [mine(recv, "Recv", 7505, OpState.started), hung.model_copy(update={"state": OpState.scheduled})]
    renumbered = [e.model_copy(update={"index": i}) for i, e in enumerate(step)]
    group = rank1.process_groups["0"].model_copy(update={"last_completed": 7505})
    return FrDump(
        rank=0,
        version=rank1.version,
        comm_lib_version=rank1.comm_lib_version,
        process_groups={"0": group},
        entries=renumbered,
        cite=Citation(file="nccl_trace_rank_0"),
    )


def test_rank1s_all_reduce_is_pending_though_its_group_status_counts_higher(rank1: FrDump) -> None:
    state = JobState()
    state.apply(rank1)
    (seq,) = state.comms["fr:0"].ranks.values()
    assert (seq.total, seq.completed) == (1501, 1500)


def test_the_stage_that_never_sent_is_named(rank1: FrDump) -> None:
    state = JobState()
    state.apply(_stage0(rank1))
    state.apply(rank1)
    finding = job_finding(take_snapshot(state, observed_at=0.0))
    assert (finding.verdict, finding.culprits) == (Verdict.rank_behind, (1,))
    assert "never posted the Send rank 0 waits for" in finding.summary
    assert "collective #1501" in finding.summary


def test_pages_though_rank1_spins_in_item(rank1: FrDump) -> None:
    """Node 1's real probe (its worker, /proc samples with the CPU moving, its stack in ``loss.item()``): the
    busy-culprit hold does not apply to a rank with a collective pending."""
    state = JobState()
    for event in parse_journal(_member("journal.jsonl"), "journal.jsonl"):
        state.apply(event)
    state.apply(_stage0(rank1))
    state.apply(rank1)
    decision = classify(take_snapshot(state, observed_at=state.stall.at if state.stall else 0.0))
    assert (decision.finding.verdict, decision.finding.culprits, decision.page) == (Verdict.rank_behind, (1,), True)


def test_a_sender_still_before_the_collective_is_not_named(rank1: FrDump) -> None:
    """Mid-step in a healthy job: stage 0 waits in its recv and has enqueued the all_reduce, stage 1 has not reached
    it (still computing the gradient it will send)."""
    state = JobState()
    state.apply(_stage0(rank1))
    before = [e for e in rank1.entries if not (e.op == "AllReduce" and e.collective_seq_id == 1501)]
    state.apply(rank1.model_copy(update={"entries": before}))
    (comm,) = take_snapshot(state, observed_at=0.0).comms
    assert p2p_recv_cycle(comm) is None and p2p_recv_never_sent(comm) is None
