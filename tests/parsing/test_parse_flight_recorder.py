"""Flight Recorder dumps -> FrDump: real dumps first, then every older shape, then bad input.

Real data: the 2-GPU NCCL fixture (torch 2.11, NCCL 2.28.9, a collective
mismatch with batched p2p) beside the repository, and the dumps under
``tests/data/flight_recorder/`` (see its README).  Older versions are built
here with exactly the keys PyTorch's source wrote at that version.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ncclwatch.watchdog.events import Citation, FrDump, OpState, Unusable
from ncclwatch.watchdog.parsing.flight_recorder import (
    effective_states,
    looks_like_flight_recorder,
    parse_flight_recorder,
    parse_profiling_name,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests/fixtures/nccl-2.28.9-2gpu/mismatch_fr/fr"
DATA = Path(__file__).resolve().parents[1] / "data/flight_recorder"


def parse(data: bytes, name: str = "nccl_trace_rank_0") -> FrDump:
    events = parse_flight_recorder(data, name)
    assert len(events) == 1
    assert isinstance(events[0], FrDump), getattr(events[0], "reason", events[0])
    return events[0]


def unusable(data: bytes, name: str = "dump_rank_3") -> Unusable:
    events = parse_flight_recorder(data, name)
    assert len(events) == 1
    assert isinstance(events[0], Unusable), events[0]
    assert events[0].cite == Citation(file=name)
    return events[0]


def fixture(rank: int) -> bytes:
    return (FIXTURE / f"nccl_trace_rank_{rank}").read_bytes()


# --------------------------------------------------------------------------
# The real 2-GPU dumps (version 2.10, pickle)
# --------------------------------------------------------------------------


class TestRealTwoGpuDumps:
    def test_rank_0_header_and_group(self) -> None:
        dump = parse(fixture(0), "fr/nccl_trace_rank_0")
        assert dump.rank == 0
        assert dump.version == "2.10"
        assert dump.comm_lib_version == "2.28.9"
        assert dump.cite == Citation(file="fr/nccl_trace_rank_0")
        assert len(dump.entries) == 132
        assert list(dump.process_groups) == ["0"]
        group = dump.process_groups["0"]
        assert (group.desc, group.ranks) == ("default_pg", [0, 1])
        assert (group.last_enqueued, group.last_started, group.last_completed) == (16, None, 82)

    def test_rank_0_first_entry(self) -> None:
        first = parse(fixture(0)).entries[0]
        assert (first.index, first.record_id, first.pg_id) == (0, 0, "0")
        assert (first.op, first.profiling_name, first.state) == ("AllGather", "nccl:all_gather", OpState.completed)
        assert (first.input_sizes, first.output_sizes) == ([[1]], [[2, 1]])
        assert (first.input_dtypes, first.output_dtypes) == (["Long"], ["Long"])
        assert (first.collective_seq_id, first.p2p_seq_id, first.timeout_ms) == (1, 0, 15000)
        assert first.time_created_ns == 1795301395678753185
        assert first.time_started_ns is None  # no start events without TORCH_NCCL_ENABLE_TIMING
        assert first.time_completed_ns == 1795301395850110778
        assert [str(f) for f in first.frames[-2:]] == ["main (/job/train.py:17)", "<module> (/job/train.py:56)"]
        assert first.frames[0].name == "_verify_param_shape_across_processes"

    def test_rank_0_tail_is_the_hung_step(self) -> None:
        entries = parse(fixture(0)).entries
        last_done = entries[126]
        assert (last_done.op, last_done.state, last_done.input_sizes) == ("AllReduce", OpState.completed, [[16777216]])
        assert last_done.collective_seq_id == 82
        tail = [(e.op, e.state, e.input_sizes, e.peer, e.is_p2p) for e in entries[127:]]
        assert tail == [
            ("AllGather", OpState.scheduled, [[1024]], None, False),
            ("Broadcast", OpState.scheduled, [[1024]], None, False),
            ("Send", OpState.scheduled, [[4096]], 1, True),
            ("Recv", OpState.scheduled, [[4096]], 1, True),
            ("Coalesced", OpState.scheduled, [], None, False),
        ]
        assert entries[127].output_sizes == [[2, 1024]]
        marker = entries[131]
        assert (marker.collective_seq_id, marker.p2p_seq_id, marker.profiling_name) == (84, 16, "nccl:coalesced")
        assert marker.frames[0].name == "_coalescing_manager"

    def test_rank_1_header_and_tail(self) -> None:
        dump = parse(fixture(1), "nccl_trace_rank_1")
        assert (dump.rank, dump.version, len(dump.entries)) == (1, "2.10", 134)
        assert dump.process_groups["0"].ranks == [0, 1]
        assert dump.process_groups["0"].last_completed == 82
        tail = [(e.op, e.state, e.input_sizes, e.peer) for e in dump.entries[127:]]
        assert tail == [
            ("AllReduce", OpState.scheduled, [[4198400]], None),
            ("AllReduce", OpState.scheduled, [[16777216]], None),
            ("AllGather", OpState.scheduled, [[1024]], None),
            ("Broadcast", OpState.scheduled, [[1024]], None),
            ("Send", OpState.scheduled, [[4096]], 0),
            ("Recv", OpState.scheduled, [[4096]], 0),
            ("Coalesced", OpState.scheduled, [], None),
        ]
        assert dump.entries[-3].profiling_name == "nccl:send 1->0"

    def test_the_ranks_diverge_at_collective_82(self) -> None:
        """The fixture's planted mismatch: rank 1 runs one bucket's all_reduce twice."""
        by_seq = [
            {e.collective_seq_id: e for e in parse(fixture(rank)).entries if not e.is_p2p and e.op != "Coalesced"}
            for rank in (0, 1)
        ]
        assert by_seq[0][81].input_sizes == by_seq[1][81].input_sizes == [[4198400]]
        # Same op, different counts: NCCL completes it anyway on both ranks.
        assert (by_seq[0][82].op, by_seq[0][82].input_sizes, by_seq[0][82].state) == (
            "AllReduce",
            [[16777216]],
            OpState.completed,
        )
        assert (by_seq[1][82].op, by_seq[1][82].input_sizes, by_seq[1][82].state) == (
            "AllReduce",
            [[4195328]],
            OpState.completed,
        )
        assert (by_seq[0][83].op, by_seq[0][83].input_sizes) == ("AllGather", [[1024]])
        assert (by_seq[1][83].op, by_seq[1][83].input_sizes) == ("AllReduce", [[4198400]])

    def test_batched_p2p_stays_scheduled_while_its_marker_completes(self) -> None:
        """The trap effective_states exists for, as the real dump shows it."""
        entries = parse(fixture(0)).entries
        send, recv, marker = entries[7], entries[8], entries[9]
        assert (send.profiling_name, recv.profiling_name) == ("nccl:send 0->1", "nccl:recv 0<-1")
        assert (send.state, recv.state, marker.state) == (OpState.scheduled, OpState.scheduled, OpState.completed)
        assert send.p2p_seq_id == recv.p2p_seq_id == marker.p2p_seq_id == 1
        # the marker keeps the collective_seq_id of the broadcast before the group
        assert entries[6].collective_seq_id == marker.collective_seq_id == 7

    def test_effective_states_give_p2p_their_markers_state(self) -> None:
        dump = parse(fixture(0))
        states = effective_states(dump)
        assert len(states) == len(dump.entries)
        assert states[7] == states[8] == OpState.completed
        assert states[6] == OpState.completed  # the broadcast before the group is not a member
        assert states[129] == states[130] == OpState.scheduled  # the hung group's marker never completed
        p2p = [i for i, e in enumerate(dump.entries) if e.is_p2p]
        assert len(p2p) == 32
        assert [i for i in p2p if states[i] != OpState.completed] == [129, 130]
        # nothing outside a group changes
        assert all(s == e.state for s, e in zip(states, dump.entries, strict=True) if not e.is_p2p)

    def test_rank_inferred_from_p2p_names_when_the_file_name_has_none(self) -> None:
        assert parse(fixture(0), "copy-of-dump").rank == 0
        assert parse(fixture(1), "/tmp/renamed.bin").rank == 1

    def test_looks_like_a_dump_from_its_first_kilobytes(self) -> None:
        assert looks_like_flight_recorder(fixture(0)[:4096])
        assert looks_like_flight_recorder(fixture(1)[:64])


# --------------------------------------------------------------------------
# Other real dumps (tests/data/flight_recorder)
# --------------------------------------------------------------------------


class TestRealDataDumps:
    def test_every_nccl_collective_name_maps_to_ncclss_spelling(self) -> None:
        dump = parse((DATA / "torch2.11_nccl_1gpu_pickle_rank_0").read_bytes(), "torch2.11_nccl_1gpu_pickle_rank_0")
        assert (dump.rank, dump.version, dump.comm_lib_version, len(dump.entries)) == (0, "2.10", "2.28.9", 18)
        ops = [(e.profiling_name, e.op) for e in dump.entries[:16]]
        assert ops == [
            ("nccl:all_reduce", "AllReduce"),
            ("nccl:broadcast", "Broadcast"),
            ("nccl:reduce", "Reduce"),
            ("nccl:all_gather", "AllGather"),
            ("nccl:_all_gather_base", "AllGather"),
            ("nccl:reduce_scatter", "ReduceScatter"),
            ("nccl:_reduce_scatter_base", "ReduceScatter"),
            ("nccl:all_to_all", "AlltoAll"),
            ("nccl:all_to_all", "AlltoAll"),
            ("nccl:all_reduce_barrier", "Barrier"),
            ("nccl:gather", "Gather"),
            ("nccl:scatter", "Scatter"),
            ("nccl:allreduce_coalesced", "AllReduce"),
            ("nccl:all_gather_into_tensor_coalesced", "AllGather"),
            ("nccl:reduce_scatter_tensor_coalesced", "ReduceScatter"),
            ("nccl:allreduce_coalesced", "AllReduce"),
        ]
        assert all(e.state == OpState.completed and not e.is_p2p for e in dump.entries)
        assert dump.entries[12].input_sizes == [[8], [8]]
        assert dump.entries[5].input_sizes == [[1, 8]]

    def test_a_second_group_keeps_its_name_desc_and_dtype(self) -> None:
        dump = parse((DATA / "torch2.11_nccl_1gpu_pickle_rank_0").read_bytes(), "torch2.11_nccl_1gpu_pickle_rank_0")
        assert set(dump.process_groups) == {"0", "1"}
        tp = dump.process_groups["1"]
        assert (tp.desc, tp.ranks, tp.last_enqueued, tp.last_completed) == ("tp_group", [0], 1, None)
        sub = dump.entries[16]
        assert (sub.pg_id, sub.collective_seq_id, sub.input_dtypes) == ("1", 1, ["BFloat16"])

    def test_json_dump_of_the_same_process_matches_the_pickle(self) -> None:
        pickled = parse((DATA / "torch2.11_nccl_1gpu_pickle_rank_0").read_bytes(), "p_rank_0")
        as_json = parse((DATA / "torch2.11_nccl_1gpu_json_rank_0").read_bytes(), "j_rank_0")

        def shape(dump: FrDump) -> list[tuple[object, ...]]:
            return [(e.record_id, e.pg_id, e.op, e.input_sizes, e.output_sizes, e.input_dtypes) for e in dump.entries]

        assert shape(as_json) == shape(pickled)
        assert all(not e.frames for e in as_json.entries)  # JSON dumps carry no stacks
        assert all(e.frames for e in pickled.entries)

    def test_json_spellings_are_normalised(self) -> None:
        dump = parse((DATA / "torch2.11_nccl_1gpu_json_rank_0").read_bytes(), "torch2.11_nccl_1gpu_json_rank_0")
        group = dump.process_groups["0"]  # pg_status values are strings in JSON: "17"
        assert (group.desc, group.ranks, group.last_enqueued, group.last_started, group.last_completed) == (
            "default_pg",
            [0],
            17,
            17,
            17,
        )
        last = dump.entries[-1]
        assert (last.pg_id, last.state, last.timeout_ms) == ("0", OpState.completed, 600000)
        assert last.time_started_ns == 1795303606571075121

    def test_json_dump_without_entries_is_an_empty_dump(self) -> None:
        data = (DATA / "torch2.11_fr_json_empty_rank_0").read_bytes()
        assert looks_like_flight_recorder(data)
        dump = parse(data, "torch2.11_fr_json_empty_rank_0")
        assert (dump.rank, dump.version, dump.entries, dump.process_groups) == (0, "2.10", [], {})
        assert dump.comm_lib_version is None  # dumped as ""

    def test_gloo_dump_names_and_its_empty_group(self) -> None:
        dump = parse((DATA / "torch2.13_gloo_pickle_rank_0").read_bytes(), "torch2.13_gloo_pickle_rank_0")
        assert [e.op for e in dump.entries] == [
            "AllReduce",
            "Broadcast",
            "AllGather",
            "Barrier",
            "AllReduce",
            "AlltoAll",
            "Reduce",
        ]
        assert all(e.profiling_name.startswith("gloo:") for e in dump.entries)
        # gloo's pg_config is {"": {"name": "", "desc": "", "ranks": "[]"}}: skipped,
        # the groups come from the entries and pg_status instead.
        assert set(dump.process_groups) == {"0", "1"}
        assert dump.process_groups["1"].desc == "my_sub"
        assert dump.process_groups["0"].ranks == []
        assert dump.process_groups["0"].last_completed == 9
        assert all(e.state == OpState.scheduled for e in dump.entries)  # no CUDA events on CPU

    def test_json_zero_times_mean_not_discovered(self) -> None:
        dump = parse((DATA / "torch2.13_gloo_json_rank_1").read_bytes(), "torch2.13_gloo_json_rank_1")
        assert dump.rank == 1
        assert all(e.time_started_ns is None and e.time_completed_ns is None for e in dump.entries)
        assert dump.entries[4].input_dtypes == ["Double"]

    def test_all_data_files_are_sniffed(self) -> None:
        for path in DATA.glob("torch*"):
            assert looks_like_flight_recorder(path.read_bytes()[:4096]), path.name


# --------------------------------------------------------------------------
# Older versions, built with the keys PyTorch wrote at each version
# --------------------------------------------------------------------------

FRAMES = [
    {"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2050},
    {"name": "<module>", "filename": "t.py", "line": 9},
]


def v1_4_entry(record_id: int, seq_id: int, name: str, state: str = "completed") -> dict[str, object]:
    """TraceUtils.h at "1.4": seq_id only, no process_group, dtypes, is_p2p or timeout."""
    done = state == "completed"
    return {
        "record_id": record_id,
        "pg_id": 0,
        "seq_id": seq_id,
        "op_id": record_id + 1,
        "profiling_name": name,
        "time_created_ns": 1000 + record_id,
        "input_sizes": [[4]],
        "output_sizes": [[4]],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": 2000 + record_id if done else None,
        "retired": done,
        "frames": FRAMES,
    }


def v1_4_dump() -> dict[str, object]:
    entries = [
        v1_4_entry(0, 1, "nccl:all_reduce"),
        v1_4_entry(1, 2, "nccl:send 0->1", "scheduled"),
        v1_4_entry(2, 2, "nccl:recv 0<-1", "scheduled"),
        v1_4_entry(3, 2, "nccl:coalesced"),
        v1_4_entry(4, 3, "nccl:all_reduce", "scheduled"),
    ]
    entries[0]["duration_ms"] = 0.25  # only when TORCH_NCCL_ENABLE_TIMING
    # "entries" is the first key; pg_config is {uid: [global ranks]}
    return {"entries": entries, "version": "1.4", "pg_config": {0: [0, 1], 1: [0]}}


def v2_0_entry(record_id: int, coll: int, p2p: int, name: str, is_p2p: bool, state: str) -> dict[str, object]:
    """TraceUtils.h at "2.0": collective/p2p seq ids, process_group tuple, dtypes, is_p2p."""
    return {
        "record_id": record_id,
        "pg_id": 1,
        "process_group": ("tp", "tensor_parallel"),
        "collective_seq_id": coll,
        "p2p_seq_id": p2p,
        "op_id": record_id + 1,
        "profiling_name": name,
        "time_created_ns": 5000 + record_id,
        "input_sizes": [[2, 3]],
        "input_dtypes": ["float"],  # dtype().name() before c10::toString
        "output_sizes": [[2, 3]],
        "output_dtypes": ["float"],
        "state": state,
        "time_discovered_started_ns": 6000 + record_id if state != "scheduled" else None,
        "time_discovered_completed_ns": 7000 + record_id if state == "completed" else None,
        "retired": state == "completed",
        "is_p2p": is_p2p,
        "frames": FRAMES,
    }


def v2_0_dump() -> dict[str, object]:
    entries = [
        v2_0_entry(0, 1, 0, "nccl:_allgather_base", False, "completed"),
        v2_0_entry(1, 1, 1, "nccl:send 1->0", True, "started"),
    ]
    pg_config = {"tp": {"name": "tp", "desc": "tensor_parallel", "ranks": "[4, 6]"}}
    return {"entries": entries, "version": "2.0", "pg_config": pg_config}


def v2_2_entry(record_id: int, name: str) -> dict[str, object]:
    """NCCLUtils.hpp at "2.2": adds timeout_ms; frames first, only with stack traces."""
    entry = v2_0_entry(record_id, record_id + 1, 0, name, False, "scheduled")
    entry.update(pg_id=0, process_group=("0", "default_pg"), input_dtypes=["Float"], output_dtypes=["Float"])
    entry["timeout_ms"] = 600000
    return {"frames": entry.pop("frames"), **entry}


def v2_2_dump() -> dict[str, object]:
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    return {"version": "2.2", "pg_config": pg_config, "entries": [v2_2_entry(0, "nccl:reduce_scatter")]}


def v2_3_dump() -> dict[str, object]:
    """NCCLUtils.hpp at "2.3": pg_status by uid, with -1 for "none yet"."""
    dump = v2_2_dump()
    dump["version"] = "2.3"
    dump["entries"] = [v2_2_entry(0, "nccl:all_to_all"), v2_2_entry(1, "nccl:broadcast")]
    pg_status = {"0": {"last_enqueued_collective": 2, "last_started_collective": -1, "last_completed_collective": -1}}
    return {"version": "2.3", "pg_config": dump["pg_config"], "pg_status": pg_status, "entries": dump["entries"]}


def v2_7_dump() -> dict[str, object]:
    """FlightRecorder.hpp at "2.7": nccl_version at top level; slow-path coalesced collectives."""
    names = ["nccl:_broadcast_oop", "nccl:_broadcast_oop", "nccl:coalesced"]
    entries = [v2_2_entry(i, name) for i, name in enumerate(names)]
    for entry, state in zip(entries, ["scheduled", "scheduled", "completed"], strict=True):
        entry.update({"collective_seq_id": 5, "state": state})
    entries[2]["time_discovered_completed_ns"] = 9999
    pg_status = {"0": {"last_enqueued_collective": 5, "last_started_collective": 5, "last_completed_collective": 5}}
    return {
        "version": "2.7",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "nccl_version": "2.21.5",
        "pg_status": pg_status,
        "entries": entries,
    }


def pickled(dump: object) -> bytes:
    return pickle.dumps(dump, protocol=2)  # torch::jit::Pickler writes protocol 2


class TestOlderVersions:
    def test_1_4_seq_id_and_pg_config_of_rank_lists(self) -> None:
        data = pickled(v1_4_dump())
        assert looks_like_flight_recorder(data)  # "entries" comes first
        dump = parse(data, "nccl_trace_rank_1")
        assert (dump.version, dump.rank, dump.comm_lib_version) == ("1.4", 1, None)
        assert {pg: g.ranks for pg, g in dump.process_groups.items()} == {"0": [0, 1], "1": [0]}
        assert dump.process_groups["0"].desc is None
        assert dump.process_groups["0"].last_completed is None  # no pg_status before 2.3
        first, send = dump.entries[0], dump.entries[1]
        assert (first.collective_seq_id, first.p2p_seq_id, first.pg_id, first.timeout_ms) == (1, None, "0", None)
        assert first.input_dtypes == []
        assert (send.op, send.is_p2p, send.peer, send.collective_seq_id) == ("Send", True, 1, 2)

    def test_1_4_coalesced_group_is_keyed_by_its_one_seq_id(self) -> None:
        dump = parse(pickled(v1_4_dump()))
        assert effective_states(dump) == [
            OpState.completed,
            OpState.completed,
            OpState.completed,
            OpState.completed,
            OpState.scheduled,
        ]

    def test_1_4_rank_from_p2p_on_the_default_group(self) -> None:
        assert parse(pickled(v1_4_dump()), "trace").rank == 0

    def test_2_0_process_group_tuple_and_ranks_string(self) -> None:
        dump = parse(pickled(v2_0_dump()), "nccl_trace_rank_6")
        assert set(dump.process_groups) == {"tp"}
        tp = dump.process_groups["tp"]
        assert (tp.desc, tp.ranks) == ("tensor_parallel", [4, 6])
        gather, send = dump.entries
        assert (gather.op, gather.pg_id, gather.input_dtypes, gather.timeout_ms) == ("AllGather", "tp", ["float"], None)
        assert (send.op, send.state) == ("Send", OpState.started)
        assert (send.time_started_ns, send.time_completed_ns) == (6001, None)
        assert (send.peer, send.p2p_seq_id) == (0, 1)

    def test_2_0_rank_through_a_subgroup_s_ranks(self) -> None:
        # "send 1->0" on group "tp" = [4, 6]: group rank 1 is global rank 6
        assert parse(pickled(v2_0_dump()), "unnamed").rank == 6

    def test_2_2_timeout_and_version_first(self) -> None:
        data = pickled(v2_2_dump())
        assert looks_like_flight_recorder(data)
        dump = parse(data)
        entry = dump.entries[0]
        assert (entry.op, entry.timeout_ms, entry.input_dtypes) == ("ReduceScatter", 600000, ["Float"])
        assert dump.process_groups["0"].ranks == [0, 1, 2, 3]

    def test_2_2_without_entries_or_frames(self) -> None:
        raw = v2_2_dump()
        del raw["entries"]  # includeCollectives=False
        assert parse(pickled(raw)).entries == []
        raw = v2_2_dump()
        del raw["entries"][0]["frames"]  # includeStackTraces=False
        assert parse(pickled(raw)).entries[0].frames == []

    def test_2_3_pg_status_minus_one_is_none(self) -> None:
        group = parse(pickled(v2_3_dump())).process_groups["0"]
        assert (group.last_enqueued, group.last_started, group.last_completed) == (2, None, None)

    def test_2_7_nccl_version_and_slow_path_coalesced_collectives(self) -> None:
        dump = parse(pickled(v2_7_dump()))
        assert dump.comm_lib_version == "2.21.5"
        assert [e.op for e in dump.entries] == ["Broadcast", "Broadcast", "Coalesced"]
        assert effective_states(dump) == [OpState.completed] * 3

    def test_json_variant_of_an_older_version(self) -> None:
        raw = v2_3_dump()
        for entry in raw["entries"]:
            entry["process_group"] = list(entry["process_group"])
            entry["time_discovered_started_ns"] = entry["time_discovered_started_ns"] or 0
            entry["time_discovered_completed_ns"] = entry["time_discovered_completed_ns"] or 0
            del entry["frames"]
        raw["pg_status"] = {"0": {k: str(v) for k, v in raw["pg_status"]["0"].items()}}
        data = json.dumps(raw, sort_keys=True).encode()
        assert looks_like_flight_recorder(data)
        dump = parse(data)
        assert dump.process_groups["0"].last_enqueued == 2
        assert [e.op for e in dump.entries] == ["AlltoAll", "Broadcast"]
        assert all(e.time_started_ns is None for e in dump.entries)

    def test_newer_minor_version_is_read(self) -> None:
        raw = v2_3_dump()
        raw["version"] = "2.14"
        raw["entries"][0]["a_field_from_the_future"] = [1, 2]
        assert parse(pickled(raw)).version == "2.14"


# --------------------------------------------------------------------------
# Profiling names
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nccl:all_reduce", ("AllReduce", None, None)),
        ("nccl:all_gather", ("AllGather", None, None)),
        ("nccl:_allgather_base", ("AllGather", None, None)),
        ("nccl:_all_gather_base", ("AllGather", None, None)),
        ("nccl:reduce_scatter", ("ReduceScatter", None, None)),
        ("nccl:_reduce_scatter_base", ("ReduceScatter", None, None)),
        ("nccl:broadcast", ("Broadcast", None, None)),
        ("nccl:_broadcast_oop", ("Broadcast", None, None)),
        ("nccl:reduce", ("Reduce", None, None)),
        ("nccl:_reduce_oop", ("Reduce", None, None)),
        ("nccl:all_to_all", ("AlltoAll", None, None)),
        ("nccl:all_reduce_barrier", ("Barrier", None, None)),
        ("nccl:send 0->1", ("Send", 0, 1)),
        ("nccl:recv 0<-1", ("Recv", 0, 1)),
        ("nccl:send 12->3", ("Send", 12, 3)),
        ("nccl:coalesced", ("Coalesced", None, None)),
        ("nccl:ALLGATHER_coalesced", ("Coalesced", None, None)),
        ("nccl:allreduce_coalesced", ("AllReduce", None, None)),
        ("nccl:gather", ("Gather", None, None)),
        ("nccl:scatter", ("Scatter", None, None)),
        ("gloo:barrier", ("Barrier", None, None)),
        ("gloo:recvAnySource", ("Recv", None, None)),
        ("xccl:all_reduce", ("AllReduce", None, None)),
        ("nccl:split", ("split", None, None)),
        ("nccl2:some_new_op", ("some_new_op", None, None)),
        ("", ("", None, None)),
    ],
)
def test_profiling_names_map_to_nccl_spelling(name: str, expected: tuple[str, int | None, int | None]) -> None:
    assert parse_profiling_name(name) == expected


# --------------------------------------------------------------------------
# Bad input: always one Unusable, never an exception
# --------------------------------------------------------------------------


class Boom:
    """A pickle that runs a shell command when plainly unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


