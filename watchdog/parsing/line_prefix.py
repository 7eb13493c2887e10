"""Lines as schedulers and launchers print them: the prefix in front of every line, found once per file.

A job's output often reaches on-call through the tool that launched it, and each puts its own mark in front
of every line: ``srun --label`` the task id (``12: ``, padded to the widest id), pdsh the host
(``10.1.2.3: ``), ``mpirun --tag-output`` the job and rank and stream (``[1,12]<stdout>:``, PRRTE's
``--output tag``), Ray the actor and process (``(RayTrainWorker pid=123, ip=10.0.0.1) ``), log collectors a
timestamp (ISO 8601 with or without ``T`` and zone, bracketed ``[2026-11-26 03:12:45,123]``, syslog
``Nov 26 03:12:45 host prog[pid]: ``, ``journalctl -o short-iso``, ``mpirun --timestamp-output``'s
``Thu Nov 26 03:12:45 2026``), and a timestamp and a label together.  The format parsers
(``nccl_log``, ``torch_log``, ``ras``, ...) expect their lines from the start, so such a file was ignored
whole.

``detect`` picks one form from the file's first lines (a form is tested against a few hundred lines, never
against every line of a 1 GB file); ``LinePrefix.strip`` then rewrites every line in one C-level split per
chunk: the timestamp goes, the launcher's label becomes a tag every parser already skips, ``[task12]: ``,
``[mpirank12]: ``, ``[host node3]: ``, ``[ray pid=123, ip=10.0.0.1]: `` (NCCL's parser skips bracketed prefixes;
``rank_prefix`` counts the task and MPI rank tags as it counted srun's labels; ``torch_log`` keeps the lines of
one tag together: a combined file of many tasks or hosts is read as the streams it interleaves).  The number of
lines never changes, so line numbers cite the original file.

Failure modes, by design: a form is taken only where it marks at least half of the sampled lines, so an
ordinary line that happens to start like one (``12: `` in a training printout) changes nothing; lines without
the file's prefix (a traceback the launcher did not label) pass unchanged.  The srun task id is a rank only
where srun started every rank; under ``torchrun`` per node it is the node, and NCCL's own ``host:pid`` prefix
still names the process (its Init line, the rank).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain

# Timestamps and hosts in front of the launcher's label; each is dropped, the syslog host kept as the stream
# where no label follows.
_ISO = rb"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_CTIME = rb"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"
_SYSLOG_DATE = rb"[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d"
_SYSLOG_TAIL = rb" (?P<host>[\w.-]+) [\w./@-]+(?:\[\d+\])?: "  # "host prog[pid]: " (journalctl, /var/log/syslog)
_TIMESTAMPS: tuple[tuple[str, bytes], ...] = (
    ("", b""),
    ("ISO 8601 timestamp", _ISO + rb" "),
    ("bracketed timestamp", rb"\[(?:" + _ISO + rb"|" + _CTIME + rb")\](?:<std(?:out|err)>:)? ?"),
    ("mpirun --timestamp-output", _CTIME + rb" ?"),
    ("syslog", _SYSLOG_DATE + _SYSLOG_TAIL),
    # journalctl's short-iso always has the zone; a logger's "2026-11-26 03:12:45,123 INFO foo: " has none.
    ("journalctl short-iso", rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)" + _SYSLOG_TAIL),
)
# The launcher's label: (name, pattern with the one group "label", the tag it becomes).
_LABELS: tuple[tuple[str, bytes, bytes], ...] = (
    ("", b"", b""),
    ("srun --label", rb" *(?P<label>\d+): ", b"task"),
    ("mpirun --tag-output", rb"\[\d+,(?P<label>\d+)\](?:\[[^\]\n]*\])?<std(?:out|err)>: ?", b"mpirank"),
    # pdsh: a host name with a digit in it ("node12", "10.1.2.3"); a word like "RuntimeError: " is no host.
    ("pdsh", rb"(?P<label>(?!\d+: )(?=[\w.-]*\d)[A-Za-z0-9][\w.-]*): ", b"host "),
    ("Ray", rb"\((?P<label>(?:[\w.]+ )?pid=\d+(?:, ip=[\d.]+)?)\) ", b"ray "),
)
_SAMPLE_LINES = 400
_SAMPLE_BYTES = 1 << 18


@dataclass(frozen=True)
class LinePrefix:
    """One file's prefix form: ``name`` says it ("syslog + srun --label"), ``tag`` names its streams."""

    name: str
    tag: bytes  # b"task", b"host ", ...; b"" where the prefix is a timestamp alone
    pattern: re.Pattern[bytes]  # "\n" + the prefix, its stream in the one group (where there is one)

    def strip(self, body: bytes, tags: dict[bytes | None, bytes] | None = None) -> bytes:
        """``body`` (lines each after a "\\n", the parsers' carry shape) with every line's prefix rewritten;
        ``tags``: a ``tag_cache()`` kept across chunks (its keys are then the streams seen)."""
        if self.pattern.groups == 0:
            return self.pattern.sub(b"\n", body)
        parts = self.pattern.split(body)
        texts, labels = parts[0::2], parts[1::2]
        tags = tags if tags is not None else self.tag_cache()
        return b"".join(chain.from_iterable(zip(texts, map(tags.__getitem__, labels)))) + texts[-1]

    def tag_cache(self) -> dict[bytes | None, bytes]:
        return _TagCache(self.tag)

    def remove_lines(self, data: bytes) -> bytes:
        """A whole text (no carry) with every line's prefix removed, tag and all: for the whole-file formats."""
        return self.pattern.sub(b"\n", b"\n" + data)[1:]


