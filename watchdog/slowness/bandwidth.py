"""Achieved bus bandwidth and arrival skew from Flight Recorder entries, and the slow-collective check.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md``): ``algbw = S / t``
with ``S`` the collective's size as nccl-tests counts it (the all-reduce
buffer, the all-gather output, the reduce-scatter input, the whole
all-to-all), and ``busbw = algbw * factor`` with nccl-tests' factor
(``ncclwatch/bus_bandwidth.py``), so one number can be compared with the hardware's link speed whatever the
collective and the rank count.

Matching: an entry of one rank is the same collective as another rank's
when both have the same process group and ``collective_seq_id``.
``time_created_ns`` is when each rank enqueued it (host wall clock, so
across nodes only as good as NTP: skews under a few ms between nodes are
noise), which gives arrival order and skew.  The time the data took (the
link time) is measured from the last rank's start: an early rank's kernel
(``duration_ms``, only with ``TORCH_NCCL_ENABLE_TIMING=1``) includes its wait
for the last one, so it is never taken as the link time (``link_time``).
Without durations anywhere in the group (timing off) it is the first
discovered completion minus the last arrival, which is up to the watchdog
thread's poll period too long, so busbw is then a lower bound; where the
group's other entries have durations, one without is not retired yet and
gives no link time (``link_time``).  Gloo entries carry neither: skew only.  With NCCL an
enqueue is not an arrival on the GPU (the call returns at once and the host
runs ahead): when each GPU reached it is in the durations
(``CollectiveTiming.gpu_arrivals``); with gloo the call is synchronous and the
enqueue is the arrival.

Failure modes: a collective seen by one rank only, with no size, or with
an unknown dtype gives no bandwidth (``None``), never a guess; small
collectives (``min_bytes``) are latency-bound and never judged on
bandwidth.  The detectors need ``min_history`` comparable samples before
they say anything, so a job's first minutes stay quiet.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ncclwatch.bus_bandwidth import bus_factor, busbw
from ncclwatch.watchdog.events import FrDump, FrEntry, OpState
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind, gbps, where

# Element sizes: PyTorch's ScalarType names as Flight Recorder writes them (c10::toString,
# older dumps lower case) and NCCL's ncclDataType_t numbers as its COLL lines print them.
_TORCH_DTYPE_BYTES = {
    "bool": 1,
    "byte": 1,
    "char": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "short": 2,
    "half": 2,
    "bfloat16": 2,
    "int": 4,
    "float": 4,
    "long": 8,
    "double": 8,
    "complexhalf": 4,
    "complexfloat": 8,
    "complexdouble": 16,
}
_NCCL_DTYPE_BYTES = {"0": 1, "1": 1, "2": 4, "3": 4, "4": 8, "5": 8, "6": 2, "7": 4, "8": 8, "9": 2, "10": 1, "11": 1}

MIN_BYTES = 1 << 20  # below this a collective is latency-bound: its bandwidth says nothing about links


def element_bytes(dtype: str | None) -> int | None:
    """Size of one element from a Flight Recorder dtype name or a NCCL datatype number; unknown: None."""
    if dtype is None:
        return None
    return _NCCL_DTYPE_BYTES.get(dtype) or _TORCH_DTYPE_BYTES.get(dtype.lower().replace("torch.", ""))


def fr_collective_bytes(entry: FrEntry) -> int | None:
    """nccl-tests' size S of a Flight Recorder entry: the larger of its inputs and outputs, in bytes.

    All-reduce, broadcast and all-to-all have equal inputs and outputs; the
    all-gather output and the reduce-scatter input are the whole (n x per-rank).
    """
    sizes = [(entry.input_sizes, entry.input_dtypes), (entry.output_sizes, entry.output_dtypes)]
    totals = []
    for shapes, dtypes in sizes:
        if not shapes or not dtypes:
            continue
        width = element_bytes(dtypes[0])
        if width is None:
            return None
        totals.append(sum(_numel(shape) for shape in shapes) * width)
    return max(totals) if totals else None


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective as every rank that dumped it saw it."""

    pg: str
    seq: int
    op: str
    nranks: int  # the group's size
    nbytes: int | None
    arrivals: Mapping[int, int]  # global rank -> time_created_ns
    completed: bool  # every rank that recorded it saw it complete
    transfer_s: float | None  # how long the data took (see the module docstring)
    started_ns: int | None  # when the last rank arrived: the data could not move before
    kernel_s: Mapping[int, float] = field(default_factory=dict)  # global rank -> its duration_ms in s, where recorded

    @property
    def all_arrived(self) -> bool:
        return len(self.arrivals) >= self.nranks

    @property
    def last_rank(self) -> int:
        return max(self.arrivals, key=lambda r: (self.arrivals[r], r))

    @property
    def skew_s(self) -> float:
        """Last arrival minus first."""
        return (max(self.arrivals.values()) - min(self.arrivals.values())) / 1e9

    @property
    def lead_s(self) -> float:
        """By how much the last rank was last: its arrival minus the second-to-last one's."""
        times = sorted(self.arrivals.values())
        return (times[-1] - times[-2]) / 1e9 if len(times) > 1 else 0.0

    @property
    def gpu_arrivals(self) -> dict[int, float] | None:
        """Rank -> when its GPU reached this collective, in seconds on an origin of this collective's own (its first
        enqueue); None unless every rank recorded a kernel time (gloo, timing off, an entry not retired yet).

        Every rank's kernel ends together, when the last one has joined and the data has moved, so a kernel's time
        less the shortest is how long that rank's GPU waited: the rank with the shortest kernel reached it last.
        With NCCL a call returns at enqueue and the host runs ahead of its GPU, so enqueue order says nothing of
        who the GPUs waited for: a host that synchronised (``.item()``) enqueues late while no GPU waits, and a
        GPU that is slow keeps the others waiting while its host enqueued early.
        """
        if not self.all_arrived or set(self.kernel_s) != set(self.arrivals):
            return None
        first, longest = min(self.arrivals.values()) / 1e9, max(self.kernel_s.values())
        return {rank: first + longest - kernel for rank, kernel in self.kernel_s.items()}

    @property
    def busbw(self) -> float | None:
        if self.nbytes is None or self.transfer_s is None or not self.completed:
            return None
        return busbw(self.op, self.nbytes, self.nranks, self.transfer_s)


