"""GPU figures for issue 14: preflight busbw, a straggler, a slow link; time from the fault to the finding; false reports.

Usage (on the GPU machine, from the repository root)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python bench/slow_links.py OUT_DIR [--backend nccl] [--steps 120]

Writes ``OUT_DIR/results.json`` (one entry per case) and, per case, the
ranks' Flight Recorder dumps and NCCL logs under ``OUT_DIR/<case>/``.
``--backend gloo`` runs the same on CPU (skew only: gloo records no
durations), which is how it was checked off the GPU machine.

Cases, each a 2-rank job; ranks share one GPU when there is only one,
each with its own ``NCCL_HOSTID`` so NCCL connects them via NET/Socket:

- ``preflight``: ``ncclwatch preflight`` sweep (1 MiB..256 MiB) and pairs.
- ``healthy``: 64 MiB all-reduces, every rank on time: any finding is a false report.
- ``straggler``: from step ``fault_step`` rank 1 sleeps 50 ms before each all-reduce.
- ``slowlink``: rank 1's NCCL opens 1 socket with 1 thread (NCCL_SOCKET_NTHREADS=1,
  NCCL_NSOCKS_PERTHREAD=1) where rank 0 opens 4 x 4, and from ``fault_step`` a
  second, hidden all-reduce of 4x the size is folded into the timed one on the
  same group (the link does 5x the work: a collective at ~1/5 of its history);
  ``tc`` is not used (it needs root and would slow every loopback user).

Each rank dumps its Flight Recorder (JSON) every ``dump_every`` steps (``fr_step<N>_rank<R>.json``:
the parser takes the rank from the trailing number); the
analysis replays the dumps in time order through the same pure functions the
sidecar uses (``match_collectives``, ``slow_collectives``, ``last_arrivals``,
``stragglers``) and reports when the first finding appeared after the fault.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ncclwatch.watchdog.engine.bandwidth import match_collectives, slow_collectives
from ncclwatch.watchdog.engine.stragglers import arrival_rounds, last_arrivals, stragglers
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

JOB = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import torch._C._distributed_c10d as c
out, case, backend, steps, fault_step, dump_every = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
rank = int(os.environ["RANK"])
os.environ["NCCL_HOSTID"] = f"bench-node{rank}"
device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(backend)
numel = (64 << 20) // 4 if backend == "nccl" else (1 << 20) // 4
buf = torch.ones(numel, device=device)
extra = torch.ones(4 * numel, device=device)
marks = {}
for step in range(steps):
    if step == fault_step:
        marks["fault_ns"] = time.time_ns()
    faulty = step >= fault_step
    if faulty and case == "straggler" and rank == 1:
        time.sleep(0.05)
    if faulty and case == "slowlink":
        dist.all_reduce(extra)  # same group, same stream: the next timed collective waits behind it
    dist.all_reduce(buf)
    if backend == "nccl":
        torch.cuda.synchronize()
    if step % dump_every == dump_every - 1:
        with open(os.path.join(out, f"fr_step{step:05d}_rank{rank}.json"), "wb") as f:
            f.write(c._dump_fr_trace_json())
        marks.setdefault("dumps", []).append([step, time.time_ns()])
json.dump(marks, open(os.path.join(out, f"marks_{rank}.json"), "w"))
dist.barrier()
dist.destroy_process_group()
"""


def run_case(out: Path, case: str, backend: str, steps: int, fault_step: int, dump_every: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        threads = "1" if (case == "slowlink" and rank == 1) else "4"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCH_FR_BUFFER_SIZE": "4000", "TORCH_NCCL_ENABLE_TIMING": "1", "NCCL_DEBUG": "INFO",
               "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(out / f"nccl.{rank}.log"),
               "NCCL_SOCKET_NTHREADS": threads, "NCCL_NSOCKS_PERTHREAD": threads}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", JOB, str(out), case, backend, str(steps), str(fault_step), str(dump_every)], env=env))
    codes = [p.wait(timeout=580) for p in procs]
    if any(codes):
        return {"case": case, "error": f"exit codes {codes}"}
    return analyze(out, case, fault_step if case != "healthy" else None)


def analyze(out: Path, case: str, fault_step: int | None) -> dict:
    """Replay the dumps round by round; the first round with a finding of the expected kind, and every false one."""
    marks = json.loads((out / "marks_0.json").read_text())
    rounds = sorted({step for step, _ in marks["dumps"]})
    first: dict[str, float | None] = {"slow_collective": None, "straggler": None}
    false_reports = 0  # findings before the fault (or in the healthy case at all), counted per dump round
    found_keys: set[str] = set()
    fault_ns = marks.get("fault_ns") if fault_step is not None else None
    for step, at_ns in marks["dumps"]:
        dumps = []
        for rank in range(2):
            name = f"fr_step{step:05d}_rank{rank}.json"
            dumps += [e for e in parse_flight_recorder((out / name).read_bytes(), name) if hasattr(e, "entries")]
        timings = match_collectives(dumps)
        findings = slow_collectives(timings, now_ns=at_ns) + stragglers(last_arrivals(arrival_rounds(timings), source="arrival"))
        for f in findings:
            found_keys.add(f.key)
            if fault_ns is None or at_ns < fault_ns:
                false_reports += 1
            elif first.get(f.kind.value, 0.0) is None:
                first[f.kind.value] = (at_ns - fault_ns) / 1e9
    last = [out / f"fr_step{rounds[-1]:05d}_rank{rank}.json" for rank in range(2)]
    timings = match_collectives(e for path in last for e in parse_flight_recorder(path.read_bytes(), path.name) if hasattr(e, "entries"))
    busbw = [t.busbw for t in timings if t.busbw]
    return {"case": case, "fault_step": fault_step, "dump_rounds": len(rounds), "seconds_to_first": first, "false_reports": false_reports,
            "finding_keys": sorted(found_keys), "busbw_first_last_GBps": [b / 1e9 for b in busbw[:1] + busbw[-1:]]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dump-every", type=int, default=5)
    parser.add_argument("--cases", default="preflight,healthy,straggler,slowlink")
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        started = time.monotonic()
        if case == "preflight":
            pf = args.out / "preflight.json"
            cmd = [sys.executable, "-m", "ncclwatch", "preflight", f"--backend={args.backend}", "--nproc=2", "--pairs=64M",
                   "--sizes=" + ("1M,4M,16M,64M,256M" if args.backend == "nccl" else "4K,64K,1M"), f"--out={pf}", "--time-limit=500"]  # fmt: skip
            env = {**os.environ, "NCCLWATCH_PREFLIGHT_HOSTID_PER_RANK": "1"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            result = {"case": case, "exit": proc.returncode, "table": proc.stdout, "stderr": proc.stderr[-2000:]}
        else:
            result = run_case(args.out / case, case, args.backend, args.steps, args.steps // 2, args.dump_every)
        result["wall_s"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(json.dumps(result), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
