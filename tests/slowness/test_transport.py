"""NCCL INIT lines -> transports per rank (real 2.28.9 captures and recorded 2-node lines), and the anomaly rules."""

from __future__ import annotations

from dataclasses import replace

from conftest import CAPTURES, DATA

from ncclwatch.watchdog.events import ProcKey
from ncclwatch.watchdog.parsing.transport import TransportScanner, parse_transport
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.slowness.links import hca_spec_entries, rank_links, transport_anomalies

LOGS = DATA / "transport"


def facts(name: str):
    return parse_transport((LOGS / name).read_bytes())


class TestParse:
    def test_real_single_node_capture_is_p2p_with_sockets_listed(self):
        files = sorted((CAPTURES / "nccl-2.28.9-h200x2" / "none" / "nccl").iterdir())
        records = [r for f in files for r in parse_transport(f.read_bytes())]
        assert [(r.rank, r.nranks, r.nnodes, r.local_ranks) for r in records] == [(0, 2, 1, 2), (1, 2, 1, 2)]
        first = records[0]
        assert (first.network, first.ib_absent, first.coll_channels, first.nvls_channels, first.p2p_channels) == (
            "Socket",
            True,
            24,
            0,
            32,
        )
        assert first.connections == {"P2P/CUMEM": 56} and first.socket_devices[0].name == "eth0"
        assert first.comm_ptr == "0x450e4fb0" and first.links() == ()

    def test_ib_devices_ports_and_the_nics_each_rank_uses(self):
        records = facts("healthy-ib.log")
        assert len(records) == 4
        r0 = records[0]
        assert [(d.index, d.name, d.port, d.link_layer) for d in r0.ib_devices] == [
            (0, "mlx5_0", 1, "IB"),
            (1, "mlx5_1", 1, "IB"),
        ]
        assert r0.connections == {"P2P/CUMEM": 16, "NET/IB": 32} and r0.gdr is True
        assert r0.links() == ("mlx5_0/1", "mlx5_1/1")
        assert rank_links(records) == {r: ("mlx5_0/1", "mlx5_1/1") for r in range(4)}

    def test_socket_fallback_shm_and_thread_lines(self):
        node2 = [r for r in facts("socket-fallback-node2.log") if r.proc.host == "node2"]
        assert {r.network for r in node2} == {"Socket"} and node2[0].connections["NET/Socket"] == 32
        assert node2[0].socket_threads == (2, 8) and node2[0].links() == ("eth0",)
        shm = [r for r in facts("p2p-disabled-node2.log") if r.proc.host == "node2"][0]
        assert (
            shm.connections == {"SHM": 16, "NET/IB": 32}
            and shm.p2p_disabled == "NCCL_P2P_DISABLE set by environment to 1"
        )

    def test_incremental_feed_across_line_breaks_matches_whole_file(self):
        data = (LOGS / "healthy-ib.log").read_bytes()
        scanner = TransportScanner()
        for start in range(0, len(data), 777):  # chunks that cut lines anywhere
            scanner.feed(data[start : start + 777])
        scanner.feed(b"", final=True)
        assert scanner.facts() == parse_transport(data)

    def test_other_formats_p2p_variants_and_proxy_ranks(self):
        lines = (
            "\n".join(
                [
                    "h:1:1 [0] NCCL INFO comm 0xa rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0",
                    # 2.18
                    "h:1:1 [0] NCCL INFO 2 coll channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer",
                    "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read",
                    "h:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 2[2] via P2P/indirect/1[1]",
                    "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 3[3] via P2P/direct pointer",
                    "h:1:1 [0] NCCL INFO Channel 01/1 : 0[0] -> 5[5] [send] via NET/IB/3(1)/GDRDMA(PCI)/Shared",
                    "[2026-04-28 14:14:42] h:1:1 [0] NCCL INFO Channel 02 : 0[0] -> 1[1] via SHM/direct",
                ]
            )
            + "\n"
        )
        (r,) = parse_transport(lines)
        assert r.coll_channels == 2 and r.connections == {
            "P2P/IPC": 1,
            "P2P/indirect": 1,
            "P2P/direct": 1,
            "NET/IB": 1,
            "SHM": 1,
        }
        assert r.net_devices_used == (3,) and r.gdr is True


GLOBAL = {ProcKey(h, 4100 + r): r for h, rs in (("node1", (0, 1)), ("node2", (2, 3))) for r in rs}