@dataclass(frozen=True)
class RankEntry:
    """One rank's record of one collective: what matching needs, read from a dump or from another node's record."""

    rank: int  # global
    pg: str
    seq: int  # collective_seq_id
    op: str
    created_ns: int  # time_created_ns: when the rank enqueued it (its host's wall clock)
    state: OpState
    nbytes: int | None = None  # nccl-tests' size S (fr_collective_bytes)
    nranks: int | None = None  # the group's member count, where the rank's dump listed the group
    duration_ms: float | None = None
    completed_ns: int | None = None  # when its watchdog thread saw it complete (this host's clock)


def rank_entries(dumps: Iterable[FrDump]) -> list[RankEntry]:
    """The collectives in Flight Recorder dumps, per rank: no p2p, no coalescing markers, none without a
    sequence number or creation time; dumps without a rank are skipped (their arrivals could not be attributed)."""
    out = []
    for dump in dumps:
        if dump.rank is None:
            continue
        for e in dump.entries:
            if e.is_p2p or e.op == "Coalesced" or e.collective_seq_id is None or e.time_created_ns is None:
                continue
            group = dump.process_groups.get(e.pg_id)
            nranks = len(group.ranks) if group is not None and group.ranks else None
            out.append(
                RankEntry(
                    rank=dump.rank,
                    pg=e.pg_id,
                    seq=e.collective_seq_id,
                    op=e.op,
                    created_ns=e.time_created_ns,
                    state=e.state,
                    nbytes=fr_collective_bytes(e),
                    nranks=nranks,
                    duration_ms=e.duration_ms,
                    completed_ns=e.time_completed_ns,
                )
            )
    return out


