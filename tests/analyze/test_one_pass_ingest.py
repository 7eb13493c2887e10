"""``ncclwatch analyze`` reads each input once: the same report as the two passes and the exact parser gave.

The transports NCCL chose used to come from a second pass over every NCCL log (``TransportScanner`` fed each
whole file again); ``inputs.TextIngest`` now keeps the transport lines of the one pass.  The NCCL parser's fast
paths hand the text less its operation records to the other readers.  Each test compares with the old way.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from conftest import DATA, FIXTURES

from ncclwatch.watchdog import inputs
from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.evidence import citations
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.inputs import ingest_file, iter_files, open_input
from ncclwatch.watchdog.parsing import EXCLUSIVE, nccl_log
from ncclwatch.watchdog.parsing.ras import looks_like_ras
from ncclwatch.watchdog.parsing.transport import MARKERS, TransportScanner

TRANSPORT = DATA / "transport"


def two_passes(paths: list[str]) -> list:
    """The transports as the second pass read them: every input found to be an NCCL log, whole, in order,
    lines found by the old regex alternation."""
    marker_re = re.compile(b"|".join(map(re.escape, MARKERS)))
    state, scanner = JobState(), TransportScanner()
    entries = [ingest_file(state, name, {}) for name, problem in iter_files(paths) if problem is None]
    for entry in entries:
        if "nccl_log" not in entry.kinds:
            continue
        with open_input(entry.path, {}) as (handle, _):
            body = handle.read()
        line_end = -1
        for match in marker_re.finditer(body):
            if match.start() < line_end:
                continue
            start = body.rfind(b"\n", 0, match.start()) + 1
            line_end = body.find(b"\n", match.end())
            line_end = len(body) if line_end < 0 else line_end
            scanner._line(body[start:line_end].decode("utf-8", "replace"))
    return scanner.facts()


def one_pass(paths: list[str]) -> list:
    state, scanner = JobState(), TransportScanner()
    for name, problem in iter_files(paths):
        if problem is None:
            ingest_file(state, name, {}, scanner)
    return scanner.facts()


def report(paths: list[str]) -> dict:
    out = json.loads(analyze_paths(paths, now=1e9).model_dump_json())
    out.pop("analyzed_at", None)
    return out


def rank_log(rank: int, lines: int, transport_every: int = 0, output_every: int = 0, stop_at: int = 0) -> str:
    """A 2.28.9 debug file of rank ``rank`` of 2: init and its transport lines, a DDP-like step, lazily made p2p
    connections and training output between the operations, destroy (or a stop at ``stop_at``: a hang)."""
    rng = random.Random(rank)
    pre = f"node{rank}:{700 + rank}:{700 + rank} [0] NCCL INFO "
    comm = f"0x{0x5000 + rank:x}"
    out = [
        pre + "NCCL version 2.28.9+cuda13.0",
        pre + "NCCL_IB_HCA set to mlx5_0",
        pre + "NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>",
        pre + "Using network IB",
        pre + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks 2 cudaDev 0 nvmlDev 0 busId 0 "
        "commId 0x678a9195a2e6ef0d - Init START",
        pre + f"comm {comm} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0",
        pre + "2 coll channels, 2 collnet channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer",
        pre + f"Channel 00/0 : {rank}[0] -> {1 - rank}[0] [send] via NET/IB/0/GDRDMA",
        pre + f"ncclCommInitRankConfig comm {comm} rank {rank} nranks 2 cudaDev 0 nvmlDev 0 busId 0 "
        "commId 0x678a9195a2e6ef0d - Init COMPLETE",
    ]
    step = (("AllReduce", 4195328, 0), ("AllReduce", 1024, 0), ("Send", 64, 1 - rank), ("Recv", 64, 1 - rank))
    for i in range(stop_at or lines):
        if transport_every and i % transport_every == transport_every - 1:
            out.append(pre + f"Channel {i % 32:02d}/1 : {rank}[0] -> {1 - rank}[0] [receive] via NET/IB/0")
        if output_every and i % output_every == output_every - 1:
            out.append(f"step {i} loss {rng.random():.3f}")
        name, count, root = step[i % len(step)]
        send = "(nil)" if name in ("Send", "Recv") else "0x7f2963e05000"
        out.append(
            pre + f"{name}: opCount {i:x} sendbuff {send} recvbuff 0x7f29{i:08x} count {count} datatype 7 op 0 "
            f"root {root} comm {comm} [nranks=2] stream 0x1f481490"
        )
    if not stop_at:
        out.append(pre + f"comm {comm} rank {rank} nranks 2 cudaDev 0 busId 0 - Destroy COMPLETE")
    return "\n".join(out) + "\n"


@pytest.fixture
def slow_path(monkeypatch: pytest.MonkeyPatch):
    """What the exact NCCL parser alone would give (no fast path, every reader on the whole text, citations
    found line by line)."""

    def reports(paths: list[str]) -> dict:
        with monkeypatch.context() as patch:
            patch.setattr(nccl_log.NcclLogParser, "_fast", lambda self, blocks: None)
            patch.setattr(citations, "op_records", lambda data, table=None: None)  # cited lines read one by one
            return report(paths)

    return reports


class TestTransportsInOnePass:
    def test_the_fixtures(self):
        paths = [str(TRANSPORT)]
        facts = one_pass(paths)
        assert facts == two_passes(paths)
        assert {f.network for f in facts} >= {"IB", "Socket"}

    def test_every_fixture_folder(self):
        for folder in sorted(p for p in FIXTURES.rglob("*") if p.is_dir() and p.name == "nccl"):
            assert one_pass([str(folder)]) == two_passes([str(folder)]), folder

    def test_a_large_log_with_lines_in_every_chunk(self, tmp_path: Path):
        for rank in (0, 1):
            (tmp_path / f"nccl.node{rank}.{700 + rank}.log").write_text(rank_log(rank, 120_000, 997, 1_003))
        (tmp_path / "stderr.txt").write_text("not NCCL\n" + "NET/IB : lines of no NCCL log are not read\n" * 50)
        facts = one_pass([str(tmp_path)])
        assert facts == two_passes([str(tmp_path)])
        assert sum(sum(f.connections.values()) for f in facts) > 200

    def test_past_the_lines_kept_the_input_is_read_again(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        (tmp_path / "nccl.node0.700.log").write_text(rank_log(0, 20_000, 7))
        monkeypatch.setattr(inputs, "TRANSPORT_LINES", 100)
        assert one_pass([str(tmp_path)]) == two_passes([str(tmp_path)])


class TestSameReport:
    def test_fixture_folders(self, slow_path):
        folders = [TRANSPORT, *sorted((FIXTURES / "nccl-2.28.9-2gpu").iterdir())]
        for folder in folders:
            if folder.is_dir():
                assert report([str(folder)]) == slow_path([str(folder)]), folder

    def test_a_hang_in_large_logs_cites_the_same_lines(self, tmp_path: Path, slow_path):
        (tmp_path / "nccl.node0.700.log").write_text(rank_log(0, 80_000, 991, 1_009))
        (tmp_path / "nccl.node1.701.log").write_text(rank_log(1, 80_000, 991, 1_009, stop_at=79_000))
        fast = report([str(tmp_path)])
        assert fast["verdict"] != "no_hang"
        assert any(":" in str(e.get("cite")) for e in fast["evidence"])
        assert fast == slow_path([str(tmp_path)])

    def test_a_combined_stderr_with_rank_prefixes(self, tmp_path: Path, slow_path):
        lines = [f"[rank{r}]:{line}" for r in (0, 1) for line in rank_log(r, 30_000, 0, 500).splitlines()]
        random.Random(1).shuffle(lines)
        (tmp_path / "combined.out").write_text("\n".join(lines) + "\n")
        assert report([str(tmp_path)]) == slow_path([str(tmp_path)])


def test_the_ras_sniff_reads_what_it_read():
    ras = next(f for f in EXCLUSIVE if f.name == "ras")
    heads = [p.read_bytes()[: 1 << 20] for root in (FIXTURES, DATA) for p in root.rglob("*") if p.is_file()]
    assert sum(map(looks_like_ras, heads)) > 3
    assert [ras.looks_like(h) for h in heads] == [looks_like_ras(h) for h in heads]
