"""py-spy's JSON dumps: native frames without a symbol (raw addresses) are left out, the others kept."""

from __future__ import annotations

import json
import re

from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import StackDump
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy

ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")
STACKS = shared("stacks")
FSDP2_SKIP = shared(
    "bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"
)


def test_native_dump_keeps_symbols_and_python_frames_without_raw_addresses() -> None:
    path = STACKS / "irecv_wait.native.json"
    raw = json.loads(path.read_bytes())
    assert any(ADDRESS.fullmatch(f["name"]) for t in raw for f in t["frames"])  # the real dump has them
    (dump,) = parse_pyspy(path.read_bytes(), str(path))
    assert isinstance(dump, StackDump)
    frames = [frame for thread in dump.threads for frame in thread.frames]
    assert not [f for f in frames if ADDRESS.search(f)]
    named = [f"{f['name']} " for t in raw for f in t["frames"] if not ADDRESS.fullmatch(f["name"])]
    assert len(frames) == len(named) and all(frame.startswith(name) for frame, name in zip(frames, named))


def test_rank_table_of_a_bundle_shows_no_raw_addresses() -> None:
    report = analyze_paths([str(FSDP2_SKIP)])
    stacks = {row.rank: row.stack for row in report.ranks}
    assert all(stacks.values()), stacks
    assert not [s for s in stacks.values() if ADDRESS.search(s or "")], stacks
    assert stacks[0].endswith("main (fsdp_job.py:129)"), stacks
