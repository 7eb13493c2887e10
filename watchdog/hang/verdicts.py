"""The verdicts the hang engine gives, and one catalogue of what each means and what is done about it.

Every reader takes its words from ``CATALOGUE``: the help of ``ncclwatch`` and ``ncclwatch analyze``
(``launcher/cli.py``), the report's headline (its "Next:" advice, ``report.py``), the defaults of
``--restart-on`` and ``--drain-on`` and the response's "why" (``config.py``, ``response/policy.py``),
the engine's ranking of findings (``PRIORITY``), and the live watchdog's choice of which verdicts page as soon as
they are seen (``CONCLUSIVE``: the evidence proves the hang by itself) rather than after the stall timeout.

Adding a verdict is its member in ``Verdict``, its entry in ``CATALOGUE`` (a member without one, or with
two, fails at import) and its detector; nothing else is edited by hand, except the README's three verdict
tables, whose rows ``tests/hang/test_verdict_catalogue.py`` renders from here and requires word for word.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    collective_mismatch = "collective_mismatch"
    rank_behind = "rank_behind"
    process_dead = "process_dead"
    process_stopped = "process_stopped"
    gpu_compute_hang = "gpu_compute_hang"
    gpu_xid = "gpu_xid"
    stuck_in_collective = "stuck_in_collective"
    progress_stalled = "progress_stalled"
    network_error = "network_error"
    node_lost = "node_lost"
    p2p_deadlock = "p2p_deadlock"
    collective_timeout = "collective_timeout"
    no_hang = "no_hang"
    inconclusive = "inconclusive"


@dataclass(frozen=True, kw_only=True)
class VerdictEntry:
    verdict: Verdict
    priority: int  # higher wins when communicators or sources disagree
    hang: bool  # paged, and a --restart-on / --drain-on choice (no_hang and inconclusive are not)
    # The evidence proves the hang by itself, whatever the clock says: paged as soon as it is seen (at any step,
    # before any timeout is learned) and without a second look, because it does not go away with a pause (a
    # mismatch, a dead or stopped rank).  False: the same picture is a moment a healthy job passes through (a rank
    # still compiling, a long kernel, stacks caught a few ms apart), so the stall timeout and the second look apply.
    conclusive: bool = False
    meaning: str  # one line, for the help texts
    detail: str  # how it is decided and who is named (the README, after the meaning)
    # What on-call checks first (the headline's "Next:"); "{ranks}" stands for the culprits, or "the lead rank".
    next_step: str
    restart: bool = False  # restarted by default (--restart-on)
    # Why a restart helps (``restart``) or cannot help (a hang verdict not restarted by default): the response's words.
    restart_why: str = ""
    # Restarted by default when every culprit is blocked (state S or D: a read, a sleep, a lock) rather than running
    # its own code: these words say why (``--restart-on <verdict>_blocked``).  Empty: no such default.
    restart_when_blocked: str = ""
    drain: bool = False  # blames the culprit's node's hardware by default (--drain-on)
    live: bool = True  # the live watchdog can give it
    offline: bool = True  # ``ncclwatch analyze`` can give it (from a bundle or a kept run folder too)
    # What the culprit does, in the headline after "rank N (host, pid)"; "{op}" stands for the operation and its
    # position.  Empty: the headline quotes the finding's summary.
    culprit_does: str = ""
    # Sub-kinds whose next step differs from the verdict's (Finding.kind -> the headline's "Next:"), same
    # placeholders: (kind, next step).
    kinds: tuple[tuple[str, str], ...] = ()

    def next_step_for(self, kind: str | None) -> str:
        return dict(self.kinds).get(kind or "", self.next_step)


_ENTRIES = (
    VerdictEntry(
        verdict=Verdict.collective_mismatch,
        conclusive=True,
        priority=9,
        hang=True,
        meaning="ranks issued different operations at the same position",
        detail="At the first diverging position their type, count, datatype, reduce op or root differ, or a send and "
        "its recv disagree. The culprit is the rank that departs from the others: the minority, or with an even split "
        '(two ranks) the side that breaks the step the communicator repeats (see "How ranks are aligned"); where '
        "nothing decides, both sides are named as suspects and no culprit.",
        next_step="compare the two call sites (stacks in the bundle); look for a branch on the rank or on data that "
        "differs between ranks before that line",
        kinds=(
            (
                "dtype",
                "find where the tensor of {ranks} gets its datatype before that call (a .float() or .to(), an autocast "
                "region, a mixed-precision setting or a checkpoint loaded in another dtype on some ranks)",
            ),
        ),
        restart_why="a collective mismatch comes from the program (a branch on the rank) and recurs",
    ),
    VerdictEntry(
        verdict=Verdict.rank_behind,
        priority=6,
        hang=True,
        meaning="some ranks never entered the collective the others wait in",
        detail="The sequences agree up to it; with point-to-point operations, the rank that never posted the send or "
        "recv its peer waits for.",
        next_step="py-spy stack in the bundle: is {ranks} still in its own code (blocked in I/O, a data loader or a "
        "lock, a long computation) or past a branch that skipped the collective (an early exit, a branch on the rank, "
        "a data loader that ran dry)?",
        restart_why="a rank held up in its own code is in the program's hands, not the hardware's",
        restart_when_blocked="a rank blocked in a read, a sleep or a lock (state S or D: a network filesystem, a data "
        "loader) may get past it in a fresh process; the loop guard ends it if it recurs",
        culprit_does="never entered {op}; its peers wait in it",
    ),
    VerdictEntry(
        verdict=Verdict.process_dead,
        conclusive=True,
        priority=8,
        hang=True,
        meaning="a rank exited while its peers wait",
        detail="It ended without shutting NCCL down: its process is gone (live), torchrun's failure summary names it, "
        "or a peer's NCCL log saw its connection close.",
        next_step="read {ranks}'s output and exit status (torchrun's log, the bundle): an exception, or the OOM killer "
        "(dmesg)",
        restart=True,
        restart_why="the restart replaces the dead process",
        culprit_does="exited while its peers wait in {op}",
    ),
    VerdictEntry(
        verdict=Verdict.process_stopped,
        conclusive=True,
        priority=7,
        hang=True,
        meaning="a rank is stopped (state T: SIGSTOP, a debugger)",
        detail="Read from its /proc state, live or from a run folder's or bundle's journal.",
        next_step="send SIGCONT to {ranks}, or find who stopped it (a debugger, a scheduler's suspend)",
        restart=True,
        restart_why="the restart replaces the stopped process",
        culprit_does="is stopped (state T) while its peers wait in {op}",
    ),
    VerdictEntry(
        verdict=Verdict.gpu_compute_hang,
        priority=5,
        hang=True,
        meaning="a rank's GPU is stuck in a non-NCCL kernel while its peers spin in NCCL",
        detail="Flight Recorder (with timing) shows its GPU never started the collective its peers' GPUs run, or NVML "
        "shows it busy in another kernel while theirs spin (NVML measures a whole GPU, so it counts only for a GPU "
        "that runs one rank and nothing else). Paged without waiting for the stall timeout once it has held for 15 s "
        "of silence, or for 3 s where NVML shows the GPU spinning on almost none of its SMs and Flight Recorder no "
        "NCCL operation running on it (a kernel waiting on something that never comes).",
        next_step="find the kernel {ranks} launched before the collective (a custom op, a spinning kernel): stack and "
        "NVML sample in the bundle",
        kinds=(
            (
                "spin",
                "find the kernel {ranks} launched before the collective: it spins on almost none of the GPU's SMs, "
                "waiting on something that never comes (a flag, a peer's signal, a lock in a custom op); stack and "
                "NVML sample in the bundle",
            ),
        ),
        restart=True,
        restart_why="a new process clears the GPU's endless kernel",
        # Not drained: a kernel that never ends is as often the program's; with a hardware Xid on the rank's GPU the
        # verdict becomes gpu_xid, which is (``classify._with_xid``).
        # One NVML sample or dump cannot tell a kernel that never ends from a long one (autotuning, a first step)
        # while the peers already wait: it proves the hang only once it has held for ``judging.GPU_HANG_SETTLED_S``
        # of silence (a training kernel runs milliseconds); before, the stall timeout decides.  On the H200, DDP and a
        # compiled model hung 1.5 s into training waited for the 300 s warm-up timeout.  A GPU spinning on almost
        # none of its SMs with no NCCL operation running (kind ``spin``) is no long compute kernel: it proves the
        # hang after ``judging.GPU_SPIN_SETTLED_S``.
        conclusive=True,
        culprit_does="has its GPU stuck in a non-NCCL kernel while its peers wait in {op}",
    ),
    VerdictEntry(
        verdict=Verdict.gpu_xid,
        # Not conclusive: the Xid only names whose GPU failed; the hang it strengthens (stuck, behind, stalled) still
        # waits for the stall timeout, and some hardware Xids (a contained ECC error, a row remap) let a job go on.
        priority=8,
        hang=True,
        meaning="a rank's GPU reported a hardware Xid (the kernel log) while the job hangs",
        detail="The GPU driver's `NVRM: Xid` lines (a kernel log given to `analyze`, or /dev/kmsg live): an Xid that "
        "points at the hardware (79 off the bus, 48/94/95 ECC, 74 and 144-150 NVLink, 119/120 GSP) on the GPU of a "
        "rank that a GPU, stuck, behind, dead or stalled verdict blames (of any rank where it names none), placed by "
        "the bus id of NCCL's Init lines or NVML. Other verdicts cite the Xid.",
        next_step="take the node of {ranks} out of service and check its GPU (nvidia-smi -q, the Xid in the "
        "bundle's kernel log); the Xid table in NVIDIA's Xid catalogue says what to reset or replace",
        restart=True,
        restart_why="the restart moves the job off the failed GPU where the scheduler gives it another node",
        drain=True,
        # No culprit_does: the headline quotes the summary, which starts with the Xid ("Xid 79 on GPU ...").
    ),
    VerdictEntry(
        verdict=Verdict.stuck_in_collective,
        priority=4,
        hang=True,
        meaning="every rank entered the collective and it never completed",
        detail="Flight Recorder, an abort, or the stacks say so; the lead rank comes from Flight Recorder's "
        "started/scheduled states, GPU signatures or stacks, where they differ.",
        next_step="check the network and GPUs of {ranks}: NCCL logs, NVML and InfiniBand counters in the bundle",
        restart=True,
        restart_why="a collective lost in the network often completes on fresh communicators",
        culprit_does="leads: {op} never completed",
    ),
    VerdictEntry(
        verdict=Verdict.progress_stalled,
        priority=3,
        hang=True,
        meaning="nothing moved for the progress timeout and no rank is in a collective",
        detail="A pause outside collectives (a checkpoint, an evaluation) is no hang until `--progress-timeout` has "
        "passed; offline, only from a run folder's or bundle's journal.",
        next_step="read the stacks in the bundle: a checkpoint, an evaluation or a data stall that does not end",
        restart_why="no rank waits in a collective (a checkpoint or evaluation may still be running)",
    ),
    VerdictEntry(
        verdict=Verdict.network_error,
        conclusive=True,
        priority=7,
        hang=True,
        meaning="a link failed (InfiniBand completion error); names the peer",
        detail="From NCCL's `NET/IB ... Got completion from peer` errors in the files given: the peer host and the "
        "adapter are named, and the peer's rank where the files give it. Offline only: the live watchdog lists NCCL's "
        "network warnings in the evidence of its verdict.",
        next_step="check the named adapter and its peer: InfiniBand counters, cable, switch port",
        restart=True,
        restart_why="a link error often clears once the communicators are built again",
        drain=True,
        live=False,
    ),
    VerdictEntry(
        verdict=Verdict.node_lost,
        conclusive=True,
        priority=8,
        hang=True,
        meaning="a node's sidecar stopped answering while the other nodes' ranks wait",
        detail="Jobs on several nodes, live only: the lost node's ranks are the culprits, unless a fault at least as "
        "strong (a mismatch, a dead process) names ranks elsewhere.",
        next_step="check the lost node: its sidecar, its network, whether it is up",
        restart=True,
        restart_why="the nodes meet again in the rendezvous (an elastic job goes on without the lost one)",
        drain=True,
        offline=False,
    ),
    VerdictEntry(
        verdict=Verdict.p2p_deadlock,
        priority=7,
        hang=True,
        meaning="ranks each wait in a send or recv for the other's missing side",
        detail="E.g. both `recv` first: from NCCL's log where a rank never posted its side, from Flight Recorder where "
        "both posted but each queued its recv first (over NVLink the host never blocks), from the stacks where "
        "neither tells.",
        next_step="reorder the send/recv pair on one side of {ranks} (one sends first), or post both with "
        "batch_isend_irecv",
        restart_why="a send/recv order that deadlocks is the program's and recurs",
        # Not conclusive: from stacks (gloo) the ranks are caught a few ms apart, and a healthy pipeline stage that
        # sends and enters its next recv between two captures reads as every stage in recv.
    ),
    VerdictEntry(
        verdict=Verdict.collective_timeout,
        # Given only once the job has died of the timeout (``hang.failure``): nothing a healthy job passes through.
        conclusive=True,
        priority=6,
        hang=True,
        meaning="the job died of a collective timeout; names the ranks that never entered the collective",
        detail="A failed job whose ranks' output says their collective timed out (PyTorch's `Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=...)`, gloo's `Timed out waiting ...ms`): those ranks waited, "
        "the others never entered it and are named, unless the sequences name a rank behind. Where every rank timed "
        "out, no rank is named.",
        next_step="find where {ranks} was when its peers timed out (its own output, its stack): blocked in I/O or a "
        "data loader, a long computation, or past a branch that skipped the collective; raise the process group's "
        "timeout only if that wait was expected",
        restart_why="a rank held up in its own code is in the program's hands; the same step times out again",
        culprit_does="never entered {op}; its peers timed out in it",
    ),
    VerdictEntry(
        verdict=Verdict.no_hang,
        priority=2,
        hang=False,
        meaning="the job ended cleanly, or nothing is pending",
        detail="Its communicators were shut down cleanly, or Flight Recorder shows nothing pending.",
        next_step="nothing to do",
    ),
    VerdictEntry(
        verdict=Verdict.inconclusive,
        priority=1,
        hang=False,
        meaning="not enough evidence (the report says what is missing)",
        detail='`missing` ("could not see") says what would decide it; also recognised input that holds no operations.',
        next_step="add what the report lists under 'could not see' and analyze again",
    ),
)


def _catalogue(entries: Iterable[VerdictEntry]) -> dict[Verdict, VerdictEntry]:
    """Entries by verdict, in ``Verdict``'s order; raises when a verdict has no entry, or two."""
    by_verdict: dict[Verdict, VerdictEntry] = {}
    for entry in entries:
        if entry.verdict in by_verdict:
            raise ValueError(f"verdict catalogue: {entry.verdict.value} has two entries")
        if not entry.hang and (entry.restart or entry.drain or entry.restart_why):
            raise ValueError(f"verdict catalogue: {entry.verdict.value} is no hang: nothing to restart or drain")
        if entry.conclusive and not entry.hang:
            raise ValueError(f"verdict catalogue: {entry.verdict.value} is no hang: it proves none")
        if entry.hang and not entry.restart_why:
            raise ValueError(f"verdict catalogue: {entry.verdict.value} needs restart_why (why a restart helps or not)")
        by_verdict[entry.verdict] = entry
    unlisted = [v.value for v in Verdict if v not in by_verdict]
    if unlisted:
        raise ValueError(f"verdict catalogue: no entry for {', '.join(unlisted)}")
    return {v: by_verdict[v] for v in Verdict}


