"""The kernel log's GPU driver lines (``NVRM: Xid``) -> ``XidError`` events.

The driver reports a GPU fault as an Xid: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has
fallen off the bus.`` (``pid=`` and ``name=`` in newer drivers, ``pid='<unknown>'`` where no process is to
blame, no ``PCI:`` in old ones).  The line reaches on-call in every form the kernel log is read in, each
handled here per line: ``/dev/kmsg`` records (``6,1234,5678901,-;NVRM: ...``: priority, sequence, microseconds
since boot), ``dmesg`` (``[ 1234.567890] NVRM: ...``), ``dmesg -T`` (``[Thu Nov 26 03:12:45 2026] ...``),
syslog and ``journalctl -k`` (``Nov 26 03:12:45 node1 kernel: ...``, short-iso ``2026-11-26T03:12:45+0000
node1 kernel: ...``), and the same lines inside another file (a job's combined log, a bundle's journal text).

Only lines holding ``NVRM: Xid`` are parsed (found with ``bytes.find``): a kernel log is mostly other lines.

What an Xid means, and whether it points at the hardware (the GPU, its memory, its links) rather than the
program, is NVIDIA's Xid catalogue: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
(the table and its "resolution bucket": RESET_GPU, RESTART_BM and CONTACT_SUPPORT mark hardware;
RESTART_APP and IGNORE the program or nothing).  Codes not in ``XID_TABLE`` are reported as they are, never
as hardware.

Failure modes: a line cut short or of an unknown shape is skipped, never raised; a repeated Xid (the driver
logs some once per channel) is one event per (code, bus, pid) per file.
"""

from __future__ import annotations

import re

from ncclwatch.watchdog.events import Citation, XidError

MARKER = b"NVRM: Xid"

# code -> (what it means, whether it points at the GPU or its links rather than the program).
XID_TABLE: dict[int, tuple[str, bool]] = {
    8: ("the GPU stopped processing (idle timeout)", False),
    13: ("a graphics engine exception (the program: an illegal instruction or address, most often)", False),
    31: ("a GPU memory page fault (the program's illegal address, most often)", False),
    32: ("an invalid or corrupted push buffer stream (PCIe or the program)", False),
    38: ("the driver firmware failed", True),
    43: ("the GPU stopped processing (a program fault reset its channel)", False),
    45: ("preemptive cleanup: a process on the GPU was ended after an earlier error", False),
    48: ("a double-bit ECC error (uncorrectable GPU memory error)", True),
    56: ("a display engine error", False),
    57: ("an error programming video memory interface", True),
    61: ("an internal micro-controller breakpoint (firmware)", True),
    62: ("an internal micro-controller halt (firmware)", True),
    63: ("an ECC page retirement or row remapping event (GPU memory)", True),
    64: ("an ECC page retirement or row remapper recording failure (GPU memory)", True),
    68: ("a video processor exception", False),
    69: ("a graphics engine class error", False),
    74: ("an NVLink error", True),
    79: ("the GPU fell off the bus", True),
    92: ("a high single-bit ECC error rate (GPU memory)", True),
    94: ("a contained ECC error (GPU memory: the processes using it must restart)", True),
    95: ("an uncontained ECC error (GPU memory: the GPU must be reset)", True),
    109: ("a context switch timeout", False),
    110: ("a security fault error (hardware)", True),
    119: ("a GSP RPC timeout (the GPU's system processor stopped answering)", True),
    120: ("a GSP error (the GPU's system processor)", True),
    121: ("a C2C (chip-to-chip) link error", True),
    122: ("an SPI PMU RPC read failure", True),
    123: ("an SPI PMU RPC write failure", True),
    136: ("a GPU link training failure", True),
    137: ("an NVLink FLA privilege error", True),
    140: ("an unrecovered ECC error (GPU memory)", True),
    143: ("a GPU initialization failure", True),
    144: ("an NVLink error (SAW)", True),
    145: ("an NVLink error (RLW)", True),
    146: ("an NVLink error (TLW)", True),
    147: ("an NVLink error (TREX)", True),
    148: ("an NVLink error (NVLPW control)", True),
    149: ("an NVLink error (NETIR)", True),
    150: ("an NVLink error (MSE)", True),
    154: ("the GPU's recovery action changed (a reset or reboot is needed)", True),
    155: ("an NVLink link down or training failure", True),
}

