"""NVIDIA's NCCL Inspector profiler plugin output -> completed operations and per-communicator progress.

The plugin (``plugins/profiler/inspector`` in NVIDIA/nccl, loaded with
``NCCL_PROFILER_PLUGIN``; ``NCCL_INSPECTOR_ENABLE=1``) writes into
``NCCL_INSPECTOR_DUMP_DIR`` one of two formats:

JSON lines (default), one file per process, ``<host>-pid<pid>.log``,
appended by a dump thread every ``NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS``.
One object per *completed* operation per communicator::

    {"header": {"id": "0x5ec1...", "comm_name": "unknown", "rank": 0, "n_ranks": 2, "nnodes": 2},
     "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "...",
                  "rec_mechanism": "nccl_profiler_interface", "dump_timestamp_us": 1796..., "hostname": "h", "pid": 7},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 41, "coll_msg_size_bytes": 32768, "coll_exec_time_us": 61,
                   "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 0.53, "coll_busbw_gbs": 0.53}}

or ``"p2p_perf": {"p2p": "Send", "p2p_sn", "p2p_peer", "p2p_msg_size_bytes", "p2p_exec_time_us",
"p2p_timing_source", "p2p_algobw_gbs", "p2p_busbw_gbs"}``; with ``NCCL_INSPECTOR_DUMP_VERBOSE=1`` also
``event_trace_sn`` / ``event_trace_ts`` (ignored here).  ``header.rank`` is the rank *in that communicator*,
``header.id`` NCCL's ``comm->commHash`` as ``0x%lx``.  For a communicator made from a unique id that is the
``commId 0x...`` of NCCL's ``Init START|COMPLETE`` line (NCCL 2.28.9 init.cc); for one made by
``ncclCommSplit`` (PyTorch's sub-groups once the default group is bound to a device) it is a hash of
(parent hash, split count, color) that NCCL's INFO lines never print, so such a communicator is joined to
the log's by (host, pid, rank, nranks), not by id.  A double that is NaN is written as the string ``"nan"``.
What the plugin cannot say, it leaves out rather than guesses:

* operations under ``NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES`` (default 8192) are not recorded at all;
* each communicator keeps its completed operations in a ring (``NCCL_INSPECTOR_DUMP_COLL_RING_SIZE``, default
  1024) drained at every dump, the oldest overwritten when full: more completions than that between two dumps
  are lost, so sequence numbers have gaps and a count of records is not a count of operations.  Progress is
  therefore the *highest* sequence number seen, never a count;
* with ``NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=1`` (default) an operation without GPU kernel timing is dropped.

Prometheus text (``NCCL_INSPECTOR_PROM_DUMP=1``): one file per GPU, ``nccl_inspector_metrics_<uuid>.prom``,
rewritten whole at most every 30 s, holding per (communicator name, collective, message-size bucket) over the
operations completed since the previous dump the geometric mean ``nccl_bus_bandwidth_gbs`` and the mean
``nccl_collective_exec_time_microseconds`` (``nccl_p2p_*`` for p2p; inspector_prom.cc).
No sequence numbers: it says how fast, not how far.  ``parse_inspector_prom`` reads any Prometheus text
exposition into samples.

Pure: bytes in, frozen dataclasses out; a malformed or half-written line is counted, never raised.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

INSPECTOR_MARKERS = (b'"rec_mechanism"', b'"inspector_output_format_version"')


@dataclass(frozen=True)
class InspectorOp:
    """One completed operation of one communicator on one rank, as the plugin recorded it."""

    host: str
    pid: int
    comm_id: str  # NCCL's communicator hash, "0x..."
    comm_name: str  # "unknown" where the job gave NCCL no name
    rank: int  # in this communicator
    nranks: int
    nnodes: int
    kind: str  # "coll" or "p2p"
    op: str  # "AllReduce", "ReduceScatter", "Send", ...
    seq: int  # coll_sn / p2p_sn: per communicator and kind
    peer: int | None  # p2p only
    size_bytes: int
    exec_us: int
    timing_source: str | None  # "kernel_gpu", "kernel_cpu", "collective_cpu"
    algo_bw_gbs: float | None
    bus_bw_gbs: float | None
    dumped_at_us: int  # the dump's wall clock, microseconds since the epoch; not the completion's


@dataclass(frozen=True)
class CommProgress:
    """How far one rank got in one communicator: the highest completed sequence numbers seen, and its speed."""

    host: str
    pid: int
    comm_id: str
    comm_name: str
    rank: int
    nranks: int
    last_coll_seq: int | None
    last_p2p_seq: int | None
    last_op: str  # the operation holding the highest sequence number of its kind, collectives first
    records: int  # records seen (not operations: see the module docstring)
    bus_bw_gbs_median: float | None  # over records with a bandwidth, collectives and p2p together
    exec_us_median: float | None
    last_dump_us: int


@dataclass(frozen=True)
class PromSample:
    """One sample of a Prometheus text file."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, name: str) -> str | None:
        return dict(self.labels).get(name)


