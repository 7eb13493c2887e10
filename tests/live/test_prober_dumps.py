"""How long the prober waits for Flight Recorder dumps: shorter once NCCL reported a communicator error.

A real FIFO with a reader that never dumps (a rank whose torch watchdog is
busy failing its communicator, as seen over NET/Socket on the H100 suite),
and the real NCCL WARN line of that run parsed by the real parser.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tarfile
import time
from pathlib import Path

import pytest

from ncclwatch.watchdog.events import FrDump, NcclWarning, Unusable
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.live.prober import DUMP_WAIT_S, ERRORED_DUMP_WAIT_S, JobProber, comm_errored
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.probes.flight_recorder import FULL_REQUEST, QUIET_REQUEST, request_dumps

TRUNCATED = (
    b"vm:2072:2301 [0] include/socket.h:409 NCCL WARN NET/Socket : peer 192.0.2.2<37060> message truncated : "
    b"receiving 1048576 bytes instead of 65536. If you believe your socket network is in a healthy state, there may be "
    b"a mismatch in collective sizes or environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between ranks\n"
)
CUDA_OOM = b"vm:2072:2072 [0] enqueue.cc:1500 NCCL WARN Cuda failure 2 'out of memory'\n"


def warnings_of(line: bytes) -> list[NcclWarning]:
    parser = NcclLogParser("vm.2072")
    return [event for event in parser.feed(line) if isinstance(event, NcclWarning)]


def test_a_network_warn_is_a_communicator_error_and_a_cuda_one_is_not() -> None:
    assert comm_errored(warnings_of(TRUNCATED))
    assert not comm_errored(warnings_of(CUDA_OOM))
    assert not comm_errored([])


@pytest.mark.parametrize(
    "errored, after_proof, wait_s",
    [(False, False, DUMP_WAIT_S), (True, False, ERRORED_DUMP_WAIT_S), (False, True, ERRORED_DUMP_WAIT_S)],
)
def test_a_rank_that_never_dumps_is_waited_for_less_once_nccl_reported_an_error_or_a_peek_proved_the_hang(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, errored: bool, after_proof: bool, wait_s: float
) -> None:
    pid = os.getpid()
    fifo = tmp_path / f"ncclwatch_pipe.{pid}"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDWR)  # alive, never answers
    try:
        prober = JobProber(tmp_path, pyspy=str(tmp_path / "no-py-spy"), nccl_errored=lambda: errored)
        worker = WorkerView(
            rank=0,
            pid=pid,
            local_rank=0,
            world_size=1,
            host="vm",
            state="S",
            cpu_share=0.0,
            io_rate=0.0,
            step=5,
            gone=False,
        )
        with caplog.at_level(logging.INFO, logger="ncclwatch"):
            asyncio.run(prober.probe([worker], with_gpus=False, after_proof=after_proof))
        assert f"no new dump within {wait_s:g} s of the trigger" in caplog.text
    finally:
        os.close(reader)


@pytest.mark.parametrize("quiet", [False, True])
def test_the_quiet_request_goes_to_ncclwatchs_door_even_where_torchs_exists(tmp_path: Path, quiet: bool) -> None:
    """torch's pipe prints '[E] ... preparing to dump debug info' into the job's stderr at every dump: the
    performance look of a healthy job asks ncclwatch's responder, without stack traces, and nothing else."""
    pid = os.getpid()
    doors = {name: tmp_path / name for name in ("pipe_0.pipe", f"ncclwatch_pipe.{pid}")}
    readers = {}
    for name, fifo in doors.items():
        os.mkfifo(fifo, 0o600)
        readers[name] = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        asyncio.run(request_dumps(tmp_path, {0: pid}, wait_s=0.2, quiet=quiet))

        def read(name: str) -> bytes:
            try:
                return os.read(readers[name], 64)
            except BlockingIOError:
                return b""

        asked = {name: read(name) for name in doors}
    finally:
        for fd in readers.values():
            os.close(fd)
    if quiet:
        assert asked == {"pipe_0.pipe": b"", f"ncclwatch_pipe.{pid}": QUIET_REQUEST}
    else:
        assert asked == {"pipe_0.pipe": FULL_REQUEST, f"ncclwatch_pipe.{pid}": b""}


def _fsdp2_dump(rank: int) -> bytes:
    """PyTorch's own dump from the H100 FSDP2 bundle (tests/fixtures/bundles/nccl-2.28.9-h100x1), written when NCCL
    failed the communicator."""
    bundle = next((Path(__file__).parents[1] / "fixtures" / "bundles" / "nccl-2.28.9-h100x1").glob("*.tar.gz"))
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"fr/nccl_trace_rank_{rank}"))
        data = tar.extractfile(member)
        assert data is not None
        return data.read()


@pytest.mark.parametrize("written_after_the_stall", [True, False])
def test_a_rank_that_does_not_answer_is_read_from_its_dump_written_since_the_stall(
    tmp_path: Path, written_after_the_stall: bool
) -> None:
    """torch's door is open but the rank never dumps (its communicator failed); the dump PyTorch wrote at the error,
    before the probe and after the stall began, is its evidence, and the report says so.  One written before the
    stall is not."""
    pid = os.getpid()
    fifo = tmp_path / "pipe_1.pipe"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDWR)  # alive, never answers
    dump = tmp_path / "nccl_trace_rank_1"
    dump.write_bytes(_fsdp2_dump(1))
    written = time.time() - 5.0
    os.utime(dump, (written, written))
    stalled_since = written - 0.4 if written_after_the_stall else written + 0.4
    try:
        prober = JobProber(tmp_path, pyspy=str(tmp_path / "no-py-spy"), nccl_errored=lambda: True)
        worker = WorkerView(
            rank=1,
            pid=pid,
            local_rank=0,
            world_size=2,
            host="vm",
            state="S",
            cpu_share=0.0,
            io_rate=0.0,
            step=90,
            gone=False,
        )
        events = asyncio.run(prober.probe([worker], with_gpus=False, stalled_since=stalled_since))
    finally:
        os.close(reader)
    dumps = [e for e in events if isinstance(e, FrDump)]
    notes = [e.reason for e in events if isinstance(e, Unusable)]
    if not written_after_the_stall:
        assert (dumps, notes) == ([], [])
        return
    assert [(d.rank, d.cite.file) for d in dumps] == [(1, str(dump))]
    assert any(e.frames for e in dumps[0].entries)  # the call sites the live verdict lacked
    (note,) = notes
    assert "no Flight Recorder dump came from rank 1 at this probe" in note
    assert "0.4 s after the job last moved" in note
