#!/usr/bin/env python3
"""What ``ncclwatch torchrun`` costs a real training job, and which part of it costs what.

Every measurement is the steady-state steps/s that ``bench/gpu_job.py``
(``--fault none``) times itself (warm-up steps excluded, a device
synchronize at both ends), never the command's wall time, so start-up and
shutdown do not dilute it; they are reported apart.

``--mode ab``: plain torchrun (A) and ``python -m ncclwatch torchrun`` (B),
interleaved A B A B ..., ``--pairs`` pairs per size.  Per size: the median
of the per-pair ratios B/A and their min-max spread; start-up (launch to
the job's first finished step) of each.

``--mode ablation``: plain torchrun with one piece of what the wrapper
injects at a time, then cumulatively, each round running the baseline and
every configuration once (``--rounds`` rounds); ratios are against the same
round's baseline.  The pieces are subsets of the environment the wrapper
builds (``ncclwatch.launcher.env.injected_env``), so they stay what the
wrapper really sets:

  nccl_debug      NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS (INIT,COLL,DESTROY), NCCL_DEBUG_FILE per process
  timing          TORCH_NCCL_ENABLE_TIMING=1
  fr_off, fr_20000  TORCH_FR_BUFFER_SIZE=0 / 20000 (torch 2.11's default is on, 2000)
  sitecustomize   PYTHONPATH to the injected sitecustomize + NCCLWATCH_RUN_DIR: heartbeat hook, responder thread
  debug_timing    nccl_debug + timing                   (cumulative)
  injected_env    the wrapper's whole environment       (cumulative: everything but the sidecar)
  wrapper         python -m ncclwatch torchrun          (cumulative: all of it)
  wrapper_no_timing  the wrapper, the user having set TORCH_NCCL_ENABLE_TIMING=0 (their value wins)
  wrapper_lean    the wrapper with TORCH_NCCL_ENABLE_TIMING=0 and NCCL_DEBUG=WARN (no per-operation lines)
  wrapper_perf_off, wrapper_perf5  the wrapper with its performance look off / every 5 s (default: 60 s)

``--ab A,B`` compares any two configurations the same way (default
``baseline,wrapper``); ``--ab wrapper_perf_off,wrapper_perf5`` is what the
performance look costs.

``--mode fr_dump``: one-time cost of Flight Recorder: the job under plain
torchrun with the wrapper's environment; once every rank's heartbeat passed
the warm-up, each rank is asked for a dump through its FIFO (as the sidecar
primes it) twice, and the seconds until the dump file is written are
recorded (torch symbolises C++ stacks on the first one).

    python3 bench/overhead_ab.py --device cpu --nproc 2 --pairs 1 --steps 100     # CPU dry run
    python3 bench/overhead_ab.py --mode ab --sizes short,long --pairs 5 --budget 500
    python3 bench/overhead_ab.py --mode ablation --rounds 3 --budget 500
    python3 bench/overhead_ab.py --mode fr_dump

Writes ``<out-dir>/overhead-<mode>.jsonl`` (one line per run) and ``overhead-<mode>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ncclwatch.launcher.env import injected_env
from ncclwatch.watchdog.live.runfolder import RunDirs
from ncclwatch.watchdog.probes.flight_recorder import fr_files, signature, trigger

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "bench" / "gpu_job.py"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
INJECTED_SUBSETS = {
    "nccl_debug": ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"),
    "timing": ("TORCH_NCCL_ENABLE_TIMING",),
    "sitecustomize": ("PYTHONPATH", "NCCLWATCH_RUN_DIR"),
    "debug_timing": ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "TORCH_NCCL_ENABLE_TIMING"),
}
FIXED = {"fr_off": {"TORCH_FR_BUFFER_SIZE": "0"}, "fr_20000": {"TORCH_FR_BUFFER_SIZE": "20000"}}
# The wrapper under a user environment that turns one of its signals off (the user's value wins).
WRAPPED = {
    "wrapper": {},
    "wrapper_no_timing": {"TORCH_NCCL_ENABLE_TIMING": "0"},
    "wrapper_lean": {"TORCH_NCCL_ENABLE_TIMING": "0", "NCCL_DEBUG": "WARN"},
    # The performance look (issue 14): off, and 12 times as often as its default of once a minute.
    "wrapper_perf_off": {"NCCLWATCH_PERF_INTERVAL": "0"},
    "wrapper_perf5": {"NCCLWATCH_PERF_INTERVAL": "5"},
}
CONFIGS = (*INJECTED_SUBSETS, *FIXED, "injected_env", *WRAPPED)


def config_env(config: str, work: Path) -> dict[str, str]:
    """The environment of one configuration (``baseline``: the plain one)."""
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    if config == "baseline":
        return env
    if config in WRAPPED:
        return {**env, **WRAPPED[config]}
    if config in FIXED:
        return {**env, **FIXED[config]}
    full = injected_env(env, RunDirs.create(work / "run"))
    if config == "injected_env":
        return full
    return {**env, **{name: full[name] for name in INJECTED_SUBSETS[config]}}


def command(config: str, args: argparse.Namespace, size: str, work: Path, steps: int | None = None) -> list[str]:
    long = size == "long"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(JOB),
        f"--device={args.device}",
        f"--size={size}",
        "--fault=none",
        f"--result={work / 'result.json'}",
        f"--steps={steps or (args.long_steps if long else args.steps)}",
        f"--warmup-steps={10 if long else args.warmup_steps}",
    ]
    if config in WRAPPED:
        return [sys.executable, "-m", "ncclwatch", "--bundle-dir", str(work / "bundles"), *torchrun]
    return torchrun


def run_job(config: str, args: argparse.Namespace, size: str) -> dict:
    """One whole run in a fresh folder: steps/s from the job; start-up, wall time and launcher CPU from here.

    ``launcher_cpu_s`` is the CPU time of the process we start, not of its
    children: torchrun's agent for A, the wrapper (its sidecar included) for
    B.  It is sampled every 0.5 s, so the last half second is missing.
    """
    with tempfile.TemporaryDirectory(prefix=f"overhead-{config}-") as folder:
        work = Path(folder)
        output = work / "output.log"
        launched = time.time()
        with output.open("wb") as sink:
            process = subprocess.Popen(
                command(config, args, size, work), env=config_env(config, work), cwd=work, stdout=sink, stderr=sink
            )
        launcher, cpu_s = psutil.Process(process.pid), 0.0
        while process.poll() is None and time.time() - launched < args.timeout:
            try:
                times = launcher.cpu_times()
                cpu_s = times.user + times.system
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)
        if process.poll() is None:
            for proc in [launcher, *launcher.children(recursive=True)]:
                proc.kill()
        returncode = process.wait()
        wall_s = time.time() - launched
        record = {
            "config": config,
            "size": size,
            "returncode": returncode,
            "wall_s": round(wall_s, 2),
            "launcher_cpu_s": round(cpu_s, 2),
            "launcher_cpu_pct": round(100 * cpu_s / wall_s, 1),
        }
        result_file = work / "result.json"
        if result_file.exists():
            result = json.loads(result_file.read_text())
            record.update(
                steps_per_s=result["steps_per_s"],
                to_job_start_s=round(result["started_at"] - launched, 2),  # the wrapper's and torchrun's own start
                to_first_step_s=round(result["first_step_at"] - launched, 2),
                after_end_s=round(time.time() - result["ended_at"], 2),  # teardown until the command returned
                device=result["device"],
                world=result["world"],
                params=result["params"],
                steps=result["steps_measured"],
            )
        else:
            record["error_tail"] = output.read_bytes()[-3000:].decode(errors="replace")
    return record


def ratio_stats(ratios: list[float]) -> str:
    if not ratios:
        return "- | -"
    return f"{statistics.median(ratios):.3f} | {min(ratios):.3f} - {max(ratios):.3f}"


def median(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def summarize_ab(records: list[dict]) -> str:
    first = next((pair for size in dict.fromkeys(r["size"] for r in records) for pair in pairs_of(records, size)), None)
    a, b = (first[0]["config"], first[1]["config"]) if first else ("A", "B")
    a, b = ("torchrun" if a == "baseline" else a), ("ncclwatch" if b == "wrapper" else b)
    lines = [
        f"| size | pairs | {a} steps/s (median) | {b} steps/s (median) | ratio B/A median | ratio min - max "
        f"| launch to first step, {a} / {b} (s) | launch to job start, {a} / {b} (s) "
        f"| launcher CPU, {a} / {b} (% of a core) |",
        "|" + " --- |" * 9,
    ]
    for size in dict.fromkeys(r["size"] for r in records):
        pairs = [(a, b) for a, b in pairs_of(records, size) if a.get("steps_per_s") and b.get("steps_per_s")]
        a_runs, b_runs = [a for a, _ in pairs], [b for _, b in pairs]
        lines.append(
            f"| {size} | {len(pairs)} | {median([a['steps_per_s'] for a in a_runs])} | "
            f"{median([b['steps_per_s'] for b in b_runs])} | "
            f"{ratio_stats([b['steps_per_s'] / a['steps_per_s'] for a, b in pairs])} | "
            f"{median([a['to_first_step_s'] for a in a_runs])} / {median([b['to_first_step_s'] for b in b_runs])} | "
            f"{median([a['to_job_start_s'] for a in a_runs])} / {median([b['to_job_start_s'] for b in b_runs])} | "
            f"{median([a['launcher_cpu_pct'] for a in a_runs])} / {median([b['launcher_cpu_pct'] for b in b_runs])} |"
        )
    return "\n".join(lines)


def pairs_of(records: list[dict], size: str) -> list[tuple[dict, dict]]:
    """(A, B) of each pair of this size, in the order each pair ran them."""
    by_pair: dict[int, list[dict]] = {}
    for record in records:
        if record["size"] == size:
            by_pair.setdefault(record["pair"], []).append(record)
    return [(runs[0], runs[1]) for runs in by_pair.values() if len(runs) == 2]


def summarize_ablation(records: list[dict]) -> str:
    lines = [
        "| configuration | runs | steps/s (median) | ratio to the round's baseline, median | min - max |",
        "|" + " --- |" * 5,
    ]
    baselines = {(r["size"], r["pair"]): r.get("steps_per_s") for r in records if r["config"] == "baseline"}
    for config in dict.fromkeys(r["config"] for r in records):
        runs = [r for r in records if r["config"] == config and r.get("steps_per_s")]
        paired = [(r["steps_per_s"], baselines.get((r["size"], r["pair"]))) for r in runs]
        ratios = [steps / baseline for steps, baseline in paired if baseline]
        lines.append(f"| {config} | {len(runs)} | {median([r['steps_per_s'] for r in runs])} | {ratio_stats(ratios)} |")
    return "\n".join(lines)


def measure_fr_dump(args: argparse.Namespace) -> list[dict]:
    """Ask every rank for two dumps once it is past warm-up; seconds until each dump was written."""
    with tempfile.TemporaryDirectory(prefix="overhead-frdump-") as folder:
        work = Path(folder)
        env = config_env("injected_env", work)
        fr_dir, hb_dir = work / "run" / "fr", work / "run" / "hb"
        job = subprocess.Popen(
            command("injected_env", args, "short" if args.device == "cuda" else "tiny", work, steps=1_000_000),
            env=env,
            cwd=work,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        records = []
        try:
            workers = wait_for_steps(hb_dir, args.nproc, args.warmup_steps, deadline=time.time() + args.timeout)
            for rank, pid in sorted(workers.items()):
                pipe, dump = fr_files(fr_dir, rank, pid)
                record = {"rank": rank, "pipe": pipe.name}
                for attempt in ("first_dump_s", "second_dump_s"):
                    before, asked = signature(dump), time.monotonic()
                    error = trigger(pipe)
                    record[attempt] = None if error else wait_for_dump(dump, before, asked + 30)
                    record["error"] = error
                records.append(record)
        finally:
            workers = psutil.Process(job.pid).children(recursive=True)
            job.terminate()  # torchrun forwards it to the workers
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
            for worker in psutil.wait_procs(workers, timeout=10)[1]:
                worker.kill()
    return records


def wait_for_steps(hb_dir: Path, nproc: int, step: int, deadline: float) -> dict[int, int]:
    """{rank: pid} once every rank's heartbeat (written by the injected sitecustomize) passed ``step``."""
    while time.time() < deadline:
        beats = []
        for path in hb_dir.glob("*.json"):
            try:
                beats.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
        if len(beats) >= nproc and all(b["step"] >= step for b in beats):
            return {b["rank"]: b["pid"] for b in beats}
        time.sleep(0.2)
    raise SystemExit(f"the job did not pass step {step} on {nproc} ranks in time (heartbeats: {hb_dir})")


