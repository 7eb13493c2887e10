"""Issue 23's hard cases on real NCCL: FSDP2 even splits and pipeline point-to-point across nodes.

Each scenario runs the real wrapper (one per "node"; on a single GPU each
node's ranks get their own ``NCCL_HOSTID``) over real torchrun, with a
webhook receiver on loopback counting pages, and reads every node's bundle.
Reported per scenario: the pages (verdict, culprits), each node's bundle
verdict, the culprit's call site, the fault -> page latency, and every
"performance:" line the wrappers printed (a healthy run must have none).

    python3 bench/hard_cases.py --out bench/results/x/hard.jsonl [--only fsdp|pipeline]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from restart import Pages

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Scenario:
    name: str
    script: str
    nodes: int
    per_node: int
    job: list[str]
    expect: tuple[str, tuple[int, ...]] | None  # (verdict, culprits); None: no page
    watch: list[str] = field(default_factory=list)
    findings: tuple[str, ...] = ()  # with no page: the performance findings it must log, each "kind: rank N"; no others


FSDP = [
    Scenario(
        "fsdp2_skip_rank1",
        "fsdp_job.py",
        1,
        2,
        ["--steps=400", "--skip-rank=1", "--skip-step=40"],
        ("collective_mismatch", (1,)),
    ),
    Scenario(
        "fsdp2_skip_rank0",
        "fsdp_job.py",
        1,
        2,
        ["--steps=400", "--skip-rank=0", "--skip-step=55"],
        ("collective_mismatch", (0,)),
    ),
    Scenario(
        "fsdp2_skip_rank1_clip_accum",
        "fsdp_job.py",
        1,
        2,
        ["--steps=400", "--skip-rank=1", "--skip-step=70", "--clip-grad", "--grad-accum=2"],
        ("collective_mismatch", (1,)),
    ),
    Scenario(
        "fsdp2_skip_rank1_late",
        "fsdp_job.py",
        1,
        2,
        ["--steps=400", "--skip-rank=1", "--skip-step=90"],
        ("collective_mismatch", (1,)),
    ),
    Scenario(
        "fsdp2_skip_two_nodes",
        "fsdp_job.py",
        2,
        1,
        ["--steps=400", "--skip-rank=1", "--skip-step=40"],
        ("collective_mismatch", (1,)),
    ),
    Scenario("fsdp2_healthy", "fsdp_job.py", 1, 2, ["--steps=2000"], None, ["--perf-interval=10"]),
    # Four ranks on one node: three against one, and the culprit's line.
    Scenario(
        "fsdp2_4ranks_skip_rank2",
        "fsdp_job.py",
        1,
        4,
        ["--steps=400", "--skip-rank=2", "--skip-step=45"],
        ("collective_mismatch", (2,)),
    ),
    Scenario(
        "fsdp2_4ranks_skip_rank0",
        "fsdp_job.py",
        1,
        4,
        ["--steps=400", "--skip-rank=0", "--skip-step=60"],
        ("collective_mismatch", (0,)),
    ),
    # A GPU 80 ms late every step: one straggler finding, no page, nothing slow beside it.
    Scenario(
        "fsdp2_straggler_rank1",
        "fsdp_job.py",
        1,
        2,
        ["--steps=600", "--slow-rank=1", "--slow-ms=80"],
        None,
        ["--perf-interval=10"],
        ("straggler: rank 1",),
    ),
]
# Faults late enough that the job has shown its rhythm (on the H100 a step takes ~16 ms: a hang at step 60
# came 1 s into training, under the 300 s warm-up timeout).
PIPELINE = [
    Scenario(
        "pipeline_both_recv",
        "pipeline_job.py",
        2,
        1,
        ["--steps=100000", "--fault=both_recv", "--fault-step=1500"],
        ("p2p_deadlock", (0, 1)),
    ),
    Scenario(
        "pipeline_missing_send",
        "pipeline_job.py",
        2,
        1,
        ["--steps=100000", "--fault=missing_send", "--fault-rank=1", "--fault-step=1500"],
        ("rank_behind", (1,)),
    ),
    Scenario(
        "pipeline_healthy", "pipeline_job.py", 2, 1, ["--steps=3000", "--step-time=0.01"], None, ["--perf-interval=10"]
    ),
]


def made_folder(path: str) -> Path:
    """``--work``: the folder every run's own folder goes under, made if missing."""
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def bundle_reports(folder: Path) -> list[dict]:  # type: ignore[type-arg]
    found = []
    for bundle in sorted(folder.glob("*.tar.gz")):
        with tarfile.open(bundle) as tar:
            found.append(
                json.loads(tar.extractfile(next(n for n in tar.getnames() if n.endswith("/report.json"))).read())
            )  # type: ignore[union-attr]
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a wrapper and everything under it: torchrun's workers run in sessions of their own and outlive a kill
    of the wrapper alone."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def fault_time(folders: list[Path]) -> float | None:
    times = [json.loads(p.read_text())["time"] for f in folders for p in f.glob("fault.*")]
    return min(times) if times else None


