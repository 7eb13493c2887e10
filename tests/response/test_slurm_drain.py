"""``--drain slurm`` against a real single-node Slurm: munged, slurmctld and slurmd of this machine.

The cluster lives in a temporary folder (its own munge socket and key, its
own ports, ``SLURM_CONF`` pointing at it), so nothing of a site's Slurm is
touched.  The node is this machine under its short hostname, the name the
wrapper gives ``scontrol`` for a culprit on it.  ``.ci/run`` installs
slurm-wlm and munge where apt-get can; without them (or without root, which
slurmd needs) the tests are skipped, except under CI=true where that is a
failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from receiver import Receiver
from support import free_port

from ncclwatch.watchdog.hang.report import EXIT_DRAINED
from ncclwatch.watchdog.response.drain import drain_slurm

JOB = Path(__file__).resolve().parents[2] / "bench" / "checkpoint_job.py"
HOST = socket.gethostname().split(".")[0]
DAEMONS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")


def _unavailable() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"no {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    if (
        not Path("/etc/munge/munge.key").is_file()
        and shutil.which("mungekey") is None
        and not Path("/usr/sbin/mungekey").exists()
    ):
        return "no munge key and no mungekey to make one"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running one-node cluster; yields the environment that points Slurm's commands at it."""
    why = _unavailable()
    if why is not None:
        if os.environ.get("CI") == "true":  # .ci/run installs it: its absence in CI is a failure, not a skip
            pytest.fail(f"Slurm test cannot run under CI: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)  # munged wants every folder above its socket searchable
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "key"
    if Path("/etc/munge/munge.key").is_file():
        shutil.copyfile("/etc/munge/munge.key", key)
    else:
        subprocess.run([_daemon("mungekey"), "--create", f"--keyfile={key}"], check=True)
    key.chmod(0o400)
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    ctld_port, slurmd_port = free_port(), free_port()
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=ncclwatchtest
SlurmctldHost={HOST}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge}/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={HOST} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=test Nodes={HOST} Default=YES State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [
        subprocess.Popen(
            [
                _daemon("munged"),
                "-F",
                "-f",
                f"--socket={munge}/sock",
                f"--key-file={key}",
                f"--log-file={munge}/log",
                f"--pid-file={munge}/pid",
                f"--seed-file={munge}/seed",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        _until(lambda: (munge / "sock").exists(), 10, "munged's socket")
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(
                subprocess.Popen(
                    [_daemon(daemon), "-D", "-f", str(conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        _until(lambda: node_state(env)[0] in ("idle", "mixed", "allocated"), 30, f"node {HOST} idle in sinfo")
        yield env
    finally:
        for process in reversed(daemons):
            process.terminate()
        for process in daemons:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def _until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"Slurm test cluster: no {what} after {timeout_s:g} s")


def node_state(env: dict[str, str]) -> tuple[str, str]:
    """sinfo's state and reason of this node: ("drained", "ncclwatch: ...")."""
    result = subprocess.run(["sinfo", "-h", "-n", HOST, "-o", "%T|%E"], env=env, capture_output=True, text=True)
    state, _, reason = result.stdout.strip().partition("|")
    return state.rstrip("*"), reason


def resume(env: dict[str, str]) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={HOST}", "State=RESUME"], env=env, check=True)


def test_drain_slurm_drains_the_node_with_the_reason(slurm: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    outcome = asyncio.run(drain_slurm([HOST], "ncclwatch: network_error run/0|node_lost"))
    try:
        assert outcome.ok, outcome
        assert node_state(slurm) == ("drained", "ncclwatch: network_error run/0|node_lost")
        # What docs/slurm.md's requeue script asks Slurm.
        reasons = subprocess.run(
            ["sinfo", "-h", "-R", "-n", HOST, "-o", "%E"], env=slurm, capture_output=True, text=True
        )
        assert reasons.stdout.strip() == "ncclwatch: network_error run/0|node_lost"
    finally:
        resume(slurm)


def test_an_unknown_node_is_a_failed_drain_with_scontrols_words(
    slurm: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    outcome = asyncio.run(drain_slurm(["no-such-node"], "ncclwatch: test"))
    assert not outcome.ok and outcome.returncode not in (0, None)
    assert (
        outcome.describe("scontrol").startswith(f"scontrol exit {outcome.returncode}: ")
        and "node" in outcome.output.lower()
    )


def test_the_wrapper_drains_the_culprits_node_and_exits_for_a_requeue(slurm: dict[str, str], tmp_path: Path) -> None:
    """A stopped rank, with a site policy that blames the node for it: drained, job ended with EXIT_DRAINED, one page
    that says so, and the drain in the bundle's report."""

    async def run() -> tuple[int, str, list[dict]]:  # type: ignore[type-arg]
        async with Receiver() as receiver:
            env = dict(slurm, NCCLWATCH_WEBHOOK_URL=receiver.url, PYTHONUNBUFFERED="1")
            wrapper = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "ncclwatch",
                "--on-hang",
                "kill",
                "--drain",
                "slurm",
                "--drain-on",
                "process_stopped",
                "--bundle-dir",
                str(tmp_path / "bundles"),
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "--monitor-interval=0.2",
                str(JOB),
                "--steps=60",
                f"--ckpt-dir={tmp_path}",
                f"--events={tmp_path / 'events.jsonl'}",
                "--fault=sigstop",
                "--fault-rank=1",
                "--fault-step=20",
                env=env,
                cwd=tmp_path,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            _, stderr = await asyncio.wait_for(wrapper.communicate(), 240)
            await asyncio.sleep(0.5)
            return wrapper.returncode or 0, stderr.decode(errors="replace"), [json.loads(s.body) for s in receiver.seen]

    pytest.importorskip("torch")
    try:
        code, stderr, posts = asyncio.run(run())
        state = node_state(slurm)
    finally:
        resume(slurm)
    assert code == EXIT_DRAINED, stderr[-3000:]
    assert state[0] == "drained" and state[1].startswith("ncclwatch: process_stopped "), state
    triggers = [p for p in posts if p["action"] == "trigger"]
    assert len(triggers) == 1 and f"draining {HOST} and ending the job" in triggers[0]["summary"]
    bundle = next((tmp_path / "bundles").glob("*.tar.gz"))
    with tarfile.open(bundle) as tar:
        report = json.loads(tar.extractfile(next(n for n in tar.getnames() if n.endswith("/report.json"))).read())  # type: ignore[union-attr]
    kinds = [(a["kind"], a["ok"]) for a in report["actions"]]
    assert kinds == [("kill", True), ("drain", True)], report["actions"]
