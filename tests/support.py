"""Real processes and a real RAS server for the probe and evidence tests (no tests here).

- ``sleepers(n)``: Python processes parked in ``sleeping_here()`` -> ``time.sleep``,
  optionally SIGSTOPped; killed on exit whatever their state.
- ``make_port``: one port of a fake /sys/class/infiniband tree (no IB here).
- ``free_port``: a loopback port for a process started later to listen on.
- ``torch_store_server``: a real torch TCPStore server on a loopback ephemeral port.
- ``bundle_events``: a bundle's Flight Recorder dumps and NCCL logs as the sidecar that wrote it read them.
- ``RasServer``: NCCL's side of the RAS protocol on a loopback ephemeral port,
  answering with a canned report; the first ``silent`` connections are accepted
  and never answered, as a SIGSTOPped rank's socket is.
- ``watched`` / ``run_watched``: ``ncclwatch ... torchrun --standalone JOB`` in a test's folder,
  ``job_processes``: what of such a job is still running, ``only_report`` and ``assert_offline_parity``:
  its bundle's report, and ``ncclwatch analyze`` reaching the same verdict (the e2e tests' wrapper runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil

from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.evidence import EvidenceContext, RankTarget
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.probes.procfs import proc_state

SLEEPER = """
import time
def sleeping_here():
    print("ready", flush=True)
    time.sleep(600)
sleeping_here()
"""


def wait_state(pid: int, states: str, timeout_s: float = 5.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while (state := proc_state(pid)) not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@contextlib.contextmanager
def sleepers(n: int, stopped: tuple[int, ...] = (), env: dict | None = None) -> Iterator[list[subprocess.Popen]]:
    """``n`` sleeping Python processes; those at the indexes in ``stopped`` get SIGSTOP."""
    procs = [
        subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
        for _ in range(n)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline() == b"ready\n"
            assert wait_state(proc.pid, "S") == "S"  # inside time.sleep, not still printing
        for index in stopped:
            os.kill(procs[index].pid, signal.SIGSTOP)
            assert wait_state(procs[index].pid, "T") == "T"
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def targets(procs: list[subprocess.Popen]) -> tuple[RankTarget, ...]:
    return tuple(RankTarget(rank=i, pid=p.pid, local_rank=i, host="localhost") for i, p in enumerate(procs))


def context(tmp_path, procs=(), **kw) -> EvidenceContext:
    out = tmp_path / "bundle"
    out.mkdir(exist_ok=True)
    kw.setdefault("run_dir", None)
    kw.setdefault("pyspy", None)
    kw.setdefault("ranks", targets(list(procs)))
    return EvidenceContext(out_dir=out, **kw)


@dataclass
class RasServer:
    report: bytes
    json_report: bytes | None = None  # sent after SET FORMAT json, when given
    silent: int = 0  # accept and never answer this many connections first
    answers: dict = field(default_factory=dict)  # command -> answer line, overriding "OK"
    commands: list = field(default_factory=list)  # what each connection sent, one list per connection
    half_closed: list = field(default_factory=list)  # per answered connection: did the client shut down writes?
    port: int = 0

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._held: list[asyncio.StreamWriter] = []
        return self

    async def __aexit__(self, *exc) -> None:
        for writer in self._held:
            writer.close()
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent: list[str] = []
        self.commands.append(sent)
        if len(self.commands) <= self.silent:
            self._held.append(writer)
            return
        while line := await reader.readline():
            command = line.decode().strip()
            sent.append(command)
            if command.endswith("STATUS"):
                break
            default = "SERVER PROTOCOL 2" if command.startswith("CLIENT PROTOCOL") else "OK"
            writer.write(self.answers.get(command, default).encode() + b"\n")
        if not (sent and sent[-1].endswith("STATUS")):
            writer.close()  # the client gave up during the handshake
            return
        as_json = "SET FORMAT json" in sent and self.json_report is not None
        writer.write(self.json_report if as_json else self.report)
        await writer.drain()
        with contextlib.suppress(TimeoutError):  # a client that half-closed shows as EOF here
            await asyncio.wait_for(reader.read(1), 0.2)
        self.half_closed.append(reader.at_eof())
        writer.close()


def torch_store_server(use_libuv: bool = True):  # type: ignore[no-untyped-def]
    """A real torch TCPStore server on 127.0.0.1, port chosen by the kernel.

    The server connects to itself as it starts; 30 s (not torch's usual 5 s in our tests) because a
    CI machine running the suite beside other jobs once took longer than 5 s to accept that
    connection, failing a test before it began.
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv, timeout=timedelta(seconds=30)
    )


def free_port() -> int:
    """A loopback port free now, for a process started later to listen on (torchrun's store, a server).  Taken
    below the kernel's ephemeral range: a port from that range can be handed to any outgoing connection or
    ``bind(0)`` on the machine (eight wrappers' torchruns, sidecars and ranks start in between) before the
    process binds it, and the job then waits for a store that never starts."""
    low = ephemeral_low()
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    raise OSError("no free loopback port below the ephemeral range")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


COUNTERS = {
    "port_xmit_data": 1000,
    "port_rcv_data": 2000,
    "port_xmit_wait": 0,
    "symbol_error": 0,
    "link_downed": 1,
    "port_rcv_errors": 0,
    "VL15_dropped": 0,
}
HW = {"out_of_sequence": 0, "local_ack_timeout_err": 0, "rnr_nak_retry_err": 0, "np_cnp_sent": 5}


