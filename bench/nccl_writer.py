"""Real NCCL INFO lines, appended at a set rate as NCCL appends them: the writer footprint.py and sidecar_cost.py share.

The lines are a real capture's (``CAPTURE``: tests/fixtures/nccl-2.28.9-2gpu/
healthy, 2 x H200, NCCL 2.28.9): its lines before the first operation (ENV,
Init START/COMPLETE with the commId, transports), then its 285 operation
lines over and over, then its closing lines (Destroy).  ``as_rank`` makes a
capture rank's lines those of any rank of any job size, in the writing
process's own host and pid prefix.  ``paced`` says how many lines are due
every 10 ms at a rate that may change; the caller writes them in one batch
through one open descriptor, as NCCL's debug file is written.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CAPTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nccl-2.28.9-2gpu" / "healthy" / "nccl"
_OP = b": opCount "
_PREFIX = re.compile(rb"^[^:\n]+:(\d+):(\d+) \[\d+\]", re.M)
_INIT_RANK = re.compile(rb" rank (\d+) nranks (\d+) ")


def capture(rank_file: Path) -> tuple[bytes, list[bytes]]:
    """(the lines before the first operation, the operation lines) of one rank's real NCCL file."""
    lines = rank_file.read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if _OP in line)
    return b"".join(lines[:first]), [line for line in lines[first:] if _OP in line]


def closing(rank_file: Path) -> bytes:
    """The lines after the last operation of one rank's real NCCL file (its communicators' Destroy)."""
    lines = rank_file.read_bytes().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if _OP in line)
    return b"".join(lines[last + 1 :])


def as_rank(text: bytes, *, rank: int, nranks: int, host: str, pid: int) -> bytes:
    """A capture rank's lines as rank ``rank`` of ``nranks`` writes them, from process ``pid`` on ``host``.

    The prefix (``host:pid:tid [cudaDev]``, threads kept apart by their
    offset from the main thread), the rank and size in the Init, topology and
    operation lines, the Send and Recv peers (the captured ring) and the
    communicator's address (one per process) change; the commId stays, so
    all ranks share one communicator.
    """
    capture_pid = int(_PREFIX.search(text).group(1))
    capture_rank, capture_size = (int(g) for g in _INIT_RANK.search(text).groups())

    def prefix(match: re.Match[bytes]) -> bytes:
        return f"{host}:{pid}:{pid + int(match.group(2)) - capture_pid} [{rank}]".encode()

    text = _PREFIX.sub(prefix, text)
    text = _INIT_RANK.sub(f" rank {rank} nranks {nranks} ".encode(), text)
    text = re.sub(
        rb"nRanks \d+ nNodes 1 localRanks \d+ localRank \d+",
        f"nRanks {nranks} nNodes 1 localRanks {nranks} localRank {rank}".encode(),
        text,
    )
    text = re.sub(rb"cudaDev \d+ nvmlDev \d+", f"cudaDev {rank} nvmlDev {rank}".encode(), text)
    text = re.sub(rb"cudaDev \d+ busId", f"cudaDev {rank} busId".encode(), text)
    text = text.replace(f"[nranks={capture_size}]".encode(), f"[nranks={nranks}]".encode())
    # The captured job's ring batch_isend_irecv: send to rank + 1, receive from rank - 1 (a line's root is its peer).
    text = re.sub(rb"(Send: .*? root )\d+ ", f"\\g<1>{(rank + 1) % nranks} ".encode(), text)
    text = re.sub(rb"(Recv: .*? root )\d+ ", f"\\g<1>{(rank - 1) % nranks} ".encode(), text)
    comm = re.search(rb"comm (0x[0-9a-f]+) rank ", text).group(1)
    return text.replace(comm, f"0x{0x10000000 + 0x100000 * rank + capture_rank:x}".encode())


class OpCycle:
    """A capture's operation lines, handed out in order and over again."""

    def __init__(self, ops: list[bytes]) -> None:
        self.ops = ops
        self.index = 0

    def take(self, count: int) -> bytes:
        """The next ``count`` operation lines, joined."""
        batch = b"".join(self.ops[(self.index + i) % len(self.ops)] for i in range(count))
        self.index += count
        return batch


def paced(rate: Callable[[], float], running: Callable[[], bool], most: int = 50_000) -> Iterator[int]:
    """Counts of lines due at ``rate()`` per second, looked at every 10 ms, while ``running()``.

    A changed rate counts from the moment it changed; a writer that fell
    behind catches up at most ``most`` lines at a time.
    """
    began, sent, pace = time.monotonic(), 0, rate()
    while running():
        if rate() != pace:
            began, sent, pace = time.monotonic(), 0, rate()
        due = int((time.monotonic() - began) * pace) - sent
        if due <= 0:
            time.sleep(0.01)
            continue
        due = min(due, most)
        sent += due
        yield due
