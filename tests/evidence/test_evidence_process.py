"""/proc and environment collectors on real processes; secrets never reach the bundle."""

from __future__ import annotations

import asyncio

from support import context, sleepers

from ncclwatch.watchdog.evidence import RankTarget, collect_env, collect_proc
from ncclwatch.watchdog.evidence.redact import marker, redact_env

SECRETS = {
    "HF_TOKEN": "hf_abc",
    "github_token": "ghp_abc",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "WANDB_API_KEY": "wandb-key",
    "DB_PASSWORD": "pw",
    "MYSQL_PASSWD": "pw2",
    "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json",
}
PLAIN = {"NCCL_DEBUG": "INFO", "RANK": "3", "MASTER_ADDR": "10.0.0.1"}


def test_redaction_is_by_name_and_case_insensitive():
    redacted = redact_env({**SECRETS, **PLAIN})
    assert {k: redacted[k] for k in SECRETS} == dict.fromkeys(SECRETS, marker("secret variable"))
    assert {k: redacted[k] for k in PLAIN} == PLAIN


def test_env_file_of_a_real_process(tmp_path):
    with sleepers(1, env={**SECRETS, **PLAIN}) as procs:
        ctx = context(tmp_path, procs)
        (rec,) = asyncio.run(collect_env(ctx))
    assert (rec.name, rec.rank, rec.error, rec.paths) == ("env", 0, None, ["env/rank0.txt"])
    text = (ctx.out_dir / "env/rank0.txt").read_text()
    assert "NCCL_DEBUG=INFO\n" in text and "RANK=3\n" in text and "HF_TOKEN=<redacted: secret variable>\n" in text
    assert not any(value in text for value in SECRETS.values())


def test_proc_files_of_running_and_stopped_ranks(tmp_path):
    with sleepers(2, stopped=(1,)) as procs:
        ctx = context(tmp_path, procs)
        records = asyncio.run(collect_proc(ctx))
    assert [(r.rank, r.error, r.note) for r in records] == [(0, None, "state S"), (1, None, "state T")]
    running = (ctx.out_dir / "proc/rank0.txt").read_text()
    stopped = (ctx.out_dir / "proc/rank1.txt").read_text()
    assert running.startswith(f"rank 0 pid {procs[0].pid} host localhost local_rank 0")
    assert "\nstate: S (sleeping)  wchan: " in running and "\nstate: T (stopped)" in stopped
    assert "threads by state: T=1" in stopped
    for section in ("cmdline", "status", "stat", "io"):
        assert f"== /proc/{procs[0].pid}/{section}\n" in running
    assert "sleeping_here()" in running  # the cmdline, NULs as spaces
    assert f"\n{procs[0].pid}\tS\t" in running  # the thread table


def test_gone_rank_gets_placeholders(tmp_path):
    with sleepers(1) as (proc,):
        pass
    ctx = context(tmp_path, ranks=(RankTarget(rank=5, pid=proc.pid, local_rank=None, host="localhost"),))
    (proc_rec,) = asyncio.run(collect_proc(ctx))
    (env_rec,) = asyncio.run(collect_env(ctx))
    for rec, rel in ((proc_rec, "proc/rank5.txt"), (env_rec, "env/rank5.txt")):
        assert rec.error == f"process {proc.pid} of rank 5 not found (exited?)"
        assert rec.paths == [f"{rel}.missing"] and (ctx.out_dir / rec.paths[0]).read_text() == rec.error + "\n"