def make_port(root: Path, dev: str = "mlx5_0", port: int = 1, **values) -> Path:
    """One port of a fake /sys/class/infiniband tree; ``values`` override files by name."""
    base = root / dev / "ports" / str(port)
    files = {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "400 Gb/sec (4X NDR)",
        **{f"counters/{k}": str(v) for k, v in COUNTERS.items()},
        **{f"hw_counters/{k}": str(v) for k, v in HW.items()},
    }
    for name, value in values.items():
        files[name.replace("__", "/")] = str(value)
    for name, text in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(text + "\n")  # sysfs values end with a newline
    return base


def bundle_events(bundle: Path) -> list[Event]:
    """A bundle's Flight Recorder dumps and NCCL logs, parsed as its sidecar read them."""
    events: list[Event] = []
    with tarfile.open(bundle) as archive:
        for member in archive.getmembers():
            name = member.name.partition("/")[2]
            if name.startswith("fr/nccl_trace_rank_"):
                events += parse_flight_recorder(archive.extractfile(member).read(), name)  # type: ignore[union-attr]
            elif name.startswith("nccl/"):
                parser = NcclLogParser(name.removeprefix("nccl/"))
                events += parser.feed(archive.extractfile(member).read(), final=True)  # type: ignore[union-attr]
    return events


E2E_TIMEOUT_S = 150  # one wrapped job, start to end, on two busy cores


def demo(fault: str, *args: str) -> list[str]:
    """launcher/demo_job.py with ``fault`` at step 10 of 30 quick steps; later ``args`` override these."""
    from ncclwatch.launcher import demo_job

    return [demo_job.__file__, f"--fault={fault}", "--fault-step=10", "--step-time=0.05", "--steps=30", *args]


def standalone(nproc: int, *options: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node=NPROC OPTIONS...`` (as ``python -m torch.distributed.run``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *options]


def watched(
    tmp_path: Path, job: Sequence[str], *watch: str, nproc: int = 3, torchrun: Sequence[str] = (), run_dir: bool = True
) -> list[str]:
    """``ncclwatch --bundle-dir <tmp>/bundles [--run-dir <tmp>/run] WATCH... torchrun --standalone TORCHRUN... JOB``,
    torchrun's monitor at 0.2 s (not 5 s), so the job ends soon after its ranks."""
    folders = ["--bundle-dir", str(tmp_path / "bundles")] + (["--run-dir", str(tmp_path / "run")] if run_dir else [])
    wrapper = [sys.executable, "-m", "ncclwatch", *folders, *watch]
    return wrapper + standalone(nproc, "--monitor-interval=0.2", *torchrun, *job)


def run_watched(
    tmp_path: Path,
    job: Sequence[str],
    *watch: str,
    nproc: int = 3,
    torchrun: Sequence[str] = (),
    run_dir: bool = True,
    timeout_s: float = E2E_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """``watched(...)`` run to its end in ``tmp_path``, its output captured.  No process of the job may outlive
    the wrapper: any still running are killed, and the test fails naming them."""
    command = watched(tmp_path, job, *watch, nproc=nproc, torchrun=torchrun, run_dir=run_dir)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path)
    finally:
        leftovers = kill_leftovers(tmp_path)
    assert not leftovers, f"processes outlived the wrapper: {leftovers}"
    return done


def job_processes(folder: Path) -> list[psutil.Process]:
    """Every process of a job started in ``folder``: the wrapper runs it there (the working directory every
    process of the job inherits), and a wrapper given ``--run-dir`` inside it tells its ranks so."""
    found = []
    for process in psutil.process_iter():
        try:
            run_dir = process.environ().get("NCCLWATCH_RUN_DIR", "")
            if Path(process.cwd()) == folder or run_dir.startswith(f"{folder}/"):
                found.append(process)
        except psutil.Error:
            continue  # gone, or not ours to read
    return found


def kill_leftovers(folder: Path) -> list[psutil.Process]:
    """Kill what of the job started in ``folder`` still runs; what that was (for the test to fail on)."""
    leftovers = job_processes(folder)
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return leftovers


def only_report(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    """The report of the one bundle in ``<tmp>/bundles``, with ``_evidence`` (its evidence index) and ``_files``."""
    bundles = sorted((tmp_path / "bundles").glob("*.tar.gz"))
    assert len(bundles) == 1, f"expected one bundle, found {bundles}"
    with tarfile.open(bundles[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        report = json.load(tar.extractfile(member))  # type: ignore[arg-type]
        index = next(m for m in tar.getmembers() if m.name.endswith("/evidence.json"))
        report["_evidence"] = json.load(tar.extractfile(index))["records"]  # type: ignore[arg-type]
    report["_files"] = names
    return report


def analyzed(path: Path) -> dict:  # type: ignore[type-arg]
    """``ncclwatch analyze --json`` on what the live run left (run folder or bundle)."""
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", "--json", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout, done.stderr[-2000:]
    return json.loads(done.stdout)


def assert_offline_parity(tmp_path: Path, report: dict) -> None:  # type: ignore[type-arg]
    """One engine: analyze on the kept run folder and on the bundle reaches the live verdict."""
    [bundle] = sorted((tmp_path / "bundles").glob("*.tar.gz"))
    for left in (tmp_path / "run", bundle):
        offline = analyzed(left)
        assert (offline["verdict"], offline["culprit_ranks"]) == (report["verdict"], report["culprit_ranks"]), left


def fault_time(tmp_path: Path) -> float:
    """When the job's first rank misbehaved: the earliest ``fault.<rank>`` mark in the run folder."""
    return min(json.loads(p.read_text())["time"] for p in (tmp_path / "run").glob("fault.*"))