class TestBadInput:
    def test_empty(self) -> None:
        assert "empty" in unusable(b"").reason
        assert "empty" in unusable(b"  \n").reason

    def test_truncated_pickle(self) -> None:
        data = fixture(0)
        reason = unusable(data[: len(data) // 2]).reason
        assert "truncated or corrupt pickle" in reason
        assert "truncated or corrupt pickle" in unusable(data[:3]).reason

    def test_truncated_json(self) -> None:
        data = (DATA / "torch2.11_nccl_1gpu_json_rank_0").read_bytes()
        assert "truncated or corrupt JSON" in unusable(data[:5000]).reason

    def test_random_bytes(self) -> None:
        rng = random.Random(7)
        blob = bytes(rng.randrange(256) for _ in range(4096))
        assert not looks_like_flight_recorder(blob)
        assert "neither a pickle nor JSON" in unusable(blob.replace(b"\x80", b"\x00")).reason
        unusable(b"\x80\x02" + blob)  # a pickle header on garbage

    def test_a_pickle_of_something_else(self) -> None:
        assert "top level is a list" in unusable(pickled([{"pg_id": 0, "seq_id": 1}])).reason
        assert "top level is a str" in unusable(pickled("version")).reason
        assert "no 'version', 'entries' or 'pg_config'" in unusable(pickled({"a": 1})).reason
        assert not looks_like_flight_recorder(pickled({"a": 1}))

    @pytest.mark.parametrize("protocol", [2, 4, 5])
    def test_malicious_pickle_is_refused_before_it_runs(self, tmp_path: Path, protocol: int) -> None:
        marker = tmp_path / "pwned"
        data = pickle.dumps({"version": "2.10", "entries": [Boom(marker)]}, protocol=protocol)
        assert looks_like_flight_recorder(data)  # it looks the part; the parser must still refuse it
        reason = unusable(data).reason
        assert reason.startswith("refused to unpickle: the file asks for code")
        if protocol == 2:
            assert "system" in reason  # GLOBAL names it; STACK_GLOBAL takes it from the stack
        assert not marker.exists()

    def test_the_unpickler_refuses_globals_on_its_own(self) -> None:
        from ncclwatch.watchdog.parsing.flight_recorder import _PlainUnpickler

        data = pickle.dumps(Boom(Path("/nonexistent/never")), protocol=2)
        with pytest.raises(pickle.UnpicklingError, match="refused global"):
            _PlainUnpickler(io.BytesIO(data)).load()

    def test_a_corrupt_memo_index_does_not_make_the_unpickler_allocate(self) -> None:
        """One flipped byte in a LONG_BINPUT took the C unpickler 25 s and gigabytes."""
        data = bytearray(fixture(0))
        assert data[5893:5898] == b"rK\x01\x00\x00"  # LONG_BINPUT 331
        data[5897] = 0x43  # -> LONG_BINPUT 1124073803
        reason = unusable(bytes(data)).reason
        assert "memo index 1124073803" in reason

    def test_malicious_protocol_0_pickle_is_not_even_unpickled(self, tmp_path: Path) -> None:
        marker = tmp_path / "pwned"
        data = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
        assert not looks_like_flight_recorder(data)
        unusable(data)
        assert not marker.exists()

    def test_any_global_is_refused(self) -> None:
        from collections import OrderedDict

        data = pickle.dumps(OrderedDict(version="2.10", entries=[]), protocol=2)
        assert "refused" in unusable(data).reason

    def test_versions_outside_what_is_known(self) -> None:
        raw = v2_3_dump()
        raw["version"] = "3.0"
        assert "unknown Flight Recorder dump version 3.0" in unusable(pickled(raw)).reason
        raw["version"] = "1.1"
        assert "older than 1.4" in unusable(pickled(raw)).reason
        raw["version"] = "two"
        assert "unknown Flight Recorder dump version 'two'" in unusable(pickled(raw)).reason
        del raw["version"]
        assert "without a 'version'" in unusable(pickled(raw)).reason

    def test_entries_of_the_wrong_shape(self) -> None:
        raw = v2_3_dump()
        raw["entries"] = {"0": {}}
        assert "'entries' is a dict" in unusable(pickled(raw)).reason
        raw["entries"] = [v2_2_entry(0, "nccl:all_reduce"), "oops"]
        assert "entries[1] is a str" in unusable(pickled(raw)).reason

    def test_mistyped_fields_become_empty_not_errors(self) -> None:
        raw = v2_3_dump()
        entry = raw["entries"][0]
        entry.update(input_sizes="[[4]]", input_dtypes=None, timeout_ms="soon", state="weird")
        entry["frames"] = [1, {"name": "f"}]
        raw["pg_config"]["0"]["ranks"] = "all of them"
        raw["pg_status"]["0"] = "gone"
        dump = parse(pickled(raw))
        first = dump.entries[0]
        assert (first.input_sizes, first.input_dtypes, first.timeout_ms) == ([], [], None)
        assert first.state == OpState.scheduled  # "weird" state, no discovery times
        assert [(f.name, f.filename, f.line) for f in first.frames] == [("f", "", None)]
        assert dump.process_groups["0"].ranks == []
        assert dump.process_groups["0"].last_enqueued is None

    def test_json_that_is_not_a_dump(self) -> None:
        assert "top level is a list" in unusable(b'[{"pid": 1, "frames": []}]').reason
        assert "no 'version'" in unusable(b'{"nccl_version": "2.28.9", "communicators": []}').reason

    @pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pickletools on garbage STRING args
    def test_flipped_bytes_never_raise(self) -> None:
        data = bytearray(fixture(0))
        rng = random.Random(11)
        for _ in range(150):
            mutated = bytearray(data)
            for _ in range(rng.randrange(1, 8)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            events = parse_flight_recorder(bytes(mutated), "nccl_trace_rank_0")
            assert len(events) == 1 and isinstance(events[0], (FrDump, Unusable))


# --------------------------------------------------------------------------
# Sniffing
# --------------------------------------------------------------------------


class TestSniffing:
    def test_python_pickles_of_a_dump_are_recognised(self) -> None:
        for protocol in (2, 4, 5):
            assert looks_like_flight_recorder(pickle.dumps(v2_3_dump(), protocol=protocol))

    def test_other_files_are_not(self) -> None:
        assert not looks_like_flight_recorder(b"")
        assert not looks_like_flight_recorder(b"\x80")
        assert not looks_like_flight_recorder(b"\x80\x02")
        assert not looks_like_flight_recorder(pickled([1, 2]))
        assert not looks_like_flight_recorder(b"host:123:456 [0] NCCL INFO AllReduce: opCount 0")
        assert not looks_like_flight_recorder(b'[{"pid": 1437, "thread_id": 1, "frames": []}]')
        assert not looks_like_flight_recorder(b'{"nccl_version": "2.28.9", "communicators": []}')
        assert not looks_like_flight_recorder(b'{"version": "1.0"}')

    def test_nccl_ras_json_is_not_a_dump(self) -> None:
        ras = sorted((REPO / "tests/data/ras").glob("*.json"))
        if not ras:
            pytest.skip("no RAS JSON samples in tests/data/ras")
        for path in ras:
            assert not looks_like_flight_recorder(path.read_bytes()), path.name

    def test_never_raises(self) -> None:
        for head in (bytearray(b"\x80\x02}"), memoryview(b'{"entries": []}'), None, 12, "text"):
            assert looks_like_flight_recorder(head) in (True, False)  # type: ignore[arg-type]


def test_rank_from_file_names() -> None:
    data = pickled(v2_2_dump())
    assert parse(data, "/tmp/nccl_trace_rank_12").rank == 12
    assert parse(data, "dumps/rank3.pkl").rank == 3
    assert parse(data, "rank_7.json").rank == 7
    assert parse(data, "dump").rank is None  # no p2p to infer from


def test_the_module_does_not_import_torch() -> None:
    code = "import sys, watchdog.parsing.flight_recorder; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
