#!/usr/bin/env python3
"""Detection latency and accuracy of the live watchdog on real faults.

Runs ``ncclwatch --on-hang kill ... torchrun launcher/demo_job.py --fault F``
once per scenario and repeat, and measures from the moment the faulty rank
misbehaved (its ``fault.<rank>`` mark) to the verdict (``detected_at`` in
report.json) and to the finished bundle (the file's mtime).  Healthy
scenarios (none, uneven, pause) must end with exit 0 and no bundle; ``exit``
must keep torchrun's exit code and leave no bundle.

    python3 bench/latency.py --nproc 3 --repeat 3                   # CPU, gloo
    python3 bench/latency.py --nproc 4 --repeat 3 \\
        --scenarios skip,python_stuck,sigstop,spin_kernel,exit,none,pause,uneven

Prints a Markdown table (for BENCHMARKS.md) and writes every run as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "launcher" / "demo_job.py"
HANG = {
    "skip": "collective_mismatch",
    "extra": "collective_mismatch",
    "python_stuck": "rank_behind",
    "sigstop": "process_stopped",
    "spin_kernel": "gpu_compute_hang",
}
HEALTHY = ("none", "uneven", "pause")


def run_once(scenario: str, args: argparse.Namespace, work: Path) -> dict:
    bundles, run_dir = work / "bundles", work / "run"
    command = [
        sys.executable,
        "-m",
        "ncclwatch",
        "--on-hang",
        "kill",
        "--bundle-dir",
        str(bundles),
        "--run-dir",
        str(run_dir),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--monitor-interval=0.2",
        str(DEMO),
        f"--fault={scenario}",
        f"--fault-step={args.fault_step}",
        f"--step-time={args.step_time}",
        f"--steps={args.steps}",
        f"--pause-s={args.pause_s}",
    ]
    began = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=work)
        returncode, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = (
            None,
            (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""),
        )
    result: dict = {"scenario": scenario, "returncode": returncode, "wall_s": round(time.time() - began, 2)}
    marks = [json.loads(p.read_text()) for p in run_dir.glob("fault.*")]
    fault_at = min((m["time"] for m in marks), default=None)
    bundle = next(iter(sorted(bundles.glob("*.tar.gz"))), None)
    if bundle is not None:
        report = _report(bundle)
        detected = dt.datetime.fromisoformat(report["detected_at"]).timestamp()
        result.update(
            verdict=report["verdict"],
            culprits=report["culprit_ranks"],
            stall_timeout_s=report.get("stall_timeout_s"),
            to_report_s=round(detected - fault_at, 2) if fault_at else None,
            to_bundle_s=round(bundle.stat().st_mtime - fault_at, 2) if fault_at else None,
            bundle_s=round(bundle.stat().st_mtime - detected, 2),
        )
    result["correct"] = _correct(scenario, result, args.nproc)
    if not result["correct"]:
        result["stderr_tail"] = stderr[-2000:]
    return result


def _report(bundle: Path) -> dict:
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
        return json.load(tar.extractfile(member))  # type: ignore[arg-type]


def _correct(scenario: str, result: dict, nproc: int) -> bool:
    if scenario in HANG:
        expected = HANG[scenario]
        return result.get("verdict") == expected and result.get("culprits") == [nproc - 1] and result["returncode"] == 3
    if scenario == "exit":
        return "verdict" not in result and result["returncode"] not in (0, 3, None)
    return "verdict" not in result and result["returncode"] == 0


def summarize(results: list[dict]) -> str:
    lines = [
        "| scenario | runs | correct | verdict | report p50 / p90 (s) | bundle p50 / p90 (s) | stall timeout (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        runs = [r for r in results if r["scenario"] == scenario]
        verdicts = ", ".join(sorted({r.get("verdict", f"none (rc {r['returncode']})") for r in runs}))
        lines.append(
            f"| {scenario} | {len(runs)} | {sum(r['correct'] for r in runs)} | {verdicts} | "
            f"{_p(runs, 'to_report_s')} | {_p(runs, 'to_bundle_s')} | {_p(runs, 'stall_timeout_s')} |"
        )
    return "\n".join(lines)


def _p(runs: list[dict], key: str) -> str:
    values = sorted(r[key] for r in runs if r.get(key) is not None)
    if not values:
        return "-"
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return f"{statistics.median(values):.1f} / {p90:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="skip,python_stuck,sigstop,exit,none,pause,uneven")
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pause-s", type=float, default=20.0, help="the pause scenario: longer than the stall timeout")
    parser.add_argument("--timeout", type=float, default=180.0, help="per run, seconds")
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting runs after this many seconds")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "latency.jsonl"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    began = time.monotonic()
    for repeat in range(args.repeat):
        for scenario in args.scenarios.split(","):
            if time.monotonic() - began > args.budget:
                break
            with tempfile.TemporaryDirectory(prefix=f"lat-{scenario}-") as work:
                result = run_once(scenario, args, Path(work))
            result["repeat"] = repeat
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "stderr_tail"}), file=sys.stderr, flush=True)
            with out.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
    print(summarize(results))
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
