"""No secret reaches a bundle: real workers with credentials in their environment, on their command line
and in their logs, every collector run, every file written read back as bytes (issue 31)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from support import context, wait_state

from ncclwatch.watchdog.evidence import collect_all

WITHHELD = "<withheld: not needed for diagnosis>"  # spelled out: the test must run (and fail) without redact.py

# The four of the issue, and one on the command line; fakes in the real formats, built up so that
# no scanner takes this file for a leak.
DB_PASSWORD = "Tr0ub4dor-and-3"
SLACK_HOOK = "https://hooks.slack.com/services/" + "T0AAAAAAA/B0BBBBBBB/" + "q" * 24
GH_PAT = "ghp_" + "x7Kd9QmT2vLp" * 3
CLOUD_KEY_ID = "AKIA" + "Z3XAMPLEK3Y1D0K7"
CLI_PASSWORD = "cli-pass-5ecret"
SECRET_ENV = {
    "DATABASE_URL": f"postgres://admin:{DB_PASSWORD}@db/x",
    "SLACK_WEBHOOK": SLACK_HOOK,
    "GH_PAT": GH_PAT,
    "MY_CLOUD_CRED": CLOUD_KEY_ID,
}
SECRETS = [DB_PASSWORD, SLACK_HOOK, SLACK_HOOK.rsplit("/", 1)[1], GH_PAT, CLOUD_KEY_ID, CLI_PASSWORD]
NCCL_ENV = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"}

# A training script that logs its command line and its config, as many do, then waits in a "collective".
WORKER = """
import os, sys, time
with open(sys.argv[1], "w") as log:
    print("argv:", " ".join(sys.argv), file=log)
    print("connecting to", os.environ["DATABASE_URL"], file=log)
    print("alerts to", os.environ["SLACK_WEBHOOK"], file=log)
    print("GH_PAT=" + os.environ["GH_PAT"], file=log)
    print("cloud key id:", os.environ["MY_CLOUD_CRED"], file=log)
    print("NCCL_SOCKET_IFNAME=" + os.environ["NCCL_SOCKET_IFNAME"], file=log)
print("ready", flush=True)
time.sleep(600)
"""
NCCL_LOG = (
    "host:{pid}:{pid} [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to lo\n"
    "host:{pid}:{pid} [0] NCCL INFO comm 0x55d4c0a0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0 "
    "commId 0xa1b2c3d4e5f60718 - Init COMPLETE\n"
    "host:{pid}:{pid} [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f3a2b1c4d5e recvbuff 0x7f3a2b1c4d5e count 8 "
    "datatype 7 op 0 root 0 comm 0x55d4c0a0 [nranks=2] stream 0x55d4c1b0\n"
)


def _workers(tmp_path: Path, n: int) -> list[subprocess.Popen]:
    env = {**os.environ, **SECRET_ENV, **NCCL_ENV}
    procs = []
    for rank in range(n):
        log = tmp_path / "logs" / f"rank{rank}.log"
        log.parent.mkdir(exist_ok=True)
        argv = [sys.executable, "-c", WORKER, str(log), "--password", CLI_PASSWORD, "--lr", "3e-4"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, env=env))
    for proc in procs:
        assert proc.stdout.readline() == b"ready\n"
        assert wait_state(proc.pid, "S") == "S"
    return procs


def test_no_secret_in_any_file_the_collectors_write(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "nccl").mkdir(parents=True)
    procs = _workers(tmp_path, 2)
    try:
        for proc in procs:
            (run_dir / "nccl" / f"host.{proc.pid}").write_text(NCCL_LOG.format(pid=proc.pid))
        logs = {rank: [tmp_path / "logs" / f"rank{rank}.log"] for rank in range(len(procs))}
        ctx = context(tmp_path, procs, run_dir=run_dir, worker_logs=logs, budget_s=25.0)
        records = asyncio.run(collect_all(ctx))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()

    written = {p.relative_to(ctx.out_dir).as_posix(): p.read_bytes() for p in ctx.out_dir.rglob("*") if p.is_file()}
    for rel in ("env/rank0.txt", "env/rank1.txt", "proc/rank0.txt", "logs/rank0/rank0.log", "evidence.json"):
        assert rel in written, (rel, records)
    assert sum(rel.startswith("nccl/") for rel in written) == 2
    leaks = {rel: [s for s in SECRETS if s.encode() in data] for rel, data in written.items()}
    assert not {rel: found for rel, found in leaks.items() if found}

    env = written["env/rank0.txt"].decode()
    for name, value in NCCL_ENV.items():
        assert f"\n{name}={value}\n" in env  # what diagnosis needs is kept
    for name in SECRET_ENV:
        assert f"\n{name}=" in env  # the rest stays listed, its value withheld or redacted
    assert f"\nDATABASE_URL={WITHHELD}\n" in env
    assert "--password <redacted: secret flag> --lr 3e-4" in written["proc/rank0.txt"].decode()
    log = written["logs/rank0/rank0.log"].decode()
    assert "connecting to postgres://admin:<redacted: password>@db/x" in log and "NCCL_SOCKET_IFNAME=lo" in log
    for proc in procs:  # NCCL's own lines are copied byte for byte
        assert written[f"nccl/host.{proc.pid}"] == NCCL_LOG.format(pid=proc.pid).encode()
