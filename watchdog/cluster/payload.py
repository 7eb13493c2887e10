"""What a node's evidence looks like on its way through the store: trimmed, compressed, dated.

At a hang every node shares a *compact* record of its ranks (where each
one is: its newest Flight Recorder entries and collectives, its process
state, the innermost frames of its stacks); the leader asks the few nodes
whose ranks decide the verdict (behind, diverging, absent) for their *full*
evidence.  Both are the journal's events (``parsing.journal``), so the
leader judges them with the same engine as its own ranks.

On the wire: one JSON line of metadata (``node``, ``kind``, ``stall_at``:
the probe it came from), a newline, then the journal lines compressed with
zlib.  A process group's member list travels as runs ("0-8191", "3-8187:8"),
and compact evidence leaves out a list that is the identity (global rank =
group rank, as the default group's): the leader would otherwise expand
8,192 numbers for each of 8,192 dumps (2.9 GB and 9 s at 1,024 nodes, the
bench found).  Decoding is bounded (``MAX_DECODED``) and never raises: a
payload that does not parse is None.
"""

from __future__ import annotations

import gc
import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from ncclwatch.watchdog.events import (
    Event,
    FrDump,
    FrEntry,
    FrProcessGroup,
    OpState,
    ProcessState,
    SequenceTail,
    StackDump,
)
from ncclwatch.watchdog.hang.state import pending_alone
from ncclwatch.watchdog.parsing.journal import HEADER, JOURNALED, journal_line, parse_journal

Kind = Literal["compact", "full"]

# Full evidence, per rank: enough to align the pending collective across nodes.
FR_ENTRIES_SHARED = 32  # per process group
FR_FRAMES_SHARED = 4  # entries (the newest) that keep their recorded stack
STACK_FRAMES_SHARED = 24
TAIL_SHARED = 64  # newest collectives per rank and NCCL communicator: the divergence is near the end...
# ... unless a rank's host ran ahead: on NCCL a call returns at enqueue, and on the H100 an FSDP2 rank that had
# skipped a collective enqueued 157 more before the job stopped.  The leader says where the slowest rank stands
# (``IncidentView.since``); a full tail reaches back to it, by this margin, to at most TAIL_SHARED_MAX.
TAIL_BEFORE_SINCE = 16
TAIL_SHARED_MAX = 2048
# Compact, per rank: where it is and what it is doing, no history.
FR_ENTRIES_COMPACT = 4
# Either kind reaches further back, per group, to where the rank stands: its oldest collective not completed and
# the two before it, within FR_REACH_* entries (the entries stay one contiguous run: the job's sequences are built
# from them).  A rank whose host ran ahead (NCCL returns at enqueue) has its newest entries past the position where
# ranks diverged: on the H200's mismatch_fr capture rank 1 had queued four more past #82, where its AllReduce's
# count differs from rank 0's, and the newest four alone read as rank_behind [0].
FR_BEFORE_PENDING = 2
FR_REACH_COMPACT = 16
FR_REACH_SHARED = 64
# Either kind also reaches back to the op each group's GPU is running (its oldest ``started``), within this many: a
# rank that ran ahead is told from one behind by where its GPU is (``classify._ran_ahead``). On the H200, pipeline x
# DP on two wrappers, rank 3 skipped the loss all_reduce; its GPU sat in a batched send/recv 120 pipeline entries
# before its newest, and without it the leader named the three ranks waiting for it (the dumps alone named rank 3).
# The compact kind too: the leader asked for full evidence and, the GPU shared by other jobs, judged before it came.
# A rank waiting where it should runs its newest op, so only a rank that ran ahead sends more.
FR_REACH_RUNNING = 256
FR_FRAMES_COMPACT = 1
STACK_FRAMES_COMPACT = 8
TAIL_COMPACT = 8
SAMPLES_COMPACT = 3  # /proc samples per worker: CPU moving or not needs two

PENDING_P2P_SHARED = 8  # per group: older point-to-point ops still pending, with their recorded stack

MAX_DECODED = 64 << 20


