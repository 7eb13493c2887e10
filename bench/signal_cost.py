#!/usr/bin/env python3
"""What each signal ncclwatch injects costs per operation, measured alone and all together (issue 45).

One job per configuration (``bench/signal_cost_job.py``, ``--nproc`` ranks
each), all started at once and all kept alive; then, round after round, each
job in turn times one block while the others wait idle on their stdin. So the
configurations are interleaved in time (A B C ... A B C ...), every block runs
in steady state (no start-up in any figure), and a round's ratios are against
the same round's baseline. The first ``--warmup-rounds`` rounds are dropped
(Flight Recorder's ring fills, the NCCL debug file's page cache warms).

Configurations are subsets of the environment the wrapper really builds
(``ncclwatch.launcher.env.injected_env``), over a baseline with every signal
off:

  none             Flight Recorder off (``TORCH_FR_BUFFER_SIZE=0``), nothing else of ours
  coll_lines       NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS (INIT,COLL,DESTROY,ENV), NCCL_DEBUG_FILE: one line per operation
  timing           TORCH_NCCL_ENABLE_TIMING=1: CUDA start/end events per collective
  flight_recorder  TORCH_FR_BUFFER_SIZE=2000 (torch 2.11's own default), the dump file and pipe, dump on timeout
  heartbeat        the injected sitecustomize (PYTHONPATH, NCCLWATCH_RUN_DIR): optimizer-step hook, FIFO responder
  all              the wrapper's whole environment (every signal above)
  all_no_timing    the same with TORCH_NCCL_ENABLE_TIMING=0 (the user's value wins)
  inspector        NVIDIA's NCCL Inspector profiler plugin alone (``--inspector-so``), JSON output, every size

Several ranks on one GPU each take their own ``NCCL_HOSTID`` (bench/ranks.py);
NCCL then joins them over its socket transport.

    python3 bench/signal_cost.py --device cpu --workload allreduce --rounds 2 --ops 200 --sync-ops 50  # CPU check
    python3 bench/signal_cost.py --workload allreduce --rounds 8 --out $OUT/signal_cost.jsonl
    python3 bench/signal_cost.py --workload fsdp2_tp --nproc 4 --rounds 6 --out $OUT/signal_cost.jsonl

Appends one row per (round, configuration, item) to ``--out`` and a summary
row per (configuration, item); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ncclwatch.launcher.env import injected_env
from ncclwatch.watchdog.live.runfolder import RunDirs

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "bench" / "signal_cost_job.py"
PROTOCOL = "SIGNALCOST"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIGNALS = {
    "coll_lines": ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"),
    "timing": ("TORCH_NCCL_ENABLE_TIMING",),
    "flight_recorder": (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    ),
    "heartbeat": ("PYTHONPATH", "NCCLWATCH_RUN_DIR"),
}
DEFAULT_CONFIGS = ("none", *SIGNALS, "all", "all_no_timing")
JOB_OPTIONS = ("sizes", "ops", "sync_ops", "steps", "blocks", "width", "batch", "seq", "vocab")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("allreduce", "fsdp2_tp"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job (fsdp2_tp: an even 4 or more)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated; 'none' is added")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds (pairs against 'none')")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds: start no round after this")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--inspector-so", help="libnccl-profiler-inspector.so: adds the 'inspector' configuration")
    parser.add_argument(
        "--inspector-env", action="append", default=[], metavar="NAME=VALUE", help="more Inspector settings"
    )
    parser.add_argument("--exit-timeout", type=float, default=60.0, help="seconds a rank has to exit, then killed")
    parser.add_argument("--work", help="keep every job's run folder and logs here (default: a temporary folder)")
    parser.add_argument("--out", default="bench/out/signal_cost.jsonl")
    parser.add_argument("--label", default="", help="the machine, written into every row")
    job = parser.add_argument_group("job", "passed to bench/signal_cost_job.py")
    job.add_argument("--sizes", default="1024,32768")
    job.add_argument("--ops", type=int, default=3000)
    job.add_argument("--sync-ops", type=int, default=1000)
    job.add_argument("--steps", type=int, default=20)
    job.add_argument("--blocks", type=int, default=4)
    job.add_argument("--width", type=int, default=256)
    job.add_argument("--batch", type=int, default=8)
    job.add_argument("--seq", type=int, default=128)
    job.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args(argv)
    configs = [name for name in args.configs.split(",") if name and name != "none"]
    if args.inspector_so and "inspector" not in configs:
        configs.append("inspector")
    args.configs = ["none", *configs]
    return args


def config_env(config: str, folder: Path, args: argparse.Namespace) -> dict[str, str]:
    """The environment of one configuration's job; its run folder is ``folder/run``."""
    plain = {name: value for name, value in os.environ.items() if not name.startswith(("TORCH_FR_", "NCCL_DEBUG"))}
    plain.update(SAFE_ENV)
    plain["PYTHONUNBUFFERED"] = "1"
    baseline = {**plain, "TORCH_FR_BUFFER_SIZE": "0"}
    full = injected_env(plain, RunDirs.create(folder / "run"))
    if config == "none":
        return baseline
    if config == "all":
        return full
    if config == "all_no_timing":
        return {**full, "TORCH_NCCL_ENABLE_TIMING": "0"}
    if config == "inspector":
        if not args.inspector_so:
            raise SystemExit("the inspector configuration needs --inspector-so")
        (folder / "inspector").mkdir(exist_ok=True)
        inspector = {
            "NCCL_PROFILER_PLUGIN": str(Path(args.inspector_so).resolve()),
            "NCCL_INSPECTOR_ENABLE": "1",
            "NCCL_INSPECTOR_DUMP_DIR": str(folder / "inspector"),
            "NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": "1000000",
            "NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES": "0",  # every operation, as a watchdog needs
        }
        inspector.update(dict(item.split("=", 1) for item in args.inspector_env))
        return {**baseline, **inspector}
    if config not in SIGNALS:
        raise SystemExit(f"unknown configuration {config!r}: none, {', '.join(SIGNALS)}, all, all_no_timing, inspector")
    return {**baseline, **{name: full[name] for name in SIGNALS[config]}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Job:
    """One configuration's ranks, started together; their protocol lines arrive on one queue."""

    def __init__(self, config: str, folder: Path, args: argparse.Namespace) -> None:
        self.config, self.folder = config, folder
        self.lines: queue.Queue[dict] = queue.Queue()
        env = config_env(config, folder, args)
        port = free_port()
        options = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in JOB_OPTIONS]
        command = [sys.executable, str(JOB), f"--workload={args.workload}", f"--device={args.device}", *options]
        self.ranks = []
        for rank in range(args.nproc):
            rank_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(args.nproc),
                "LOCAL_WORLD_SIZE": str(args.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            with (folder / f"rank{rank}.log").open("wb") as log:
                process = subprocess.Popen(
                    command, env=rank_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
                )
            threading.Thread(target=self._read, args=(process,), daemon=True).start()
            self.ranks.append(process)

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            if line.startswith(PROTOCOL + " "):
                self.lines.put(json.loads(line[len(PROTOCOL) + 1 :]))

    def collect(self, timeout: float) -> list[dict]:
        """One protocol message from every rank."""
        deadline, got = time.monotonic() + timeout, []
        while len(got) < len(self.ranks):
            try:
                got.append(self.lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.returncode for p in self.ranks if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.config}: {len(got)} of {len(self.ranks)} answered, exits {dead}"
                    ) from None
        return got

    def tell(self, command: str) -> None:
        for process in self.ranks:
            process.stdin.write(command + "\n")
            process.stdin.flush()

    def block(self, timeout: float) -> dict[str, float]:
        """Times of one block: per item, the slowest rank's (the job is as fast as its slowest rank)."""
        self.tell("RUN")
        answers = self.collect(timeout)
        return {item: max(answer["times"][item] for answer in answers) for item in answers[0]["times"]}

    def finish(self, timeout: float) -> None:
        try:
            self.tell("EXIT")
        except OSError:
            pass
        for process in self.ranks:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()

    def log_tail(self, lines: int = 15) -> str:
        text = (self.folder / "rank0.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def disk_bytes(self) -> int:
        """What this job wrote to its run folder (NCCL lines, heartbeats, Inspector files)."""
        kept = [self.folder / "run", self.folder / "inspector"]
        return sum(path.stat().st_size for root in kept for path in root.rglob("*") if path.is_file())


def units(workload: str, args: argparse.Namespace, item: str) -> tuple[int, str]:
    """Operations (or steps) in one block of ``item``, and the unit of its per-operation time."""
    if workload == "fsdp2_tp":
        return args.steps, "ms/step"
    return (args.sync_ops if item.endswith("_sync") else args.ops), "us/op"


def summarise(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per configuration and item: the per-round ratios to the same round's 'none', median and spread."""
    by = {(row["round"], row["config"], row["item"]): row["seconds"] for row in rows}
    items = sorted({row["item"] for row in rows})
    rounds = sorted({row["round"] for row in rows})
    summary = []
    for config in args.configs:
        for item in items:
            pairs = [(by[r, config, item], by[r, "none", item]) for r in rounds if (r, config, item) in by]
            if not pairs:
                continue
            count, unit = units(args.workload, args, item)
            scale = 1e3 if unit == "ms/step" else 1e6
            ratios = [mine / base for mine, base in pairs]
            summary.append(
                {
                    "kind": "summary",
                    "workload": args.workload,
                    "label": args.label,
                    "config": config,
                    "item": item,
                    "pairs": len(pairs),
                    "unit": unit,
                    "per_op_median": statistics.median(mine for mine, _ in pairs) / count * scale,
                    "baseline_per_op_median": statistics.median(base for _, base in pairs) / count * scale,
                    "cost_pct_median": (statistics.median(ratios) - 1) * 100,
                    "cost_pct_min": (min(ratios) - 1) * 100,
                    "cost_pct_max": (max(ratios) - 1) * 100,
                }
            )
    return summary


def table(summary: list[dict]) -> str:
    lines = [
        "| workload | item | configuration | pairs | per op (median) | baseline | cost, median | cost, min .. max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary:
        if row["config"] == "none":
            continue
        lines.append(
            f"| {row['workload']} | {row['item']} | {row['config']} | {row['pairs']} | "
            f"{row['per_op_median']:.2f} {row['unit']} | {row['baseline_per_op_median']:.2f} | "
            f"{row['cost_pct_median']:+.1f} % | {row['cost_pct_min']:+.1f} .. {row['cost_pct_max']:+.1f} % |"
        )
    return "\n".join(lines)


def measure(jobs: dict[str, Job], args: argparse.Namespace, started: float, out) -> list[dict]:
    """The rounds: each job one block in turn, the order rotated every round so no configuration is always first."""
    rows, names = [], list(jobs)
    block_timeout = 120.0
    for index in range(args.warmup_rounds + args.rounds):
        if time.monotonic() - started > args.budget:
            print(f"[signal_cost] budget spent: stopping after {index} rounds", flush=True)
            break
        order = names[index % len(names) :] + names[: index % len(names)]
        for config in order:
            times = jobs[config].block(block_timeout)
            for item, seconds in times.items():
                row = {
                    "kind": "block",
                    "workload": args.workload,
                    "label": args.label,
                    "round": index - args.warmup_rounds,
                    "config": config,
                    "item": item,
                    "seconds": seconds,
                }
                if index >= args.warmup_rounds:
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
        out.flush()
        print(
            f"[signal_cost] round {index - args.warmup_rounds} done at {time.monotonic() - started:.0f} s", flush=True
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="signal-cost-"))
    jobs: dict[str, Job] = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        try:
            for config in args.configs:
                folder = work / f"{args.workload}-{config}"
                folder.mkdir(parents=True, exist_ok=True)
                jobs[config] = Job(config, folder, args)
            for config, job in jobs.items():
                ready = job.collect(args.start_timeout)
                info = {"kind": "ready", "workload": args.workload, "label": args.label, "config": config}
                out.write(json.dumps({**info, **ready[0]["ready"], "at_s": time.monotonic() - started}) + "\n")
            print(f"[signal_cost] {len(jobs)} jobs ready at {time.monotonic() - started:.0f} s", flush=True)
            rows = measure(jobs, args, started, out)
        except RuntimeError as error:
            print(f"[signal_cost] {error}", flush=True)
            for job in jobs.values():
                print(f"--- {job.config} rank0.log\n{job.log_tail()}", flush=True)
            rows = []
        finally:
            for job in jobs.values():
                job.finish(args.exit_timeout)
        for config, job in jobs.items():
            disk = {"kind": "disk", "workload": args.workload, "label": args.label, "config": config}
            out.write(json.dumps({**disk, "run_folder_bytes": job.disk_bytes()}) + "\n")
        summary = summarise(rows, args)
        for row in summary:
            out.write(json.dumps(row) + "\n")
    print(table(summary), flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if summary else 1


if __name__ == "__main__":
    sys.exit(main())
