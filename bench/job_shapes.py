"""Issue 30's job shapes: ncclwatch around small real jobs of each shape PyTorch's libraries build, with faults.

Each scenario runs bench/shapes_job.py (DDP, FSDP2, TP, three pipelining schedules, FSDP2 x TP on a 2-D mesh,
pipeline x data parallel, a compiled model) under the real wrapper, one per "node", through bench/hard_cases.py's
``run`` (a loopback webhook counting pages, every node's bundle read, fault -> page from the job's fault mark).
Per shape: ``stuck`` on the last rank and on rank 0, ``skip``, ``dead``, ``gpu_hang`` (CUDA only) and a healthy run
with a checkpoint pause; then issue 30's special cases: TP's set-up scatter (a fault soon after it must not be read
as a mismatch there), FSDP2 x TP with rank 3 stuck or skipping, and pipeline x data parallel across two wrappers
where ranks 1 and 2 both ``recv`` first (``p2p_deadlock [1, 2]``).

Expected verdicts, from the README's verdict table: ``stuck`` -> ``rank_behind [R]`` (its peers wait in
communication, it is in its own code); ``dead`` -> ``process_dead [R]``; ``gpu_hang`` -> ``gpu_compute_hang [R]``;
``skip`` depends on what the rank issues next.  Where that is a collective on the logging all_reduce's own
communicator (ddp, fsdp2, tp and compiled: DDP, FSDP2 and a 1-D mesh of all ranks use the default group), it stands
at the position of its peers' all_reduce: ``collective_mismatch [R]``, "ranks issued different operations at the same
position", as in the README's own skipped all_reduce ("rank 1 skipped AllReduce ... it is already at AllGather ...
the next step's").  Where it is not (the pipelines: a point-to-point recv or send, numbered apart from collectives;
fsdp2_tp: a collective on the "tp" or "dp" group), nothing stands at that position on that communicator and the
rank "never entered the collective the others wait in": ``rank_behind [R]``.  The verdict the page names is what
is judged; ``rank_behind`` for a skip still names the right rank.
A pause outside collectives: no page.  As in bench/fault_suite.py, a crash is torchrun's
to end: a ``dead`` rank on one node (torchrun sees its worker exit and ends the others at once), and on gloo a
``skip`` whose next collective meets one of another size (gloo checks sizes and raises).  There "crash" (no page,
no bundle, every wrapper torchrun's exit 1) is right too, and the row says so.

One JSON row per run to ``--out``; a table per shape and fault at the end (right / runs, median fault -> page).
A "false page" is a page in a scenario that must not page.

    python3 bench/job_shapes.py --device cpu --only ddp --out /tmp/shapes.jsonl
    python3 bench/job_shapes.py --device cuda --nodes 2 --out $OUT/shapes.jsonl      # every shape on 2 wrappers
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hard_cases import Scenario, made_folder, run  # bench/: the script's folder is on sys.path
from shapes_job import FAULTS, SHAPES, TWO_D

# The step of each fault and of the healthy run's pause: well past the 8 steps the stall timeout is learned from,
# with whole steps of history before it.  These jobs take 10-100 ms a step on a 2-core CPU, 20-120 ms on one H200
# shared by their ranks, where faults at steps 12-60 (1-2 s into training) went unpaged for 80 s and faults at 300
# and 600 were paged in 11-13 s.
FAULT_STEP = {"cpu": 60, "cuda": 600}
PAUSE_S, STEPS_AFTER_PAUSE = 20, 100  # a healthy run's checkpoint pause, well past the stall timeout's 5 s floor
# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on shared GPU machines a job using it can put the GPUs out of
# service; set here too in case the machine's environment lacks them.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
EXPECT = {"stuck": "rank_behind", "skip": "collective_mismatch", "dead": "process_dead", "gpu_hang": "gpu_compute_hang"}
# A skip whose next operation is on another sequence than the logging all_reduce's (see above).
SKIP_BEHIND = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_dp", "fsdp2_tp")


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    fault: str  # shapes_job.py's --fault; "none": healthy, with a pause
    rank: int
    where: str
    nodes: int
    per_node: int
    expect: tuple[str, tuple[int, ...]] | None  # (verdict, culprits); None: no page
    tag: str = ""  # names a special case
    pinned: bool = False  # its layout is the point: --nodes leaves it
    early: bool = False  # at half the fault step

    @property
    def name(self) -> str:
        what = "pause" if self.fault == "none" else f"{self.fault}_r{self.rank}_{self.where}"
        return f"{self.shape}_{what}" + (f"_{self.tag}" if self.tag else "")

    @property
    def gpu_only(self) -> bool:
        return self.fault == "gpu_hang"

    def step(self, fault_step: int) -> int:
        """Of the fault, or of the pause."""
        return fault_step // 2 if self.early else fault_step

    def job(self, fault_step: int) -> list[str]:
        shape, step = f"--shape={self.shape}", self.step(fault_step)
        if self.fault == "none":
            return [shape, f"--steps={step + STEPS_AFTER_PAUSE}", f"--pause-at={step}", f"--pause-s={PAUSE_S}"]
        return [
            shape,
            "--steps=1000000",
            f"--fault={self.fault}",
            f"--fault-rank={self.rank}",
            f"--fault-step={step}",
            f"--fault-where={self.where}",
        ]


def shape_cases(shape: str) -> list[Case]:
    world = 4 if shape in TWO_D else 2
    # pp_dp is pipeline x data parallel across two nodes by construction; the others on one node unless --nodes.
    nodes = 2 if shape == "pp_dp" else 1
    layout = (nodes, world // nodes)
    last = world - 1

    def case(fault: str, rank: int, where: str) -> Case:
        verdict = "rank_behind" if fault == "skip" and shape in SKIP_BEHIND else EXPECT[fault]
        return Case(shape, fault, rank, where, *layout, (verdict, (rank,)))

    return [
        case("stuck", last, "mid"),
        case("stuck", 0, "before"),
        case("skip", last, "after"),
        case("dead", last, "after"),
        case("gpu_hang", last, "before"),
        Case(shape, "none", -1, "after", *layout, None),
    ]


SPECIAL = [
    # TP's set-up scatters each up weight from the mesh's first rank, which records 65536 elements where the other
    # records 0; a hang while the scatter is still in Flight Recorder's buffer (2000 entries; TP issues 5 a step)
    # must not be read as a mismatch there.
    Case("tp", "stuck", 1, "mid", 1, 2, ("rank_behind", (1,)), tag="setup_scatter", early=True),
    Case("tp", "skip", 1, "after", 1, 2, ("collective_mismatch", (1,)), tag="setup_scatter", early=True),
    # Pipeline x data parallel on 2 wrappers: ranks 1 and 2 (one per node, one pipeline) both recv first while
    # their data-parallel peers, 0 and 3, wait in the gradient all_reduce.
    Case("pp_dp", "recv_first", 1, "before", 2, 2, ("p2p_deadlock", (1, 2)), pinned=True),
]
# FSDP2 x TP with rank 3 stuck or skipping (issue 30) are shape_cases("fsdp2_tp")'s own: its last rank is 3.
CASES = [c for shape in SHAPES for c in shape_cases(shape)] + SPECIAL


def laid_out(case: Case, nodes: int) -> Case:
    """The case as ``nodes`` wrappers (0: as the table has it)."""
    if not nodes or case.pinned:
        return case
    world = case.nodes * case.per_node
    if world % nodes:
        raise SystemExit(f"{case.name}: {world} ranks do not split over {nodes} wrappers")
    return dataclasses.replace(case, nodes=nodes, per_node=world // nodes)


def visible_gpus(device: str) -> int:
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def outcome(got: dict) -> str:  # type: ignore[type-arg]
    """What the run came to: the page, a crash torchrun ended, a clean end, or neither."""
    if got["paged"]:
        return f"{got['paged'][0]} {list(got['paged'][1])}"
    exits = [n["exit"] for n in got["nodes"]]
    if all(code == 1 and n["bundles"] == 0 for code, n in zip(exits, got["nodes"], strict=True)):
        return "crash"
    return "no page" if all(code == 0 for code in exits) else f"no page, exits {exits}"


def judged(case: Case, got: dict, device: str) -> bool:  # type: ignore[type-arg]
    crash_is_right = case.fault == "dead" or (case.fault == "skip" and device == "cpu")
    return got["right"] or (crash_is_right and outcome(got) == "crash")


def result_row(case: Case, got: dict, device: str, index: int, fault_step: int) -> dict:  # type: ignore[type-arg]
    """hard_cases.run's row with what this suite reports beside it."""
    return {
        "scenario": case.name,
        "shape": case.shape,
        "fault": case.fault,
        "fault_rank": case.rank,
        "fault_step": case.step(fault_step),
        "where": case.where,
        "layout": f"{case.nodes}x{case.per_node}",
        "device": device,
        "run": index,
        "expect": case.expect,
        "pages": got["pages"],
        "paged": got["paged"],
        "bundle_verdicts": [(n["verdict"], n["culprits"]) for n in got["nodes"]],
        "fault_to_page_s": got["fault_to_page_s"],
        "false_page": case.expect is None and got["pages"] > 0,
        "outcome": outcome(got),
        "right": judged(case, got, device),
        "nodes_agree": got["nodes_agree"],
        "nodes": got["nodes"],
    }


