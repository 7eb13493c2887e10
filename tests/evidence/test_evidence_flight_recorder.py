"""Flight Recorder collector with real FIFOs and a real responder process.

The responder mirrors torch's (ProcessGroupNCCL's DumpPipe): it makes the
FIFO, opens it ``O_RDONLY|O_NONBLOCK``, polls it, and writes its dump file
when a byte arrives.  A FIFO nobody opened is the ENXIO case.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import context, sleepers, wait_state

from ncclwatch.watchdog.evidence import RankTarget, collect_flight_recorder
from ncclwatch.watchdog.evidence import flight_recorder as fr_module

RESPONDER = """
import os, sys, time
fifo, dump, answer = sys.argv[1].format(pid=os.getpid()), sys.argv[2], sys.argv[3] == "answer"
os.mkfifo(fifo)
fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
print("ready", flush=True)
while True:
    try:
        got = os.read(fd, 128)
    except BlockingIOError:  # a writer has it open, nothing written yet
        got = b""
    if got and answer:
        with open(dump, "wb") as f:
            f.write(b"dump from " + str(os.getpid()).encode())
    time.sleep(0.05)
"""


class Responder:
    def __init__(self, fifo: str, dump: Path, answer: bool = True) -> None:
        mode = "answer" if answer else "ignore"
        self.proc = subprocess.Popen([sys.executable, "-c", RESPONDER, fifo, str(dump), mode], stdout=subprocess.PIPE)
        assert self.proc.stdout.readline() == b"ready\n"
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def responders():
    made: list[Responder] = []

    def start(*args, **kw) -> Responder:
        made.append(Responder(*args, **kw))
        return made[-1]

    yield start
    for responder in made:
        responder.close()


@pytest.fixture
def fr_dir(tmp_path) -> Path:
    (tmp_path / "run" / "fr").mkdir(parents=True)
    return tmp_path / "run" / "fr"


def collect(tmp_path, fr_dir, ranks: list[RankTarget]):
    ctx = context(tmp_path, run_dir=fr_dir.parent, ranks=tuple(ranks))
    return ctx, asyncio.run(collect_flight_recorder(ctx))


def rank(r: int, pid: int) -> RankTarget:
    return RankTarget(rank=r, pid=pid, local_rank=r, host="localhost")


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_torch_pipe_dump_is_triggered_and_copied(tmp_path, fr_dir, responders):
    responder = responders(str(fr_dir / "pipe_0.pipe"), fr_dir / "nccl_trace_rank_0")
    ctx, (rec,) = collect(tmp_path, fr_dir, [rank(0, responder.pid)])
    assert (rec.name, rec.rank, rec.error, rec.paths) == ("flight_recorder", 0, None, ["fr/nccl_trace_rank_0"])
    assert (ctx.out_dir / "fr/nccl_trace_rank_0").read_bytes() == f"dump from {responder.pid}".encode()
    assert rec.duration_s < 2.0


def test_ncclwatch_pipe_named_by_pid(tmp_path, fr_dir, responders):
    responder = responders(str(fr_dir / "ncclwatch_pipe.{pid}"), fr_dir / "ncclwatch_trace_3")
    ctx, (rec,) = collect(tmp_path, fr_dir, [rank(3, responder.pid)])
    assert rec.error is None and rec.paths == ["fr/ncclwatch_trace_3"]
    assert (ctx.out_dir / "fr/ncclwatch_trace_3").read_bytes() == f"dump from {responder.pid}".encode()


def test_fifo_without_reader_is_enxio_and_the_other_rank_still_dumps(tmp_path, fr_dir, responders):
    responder = responders(str(fr_dir / "pipe_0.pipe"), fr_dir / "nccl_trace_rank_0")
    os.mkfifo(fr_dir / "pipe_1.pipe")  # armed once, its reader gone
    with sleepers(1) as (rank1,):
        ctx, records = collect(tmp_path, fr_dir, [rank(0, responder.pid), rank(1, rank1.pid)])
    assert records[0].error is None
    assert records[1].error == "nobody reads pipe_1.pipe (ENXIO): the rank is not listening"
    assert records[1].paths == ["fr/nccl_trace_rank_1.missing"]
    assert "ENXIO" in (ctx.out_dir / "fr/nccl_trace_rank_1.missing").read_text()


def test_stopped_rank_is_not_triggered_but_its_earlier_dump_is_kept(tmp_path, fr_dir, responders):
    responder = responders(str(fr_dir / "pipe_0.pipe"), fr_dir / "nccl_trace_rank_0")
    (fr_dir / "nccl_trace_rank_0").write_bytes(b"dump written on timeout")
    os.kill(responder.pid, signal.SIGSTOP)
    wait_state(responder.pid, "T")
    ctx, (rec,) = collect(tmp_path, fr_dir, [rank(0, responder.pid)])
    assert rec.error == "rank 0 is stopped (state T): it cannot answer, not triggered"
    assert rec.paths == ["fr/nccl_trace_rank_0"] and rec.note.startswith("copied the dump that was already there")
    assert (ctx.out_dir / "fr/nccl_trace_rank_0").read_bytes() == b"dump written on timeout"


def test_no_pipe_at_all(tmp_path, fr_dir):
    with sleepers(1) as (proc,):
        _, (rec,) = collect(tmp_path, fr_dir, [rank(0, proc.pid)])
    assert rec.error == f"no Flight Recorder pipe ncclwatch_pipe.{proc.pid} in {fr_dir}"


def test_responder_that_never_dumps(tmp_path, fr_dir, responders, monkeypatch):
    monkeypatch.setattr(fr_module, "FR_WAIT_S", 0.5)
    responder = responders(str(fr_dir / "pipe_0.pipe"), fr_dir / "nccl_trace_rank_0", answer=False)
    _, (rec,) = collect(tmp_path, fr_dir, [rank(0, responder.pid)])
    assert rec.error == "no new dump within 0.5 s of the trigger" and rec.paths == ["fr/nccl_trace_rank_0.missing"]


def test_no_run_folder(tmp_path):
    (rec,) = asyncio.run(collect_flight_recorder(context(tmp_path)))
    assert rec.error == "no run folder: Flight Recorder pipes unknown"


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_rank_that_did_not_answer_the_probe_is_not_asked_again(tmp_path, fr_dir, responders):
    """Its communicator is in error (seen on H100): waiting again only delays the bundle."""
    responder = responders(str(fr_dir / "pipe_0.pipe"), fr_dir / "nccl_trace_rank_0", answer=False)
    (fr_dir / "nccl_trace_rank_0").write_bytes(b"the primed dump")
    ctx = context(
        tmp_path, run_dir=fr_dir.parent, ranks=(rank(0, responder.pid),), dumpless_pids=frozenset({responder.pid})
    )
    (rec,) = asyncio.run(collect_flight_recorder(ctx))
    assert rec.error == "rank 0 did not answer the probe's dump request moments before: not asked again"
    assert rec.duration_s < 1.0 and rec.note.startswith("copied the dump that was already there")
    assert (ctx.out_dir / "fr/nccl_trace_rank_0").read_bytes() == b"the primed dump"