def looks_like_inspector(head: bytes) -> bool:
    return all(marker in head for marker in INSPECTOR_MARKERS) and (b'"coll_perf"' in head or b'"p2p_perf"' in head)


def _number(value: Any) -> float | None:
    """A bandwidth as the plugin writes it: a number, or the string "nan"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def _op(doc: dict) -> InspectorOp:
    header, meta = doc["header"], doc["metadata"]
    kind = "coll" if "coll_perf" in doc else "p2p"
    perf = doc[f"{kind}_perf"]
    return InspectorOp(
        host=str(meta["hostname"]),
        pid=int(meta["pid"]),
        comm_id=str(header["id"]),
        comm_name=str(header.get("comm_name", "unknown")),
        rank=int(header["rank"]),
        nranks=int(header["n_ranks"]),
        nnodes=int(header.get("nnodes", 0)),
        kind=kind,
        op=str(perf[kind]),
        seq=int(perf[f"{kind}_sn"]),
        peer=int(perf["p2p_peer"]) if kind == "p2p" else None,
        size_bytes=int(perf[f"{kind}_msg_size_bytes"]),
        exec_us=int(perf[f"{kind}_exec_time_us"]),
        timing_source=perf.get(f"{kind}_timing_source"),
        algo_bw_gbs=_number(perf.get(f"{kind}_algobw_gbs")),
        bus_bw_gbs=_number(perf.get(f"{kind}_busbw_gbs")),
        dumped_at_us=int(meta["dump_timestamp_us"]),
    )


class InspectorJsonParser:
    """Incremental: ``feed`` the bytes appended to one JSON-lines file; a partial last line waits for its end.

    ``garbled`` counts lines that are not one of the plugin's records (another
    version's, or bytes of a file cut by a crash).
    """

    def __init__(self) -> None:
        self._rest = b""
        self.garbled = 0

    def feed(self, data: bytes) -> list[InspectorOp]:
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        return self._parse(lines)

    def close(self) -> list[InspectorOp]:
        """The last line, if the file ended without its newline."""
        rest, self._rest = self._rest, b""
        return self._parse([rest])

    def _parse(self, lines: Iterable[bytes]) -> list[InspectorOp]:
        ops = []
        for line in lines:
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                ops.append(_op(doc))
            except (ValueError, KeyError, TypeError, AttributeError):
                self.garbled += 1
        return ops


def parse_inspector_json(data: bytes) -> list[InspectorOp]:
    """Every record of a whole JSON-lines file."""
    parser = InspectorJsonParser()
    return parser.feed(data) + parser.close()


def median_or_none(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def progress(ops: Iterable[InspectorOp]) -> list[CommProgress]:
    """Per (process, communicator, rank): the highest completed sequence numbers and the speed, in first-seen order."""
    groups: dict[tuple[str, int, str, int], list[InspectorOp]] = {}
    for op in ops:
        groups.setdefault((op.host, op.pid, op.comm_id, op.rank), []).append(op)
    result = []
    for (host, pid, comm_id, rank), mine in groups.items():
        colls = [op for op in mine if op.kind == "coll"]
        p2ps = [op for op in mine if op.kind == "p2p"]
        latest = max(colls or p2ps, key=lambda op: op.seq)
        result.append(
            CommProgress(
                host=host,
                pid=pid,
                comm_id=comm_id,
                comm_name=mine[-1].comm_name,
                rank=rank,
                nranks=mine[-1].nranks,
                last_coll_seq=max(op.seq for op in colls) if colls else None,
                last_p2p_seq=max(op.seq for op in p2ps) if p2ps else None,
                last_op=latest.op,
                records=len(mine),
                bus_bw_gbs_median=median_or_none([op.bus_bw_gbs for op in mine if op.bus_bw_gbs is not None]),
                exec_us_median=median_or_none([float(op.exec_us) for op in mine]),
                last_dump_us=max(op.dumped_at_us for op in mine),
            )
        )
    return result


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def parse_inspector_prom(text: str) -> list[PromSample]:
    """The samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    samples = []
    for line in text.splitlines():
        match = _PROM_LINE.match(line.strip())
        if match is None or line.lstrip().startswith("#"):
            continue
        name, body, raw = match.groups()
        labels = tuple((key, _unescape(value)) for key, value in _PROM_LABEL.findall(body or ""))
        try:
            value = float(raw)
        except ValueError:
            continue
        samples.append(PromSample(name=name, labels=labels, value=value))
    return samples
