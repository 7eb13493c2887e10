"""Write the transport fixtures: NCCL 2.28.9 INIT lines of 2-node, 4-rank jobs, one file per fault.

No InfiniBand here, so the multi-node lines are written from NCCL's format
strings (v2.28.9: init.cc, net_ib.cc, net_socket.cc, net.cc, p2p.cc,
shm.cc, paths.cc; see watchdog/parsing/transport.py), around the preamble
of a real capture (tests/fixtures/captures/nccl-2.28.9-h200x2).  Run from
this folder: python make_logs.py
"""

from pathlib import Path

IB = "NET/IB : Using {devs} [RO]; OOB ib0:{addr}<0>"
NODES = {"node1": ("10.0.0.1", (0, 1)), "node2": ("10.0.0.2", (2, 3))}


def rank_lines(
    host: str,
    addr: str,
    rank: int,
    *,
    network="IB",
    hcas=("mlx5_0", "mlx5_1"),
    channels=16,
    p2p_env=False,
    ib_hca=None,
    comm="0x5581c0a0",
    comm_id="0x8d2c5b0e11f7a3c4",
    nranks=4,
):
    pid, dev = 4100 + rank, rank % 2
    p = f"{host}:{pid}:{pid} [{dev}] NCCL INFO "
    out = [p + "NCCL version 2.28.9+cuda13.0", p + "NET/Plugin: Could not find: libnccl-net.so"]
    if p2p_env:
        out.append(p + "NCCL_P2P_DISABLE set by environment to 1")
    if ib_hca is not None:  # net_ib.cc, NCCL_NET|NCCL_ENV, once per process, before the device list
        out.append(p + f"NCCL_IB_HCA set to {ib_hca}")
    if network == "IB":
        out.append(p + IB.format(devs=" ".join(f"[{i}]{h}:1/IB" for i, h in enumerate(hcas)), addr=addr))
        out += [p + "Initialized NET plugin IB", p + "Assigned NET plugin IB to comm", p + "Using network IB"]
    else:
        out += [
            p + "NET/IB : No device found.",
            p + f"NET/IB : Using [RO]; OOB eth0:{addr}<0>",
            p + "Failed to initialize NET plugin IB",
            p + f"NET/Socket : Using [0]eth0:{addr}<0>",
            p + "Initialized NET plugin Socket",
            p + "Assigned NET plugin Socket to comm",
            p + "NET/Socket: Using 2 threads and 8 sockets per thread",
            p + "Using network Socket",
        ]
    out.append(
        p + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {dev} nvmlDev {dev} "
        f"busId {(6 + dev)}0 commId {comm_id} - Init START"
    )
    out.append(p + f"comm {comm} rank {rank} nRanks {nranks} nNodes 2 localRanks 2 localRank {dev} MNNVL 0")
    out += [p + f"Channel {c:02d}/{channels:02d} : 0 1 2 3" for c in range(channels)]
    out.append(
        p
        + f"{channels} coll channels, {channels} collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer"
    )
    out.append(
        p + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {dev} nvmlDev {dev} "
        f"busId {(6 + dev)}0 commId {comm_id} - Init COMPLETE"
    )
    local, remote = (rank ^ 1), (rank + 1) % 4
    for c in range(channels):
        if p2p_env:
            out.append(p + f"Channel {c:02d} : {rank}[{dev}] -> {local}[{local % 2}] via SHM/direct/direct")
        else:
            out.append(p + f"Channel {c:02d}/0 : {rank}[{dev}] -> {local}[{local % 2}] via P2P/CUMEM/read")
        nic = c % len(hcas) if network == "IB" else 0
        suffix = "/GDRDMA" if network == "IB" else ""
        out.append(
            p + f"Channel {c:02d}/0 : {rank}[{dev}] -> {remote}[{remote % 2}] [send] via NET/{network}/{nic}{suffix}"
        )
        out.append(
            p
            + f"Channel {c:02d}/0 : {(rank + 3) % 4}[{(rank + 3) % 2}] -> {rank}[{dev}] [receive] via NET/{network}/{nic}{suffix}"
        )
    out.append(p + "Connected all rings, use ring PXN 0 GDR 1")
    out.append(
        p
        + f"AllReduce: opCount 0 sendbuff 0x7f1c00000000 recvbuff 0x7f1c00000000 count 67108864 datatype 7 op 0 root 0 comm {comm} [nranks={nranks}] stream 0x55d1c2a0"
    )
    return out


def job(ib_hca=None, **node2) -> str:
    """Every node as node1 except for ``node2``'s differences; ``ib_hca``: the job's NCCL_IB_HCA, on every rank."""
    lines = []
    for host, (addr, ranks) in NODES.items():
        for rank in ranks:
            lines += rank_lines(host, addr, rank, ib_hca=ib_hca, **(node2 if host == "node2" else {}))
    return "\n".join(lines) + "\n"


FAULTS = {
    "healthy-ib.log": {"ib_hca": "mlx5_0,mlx5_1"},
    "socket-fallback-node2.log": {"network": "Socket", "hcas": ()},
    "p2p-disabled-node2.log": {"p2p_env": True},
    # Within one communicator NCCL agrees on one channel count: node2's ranks here form another
    # communicator of the same shape (4 ranks, 2 nodes), as a second data-parallel replica would.
    "missing-hca-node2.log": {
        "hcas": ("mlx5_0",),
        "channels": 8,
        "comm_id": "0x3b9e4f0c2a6d8e17",
        "ib_hca": "=mlx5_0:1,mlx5_1:1",
    },
}

if __name__ == "__main__":
    for name, node2 in FAULTS.items():
        Path(name).write_text(job(**node2))
