"""``ncclwatch analyze`` on Flight Recorder dumps of a slow job says what the live performance look would.

Two ranks' dumps in torch's pickle format (the fields of the real 2-GPU
captures): 30 steps of a 64 MiB gradient all_reduce, a loss all_reduce and
a broadcast, every one completed with its kernel time; rank 1 enters each
step's gradient all_reduce 60 ms after rank 0, whose kernel spins 60 ms
longer waiting for it.  Not a hang: the verdict
stays ``no_hang``, and the report's performance notes name rank 1.

NCCL logs: the transports their init lines show are compared as the live
look compares them (the recorded 2-node, 4-rank lines of ``tests/data/transport``).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from conftest import DATA

from ncclwatch.watchdog.analyze import analyze_paths

T0_NS = 1_795_301_000_000_000_000
STEP_NS = 200_000_000
MIB_FLOATS = 256 * 1024


def dump(rank: int, *, late_rank: int | None, steps: int = 30) -> bytes:
    entries = []
    for step in range(steps):
        start = T0_NS + step * STEP_NS + rank * 100_000  # 0.1 ms apart: jitter, not a lead
        late = 60_000_000 if rank == late_rank else 0
        waits = 60.0 if late_rank is not None and rank != late_rank else 0.0  # ms its gradient all_reduce kernel waited
        for offset, (name, numel, at) in enumerate(
            (
                ("nccl:all_reduce", 64 * MIB_FLOATS, start + late),
                ("nccl:all_reduce", 256, start + 65_000_000),
                ("nccl:broadcast", 4, start + 66_000_000),
            )
        ):
            seq = 3 * step + offset + 1
            entries.append(
                {
                    "frames": [{"name": "train_step", "filename": "/work/train.py", "line": 88}],
                    "record_id": seq - 1,
                    "pg_id": 0,
                    "process_group": ("0", "default_pg"),
                    "collective_seq_id": seq,
                    "p2p_seq_id": 0,
                    "op_id": seq,
                    "profiling_name": name,
                    "time_created_ns": at,
                    "input_sizes": [[numel]],
                    "input_dtypes": ["Float"],
                    "output_sizes": [[numel]],
                    "output_dtypes": ["Float"],
                    "state": "completed",
                    "duration_ms": 40.0 + waits if offset == 0 else 0.05,
                    "retired": True,
                    "timeout_ms": 600_000,
                    "is_p2p": False,
                }
            )
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    return pickle.dumps({"version": "2.10", "pg_config": pg_config, "entries": entries})


def write_dumps(folder: Path, late_rank: int | None) -> list[str]:
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"nccl_trace_rank_{rank}").write_bytes(dump(rank, late_rank=late_rank))
    return [str(folder)]


def test_a_straggler_in_the_dumps_is_a_performance_note_not_a_verdict(tmp_path: Path) -> None:
    report = analyze_paths(write_dumps(tmp_path / "fr", late_rank=1))
    assert report.verdict == "no_hang"
    [note] = report.performance
    assert (note.kind, note.ranks) == ("straggler", [1])
    assert "rank 1 was last in 20 of the last 20 collectives" in note.summary and "60 ms" in note.summary


def test_even_ranks_have_no_performance_notes(tmp_path: Path) -> None:
    assert analyze_paths(write_dumps(tmp_path / "fr", late_rank=None)).performance == []


def test_the_command_prints_the_section_and_its_json(tmp_path: Path) -> None:
    paths = write_dumps(tmp_path / "fr", late_rank=1)
    text = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", *paths], capture_output=True, text=True, timeout=60
    )
    assert "performance (slow, not hung):\n  - [straggler] rank 1 was last" in text.stdout, text.stdout[-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", "--json", *paths], capture_output=True, text=True, timeout=60
    )
    assert [n["kind"] for n in json.loads(done.stdout)["performance"]] == ["straggler"]


def test_a_node_on_sockets_among_infiniband_nodes_is_a_performance_note() -> None:
    report = analyze_paths([str(DATA / "transport" / "socket-fallback-node2.log")])
    notes = {note.key: note for note in report.performance}
    network = notes["transport-network-node2"]
    assert (network.kind, network.ranks, network.hosts) == ("transport_anomaly", [2, 3], ["node2"])
    assert "uses network Socket while the other nodes use IB" in network.summary
    assert notes["transport-hcas-node2"].links == ["mlx5_0", "mlx5_1"]  # node2's NCCL listed no HCA at all


def test_a_healthy_infiniband_job_has_no_transport_note() -> None:
    assert analyze_paths([str(DATA / "transport" / "healthy-ib.log")]).performance == []
