"""A verdict's cited operations -> ``file:line`` and the line's text, for the report and the bundle.

The state keeps no line numbers (they would cost memory per operation), so
each cited NCCL log is read again, only as far as its last cited operation:
``ncclwatch analyze`` does it for the files it was given, the live bundle
for the files its sidecar tailed.

The line's text is redacted by value (``redact.redact_text``), as the log
tails in the bundle are.

Failure modes: a file that cannot be read any more, or whose start was
freed behind the reader (a punched hole: its line numbers are unknown),
leaves its citations unresolved (the report shows them as the engine made them); nothing here
raises.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import compress, count

from ncclwatch.watchdog.events import P2P_OPS, OpSig, ProcKey
from ncclwatch.watchdog.evidence.redact import redact_text
from ncclwatch.watchdog.hang.types import Finding, OpRef
from ncclwatch.watchdog.parsing.line_prefix import LinePrefix, detect
from ncclwatch.watchdog.parsing.nccl_log import iter_op_lines, op_records, op_table
from ncclwatch.watchdog.sources.holes import retained_start

CHUNK_BYTES = 8 << 20  # a cited 1 GB log is never read whole


def resolve_citations(finding: Finding) -> dict[int, tuple[str, str | None]]:
    """Turn each evidence ``OpRef`` into "file:line" by rescanning only the cited files."""
    wanted: dict[str, list[tuple[int, OpRef]]] = {}
    for index, item in enumerate(finding.evidence):
        if item.op_ref is not None:
            wanted.setdefault(item.op_ref.file, []).append((index, item.op_ref))
    resolved: dict[int, tuple[str, str | None]] = {}
    for file, refs in wanted.items():
        targets = {(r.proc, r.comm_ptr, r.kind, r.peer, r.ordinal): i for i, r in refs}
        for index, line, text in _cited(file, targets):
            resolved[index] = (f"{file}:{line}", redact_text(text) if text else text)
    return resolved


def _cited(file: str, targets: dict[tuple, int]) -> Iterator[tuple[int, int, str]]:
    """(evidence index, line, text) of each target found in ``file``; reads no further than the last one.

    A target is the ``ordinal``-th operation of its (process, communicator, kind, peer) in the file.  A chunk
    is read column-wise where ``op_records`` vouches for it: operations counted per key with ``Counter`` (in
    C), a target's line looked for only in the chunk that holds it; else line by line (``iter_op_lines``).
    """
    counters: dict[tuple, int] = {}
    table = op_table()
    wanted_keys = {target[:4] for target in targets}
    for data, lines in _chunks(file):
        records = op_records(data, table)
        if records is None:
            for line, text, proc, comm_ptr, sig in iter_op_lines(data):
                key = _key(proc, comm_ptr, sig)
                ordinal = counters.get(key, 0)
                counters[key] = ordinal + 1
                index = targets.pop((*key, ordinal), None)
                if index is not None:
                    yield index, lines + line, text
                    if not targets:
                        return
            continue
        by_key: dict[tuple, list[int]] = {}
        per_id = Counter(records.ids)
        for op_id in per_id:
            proc, comm_ptr, sig = records.key(op_id)
            by_key.setdefault(_key(proc, comm_ptr, sig), []).append(op_id)
        for key, op_ids in by_key.items():
            base = counters.get(key, 0)
            counters[key] = base + sum(per_id[i] for i in op_ids)
            if key not in wanted_keys:
                continue
            for ordinal in range(base, counters[key]):
                index = targets.pop((*key, ordinal), None)
                if index is None:
                    continue
                members = set(op_ids)
                record = list(compress(count(), map(members.__contains__, records.ids)))[ordinal - base]
                line, text = records.line(record)
                yield index, lines + line, text
        if not targets:
            return


def _key(proc: ProcKey, comm_ptr: str, sig: OpSig) -> tuple:
    kind = sig.op if sig.op in P2P_OPS else "coll"
    return proc, comm_ptr, kind, sig.root if kind != "coll" else None


def _chunks(file: str) -> Iterator[tuple[bytes, int]]:
    """A file's whole lines, chunk by chunk, with the lines before each; a launcher's prefix on every line
    (``line_prefix``, as ``inputs.TextIngest`` read it) rewritten, the line numbers unchanged."""
    try:
        with open(file, "rb") as handle:
            if retained_start(handle.fileno()):
                return  # freed behind the sidecar's reader (``sources/run_space.py``): its line numbers are unknown
            carry, lines = b"", 0
            prefix: LinePrefix | None = None
            while chunk := handle.read(CHUNK_BYTES):
                if not lines and not carry:
                    prefix = detect(chunk)
                body = carry + chunk
                cut = body.rfind(b"\n") + 1
                yield (prefix.strip(b"\n" + body[:cut])[1:] if prefix else body[:cut]), lines
                lines += body.count(b"\n", 0, cut)
                carry = body[cut:]
            yield (prefix.strip(b"\n" + carry)[1:] if prefix else carry), lines
    except OSError:
        return
