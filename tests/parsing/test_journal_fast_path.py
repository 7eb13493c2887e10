"""The journal's fast path (pydantic reads each line as JSON, the kind cut out) gives the events the general path
(``json.loads``, then ``model_validate``) gives, and leaves every other line to it."""

from __future__ import annotations

import json

import pytest

from ncclwatch.watchdog.events import (
    Citation,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpSig,
    OpState,
    ProcessState,
    SequenceTail,
    StackDump,
    Stall,
    ThreadStack,
    Unusable,
    WorkerSeen,
)
from ncclwatch.watchdog.parsing import journal
from ncclwatch.watchdog.parsing.journal import HEADER, journal_line, parse_journal

EVENTS = [
    WorkerSeen(pid=7, rank=3, local_rank=3, world_size=16, host="node0", at=1.5, node_rank=0, nnodes=2),
    ProcessState(pid=7, rank=3, state="S", cpu_seconds=1.25, at=2.0),
    StackDump(pid=7, threads=[ThreadStack(name="MainThread", frames=["step (/opt/t.py:4)"])], cite=Citation(file="s")),
    FrDump(
        rank=3,
        version="2.10",
        process_groups={"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(range(16)))},
        entries=[
            FrEntry(
                index=0,
                pg_id="0",
                collective_seq_id=9,
                profiling_name="nccl:all_reduce",
                op="AllReduce",
                is_p2p=False,
                input_sizes=[[4, 2]],
                input_dtypes=["BFloat16"],
                state=OpState.started,
                frames=[FrFrame(name="step", filename="/opt/t.py", line=4)],
            )
        ],
        cite=Citation(file="fr/3"),
    ),
    SequenceTail(
        comm_key="nccl:0xa",
        label="commId 0xa",
        nranks=16,
        comm_rank=3,
        global_rank=3,
        host="node0",
        pid=7,
        base=8,
        sigs=[OpSig("AllReduce", 8, "9", "0", None)],
    ),
    Stall(at=3.0, stalled_for_s=20.0, stall_timeout_s=15.0, progress_timeout_s=1800.0),
]


def test_the_fast_path_reads_what_the_general_path_reads() -> None:
    lines = [journal_line(e).encode() for e in EVENTS]
    assert all(journal._fast(line) is not None for line in lines)  # each one took the fast path
    assert parse_journal(b"\n".join([HEADER, *lines]), "j") == EVENTS == [journal._general(line) for line in lines]


def test_other_spellings_take_the_general_path() -> None:
    doc = json.loads(journal_line(EVENTS[1]))
    kind_last = json.dumps({k: v for k, v in doc.items() if k != "event"} | {"event": doc["event"]})
    spaced = json.dumps(doc)  # '{"event": "ProcessState", ...}': a space after the colon
    wrong_field = journal_line(EVENTS[1]).replace('"state":"S"', '"state":5')
    data = "\n".join([HEADER.decode(), kind_last, spaced, wrong_field, '{"event":"Nope","x":1}']).encode()
    events = parse_journal(data, "j")
    assert events[:2] == [EVENTS[1], EVENTS[1]]
    assert [type(e) for e in events[2:]] == [Unusable, Unusable]
    assert [e.cite.line for e in events[2:]] == [4, 5]  # type: ignore[union-attr]


def test_lines_without_their_defaults_read_back_the_same_events() -> None:
    """What nodes share (``cluster.payload.encode``) leaves out the nulls and empty lists; the fast path reads the
    same events from it."""
    lines = [journal_line(e, defaults=False).encode() for e in EVENTS]
    assert all(journal._fast(line) is not None for line in lines)
    assert parse_journal(b"\n".join([HEADER, *lines]), "j") == EVENTS
    assert b"null" not in lines[3] and b"[]" not in lines[3]  # the dump's entry: most of its fields at their defaults


def test_lines_of_one_kind_read_together_give_each_line_s_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines of one kind go to pydantic as one array (``journal._together``): the same events in the same order as one
    line at a time, kinds interleaved; no line was read alone."""
    lines = [journal_line(e, defaults=False).encode() for e in EVENTS for _ in range(3)]
    alone = journal._one
    monkeypatch.setattr(journal, "_one", lambda *a: pytest.fail("a line read alone"))
    events = parse_journal(b"\n".join([HEADER, *lines[::-1]]), "j")
    assert events == [e for e in EVENTS for _ in range(3)][::-1]
    assert events == [alone(line, i, "j") for i, line in enumerate(lines[::-1], 1)]


def test_a_malformed_line_costs_its_own_event_only() -> None:
    """One bad line among others of its kind: the array does not validate, each line is read alone, the bad one is an
    ``Unusable`` naming its line and the others of its kind are read."""
    good = journal_line(EVENTS[1]).encode()
    truncated = good[: len(good) // 2]
    wrong_type = good.replace(b'"cpu_seconds":1.25', b'"cpu_seconds":"lots"')
    data = b"\n".join([HEADER, good, truncated, good, wrong_type, good])
    events = parse_journal(data, "j")
    assert [type(e) for e in events] == [ProcessState, Unusable, ProcessState, Unusable, ProcessState]
    assert [e.cite.line for e in events if isinstance(e, Unusable)] == [3, 5]


def test_a_line_that_is_not_one_object_does_not_read_as_two() -> None:
    """Joined into one array, ``{"event":"ProcessState",<fields>},{<fields>}`` would read as two samples; read alone
    it is not JSON, and its line is said unusable."""
    good = journal_line(EVENTS[1]).encode()
    fields = good[good.index(b'"pid"') :]
    two_in_one = good[:-1] + b"},{" + fields
    events = parse_journal(b"\n".join([HEADER, two_in_one, good]), "j")
    assert [type(e) for e in events] == [Unusable, ProcessState]