@dataclass(frozen=True)
class Limits:
    fr_entries: int
    fr_reach: int  # back to the oldest pending collective, within this many
    fr_running_reach: int  # back to the op the GPU is running, within this many
    fr_frames: int
    stack_frames: int
    tail: int
    samples: int | None


LIMITS: dict[Kind, Limits] = {
    "full": Limits(
        FR_ENTRIES_SHARED, FR_REACH_SHARED, FR_REACH_RUNNING, FR_FRAMES_SHARED, STACK_FRAMES_SHARED, TAIL_SHARED, None
    ),
    "compact": Limits(
        FR_ENTRIES_COMPACT,
        FR_REACH_COMPACT,
        FR_REACH_RUNNING,
        FR_FRAMES_COMPACT,
        STACK_FRAMES_COMPACT,
        TAIL_COMPACT,
        SAMPLES_COMPACT,
    ),
}


@dataclass(frozen=True)
class Payload:
    node: int
    kind: Kind
    stall_at: float
    events: list[Event]


def shareable(events: Iterable[Event], kind: Kind = "full", since: Mapping[str, int] = {}) -> list[Event]:
    """What travels, trimmed to ``kind``: only the journal's kinds (a probe's notes stay on its node).  ``since``:
    communicator -> the fewest collectives a rank of the job issued on it, which a full tail reaches back to."""
    limits = LIMITS[kind]
    out: list[Event] = []
    samples: dict[int, int] = {}
    kept = [e for e in events if type(e).__name__ in JOURNALED]
    for event in reversed(kept):  # newest first, so the sample limit keeps the latest
        if isinstance(event, FrDump):
            update: dict = {"entries": _newest_entries(event.entries, limits)}
            if kind == "compact":
                update["process_groups"] = {pg: _without_identity(g) for pg, g in event.process_groups.items()}
            event = event.model_copy(update=update)
        elif isinstance(event, StackDump):
            threads = [t.model_copy(update={"frames": t.frames[: limits.stack_frames]}) for t in event.threads]
            event = event.model_copy(update={"threads": threads})
        elif isinstance(event, SequenceTail):
            event = _trimmed_tail(event, _tail_length(event, limits.tail, since.get(event.comm_key)))
        elif isinstance(event, ProcessState) and limits.samples is not None:
            samples[event.pid] = samples.get(event.pid, 0) + 1
            if samples[event.pid] > limits.samples:
                continue
        out.append(event)
    out.reverse()
    return out


def _without_identity(group: FrProcessGroup) -> FrProcessGroup:
    """Members 0..n-1 in order say nothing a rank's own number does not (``JobState`` reads an empty list so)."""
    identity = group.ranks == list(range(len(group.ranks)))
    return group.model_copy(update={"ranks": []}) if identity and group.ranks else group


def _tail_length(tail: SequenceTail, usual: int, since: int | None) -> int:
    """``usual`` newest collectives, or back to ``since`` (less a margin) where that is further, within the cap."""
    if since is None:
        return usual
    issued = tail.base + len(tail.sigs)
    return min(max(usual, issued - since + TAIL_BEFORE_SINCE), TAIL_SHARED_MAX)


def _trimmed_tail(tail: SequenceTail, length: int) -> SequenceTail:
    """The newest ``length`` collectives, and as many point-to-point ops per peer; counts stay whole."""
    cut = max(len(tail.sigs) - length, 0)
    peers = {
        side: {
            peer: t.model_copy(update={"sigs": t.sigs[len(t.sigs) - min(length, len(t.sigs)) :]})
            for peer, t in getattr(tail, side).items()
        }
        for side in ("sent", "received")
    }
    return tail.model_copy(update={"sigs": tail.sigs[cut:], "base": tail.base + cut, **peers})


