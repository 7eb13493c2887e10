"""Which rank a line, or a whole file, belongs to when the text does not say.

Users hold one combined file as often as one file per rank: torchrun
``--tee`` prefixes every line with ``[default<local rank>]:``, PyTorch's own
messages with ``[rank<N>]:``, ``srun --label`` with ``<task>: ``.  A file of
one rank says so in its name (``rank3.log``, ``stderr_rank_3``, torchrun's
``attempt_0/3/stderr.log``).

Failure mode: a number that only looks like a prefix (a line starting with
``12: `` in a training printout) is read as a rank when the file has no other
prefix; callers treat these as hints (``RankLog.how`` says which kind).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePath

# "[rank3]:", "[default3]:", "[trainer3]:" (torchrun's role name), "3: " (srun --label), and the tags
# ``line_prefix`` writes for srun's and mpirun's labels: "[task3]: ", "[mpirank3]: ".
_LINE_RE = re.compile(r"^\s*(?:\[(?P<role>rank|default|[A-Za-z_]+)(?P<n>\d+)\]:|(?P<task>\d+): )")
_LINE_RE_B = re.compile(rb"\n(?:\[(rank|default|task|mpirank)(\d+)\]:|(\d+): )")
_PREFIX_B = re.compile(rb"\n(?:\[(?:rank|default|task|mpirank)\d+\]:|\d+: )")
_HOW = {
    "task": "srun --label prefix",
    "rank": "[rankN]: prefix",
    "mpirank": "mpirun --tag-output prefix",
}
_FILE_RE = re.compile(r"(?:^|[^a-z0-9])rank[_-]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)
_TORCHRUN_DIR_RE = re.compile(r"attempt_\d+/(\d+)/(?:stdout|stderr|error)\.(?:log|txt|json)$")


def rank_of_line(line: str) -> tuple[int, str] | None:
    """(rank, how) from a line's launcher prefix, or None."""
    m = _LINE_RE.match(line)
    if m is None:
        return None
    if m["task"] is not None:
        return int(m["task"]), "srun --label prefix"
    role = m["role"]
    if role in _HOW:
        return int(m["n"]), _HOW[role]
    return int(m["n"]), f"[{role}N]: prefix (torchrun --tee, local rank)"


_SAMPLE = SAMPLE = 1 << 18


def ranks_in_chunk(
    chunk: bytes, known: set[bytes] | None = None, stop: int | None = None, counted: bytes | None = None
) -> dict[tuple[int, str], int]:
    """Lines per (rank, prefix kind) in chunk[:stop]; ``chunk`` must start at a line start ("\\n").

    Prefixes are discovered in the chunk's first and last 256 KiB (plus
    ``known``, the ones seen before) and then counted with ``bytes.count``:
    a regex match object per line costs 18 s per GB.  ``counted``: a text
    with the same line starts to count them in (``nccl_log.Residual.text``,
    the chunk less its operation records).
    """
    stop = len(chunk) if stop is None else stop
    head, tail = chunk[: min(_SAMPLE, stop)], chunk[max(0, stop - _SAMPLE) : stop]
    return ranks_in_samples(head, tail, counted if counted is not None else lambda: chunk[:stop], known)


def ranks_in_samples(
    head: bytes, tail: bytes, counted: bytes | Callable[[], bytes], known: set[bytes] | None = None
) -> dict[tuple[int, str], int]:
    """``ranks_in_chunk`` given its samples (the chunk's first and last 256 KiB) and the text to count in (or
    what makes it: it is needed only where a prefix is known)."""
    found = set(_PREFIX_B.findall(head)) | set(_PREFIX_B.findall(tail))
    if known is not None:
        known |= found
        found = known
    counts: dict[tuple[int, str], int] = {}
    if not found:
        return counts
    text = counted() if callable(counted) else counted
    for prefix in found:
        n = text.count(prefix)
        if n:
            m = _LINE_RE_B.match(prefix)
            _add(counts, m.groups(), n)  # type: ignore[union-attr]
    return counts


def _add(counts: dict[tuple[int, str], int], groups: tuple[bytes, bytes, bytes], n: int) -> None:
    role, number, task = groups
    if task:
        key = (int(task), "srun --label prefix")
    elif role.decode() in _HOW:
        key = (int(number), _HOW[role.decode()])
    else:
        key = (int(number), "[defaultN]: prefix (torchrun --tee, local rank)")
    counts[key] = counts.get(key, 0) + n


def rank_of_file(name: str) -> int | None:
    """A rank named by the file's path: ``rank3.log``, ``.../attempt_0/3/stderr.log``."""
    path = PurePath(name)
    m = _TORCHRUN_DIR_RE.search(path.as_posix())
    if m:
        return int(m[1])
    for part in (path.name, path.parent.name):
        m = _FILE_RE.search(part)
        if m:
            return int(m[1])
    return None
