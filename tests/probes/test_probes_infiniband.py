"""InfiniBand probe on a fake sysfs tree with the kernel's layout and value formats (no IB here)."""

from __future__ import annotations

from pathlib import Path

from support import COUNTERS, HW, make_port

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


# -- rates, port findings, HCA to GPU through the PCI tree ------------------------------------------

import os  # noqa: E402

from ncclwatch.watchdog.events import rate_bytes_per_s  # noqa: E402
from ncclwatch.watchdog.probes.infiniband import hca_gpu_map  # noqa: E402
from ncclwatch.watchdog.slowness.findings import PerfKind  # noqa: E402
from ncclwatch.watchdog.slowness.links import ib_port_findings  # noqa: E402


def test_rates_and_link_layer(tmp_path):
    make_port(tmp_path, link_layer="InfiniBand")
    assert read_ib_counters(tmp_path)["mlx5_0"]["1"]["link_layer"] == "InfiniBand"
    assert rate_bytes_per_s("400 Gb/sec (4X NDR)") == 50e9 and rate_bytes_per_s("2.5 Gb/sec (1X SDR)") == 0.3125e9
    assert rate_bytes_per_s("N/A") is None and rate_bytes_per_s(None) is None


def test_port_slower_than_its_siblings_down_while_used_and_rising_errors(tmp_path):
    for dev in ("mlx5_0", "mlx5_1", "mlx5_2"):
        make_port(tmp_path, dev, link_layer="InfiniBand")
    make_port(tmp_path, "mlx5_1", rate="40 Gb/sec (4X QDR)", link_layer="InfiniBand")  # renegotiated down: a bad cable
    make_port(tmp_path, "mlx5_2", state="1: DOWN", phys_state="3: Disabled", link_layer="InfiniBand")
    make_port(
        tmp_path, "mlx5_3", state="1: DOWN", phys_state="2: Polling", link_layer="InfiniBand"
    )  # unused: not flagged
    before = read_ib_counters(tmp_path)
    make_port(tmp_path, "mlx5_1", rate="40 Gb/sec (4X QDR)", link_layer="InfiniBand", counters__symbol_error=12)
    after = read_ib_counters(tmp_path)
    found = {
        f.key: f
        for f in ib_port_findings(
            "node7",
            after,
            ib_delta(before, after, 10.0),
            used=["mlx5_0/1", "mlx5_1/1", "mlx5_2/1"],
            port_ranks={"mlx5_1/1": [5]},
        )
    }
    assert set(found) == {"ib_port-rate-node7-mlx5_1/1", "ib_port-down-node7-mlx5_2/1", "ib_port-errors-node7-mlx5_1/1"}
    rate = found["ib_port-rate-node7-mlx5_1/1"]
    assert rate.kind is PerfKind.ib_port and (rate.measured, rate.expected) == (5e9, 50e9) and rate.ranks == (5,)
    assert "its siblings at 400 Gb/sec; nearest ranks: 5" in rate.summary
    assert "symbol_error +12" in found["ib_port-errors-node7-mlx5_1/1"].summary


def test_healthy_ports_raise_nothing(tmp_path):
    for dev in ("mlx5_0", "mlx5_1"):
        make_port(tmp_path, dev)
    reading = read_ib_counters(tmp_path)
    assert ib_port_findings("n", reading, ib_delta(reading, reading, 1.0), used=["mlx5_0/1", "mlx5_1/1"]) == []


def pci_tree(sys: Path) -> None:
    """Two root ports, each with a PCIe switch holding one HCA and one GPU (a DGX-like pairing).

    Links as sysfs has them.
    """
    devices = sys / "devices" / "pci0000:00"
    layout = {
        "mlx5_0": "0000:00:01.0/0000:10:00.0/0000:11:00.0/0000:12:00.0",
        "mlx5_1": "0000:00:02.0/0000:20:00.0/0000:21:00.0/0000:22:00.0",
        "gpu:0000:13:00.0": "0000:00:01.0/0000:10:00.0/0000:11:01.0/0000:13:00.0",
        "gpu:0000:23:00.0": "0000:00:02.0/0000:20:00.0/0000:21:01.0/0000:23:00.0",
    }
    for name, rel in layout.items():
        path = devices / rel
        path.mkdir(parents=True)
        if name.startswith("gpu:"):
            (path / "vendor").write_text("0x10de\n")
            (path / "class").write_text("0x030200\n")
            link = sys / "bus" / "pci" / "devices" / name[4:]
        else:
            (sys / "class" / "infiniband" / name / "ports").mkdir(parents=True)
            link = sys / "class" / "infiniband" / name / "device"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(path, link.parent))
    nic = devices / "0000:00:03.0"  # an Ethernet NIC: not NVIDIA, not a GPU
    nic.mkdir()
    (nic / "vendor").write_text("0x8086\n")
    (nic / "class").write_text("0x020000\n")
    (sys / "bus" / "pci" / "devices" / "0000:00:03.0").symlink_to(nic)


def test_hca_to_gpu_by_common_pci_ancestor(tmp_path):
    pci_tree(tmp_path)
    got = hca_gpu_map(tmp_path)
    assert got["hcas"]["mlx5_0"] == {"pci": "0000:12:00.0", "gpus": ["0000:13:00.0"], "hops": 4}
    assert got["hcas"]["mlx5_1"]["gpus"] == ["0000:23:00.0"]
    assert got["gpus"] == {"0000:13:00.0": ["mlx5_0"], "0000:23:00.0": ["mlx5_1"]}


def test_gpus_named_by_nvml_bus_ids_and_no_ib(tmp_path):
    pci_tree(tmp_path)
    assert hca_gpu_map(tmp_path, ["00000000:23:00.0"])["gpus"] == {"0000:23:00.0": ["mlx5_1"]}
    assert hca_gpu_map(tmp_path / "empty") == {"hcas": {}, "gpus": {}}
