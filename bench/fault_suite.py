#!/usr/bin/env python3
"""Detection latency, accuracy and false pages of the live watchdog on a real training job.

Each run is ``python -m ncclwatch --on-hang kill ... python -m torch.distributed.run ...
bench/gpu_job.py --fault KIND --fault-rank R --fault-step S`` with a hard
timeout.  Repeats move the fault between rank 0 and the last rank
(``--fault-ranks``) and between steps (``--fault-steps``).

Per run it records the expected and the reported verdict and culprit ranks
of every wrapper, from three places: the verdict line on the wrapper's
terminal (``ncclwatch: <VERDICT> — culprit rank R``, stamped when it
arrived: the page), ``report.json`` in the bundle (``detected_at``) and the
bundle's mtime; plus the webhook triggers a loopback receiver got
(``NCCLWATCH_WEBHOOK_URL``: one page per hang, none for a healthy job).
Latencies run from the fault's own mark (``fault.<rank>``, written by the
job the instant it misbehaves).

Healthy scenarios (none, checkpoint, straggler, pause) must end with exit 0
and no page; a crash (sigkill, exception) on one node is torchrun's to end
(its exit code, no page; a ``process_dead`` page naming the rank is also
right).  On gloo (``--device cpu``) dtype and conditional are crashes too:
gloo checks message sizes and raises.

Multi-node mode (``--nnodes N``, any N >= 2): N wrappers on this machine,
``--nproc`` ranks each (default 1; global rank = node * nproc + local),
``--node-rank k --master-addr 127.0.0.1 --master-port P`` (static rendezvous:
node 0's torchrun serves the store) or ``--rdzv-backend c10d``; each wrapper
gets its own ``NCCL_HOSTID=node<k>`` so NCCL treats them as N hosts.  A hang,
on one node or several, is right when exactly one wrapper pages (the others
say which node does) and one webhook trigger arrives, both with the expected
verdict and culprit; a verdict in the bundle of a node that did not page is
shown, not judged.

Two scenarios act on a whole node, not through the job (which runs ``--fault
none``): once that node's ranks have beaten past the fault step (their
heartbeats in ``<run dir>/hb/``) the suite signals its wrapper and every
process under it, and that moment is ``fault_at``.

  freeze_node      SIGSTOP the node of the fault rank (rank 0: node 0, -1: the last
                   node): ``node_lost`` naming its ranks, one page, the others exit 3
  kill_store_node  SIGKILL node 0, the store's node: ``node_lost`` naming its ranks,
                   one page (from one survivor), no wrapper exits 0

    python3 bench/fault_suite.py --device cpu --nproc 2 --scenarios skip,none      # CPU dry run
    python3 bench/fault_suite.py --scenarios skip,syscall,sigstop --repeats 2 --budget 500
    python3 bench/fault_suite.py --nnodes 2 --rdzv c10d --scenarios skip,sigkill --budget 500
    python3 bench/fault_suite.py --nnodes 8 --size tiny --fault-ranks 4 \\
        --scenarios skip,freeze_node,kill_store_node,none                          # 8 nodes on one GPU
    python3 bench/fault_suite.py --device cpu --nnodes 3 --scenarios freeze_node,kill_store_node  # CPU dry run
    python3 bench/fault_suite.py --summarize a.jsonl b.jsonl                        # one table

Writes ``<out-dir>/<name>.jsonl`` (one line per run), ``<name>.md`` (the
table) and ``<name>-logs.tar.gz`` (each wrapper's whole output).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from aiohttp import web
from hard_cases import gpu_slice  # bench/: the script's folder is on sys.path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "bench" / "gpu_job.py"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
VERDICT_LINE = re.compile(r"^ncclwatch: ([A-Z][A-Z0-9 ]+?)(?: — culprit ranks? ([\d, ]+))?\s*$")  # P2P DEADLOCK
PERF_LINE = re.compile(r"^ncclwatch .*? performance: (\w+): (.*)$")  # the performance look's findings (logged)
# A node that shows the verdict but leaves the page to another ("node 0 pages the job-wide verdict", "a lower
# node that answers pages"): every node writes a bundle, so only these lines tell which node paged.
DEFER_LINE = re.compile(r"^ncclwatch: node \d+: .*\bpages\b")
ACTION_TAIL_STEPS = 100_000  # a node action's job trains on until the action or the run's timeout ends it
LOG_TAIL_BYTES = 256 << 10


@dataclass(frozen=True)
class Expect:
    verdict: str | None = None  # None: no page
    names_culprit: bool = True  # the culprit must be exactly [fault rank]
    crash: bool = False  # torchrun ends the job with an error
    gpu_only: bool = False
    long: bool = False  # runs --pause-s longer
    gloo_raises: bool = False  # gloo checks sizes and raises: on CPU the job dies of it, no hang
    # "freeze" (SIGSTOP) or "kill" (SIGKILL) a whole wrapper, "interrupt" (SIGINT, a user's Ctrl-C) the wrapper
    # alone; the job runs healthy
    node_action: str | None = None
    dies: bool = False  # the job dies of the fault: its verdict is paged once, naming the fault rank (issue 44)
    no_incident: bool = False  # the job ends badly by the user's own hand (sys.exit(3), Ctrl-C): no page, no bundle


EXPECT = {
    "none": Expect(),
    "skip": Expect("collective_mismatch"),
    "dtype": Expect("collective_mismatch", gloo_raises=True),
    "conditional": Expect("collective_mismatch", gloo_raises=True),
    "p2p_deadlock": Expect("p2p_deadlock", names_culprit=False),  # every rank is in the cycle
    "syscall": Expect("rank_behind"),
    "long_kernel": Expect("gpu_compute_hang", gpu_only=True),
    "sigkill": Expect("process_dead", dies=True),
    "exception": Expect("process_dead", dies=True),
    "raise": Expect("process_dead", dies=True),
    "oom": Expect("process_dead", dies=True),
    "pg_timeout": Expect("collective_timeout", dies=True),
    "exit": Expect(no_incident=True),
    "interrupt": Expect(no_incident=True, node_action="interrupt"),
    "checkpoint": Expect(long=True),
    "straggler": Expect(),
    "pause": Expect(long=True),
    "sigstop": Expect("process_stopped"),
    "freeze_node": Expect("node_lost", node_action="freeze"),
    "kill_store_node": Expect("node_lost", node_action="kill"),
}
HEALTHY = tuple(name for name, e in EXPECT.items() if e.verdict is None and not e.crash and not e.no_incident)
DIES = tuple(name for name, e in EXPECT.items() if e.dies or e.gloo_raises or e.no_incident)


def expectation(scenario: str, device: str) -> Expect:
    expect = EXPECT[scenario]
    return Expect(expect.verdict, dies=True) if expect.gloo_raises and device == "cpu" else expect


class WebhookReceiver:
    """A loopback JSON webhook (aiohttp, own thread): every POST is kept with its arrival time."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.url = ""

    def start(self) -> str:
        threading.Thread(target=self._serve, daemon=True, name="webhook").start()
        self._ready.wait(10)
        return self.url

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            alert = json.loads(body)
        except ValueError:
            alert = {}
        self.posts.append(
            {
                "time": time.time(),
                "event": request.headers.get("X-Ncclwatch-Event"),
                "id": request.headers.get("X-Ncclwatch-Id"),
                "job": alert.get("job"),
                "host": alert.get("host"),
                "verdict": alert.get("verdict"),
                "culprit_ranks": alert.get("culprit_ranks"),
            }
        )
        return web.Response(text="ok")

    def for_job(self, job: str) -> list[dict]:
        return [p for p in list(self.posts) if p["job"] == job]


