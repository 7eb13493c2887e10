"""Builders for NCCL debug lines in the exact 2.28.9 format (see the shared fixtures)."""

from __future__ import annotations

COMM_ID = "0x678a9195a2e6ef0d"


def prefix(rank: int, host: str = "node1", pid: int | None = None) -> str:
    return f"{host}:{pid or 1000 + rank}:{pid or 1000 + rank} [{rank}] NCCL INFO "


def init(rank: int, nranks: int, comm: str, comm_id: str = COMM_ID, host: str = "node1", pid: int | None = None) -> str:
    lines = []
    for phase in ("START", "COMPLETE"):
        lines.append(
            prefix(rank, host, pid)
            + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks {nranks} cudaDev {rank} nvmlDev {rank} "
            f"busId {rank}0 commId {comm_id} - Init {phase}"
        )
        if phase == "START":
            lines.append(
                prefix(rank, host, pid)
                + f"comm {comm} rank {rank} nRanks {nranks} nNodes 1 localRanks {nranks} localRank {rank} MNNVL 0"
            )
    return "\n".join(lines) + "\n"


def op(
    rank: int,
    name: str,
    count: int,
    comm: str,
    root: int = 0,
    dtype: int = 7,
    host: str = "node1",
    pid: int | None = None,
) -> str:
    send = "(nil)" if name in ("Send", "Recv") else "0x7f2963e05000"
    return (
        prefix(rank, host, pid)
        + f"{name}: opCount 0 sendbuff {send} recvbuff 0x7f2963e05600 count {count} datatype {dtype} op 0 root {root} "
        f"comm {comm} [nranks=2] stream 0x1f481490\n"
    )


def destroy(
    rank: int, nranks: int, comm: str, kind: str = "Destroy", host: str = "node1", pid: int | None = None
) -> str:
    return (
        prefix(rank, host, pid)
        + f"comm {comm} rank {rank} nranks {nranks} cudaDev {rank} busId {rank}0 - {kind} COMPLETE\n"
    )


STEP = (("AllReduce", 4195328), ("AllReduce", 16777216), ("AllGather", 1024), ("Broadcast", 1024))


def steps(rank: int, comm: str, n: int, **kw) -> str:
    return "".join(op(rank, name, count, comm, **kw) for _ in range(n) for name, count in STEP)
