"""From a fault to training again: ``--on-hang restart`` on a checkpointing job (bench/checkpoint_job.py).

Each run is the real wrapper over real torchrun (``--max-restarts 2``) with a
webhook receiver on loopback counting pages.  Scenarios:

  transient   a rank stops itself (SIGSTOP) once, in the first round: one page, one restart, exit 0
  mismatch    a rank gathers where the others reduce, every round: no restart (the default policy), exit 3
  loop_guard  the same, with --restart-on collective_mismatch: one restart, then "recurs after restart", exit 3

``--nodes N`` runs N wrappers on this machine (c10d rendezvous, ``--nproc`` ranks each, each its own
``NCCL_HOSTID``), the fault on a rank of each node in turn.

For each run, from the job's own event lines, the wrapper's report and the
receiver's clock: fault -> page, fault -> workers ended (the watchdog's part),
fault -> first step of the new round (what the user waits for), and the
resolve.  One JSON line per run to ``--out``; a table on stdout.

    python3 bench/restart.py --out bench/results/x/restart.jsonl --device cuda --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from aiohttp import web

JOB = Path(__file__).resolve().parent / "checkpoint_job.py"
SCENARIOS = ("transient", "mismatch", "loop_guard")


class Pages:
    """A webhook receiver on 127.0.0.1 that notes when each post arrived."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, dict]] = []  # type: ignore[type-arg]
        self.url = ""

    async def __aenter__(self) -> Pages:
        app = web.Application()

        async def hook(request: web.Request) -> web.Response:
            self.posts.append((time.time(), json.loads(await request.read())))
            return web.Response(text="ok")

        app.router.add_post("/hook", hook)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def iso_time(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


async def one_run(scenario: str, run: int, args: argparse.Namespace, folder: Path) -> dict:  # type: ignore[type-arg]
    fault = "sigstop" if scenario == "transient" else "gather"
    world = args.nproc * max(args.nodes, 1)
    fault_rank = (run * max(args.nproc, 1)) % world if args.nodes > 1 else run % args.nproc  # rank 0 first
    fault_step = args.fault_step + 7 * run  # a different step each run
    watch = ["--on-hang", "restart", *(["--restart-on", "collective_mismatch"] if scenario == "loop_guard" else [])]
    events = folder / "events.jsonl"
    job = [
        str(JOB),
        f"--device={args.device}",
        f"--width={args.width}",
        f"--layers={args.layers}",
        f"--steps={args.steps}",
        f"--ckpt-every={args.ckpt_every}",
        f"--ckpt-dir={folder}",
        f"--events={events}",
        f"--fault={fault}",
        f"--fault-rank={fault_rank}",
        f"--fault-step={fault_step}",
        "--step-time=0",
        f"--fault-rounds={1 if scenario == 'transient' else 9}",
    ]
    nodes = max(args.nodes, 1)
    if nodes > 1:
        layout = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{29500 + run}"]
        layout.append(f"--rdzv-id=restart-{scenario}-{run}")
    else:
        layout = ["--standalone"]
    async with Pages() as pages:
        began = time.time()
        wrappers = []
        for node in range(nodes):
            env = dict(os.environ, NCCLWATCH_WEBHOOK_URL=pages.url, PYTHONUNBUFFERED="1")
            if nodes > 1:
                env["NCCL_HOSTID"] = f"node{node}"  # N "hosts" on one machine: NCCL's socket transport between them
            node_args = [f"--node-rank={node}"] if nodes > 1 else []
            wrappers.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "ncclwatch",
                    "--job-name",
                    f"restart-{scenario}",
                    "--bundle-dir",
                    str(folder / f"bundles{node}"),
                    *watch,
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *layout,
                    *node_args,
                    f"--nproc-per-node={args.nproc}",
                    "--max-restarts=2",
                    "--monitor-interval=0.2",
                    *job,
                    env=env,
                    cwd=folder,
                    stderr=(folder / f"wrapper{node}.stderr").open("wb"),  # a file: kept when the run is killed
                )
            )

        async def finish(wrapper: asyncio.subprocess.Process) -> None:
            try:
                await asyncio.wait_for(wrapper.wait(), args.timeout)
            except TimeoutError:
                wrapper.kill()
                await wrapper.wait()

        await asyncio.gather(*(finish(w) for w in wrappers))
        await asyncio.sleep(0.5)
        posts = list(pages.posts)
    for node, wrapper in enumerate(wrappers):
        if wrapper.returncode not in (0, 3):
            print((folder / f"wrapper{node}.stderr").read_text(errors="replace")[-2000:], file=sys.stderr, flush=True)
    exits = [w.returncode for w in wrappers]
    seen = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    faults = [e for e in seen if e["event"] == "fault"]
    first = faults[0]["time"] if faults else None
    new_round = next((e for e in seen if e["event"] == "step" and e["round"] >= 1), None)
    reports = []
    for bundle in sorted(folder.glob("bundles*/*.tar.gz")):
        with tarfile.open(bundle) as tar:
            reports.append(
                json.loads(tar.extractfile(next(n for n in tar.getnames() if n.endswith("/report.json"))).read())
            )  # type: ignore[union-attr]
    restarts = [iso_time(a["at"]) for r in reports for a in r.get("actions", []) if a["kind"] == "restart"]
    triggers = [(t, p) for t, p in posts if p["action"] == "trigger"]
    resolves = [(t, p) for t, p in posts if p["action"] == "resolve"]
    since = lambda t: round(t - first, 2) if t is not None and first is not None else None  # noqa: E731
    return {
        "scenario": scenario,
        "run": run,
        "fault_rank": fault_rank,
        "fault_step": fault_step,
        "nodes": nodes,
        "exit": exits[0] if nodes == 1 else exits,
        "wall_s": round(time.time() - began, 1),
        "rounds": sorted({e["round"] for e in seen if e["event"] == "start"}),
        "pages": len(triggers),
        "verdicts": [p["verdict"] for _, p in triggers],
        "summaries": [p["summary"][:300] for _, p in triggers],
        "resolves": [p["reason"] for _, p in resolves],
        "fault_to_page_s": since(triggers[0][0]) if triggers else None,
        "fault_to_workers_ended_s": since(restarts[0]) if restarts else None,
        "fault_to_training_again_s": since(new_round["time"]) if new_round else None,
        "resumed_at_step": next((e["step"] for e in seen if e["event"] == "start" and e["round"] >= 1), None),
        "fault_to_resolve_s": since(resolves[0][0]) if resolves else None,
        "done": any(e["event"] == "done" for e in seen),
    }


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for scenario in args.scenarios:
        for run in range(args.runs if scenario == "transient" else 1):
            folder = Path(tempfile.mkdtemp(prefix=f"restart-{scenario}-{run}-", dir=args.work))
            row = await one_run(scenario, run, args, folder)
            rows.append(row)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    transient = [r for r in rows if r["scenario"] == "transient" and r["fault_to_training_again_s"] is not None]
    for key in ("fault_to_page_s", "fault_to_workers_ended_s", "fault_to_training_again_s", "fault_to_resolve_s"):
        values = [r[key] for r in transient if r[key] is not None]
        if values:
            print(
                f"{key}: median {statistics.median(values):.1f} s, "
                f"min {min(values):.1f}, max {max(values):.1f} (n={len(values)})"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default=None, help="where each run's folder goes (default: the temp folder)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node")
    parser.add_argument("--nodes", type=int, default=1, help="N > 1: N wrappers on this machine (c10d rendezvous)")
    parser.add_argument("--runs", type=int, default=3, help="runs of the transient scenario")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=35)
    parser.add_argument("--timeout", type=float, default=240)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