class Wrapper:
    """One ``ncclwatch ... torchrun`` process: its output stamped line by line as it arrives."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.log = log
        self.verdict_lines: list[tuple[float, str, list[int]]] = []
        self.perf_lines: list[tuple[float, str, str]] = []  # (arrived, kind, summary)
        self.deferred = False  # said that another node pages
        self.process = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.first_death_at: float | None = None  # when the first of its ranks ended (a failed job's clock)
        threading.Thread(target=self._watch_ranks, daemon=True).start()

    def _watch_ranks(self) -> None:
        """Note when the first rank (a ``JOB`` process under torchrun) ends, every 20 ms, until the wrapper ends."""
        seen: set[int] = set()
        while self.process.poll() is None and self.first_death_at is None:
            try:
                tree = psutil.Process(self.process.pid).children(recursive=True)
                ranks = {p.pid for p in tree if _is_rank(p) and p.status() != psutil.STATUS_ZOMBIE}
            except psutil.Error:
                ranks = set()
            if seen - ranks:
                self.first_death_at = time.time()
            seen |= ranks
            time.sleep(0.02)

    def _read(self) -> None:
        with self.log.open("wb") as out:
            for raw in self.process.stdout:  # type: ignore[union-attr]
                arrived = time.time()
                out.write(raw)
                line = raw.decode(errors="replace").rstrip("\n")
                if perf := PERF_LINE.match(line):
                    self.perf_lines.append((arrived, perf.group(1), perf.group(2)))
                self.deferred = self.deferred or bool(DEFER_LINE.match(line))
                match = VERDICT_LINE.match(line)
                if match:
                    verdict = match.group(1).strip().lower().replace(" ", "_")
                    culprits = [int(x) for x in re.findall(r"\d+", match.group(2) or "")]
                    self.verdict_lines.append((arrived, verdict, culprits))

    def end(self, hard: bool = False) -> None:
        """SIGTERM the wrapper (it forwards to torchrun), then SIGKILL whatever of its tree is left.

        ``hard``: SIGKILL at once (a frozen node's tree would hold a SIGTERM until the wait ran out).
        """
        try:
            tree = [psutil.Process(self.process.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.process.poll() is None and not hard:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for proc in tree:
            try:
                proc.kill()  # SIGKILL ends a stopped process too
            except psutil.NoSuchProcess:
                pass
        self.process.wait()  # reaped by Popen first: after psutil's wait Popen would read exit status 0
        psutil.wait_procs(tree[1:], timeout=20)
        self._reader.join(10)


def _is_rank(proc: psutil.Process) -> bool:
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return any(arg.endswith(JOB.name) for arg in cmdline) and "torch.distributed.run" not in cmdline


def kill_leftovers(work: Path) -> int:
    """Kill any process still naming this run's folder (a worker the wrapper failed to end); how many there were.

    Only this run's processes match: every job argument list holds the run's
    own temporary folder.  A survivor would hold the GPU for the next run.
    """
    survivors = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(work) in arg for arg in proc.info["cmdline"] or ()):
            survivors.append(proc)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(survivors, timeout=20)
    return len(survivors)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wrapper_commands(
    args: argparse.Namespace, scenario: str, rank: int, step: int, work: Path, job: str
) -> list[list[str]]:
    fault, tail = (scenario, args.steps_after) if EXPECT[scenario].node_action is None else ("none", ACTION_TAIL_STEPS)
    job_args = [
        str(JOB),
        f"--device={args.device}",
        f"--size={args.size}",
        f"--fault={fault}",
        f"--fault-rank={rank}",
        f"--fault-step={step}",
        f"--steps={step + tail}",
        f"--warmup-steps={min(20, step)}",
        f"--pause-s={args.pause_s}",
        f"--mark-dir={work / 'marks'}",
        *([f"--pg-timeout-s={args.pg_timeout_s}"] if scenario == "pg_timeout" else []),
        f"--result={work / 'result.json'}",
    ]
    commands = []
    for node in range(args.nnodes):
        wrapper = [
            sys.executable,
            "-m",
            "ncclwatch",
            "-v",
            "--on-hang",
            "kill",
            "--job-name",
            job,
            "--bundle-dir",
            str(work / f"bundles{node}"),
            "--run-dir",
            str(work / f"run{node}"),
        ]
        if args.stall_timeout_floor is not None:
            wrapper += ["--stall-timeout-floor", str(args.stall_timeout_floor)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
        if args.nnodes == 1:
            torchrun.append("--standalone")
        elif args.rdzv == "static":
            torchrun += [f"--nnodes={args.nnodes}", f"--node-rank={node}", "--master-addr=127.0.0.1"]
            torchrun.append(f"--master-port={args.port}")
        else:
            torchrun += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{args.port}"]
            torchrun.append(f"--rdzv-id={job}")
        commands.append(wrapper + args.wrapper_arg + torchrun + job_args)
    return commands


def start_wrappers(
    args: argparse.Namespace, hook: str, scenario: str, rank: int, step: int, work: Path, job: str
) -> list[Wrapper]:
    wrappers = []
    for node, command in enumerate(wrapper_commands(args, scenario, rank, step, work, job)):
        env = {**os.environ, **SAFE_ENV, "NCCLWATCH_WEBHOOK_URL": hook, "PYTHONUNBUFFERED": "1"}
        if args.nnodes > 1:
            env["NCCL_HOSTID"] = f"node{node}"
        if args.gpu_each:
            # As on separate hosts: NVML then reads each rank's GPU alone, which a GPU hang's signature needs.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_slice(node, args.nproc))
        wrappers.append(Wrapper(command, env, work, work / f"wrapper{node}.log"))
    return wrappers


def target_node(expect: Expect, rank: int, nproc: int) -> int | None:
    """The node a node action hits: the fault rank's (so repeats vary it), but always node 0 for the kill,
    whose point is that the store dies with the node."""
    if expect.node_action is None:
        return None
    return 0 if expect.node_action == "kill" else rank // nproc


def reach_step(run_dir: Path, nproc: int, step: int, wrappers: list[Wrapper], deadline: float) -> bool:
    """Wait until each of the node's ranks has beaten past ``step`` (``<run dir>/hb/<pid>.json``).

    Past its warm-up, at the step where a job fault would strike, so the latencies compare with the job
    faults'; the start-up time itself varies too much with the load for a fixed delay.  False when a
    wrapper ended or the deadline passed first.
    """
    while time.time() < deadline and all(w.process.poll() is None for w in wrappers):
        steps = []
        for path in (run_dir / "hb").glob("*.json"):
            try:
                steps.append(json.loads(path.read_text()).get("step") or 0)
            except (OSError, ValueError):  # not written yet: read it on the next round
                pass
        if len(steps) >= nproc and min(steps) >= step:
            return True
        time.sleep(0.1)
    return False


def act_on_node(wrapper: Wrapper, action: str) -> None:
    """SIGSTOP (freeze) or SIGKILL a wrapper and everything under it: a node that hangs or dies whole; or SIGINT
    the wrapper alone (interrupt: the user's Ctrl-C).

    The tree is collected before any signal: the wrapper starts torchrun in a session of its own (its
    process group is not enough), and a killed parent's children are reparented out of ``children()``.
    """
    root = psutil.Process(wrapper.process.pid)
    tree = [root, *root.children(recursive=True)]
    how = signal.SIGSTOP if action == "freeze" else signal.SIGKILL
    if action == "interrupt":  # a terminal's Ctrl-C reaches the wrapper's process group: the wrapper passes it on
        tree, how = [root], signal.SIGINT
    for proc in tree:  # top down: no parent sees a child stop or die and reacts
        try:
            proc.send_signal(how)
        except psutil.NoSuchProcess:
            pass


def archive_logs(logs: tarfile.TarFile, wrappers: list[Wrapper], stem: str) -> None:
    for i, wrapper in enumerate(wrappers):
        data = wrapper.log.read_bytes()[-LOG_TAIL_BYTES:]
        info = tarfile.TarInfo(f"{stem}-node{i}.log")
        info.size, info.mtime = len(data), int(time.time())
        logs.addfile(info, io.BytesIO(data))


def run_once(
    args: argparse.Namespace,
    receiver: WebhookReceiver,
    scenario: str,
    rank: int,
    step: int,
    n: int,
    logs: tarfile.TarFile,
) -> dict:
    expect = expectation(scenario, args.device)
    node = target_node(expect, rank, args.nproc)
    job = f"bench-{scenario}-{n}-{os.getpid()}"
    timeout = args.timeout + (args.pause_s if expect.long else 0)
    with tempfile.TemporaryDirectory(prefix=f"fault-{scenario}-") as folder:
        work = Path(folder)
        (work / "marks").mkdir()
        args.port = free_port()
        began = time.time()
        wrappers = start_wrappers(args, receiver.url, scenario, rank, step, work, job)
        acted_at, hit = None, None  # the node action's time and the wrapper it hit
        if node is not None and reach_step(work / f"run{node}", args.nproc, step, wrappers, began + timeout):
            acted_at, hit = time.time(), wrappers[node]
            act_on_node(hit, expect.node_action)
        # The node hit never ends by itself (frozen) or ended at once (killed): only the others are waited for.
        waited = [w for w in wrappers if w is not hit or expect.node_action == "interrupt"]
        timed_out = wait_all(waited, began + timeout, args.peer_grace)
        for wrapper in wrappers:
            wrapper.end(hard=wrapper is hit)
        leftovers = kill_leftovers(work)
        time.sleep(0.5)  # a webhook the sidecar sent just before it exited
        marks = [json.loads(p.read_text()) for p in (work / "marks").glob("fault.*") if not p.name.endswith(".tmp")]
        fault_at = acted_at if node is not None else min((m["time"] for m in marks), default=None)
        nodes = [node_result(w, work / f"bundles{i}", fault_at) for i, w in enumerate(wrappers)]
        deaths = [w.first_death_at for w in wrappers if w.first_death_at is not None]
        first_death_at = min(deaths) if expect.dies and deaths else None
        result_file = work / "result.json"
        steps_per_s = json.loads(result_file.read_text()).get("steps_per_s") if result_file.exists() else None
        archive_logs(logs, wrappers, f"{scenario}-{n}")
        record = {
            "scenario": scenario,
            "repeat": n,
            "nnodes": args.nnodes,
            "rdzv": args.rdzv if args.nnodes > 1 else None,
            "nproc_per_node": args.nproc,
            "device": args.device,
            "size": args.size,
            "fault_rank": rank,
            "fault_step": step,
            "action": expect.node_action,
            "action_node": node,
            "expected_verdict": expect.verdict,
            "expect_crash": expect.crash,
            "expected_culprits": expected_culprits(expect, rank, node, args.nproc),
            "fault_at": fault_at,
            "first_death_at": first_death_at,
            "wall_s": round(time.time() - began, 1),
            "timed_out": timed_out,
            "nodes": nodes,
            "steps_per_s": steps_per_s,
            "leftover_processes": leftovers,
        }
        score(record, receiver.for_job(job))
        record["correct"] = judge(expect, record, rank)
        if not record["correct"]:
            # A wrong verdict needs its evidence to be understood: the bundles (NCCL logs, dumps, stacks) come back.
            for i in range(len(wrappers)):
                for bundle in sorted((work / f"bundles{i}").glob("*.tar.gz")):
                    shutil.copy(bundle, Path(args.out_dir) / f"wrong-{scenario}-{n}-node{i}-{bundle.name}")
    return record


def expected_culprits(expect: Expect, rank: int, node: int | None, nproc: int) -> list[int] | None:
    if node is not None:
        return list(range(node * nproc, (node + 1) * nproc))
    return [rank] if expect.verdict and expect.names_culprit else None


def score(record: dict, posts: list[dict]) -> None:
    """Pages (terminal and webhook) and latencies from the fault's mark, or the node action, into ``record``."""
    nodes, fault_at = record["nodes"], record["fault_at"]
    triggers = [p for p in posts if p["event"] == "trigger"]
    reported = [i for i, node in enumerate(nodes) if node["page_verdict"] or node["verdict"]]
    record.update(
        reports=len(reported),
        paged_by=[i for i in reported if not nodes[i]["deferred"]],
        webhook_triggers=len(triggers),
        webhook_resolves=sum(p["event"] == "resolve" for p in posts),
        webhook_keys=len({p["id"] for p in triggers}),
        webhook_pages=[[p["verdict"], p["culprit_ranks"]] for p in triggers],
    )
    record["pages"] = len(record["paged_by"])
    for key in ("page_s", "report_s", "bundle_s"):
        values = [node[key] for node in nodes if node.get(key) is not None]
        record[key] = min(values) if values else None
    record["webhook_s"] = round(min(p["time"] for p in triggers) - fault_at, 2) if triggers and fault_at else None
    # A job that died: the clock runs from its first rank's end (PyTorch's own timeout ends ranks long after the
    # fault), to the page (the webhook's arrival) and to the bundle.
    death = record.get("first_death_at")
    if death is not None and fault_at is not None:
        shift = death - fault_at
        record["page_from_death_s"] = round(record["webhook_s"] - shift, 2) if record["webhook_s"] is not None else None
        record["bundle_from_death_s"] = round(record["bundle_s"] - shift, 2) if record["bundle_s"] is not None else None


def wait_all(wrappers: list[Wrapper], deadline: float, peer_grace: float) -> bool:
    """Wait for every wrapper; once one has ended the others get ``peer_grace`` more seconds.  True if any timed out."""
    while time.time() < deadline:
        ended = [w.process.poll() is not None for w in wrappers]
        if all(ended):
            return False
        if any(ended):
            deadline = min(deadline, time.time() + peer_grace)
            peer_grace = float("inf")  # set the shorter deadline once
        time.sleep(0.2)
    return True


def node_result(wrapper: Wrapper, bundles: Path, fault_at: float | None) -> dict:
    since = lambda t: round(t - fault_at, 2) if fault_at is not None and t is not None else None  # noqa: E731
    first_line = wrapper.verdict_lines[0] if wrapper.verdict_lines else (None, None, None)
    node = {
        "returncode": wrapper.process.returncode,
        "page_verdict": first_line[1],
        "page_culprits": first_line[2],
        "page_s": since(first_line[0]),
        "verdict_lines": len(wrapper.verdict_lines),
        "deferred": wrapper.deferred,
        "verdict": None,
        "culprit_ranks": None,
        "perf_findings": [{"kind": kind, "summary": text, "s": since(at)} for at, kind, text in wrapper.perf_lines],
    }
    found = sorted(bundles.glob("*.tar.gz"))
    node["bundles"] = len(found)
    if found:
        with tarfile.open(found[0]) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/report.json"))
            report = json.load(tar.extractfile(member))  # type: ignore[arg-type]
            index = next((m for m in tar.getmembers() if m.name.endswith("/evidence.json")), None)
            evidence = json.load(tar.extractfile(index))["records"] if index else []  # type: ignore[arg-type]
        # What made the bundle slow, when it was: the three longest collectors.
        node["slowest_evidence"] = [
            {k: r.get(k) for k in ("name", "rank", "duration_s", "error")}
            for r in sorted(evidence, key=lambda r: -r["duration_s"])[:3]
        ]
        detected = dt.datetime.fromisoformat(report["detected_at"]).timestamp()
        node.update(
            verdict=report["verdict"],
            culprit_ranks=report["culprit_ranks"],
            stall_timeout_s=report.get("stall_timeout_s"),
            hang_started_at=report.get("hang_started_at"),
            report_s=since(detected),
            bundle_s=since(found[0].stat().st_mtime),
        )
    if (not found and node["returncode"] != 0) or node["verdict"] != node["page_verdict"]:
        node["tail"] = wrapper.log.read_bytes()[-3000:].decode(errors="replace")
    return node


def judge(expect: Expect, record: dict, rank: int) -> bool:
    nodes = record["nodes"]
    if record["timed_out"] and not (expect.verdict and any(n["verdict"] for n in nodes)):
        return False
    if expect.no_incident:  # the user's own end: whatever the exit status, nothing paged, no bundle
        return record["reports"] == 0 and record["webhook_triggers"] == 0 and not any(n["bundles"] for n in nodes)
    if expect.verdict is None and not expect.crash:
        return record["reports"] == 0 and record["webhook_triggers"] == 0 and all(n["returncode"] == 0 for n in nodes)
    if expect.dies:
        # One incident (one dedup key: every node that judges it pages under the same key), naming the fault rank.
        pages = [(verdict, ranks) for verdict, ranks in record["webhook_pages"]]
        right = all(verdict == expect.verdict and ranks == [rank] for verdict, ranks in pages)
        return record["webhook_keys"] == 1 and bool(pages) and right
    if expect.crash:
        named = [n for n in nodes if n["verdict"]]
        # One node: torchrun ends the job.  Across nodes the survivor hangs and should name the dead rank.
        if any(n["culprit_ranks"] != [rank] for n in named):
            return False
        if record["nnodes"] == 1:
            ended_by_torchrun = not named and nodes[0]["returncode"] not in (0, 3)
            return ended_by_torchrun or [n["verdict"] for n in named] == ["process_dead"]
        return True
    culprits = record["expected_culprits"]  # None: any (p2p_deadlock: every rank is in the cycle)
    # What was paged is judged: the one wrapper that paged (its bundle) and the one webhook trigger.  A node
    # that left the page to another may keep another verdict in its bundle (with the store gone each node
    # judges alone); the table's "got" shows every node's.
    pages = [(nodes[i]["verdict"], nodes[i]["culprit_ranks"]) for i in record["paged_by"]]
    pages += [(verdict, ranks) for verdict, ranks in record["webhook_pages"]]
    right = all(verdict == expect.verdict and culprits in (None, ranks) for verdict, ranks in pages)
    return record["pages"] == 1 and record["webhook_triggers"] == 1 and right and spared_nodes_ok(expect, record)


def spared_nodes_ok(expect: Expect, record: dict) -> bool:
    """How the nodes a node action spared end: ended by ncclwatch (3) after a freeze; never as a clean
    exit after the store's node died (gloo ranks crash and torchrun fails, unless a slow exit lets the
    stall be paged first; NCCL ranks hang until ncclwatch ends them: 3)."""
    codes = [n["returncode"] for i, n in enumerate(record["nodes"]) if i != record["action_node"]]
    if expect.node_action == "freeze":
        return all(code == 3 for code in codes)
    return 0 not in codes


def percentiles(values: list[float]) -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return f"{statistics.median(values):.1f} / {p90:.1f}"


def outcome(node: dict) -> str:
    """``node_lost [0], rc 3``: after a node action the exit code says who ended the others (3: ncclwatch)."""
    told = f"{node['verdict']} {node['culprit_ranks']}" if node["verdict"] else "none"
    return f"{told}, rc {node['returncode']}"


def perf_summary(runs: list[dict]) -> str:
    """Per run, each kind the performance look logged with its first time: 'straggler 31.2'; '-' for none."""
    told = []
    for run in runs:
        first: dict[str, float | None] = {}
        for node in run["nodes"]:
            for finding in node.get("perf_findings", ()):
                first.setdefault(finding["kind"], finding["s"])
        told.append(", ".join(f"{kind} {s}" for kind, s in first.items()) or "-")
    return "; ".join(told)


def expected_text(runs: list[dict]) -> str:
    first = runs[0]
    if first.get("action"):
        hit = ", ".join(str(node) for node in sorted({r["action_node"] for r in runs}))
        return f"{first['expected_verdict']} ({first['action']} node {hit})"
    return first["expected_verdict"] or ("crash: torchrun's exit" if first.get("expect_crash") else "no page")


def grouped(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Each table row's runs: (scenario, "nodes x ranks (rendezvous)") -> its runs, rows in order of first run."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        nodes = f"{record['nnodes']} x {record['nproc_per_node']}"
        nodes += f" ({record['rdzv']})" if record["nnodes"] > 1 else ""
        groups.setdefault((record["scenario"], nodes), []).append(record)
    return groups


def summarize(records: list[dict]) -> str:
    lines = [
        "| scenario | nodes x ranks | runs | correct | expected | got (culprits) | fault -> first page p50 / p90 (s) "
        "| report p50 / p90 (s) | bundle p50 / p90 (s) | fault -> webhook p50 / p90 (s) | triggers (dedup keys) "
        "| paged by (node, per run) | false pages | stall timeout (s) | processes left behind "
        "| performance findings (first, s after the fault) |",
        "|" + " --- |" * 16,
    ]
    for (scenario, nodes), runs in grouped(records).items():
        got = sorted({outcome(node) for r in runs for node in r["nodes"]})
        # Older records have no "reports": their "pages" counted every wrapper that showed a verdict.
        false_pages = "-"
        if scenario in HEALTHY:
            false_pages = sum(r.get("reports", r["pages"]) + r["webhook_triggers"] > 0 for r in runs)
        paged_by = "; ".join(",".join(map(str, r["paged_by"])) or "-" for r in runs) if "paged_by" in runs[0] else "?"
        stall = [n.get("stall_timeout_s") for r in runs for n in r["nodes"]]
        lines.append(
            f"| {scenario} | {nodes} | {len(runs)} | {sum(r['correct'] for r in runs)} | {expected_text(runs)} | "
            f"{'; '.join(got)} | "
            f"{percentiles([r['page_s'] for r in runs])} | {percentiles([r['report_s'] for r in runs])} | "
            f"{percentiles([r['bundle_s'] for r in runs])} | {percentiles([r['webhook_s'] for r in runs])} | "
            f"{sum(r['webhook_triggers'] for r in runs)} ({sum(r['webhook_keys'] for r in runs)}) | {paged_by} | "
            f"{false_pages} | {percentiles(stall)} | {sum(r.get('leftover_processes', 0) for r in runs)} | "
            f"{perf_summary(runs)} |"
        )
    return "\n".join(lines)


def summarize_failures(records: list[dict]) -> str:
    """The failure matrix (issue 44): jobs that die, and jobs the user ends; from the first death to page and bundle."""
    lines = [
        "| scenario | nodes x ranks | runs | correct | expected | got (culprits) "
        "| first death -> page p50 / p90 / max (s) | first death -> bundle p50 / p90 / max (s) | runs with a bundle "
        "| pages |",
        "|" + " --- |" * 10,
    ]
    groups = grouped([record for record in records if record["scenario"] in DIES])
    for (scenario, nodes), runs in groups.items():
        got = sorted({outcome(node) for r in runs for node in r["nodes"]})
        page = [r.get("page_from_death_s") for r in runs]
        bundle = [r.get("bundle_from_death_s") for r in runs]
        lines.append(
            f"| {scenario} | {nodes} | {len(runs)} | {sum(r['correct'] for r in runs)} | {expected_text(runs)} | "
            f"{'; '.join(got)} | {percentiles(page)} / {_most(page)} | {percentiles(bundle)} / {_most(bundle)} | "
            f"{sum(any(n['bundles'] for n in r['nodes']) for r in runs)} | {sum(r['webhook_triggers'] for r in runs)} |"
        )
    return "\n".join(lines) if groups else ""


def _most(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{max(present):.2f}" if present else "-"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="skip,syscall,sigstop,long_kernel,none")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    sizes = ("tiny", "short", "short_compute", "long")
    parser.add_argument("--size", choices=sizes, help="default: short on cuda, tiny on cpu")
    parser.add_argument("--nproc", type=int, help="ranks per node (default: 2 on one node, 1 with several)")
    parser.add_argument("--nnodes", type=int, default=1, help="N > 1: N wrappers on this machine")
    parser.add_argument("--rdzv", choices=("static", "c10d"), default="static", help="rendezvous with several nodes")
    parser.add_argument("--fault-ranks", default="0,-1", help="cycled over repeats; -1 is the last rank")
    parser.add_argument("--fault-steps", default="60,200", help="cycled over repeats")
    parser.add_argument("--steps-after", type=int, default=150, help="steps the job runs past the fault step")
    parser.add_argument("--pause-s", type=float, default=40.0, help="pause and checkpoint length")
    parser.add_argument("--pg-timeout-s", type=float, default=5.0, help="pg_timeout: the process group's timeout")
    parser.add_argument("--stall-timeout-floor", type=float, help="passed to the wrapper (its default: 5 s)")
    parser.add_argument("--wrapper-arg", action="append", default=[], help="one more wrapper option (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run (pause, checkpoint: + --pause-s)")
    parser.add_argument("--peer-grace", type=float, default=60.0, help="nodes: seconds the others have once one ended")
    parser.add_argument("--budget", type=float, default=480.0, help="start no run that could end after this (seconds)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    parser.add_argument("--name", default="fault", help="output file stem")
    parser.add_argument(
        "--gpu-each",
        action="store_true",
        help="each wrapper its own GPUs, a share of those visible (nnodes x nproc of them), as on separate hosts",
    )
    parser.add_argument("--summarize", nargs="+", metavar="JSONL", help="only print the table of these files")
    args = parser.parse_args()
    if args.nnodes < 1:
        parser.error("--nnodes must be 1 or more")
    if args.nnodes == 1 and any(EXPECT[s].node_action in ("freeze", "kill") for s in args.scenarios.split(",")):
        parser.error("freeze_node and kill_store_node need --nnodes 2 or more")
    args.size = args.size or ("short" if args.device == "cuda" else "tiny")
    args.nproc = args.nproc or (2 if args.nnodes == 1 else 1)
    return args


def main() -> int:
    args = parse_args()
    if args.summarize:
        lines = [line for name in args.summarize for line in Path(name).read_text().splitlines() if line]
        records = [json.loads(line) for line in lines]
        print("\n\n".join(table for table in (summarize(records), summarize_failures(records)) if table))
        return 0
    scenarios = [s for s in args.scenarios.split(",") if not (EXPECT[s].gpu_only and args.device == "cpu")]
    world = args.nproc * args.nnodes
    ranks = [int(r) % world for r in args.fault_ranks.split(",")]
    steps = [int(s) for s in args.fault_steps.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    receiver = WebhookReceiver()
    receiver.start()
    records, began, skipped = [], time.monotonic(), []
    with tarfile.open(out / f"{args.name}-logs.tar.gz", "w:gz") as logs:
        for n in range(args.repeats):
            for scenario in scenarios:
                worst = args.timeout + (args.pause_s if EXPECT[scenario].long else 0) + 30  # + ending the tree
                if time.monotonic() - began + worst > args.budget:
                    skipped.append(f"{scenario}#{n}")
                    continue
                record = run_once(args, receiver, scenario, ranks[n % len(ranks)], steps[n % len(steps)], n, logs)
                records.append(record)
                brief = {k: v for k, v in record.items() if k != "nodes"}
                brief["verdicts"] = [(n["verdict"], n["culprit_ranks"], n["returncode"]) for n in record["nodes"]]
                print(json.dumps(brief), file=sys.stderr, flush=True)
                with (out / f"{args.name}.jsonl").open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
    table = "\n\n".join(t for t in (summarize(records), summarize_failures(records)) if t)
    if skipped:
        table += f"\n\nNot started (budget {args.budget:g} s): {', '.join(skipped)}"
    (out / f"{args.name}.md").write_text(table + "\n")
    print(table)
    return 0 if records and all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