def gpu_slice(node: int, per_node: int) -> list[str]:
    """The GPUs of wrapper ``node``: its share of those this process sees, in order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range((node + 1) * per_node)]
    return names[node * per_node : (node + 1) * per_node]


async def run(scenario: Scenario, work: Path, timeout_s: float, device: str, gpus: int = 1) -> dict:  # type: ignore[type-arg]
    """One scenario's wrappers to the end; ``gpus``: the machine's, to tell who names the NCCL hosts."""
    port = random.randint(29600, 29900)
    runs = [work / f"run{n}" for n in range(scenario.nodes)]
    async with Pages() as pages:
        wrappers = []
        for n in range(scenario.nodes):
            env = dict(os.environ, NCCLWATCH_WEBHOOK_URL=pages.url, PYTHONUNBUFFERED="1")
            if scenario.nodes > 1 and scenario.per_node <= gpus:
                # One "host" per wrapper on one machine.  With more ranks per wrapper than GPUs, ranks.py gives
                # each rank its own instead: NCCL refuses two ranks of one host on one GPU.
                env["NCCL_HOSTID"] = f"node{n}"
            if scenario.nodes > 1 and scenario.nodes * scenario.per_node <= gpus:
                # Enough GPUs for a rank each: each wrapper its own, as on separate hosts.  NVML then reads each
                # rank's GPU alone, which a GPU hang's signature needs.
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_slice(n, scenario.per_node))
            launch = (
                ["--standalone"]
                if scenario.nodes == 1
                else [
                    f"--nnodes={scenario.nodes}",
                    f"--node-rank={n}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                ]
            )
            wrappers.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "ncclwatch",
                    "--job-name",
                    scenario.name,
                    "--on-hang",
                    "kill",
                    *scenario.watch,
                    "--bundle-dir",
                    str(work / f"bundles{n}"),
                    "--run-dir",
                    str(runs[n]),
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *launch,
                    f"--nproc-per-node={scenario.per_node}",
                    "--monitor-interval=0.2",
                    str(BENCH / scenario.script),
                    f"--device={device}",
                    f"--mark-dir={runs[n]}",
                    *scenario.job,
                    env=env,
                    cwd=work,
                    stderr=asyncio.subprocess.PIPE,
                )
            )
        # Read stderr beside the wait: a wrapper killed at the deadline keeps what it said (communicate() under
        # wait_for drops it).
        reading = [asyncio.create_task(w.stderr.read()) for w in wrappers]  # type: ignore[union-attr]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.wait() for w in wrappers)), timeout_s)
        late = [w.returncode is None for w in wrappers]
        for w, running in zip(wrappers, late, strict=True):
            if running:
                kill_tree(w.pid)  # all at once: a wrapper still running might page for another's end
        await asyncio.gather(*(w.wait() for w in wrappers))
        ends = [
            await r + (b"\nbench: timed out\n" if running else b"") for r, running in zip(reading, late, strict=True)
        ]
        await asyncio.sleep(0.5)
        posts = list(pages.posts)
    stderr = [e.decode(errors="replace") for e in ends]
    for n, text in enumerate(stderr):
        (work / f"node{n}.stderr").write_text(text)
    triggers = [(t, p) for t, p in posts if p["action"] == "trigger"]
    fault = fault_time(runs)
    nodes = []
    for n in range(scenario.nodes):
        reports = bundle_reports(work / f"bundles{n}")
        report = reports[0] if reports else None
        rows = {r["rank"]: r for r in report["ranks"]} if report else {}
        culprit = rows.get(report["culprit_ranks"][0]) if report and report["culprit_ranks"] else None
        nodes.append(
            {
                "exit": wrappers[n].returncode,
                "bundles": len(reports),
                "verdict": report["verdict"] if report else None,
                "culprits": report["culprit_ranks"] if report else None,
                "call_site": culprit.get("call_site") if culprit else None,
                "stack": culprit.get("stack") if culprit else None,
                "headline": report.get("headline") if report else None,
                "performance": [line for line in stderr[n].splitlines() if "performance:" in line],
            }
        )
    got = (triggers[0][1]["verdict"], tuple(triggers[0][1]["culprit_ranks"])) if triggers else None
    # A node whose job failed before the page (a rank of it died and its torchrun ended it, exit 1) writes no
    # bundle; every node that wrote one must say the same.
    judged = [x for x in nodes if x["bundles"] or x["exit"] != 1]
    agree = len({(x["verdict"], tuple(x["culprits"] or ())) for x in judged}) == 1
    if scenario.expect is None:
        logged = sorted(line.split("performance: ", 1)[1] for x in nodes for line in x["performance"])
        wanted = sorted(scenario.findings)
        right = (
            not triggers
            and all(x["bundles"] == 0 and x["exit"] == 0 for x in nodes)
            and len(logged) == len(wanted)
            and all(line.startswith(prefix) for line, prefix in zip(logged, wanted))
        )
    else:
        right = len(triggers) == 1 and got == scenario.expect and agree
    return {
        "scenario": scenario.name,
        "expect": scenario.expect,
        "right": right,
        "pages": len(triggers),
        "paged": got,
        "fault_to_page_s": round(triggers[0][0] - fault, 2) if triggers and fault else None,
        "nodes_agree": agree,
        "nodes": nodes,
    }


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = (FSDP if args.only in ("all", "fsdp") else []) + (PIPELINE if args.only in ("all", "pipeline") else [])
    if args.names:
        chosen = [s for s in chosen if s.name in args.names]
    for scenario in chosen * args.repeat:
        began = time.time()
        row = await run(
            scenario, Path(tempfile.mkdtemp(prefix=f"{scenario.name}-", dir=args.work)), args.timeout, args.device
        )
        row["wall_s"] = round(time.time() - began, 1)
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        brief = {k: row[k] for k in ("scenario", "right", "pages", "paged", "fault_to_page_s", "nodes_agree", "wall_s")}
        print(json.dumps(brief), flush=True)
        for n, node in enumerate(row["nodes"]):
            print(
                f"  node {n}: exit {node['exit']} {node['verdict']} {node['culprits']} call site {node['call_site']!r} "
                f"perf {node['performance'][:2]}",
                flush=True,
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=("all", "fsdp", "pipeline"), default="all")
    parser.add_argument("--names", nargs="*", help="only these scenarios")
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen scenarios this many times, in turn")
    parser.add_argument("--work", type=made_folder, default=None)
    parser.add_argument("--timeout", type=float, default=150)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, to try the bench itself")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
