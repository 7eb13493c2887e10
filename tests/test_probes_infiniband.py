"""InfiniBand probe on a fake sysfs tree with the kernel's layout and value formats (no IB here)."""

from __future__ import annotations

from test_evidence_support import COUNTERS, HW, make_port

from ncclwatch.watchdog.probes.infiniband import ib_delta, read_ib_counters


def test_reads_states_and_counters(tmp_path):
    make_port(tmp_path)
    make_port(tmp_path, "mlx5_1", 1, state="1: DOWN", phys_state="3: Disabled")
    (tmp_path / "mlx5_0" / "device").mkdir()  # the other entries of a device folder are not ports
    got = read_ib_counters(tmp_path)
    assert set(got) == {"mlx5_0", "mlx5_1"}
    port = got["mlx5_0"]["1"]
    assert (port["state"], port["phys_state"], port["rate"]) == ("4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
    assert port["counters"] == COUNTERS and port["hw_counters"] == HW
    assert got["mlx5_1"]["1"]["state"] == "1: DOWN"


def test_unreadable_or_odd_counter_is_left_out(tmp_path):
    base = make_port(tmp_path, counters__port_rcv_data="N/A")
    (base / "counters" / "unit_test_dir").mkdir()  # reading a directory fails: skipped, no exception
    got = read_ib_counters(tmp_path)["mlx5_0"]["1"]["counters"]
    assert "port_rcv_data" not in got and "unit_test_dir" not in got and got["port_xmit_data"] == 1000


def test_no_infiniband_is_none(tmp_path):
    assert read_ib_counters(tmp_path / "absent") is None
    assert read_ib_counters(tmp_path) is None  # the class folder exists but holds no device


def test_delta_converts_words_to_bytes_and_rates(tmp_path):
    make_port(tmp_path)
    before = read_ib_counters(tmp_path)
    make_port(tmp_path, counters__port_xmit_data=1000 + 250_000, counters__port_rcv_data=2000 + 500)
    after = read_ib_counters(tmp_path)
    port = ib_delta(before, after, 2.0)["ports"]["mlx5_0/1"]
    assert port["xmit_bytes"] == 1_000_000 and port["xmit_bytes_per_s"] == 500_000.0
    assert port["rcv_bytes"] == 2000 and port["rcv_bytes_per_s"] == 1000.0
    assert port["counters"]["port_xmit_data"] == 250_000


def test_idle_link_flags_nothing(tmp_path):
    make_port(tmp_path)
    same = read_ib_counters(tmp_path)
    delta = ib_delta(same, same, 1.0)
    assert delta["errors"] == [] and delta["ports"]["mlx5_0/1"]["errors"] == {}
    assert delta["ports"]["mlx5_0/1"]["xmit_bytes_per_s"] == 0.0


def test_moving_error_counters_are_flagged(tmp_path):
    make_port(tmp_path)
    before = read_ib_counters(tmp_path)
    make_port(
        tmp_path,
        counters__symbol_error=3,
        counters__port_xmit_wait=900,  # congestion, not an error
        hw_counters__local_ack_timeout_err=2,
        hw_counters__np_cnp_sent=50,  # not watched
    )
    delta = ib_delta(before, read_ib_counters(tmp_path), 1.0)
    assert delta["errors"] == ["mlx5_0/1 symbol_error +3", "mlx5_0/1 local_ack_timeout_err +2"]
    assert delta["ports"]["mlx5_0/1"]["errors"] == {"symbol_error": 3, "local_ack_timeout_err": 2}


def test_link_going_down_and_counter_reset(tmp_path):
    make_port(tmp_path, counters__port_rcv_data=10_000)
    before = read_ib_counters(tmp_path)
    make_port(tmp_path, state="1: DOWN", phys_state="2: Polling", counters__port_rcv_data=7)
    delta = ib_delta(before, read_ib_counters(tmp_path), 1.0)
    port = delta["ports"]["mlx5_0/1"]
    assert port["reset"] == ["port_rcv_data"] and port["rcv_bytes"] is None
    assert delta["errors"] == ["mlx5_0/1 state 4: ACTIVE -> 1: DOWN", "mlx5_0/1 phys_state 5: LinkUp -> 2: Polling"]


def test_port_seen_only_once_is_skipped(tmp_path):
    make_port(tmp_path)
    before = read_ib_counters(tmp_path)
    make_port(tmp_path, "mlx5_1")
    assert set(ib_delta(before, read_ib_counters(tmp_path), 1.0)["ports"]) == {"mlx5_0/1"}