class _TagCache(dict[bytes | None, bytes]):
    """Label -> "\\n[<tag><label>]: ", made once per distinct label (a split gives one label per line)."""

    def __init__(self, tag: bytes) -> None:
        super().__init__()
        self.tag = tag

    def __missing__(self, label: bytes | None) -> bytes:
        value = self[label] = b"\n" if label is None else b"\n[" + self.tag + label.strip() + b"]: "
        return value


def _forms() -> list[tuple[str, bytes, re.Pattern[bytes]]]:
    forms = []
    for ts_name, ts in _TIMESTAMPS:
        for label_name, label, tag in _LABELS:
            if not ts and not label:
                continue
            stamp = ts
            if b"(?P<host>" in ts and label:
                stamp = ts.replace(b"(?P<host>", b"(?:")  # one stream group: the label's
            elif b"(?P<host>" in ts:
                stamp, tag = ts.replace(b"(?P<host>", b"(?P<label>"), b"host "
            name = " + ".join(n for n in (ts_name, label_name) if n)
            forms.append((name, tag, re.compile(rb"\n" + stamp + label)))
    return forms


_FORMS = _forms()


def detect(head: bytes) -> LinePrefix | None:
    """The prefix form that marks most of the first lines of ``head`` (at least half of them), or None."""
    sample = head[:_SAMPLE_BYTES]
    if len(head) > _SAMPLE_BYTES:
        sample = sample[: sample.rfind(b"\n") + 1] or sample
    lines = [b"\n" + line for line in sample.split(b"\n", _SAMPLE_LINES)[:_SAMPLE_LINES] if line.strip()]
    if not lines:
        return None
    best: tuple[int, int, str, bytes, re.Pattern[bytes]] | None = None
    for name, tag, pattern in _FORMS:
        count = sum(1 for line in lines if pattern.match(line))
        # Ties go to the longer form (a timestamp and a label over the timestamp alone), then the earlier.
        key = (count, len(pattern.pattern))
        if count * 2 >= len(lines) and count and (best is None or key > best[:2]):
            best = (count, len(pattern.pattern), name, tag, pattern)
    if best is None:
        return None
    _, _, name, tag, pattern = best
    return LinePrefix(name=name, tag=tag, pattern=pattern)


class PrefixStripper:
    """``LinePrefix.strip`` over a stream of chunks cut anywhere: the partial last line waits for the next.
    ``labels``: the streams seen (srun tasks, hosts, ...)."""

    def __init__(self, prefix: LinePrefix) -> None:
        self.prefix = prefix
        self._tags = prefix.tag_cache()
        self._partial = b""

    @property
    def labels(self) -> list[bytes]:
        return [label for label in self._tags if label is not None]

    def feed(self, chunk: bytes, final: bool = False) -> bytes:
        text = self._partial + chunk
        cut = len(text) if final else text.rfind(b"\n") + 1
        self._partial = text[cut:]
        return self.prefix.strip(b"\n" + text[:cut], self._tags)[1:] if cut else b""


# The tags ``strip`` writes, as ``torch_log`` and ``rank_prefix`` read them back.
TAG_RE = re.compile(r"^\[(?P<tag>task|mpirank|host |ray )(?P<label>[^\]\n]*)\]: ")
