"""Log tails: cut at a line start, bounded, NCCL files and torchrun worker logs."""

from __future__ import annotations

import asyncio

from support import context

from ncclwatch.watchdog.evidence import RankTarget, collect_nccl_logs, collect_worker_logs
from ncclwatch.watchdog.evidence.logs import NO_WORKER_LOGS, collect_job_output, read_tail

LINE = b"vm:732:740 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 4 datatype 7 op 0 root 0\n"


class TestReadTail:
    def test_small_file_whole(self, write):
        assert read_tail(write("a.log", b"one\ntwo\n"), 100) == (b"one\ntwo\n", 8)

    def test_tail_starts_at_the_next_line(self, write):
        assert read_tail(write("a.log", b"first line\nsecond\nthird\n"), 10) == (b"third\n", 24)

    def test_tail_already_at_a_line_start_keeps_that_line(self, write):
        assert read_tail(write("a.log", b"first line\nsecond\n"), 7) == (b"second\n", 18)

    def test_one_line_longer_than_the_tail_is_cut(self, write):
        assert read_tail(write("a.log", b"x" * 50 + b"\n"), 10) == (b"x" * 9 + b"\n", 51)


def test_nccl_tails(tmp_path):
    nccl = tmp_path / "run" / "nccl"
    nccl.mkdir(parents=True)
    (nccl / "vm.732").write_bytes(LINE * 100)
    (nccl / "vm.733").write_bytes(LINE * 2)
    ctx = context(tmp_path, run_dir=tmp_path / "run", tail_bytes=len(LINE) * 10 + 5)
    (rec,) = asyncio.run(collect_nccl_logs(ctx))
    assert (rec.error, rec.paths) == (None, ["nccl/vm.732", "nccl/vm.733"])
    assert rec.note == f"2 files, 1 cut to their last {len(LINE) * 10 + 5} bytes"
    assert (ctx.out_dir / "nccl/vm.732").read_bytes() == LINE * 10
    assert (ctx.out_dir / "nccl/vm.733").read_bytes() == LINE * 2


def test_the_jobs_stderr_copy_older_part_first(tmp_path):
    output = tmp_path / "run" / "output"
    output.mkdir(parents=True)
    (output / "stderr.1.log").write_bytes(LINE * 3)
    (output / "stderr.log").write_bytes(LINE * 100)
    ctx = context(tmp_path, run_dir=tmp_path / "run", tail_bytes=len(LINE) * 10)
    (rec,) = asyncio.run(collect_job_output(ctx))
    assert (rec.error, rec.paths) == (None, ["output/stderr.1.log", "output/stderr.log"])
    assert (ctx.out_dir / "output/stderr.log").read_bytes() == LINE * 10


def test_no_copy_of_the_jobs_stderr(tmp_path):
    (rec,) = asyncio.run(collect_job_output(context(tmp_path, run_dir=tmp_path)))
    assert rec.error == f"no copy of the job's stderr ({tmp_path / 'output'})"


def test_no_nccl_folder(tmp_path):
    (rec,) = asyncio.run(collect_nccl_logs(context(tmp_path, run_dir=tmp_path)))
    assert rec.error == f"no NCCL debug folder ({tmp_path / 'nccl'})"


def test_worker_logs_per_rank_with_attempts_of_the_same_name(tmp_path, write):
    logs = {
        0: [write("attempt_0/0/stderr.log", "a0\n"), write("attempt_1/0/stderr.log", "a1\n")],
        1: [write("attempt_1/1/stderr.log", "r1\n"), tmp_path / "gone.log"],
    }
    ranks = tuple(RankTarget(rank=r, pid=1, local_rank=r, host="localhost") for r in (0, 1, 2))
    ctx = context(tmp_path, ranks=ranks, worker_logs=logs)
    records = asyncio.run(collect_worker_logs(ctx))
    assert [(r.rank, r.paths) for r in records] == [
        (0, ["logs/rank0/stderr.log", "logs/rank0/1.stderr.log"]),
        (1, ["logs/rank1/stderr.log"]),
        (2, []),
    ]
    assert (ctx.out_dir / "logs/rank0/1.stderr.log").read_text() == "a1\n"
    assert records[0].error is None
    assert records[1].error == f"{tmp_path / 'gone.log'}: No such file or directory"
    assert records[2].error == "no worker log files known"


def test_no_worker_logs_at_all_is_one_record_saying_why(tmp_path):
    """Without torchrun's --log-dir no rank has a log file: one record for the job, not one line per rank in
    report.md (issue 46)."""
    ranks = tuple(RankTarget(rank=r, pid=1, local_rank=r, host="localhost") for r in (0, 1))
    records = asyncio.run(collect_worker_logs(context(tmp_path, ranks=ranks)))
    assert [(r.rank, r.error) for r in records] == [(None, NO_WORKER_LOGS)]
    assert "--log-dir" in NO_WORKER_LOGS
