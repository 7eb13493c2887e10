"""Node-wide collectors: NVML (absent here), RAS against a loopback server, InfiniBand on a fake tree."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import DATA
from support import RasServer, context, free_port, make_port

from ncclwatch.watchdog.events import RasReport
from ncclwatch.watchdog.evidence import collect_infiniband, collect_nvml, collect_ras
from ncclwatch.watchdog.parsing.ras import parse_ras
from ncclwatch.watchdog.probes.nvml import sample_gpus

REAL = DATA / "ras" / "real-2.28.9-h200x2"


@pytest.mark.serial  # a bound on its wall time: run alone, not beside other workers' jobs
@pytest.mark.skipif(sample_gpus(0.1) is not None, reason="this machine has a usable GPU")
def test_nvml_absent_is_an_error_record(tmp_path):
    (rec,) = asyncio.run(collect_nvml(context(tmp_path)))
    assert (rec.name, rec.error, rec.paths) == ("nvml", "NVML not available", [])
    assert rec.duration_s < 1.0


def test_ras_text_and_json_reports_land_raw_in_the_bundle(tmp_path):
    text, js = (REAL / "python_stuck.txt").read_bytes(), (REAL / "python_stuck.json").read_bytes()

    async def go():
        async with RasServer(text, json_report=js) as server:
            ctx = context(tmp_path, ras_port=server.port)
            return ctx, server, await collect_ras(ctx)

    ctx, server, records = asyncio.run(go())
    assert [(r.name, r.error, r.paths) for r in records] == [
        ("ras_text", None, ["ras/ras.txt"]),
        ("ras_json", None, ["ras/ras.json"]),
    ]
    assert (ctx.out_dir / "ras/ras.txt").read_bytes() == text and (ctx.out_dir / "ras/ras.json").read_bytes() == js
    assert "SET FORMAT json" in server.commands[1]
    for name in ("ras.txt", "ras.json"):  # what the engine will read from the bundle
        assert any(isinstance(e, RasReport) for e in parse_ras((ctx.out_dir / "ras" / name).read_bytes(), name))


def test_no_ras_server_skips_the_json_query(tmp_path):
    port = free_port()
    records = asyncio.run(collect_ras(context(tmp_path, ras_port=port)))
    assert [(r.name, r.error) for r in records] == [
        ("ras_text", f"no NCCL RAS server on 127.0.0.1:{port}"),
        ("ras_json", f"skipped: the text query failed (no NCCL RAS server on 127.0.0.1:{port})"),
    ]


def test_ras_withheld_is_never_asked_by_the_bundle(tmp_path):
    """The bundle follows the probe's rule (an NCCL version RAS crashes): the live server sees no connection."""
    why = "not queried: on NCCL 2.28.9+cuda13.0 VERBOSE STATUS can corrupt memory and crash the job (NVIDIA/nccl#1762)"

    async def go():
        async with RasServer((REAL / "python_stuck.txt").read_bytes()) as server:
            records = await collect_ras(context(tmp_path, ras_port=server.port, ras_withheld=why))
            return server, records

    server, records = asyncio.run(go())
    assert server.commands == []
    assert [(r.name, r.error, r.paths, r.note) for r in records] == [("ras_text", None, [], why)]


def test_infiniband_counters_and_a_moving_error_counter(tmp_path):
    sys_ib = tmp_path / "sys"
    make_port(sys_ib, counters__port_xmit_data=0)
    ctx = context(tmp_path, sys_infiniband=sys_ib)

    async def go():
        collecting = asyncio.create_task(collect_infiniband(ctx))
        await asyncio.sleep(0.3)  # between the collector's two reads, the link misbehaves
        make_port(sys_ib, counters__port_xmit_data=1_000_000, counters__symbol_error=7)
        return await collecting

    (rec,) = asyncio.run(go())
    assert (rec.error, rec.paths) == (None, ["ib/counters.json"])
    assert rec.note == "error counters moved: mlx5_0/1 symbol_error +7"
    doc = json.loads((ctx.out_dir / "ib/counters.json").read_text())
    assert set(doc) == {"before", "after", "delta", "hca_gpus", "findings"}
    assert [f["key"].split("-")[1] for f in doc["findings"]] == ["errors"]
    port = doc["delta"]["ports"]["mlx5_0/1"]
    assert port["xmit_bytes"] == 4_000_000 and 0.9 < doc["delta"]["seconds"] < 1.5


def test_no_infiniband_is_a_note_not_an_error(tmp_path):
    (rec,) = asyncio.run(collect_infiniband(context(tmp_path, sys_infiniband=tmp_path / "none")))
    assert (rec.error, rec.note, rec.paths) == (None, "no InfiniBand devices", [])
