"""Node-wide evidence: GPUs [gpu/nvml.json], NCCL RAS [ras/ras.txt, ras/ras.json], InfiniBand [ib/counters.json].

``ib/counters.json`` holds two readings a second apart, their delta, the
HCA-to-GPU map (``hca_gpu_map``, from the PCI tree of the sysfs the
InfiniBand folder belongs to) and the port findings (a port slower than
its siblings, error counters that rose).  A port that is down is named only
when NCCL is known to use it, which the bundle does not know: the live
sidecar checks that with the transport facts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from ncclwatch.watchdog.evidence.base import EvidenceContext, EvidenceRecord, guard, record, write_file
from ncclwatch.watchdog.probes.infiniband import hca_gpu_map, ib_delta, read_ib_counters
from ncclwatch.watchdog.probes.nvml import sample_gpus_async
from ncclwatch.watchdog.probes.ras import query_ras
from ncclwatch.watchdog.slowness.engine import IbPorts, perf_health

GPM_WINDOW_S = 1.0
NVML_TIMEOUT_S = GPM_WINDOW_S + 4.0
RAS_QUERY_S = 8.0
RAS_SERVER_TIMEOUT_S = (
    3  # how long NCCL waits for unresponsive peers before it reports them (a stopped rank: all of it)
)
RAS_TIMEOUT_S = 2 * RAS_QUERY_S + 1.0
IB_INTERVAL_S = 1.0
IB_TIMEOUT_S = IB_INTERVAL_S + 4.0


async def collect_nvml(ctx: EvidenceContext) -> list[EvidenceRecord]:
    async def work() -> list[EvidenceRecord]:
        started = time.monotonic()
        snapshot = await sample_gpus_async(GPM_WINDOW_S)
        if snapshot is None:
            return [record("nvml", started, error="NVML not available")]
        rel = write_file(ctx, "gpu/nvml.json", json.dumps(snapshot, indent=1) + "\n")
        return [record("nvml", started, [rel], note=f"{len(snapshot['gpus'])} GPUs")]

    return await guard("nvml", NVML_TIMEOUT_S, work())


async def collect_ras(ctx: EvidenceContext) -> list[EvidenceRecord]:
    """Text first (every RAS version), then JSON (2.28.7+).

    When the text query got nothing (no server, no answer even on a second
    connection, out of time), the JSON query is not tried: it would spend the
    same seconds for nothing.
    """

    async def work() -> list[EvidenceRecord]:
        records: list[EvidenceRecord] = []
        if ctx.ras_withheld is not None:
            # The same rule as the live probe's: a bundle must never be what crashes the job.
            return [record("ras_text", time.monotonic(), note=ctx.ras_withheld)]
        for name, rel, json_format in (("ras_text", "ras/ras.txt", False), ("ras_json", "ras/ras.json", True)):
            started = time.monotonic()
            if records and not records[0].paths:
                records.append(record(name, started, error=f"skipped: the text query failed ({records[0].error})"))
                continue
            data, error = await query_ras(
                ctx.ras_port, json_format=json_format, timeout_s=RAS_QUERY_S, server_timeout_s=RAS_SERVER_TIMEOUT_S
            )
            paths = [write_file(ctx, rel, data)] if data else []
            records.append(record(name, started, paths, error, note="partial report" if data and error else None))
        return records

    return await guard("ras", RAS_TIMEOUT_S, work())


async def collect_infiniband(ctx: EvidenceContext) -> list[EvidenceRecord]:
    async def work() -> list[EvidenceRecord]:
        started = time.monotonic()
        before = await asyncio.to_thread(read_ib_counters, ctx.sys_infiniband)
        if before is None:
            return [record("infiniband", started, note="no InfiniBand devices")]
        t0 = time.monotonic()
        await asyncio.sleep(IB_INTERVAL_S)
        after = await asyncio.to_thread(read_ib_counters, ctx.sys_infiniband)
        seconds = round(time.monotonic() - t0, 4)
        if after is None:
            return [record("infiniband", started, error=f"{ctx.sys_infiniband} vanished between two reads")]
        delta = ib_delta(before, after, seconds)
        # /sys/class/infiniband -> /sys: the PCI tree the HCAs' device links point into.
        hcas = await asyncio.to_thread(hca_gpu_map, ctx.sys_infiniband.parent.parent)
        health = perf_health(now=time.time(), ib=IbPorts(socket.gethostname(), after, delta))
        findings = [f.to_dict() for f in health.perf_findings]
        doc = {"before": before, "after": after, "delta": delta, "hca_gpus": hcas, "findings": findings}
        rel = write_file(ctx, "ib/counters.json", json.dumps(doc, indent=1) + "\n")
        slow = [f["summary"] for f in findings if f["key"].startswith("ib_port-rate-")]
        notes = (["error counters moved: " + "; ".join(delta["errors"])] if delta["errors"] else []) + slow
        note = "; ".join(notes) or None
        return [record("infiniband", started, [rel], note=note)]

    return await guard("infiniband", IB_TIMEOUT_S, work())
