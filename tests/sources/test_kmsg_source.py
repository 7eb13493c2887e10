"""The live kernel log source over a file in /dev/kmsg's record format."""

from __future__ import annotations

import os
from pathlib import Path

from ncclwatch.watchdog.events import Event, SourceDown, XidError
from ncclwatch.watchdog.sources.kmsg import KmsgSource

# /dev/kmsg records: "<priority>,<sequence>,<usec since boot>,<flags>;<text>", continuation lines start with " ".
OLD = "4,1201,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=10, name=python, GPU has fallen off the bus.\n"
NEW = (
    "6,1233,1234567890,-;nvidia 0000:3b:00.0: irq 52 for MSI/MSI-X\n"
    "4,1234,1234567912,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2345, name=python, GPU has fallen off the bus.\n"
    " SUBSYSTEM=pci\n"
    " DEVICE=+pci:0000:3b:00.0\n"
    "4,1235,1234567950,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2345, name=python, GPU has fallen off the bus.\n"
    "4,1236,1234568000,-;NVRM: Xid (PCI:0000:5e:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double"
)


def test_reads_from_the_end_each_xid_once_with_this_nodes_name(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(OLD)  # before the sidecar started: a past fault, not this job's
    source = KmsgSource(str(kmsg), host="node7")
    events: list[Event] = []
    source.poll(events.append)
    assert events == []
    with kmsg.open("a") as out:
        out.write(NEW)  # the last record not yet ended by its "\n"
    source.poll(events.append)
    assert [(e.code, e.bus_id, e.pid, e.host, e.time) for e in events if isinstance(e, XidError)] == [
        (79, "0000:3b:00", 2345, "node7", "1234.567912")
    ]
    with kmsg.open("a") as out:
        out.write("\n")
    source.poll(events.append)
    assert [e.code for e in events if isinstance(e, XidError)] == [79, 48]


def test_without_permission_or_device_it_says_so_once_and_stops(tmp_path: Path) -> None:
    events: list[Event] = []
    source = KmsgSource(str(tmp_path / "absent"))
    source.poll(events.append)
    source.poll(events.append)
    assert [(type(e), e.source) for e in events] == [(SourceDown, "kmsg")]  # type: ignore[union-attr]
    assert "Xid lines are not seen live" in events[0].reason  # type: ignore[union-attr]
    unreadable = tmp_path / "kmsg"
    unreadable.write_text(NEW)
    os.chmod(unreadable, 0)
    events.clear()
    KmsgSource(str(unreadable)).poll(events.append)  # as root the file opens: it is then read from its end
    assert events == [] if os.geteuid() == 0 else [type(e) for e in events] == [SourceDown]
