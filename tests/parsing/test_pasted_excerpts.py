"""Excerpts as users paste them into threads (issue 44): NCCL's lines without their ``host:pid:tid``, an Xid with its
PCI id elided.  Made from the real 2 x H200 NCCL logs (/work/shared/fixtures) the way a user cuts them."""

from __future__ import annotations

import re
from pathlib import Path

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.kernel_log import parse_kernel_log
from ncclwatch.watchdog.parsing.nccl_excerpt import BareLines

MISMATCH = Path("/work/shared/fixtures/nccl-2.28.9-2gpu/mismatch/nccl")
PROCESS = re.compile(r"(?m)^[^ :\n]+:\d+:\d+ (?=\[\d+\] NCCL )")


def pasted(log: Path, into: Path) -> Path:
    """The log as pasted: every ``host:pid:tid`` cut, ``[cudaDev] NCCL INFO ...`` left."""
    out = into / log.name
    out.write_text(PROCESS.sub("", log.read_text()))
    return out


def test_bare_nccl_lines_give_the_verdict_of_the_whole_logs(tmp_path: Path) -> None:
    logs = sorted(MISMATCH.glob("*.log"))
    whole = analyze_paths([str(p) for p in logs])
    cut = analyze_paths([str(pasted(p, tmp_path)) for p in logs])
    assert (
        (cut.verdict, cut.culprit_ranks) == (whole.verdict, whole.culprit_ranks) == (Verdict.collective_mismatch, [1])
    )
    assert {row.host for row in cut.ranks} == {"pasted-nccl.vm.714.log", "pasted-nccl.vm.715.log"}


def test_one_pasted_file_of_both_ranks_keeps_them_apart_by_gpu(tmp_path: Path) -> None:
    a, b = (pasted(p, tmp_path).read_text().splitlines() for p in sorted(MISMATCH.glob("*.log")))
    (tmp_path / "thread.txt").write_text("\n".join(a + b) + "\n")
    report = analyze_paths([str(tmp_path / "thread.txt")])
    assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [1]), report.summary


def test_the_line_count_never_changes_wherever_the_chunks_are_cut() -> None:
    text = PROCESS.sub("", (MISMATCH / "nccl.vm.714.log").read_text()).encode()
    whole = BareLines("x.log").feed(text, final=True)
    reader = BareLines("x.log")
    cut = b"".join(reader.feed(text[i : i + 333]) for i in range(0, len(text), 333)) + reader.feed(b"", final=True)
    assert cut == whole and whole.count(b"\n") == text.count(b"\n")
    assert whole.splitlines()[0] == b"pasted-x.log:0:0 [0] NCCL INFO ENV/Plugin: Could not find: libnccl-env.so"


def test_an_xid_with_its_pci_id_elided_is_still_read() -> None:
    line = b"Nov 26 03:12:45 node3 kernel: NVRM: Xid (PCI:...): 79, pid=867, name=python, GPU has fallen off the bus.\n"
    (xid,) = parse_kernel_log(line, "thread.txt")
    assert (xid.code, xid.pid, xid.host, xid.hardware, xid.bus_id) == (79, 867, "node3", True, "...")
