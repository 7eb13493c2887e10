#!/usr/bin/env python3
"""GPU figures for issue 14: the preflight busbw table, and the live performance look on a slow link and a straggler.

Usage (on the GPU machine, from the repository root, with ncclwatch installed)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python bench/slow_links.py OUT_DIR \\
            [--cases preflight,healthy,throttle,slow_link,fewer_sockets,straggler] [--nproc 4]

Cases:

- ``preflight``: ``ncclwatch preflight`` sweep (1 MiB..256 MiB, all_reduce
  and all_gather) and every pair at 64 MiB, two ranks (their own
  ``NCCL_HOSTID`` each when they share a GPU, so NCCL uses sockets; with a
  GPU each, its NVLink or PCIe path).
- The others: ``python -m ncclwatch --perf-interval P torchrun ...
  bench/pairs_job.py`` (the real wrapper, its performance look every ``P``
  s), ranks on a ring of pair groups (see ``pairs_job.py``).  Every
  ``performance: KIND: ...`` line the wrapper logs is stamped as it arrives.

  - ``healthy``: every finding is a false report.
  - ``throttle`` (every link slow): ``--fault-after`` s after the first
    step the loopback interface is throttled to ``--throttle-rate`` (a token
    bucket set through netlink with pyroute2, root only: the ranks of one
    machine talk through ``lo``).  Every group slows alike: any
    ``slow_collective`` finding is right.
  - ``slow_link`` (one rank's link slow, as a faulty cable): the fault rank
    listens on ``lo`` (127.0.0.1), the others on the machine's interface;
    ``--fault-after`` s after the first step, only packets to 127.0.0.1 are
    held to ``--throttle-rate``.  The two groups through the fault rank slow
    down, the others do not: a ``slow_link`` finding naming that rank is
    right.
  - ``fewer_sockets``: the fault rank's NCCL opens 1 socket per connection
    where the others open 16, from the first step: a ``transport_anomaly``
    naming that rank is right (its link is slower only where sockets bound
    the transfer; on one shared GPU they did not).
  - ``straggler``: from ``--fault-after`` s the fault rank waits 40 % of its
    step before the next one: a ``straggler`` finding naming it is right.

  Apart from ``throttle``, a right finding names the fault rank and no
  other, and a finding that does not name it is false.  Latency: from the fault's start (the first step for
  ``fewer_sockets``) to the first right line; the look's interval bounds it
  from below.

Writes ``OUT_DIR/results.jsonl`` (one line per case), ``OUT_DIR/results.md``
(the table) and each case's wrapper output ``<case>.log`` in ``OUT_DIR/logs.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from fault_suite import PERF_LINE  # the wrapper's performance lines, as the fault suite reads them

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "bench" / "pairs_job.py"
EXPECTED = {
    "healthy": None,
    "throttle": "slow_collective",
    "slow_link": "slow_link",
    "fewer_sockets": "transport_anomaly",
    "straggler": "straggler",
}
JOB_FAULT = {"healthy": "none", "throttle": "none"}  # cases whose fault is made outside the job (or partly: slow_link)
ETH_P_IP = 0x0800  # a tc filter's protocol is an ethertype (not socket.AF_INET, as pyroute2's own example has it)
THROTTLED = {"throttle": None, "slow_link": "127.0.0.1"}  # case -> the address throttled (None: all of lo)


class LoopbackThrottle:
    """A rate limit on the loopback interface, set through netlink (the lent machines have no ``tc``): ranks
    of one machine reach each other's addresses through ``lo``.  Root only; removed on exit whatever happened.

    ``only_to=None``: a token bucket on everything (``tc qdisc add dev lo root tbf``), every link slow.
    ``only_to=ADDRESS``: an HTB class at ``rate`` for packets to that address (a u32 filter on the IPv4
    destination) and nothing else: HTB sends unclassified packets straight through, unshaped.
    """

    def __init__(self, rate: str, only_to: str | None = None) -> None:
        from pyroute2 import IPRoute  # carried in .whl/ for the lent machine; only these cases need it

        self.ip = IPRoute()
        self.index = self.ip.link_lookup(ifname="lo")[0]
        self.rate, self.only_to = rate, only_to
        self.root: tuple[str, dict] | None = None

    def start(self) -> None:
        if self.only_to is None:
            self.root = ("tbf", {"rate": self.rate, "burst": 1 << 20, "latency": "100ms"})
            self.ip.tc("add", "tbf", self.index, 0x10000, **self.root[1])
            return
        self.root = ("htb", {"default": 0})  # no default class: unclassified packets are not shaped
        self.ip.tc("add", "htb", self.index, 0x10000, **self.root[1])
        # lo's packets are up to 64 KiB: mtu and burst sized for them.
        self.ip.tc(
            "add-class",
            "htb",
            self.index,
            0x10001,
            parent=0x10000,
            rate=self.rate,
            ceil=self.rate,
            burst=1 << 20,
            cburst=1 << 20,
            mtu=65536,
        )
        destination = int.from_bytes(socket.inet_aton(self.only_to), "big")
        self.ip.tc("add-filter", "u32", self.index, parent=0x10000, prio=1, protocol=ETH_P_IP,
                   target=0x10001, keys=[f"0x{destination:08x}/0xffffffff+16"])  # fmt: skip  # IPv4 destination

    def stop(self) -> None:
        if self.root is not None:
            kind, spec = self.root
            self.ip.tc("del", kind, self.index, 0x10000, **spec)  # pyroute2 wants the kind's arguments back
            self.root = None
        self.ip.close()


def run_preflight(out: Path, nproc: int) -> dict:
    result = out / "preflight.json"
    command = [
        sys.executable,
        "-m",
        "ncclwatch",
        "preflight",
        "--backend=nccl",
        f"--nproc={nproc}",
        "--pairs=64M",
        "--sizes=1M,4M,16M,64M,256M",
        f"--out={result}",
        "--time-limit=150",
    ]
    import torch

    # Ranks sharing a GPU must pose as hosts of their own (NET/Socket); one GPU each, NCCL takes NVLink or PCIe.
    shared = nproc > torch.cuda.device_count()
    env = {**os.environ, **({"NCCLWATCH_PREFLIGHT_HOSTID_PER_RANK": "1"} if shared else {})}
    began = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    (out / "preflight.txt").write_text(proc.stdout + proc.stderr)
    return {
        "case": "preflight",
        "exit": proc.returncode,
        "wall_s": round(time.monotonic() - began, 1),
        "table": proc.stdout,
    }


def run_live(out: Path, case: str, args: argparse.Namespace) -> dict:
    """One wrapped run of the pairs job; its performance lines with their arrival times."""
    fault_rank = args.fault_rank % args.nproc
    with tempfile.TemporaryDirectory(prefix=f"slow-{case}-") as folder:
        work = Path(folder)
        (work / "marks").mkdir()
        command = [
            sys.executable,
            "-m",
            "ncclwatch",
            "-v",
            f"--perf-interval={args.perf_interval}",
            "--bundle-dir",
            str(work / "bundles"),
            "--run-dir",
            str(work / "run"),
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            str(JOB),
            f"--fault={JOB_FAULT.get(case, case)}",
            f"--fault-rank={fault_rank}",
            f"--seconds={args.seconds}",
            f"--fault-after={args.fault_after}",
            f"--mark-dir={work / 'marks'}",
            *args.job_arg,
        ]
        lines: list[tuple[float, str, str]] = []
        began = time.time()
        proc = subprocess.Popen(
            command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        log = (out / f"{case}.log").open("wb")

        def read() -> None:
            for raw in proc.stdout:  # type: ignore[union-attr]
                log.write(raw)
                if found := PERF_LINE.match(raw.decode(errors="replace").rstrip("\n")):
                    lines.append((time.time(), found.group(1), found.group(2)))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        throttle = LoopbackThrottle(args.throttle_rate, THROTTLED[case]) if case in THROTTLED else None
        throttled_at = None
        try:
            if throttle is not None:
                throttled_at = throttle_after_first_step(
                    throttle, work / "marks" / "first_step", args.fault_after, proc
                )
            code = proc.wait(timeout=args.seconds + 150)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        finally:
            if throttle is not None:
                throttle.stop()
        reader.join(10)
        log.close()
        marks = {p.name: json.loads(p.read_text()) for p in (work / "marks").iterdir() if not p.name.endswith(".tmp")}
    first_step = marks.get("first_step", {}).get("time")
    if case in THROTTLED:
        fault = throttled_at
    else:
        fault = marks.get(f"fault.{fault_rank}", {}).get("time") if case == "straggler" else first_step
    expected = EXPECTED[case]
    # A throttled loopback slows every group alike: any slow collective is right, anything else is false.
    # Otherwise the right finding names the fault rank and no other, and a false one does not name it.
    named = [(at, kind, text, ranks_named(text)) for at, kind, text in lines]
    if case == "throttle":
        right = [(at, kind, text) for at, kind, text, _ in named if kind == expected]
    else:
        right = [(at, kind, text) for at, kind, text, ranks in named if kind == expected and ranks == {fault_rank}]
    false = [
        (kind, text)
        for at, kind, text, ranks in named
        if (kind != expected if case == "throttle" else expected is None or fault_rank not in ranks)
    ]
    record = {
        "case": case,
        "exit": code,
        "wall_s": round(time.time() - began, 1),
        "nproc": args.nproc,
        "fault_rank": fault_rank if expected else None,
        "perf_interval_s": args.perf_interval,
        "steps": marks.get("steps", {}).get("steps"),
        "train_s": marks.get("steps", {}).get("seconds"),
        "findings": [
            {"s_after_fault": round(at - fault, 1) if fault else None, "kind": k, "summary": t} for at, k, t in lines
        ],
        "right": bool(right) if expected else not lines,
        "first_right_s": round(right[0][0] - fault, 1) if right and fault else None,
        "false_reports": len(false),
    }
    return record


def ranks_named(summary: str) -> set[int]:
    """The ranks a finding names: ``rank 3 (vm)``, ``ranks 2, 3 (vm)``, ``on rank 3 (vm)``."""
    return {int(r) for listed in re.findall(r"\branks? ((?:\d+, )*\d+)", summary) for r in listed.split(", ")}


def throttle_after_first_step(
    throttle: LoopbackThrottle, first_step: Path, after_s: float, proc: subprocess.Popen
) -> float | None:
    """Throttle ``after_s`` seconds after the job's first step; when it was done (None: the job ended first)."""
    while not first_step.exists():
        if proc.poll() is not None:
            return None
        time.sleep(0.2)
    time.sleep(after_s)
    if proc.poll() is not None:
        return None
    throttle.start()
    return time.time()