def match_collectives(dumps: Iterable[FrDump]) -> list[CollectiveTiming]:
    """Flight Recorder dumps of several ranks -> one ``CollectiveTiming`` per (group, collective_seq_id)."""
    return match_entries(rank_entries(dumps))


def match_entries(entries: Iterable[RankEntry]) -> list[CollectiveTiming]:
    """Per-rank entries (of one node or several) -> one ``CollectiveTiming`` per (group, sequence), ordered by
    group, then sequence.  A group's size is what a rank's dump listed, else the ranks seen in it."""
    seen: dict[tuple[str, int], dict[int, RankEntry]] = defaultdict(dict)
    sizes: dict[str, int] = {}
    ranks_per_pg: dict[str, set[int]] = defaultdict(set)
    timed: set[str] = set()  # groups whose kernels are timed (some entry has a duration)
    for entry in entries:
        seen[(entry.pg, entry.seq)][entry.rank] = entry
        ranks_per_pg[entry.pg].add(entry.rank)
        if entry.nranks:
            sizes[entry.pg] = entry.nranks
        if entry.duration_ms is not None:
            timed.add(entry.pg)
    return [
        _timing(pg, seq, by_rank, sizes.get(pg, len(ranks_per_pg[pg])), timed=pg in timed)
        for (pg, seq), by_rank in sorted(seen.items(), key=lambda item: (item[0][0], item[0][1]))
    ]


def _timing(pg: str, seq: int, by_rank: Mapping[int, RankEntry], nranks: int, *, timed: bool) -> CollectiveTiming:
    entries = list(by_rank.values())
    arrivals = {rank: e.created_ns for rank, e in by_rank.items()}
    completed = all(e.state == OpState.completed for e in entries)
    last_arrival = max(arrivals.values())
    return CollectiveTiming(
        pg=pg,
        seq=seq,
        op=entries[0].op,
        nranks=nranks,
        nbytes=entries[0].nbytes,
        arrivals=arrivals,
        completed=completed,
        transfer_s=link_time(by_rank, whole=len(arrivals) >= nranks, timed=timed),
        started_ns=last_arrival if len(arrivals) >= nranks else None,
        kernel_s={rank: e.duration_ms / 1e3 for rank, e in by_rank.items() if e.duration_ms is not None},
    )


def link_time(by_rank: Mapping[int, RankEntry], *, whole: bool, timed: bool) -> float | None:
    """Seconds the data took, from the last rank's start to the end; None where the entries cannot tell.

    Every rank's kernel ends when the last rank's data has moved, and starts no
    earlier than its rank enqueued it, so each duration is at least the link
    time and the shortest is the last starter's, exact.  A rank's newest
    entries may carry no duration yet (Flight Recorder computes it when the
    watchdog thread retires the entry; a dump between completion and
    retirement writes ``completed`` without it, its discovered times at the
    dump): when the last rank to arrive has none, the others' durations may
    include their wait for it (a rank 0.4 s late would read as a 32 MiB
    all-reduce taking 0.4 s).  Then the link time is the kernel of the latest
    earlier arrival less its wait for the last enqueue, never above the
    shortest duration recorded (each is at least the link time).  A kernel
    shorter than the last enqueue's lead began behind earlier work, its host
    ahead of its GPU (on the H100 a healthy FSDP2 rank enqueued 223 ms before
    the one that synchronised): it waited for nobody, and the shortest
    duration is the link time's bound, where the first discovered completion
    less the last arrival would hold the late host's GPU queue and the
    watchdog's poll.  Without any duration it is that completion bound, unless
    the group's kernels are ``timed`` (other entries have durations): then
    none of these was retired yet, and a host running ahead of its GPU puts
    its whole queue between enqueue and completion (on the H100 a healthy
    FSDP2 job's newest reduce-scatters read as 1 % of their usual speed).
    ``whole``: every rank of the group is in ``by_rank`` (else the last arrival
    is unknown and the shortest duration is all there is).
    """
    durations = {rank: e.duration_ms / 1e3 for rank, e in by_rank.items() if e.duration_ms is not None}
    if not whole:
        return min(durations.values(), default=None)
    arrivals = {rank: e.created_ns for rank, e in by_rank.items()}
    last = max(arrivals, key=lambda r: (arrivals[r], r))
    if durations:
        shortest = min(durations.values())
        if last in durations:
            return shortest
        latest = max(durations, key=lambda r: (arrivals[r], r))
        after_last = durations[latest] - (arrivals[last] - arrivals[latest]) / 1e9
        return min(after_last, shortest) if after_last > 0 else shortest
    done = [e.completed_ns for e in by_rank.values() if e.completed_ns is not None]
    if not timed and done and min(done) > arrivals[last]:
        return (min(done) - arrivals[last]) / 1e9
    return None


