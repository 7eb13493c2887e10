"""The GPU driver's Xids (kernel log) in a verdict: whose GPU each is, and when one makes it ``gpu_xid``.

An Xid names a GPU by its PCI address; the rank is the process whose GPU has that address: NCCL's Init line
(``busId``, ``Snapshot.gpu_bus``) or an NVML sample's processes.  A kernel log names its node only in the
syslog and journalctl forms (``Xid.host``); dmesg and /dev/kmsg do not, and the same address is on every node
of a cluster, so an address alone places an Xid only where the job's ranks on that address are one node's.

The smallest change that lets ``--drain-on`` act: a verdict that already blames a rank's GPU, its being behind,
dead, stuck or stalled (``XID_STRENGTHENS``) becomes ``gpu_xid`` when a hardware Xid is on the GPU of a rank it
blames, or (where it names none) of any rank; every other verdict keeps its words and cites the Xids.
"""

from __future__ import annotations

from dataclasses import replace

from ncclwatch.watchdog.events import XidError, gpu_bus_key
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import Fact, Finding
from ncclwatch.watchdog.hang.verdicts import Verdict

XID_STRENGTHENS = frozenset(
    {
        Verdict.gpu_compute_hang,
        Verdict.stuck_in_collective,
        Verdict.rank_behind,
        Verdict.process_dead,
        Verdict.progress_stalled,
    }
)


def _same_host(a: str, b: str) -> bool:
    return a.split(".", 1)[0] == b.split(".", 1)[0]


def ranks_of_xid(xid: XidError, snapshot: Snapshot) -> list[int]:
    """The global ranks whose GPU the Xid is on (empty: not placed)."""
    key = gpu_bus_key(xid.bus_id)
    ranks: dict[int, str | None] = {}  # rank -> host
    for proc, bus in snapshot.gpu_bus.items():
        rank = snapshot.global_ranks.get(proc)
        if rank is not None and gpu_bus_key(bus) == key and (xid.host is None or _same_host(xid.host, proc.host)):
            ranks[rank] = proc.host
    of_pid = snapshot.rank_of_pid()
    for sample in snapshot.gpus:
        for gpu in sample.gpus:
            if gpu_bus_key(gpu.bus_id) == key:
                ranks.update((of_pid[p.pid], None) for p in gpu.processes if p.pid in of_pid)
    if xid.pid is not None and not ranks:  # the process the driver names, on the Xid's node where it is named
        ranks.update(
            (rank, proc.host)
            for proc, rank in snapshot.global_ranks.items()
            if proc.pid == xid.pid and (xid.host is None or _same_host(xid.host, proc.host))
        )
        if xid.host is None and xid.pid in of_pid:
            ranks.setdefault(of_pid[xid.pid], None)
    hosts = {h for h in ranks.values() if h is not None}
    if xid.host is None and len(hosts) > 1:
        return []  # the same address on several nodes, and the log does not say which
    return sorted(ranks)


def describe_xid(xid: XidError, ranks: list[int]) -> str:
    """ "Xid 79 on GPU 0000:3b:00 (rank 1): the GPU fell off the bus"."""
    where = [f"rank {', '.join(map(str, ranks))}"] if ranks else []
    if xid.host:
        where.append(f"node {xid.host}")
    place = f" ({', '.join(where)})" if where else ""
    what = xid.meaning or xid.message
    when = f" at {xid.time}" if xid.time else ""
    pid = f", pid {xid.pid}" if xid.pid is not None else ""
    return f"Xid {xid.code} on GPU {xid.bus_id}{place}: {what}{when}{pid}"


def with_xids(finding: Finding, snapshot: Snapshot) -> Finding:
    """``finding`` citing the job's Xids, made ``gpu_xid`` where a hardware one is on a blamed rank's GPU."""
    xids = [e for e in snapshot.partial if isinstance(e, XidError)]
    if not xids:
        return finding
    placed = [(xid, ranks_of_xid(xid, snapshot)) for xid in xids]
    # Hardware first: the fact on-call reads first is the one that decides.
    placed.sort(key=lambda item: not item[0].hardware)
    facts = tuple(Fact("kernel_log", describe_xid(xid, ranks), cite=xid.cite) for xid, ranks in placed)
    blamed = set(finding.culprits)
    hardware = [(xid, ranks) for xid, ranks in placed if xid.hardware and ranks]
    if blamed:
        hardware = [(xid, [r for r in ranks if r in blamed]) for xid, ranks in hardware]
        hardware = [(xid, ranks) for xid, ranks in hardware if ranks]
    if finding.verdict not in XID_STRENGTHENS or not hardware:
        return replace(finding, evidence=finding.evidence + facts)
    culprits = tuple(sorted({r for _, ranks in hardware for r in ranks}))
    first, ranks = hardware[0]
    return replace(
        finding,
        verdict=Verdict.gpu_xid,
        culprits=culprits,
        summary=f"{describe_xid(first, ranks)}. {finding.summary}",
        reason="The GPU driver reported a hardware fault on the GPU of the rank the engine blames: its peers wait "
        f"for a GPU that failed. Engine: {finding.verdict.value}: {finding.reason or finding.summary}",
        evidence=facts + finding.evidence,
    )
