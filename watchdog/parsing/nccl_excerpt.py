"""NCCL operation lines whose communicator's Init line is not in the input -> ``OrphanOps``.

An excerpt pasted into an issue, or a log rotated past its start, has COLL
lines but no ``ncclCommInitRank`` line: no rank, no communicator identity.
The fast parser (``nccl_log``) cannot place such lines; this slower pass
runs only over the files that had them and keeps, per process and
communicator address, the count and the last ``KEEP`` operations with their
``opCount`` and line number, plus ``[nranks=N]`` (2.19+), the ``[cudaDev]`` of the prefix and the rank a
``[rankN]:`` prefix or the file name gives.

A pasted excerpt often lost even the ``host:pid:tid`` in front of NCCL's own ``[cudaDev] NCCL INFO``: ``BareLines``
gives each such line a process again, named by its file and GPU (``pasted-<file>:<cudaDev>:0 [cudaDev] NCCL
...``), before any NCCL reader sees it; its Init lines, where kept, then give the ranks.

Failure mode: ``opCount`` counts kernel launches, not operations, and is 0
forever on single-node jobs from NCCL 2.27.3; ``hang.partial`` aligns by it
only when it moves.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import PurePath

from ncclwatch.watchdog.events import OpSig, OrphanOps, ProcKey
from ncclwatch.watchdog.parsing.rank_prefix import rank_of_line

KEEP = 64

_LINE_RE = re.compile(
    rb"(?m)^(?P<pre>(?:\[[^\]\n]*\]:? ?|\d+: )*)(?P<host>[^:\s\[\]]+):(?P<pid>\d+):\d+ \[(?P<dev>\d+)\] "
    rb"NCCL INFO (?P<op>\w+): "
    rb"opCount (?P<oc>[0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (?P<count>\d+) datatype (?P<dt>\d+) "
    rb"op (?P<redop>\d+) root (?P<root>-?\d+) comm (?P<comm>\S+)(?: \[nranks=(?P<nranks>\d+)\])?"
)


_BARE_RE = re.compile(rb"(?m)^\[(\d+)\] NCCL (?=INFO |WARN )")


def has_bare_lines(head: bytes) -> bool:
    """NCCL lines whose ``host:pid:tid`` was cut off (``[0] NCCL INFO ...``, as pasted into an issue)."""
    return _BARE_RE.search(head) is not None


class BareLines:
    """Chunks cut anywhere -> the same lines, each bare NCCL line behind a process named by its file and GPU.

    The line count never changes (citations hold).  Two ranks' pastes in one file stay apart by their GPU; two
    files of one GPU each are two processes by their names.
    """

    def __init__(self, name: str) -> None:
        stem = re.sub(r"[^\w.-]", "_", PurePath(name).name) or "input"
        self._host = b"pasted-" + stem.encode()
        self._partial = b""

    def feed(self, chunk: bytes, final: bool = False) -> bytes:
        text = self._partial + chunk
        cut = len(text) if final else text.rfind(b"\n") + 1
        self._partial = text[cut:]
        return _BARE_RE.sub(lambda m: self._host + b":" + m[1] + b":0 " + m[0], text[:cut])


class _Slot:
    __slots__ = ("count", "cuda_dev", "last", "nranks", "rank")

    def __init__(self) -> None:
        self.count = 0
        self.cuda_dev: int | None = None
        self.last: deque[tuple[int, OpSig, int]] = deque(maxlen=KEEP)
        self.nranks: int | None = None
        self.rank: int | None = None


class OrphanScanner:
    """Stream one file; keep what can be aligned of the communicators in ``wanted``."""

    def __init__(self, name: str, wanted: set[tuple[ProcKey, str]], file_rank: int | None) -> None:
        self.name = name
        self.file_rank = file_rank
        self._wanted = {(proc.host, proc.pid, ptr) for proc, ptr in wanted}
        self._slots: dict[tuple[str, int, str], _Slot] = {}
        self._carry = b""
        self._lines = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        body = self._carry + data
        stop = len(body) if final else body.rfind(b"\n") + 1
        self._carry = b"" if final else body[stop:]
        counted = 0
        for m in _LINE_RE.finditer(body, 0, stop):
            key = (m["host"].decode(errors="replace"), int(m["pid"]), m["comm"].decode(errors="replace"))
            if key not in self._wanted:
                continue
            self._lines += body.count(b"\n", counted, m.start())
            counted = m.start()
            slot = self._slots.get(key) or self._slots.setdefault(key, _Slot())
            slot.count += 1
            sig = OpSig(m["op"].decode(), int(m["count"]), m["dt"].decode(), m["redop"].decode(), int(m["root"]))
            slot.last.append((int(m["oc"], 16), sig, self._lines + 1))
            if m["nranks"]:
                slot.nranks = int(m["nranks"])
            slot.cuda_dev = int(m["dev"])
            if slot.rank is None:
                hint = rank_of_line(m["pre"].decode(errors="replace"))
                slot.rank = hint[0] if hint else self.file_rank
        self._lines += body.count(b"\n", counted, stop)

    def skip_lines(self, lines: int) -> None:
        """The caller starts past ``lines`` lines (only a file's tail holds its last operations)."""
        self._lines += lines

    def events(self) -> list[OrphanOps]:
        return [
            OrphanOps.model_construct(
                proc=ProcKey(host, pid),
                comm_ptr=ptr,
                file=self.name,
                rank=slot.rank,
                nranks=slot.nranks,
                cuda_dev=slot.cuda_dev,
                count=slot.count,
                last=list(slot.last),
            )
            for (host, pid, ptr), slot in self._slots.items()
        ]
