"""The kernel log's Xid lines, in every form the kernel log is read in."""

from __future__ import annotations

import pytest

from ncclwatch.watchdog.events import gpu_bus_key
from ncclwatch.watchdog.parsing.kernel_log import KernelLogParser, looks_like_kernel_log, parse_kernel_log

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2345, name=python, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "time", "host"),
    [
        (f"[ 1234.567890] {XID79}", "1234.567890", None),  # dmesg
        (f"[Thu Nov 26 03:12:45 2026] {XID79}", "Thu Nov 26 03:12:45 2026", None),  # dmesg -T
        (f"6,1234,5678901,-;{XID79}", "5.678901", None),  # /dev/kmsg
        (f"Nov 26 03:12:45 node1 kernel: {XID79}", "Nov 26 03:12:45", "node1"),  # journalctl -k, syslog
        (f"2026-11-26T03:12:45+0000 node1 kernel: {XID79}", "2026-11-26T03:12:45+0000", "node1"),  # short-iso
        (f"Jan 18 11:38:05 node1 kernel: [ 269.517039] {XID79}", "Jan 18 11:38:05", "node1"),  # syslog of dmesg
    ],
)
def test_xid_79_in_each_form(line: str, time: str, host: str | None) -> None:
    (xid,) = parse_kernel_log(line.encode() + b"\n", "kern.log")
    assert (xid.code, xid.bus_id, xid.pid, xid.process) == (79, "0000:3b:00", 2345, "python")
    assert (xid.time, xid.host, xid.hardware) == (time, host, True)
    assert xid.meaning == "the GPU fell off the bus" and xid.message == "GPU has fallen off the bus"
    assert xid.cite.line == 1 and xid.cite.text == line


@pytest.mark.parametrize(
    ("line", "code", "pid", "hardware"),
    [
        (
            "NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
            "(DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
            48,
            None,
            True,
        ),
        ("NVRM: Xid (PCI:0000:86:00): 74, pid=3, NVLink: fatal error detected on link 5(0x0, 0x0)", 74, 3, True),
        (
            "NVRM: Xid (PCI:0000:3b:00): 94, pid=777, name=python, Contained: SM (0x1). RST: No, D-RST: No",
            94,
            777,
            True,
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 95, pid=777, name=python, Uncontained: LTC TAG (0x2,0x0). RST: Yes",
            95,
            777,
            True,
        ),
        ("NVRM: Xid (PCI:0000:3b:00): 119, pid=1, name=nvidia-smi, Timeout after 6s of waiting for RPC", 119, 1, True),
        (
            "NVRM: Xid (PCI:0000:06:00): 13, pid=1, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1)",
            13,
            1,
            False,
        ),
        ("NVRM: Xid (PCI:0000:06:00): 41, ROBUST_CHANNEL_CE2_ERROR: Copy Engine Exception", 41, None, False),
        ("NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc Data ffffffff", 3, None, False),  # old drivers
    ],
)
def test_other_xids_and_whether_they_blame_the_hardware(line: str, code: int, pid: int | None, hardware: bool) -> None:
    (xid,) = parse_kernel_log(f"[  12.5] {line}\n".encode(), "k")
    assert (xid.code, xid.pid, xid.hardware) == (code, pid, hardware)


def test_streamed_in_pieces_line_numbers_of_the_whole_file_and_one_event_per_repeat() -> None:
    lines = [f"[ {i}.000001] usb 1-1: new device" for i in range(50)]
    lines[20] = f"[ 20.000001] {XID79}"
    lines[21] = f"[ 20.000002] {XID79}"  # the driver repeats it
    lines[40] = "[ 40.000001] NVRM: Xid (PCI:0000:5e:00): 48, pid=2346, name=python, An uncorrectable double bit error"
    text = ("\n".join(lines) + "\n").encode()
    for size in (5, 64, len(text)):
        parser = KernelLogParser("k")
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])]
        events += parser.feed(b"", final=True)
        assert [(e.code, e.cite.line) for e in events] == [(79, 21), (48, 41)]
        assert parser.lines_seen == 50


def test_sniffed_by_content() -> None:
    assert looks_like_kernel_log(f"{XID79}\n".encode())
    assert looks_like_kernel_log(b"[    0.000000] Linux version 6.8\n[    0.1] a\n[    0.2] b\n")
    assert not looks_like_kernel_log(b"node1:700:700 [0] NCCL INFO Bootstrap\n" * 10)


def test_one_spelling_of_a_gpu_address() -> None:
    assert gpu_bus_key("0000:3b:00") == gpu_bus_key("00000000:3B:00.0") == gpu_bus_key("3b000") == "0000:3b:00"