def _newest_entries(entries: list[FrEntry], limits: Limits) -> list[FrEntry]:
    """The newest entries of each group, back to where the rank stands (``_first_kept``), plus its pending
    point-to-point ops issued alone, whatever their age.

    A rank's first pending send or recv with a peer is what shows a pipeline deadlock (``detectors``:
    ``_pending_recv_cycle``), and the host keeps enqueueing behind it (NCCL returns at once): on a
    hung job it is soon older than the newest few entries.  Ops in a coalesced group stay ``scheduled``
    forever and their marker says how they ended, so those are never kept without it.
    """
    by_pg: dict[str, list[FrEntry]] = {}
    for entry in entries:
        by_pg.setdefault(entry.pg_id, []).append(entry)
    kept: list[FrEntry] = []
    for group in by_pg.values():
        pending = next((i for i, e in enumerate(group) if not e.is_p2p and e.state is not OpState.completed), None)
        first = min(_first_kept(len(group), pending, limits), _running_from(group, limits))
        alone = pending_alone(group)[:PENDING_P2P_SHARED]
        # Recorded stacks stay with the newest few and with the ops that say where the rank waits.
        framed = {e.index for e in [*group[-limits.fr_frames :], *alone]}
        if pending is not None:
            framed.add(group[pending].index)
        kept += [e if e.index in framed else e.model_copy(update={"frames": []}) for e in group[first:]]
        shown = {e.index for e in group[first:]}
        kept += [e for e in alone if e.index not in shown]
    return sorted(kept, key=lambda e: e.index)


def _running_from(group: list[FrEntry], limits: Limits) -> int:
    """Where the op the GPU runs starts in ``group`` (a coalesced group from its first member), if within
    ``fr_running_reach``; else past the end."""
    running = next((i for i, e in enumerate(group) if e.state is OpState.started), None)
    if running is None or running < len(group) - limits.fr_running_reach:
        return len(group)
    marker = group[running]
    if marker.op == "Coalesced":
        while running > 0 and group[running - 1].is_p2p and group[running - 1].p2p_seq_id == marker.p2p_seq_id:
            running -= 1
    return running


def _first_kept(length: int, pending: int | None, limits: Limits) -> int:
    """The newest ``fr_entries``, or back to FR_BEFORE_PENDING before the oldest pending collective (``pending``)
    where that is further, within ``fr_reach``."""
    first = length - limits.fr_entries
    if pending is not None:
        first = min(first, pending - FR_BEFORE_PENDING)
    return max(first, length - limits.fr_reach, 0)


def encode(events: Iterable[Event]) -> bytes:
    """The journal form (uncompressed): what ``parse_journal`` reads.  Fields at their defaults stay out: a compact
    Flight Recorder entry is mostly nulls, and the leader, which validates 4,095 nodes' lines at 4,096 nodes, reads a
    third fewer bytes in 12 % less time."""
    return (HEADER.decode() + "\n" + "\n".join(journal_line(e, defaults=False) for e in events)).encode()


def pack(node: int, kind: Kind, stall_at: float, events: Iterable[Event], since: Mapping[str, int] = {}) -> bytes:
    meta = json.dumps({"node": node, "kind": kind, "stall_at": stall_at}).encode()
    return meta + b"\n" + zlib.compress(encode(shareable(events, kind, since)), 6)


def unpack(raw: bytes, name: str) -> Payload | None:
    meta_line, _, body = raw.partition(b"\n")
    try:
        meta = json.loads(meta_line)
        inflate = zlib.decompressobj()
        data = inflate.decompress(body, MAX_DECODED)
        if inflate.unconsumed_tail:
            return None
        return Payload(int(meta["node"]), meta["kind"], float(meta["stall_at"]), parse_journal(data, name))
    except (ValueError, KeyError, TypeError, zlib.error):
        return None


@contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside.  Decoding and folding thousands of nodes' evidence allocates millions
    of objects that all stay alive, and each collection the allocations trigger walks every one of them: at 1,024
    nodes on the 2-core VM the leader's parse and judge took 2-3x as long with collections as without.

    ``freeze``: the objects alive at the end are left out of every later collection (``gc.freeze``), once per
    hang: else the first collections after would walk them all (0.7-1.4 s at 1,024 nodes, in the leader's
    verdict).  They are still freed when no longer referenced; only a reference cycle among them would stay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if freeze:
                gc.freeze()
            gc.enable()
