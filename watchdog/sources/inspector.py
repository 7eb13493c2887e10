"""A source that follows NVIDIA's NCCL Inspector output, where the job loads the plugin.

It tails every JSON-lines file in ``NCCL_INSPECTOR_DUMP_DIR`` (one per
process, ``<host>-pid<pid>.log``; format in ``parsing/inspector.py``) and,
after each poll, emits one ``InspectorProgress`` per (process, communicator,
rank) whose highest completed sequence number moved: completion, which
NCCL's INFO lines cannot say (they are printed at enqueue), and the rank's
bus bandwidth for stragglers and slow links.

The plugin appends to its file for the life of the process, so the source
keeps per (process, communicator, rank) only the running maximum and a
window of the last ``WINDOW`` records' speeds: its memory is bounded by the
number of communicators, not by the job's length.  Prometheus files
(``NCCL_INSPECTOR_PROM_DUMP=1``) carry no sequence numbers and are not read
here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ncclwatch.watchdog.events import Citation, InspectorProgress, Unusable
from ncclwatch.watchdog.parsing.inspector import InspectorJsonParser, InspectorOp, median_or_none
from ncclwatch.watchdog.sources import DownOnce, Emit, PollingSource
from ncclwatch.watchdog.sources.files import FolderTails

WINDOW = 256  # records per communicator and rank whose speeds the medians are taken over


@dataclass
class _Comm:
    """The running facts of one (process, communicator, rank)."""

    first: InspectorOp
    last_coll_seq: int | None = None
    last_p2p_seq: int | None = None
    last_dump_us: int = 0
    bus_bw: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    exec_us: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, op: InspectorOp) -> bool:
        """Fold one record in; True when a highest sequence number moved."""
        moved = False
        if op.kind == "coll" and (self.last_coll_seq is None or op.seq > self.last_coll_seq):
            self.last_coll_seq, moved = op.seq, True
        if op.kind == "p2p" and (self.last_p2p_seq is None or op.seq > self.last_p2p_seq):
            self.last_p2p_seq, moved = op.seq, True
        self.last_dump_us = max(self.last_dump_us, op.dumped_at_us)
        if op.bus_bw_gbs is not None:
            self.bus_bw.append(op.bus_bw_gbs)
        self.exec_us.append(float(op.exec_us))
        return moved

    def event(self, path: str) -> InspectorProgress:
        first = self.first
        return InspectorProgress(
            host=first.host,
            pid=first.pid,
            comm_id=first.comm_id,
            comm_name=first.comm_name,
            rank=first.rank,
            nranks=first.nranks,
            last_coll_seq=self.last_coll_seq,
            last_p2p_seq=self.last_p2p_seq,
            bus_bw_gbs_median=median_or_none(self.bus_bw),
            exec_us_median=median_or_none(self.exec_us),
            dumped_at=self.last_dump_us / 1e6,
            cite=Citation(file=path),
        )


@dataclass
class _File:
    parser: InspectorJsonParser = field(default_factory=InspectorJsonParser)
    comms: dict[tuple[str, int], _Comm] = field(default_factory=dict)  # (comm_id, rank) -> facts
    garbled_seen: int = 0


class InspectorSource(PollingSource):
    """Tails the Inspector's JSON-lines files in ``folder`` as they appear."""

    name = "nccl_inspector"

    def __init__(self, folder: Path, interval: float = 1.0) -> None:
        self.folder = folder
        self.interval = interval  # the plugin itself dumps at most as often as the job sets (1 s and more)
        self._tails = FolderTails(folder, lambda path: _File())
        self._down = DownOnce(self.name)

    def poll(self, emit: Emit) -> None:
        try:
            changed = self._tails.read()
        except OSError as exc:
            self._down(emit, f"cannot list {self.folder}: {exc.strerror}")
            return
        self._down(emit, None)
        for path, state, data, restarted in changed:
            if not path.endswith(".log"):
                continue  # the plugin's Prometheus files (``.prom``): no sequence numbers
            if restarted:
                state.parser, state.comms, state.garbled_seen = InspectorJsonParser(), {}, 0
            moved: dict[tuple[str, int], _Comm] = {}
            for op in state.parser.feed(data):
                comm = state.comms.setdefault((op.comm_id, op.rank), _Comm(first=op))
                if comm.add(op):
                    moved[op.comm_id, op.rank] = comm
            for comm in moved.values():
                emit(comm.event(path))
            if state.parser.garbled > state.garbled_seen:
                state.garbled_seen = state.parser.garbled
                emit(Unusable(reason=f"{state.garbled_seen} unreadable Inspector line(s)", cite=Citation(file=path)))