def size_bucket(nbytes: int) -> int:
    """Power-of-two bucket: collectives within a factor of two are compared with each other."""
    return max(nbytes, 1).bit_length()


def judged_on_bandwidth(timings: Iterable[CollectiveTiming], min_bytes: int) -> list[CollectiveTiming]:
    """The collectives with a bus bandwidth and at least ``min_bytes``: the only ones the detectors compare."""
    return [t for t in timings if t.busbw is not None and t.nbytes is not None and t.nbytes >= min_bytes]


def comm_bandwidth(
    timings: Sequence[CollectiveTiming], *, window: int = 50, min_bytes: int = MIN_BYTES
) -> dict[tuple[str, str], float]:
    """Median busbw of each (group, op) over its last ``window`` completed collectives of at least ``min_bytes``."""
    series: dict[tuple[str, str], list[float]] = defaultdict(list)
    for t in judged_on_bandwidth(timings, min_bytes):
        series[(t.pg, t.op)].append(t.busbw)  # type: ignore[arg-type]
    return {key: statistics.median(values[-window:]) for key, values in series.items()}


def rank_bandwidth(
    timings: Sequence[CollectiveTiming], *, window: int = 50, min_bytes: int = MIN_BYTES
) -> dict[int, float]:
    """Each rank's busbw: the median over the collectives it took part in (a collective moves at its slowest link,
    so a rank's own kernel time says how long it waited, not how fast its link is)."""
    series: dict[int, list[float]] = defaultdict(list)
    for t in judged_on_bandwidth(timings, min_bytes):
        for rank in t.arrivals:
            series[rank].append(t.busbw)  # type: ignore[arg-type]
    return {rank: statistics.median(values[-window:]) for rank, values in series.items()}


# --------------------------------------------------------------------------
# Detector: slow against its own history (slow against its peers: links.slow_links)
# --------------------------------------------------------------------------


def slow_collectives(
    timings: Sequence[CollectiveTiming],
    *,
    now_ns: int | None = None,
    hosts: Mapping[int, str] = {},
    links: Mapping[int, Sequence[str]] = {},
    ratio: float = 0.25,
    min_history: int = 5,
    recent: int = 3,
    min_bytes: int = MIN_BYTES,
    min_elapsed_s: float = 10.0,
) -> list[PerfFinding]:
    """A collective far slower than the same group's same op at about the same size did before.

    Two cases.  Finished: the median busbw of the latest ``recent`` is under
    ``ratio`` x the history before them, taken as its slowest tenth (the
    10th percentile), not its median: one op at one size can run at two
    speeds in a healthy job.  On the H100 an FSDP2 job's forward all-gathers
    moved 1 MiB in 0.1-0.3 ms and its backward ones, behind a reduce-scatter
    of the same communicator, in 4.5 ms, six of them in a row; against the
    median, every run of backward ones read as 6 % of the usual speed.  One
    slow instance is a hiccup, not a slow collective: on 2 x H200 a healthy
    job had one all-reduce at 7-18 % of its usual speed in every group at
    once, and the first look of a job sees its warm-up.  Still running (``now_ns`` given): every rank
    arrived, and it has run longer than ``min_elapsed_s`` and than its
    usual time / ``ratio``.  Whether a running one still moves data (IB
    counters, GPU) or is hung is for the caller: this says only "slow".
    One collective is in every rank's path, so it names all the group's
    ranks; ``links.slow_links`` and the IB port checks say which link.
    """
    groups: dict[tuple[str, str, int], list[CollectiveTiming]] = defaultdict(list)
    for t in judged_on_bandwidth(timings, min_bytes):
        groups[(t.pg, t.op, size_bucket(t.nbytes))].append(t)  # type: ignore[arg-type]
    findings: list[PerfFinding] = []
    for series in groups.values():
        history, latest = series[:-recent][-50:], series[-recent:]
        if len(history) < min_history or len(latest) < recent:
            continue
        speeds = [t.busbw for t in history]
        usual = statistics.median(speeds)  # type: ignore[type-var]
        slowest = statistics.quantiles(speeds, n=10, method="inclusive")[0]  # type: ignore[arg-type]
        now = statistics.median(t.busbw for t in latest)  # type: ignore[misc]
        if now < ratio * slowest:
            findings.append(
                _slow_finding(latest[-1], now, usual, hosts, links, running_s=None, over=recent, slowest=slowest)
            )
    if now_ns is not None:
        findings += _slow_running(timings, groups, now_ns, hosts, links, ratio, min_history, min_bytes, min_elapsed_s)
    return findings


