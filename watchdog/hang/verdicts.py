"""The verdicts the hang engine gives, and how they rank against each other."""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    collective_mismatch = "collective_mismatch"
    rank_behind = "rank_behind"
    process_dead = "process_dead"
    process_stopped = "process_stopped"
    gpu_compute_hang = "gpu_compute_hang"
    stuck_in_collective = "stuck_in_collective"
    progress_stalled = "progress_stalled"
    network_error = "network_error"  # a link failed (InfiniBand completion error): offline, from partial evidence
    node_lost = "node_lost"  # a node's sidecar stopped answering while the other nodes' ranks wait (multi-node)
    p2p_deadlock = "p2p_deadlock"  # ranks each wait in a send/recv for the other's missing side
    no_hang = "no_hang"
    inconclusive = "inconclusive"


# Higher wins when communicators disagree.
PRIORITY = {
    Verdict.collective_mismatch: 9,
    Verdict.process_dead: 8,
    Verdict.node_lost: 8,
    Verdict.process_stopped: 7,
    Verdict.network_error: 7,
    Verdict.p2p_deadlock: 7,
    Verdict.rank_behind: 6,
    Verdict.gpu_compute_hang: 5,
    Verdict.stuck_in_collective: 4,
    Verdict.progress_stalled: 3,
    Verdict.no_hang: 2,
    Verdict.inconclusive: 1,
}
HANG_VERDICTS = frozenset(v for v in Verdict if v not in (Verdict.no_hang, Verdict.inconclusive))
