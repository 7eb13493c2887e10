"""What each rank's GPU is doing, from NVML: a signature per rank, and the lead it names where sequences cannot.

A signature speaks for a rank only on a GPU that runs that rank's process
alone (``rank_signatures``).  Read by the job-wide and the live rules and by
the report.  Pure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ncclwatch.watchdog.events import Citation
from ncclwatch.watchdog.hang.snapshot import Snapshot
from ncclwatch.watchdog.hang.types import Fact, Finding

NCCL_SPIN = "multi-block kernel (NCCL spin)"
# A kernel that keeps the GPU busy on almost none of its SMs (0.76 % on H200): a spin, NCCL's point-to-point or a
# user kernel waiting on a flag; a real compute kernel fills the SMs or moves DRAM.
ONE_BLOCK_SPIN = "1-block kernel"


def gpu_signature(util_pct: float | None, sm_util_pct: float | None, dram_bw_pct: float | None = None) -> str:
    """Name what a GPU is doing from NVML (see NCCL-FACTS.md, measured on H200).

    NCCL's spin is a few blocks per channel (18 % of SMs with 24 channels on
    H200) moving no memory; a real compute kernel fills the SMs or moves
    DRAM, so a GPU busy with an evaluation is not mistaken for a collective.
    """
    if util_pct is None:
        return "unknown"
    if util_pct < 5:
        return "idle"
    if sm_util_pct is None:
        return "kernel resident"
    if sm_util_pct < 5:
        return ONE_BLOCK_SPIN
    if sm_util_pct >= 60 or (dram_bw_pct is not None and dram_bw_pct >= 5):
        return "compute kernel"
    return NCCL_SPIN


def rank_signatures(snapshot: Snapshot) -> dict[int, tuple[str, Citation]]:
    """Latest GPU signature per global rank, through the pid a GPU reports.

    NVML measures a whole device, so its signature speaks for a rank only on a GPU that runs that rank's process
    alone. On a shared GPU (several ranks, another job, MPS) it mixes everyone's kernels: on one H200 shared by
    five benchmark jobs, two ranks asleep in an evaluation pause read as "NCCL spin" from the other jobs' spinning
    collectives, and paged stuck_in_collective.
    """
    rank_of_pid = snapshot.rank_of_pid()
    signatures: dict[int, tuple[str, Citation]] = {}
    for snap in snapshot.gpus:
        for gpu in snap.gpus:
            if len(gpu.processes) != 1 or (rank := rank_of_pid.get(gpu.processes[0].pid)) is None:
                continue
            sm = gpu.gpm.sm_util_pct if gpu.gpm else None
            dram = gpu.gpm.dram_bw_util_pct if gpu.gpm else None
            signatures[rank] = (gpu_signature(gpu.util_gpu_pct, sm, dram), snap.cite)
    return signatures


def lead_from_signatures(snapshot: Snapshot, finding: Finding) -> Finding:
    """The rank whose GPU does something else than its peers' is the lead.

    A majority decides; with an even split (always, with two ranks) the ranks
    not spinning in a many-channel NCCL kernel are the lead: their peers wait
    for them inside the collective.
    """
    signatures = rank_signatures(snapshot)
    if len(signatures) < 2:
        return finding
    counts = Counter(sig for sig, _ in signatures.values())
    (common, n_common), *rest = counts.most_common()
    if not rest:
        return finding
    if n_common == rest[0][1]:
        if NCCL_SPIN not in counts:
            return finding
        common = NCCL_SPIN
    odd = sorted(r for r, (sig, _) in signatures.items() if sig != common)
    facts = tuple(Fact("nvml", f"rank {r}: GPU {sig}", c) for r, (sig, c) in sorted(signatures.items()))
    return replace(
        finding,
        culprits=tuple(odd),
        reason=(
            f"Every rank issued the same operations; the GPU of rank {', '.join(map(str, odd))} is doing something "
            f"else ({signatures[odd[0]][0]}) while the others show '{common}': it is the lead."
        ),
        evidence=finding.evidence + facts,
        missing=tuple(m for m in finding.missing if "which rank" not in m),
    )