def table(records: list[dict]) -> str:
    rows = [
        "| case | ranks | look every (s) | exit | steps | expected | right | "
        "fault -> first right finding (s) | other findings "
        "| first finding |",
        "|" + " --- |" * 10,
    ]
    for r in records:
        if r["case"] == "preflight":
            continue
        first = r["findings"][0] if r["findings"] else None
        first_right = r["first_right_s"] if r["first_right_s"] is not None else "-"
        first_text = first["kind"] + ": " + first["summary"] if first else "-"
        rows.append(
            f"| {r['case']} | {r['nproc']} | {r['perf_interval_s']:g} | {r['exit']} | {r['steps']} | "
            f"{EXPECTED[r['case']] or 'nothing'} | {r['right']} | {first_right} | "
            f"{r['false_reports']} | {first_text} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default="preflight,healthy,throttle,slow_link,fewer_sockets,straggler")
    parser.add_argument("--nproc", type=int, default=4, help="ranks of the live cases (they may share one GPU)")
    parser.add_argument("--fault-rank", type=int, default=-1, help="-1: the last rank")
    parser.add_argument("--perf-interval", type=float, default=10.0, help="the wrapper's --perf-interval")
    parser.add_argument("--seconds", type=float, default=45.0, help="training time of a live case")
    parser.add_argument(
        "--fault-after", type=float, default=10.0, help="straggler, throttle, slow_link: seconds after the first step"
    )
    parser.add_argument(
        "--throttle-rate", default="1gbit", help="throttle, slow_link: the rate once throttled (tc syntax)"
    )
    parser.add_argument("--preflight-nproc", type=int, default=2)
    parser.add_argument("--job-arg", action="append", default=[], help="one more pairs_job.py option (repeatable)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for case in args.cases.split(","):
        record = (
            run_preflight(args.out, args.preflight_nproc) if case == "preflight" else run_live(args.out, case, args)
        )
        records.append(record)
        print(json.dumps(record), flush=True)
        with (args.out / "results.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    (args.out / "results.md").write_text(table(records) + "\n")
    # One archive, not a file per case: the lent machine returns a limited number of files.
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as logs:
        for log in sorted(args.out.glob("*.log")):
            logs.add(log, arcname=log.name)
            log.unlink()
    print(table(records))
    return 0 if all(r.get("right", r.get("exit") == 0) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
