"""The NCCL Inspector source over a folder the plugin writes into, fed tick by tick."""

from __future__ import annotations

import json
from pathlib import Path

from ncclwatch.watchdog.events import Event, InspectorProgress, SourceDown, Unusable
from ncclwatch.watchdog.sources.inspector import InspectorSource


def record(seq: int, *, comm: str = "0xabc", rank: int = 0, busbw: float | str = 1.5, kind: str = "coll") -> str:
    """One line as the plugin writes it (inspector_json.cc: header, metadata, then coll_perf or p2p_perf)."""
    perf = (
        {"coll": "AllReduce", "coll_sn": seq, "coll_msg_size_bytes": 32768, "coll_exec_time_us": 40,
         "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": busbw, "coll_busbw_gbs": busbw}
        if kind == "coll"
        else {"p2p": "Send", "p2p_sn": seq, "p2p_peer": 1, "p2p_msg_size_bytes": 4096, "p2p_exec_time_us": 9,
              "p2p_timing_source": "kernel_gpu", "p2p_algobw_gbs": busbw, "p2p_busbw_gbs": busbw}
    )  # fmt: skip
    doc = {
        "header": {"id": comm, "comm_name": "unknown", "rank": rank, "n_ranks": 2, "nnodes": 2},
        "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "x",
                     "rec_mechanism": "nccl_profiler_interface",
                     "dump_timestamp_us": 1_796_000_000_000_000 + seq, "hostname": "node1", "pid": 42},
        f"{kind}_perf": perf,
    }  # fmt: skip
    return json.dumps(doc, separators=(",", ":")) + "\n"


def poll(source: InspectorSource) -> list[Event]:
    events: list[Event] = []
    source.poll(events.append)
    return events


def test_emits_progress_only_when_the_highest_sequence_moves(tmp_path: Path) -> None:
    log = tmp_path / "node1-pid42.log"
    log.write_text(record(1) + record(2))
    source = InspectorSource(tmp_path)
    first = poll(source)
    assert [(e.comm_id, e.rank, e.last_coll_seq) for e in first if isinstance(e, InspectorProgress)] == [
        ("0xabc", 0, 2)
    ]
    assert poll(source) == []  # nothing new: quiet
    with log.open("a") as out:
        out.write(record(2))  # the same sequence again (a re-dump): no progress
    assert poll(source) == []
    with log.open("a") as out:
        out.write(record(5, busbw="nan"))  # the ring dropped 3 and 4: the highest still says how far
    (event,) = poll(source)
    assert isinstance(event, InspectorProgress)
    assert (event.last_coll_seq, event.last_p2p_seq, event.bus_bw_gbs_median) == (5, None, 1.5)
    assert event.cite.file == str(log)


def test_a_line_cut_mid_write_waits_for_its_end(tmp_path: Path) -> None:
    log = tmp_path / "node1-pid42.log"
    line = record(7, kind="p2p")
    log.write_text(line[:50])
    source = InspectorSource(tmp_path)
    assert poll(source) == []
    with log.open("a") as out:
        out.write(line[50:])
    (event,) = poll(source)
    assert isinstance(event, InspectorProgress) and event.last_p2p_seq == 7 and event.last_coll_seq is None


def test_garbage_is_reported_once_and_prometheus_files_are_not_read(tmp_path: Path) -> None:
    (tmp_path / "node1-pid42.log").write_text("not json\n" + record(1, comm="0xdef", rank=1))
    (tmp_path / "nccl_inspector_metrics_GPU-1.prom").write_text('nccl_bus_bandwidth_gbs{gpu="GPU0"} 1.0\n')
    events = poll(InspectorSource(tmp_path))
    assert [type(e) for e in events] == [InspectorProgress, Unusable]
    assert events[0].comm_id == "0xdef" and events[0].rank == 1


def test_a_missing_folder_is_a_down_source(tmp_path: Path) -> None:
    events = poll(InspectorSource(tmp_path / "absent"))
    assert len(events) == 1 and isinstance(events[0], SourceDown)
