"""Stacks collector on real processes: every rank dumped, a stopped rank left as found."""

from __future__ import annotations

import asyncio
import json

import pytest
from support import context, sleepers

from ncclwatch.watchdog.evidence import RankTarget, collect_stacks
from ncclwatch.watchdog.probes.procfs import proc_state
from ncclwatch.watchdog.probes.pyspy import find_pyspy

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")


def frame_names(path) -> set[str]:
    return {f["name"] for thread in json.loads(path.read_bytes()) for f in thread["frames"]}


def by_name(records) -> dict[tuple[str, int], object]:
    return {(r.name, r.rank): r for r in records}


def test_running_and_stopped_ranks(tmp_path):
    with sleepers(3, stopped=(2,)) as procs:
        ctx = context(tmp_path, procs)
        records = by_name(asyncio.run(collect_stacks(ctx)))
        states = [proc_state(p.pid) for p in procs]
    assert len(records) == 6
    for r in range(3):
        rec = records["stacks", r]
        assert rec.error is None and rec.paths == [f"stacks/rank{r}.json"]
        assert "sleeping_here" in frame_names(ctx.out_dir / rec.paths[0])  # the stopped one too (nonblocking)
    for r in (0, 1):
        rec = records["stacks_native", r]
        assert rec.error is None and rec.note is None
        assert "sleeping_here" in frame_names(ctx.out_dir / f"stacks/rank{r}.native.json")
    skipped = records["stacks_native", 2]
    assert skipped.error is None and skipped.note.startswith("native dump skipped: rank 2 was stopped (state T)")
    assert (ctx.out_dir / "stacks/rank2.native.json.missing").exists()
    assert states == ["S", "S", "T"]  # native dumps resumed their ranks; the stopped rank stays stopped


def test_missing_pyspy_is_an_error_per_rank(tmp_path):
    with sleepers(2) as procs:
        ctx = context(tmp_path, procs, pyspy=str(tmp_path / "no-such-py-spy"))
        records = asyncio.run(collect_stacks(ctx))
    assert len(records) == 4
    assert {r.error for r in records} == {f"py-spy not found at {tmp_path}/no-such-py-spy"}
    assert (ctx.out_dir / "stacks/rank0.json.missing").read_text().startswith("py-spy not found")


def test_rank_elsewhere_or_gone_is_never_touched(tmp_path):
    with sleepers(1) as (proc,):
        gone = proc.pid
    ranks = (
        RankTarget(rank=0, pid=1, local_rank=0, host="node-that-is-not-here"),  # pid 1 here is not that rank
        RankTarget(rank=1, pid=gone, local_rank=1, host="localhost"),
    )
    ctx = context(tmp_path, ranks=ranks)
    records = by_name(asyncio.run(collect_stacks(ctx)))
    assert records["stacks", 0].error.startswith("rank 0 runs on node-that-is-not-here, not on this host")
    assert records["stacks", 1].error == f"process {gone} of rank 1 not found (exited?)"
