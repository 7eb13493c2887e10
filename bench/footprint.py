"""The run folder's footprint over a long job: bytes NCCL writes per rank and hour, and the disk it takes.

Writers (one process per rank) append real NCCL lines (a capture's Init
lines, then its operation lines over and over: tests/fixtures/nccl-2.28.9-2gpu/
healthy, 2 x H200, NCCL 2.28.9; bench/nccl_writer.py) through one open descriptor, as NCCL does,
to a run folder made as the wrapper makes it (``RunFolderSpace.declare``);
the real NCCL source (``NcclFileSource``) reads them every 0.25 s into the
real engine's state, freeing what it consumed.  Each phase samples the
folder's disk use (``st_blocks``, as ``du``) and the files' logical size.

Phases: each rate of ``--rates`` for ``--seconds`` (the bytes per operation
and hour, disk at that rate), then ``--accel-rate`` for ``--accel-seconds``
(as many operations as a long job at the lower rates: the disk must stay
flat however many were written).  At the end both ranks issue one more
AllReduce, rank 1 with another count, and the state the source built from
the bounded files is judged (a collective mismatch expected); ``ncclwatch
analyze`` is run on the bounded folder too.  30 days are extrapolated from
the measured bytes per operation; disk use is measured, not extrapolated.

    python bench/footprint.py --root /var/tmp --out bench/results/<date>-footprint/ext4.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from nccl_writer import CAPTURE, OpCycle, capture, paced

from ncclwatch.watchdog.analyze import analyze_paths, take_snapshot
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.sources.files import NcclFileSource
from ncclwatch.watchdog.sources.holes import disk_bytes, punch_problem
from ncclwatch.watchdog.sources.run_space import MIB, RunFolderSpace

DAY_S = 86_400


def writer(path: str, rank_file: str, rate: mp.Value, stop: mp.Event, written: mp.Value, plant: mp.Event) -> None:
    """Append operation lines at ``rate`` per second (batches every 10 ms) until ``stop``; then the planted op."""
    head, ops = capture(Path(rank_file))
    cycle = OpCycle(ops)
    with open(path, "wb", buffering=0) as out:
        out.write(head)
        for due in paced(lambda: rate.value, lambda: not stop.is_set()):
            out.write(cycle.take(due))
            with written.get_lock():
                written.value += due
        plant.wait()  # the main process has set ``rate`` to the count every rank reaches before the planted op
        while sent_total(written) < rate.value:
            missing = int(rate.value) - sent_total(written)
            out.write(cycle.take(missing))
            with written.get_lock():
                written.value += missing
        last = [line for line in ops if b"AllReduce" in line][-1]
        if "641" in Path(rank_file).name:  # rank 1 issues the same position with another count
            last = last.replace(b" count 1 ", b" count 2 ")
        out.write(last)


def sent_total(written: mp.Value) -> int:
    with written.get_lock():
        return int(written.value)


def sample(root: Path, nccl: Path) -> dict:
    sizes = sum(p.stat().st_size for p in nccl.iterdir())
    return {"disk_bytes": disk_bytes(root), "logical_bytes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/var/tmp", help="where the run folder goes (its filesystem is measured)")
    parser.add_argument("--rates", default="100,1000,10000")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--accel-rate", type=int, default=20_000)
    parser.add_argument("--accel-seconds", type=float, default=90.0)
    parser.add_argument("--cap-mib", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ncclwatch-footprint-", dir=args.root))
    (root / "nccl").mkdir()
    RunFolderSpace.declare(root, args.cap_mib * MIB)
    rows: list[dict] = []

    def row(**fields: object) -> None:
        rows.append(fields)
        print(json.dumps(fields), flush=True)

    row(
        kind="machine",
        python=platform.python_version(),
        kernel=platform.release(),
        cpus=os.cpu_count(),
        root=str(root),
        punch_problem=punch_problem(root),
    )
    rank_files = sorted(CAPTURE.iterdir())
    rate, stop, plant = mp.Value("d", 0.0), mp.Event(), mp.Event()
    counts = [mp.Value("q", 0) for _ in rank_files]
    procs = [
        mp.Process(target=writer, args=(str(root / "nccl" / f"vm.{i}"), str(f), rate, stop, counts[i], plant))
        for i, f in enumerate(rank_files)
    ]
    state = JobState()
    source = NcclFileSource(root / "nccl")
    reading = threading.Event()

    def read() -> None:
        while not reading.is_set():
            source.poll(state.apply)
            time.sleep(0.25)

    reader = threading.Thread(target=read, daemon=True)
    for proc in procs:
        proc.start()
    reader.start()
    phases = [(float(r), args.seconds, "nominal") for r in args.rates.split(",")]
    phases.append((float(args.accel_rate), args.accel_seconds, "accelerated"))
    for phase_rate, seconds, kind in phases:
        before_ops = sum(c.value for c in counts)
        before = sample(root, root / "nccl")
        rate.value = phase_rate
        began, peak = time.monotonic(), 0
        while time.monotonic() - began < seconds:
            time.sleep(min(5.0, seconds / 4))
            now = sample(root, root / "nccl")
            peak = max(peak, now["disk_bytes"])
            row(kind="sample", phase=kind, rate=phase_rate, t_s=round(time.monotonic() - began, 1), **now)
        after = sample(root, root / "nccl")
        ops = sum(c.value for c in counts) - before_ops
        per_op = (after["logical_bytes"] - before["logical_bytes"]) / ops if ops else None
        row(
            kind="phase",
            phase=kind,
            rate=phase_rate,
            seconds=seconds,
            ops_written=ops,
            achieved_rate_per_rank=round(ops / len(procs) / seconds),
            bytes_per_op=per_op,
            disk_peak_bytes=peak,
            disk_end_bytes=after["disk_bytes"],
            logical_end_bytes=after["logical_bytes"],
        )
    stop.set()
    time.sleep(1.0)
    rate.value = float(max(c.value for c in counts))  # every rank catches up to the same operation, then diverges
    plant.set()
    for proc in procs:
        proc.join(10)
    time.sleep(1.0)
    reading.set()
    reader.join()
    source.poll(state.apply)
    finding = classify(take_snapshot(state, observed_at=time.time())).finding
    issued = {seq.rank: seq.total for comm in state.comms.values() for seq in comm.ranks.values()}
    row(
        kind="verdict",
        source="live state from the bounded files",
        verdict=finding.verdict.value,
        culprits=list(finding.culprits),
        summary=finding.summary,
        collectives_per_rank=issued,
        ops_written=[c.value for c in counts],
    )
    offline = analyze_paths([str(root / "nccl")])
    row(
        kind="verdict",
        source="ncclwatch analyze on the bounded folder",
        verdict=offline.verdict.value,
        culprits=list(offline.culprit_ranks),
        summary=offline.summary,
    )
    row(kind="end", disk_bytes=disk_bytes(root), cap_bytes=args.cap_mib * MIB, space_used=source.space.used_bytes)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