CATALOGUE = _catalogue(_ENTRIES)
PRIORITY = {v: entry.priority for v, entry in CATALOGUE.items()}
HANG_VERDICTS = frozenset(v for v, entry in CATALOGUE.items() if entry.hang)
HANG_VERDICT_NAMES = frozenset(v.value for v in HANG_VERDICTS)
CONCLUSIVE = frozenset(v for v, entry in CATALOGUE.items() if entry.conclusive)
# The live defaults of --restart-on and --drain-on: what helps, of the verdicts the live watchdog gives (a verdict
# only ``analyze`` gives would stand in them for nothing, and its help would contradict them).
RESTART_ON_DEFAULT = tuple(v for v, entry in CATALOGUE.items() if entry.restart and entry.live)
BLOCKED = "_blocked"  # "rank_behind_blocked" in --restart-on: that verdict, where every culprit is blocked
RESTART_WHEN_BLOCKED = tuple(v for v, entry in CATALOGUE.items() if entry.restart_when_blocked)
RESTART_ON_NAMES = HANG_VERDICT_NAMES | {v.value + BLOCKED for v in RESTART_WHEN_BLOCKED}
RESTART_ON_DEFAULT_NAMES = (*(v.value for v in RESTART_ON_DEFAULT), *(v.value + BLOCKED for v in RESTART_WHEN_BLOCKED))
DRAIN_ON_DEFAULT = tuple(v for v, entry in CATALOGUE.items() if entry.drain and entry.live)