class TestAnomalies:
    def test_healthy_two_node_ib_job_raises_nothing(self):
        records = facts("healthy-ib.log")
        assert {r.ib_hca for r in records} == {"mlx5_0,mlx5_1"}  # "NCCL_IB_HCA set to", each process's own
        assert transport_anomalies(records, global_ranks=GLOBAL) == []

    def test_a_node_on_sockets_among_ib_nodes(self):
        found = {f.key: f for f in transport_anomalies(facts("socket-fallback-node2.log"), global_ranks=GLOBAL)}
        network = found["transport-network-node2"]
        assert network.ranks == (2, 3) and "uses network Socket while the other nodes use IB" in network.summary
        assert found["transport-hcas-node2"].links == ("mlx5_0", "mlx5_1")  # it listed no HCA at all

    def test_p2p_disabled_node_is_named_with_the_reason(self):
        (finding,) = transport_anomalies(facts("p2p-disabled-node2.log"), global_ranks=GLOBAL)
        assert (finding.kind, finding.hosts, finding.ranks) == (PerfKind.transport_anomaly, ("node2",), (2, 3))
        assert "SHM" in finding.summary and "NCCL_P2P_DISABLE set by environment to 1" in finding.summary

    def test_missing_hca_fewer_channels_and_ib_hca_entry(self):
        found = {f.key: f for f in transport_anomalies(facts("missing-hca-node2.log"), global_ranks=GLOBAL)}
        assert set(found) == {"transport-hcas-node2", "transport-channels-node2", "transport-ib_hca-node2"}
        assert found["transport-hcas-node2"].links == ("mlx5_1",)
        assert (
            "8 channels" in found["transport-channels-node2"].summary
            and "have 16" in found["transport-channels-node2"].summary
        )
        assert (
            "did not find mlx5_1:1 named in NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" in found["transport-ib_hca-node2"].summary
        )
        assert found["transport-ib_hca-node2"].ranks == (2, 3)

    def test_each_process_is_held_to_its_own_ib_hca(self):
        """One rank's launch script named an HCA its node lacks; the others named none: only that rank is flagged,
        and a process whose NCCL logged no NCCL_IB_HCA is never held to another's."""
        records = [replace(r, ib_hca=None) for r in facts("healthy-ib.log")]
        assert transport_anomalies(records, global_ranks=GLOBAL) == []
        odd = [replace(r, ib_hca="mlx5_4:1") if r.proc == ProcKey("node2", 4103) else r for r in records]
        (finding,) = transport_anomalies(odd, global_ranks=GLOBAL)
        assert (finding.key, finding.ranks) == ("transport-ib_hca-node2", (3,))
        assert "did not find mlx5_4:1 named in NCCL_IB_HCA=mlx5_4:1" in finding.summary

    def test_sockets_while_sysfs_shows_active_ib(self):
        records = [r for r in facts("socket-fallback-node2.log") if r.proc.host == "node2"]
        assert transport_anomalies(records) == []  # one node alone has no peers
        (finding,) = transport_anomalies(records, active_ib_ports={"node2": ["mlx5_0/1"]})
        assert finding.key == "transport-socket_with_ib-node2" and finding.links == ("mlx5_0/1",)

    def test_ib_hca_syntax(self):
        assert hca_spec_entries("^mlx5_3") == (True, False, [("mlx5_3", None)])
        assert hca_spec_entries("=mlx5_0:1,mlx5_1") == (False, True, [("mlx5_0", 1), ("mlx5_1", None)])
        prefixed = [replace(r, ib_hca="mlx5") for r in facts("healthy-ib.log")]
        assert transport_anomalies(prefixed) == []  # a prefix matches every mlx5_*
        assert transport_anomalies([replace(r, ib_hca="^mlx5_9") for r in prefixed]) == []  # an exclusion lists no need

    def test_one_rank_with_fewer_sockets_is_named_among_ranks_of_one_host(self):
        """As on the H100 run of bench/slow_links.py: four ranks on one machine (own NCCL_HOSTID each), rank 3's
        environment limited to 1 thread x 1 socket; the host alone cannot say which rank, the finding must."""
        lines = []
        for rank in range(4):
            threads = (1, 1) if rank == 3 else (4, 4)
            prefix = f"vm:{700 + rank}:{700 + rank} [0] NCCL INFO "
            lines += [
                prefix + "Using network Socket",
                prefix + f"NET/Socket: Using {threads[0]} threads and {threads[1]} sockets per thread",
                prefix + f"comm 0x5{rank} rank {rank} nRanks 4 nNodes 4 localRanks 1 localRank 0 MNNVL 0",
            ]
        (finding,) = transport_anomalies(parse_transport("\n".join(lines) + "\n"))
        assert finding.ranks == (3,) and finding.hosts == ("vm",)
        assert finding.summary == "NCCL on rank 3 (vm) opens 1 socket per connection where the other ranks open 16"
