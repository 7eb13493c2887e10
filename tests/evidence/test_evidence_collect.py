"""collect_all on real processes: every collector reports, the budget holds, no rank is left stopped."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from support import RasServer, context, free_port, sleepers

from ncclwatch.watchdog.evidence import EVIDENCE_JSON, EvidenceRecord, collect_all
from ncclwatch.watchdog.probes.procfs import proc_state

ALL_NAMES = {
    "proc",
    "flight_recorder",
    "nvml",
    "ras_text",
    "ras_json",
    "infiniband",
    "stacks",
    "stacks_native",
    "env",
    "nccl_logs",
    "worker_logs",
    "job_output",
}


def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "fr").mkdir(parents=True)
    (run / "nccl").mkdir()
    (run / "nccl" / "vm.100").write_text("vm:100:100 [0] NCCL INFO Init COMPLETE\n")
    return run


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_three_real_ranks_well_within_budget(tmp_path):
    with sleepers(3, stopped=(1,)) as procs:
        ctx = context(tmp_path, procs, run_dir=run_dir(tmp_path), ras_port=free_port(), sys_infiniband=tmp_path / "no")
        started = time.monotonic()
        records = asyncio.run(collect_all(ctx))
        seconds = time.monotonic() - started
        states = [proc_state(p.pid) for p in procs]
    assert seconds < 10.0
    assert states == ["S", "T", "S"]
    assert {r.name for r in records} == ALL_NAMES
    doc = json.loads((ctx.out_dir / EVIDENCE_JSON).read_text())
    assert [EvidenceRecord.model_validate(r) for r in doc["records"]] == records
    assert [r["pid"] for r in doc["ranks"]] == [p.pid for p in procs]
    for rec in records:  # every path named is in the bundle
        assert all((ctx.out_dir / p).is_file() for p in rec.paths), rec
    stacks = {(r.name, r.rank): r for r in records if r.name.startswith("stacks")}
    assert all(stacks["stacks", r].error is None for r in range(3))
    assert stacks["stacks_native", 1].note.startswith("native dump skipped")
    assert (ctx.out_dir / "proc/rank1.txt").read_text().count("state: T (stopped)") == 1


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
def test_budget_cuts_what_has_not_finished(tmp_path):
    """A RAS server that accepts and never answers would hold the RAS collector ~6 s; the budget is 3 s."""

    async def go(ctx_args):
        async with RasServer(b"", silent=10) as server:
            ctx = context(tmp_path, procs, ras_port=server.port, budget_s=3.0, **ctx_args)
            started = time.monotonic()
            return ctx, await collect_all(ctx), time.monotonic() - started

    with sleepers(2) as procs:
        ctx, records, seconds = asyncio.run(go({"sys_infiniband": tmp_path / "no"}))
        states = [proc_state(p.pid) for p in procs]
    assert seconds < 3.2
    assert states == ["S", "S"]
    (ras,) = [r for r in records if r.name == "ras"]
    assert ras.error.startswith("timed out after 1.")  # the budget less the grace for cancelled work
    assert all(r.error is None for r in records if r.name in ("stacks", "stacks_native", "proc", "env"))
    assert ras.model_dump() in json.loads((ctx.out_dir / EVIDENCE_JSON).read_text())["records"]
