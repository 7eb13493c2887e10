"""The NCCL parser's fast paths give the exact path's events, on real files and on generated ones.

``NcclLogParser._fast`` splits a chunk at its operation records and hands back None wherever it cannot vouch for
the result; ``_exact`` is the reader the fast paths must agree with.  Each log here is parsed twice, once with the
fast paths off, in several chunk sizes (the exact path's segments follow the chunks), and the events, the garbled
count and the lines read must be equal.
"""

from __future__ import annotations

import random

import pytest
from conftest import DATA, FIXTURES

from ncclwatch.watchdog.parsing import nccl_log
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser

CHUNKS = (1 << 16, 3_000_000, 8 << 20)


def parse(data: bytes, chunk: int, fast: bool) -> tuple[list, int, int, bool]:
    parser = NcclLogParser("f.log")
    if not fast:
        parser._fast = lambda blocks: None  # type: ignore[method-assign]
    events = []
    for start in range(0, len(data), chunk):
        events += parser.feed(data[start : start + chunk])
    events += parser.feed(b"", final=True)
    return events, parser.garbled, parser.lines_seen, parser.version_seen


def assert_same(data: bytes, chunks: tuple[int, ...] = CHUNKS) -> None:
    for chunk in chunks:
        assert parse(data, chunk, fast=True) == parse(data, chunk, fast=False), chunk


def fast_chunks(data: bytes, chunk: int = 8 << 20) -> int:
    """How many chunks the fast paths read."""
    parser, taken = NcclLogParser("f.log"), 0
    for start in range(0, len(data), chunk):
        parser.feed(data[start : start + chunk])
        taken += parser.residual is not None
    return taken


STEP = (("AllReduce", 4195328, 0), ("AllReduce", 16777216, 0), ("AllGather", 1024, 0), ("Send", 4096, 1))