_XID_RE = re.compile(
    # A pasted line's bus id is often elided ("(PCI:...)", "(PCI:…)"): kept as written, it places no GPU.
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}|\.{3}|…)(?:\.[0-9a-fA-F])?\): "
    r"(?P<code>\d+),\s*(?:pid=(?P<pid>\d+|'?<unknown>'?),\s*)?(?:name=(?P<name>[^,]*),\s*)?(?P<msg>.*)"
)
# Where the line came from, in front of "NVRM:": each gives the time as printed, some the host.
_KMSG_RE = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;]*;")
_DMESG_RE = re.compile(r"\[\s*(?P<uptime>\d+\.\d+)\]\s*$")
_DMESG_T_RE = re.compile(
    r"\[(?P<date>(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s*$"
)
_SYSLOG_RE = re.compile(
    r"^(?P<date>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*) (?P<host>[\w.-]+) kernel: "
)


def parse_xid_line(text: str, file: str, line_no: int | None) -> XidError | None:
    """The ``XidError`` of one kernel log line, or None where it holds none."""
    m = _XID_RE.search(text)
    if m is None:
        return None
    before = text[: m.start()]
    when: str | None = None
    host: str | None = None
    if (k := _KMSG_RE.match(before)) is not None:
        when = f"{int(k['usec']) / 1e6:.6f}"
    elif (s := _SYSLOG_RE.match(before)) is not None:
        when, host = s["date"], s["host"]
    if (d := _DMESG_RE.search(before)) is not None:
        when = when or d["uptime"]
    elif (t := _DMESG_T_RE.search(before)) is not None:
        when = t["date"]
    code = int(m["code"])
    pid = m["pid"]
    meaning, hardware = XID_TABLE.get(code, (None, False))
    name = (m["name"] or "").strip()
    return XidError(
        code=code,
        bus_id=m["bus"].lower(),
        pid=int(pid) if pid and pid.isdigit() else None,
        process=name if name and "unknown" not in name else None,
        message=m["msg"].strip().rstrip("."),
        time=when,
        host=host,
        meaning=meaning,
        hardware=hardware,
        cite=Citation(file=file, line=line_no, text=text.strip()[:400]),
    )


class KernelLogParser:
    """Xid lines of one text input, streamed (``feed`` chunks cut anywhere; line numbers of the whole input)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lines_seen = 0
        self.lines_used = 0
        self._carry = b""
        self._seen: set[tuple[int, str, int | None]] = set()

    def feed(self, data: bytes, final: bool = False) -> list[XidError]:
        body = self._carry + data
        stop = len(body) if final else body.rfind(b"\n") + 1
        self._carry = body[stop:]
        events: list[XidError] = []
        line_no, counted = self.lines_seen, 0
        pos = body.find(MARKER, 0, stop)
        while pos != -1:
            start = body.rfind(b"\n", 0, pos) + 1
            end = body.find(b"\n", pos, stop)
            end = stop if end == -1 else end
            line_no += body.count(b"\n", counted, start)
            counted = start
            event = parse_xid_line(body[start:end].decode(errors="replace"), self.name, line_no + 1)
            if event is not None and (event.code, event.bus_id, event.pid) not in self._seen:
                self._seen.add((event.code, event.bus_id, event.pid))
                self.lines_used += 1
                events.append(event)
            pos = body.find(MARKER, end, stop)
        self.lines_seen += body.count(b"\n", 0, stop) + (1 if final and stop and not body.endswith(b"\n") else 0)
        return events


# A kernel log's own lines, for the sniffer: dmesg's uptime, /dev/kmsg's record head, syslog's "kernel:".
_KERNEL_LINE_RE = re.compile(rb"(?m)^(?:\[\s*\d+\.\d+\] |\d+,\d+,\d+,[^;\n]*;|.{15,40} kernel: )")


def looks_like_kernel_log(head: bytes) -> bool:
    """True when the first bytes hold an Xid, or are a kernel log whose Xids may come later."""
    return MARKER in head or len(_KERNEL_LINE_RE.findall(head[:65536])) >= 3


def parse_kernel_log(data: bytes, name: str) -> list[XidError]:
    """A whole text at once (tests, small files); ``KernelLogParser`` streams."""
    return KernelLogParser(name).feed(data, final=True)
