"""NCCL Inspector output -> completed operations and per-communicator progress.

No capture of our own yet (the device runs of issue 45 got no machine): the
records below are the plugin's documented examples (NVIDIA/nccl 5067397c,
plugins/profiler/inspector/README.md), one line each as its writer emits them
(inspector_json.cc: an object, then a newline), and lines built field by
field in the writer's order.  Replace them with tests/fixtures/inspector/
once `bash bench/signal_cost.sh` has run on a GPU.
"""

from __future__ import annotations

import json

from ncclwatch.watchdog.parsing.inspector import (
    InspectorJsonParser,
    looks_like_inspector,
    parse_inspector_json,
    parse_inspector_prom,
    progress,
)

# README "Output Example": a v4.0 record of an older build, without comm_name and timing source.
README_PLAIN = (
    '{"header":{"id":"0x7f8c496ae9f661","rank":2,"n_ranks":8,"nnodes":1},"metadata":{"inspector_output_format_version":'
    '"v4.0","git_rev":"","rec_mechanism":"profiler_plugin","dump_timestamp_us":1748030377748202,"hostname":'
    '"example-hostname","pid":1639453},"coll_perf":{"coll":"AllReduce","coll_sn":1407,"coll_msg_size_bytes":'
    '17179869184,"coll_exec_time_us":61974,"coll_algobw_gbs":277.210914,"coll_busbw_gbs":485.119099}}'
)
# README "Output Example Verbose": with the timing source and the event trace.
README_VERBOSE = (
    '{"header":{"id":"0xe62dedaa97644a","rank":4,"n_ranks":8,"nnodes":1},"metadata":{"inspector_output_format_version":'
    '"v4.0","git_rev":"9019a1912-dirty","rec_mechanism":"nccl_profiler_interface","dump_timestamp_us":1752867229276385,'
    '"hostname":"example-hostname","pid":438776},"coll_perf":{"coll":"ReduceScatter","coll_sn":1231,'
    '"coll_msg_size_bytes":2147483648,"coll_exec_time_us":41057,"coll_timing_source":"kernel_gpu","coll_algobw_gbs":'
    '418.439467,"coll_busbw_gbs":366.134533,"event_trace_sn":{"coll_start_sn":1,"coll_stop_sn":2,"kernel_events":'
    '[{"channel_id":0,"kernel_start_sn":3,"kernel_stop_sn":48,"kernel_record_sn":47}]},"event_trace_ts":'
    '{"coll_start_ts":1752867229235059,"coll_stop_ts":1752867229235064,"kernel_events":[{"channel_id":0,'
    '"kernel_start_ts":1752867229235181,"kernel_stop_ts":1752867229275811,"kernel_record_ts":1752867229275811}]}}}'
)


def line(seq: int, *, comm: str = "0x5ec1", rank: int = 0, pid: int = 7, kind: str = "coll", busbw: object = 0.5):
    """A record in the writer's field order (inspector_json.cc, this version: comm_name in the header)."""
    perf = {
        kind: "AllReduce" if kind == "coll" else "Recv",
        f"{kind}_sn": seq,
        **({"p2p_peer": 1} if kind == "p2p" else {}),
        f"{kind}_msg_size_bytes": 32768,
        f"{kind}_exec_time_us": 60 + seq,
        f"{kind}_timing_source": "kernel_gpu",
        f"{kind}_algobw_gbs": busbw,
        f"{kind}_busbw_gbs": busbw,
    }
    doc = {
        "header": {"id": comm, "comm_name": "unknown", "rank": rank, "n_ranks": 2, "nnodes": 2},
        "metadata": {
            "inspector_output_format_version": "v4.0",
            "git_rev": "nccl-5067397c",
            "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": 1_796_000_000_000_000 + seq,
            "hostname": "node1",
            "pid": pid,
        },
        f"{kind}_perf": perf,
    }
    return json.dumps(doc, separators=(",", ":"))


