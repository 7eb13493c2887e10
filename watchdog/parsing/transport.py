"""NCCL's INIT lines -> which transport each rank's connections use (``events.RankTransport``).

Formats, from NCCL's source (2.18-2.29; file:format at v2.28.9)::

    init.cc         comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d
    init.cc         %d coll channels, %d collnet channels, %d nvls channels, %d p2p channels, %d p2p channels per peer
                    (2.18: no collnet)
    init.cc         Using network %s                                  ("IB", "Socket", a plugin's name)
    net_ib.cc       NCCL_IB_HCA set to %s                             (NET|ENV subsystem, once per process)
    net_ib.cc       NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB ib0:10.0.0.1<0>
                    (2.29: "[0]mlx5_0:1:<rail>/IB" or "[0]mlx5_0:1::<plane>/IB" may follow the port)
                    NET/IB : No device found.
    net_socket.cc   NET/Socket : Using [0]eth0:192.0.2.2<0> [1]eth1:...
                    NET/Socket: Using %d threads and %d sockets per thread
    p2p.cc          Channel %02d/%01d : %d[%d] -> %d[%d] via <p2p> [/read] [/CE]
                    (<p2p>: P2P/CUMEM|P2P/IPC|P2P/direct pointer|P2P/indirect/%d[%d])
    shm.cc          Channel %02d : %d[%d] -> %d[%d] via SHM/direct/direct   (later: via SHM/direct)
    net.cc          Channel %02d/%d : %d[%d] -> %d[%d] [send]|[receive] via NET/%s/%d[(%d)][/GDRDMA[(PCI)]][/Shared]
    paths.cc        NCCL_P2P_DISABLE set by environment to 1 / NCCL_P2P_LEVEL set by environment to LOC
                    P2P is disabled between connected GPUs %d and %d. ...

Traps: the channel and channel-count lines do not name their communicator.
The count line comes between a communicator's ``Init START`` and
``Init COMPLETE``; connections are made lazily (2.28: at the first
collective), after COMPLETE.  Both are given to the communicator whose init
the process started last, which is right for the usual one-init-at-a-time
job and can be wrong for a process that creates several communicators and
then runs on an older one first.  ``[d]`` after a rank is its NVML device.

Failure modes: lines that are not NCCL's, or not about transports, are
skipped; a process whose init lines were not seen gives ``None`` fields,
never a guess.  The scanner looks only at lines holding one of a few
markers (``marker_lines``: one ``bytes.find`` pass per marker, in C), so
feeding it a whole debug file, operation lines and all, costs little;
``ncclwatch analyze`` gives it only the lines the NCCL parser's pass found
(``inputs.TextIngest``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ncclwatch.watchdog.events import NetDevice, ProcKey, RankTransport

# A line holding none of these is not read (``inputs.TextIngest`` skips the chunks that hold none).
MARKERS = (
    b" via ",
    b"NET/",
    b"coll channels",
    b"nNodes",
    b"Using network",
    b"P2P is disabled",
    b"set by environment",
    b"IB_HCA set",
    b" - Init START",
)
_LINE_RE = re.compile(r"(?:\[[^\]\n]*\]:? ?)*([^:\s\[\]]+):(\d+):\d+ \[(\d+)\] NCCL INFO (.*)")
_TOPO_RE = re.compile(r"comm (\S+) rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank \d+")
_INIT_RE = re.compile(
    r"comm (\S+) rank (\d+) nranks (\d+)(?: cudaDev (-?\d+))?(?: nvmlDev -?\d+)?(?: busId (\w+))?.*- Init START"
)
_COUNTS_RE = re.compile(r"(\d+) coll channels, (?:(\d+) collnet channels, )?(\d+) nvls channels, (\d+) p2p channels")
_CHANNEL_RE = re.compile(
    r"Channel \d+(?:/\d+)? : (\d+)\[\d+\] -> (\d+)\[\d+\] (?:\[(send|receive)\] )?via (\S+(?: pointer)?)"
)
_IB_DEV_RE = re.compile(r"\[(\d+)\]([^:\s\]]+):(\d+)(?::\d*)?(?::\d+)?/(\w+)")
_SOCKET_DEV_RE = re.compile(r"\[(\d+)\]([^:\s\]]+):(\S+)")
_THREADS_RE = re.compile(r"NET/Socket: Using (\d+) threads and (\d+) sockets per thread")


@dataclass
class _Process:
    """Facts one process states once, for all its communicators."""

    network: str | None = None
    ib_devices: tuple[NetDevice, ...] = ()
    ib_absent: bool = False
    socket_devices: tuple[NetDevice, ...] = ()
    socket_threads: tuple[int, int] | None = None
    ib_hca: str | None = None
    p2p_disabled: str | None = None
    current: str | None = None  # the communicator whose init started last


class TransportScanner:
    """Incremental: ``feed`` bytes of a NCCL debug file (any process mix), ``facts()`` at any time."""

    def __init__(self) -> None:
        self._carry = b""
        self._procs: dict[ProcKey, _Process] = {}
        self._comms: dict[tuple[ProcKey, str | None], dict] = {}
        self._net_used: dict[tuple[ProcKey, str | None], dict[int, None]] = {}

    def feed(self, data: bytes, final: bool = False) -> None:
        body = self._carry + data
        stop = len(body) if final else body.rfind(b"\n") + 1
        self._carry = body[stop:]
        self.take(marker_lines(body, stop))

    def take(self, lines: list[bytes]) -> None:
        """Lines ``marker_lines`` found, in order (a process's lines may be split over several files)."""
        for line in lines:
            self._line(line.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        head = _LINE_RE.search(line)
        if head is None:
            return
        proc, message = ProcKey(head[1], int(head[2])), head[4]
        info = self._procs.setdefault(proc, _Process())
        if (init := _INIT_RE.search(message)) is not None:
            info.current = init[1]
            self._comm(proc, init[1]).update(
                rank=int(init[2]),
                nranks=int(init[3]),
                bus_id=init[5],
                cuda_dev=int(init[4]) if init[4] else int(head[3]),
            )
        elif (topo := _TOPO_RE.search(message)) is not None:
            info.current = topo[1]
            self._comm(proc, topo[1]).update(
                rank=int(topo[2]), nranks=int(topo[3]), nnodes=int(topo[4]), local_ranks=int(topo[5])
            )
        elif (counts := _COUNTS_RE.search(message)) is not None:
            self._comm(proc, info.current).update(
                coll_channels=int(counts[1]), nvls_channels=int(counts[3]), p2p_channels=int(counts[4])
            )
        elif (channel := _CHANNEL_RE.search(message)) is not None:
            self._connection(proc, info.current, channel[4])
        else:
            self._process_line(info, message)

    def _process_line(self, info: _Process, message: str) -> None:
        if message.startswith("Using network "):
            info.network = message.removeprefix("Using network ").strip()
        elif message.startswith("NET/IB : Using"):
            info.ib_devices = tuple(
                NetDevice(int(i), name, int(port), ll)
                for i, name, port, ll in _IB_DEV_RE.findall(message.partition(";")[0])
            )
        elif message.startswith("NCCL_IB_HCA set to "):
            info.ib_hca = message.removeprefix("NCCL_IB_HCA set to ").strip()
        elif message.startswith("NET/IB : No device found"):
            info.ib_absent = True
        elif message.startswith("NET/Socket : Using"):
            info.socket_devices = tuple(
                NetDevice(int(i), name, address=addr) for i, name, addr in _SOCKET_DEV_RE.findall(message)
            )
        elif (threads := _THREADS_RE.search(message)) is not None:
            info.socket_threads = (int(threads[1]), int(threads[2]))
        elif "P2P is disabled" in message or message.startswith(("NCCL_P2P_DISABLE set", "NCCL_P2P_LEVEL set")):
            info.p2p_disabled = info.p2p_disabled or message.strip()

    def _comm(self, proc: ProcKey, comm_ptr: str | None) -> dict:
        return self._comms.setdefault((proc, comm_ptr), {"connections": Counter()})

    def _connection(self, proc: ProcKey, comm_ptr: str | None, via: str) -> None:
        comm = self._comm(proc, comm_ptr)
        parts = via.split("/")
        if parts[0] == "NET" and len(parts) >= 3:
            comm["connections"][f"NET/{parts[1]}"] += 1
            device = re.match(r"\d+", parts[2])
            if device is not None:
                self._net_used.setdefault((proc, comm_ptr), {})[int(device[0])] = None
            comm["gdr"] = comm.get("gdr", False) or "GDRDMA" in via
        elif parts[0] == "P2P" and len(parts) >= 2:
            comm["connections"]["P2P/" + parts[1].split()[0]] += 1
        else:
            comm["connections"][parts[0]] += 1

    def facts(self) -> list[RankTransport]:
        """One ``RankTransport`` per (process, communicator) seen, in first-seen order."""
        out = []
        for (proc, comm_ptr), fields in self._comms.items():
            info = self._procs[proc]
            out.append(
                RankTransport(
                    proc=proc,
                    comm_ptr=comm_ptr,
                    rank=fields.get("rank"),
                    **{k: v for k, v in fields.items() if k not in ("rank", "connections")},
                    connections=dict(fields["connections"]),
                    net_devices_used=tuple(self._net_used.get((proc, comm_ptr), {})),
                    network=info.network,
                    ib_devices=info.ib_devices,
                    ib_absent=info.ib_absent,
                    socket_devices=info.socket_devices,
                    socket_threads=info.socket_threads,
                    ib_hca=info.ib_hca,
                    p2p_disabled=info.p2p_disabled,
                )
            )
        return out


def marker_lines(body: bytes, stop: int | None = None) -> list[bytes]:
    """The lines of body[:stop] holding a marker, in order (``TransportScanner.take`` reads them).

    One ``bytes.find`` pass per marker (in C; a regex alternation costs five times as much), then the lines in
    the order they stand.
    """
    stop = len(body) if stop is None else stop
    starts: dict[int, int] = {}
    for marker in MARKERS:
        pos = body.find(marker, 0, stop)
        while pos != -1:
            start = body.rfind(b"\n", 0, pos) + 1
            end = body.find(b"\n", pos + len(marker), stop)
            end = stop if end < 0 else end
            starts[start] = end
            pos = body.find(marker, end, stop)
    return [body[start : starts[start]] for start in sorted(starts)]


def parse_transport(data: bytes | str) -> list[RankTransport]:
    """A whole NCCL debug file (or several concatenated) -> its ``RankTransport`` records."""
    scanner = TransportScanner()
    scanner.feed(data.encode() if isinstance(data, str) else data, final=True)
    return scanner.facts()
