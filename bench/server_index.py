"""The cluster server at size: 10,000 incidents from 1,000 hosts in the index, served by a real
``ncclwatch serve``; p50/p99 of the incident list and the hosts view, a 50 MB upload, the server's RSS.

    python bench/server_index.py [--incidents 10000] [--hosts 1000] [--requests 400] [--out DIR]

The index is filled through ``IncidentIndex.record`` (what an upload does after its checks), two nodes'
parts per incident over 60 days, each naming one culprit host (a few hosts far more often, as a bad node
is), 5% a slow link too.  Latency is measured by a client on the same machine, one request at a time, over
HTTP on loopback: what an on-call engineer's browser waits for, less the network.  RSS is sampled from
/proc every 0.5 s while the requests run and the upload goes in.  Writes rows.csv and summary.json.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "server"))

from cluster_bundles import bundle_bytes, node_report  # noqa: E402

from ncclwatch.watchdog.server.incidents import IncidentIndex, Part  # noqa: E402
from ncclwatch.watchdog.server.view import report_view  # noqa: E402

READ, UPLOAD = "bench-read", "bench-upload"
VERDICTS = ("collective_mismatch", "rank_behind", "node_lost", "gpu_compute_hang", "process_dead")


def fill(db: Path, incidents: int, hosts: int, seed: int = 7) -> float:
    """The index with ``incidents`` over ``hosts``; seconds it took."""
    rng = random.Random(seed)
    now = time.time()
    names = [f"gpu{n:04d}" for n in range(hosts)]
    weights = [20.0 if n < 10 else 1.0 for n in range(hosts)]  # ten bad nodes
    index = IncidentIndex(db)
    started = time.perf_counter()
    for n in range(incidents):
        at = now - rng.uniform(0, 60) * 86400
        culprit = rng.choices(names, weights)[0]
        verdict = rng.choice(VERDICTS)
        job = f"job{rng.randrange(incidents // 4)}"
        for node in (culprit, rng.choice(names)):
            report = node_report(job, node, culprit, at, verdict=verdict).model_dump(mode="json")
            if rng.random() < 0.05:
                report["performance"] = [{"kind": "slow_link", "key": "k", "summary": "", "detail": "",
                                          "hosts": [culprit, rng.choice(names)]}]  # fmt: skip
            bundle = f"{job}-{node}-{n}-{verdict}"
            index.record(Part(bundle, f"incident-{n:05d}", report_view(report), 150_000, "0" * 64))
    index.close()
    return time.perf_counter() - started


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def timed(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.get(url) as reply:
        await reply.read()
        assert reply.status == 200, (url, reply.status)
    return (time.perf_counter() - started) * 1000


async def measure(base: str, pid: int, requests: int, upload: bytes, rows: list[dict]) -> dict:
    rss: list[tuple[float, int]] = []
    started = time.monotonic()

    async def sample() -> None:
        while True:
            rss.append((round(time.monotonic() - started, 1), rss_kib(pid)))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    result: dict = {}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {READ}"}) as session:
        paths = ("/api/incidents", "/incidents", "/api/incidents?host=gpu0003", "/api/hosts", "/hosts")
        for _ in range(20):  # warm: the page cache, sqlite's pages, the first imports
            for path in paths:
                await timed(session, base + path)
        for round_ in range(requests):
            for path in paths:
                ms = await timed(session, base + path)
                rows.append({"what": path, "round": round_, "ms": round(ms, 3)})
        for path in paths:
            values = sorted(r["ms"] for r in rows if r["what"] == path)
            result[path] = {
                "n": len(values),
                "p50_ms": round(statistics.median(values), 2),
                "p99_ms": round(values[int(0.99 * (len(values) - 1))], 2),
                "max_ms": round(values[-1], 2),
            }
        headers = {"Authorization": f"Bearer {UPLOAD}", "X-Ncclwatch-Incident": "bench-upload"}
        t0 = time.perf_counter()
        async with session.post(base + "/api/upload", data=upload, headers=headers) as reply:
            body = await reply.json()
            assert reply.status == 201, body
        result["upload_50mb"] = {"bytes": len(upload), "seconds": round(time.perf_counter() - t0, 2)}
        rows.append({"what": "upload", "round": 0, "ms": round((time.perf_counter() - t0) * 1000, 1)})
        for _ in range(requests):  # serving on after the upload: is memory flat?
            for path in paths:
                await timed(session, base + path)
    sampler.cancel()
    result["rss_kib"] = rss
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--incidents", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=1_000)
    parser.add_argument("--requests", type=int, default=400, help="timed requests per page")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "2026-11-26-cpu-server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bundles"
        folder.mkdir()
        fill_s = fill(folder / ".incidents.sqlite", args.incidents, args.hosts)
        print(f"index: {args.incidents} incidents, {args.hosts} hosts in {fill_s:.1f} s", flush=True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLWATCH_")}
        env |= {"NCCLWATCH_API_TOKEN": READ, "NCCLWATCH_UPLOAD_TOKEN": UPLOAD}
        server = subprocess.Popen(
            [sys.executable, "-m", "ncclwatch", "serve", "--bundle-dir", str(folder), "--listen", f"127.0.0.1:{port}"],
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert "http://" in server.stdout.readline()  # type: ignore[union-attr]
        _, upload = bundle_bytes(node_report("big", "gpu0001", "gpu0002", time.time()), padding=50_000_000)
        rows: list[dict] = []
        try:
            result = asyncio.run(measure(f"http://127.0.0.1:{port}", server.pid, args.requests, upload, rows))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(20)
        db_mb = (folder / ".incidents.sqlite").stat().st_size / 1e6
    rss = [kib for _, kib in result["rss_kib"]]
    summary = {
        "date": "2026-11-26",
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "sqlite": __import__("sqlite3").sqlite_version,
        "incidents": args.incidents,
        "hosts": args.hosts,
        "fill_s": round(fill_s, 1),
        "index_mb": round(db_mb, 1),
        "latency": {k: v for k, v in result.items() if k.startswith("/")},
        "upload_50mb": result["upload_50mb"],
        "rss_mib": {
            "first": round(rss[0] / 1024, 1),
            "max": round(max(rss) / 1024, 1),
            "last": round(rss[-1] / 1024, 1),
            "samples": len(rss),
        },  # fmt: skip
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "rows.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["what", "round", "ms"])
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "rss.csv").write_text("t_s,rss_kib\n" + "".join(f"{t},{k}\n" for t, k in result["rss_kib"]))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