def log(
    lines: int,
    seed: int = 0,
    host: str = "node1",
    pid: int = 700,
    comm: str = "0x18564c40",
    stamp: bool = False,
    tee: str = "",
    every: int = 0,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """An NCCL 2.28.9 debug file of one process: init, ``lines`` operations in a repeating step, destroy; every
    ``every``-th line one of ``extra`` (a line as it is, or "{pre}" for the process's prefix)."""
    rng = random.Random(seed)

    def pre(tid: int = pid) -> str:
        stamp_text = f"[2026-04-28 14:14:{rng.randint(10, 59)}] " if stamp else ""
        return f"{tee}{stamp_text}{host}:{pid}:{tid} [0] "

    out = [
        pre() + "NCCL INFO NCCL version 2.28.9+cuda13.0",
        pre() + f"NCCL INFO ncclCommInitRankConfig comm {comm} rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 0 "
        "commId 0x678a9195a2e6ef0d - Init START",
        pre() + f"NCCL INFO comm {comm} rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0",
        pre() + f"NCCL INFO ncclCommInitRankConfig comm {comm} rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 0 "
        "commId 0x678a9195a2e6ef0d - Init COMPLETE",
    ]
    for i in range(lines):
        if every and i % every == every - 1:
            out.append(rng.choice(extra).replace("{pre}", pre()))
            continue
        name, count, root = STEP[i % len(STEP)]
        send = "(nil)" if name == "Send" else "0x7f2963e05000"
        out.append(
            pre(pid + i % 2) + f"NCCL INFO {name}: opCount {i:x} sendbuff {send} recvbuff 0x7f29{i:08x} count {count} "
            f"datatype 7 op 0 root {root} comm {comm} [nranks=2] stream 0x1f481490"
        )
    out.append(pre() + f"NCCL INFO comm {comm} rank 0 nranks 2 cudaDev 0 busId 0 - Destroy COMPLETE")
    return out


def text(lines: list[str], end: str = "\n") -> bytes:
    return ("\n".join(lines) + end).encode()


RARE = (
    "{pre}NCCL INFO Channel 00/1 : 0[0] -> 1[1] via P2P/IPC",
    "{pre}misc/socket.cc:50 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1234> with status=12",
    "{pre}NCCL INFO New proxy send connection 98 from local rank 0, transport 0",
    "{pre}NCCL INFO Using network IB",
)
FOREIGN = (
    "step 12 loss 0.25 lr 3e-4",
    "",
    "[rank0]:[E1123 10:00:00] [Rank 0] Watchdog caught collective operation timeout",
)


class TestRealFiles:
    def test_every_nccl_log_of_the_fixtures(self):
        files = [p for root in (FIXTURES, DATA) for p in root.rglob("*") if p.is_file() and p.stat().st_size]
        logs = [p for p in files if b" NCCL INFO " in p.read_bytes()[: 1 << 20]]
        assert len(logs) > 50
        for path in logs:
            assert_same(path.read_bytes(), (1 << 12, 1 << 20))


class TestGenerated:
    def test_a_clean_file_is_read_fast_and_alike(self):
        data = text(log(60_000))
        assert_same(data)
        assert fast_chunks(data) == len(range(0, len(data), 8 << 20))

    def test_rare_and_watched_lines_between_operations(self):
        assert_same(text(log(60_000, every=97, extra=RARE)))

    def test_training_output_between_operations(self):
        data = text(log(60_000, every=53, extra=FOREIGN + RARE))
        assert_same(data)
        assert fast_chunks(data) > 0  # the general pattern's reading, from the fast path

    def test_timestamps_on_every_line(self):
        assert_same(text(log(30_000, stamp=True, every=101, extra=RARE)))

    def test_tee_prefix(self):
        assert_same(text(log(30_000, tee="[rank0]:", every=89, extra=RARE)))

    def test_several_processes_merged(self):
        a = log(12_000, pid=700, comm="0xa0", every=71, extra=RARE)
        b = log(12_000, host="node2", pid=900, comm="0xb0")
        merged = [line for pair in zip(a, b) for line in pair]
        assert_same(text(merged))
        assert_same(text(a[:8_000] + b + a[8_000:]))

    def test_crlf_and_no_final_newline(self):
        assert_same(text([line + "\r" for line in log(10_000)]))
        assert_same(text(log(20_000), end=""))

    @pytest.mark.parametrize("seed", range(6))
    def test_garbled_lines(self, seed):
        rng = random.Random(seed)
        lines = log(20_000, seed=seed, every=61, extra=RARE + FOREIGN)
        for _ in range(rng.randint(1, 12)):
            i = rng.randrange(5, len(lines) - 1)
            line = lines[i]
            lines[i] = rng.choice(
                (
                    line[: rng.randint(5, len(line))],  # cut short
                    line[:60] + lines[i + 1] + "\n" + line[60:],  # another thread's line inside
                    line.replace("sendbuff 0x7f", "sendbuff 0xZZ"),  # a field the fast pattern's set refuses
                    line.replace("stream", "st:ream"),  # a colon in the tail
                    line + " - Init START",  # a rare marker in an operation line
                    line.replace(" [", "\t[", 1),
                    "host: " + line,
                    line.replace("INFO ", "INFO localRank ", 1),
                    line.replace("comm 0x", "comm 0x1\t0x"),
                    line + " " + line,  # two records on one line
                )
            )
        assert_same(text(lines))

    def test_many_distinct_operations(self):
        rng = random.Random(3)
        lines = log(30_000)
        for i in range(5, len(lines) - 1):
            lines[i] = lines[i].replace("count 1024 ", f"count {rng.randint(1, 10**7)} ")
        assert_same(text(lines))

    def test_a_communicator_reused_after_its_destroy(self):
        first, second = log(20_000), log(20_000, seed=1)
        assert_same(text(first + second))


def test_watched_markers_may_not_hold_what_the_fast_paths_cut_out():
    with pytest.raises(ValueError):
        NcclLogParser("f", watch=(b"count 5",))
    assert all(b"\n" not in m and b"INFO" not in m for m in nccl_log._MARKERS + (nccl_log._VERSION_MARKER,))


def test_op_records_give_iter_op_lines():
    lines = log(30_000, every=53, extra=FOREIGN + RARE)
    for data in (text(lines), text(log(5_000, tee="[rank1]:"))):
        expected = list(nccl_log.iter_op_lines(data))
        records = nccl_log.op_records(data)
        assert records is not None
        assert len(records.ids) == len(expected)
        for index in (0, 1, 777, len(expected) - 1):
            line, line_text, proc, comm, sig = expected[index]
            assert records.line(index) == (line, line_text)
            assert records.key(records.ids[index]) == (proc, comm, sig)
    garbled = log(3_000)
    garbled[100] = garbled[100].replace("sendbuff 0x7f", "sendbuff zz")
    garbled[200] = garbled[200][:50]
    assert nccl_log.op_records(text(garbled)) is None  # the general pattern reads one, not the other: it says
