"""``ncclwatch preflight``: a real gloo sweep (3 CPU ranks, small sizes), the hard time limit, and reading results."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from ncclwatch.launcher.cli import main
from ncclwatch.watchdog.preflight import (
    compare_to_baseline,
    expected_busbw,
    parse_size,
    render_table,
    run_preflight,
    run_ranks,
    slow_pairs,
)

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gloo_result(tmp_path_factory):
    return run_preflight(
        nproc=3,
        backend="gloo",
        sizes=[4096, 65536],
        pairs_bytes=16384,
        iters=3,
        time_limit_s=120,
        sys_infiniband=tmp_path_factory.mktemp("no-ib"),
    )


class TestRealGlooSweep:
    def test_rows_per_op_and_size_with_nccl_tests_busbw(self, gloo_result):
        assert "error" not in gloo_result, gloo_result
        rows = {(r["op"], r["bytes"]): r for r in gloo_result["rows"]}
        # float32 elements, a multiple of the rank count: 4096 B -> 1023 elements
        assert set(rows) == {("AllReduce", 4092), ("AllReduce", 65532), ("AllGather", 4092), ("AllGather", 65532)}
        for (op, nbytes), row in rows.items():
            assert row["nranks"] == 3 and row["seconds"] > 0
            factor = 4 / 3 if op == "AllReduce" else 2 / 3
            assert row["busbw"] == pytest.approx(nbytes / row["seconds"] * factor)

    def test_every_pair_is_timed(self, gloo_result):
        assert [p["pair"] for p in gloo_result["pairs"]] == [[0, 1], [0, 2], [1, 2]]
        assert all(p["busbw"] > 0 for p in gloo_result["pairs"])

    def test_no_links_known_on_cpu_and_the_table_says_so(self, gloo_result):
        assert gloo_result["expected"] == {"intra": None, "inter": None, "expected": None, "basis": None}
        table = render_table(gloo_result)
        assert "expected busbw: unknown" in table and "AllGather" in table and "pair 1-2" in table

    def test_same_run_as_its_own_baseline_is_fine(self, gloo_result):
        assert compare_to_baseline(gloo_result, gloo_result) == []


def test_the_time_limit_kills_every_rank_and_returns(tmp_path):
    marker = tmp_path / "pids"
    command = [
        sys.executable,
        "-c",
        f"import os, time; open({str(marker)!r} + str(os.getpid()), 'w').close(); time.sleep(60)",
    ]
    started = time.monotonic()
    status, _ = run_ranks(command, 3, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=1, time_limit_s=1.5)
    assert status is None and time.monotonic() - started < 10
    pids = [int(p.name.removeprefix("pids")) for p in tmp_path.iterdir()]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_failing_rank_ends_the_run_with_its_status_and_stderr(tmp_path):
    command = [
        sys.executable,
        "-c",
        "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit('boom')\ntime.sleep(60)",
    ]
    status, tail = run_ranks(command, 2, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=1, time_limit_s=30)
    assert status == 1 and "boom" in tail


class TestReading:
    def test_expected_from_nvlink_and_ib(self):
        h200 = [{"index": i, "links": 18, "version": 6} for i in range(4)]  # as NVML reported them on 2 x H200
        port = {"state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)"}
        ib = {"mlx5_0": {"1": port}, "mlx5_1": {"1": port}, "mlx5_2": {"1": {**port, "state": "1: DOWN"}}}
        assert expected_busbw(h200, ib, local_ranks=4, nnodes=1) == {
            "intra": 450e9,
            "inter": None,
            "expected": 450e9,
            "basis": "NVLink",
        }
        both = expected_busbw(h200, ib, local_ranks=4, nnodes=2)
        assert (both["inter"], both["expected"], both["basis"]) == (100e9, 100e9, "NVLink and InfiniBand")
        assert expected_busbw(None, None, local_ranks=1, nnodes=1)["expected"] is None
        b200 = [{"index": i, "links": 18, "version": 7} for i in range(2)]
        assert expected_busbw(b200, None, local_ranks=2, nnodes=1)["intra"] == 900e9

    def test_slower_than_baseline_and_not_idle(self):
        base = {"mode": "idle", "rows": [{"op": "AllReduce", "bytes": 1 << 28, "busbw": 336e9}]}
        now = {"mode": "at-hang", "rows": [{"op": "AllReduce", "bytes": 1 << 28, "busbw": 14.7e9}]}
        found = compare_to_baseline(now, base)
        assert "not idle" in found[0] and "4% of the baseline's 336.00 GB/s" in found[1]

    def test_a_pair_far_below_the_others_is_named(self):
        pairs = [
            {"pair": [a, b], "busbw": 5e9 if (a, b) == (1, 3) else 50e9} for a in range(4) for b in range(a + 1, 4)
        ]
        assert slow_pairs({"pairs": pairs}) == ["ranks 1-3: 5.00 GB/s, 10% of the median pair (50.00 GB/s)"]
        assert slow_pairs({"pairs": pairs[:2]}) == []

    def test_sizes(self):
        assert [parse_size(s) for s in ("4K", "16M", "1G", "1000", "64KB")] == [4096, 16 << 20, 1 << 30, 1000, 65536]


def test_cli_writes_the_result_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "pf.json"
    code = main(
        [
            "preflight",
            "--backend",
            "gloo",
            "--nproc",
            "2",
            "--sizes",
            "4K",
            "--ops",
            "all_reduce",
            "--iters",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "AllReduce" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["op"] == "AllReduce"
