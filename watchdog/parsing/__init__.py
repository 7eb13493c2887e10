"""Pure parsers, one per wire format, and the content sniffer that picks them.

A file's type is decided by its content, never its name: NCCL debug files
are named ``<host>.<pid>`` with any suffix, Flight Recorder dumps
``<prefix><rank>``, and people rename everything.  A text file may be two
things at once (NCCL's lines inside a worker's stderr next to PyTorch's
timeout message), so every text kind whose markers appear is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.parsing.flight_recorder import looks_like_flight_recorder, parse_flight_recorder
from ncclwatch.watchdog.parsing.journal import looks_like_journal, parse_journal
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser, looks_like_nccl_log
from ncclwatch.watchdog.parsing.nvml import looks_like_nvml, parse_nvml
from ncclwatch.watchdog.parsing.pyspy import looks_like_pyspy, parse_pyspy
from ncclwatch.watchdog.parsing.ras import looks_like_ras, parse_ras
from ncclwatch.watchdog.parsing.torch_log import looks_like_torch_log, parse_torch_log

SNIFF_BYTES = 1 << 20  # NCCL lines can start late in a worker's stderr

# A literal each of ``ras._SNIFF``'s patterns holds: its line-anchored patterns try every position of the 1 MiB
# head (37 ms per NCCL debug file), and a head holding none of these cannot match one.
_RAS_WORDS = (
    b" compiled with CUDA",
    b"Communicators...",
    b"Group ",
    b") INCOMPLETE",
    b") ERROR",
    b") MISMATCH",
    b'"nccl_version"',
    b'"communicators"',
)


def _looks_like_ras(head: bytes) -> bool:
    return any(word in head for word in _RAS_WORDS) and looks_like_ras(head)


@dataclass(frozen=True)
class Format:
    name: str
    looks_like: Callable[[bytes], bool]
    parse: Callable[[bytes, str], list[Event]] | None  # None: streamed (see NcclLogParser)


# Binary and JSON formats first: a file that is one of them is nothing else.  The journal leads: its
# first line is an exact header, and its later lines carry the other formats' markers (an NVML sample's
# "gpus", a stack's "frames", a shared dump's "entries"), so a sniffer before it would claim it.
EXCLUSIVE = (
    Format("journal", looks_like_journal, parse_journal),
    Format("flight_recorder", looks_like_flight_recorder, parse_flight_recorder),
    Format("py-spy", looks_like_pyspy, parse_pyspy),
    Format("nvml", looks_like_nvml, parse_nvml),
    Format("ras", _looks_like_ras, parse_ras),
)
TEXT = (
    Format("nccl_log", looks_like_nccl_log, None),
    Format("torch_log", looks_like_torch_log, parse_torch_log),
)


def sniff(head: bytes) -> list[Format]:
    """The formats a file's first bytes show; empty when none."""
    for fmt in EXCLUSIVE:
        if fmt.looks_like(head):
            return [fmt]
    return [fmt for fmt in TEXT if fmt.looks_like(head)]


__all__ = ["EXCLUSIVE", "SNIFF_BYTES", "TEXT", "Format", "NcclLogParser", "sniff"]