def summary(rows: list[dict]) -> str:  # type: ignore[type-arg]
    groups: dict[tuple[str, str], list[dict]] = {}  # type: ignore[type-arg]
    for row in rows:
        groups.setdefault((row["shape"], "pause" if row["fault"] == "none" else row["fault"]), []).append(row)
    lines = ["| shape | fault | right | median fault -> page (s) | false pages | got |", "|---" * 6 + "|"]
    order = ("stuck", "skip", "dead", "gpu_hang", "recv_first", "pause")
    for (shape, fault), group in sorted(groups.items(), key=lambda g: (SHAPES.index(g[0][0]), order.index(g[0][1]))):
        latencies = [r["fault_to_page_s"] for r in group if r["fault_to_page_s"] is not None]
        median = f"{statistics.median(latencies):.1f}" if latencies else "-"
        got = sorted({r["outcome"] for r in group})
        right = sum(r["right"] for r in group)
        false_pages = sum(r["false_page"] for r in group)
        lines.append(f"| {shape} | {fault} | {right}/{len(group)} | {median} | {false_pages} | {'; '.join(got)} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runnable = [c for c in CASES if args.device == "cuda" or not c.gpu_only]
    terms = args.only.split(",")

    def picked(case: Case) -> bool:
        return any(case.shape == term if term in SHAPES else term in case.name for term in terms)

    faults = set(args.faults.split(",")) if args.faults else None
    chosen = [laid_out(c, args.nodes) for c in runnable if picked(c) and (faults is None or c.fault in faults)]
    if not chosen:
        raise SystemExit(f"no {args.device} scenario matches {args.only!r}")
    if args.device == "cuda":
        os.environ.update(NO_MULTICAST)  # hard_cases.run passes this environment on to the wrappers
    gpus = visible_gpus(args.device)
    fault_step = args.fault_step or FAULT_STEP[args.device]
    rows = []
    # Several scenarios at once share the GPU (and the host's cores): fault-to-page latencies then include that
    # contention.  GPU signatures (NVML) would see the other jobs' kernels too, so gpu_hang scenarios run after
    # the others, one at a time.
    slots = asyncio.Semaphore(args.parallel)
    deadline = time.monotonic() + args.budget

    async def one(case: Case, index: int) -> None:
        async with slots:
            await judge(case, index)

    async def judge(case: Case, index: int) -> None:
        if time.monotonic() > deadline:
            print(json.dumps({"scenario": case.name, "run": index, "skipped": "past --budget"}), flush=True)
            return
        job = case.job(fault_step)
        scenario = Scenario(case.name, "shapes_job.py", case.nodes, case.per_node, job, case.expect, args.watch)
        began = time.time()
        work = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=args.work))
        got = await run(scenario, work, args.timeout, args.device, gpus)
        row = result_row(case, got, args.device, index, fault_step)
        # The engine under test is the working tree's: when each run began says which version judged it.
        row["started_at"] = dt.datetime.fromtimestamp(began).astimezone().isoformat(timespec="seconds")
        row["wall_s"] = round(time.time() - began, 1)
        row["parallel"] = args.parallel
        row["work"] = str(work)  # the run's folders: wrappers' logs, bundles
        rows.append(row)
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        brief = {k: row[k] for k in ("scenario", "layout", "right", "outcome", "fault_to_page_s", "wall_s")}
        print(json.dumps(brief), flush=True)
        for n, node in enumerate(row["nodes"]):
            print(
                f"  node {n}: exit {node['exit']} {node['verdict']} {node['culprits']}: {node['headline']}", flush=True
            )

    runs = [(case, index) for index in range(args.repeat) for case in chosen]
    await asyncio.gather(*(one(case, index) for case, index in runs if case.fault != "gpu_hang"))
    for case, index in runs:
        if case.fault == "gpu_hang":
            await judge(case, index)
    print(summary(rows), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON lines, one per run (appended); needed to run scenarios")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo (no gpu_hang scenarios)")
    parser.add_argument(
        "--only",
        default="",
        help="a shape's scenarios (tp: not fsdp2_tp's), or those whose name holds this (_skip_); comma-separated",
    )
    parser.add_argument(
        "--faults", default="", help=f"only these faults, comma-separated: {', '.join(FAULTS)} (none: the pause)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen scenarios this many times, in turn")
    parser.add_argument(
        "--budget", type=float, default=float("inf"), help="start no run this many seconds after the suite began"
    )
    parser.add_argument("--nodes", type=int, default=0, help="run every scenario as N wrappers (0: the table's layout)")
    parser.add_argument(
        "--fault-step", type=int, default=0, help="step of each fault and pause (0: 60 on cpu, 600 on cuda)"
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="scenarios run at once (gpu_hang ones after, alone); latencies then share the host",
    )
    parser.add_argument(
        "--watch", action="append", default=[], metavar="ARG", help="an option for every wrapper, e.g. --watch=-v"
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds one run may take before it is killed")
    parser.add_argument(
        "--work", type=made_folder, default=None, help="where each run's folder goes (default: the temp folder)"
    )
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", help="print the table of these rows and exit")
    args = parser.parse_args()
    if args.summarize:
        print(summary([json.loads(line) for name in args.summarize for line in Path(name).read_text().splitlines()]))
        return 0
    if args.list:
        for case in CASES:
            when = "half the fault step" if case.early else "the fault step"
            print(f"{case.name:40} {case.nodes}x{case.per_node} at {when}, expect {case.expect}")
        return 0
    if not args.out:
        parser.error("--out is required to run scenarios")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
