"""A verdict's cited operations -> ``file:line`` and the line's text, for the report and the bundle.

The state keeps no line numbers (they would cost memory per operation), so
each cited NCCL log is read again, only as far as its last cited operation:
``ncclwatch analyze`` does it for the files it was given, the live bundle
for the files its sidecar tailed.

The line's text is redacted by value (``redact.redact_text``), as the log
tails in the bundle are.

Failure modes: a file that cannot be read any more leaves its citations
unresolved (the report shows them as the engine made them); nothing here
raises.
"""

from __future__ import annotations

from collections.abc import Iterator

from ncclwatch.watchdog.events import P2P_OPS, OpSig, ProcKey
from ncclwatch.watchdog.evidence.redact import redact_text
from ncclwatch.watchdog.hang.types import Finding, OpRef
from ncclwatch.watchdog.parsing.nccl_log import iter_op_lines

CHUNK_BYTES = 8 << 20  # a cited 1 GB log is never read whole


def resolve_citations(finding: Finding) -> dict[int, tuple[str, str | None]]:
    """Turn each evidence ``OpRef`` into "file:line" by rescanning only the cited files."""
    wanted: dict[str, list[tuple[int, OpRef]]] = {}
    for index, item in enumerate(finding.evidence):
        if item.op_ref is not None:
            wanted.setdefault(item.op_ref.file, []).append((index, item.op_ref))
    resolved: dict[int, tuple[str, str | None]] = {}
    for file, refs in wanted.items():
        counters: dict[tuple, int] = {}
        targets = {(r.proc, r.comm_ptr, r.kind, r.peer, r.ordinal): i for i, r in refs}
        for line, text, proc, comm_ptr, sig in _op_lines(file):
            kind = sig.op if sig.op in P2P_OPS else "coll"
            peer = sig.root if kind != "coll" else None
            key = (proc, comm_ptr, kind, peer)
            ordinal = counters.get(key, 0)
            counters[key] = ordinal + 1
            index = targets.pop((*key, ordinal), None)
            if index is not None:
                resolved[index] = (f"{file}:{line}", redact_text(text) if text else text)
                if not targets:
                    break
    return resolved


def _op_lines(file: str) -> Iterator[tuple[int, str, ProcKey, str, OpSig]]:
    """Operation lines of a file, chunk by chunk."""
    try:
        with open(file, "rb") as handle:
            carry, lines = b"", 0
            while chunk := handle.read(CHUNK_BYTES):
                body = carry + chunk
                cut = body.rfind(b"\n") + 1
                for line, text, proc, comm_ptr, sig in iter_op_lines(body[:cut]):
                    yield lines + line, text, proc, comm_ptr, sig
                lines += body.count(b"\n", 0, cut)
                carry = body[cut:]
            for line, text, proc, comm_ptr, sig in iter_op_lines(carry):
                yield lines + line, text, proc, comm_ptr, sig
    except OSError:
        return
