"""Crafted Flight Recorder dumps are refused early, with a sentence; real ones still read (issue 13).

A pickle's memo lets a small file stand for an enormous tree: Python's own
pickler writes a shared object once and then a 2-5 byte reference per use,
which is exactly how these inputs are made.  Time and memory: bench/fr_crafted.py.
"""

from __future__ import annotations

import json
import pickle

from conftest import shared

from ncclwatch.watchdog.events import FrDump, Unusable
from ncclwatch.watchdog.parsing import flight_recorder as fr


def entry(**extra: object) -> dict[str, object]:
    return {
        "record_id": 1,
        "pg_id": 0,
        "collective_seq_id": 1,
        "profiling_name": "nccl:all_reduce",
        "state": "scheduled",
        **extra,
    }


def dump(entries: list[object]) -> dict[str, object]:
    return {"version": "2.10", "pg_config": {}, "entries": entries}


def parse(data: bytes) -> FrDump | Unusable:
    [event] = fr.parse_flight_recorder(data, "nccl_trace_rank_0")
    return event


def test_one_entry_referenced_two_million_times_is_refused_before_unpickling():
    data = pickle.dumps(dump([entry()] * 2_000_000), protocol=2)
    assert len(data) < 5_000_000  # the 4 MB file
    event = parse(data)
    assert isinstance(event, Unusable)
    assert "refused" in event.reason and "opcodes" in event.reason


def test_more_entries_than_any_buffer_is_refused_by_count():
    shared_entry = entry()
    event = parse(pickle.dumps(dump([shared_entry] * (fr.MAX_ENTRIES + 1)), protocol=2))
    assert isinstance(event, Unusable)
    assert f"{fr.MAX_ENTRIES + 1:,} entries" in event.reason and "TORCH_FR_BUFFER_SIZE" in event.reason


def test_entries_sharing_one_huge_frames_list_are_refused():
    frames = [{"name": "f", "filename": "x.py", "line": 1}] * 250_000
    one = entry(frames=frames)
    event = parse(pickle.dumps(dump([one] * 2000), protocol=2))
    assert isinstance(event, Unusable)
    assert "shared objects counted once per use" in event.reason


def test_entries_sharing_one_huge_sizes_list_are_refused():
    one = entry(input_sizes=[[4, 4]] * 250_000)
    event = parse(pickle.dumps(dump([one] * 2000), protocol=2))
    assert isinstance(event, Unusable)
    assert "refused" in event.reason


def test_a_long_name_shared_by_every_entry_is_refused():
    one = entry(profiling_name="nccl:all_reduce " + "x" * (2 << 20))
    event = parse(pickle.dumps(dump([one] * 2000), protocol=2))
    assert isinstance(event, Unusable)
    assert "refused" in event.reason


def test_a_list_that_contains_itself_spends_the_budget_and_is_refused():
    loop: list[object] = []
    loop.append(loop)
    event = parse(pickle.dumps(dump([entry(input_sizes=loop)]), protocol=2))
    assert isinstance(event, Unusable)


def test_oversize_json_is_refused_without_being_parsed():
    data = json.dumps(dump([])).encode() + b" " * fr.MAX_JSON_BYTES
    event = parse(data)
    assert isinstance(event, Unusable)
    assert "JSON" in event.reason and "MiB" in event.reason


def test_oversize_pickle_is_refused_without_being_walked():
    data = pickle.dumps(dump([entry(pad="x" * fr.MAX_PICKLE_BYTES)]), protocol=2)
    event = parse(data)
    assert isinstance(event, Unusable)
    assert "pickle" in event.reason and "MiB" in event.reason


def test_many_distinct_entries_within_the_bounds_still_read():
    entries = [
        entry(record_id=i, collective_seq_id=i, frames=[{"name": "step", "filename": "train.py", "line": i}])
        for i in range(2000)
    ]
    event = parse(pickle.dumps(dump(entries), protocol=2))
    assert isinstance(event, FrDump)
    assert len(event.entries) == 2000 and event.entries[-1].frames[0].line == 1999


def test_the_real_dumps_are_far_inside_every_bound():
    for path in sorted(shared("nccl-2.28.9-2gpu", "mismatch_fr", "fr").iterdir()):
        event = parse(path.read_bytes())
        assert isinstance(event, FrDump) and len(event.entries) > 100