def _slow_running(
    timings, groups, now_ns, hosts, links, ratio, min_history, min_bytes, min_elapsed_s
) -> list[PerfFinding]:  # type: ignore[no-untyped-def]
    findings = []
    for t in timings:
        if t.completed or t.started_ns is None or t.nbytes is None or t.nbytes < min_bytes:
            continue
        history = groups.get((t.pg, t.op, size_bucket(t.nbytes)), [])[-50:]
        factor = bus_factor(t.op, t.nranks)
        if len(history) < min_history or factor is None:
            continue
        usual = statistics.median(h.busbw for h in history)
        elapsed = (now_ns - t.started_ns) / 1e9
        usual_s = t.nbytes * factor / usual
        if elapsed > max(min_elapsed_s, usual_s / ratio):
            # The best it can have achieved so far: all of it moved just now.
            findings.append(_slow_finding(t, t.nbytes * factor / elapsed, usual, hosts, links, running_s=elapsed))
    return findings


def _slow_finding(
    t: CollectiveTiming,
    measured: float,
    usual: float,
    hosts: Mapping[int, str],
    links: Mapping[int, Sequence[str]],
    running_s: float | None,
    over: int = 1,
    slowest: float | None = None,
) -> PerfFinding:
    ranks = tuple(sorted(t.arrivals))
    host_names, link_names = where(ranks, hosts, links)
    what = f"{t.op} #{t.seq} of process group {t.pg} ({size_text(t.nbytes)}, {t.nranks} ranks)"
    if running_s is None:
        summary = (
            f"{what} and the {over - 1} before it ran at {gbps(measured)} bus bandwidth (median), "
            f"{measured / usual:.0%} of their usual {gbps(usual)} (their slowest tenth: {gbps(slowest)})"
        )
    else:
        summary = (
            f"{what} has run for {running_s:.0f} s since the last rank arrived (at most {gbps(measured)}, "
            f"usually {gbps(usual)}: {t.nbytes * bus_factor(t.op, t.nranks) / usual:.2f} s)"  # type: ignore[operator]
        )
    return PerfFinding(
        kind=PerfKind.slow_collective,
        key=f"slow_collective-{t.pg}-{t.op}",
        summary=summary,
        detail="one slow link slows every rank of the group: compare this group's InfiniBand ports' throughput and "
        "error counters, and the transports NCCL chose (report: ib, transport)",
        ranks=ranks,
        hosts=host_names,
        links=link_names,
        communicator=t.pg,
        measured=measured,
        expected=usual,
    )


def size_text(nbytes: int | None) -> str:
    """``1.0 MiB``, ``512 B``; ``size unknown`` for None."""
    if nbytes is None:
        return "size unknown"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
