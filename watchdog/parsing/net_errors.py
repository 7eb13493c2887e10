"""Network and peer failures in NCCL's and PyTorch's text -> ``NetworkError``.

The lines come from NCCL WARNs (in an NCCL debug file or on stderr) and from
NCCL's error string that PyTorch repeats inside its exceptions (``NCCL
error: remote process exited or there was a network error, NCCL version
2.20.5 ... Last error: socketProgress: Connection closed by remote peer
node-3<47514>``).  Format strings, from NCCL's sources:

- ``NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err %d`` (up to 2.18)
- ``NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err %d (%s)...`` (2.19-2.22)
- ``NET/IB: Got completion from peer %s with status=%s(%d) opcode=%s(%d) ... hca %s`` (2.23+)
- ``Net : Connection closed by remote peer %s`` / ``socketProgress: Connection closed by remote peer %s``
- ``Call to recv from %s failed : Connection reset by peer``, ``socketProgressOpt: Call to recv ... failed``
- two ranks' operations that differ, caught by the transport (``TransportMismatch``):
  ``NET/Socket : [peer %s ]message truncated : receiving %d bytes instead of %d`` (2.4+, the peer from 2.10) and
  ``NET/IB : [req %d/%d tag %x peer %s ]collective mismatch error[,] local size %d remote[ size] %d`` (2.5-2.19)

Failure mode: a status number NCCL does not name (a newer verbs enum) is
kept as a number with no meaning rather than guessed.
"""

from __future__ import annotations

import re

from ncclwatch.watchdog.events import Citation, NetworkError, ProcKey, TransportMismatch

# Lines holding any of these are looked at (a bytes.find per marker per chunk).
MARKERS = (
    b"Got completion from peer",
    b"Connection closed by remote peer",
    b"Connection reset by peer",
    b"remote process exited or there was a network error",
    b"ncclRemoteError",
    b"ncclSystemError",
    b"socketProgress",
    b"message truncated : receiving",
    b"collective mismatch error",
)

# ibv_wc_status (libibverbs verbs.h); what each means for a training job.
IBV_WC_STATUS = {
    1: ("IBV_WC_LOC_LEN_ERR", "local length error (a message larger than the receive buffer)"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local queue-pair operation error"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error (memory registration)"),
    5: (
        "IBV_WC_WR_FLUSH_ERR",
        "work request flushed: the queue pair was already in error (a consequence, look for the first error)",
    ),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response from the peer"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error"),
    9: ("IBV_WC_REM_INV_REQ_ERR", "the peer saw an invalid request"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error (the peer's memory registration)"),
    11: ("IBV_WC_REM_OP_ERR", "the peer could not complete the operation"),
    12: (
        "IBV_WC_RETRY_EXC_ERR",
        "transport retry counter exceeded: the peer stopped answering (link down, peer dead, or a congested fabric)",
    ),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retries exceeded: the peer posted no receive in time"),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("IBV_WC_REM_ABORT_ERR", "the peer aborted the operation"),
    19: ("IBV_WC_FATAL_ERR", "fatal error of the adapter"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
    21: ("IBV_WC_GENERAL_ERR", "general error"),
}

_IB_RE = re.compile(
    r"Got completion from peer (?P<peer>\S+?) with "
    r"(?:error (?P<err>\d+)|status=(?:(?P<name>[A-Z_]+)\((?P<code>\d+)\)|(?P<num>\d+)))"
    r"(?:.*? hca (?P<hca>\S+))?"
)
_CLOSED_RE = re.compile(r"Connection closed by remote peer (?P<peer>\S+)")
_RESET_RE = re.compile(r"(?:recv|send) (?:from|to) (?P<peer>\S+) failed ?: Connection reset by peer")
_TRUNCATED_RE = re.compile(
    r"NET/Socket : (?:peer (?P<peer>\S+) )?message truncated : receiving (?P<sent>\d+) bytes instead of (?P<posted>\d+)"
)
_IB_MISMATCH_RE = re.compile(
    r"NET/IB : (?:req \d+/\d+ tag \S+ peer (?P<peer>\S+) )?collective mismatch error,? "
    r"local size (?P<sent>\d+) remote(?: size)? (?P<posted>\d+)"
)
_NCCL_RANK_RE = re.compile(r"\[Rank (\d+)\]|\bRank (\d+)\]|\brank (\d+)\b")
_PROC_RE = re.compile(r"(?:^|\s|\]:?)([^:\s\[\]]+):(\d+):\d+ \[\d+\] ")


def parse_transport_mismatch(text: str) -> TransportMismatch | None:
    """NCCL's transport WARN about two ranks' operations differing, with its sizes; None for any other text."""
    if m := _TRUNCATED_RE.search(text):  # printed by the receiver: the peer sends more than was posted here
        transport, sends = "socket", False
    elif m := _IB_MISMATCH_RE.search(text):  # printed by the sender: it sends more than the peer posted
        transport, sends = "ib", True
    else:
        return None
    return TransportMismatch(
        transport=transport,
        peer=m["peer"],
        sent_bytes=int(m["sent"]),
        posted_bytes=int(m["posted"]),
        reporter_sends=sends,
    )


def parse_network_line(line: str, name: str, line_no: int, rank: int | None) -> NetworkError | None:
    """One line -> a ``NetworkError``, or None when the marker was incidental."""
    proc_m = _PROC_RE.search(line)
    proc = ProcKey(proc_m[1], int(proc_m[2])) if proc_m else None
    if rank is None:
        rank_m = _NCCL_RANK_RE.search(line)
        rank = next((int(g) for g in rank_m.groups() if g), None) if rank_m else None
    cite = Citation(file=name, line=line_no, text=line.strip()[:400])
    if (mismatch := parse_transport_mismatch(line)) is not None:
        return NetworkError(
            kind="size_mismatch", rank=rank, proc=proc, peer=mismatch.peer, mismatch=mismatch, cite=cite
        )
    if m := _IB_RE.search(line):
        code_text = m["err"] or m["code"] or m["num"]
        code = int(code_text) if code_text else None
        known = IBV_WC_STATUS.get(code) if code is not None else None
        return NetworkError(
            kind="ib_completion",
            rank=rank,
            proc=proc,
            peer=m["peer"].rstrip(","),
            device=m["hca"],
            status=code,
            status_name=m["name"] or (known[0] if known else None),
            meaning=known[1] if known else None,
            cite=cite,
        )
    if m := _CLOSED_RE.search(line) or _RESET_RE.search(line):
        return NetworkError(kind="connection_closed", rank=rank, proc=proc, peer=m["peer"].rstrip(".,"), cite=cite)
    if "remote process exited or there was a network error" in line or "ncclRemoteError" in line:
        return NetworkError(kind="remote_error", rank=rank, proc=proc, cite=cite)
    if "ncclSystemError" in line:
        return NetworkError(kind="system_error", rank=rank, proc=proc, cite=cite)
    if "socketProgress" in line and ("fail" in line or "error" in line.lower()):
        return NetworkError(kind="socket", rank=rank, proc=proc, cite=cite)
    return None