def wait_for_dump(dump: Path, before: tuple | None, deadline: float) -> float | None:
    """Seconds from the request until the dump changed and held still for 0.1 s."""
    asked, last = time.monotonic(), before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = signature(dump)
        if now is not None and now != before and now == last:
            return round(time.monotonic() - asked - 0.05, 2)
        last = now
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("ab", "ablation", "fr_dump"), default="ab")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", help="gpu_job sizes (default: short,long on cuda, tiny on cpu; ablation: the first)")
    parser.add_argument("--pairs", type=int, default=5, help="ab: A B pairs per size")
    parser.add_argument("--ab", default="baseline,wrapper", help="ab: the two configurations compared, A,B")
    parser.add_argument("--rounds", type=int, default=3, help="ablation: rounds of baseline + every configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"ablation: any of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=300, help="steps of a short/tiny run")
    parser.add_argument("--long-steps", type=int, default=60, help="steps of a long run (10 warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")
    parser.add_argument("--budget", type=float, default=500.0, help="start no run after this many seconds")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    args = parser.parse_args()
    sizes = (args.sizes or ("short,long" if args.device == "cuda" else "tiny")).split(",")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, began = out / f"overhead-{args.mode}.jsonl", time.monotonic()

    def keep(record: dict) -> None:
        print(json.dumps({k: v for k, v in record.items() if k != "error_tail"}), file=sys.stderr, flush=True)
        with jsonl.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    if args.mode == "fr_dump":
        records = measure_fr_dump(args)
        for record in records:
            keep(record)
        cells = [(r["rank"], r["pipe"], r["first_dump_s"], r["second_dump_s"], r["error"] or "") for r in records]
        rows = ["| " + " | ".join(map(str, row)) + " |" for row in cells]
        table = "\n".join(["| rank | pipe | first dump (s) | second dump (s) | error |", "|" + " --- |" * 5, *rows])
    else:
        if args.mode == "ab":
            ab = tuple(args.ab.split(","))
            # Pairs of every size alternate, so a budget cut leaves each size the same number of pairs.
            plan = [(size, n, config) for n in range(args.pairs) for size in sizes for config in ab]
        else:
            configs = ("baseline", *args.configs.split(","))
            plan = [(sizes[0], n, config) for n in range(args.rounds) for config in configs]
        records, last_s = [], 0.0
        for size, n, config in plan:
            if time.monotonic() - began + 1.5 * last_s > args.budget:
                print(f"budget reached: not starting {config} #{n} ({size})", file=sys.stderr)
                break
            record = {**run_job(config, args, size), "pair": n}
            last_s = max(last_s, record["wall_s"])
            records.append(record)
            keep(record)
        table = summarize_ab(records) if args.mode == "ab" else summarize_ablation(records)
    (out / f"overhead-{args.mode}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