def test_reads_both_documented_records() -> None:
    plain, verbose = parse_inspector_json(f"{README_PLAIN}\n{README_VERBOSE}\n".encode())
    assert (plain.comm_id, plain.comm_name, plain.rank, plain.nranks, plain.op, plain.seq) == (
        "0x7f8c496ae9f661",
        "unknown",
        2,
        8,
        "AllReduce",
        1407,
    )
    assert (plain.size_bytes, plain.exec_us, plain.timing_source, plain.bus_bw_gbs) == (
        17179869184,
        61974,
        None,
        485.119099,
    )
    assert (verbose.op, verbose.seq, verbose.timing_source, verbose.host, verbose.pid) == (
        "ReduceScatter",
        1231,
        "kernel_gpu",
        "example-hostname",
        438776,
    )
    assert verbose.dumped_at_us == 1752867229276385


def test_progress_is_the_highest_sequence_per_communicator_and_rank_not_a_count() -> None:
    # The ring dropped 3..9 between two dumps; p2p sequence numbers count apart from collectives.
    text = "\n".join([line(1), line(2), line(10), line(1, comm="0xbeef"), line(4, kind="p2p"), line(1, rank=1, pid=8)])
    by_key = {(p.comm_id, p.rank): p for p in progress(parse_inspector_json(text.encode()))}
    main = by_key["0x5ec1", 0]
    assert (main.last_coll_seq, main.last_p2p_seq, main.records, main.last_op) == (10, 4, 4, "AllReduce")
    assert main.exec_us_median == (62 + 64) / 2  # median of 61, 62, 64, 70
    assert by_key["0xbeef", 0].last_coll_seq == 1 and by_key["0xbeef", 0].last_p2p_seq is None
    assert by_key["0x5ec1", 1].pid == 8


def test_nan_bandwidth_is_no_bandwidth_and_stays_out_of_the_median() -> None:
    ops = parse_inspector_json("\n".join([line(1, busbw="nan"), line(2, busbw=3.0)]).encode())
    assert [op.bus_bw_gbs for op in ops] == [None, 3.0]
    (only,) = progress(ops)
    assert only.bus_bw_gbs_median == 3.0


def test_a_partial_line_waits_and_garbage_is_counted_not_raised() -> None:
    parser = InspectorJsonParser()
    whole = line(5)
    assert parser.feed(b"{not json}\n" + whole[:30].encode()) == []
    assert parser.garbled == 1
    (op,) = parser.feed(whole[30:].encode() + b"\n")
    assert op.seq == 5
    assert parser.feed(line(6).encode()) == []  # no newline yet: the writer may be mid-record
    assert [op.seq for op in parser.close()] == [6]


def test_sniffs_its_records_and_not_other_json() -> None:
    assert looks_like_inspector(README_VERBOSE.encode())
    assert not looks_like_inspector(b'{"pid": 1, "rank": 0, "step": 3, "time": 1.0}')


def test_prometheus_text_as_documented() -> None:
    text = (
        "# HELP nccl_bus_bandwidth_gbs NCCL bus bandwidth\n"
        'nccl_bus_bandwidth_gbs{version="v5.1",slurm_job_id="unknown",node="nvl72004-T01",gpu="GPU0",'
        'comm_name="DP Group 0",n_nodes="1",nranks="4",collective="AllReduce",message_size="4-5GB",'
        'algo_proto="Ring_ll"} 678.263\n'
        'nccl_p2p_exec_time_microseconds{version="v5.1",gpu="GPU0",comm_name="DP Group 0",p2p_operation="Send",'
        'message_size="512-513MB"} 1154.87\n'
        "garbage line without a value\n"
    )
    bus, p2p = parse_inspector_prom(text)
    assert (bus.name, bus.value, bus.label("comm_name"), bus.label("message_size")) == (
        "nccl_bus_bandwidth_gbs",
        678.263,
        "DP Group 0",
        "4-5GB",
    )
    assert (p2p.label("p2p_operation"), p2p.value, p2p.label("collective")) == ("Send", 1154.87, None)
