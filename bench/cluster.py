"""What the sidecars' exchange costs the job's TCPStore, and how fast the leader judges a hang, at 64 to 4,096 nodes.

For each ``--nodes`` size, N simulated sidecars (``Cluster`` objects, the
library's own code, one store connection each) run against a real torch
TCPStore (libuv) in a process of its own, spread over ``--procs``
processes so the simulator is not the bottleneck.  Measured:

- steady state (every sidecar publishes its summary and reads the view
  every PUBLISH_S, at a random phase, as real nodes do): requests/s and
  bytes/s at the store, requests per node per round (members and the
  leader apart: the leader runs alone in one process, so that process's CPU
  is its CPU), per-sidecar CPU as a share of a core, the slowest round and
  whether rounds fell behind their slot (``lagging``: the simulator, not
  the store, is the limit), whether every node agrees on the leader and
  the view counts all N nodes;
- the job's own store latency: a process with torch's client doing what
  torchrun's keep-alive and the job do (set, get, add, wait, check) at
  LATENCY_OPS_S, during the sidecars' steady state and, as long, without
  them (half before they start, half after they stop: the two halves'
  p99s show the noise): p50/p99 per operation and overall, and the p99
  ratio loaded / idle;
- at a hang (a fresh run id, every member exchanging every HOT_S): each
  member shares its compact evidence (8 ranks: workers, /proc samples,
  stacks, a 2,000-entry Flight Recorder ring trimmed by ``pack``, NCCL
  tails; one rank of the last node one collective behind); the leader, in
  this process, runs ``JobJudging._judge_job`` (live/job_judging.py)'s sequence step by step
  (gather compact, judge, focus, ask full, gather full, judge) and
  publishes the verdict; the members follow it.  Bytes the leader read,
  gather / judge / total time (wall and CPU per step), the verdict and
  culprits, the bytes members read to follow it, how long until all
  followed, the leader's peak RSS, whether the leadership moved meanwhile;
- the store's keys and RSS: before load, in steady state, during the
  incident, after it closed and after an elastic restart (every node one
  exchange under ``restart=1``, which deletes its keys of the round
  before): the incident's round must go back to N+1 keys.

Nothing waits forever: every call to a process has a deadline, the
incident has ``--hang-limit`` (a step still running then is named in
``timed_out_in``), the store process exits when the bench closes its stdin.
The JSON (``--out``) is rewritten after each size.  From the repository's
root, ncclwatch installed or ``PYTHONPATH=.``:

    python bench/cluster.py --nodes 64 256 1024 4096 --duration 20 --hang-limit 60 --out cluster.json
    python bench/cluster.py --nodes 16 64 --procs 2 --duration 10     # a 2-core machine

Needs torch (the store and the latency client) and psutil (the store's RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from importlib.metadata import version
from multiprocessing.connection import Connection

import psutil

from ncclwatch.watchdog.cluster.handoff import VerdictHandoff
from ncclwatch.watchdog.cluster.incident_evidence import EVIDENCE_WAIT_S, FULL_NODES, FULL_WAIT_S, IncidentEvidence
from ncclwatch.watchdog.cluster.judge import JobEvidence, focus, incident_key, with_lost_nodes
from ncclwatch.watchdog.cluster.lost import LostNodes
from ncclwatch.watchdog.cluster.payload import TAIL_SHARED, pack, paused_gc, unpack
from ncclwatch.watchdog.cluster.peers import Cluster, Membership
from ncclwatch.watchdog.cluster.store import StoreClient, StoreError
from ncclwatch.watchdog.cluster.view import HOT_S, PUBLISH_S, NodeSummary
from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpSig,
    OpState,
    ProcessState,
    SequenceTail,
    StackDump,
    Stall,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.state import JobState

HOST = "127.0.0.1"
FR_ENTRIES = 2000  # each rank's Flight Recorder ring (torch's default size); pack keeps the newest
ISSUED = 5000  # collectives each rank issued before the hang
LATENCY_OPS_S = 50  # the job's client: 10 rounds/s of set, get, add, wait, check (a p99 needs samples)
LAG_S = PUBLISH_S / 10  # a round that starts later than this after its slot: the simulator falls behind
CALL_S = 120.0  # the longest a worker process may take to answer one command
JOIN_S = 10 * PUBLISH_S  # the longest the nodes may take to join a view
Samples = dict[str, list[float]]  # the job's client: operation -> latencies (ms)
STORE_CODE = """
import resource, sys, torch.distributed as dist
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)  # a socket a node
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()  # serve until the bench closes our stdin, or dies
"""


# -- the store, in a process of its own -----------------------------------


class Store:
    """torch's TCPStore server (libuv, torch's default) in its own process: its RSS is the store's alone."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STORE_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the store did not start (said {line!r})")
        self.port = int(line)

    def rss_mb(self) -> float:
        return round(psutil.Process(self.proc.pid).memory_info().rss / 1e6, 1)

    async def keys(self) -> int:
        # Seen here on both of torch's backends, with torch's own client too: now and then a fresh connection's
        # first answer comes 5 s late.  The bench's own count waits it out (the sidecars keep their 5 s).
        client = StoreClient(HOST, self.port, timeout_s=30)
        try:
            return await client.num_keys()
        finally:
            await client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- what a node says and shares ------------------------------------------


def summary(node: int, ranks: int, nnodes: int, phase: str) -> NodeSummary:
    now = time.time()
    return NodeSummary(
        node=node,
        host=f"node{node}",
        at=now,
        ranks=list(range(node * ranks, (node + 1) * ranks)),
        last_progress=now,
        phase=phase,
        world_size=nnodes * ranks,
        started_at=now - 600,
    )


@lru_cache(maxsize=2)
def ring(total: int) -> list[FrEntry]:
    """A rank's Flight Recorder ring after ``total`` all-reduces, the newest still running.  The same on every
    rank issuing as many, so it is built once per process (frozen models), not 2,000 validations per rank."""
    frames = [FrFrame(name="step", filename="/opt/train/loop.py", line=42)] * 12
    return [
        FrEntry(
            index=i,
            pg_id="0",
            collective_seq_id=total - FR_ENTRIES + i + 1,
            profiling_name="nccl:all_reduce",
            op="AllReduce",
            is_p2p=False,
            input_sizes=[[1 << 20]],
            input_dtypes=["BFloat16"],
            state=OpState.completed if i < FR_ENTRIES - 1 else OpState.started,
            frames=frames,
        )
        for i in range(FR_ENTRIES)
    ]


@lru_cache(maxsize=2)
def default_group(world: int) -> dict[str, FrProcessGroup]:
    return {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(range(world)))}


def node_evidence(node: int, ranks: int, nnodes: int, stall: Stall) -> list[Event]:
    """One node's evidence at a probe, as the sidecar shares it; the job's last rank issued one collective fewer."""
    world = nnodes * ranks
    events: list[Event] = []
    for local in range(ranks):
        rank = node * ranks + local
        pid = 10_000 + rank
        events.append(
            WorkerSeen(
                pid=pid,
                rank=rank,
                local_rank=local,
                world_size=world,
                host=f"node{node}",
                at=stall.at - 600,
                node_rank=node,
                nnodes=nnodes,
            )
        )
        events += [ProcessState(pid=pid, rank=rank, state="S", cpu_seconds=1.0, at=stall.at - i) for i in range(8)]
        frames = [f"frame{i} (/opt/train/model.py:{100 + i})" for i in range(20)]
        stack = ThreadStack(name="MainThread", frames=frames)
        events.append(StackDump(pid=pid, threads=[stack], cite=Citation(file="py-spy")))
        total = ISSUED - (rank == world - 1)
        events.append(
            FrDump(
                rank=rank,
                version="2.10",
                process_groups=default_group(world),
                entries=ring(total),
                cite=Citation(file=f"fr/{rank}"),
            )
        )
        sigs = [OpSig("AllReduce", 1 << 20, "9", "0", 0)] * TAIL_SHARED
        events.append(
            SequenceTail(
                comm_key="nccl:0xabc",
                label="commId 0xabc",
                nranks=world,
                comm_rank=rank,
                global_rank=rank,
                host=f"node{node}",
                pid=pid,
                base=total - TAIL_SHARED,
                sigs=sigs,
            )
        )
    return events + [stall]


def stall_at(at: float) -> Stall:
    return Stall(at=at, stalled_for_s=20.0, stall_timeout_s=15.0, progress_timeout_s=1800.0)


# -- simulated sidecars: many per process ---------------------------------


class CountingClient(StoreClient):
    """Counts the evidence the leader reads (values of ``compact/`` and ``full/`` keys, length prefixes included)."""

    evidence_read = 0

    async def multi_get(self, keys: list[str]) -> list[bytes | None]:
        values = await super().multi_get(keys)
        if keys and ("/compact/" in keys[0] or "/full/" in keys[0]):
            self.evidence_read += sum(8 + len(v or b"") for v in values)
        return values


@dataclass
class Node:
    """One simulated sidecar and what it did since the last ``mark``."""

    cluster: Cluster
    rounds: int = 0
    errors: int = 0
    worst_round_s: float = 0.0
    worst_lag_s: float = 0.0
    base: tuple[int, int, int, int] = (0, 0, 0, 0)  # requests, sent, received, rounds at the mark
    full_sent: int = 0
    followed_at: float | None = None  # when it read the leader's verdict
    verdict_read: int = 0  # bytes it read to follow it
    culprits: list[int] = field(default_factory=list)
    evidence: IncidentEvidence = field(init=False)  # the cluster's roles at a stall (``live/job_judging.Met``)
    verdicts: VerdictHandoff = field(init=False)
    lost: LostNodes = field(init=False)

    def __post_init__(self) -> None:
        self.evidence = IncidentEvidence(self.cluster)
        self.verdicts = VerdictHandoff(self.cluster, self.evidence)
        self.lost = LostNodes(self.cluster)

    def counters(self) -> tuple[int, int, int, int]:
        client = self.cluster.client
        return client.requests, client.sent_bytes, client.received_bytes, self.rounds


class Sim:
    """The simulated sidecars of one process: each exchanges on a fixed grid; during an incident each also
    sends its full evidence when asked and follows the leader's verdict, as ``Nodes._follow`` (live/nodes.py) does."""

    def __init__(self, port: int, nnodes: int, ranks: int) -> None:
        self.port, self.nnodes, self.ranks = port, nnodes, ranks
        self.nodes: list[Node] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.running = False
        self.stall: Stall | None = None  # set during an incident
        self.marked = (0.0, 0.0)  # wall, CPU at the mark

    def cluster(self, run: str, node: int, restart: int = 0) -> Cluster:
        membership = Membership(HOST, self.port, run, restart, node, self.nnodes)
        return Cluster(membership, f"node{node}", client=CountingClient(HOST, self.port))

    async def start(self, run: str, nodes: list[int], period: float, stall: float | None) -> None:
        self.stall = stall_at(stall) if stall is not None else None
        self.nodes = [Node(self.cluster(run, n)) for n in nodes]
        self.running = True
        self.tasks = [asyncio.create_task(self._rounds(node, random.uniform(0, period), period)) for node in self.nodes]

    async def _rounds(self, node: Node, offset: float, period: float) -> None:
        next_at = time.monotonic() + offset
        phase = "watching" if self.stall is None else "suspect"
        while self.running:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            started = time.monotonic()
            node.worst_lag_s = max(node.worst_lag_s, started - next_at)
            try:
                await node.cluster.exchange(summary(node.cluster.me, self.ranks, self.nnodes, phase))
                if self.stall is not None:
                    await self._follow(node, self.stall)
            except StoreError:
                node.errors += 1
            node.rounds += 1
            node.worst_round_s = max(node.worst_round_s, time.monotonic() - started)
            next_at += period

    async def _follow(self, node: Node, stall: Stall) -> None:
        cluster, client, evidence = node.cluster, node.cluster.client, node.evidence
        if (opened := evidence.full_wanted(stall.at)) is not None:
            sent = client.sent_bytes
            await evidence.share("full", node_evidence(cluster.me, self.ranks, self.nnodes, stall), stall.at)
            evidence.full_shared(opened)
            node.full_sent += client.sent_bytes - sent
        received = client.received_bytes
        verdict = await node.verdicts.read()
        node.verdict_read += client.received_bytes - received
        if verdict is not None:
            node.followed_at, node.culprits = time.time(), list(verdict.decision.finding.culprits)
            await evidence.drop_own()

    async def status(self) -> dict:
        views = [n.cluster.view for n in self.nodes]
        return {
            "joined": all(v is not None and v.joined == self.nnodes for v in views),
            "followed": sum(n.followed_at is not None for n in self.nodes),
        }

    async def mark(self) -> None:
        for node in self.nodes:
            node.base, node.errors = node.counters(), 0
            node.worst_round_s = node.worst_lag_s = 0.0
        self.marked = (time.monotonic(), time.process_time())

    async def share(self) -> dict:
        """Every node's compact evidence, as each sidecar shares it at its probe: bytes sent and CPU per node."""
        assert self.stall is not None
        sent, cpu = [], []
        for node in self.nodes:
            events = node_evidence(node.cluster.me, self.ranks, self.nnodes, self.stall)
            client, started, before = node.cluster.client, time.process_time(), node.cluster.client.sent_bytes
            await node.evidence.share("compact", events, self.stall.at)  # pack (trim, journal, zlib) and set
            sent.append(client.sent_bytes - before)
            cpu.append(time.process_time() - started)
            await asyncio.sleep(0)  # each node packs on its own CPU: the others' rounds go on meanwhile
        return {"sent": sent, "cpu": cpu}

    async def stop(self) -> dict:
        """Stop every node; what each role did since the mark."""
        wall, cpu = time.monotonic() - self.marked[0], time.process_time() - self.marked[1]
        roles: dict[str, list[int]] = {}
        for node in self.nodes:
            role = "leader" if node.cluster.leads() else "members"
            totals = roles.setdefault(role, [0, 0, 0, 0, 0])
            totals[:4] = [t + now - then for t, now, then in zip(totals, node.counters(), node.base)]
            totals[4] += 1
        # Python 3.11's wait_for swallows a cancel that lands as its awaitable completes, which a task looping
        # on store requests nearly always is: the flag ends those at their next round, the cancel the sleepers.
        self.running = False
        for task in self.tasks:
            task.cancel()
        _, running = await asyncio.wait(self.tasks, timeout=30) if self.tasks else (set(), set())
        for node in self.nodes:
            await node.cluster.client.close()
        nodes = self.nodes
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "roles": roles,
            "unstopped": len(running),
            "errors": sum(n.errors for n in nodes),
            "worst_round_s": max((n.worst_round_s for n in nodes), default=0.0),
            "worst_lag_s": max((n.worst_lag_s for n in nodes), default=0.0),
            "leaders": sorted({n.cluster.leader() for n in nodes}),
            "joined_min": min((n.cluster.view.joined if n.cluster.view else 0 for n in nodes), default=self.nnodes),
            "full_sent": [n.full_sent for n in nodes if n.full_sent],
            "followed_at": [n.followed_at for n in nodes if n.followed_at is not None],
            "verdict_read": sum(n.verdict_read for n in nodes),
            "culprits": sorted({tuple(n.culprits) for n in nodes if n.followed_at is not None}),
        }

    async def restart(self, run: str, nodes: list[int]) -> int:
        """An elastic restart: each node's first exchange of the new round deletes its keys of the round before.
        A node whose exchange fails tries again as a new sidecar would (a new connection); the failures."""
        failures = 0
        for node in nodes:
            for _ in range(3):
                cluster = self.cluster(run, node, restart=1)
                try:
                    await cluster.exchange(summary(node, self.ranks, self.nnodes, "watching"))
                    break
                except StoreError:
                    failures += 1
                finally:
                    await cluster.client.close()
        return failures


def worker_main(conn: Connection, port: int, nnodes: int, ranks: int, seed: int) -> None:
    """A simulator process: runs the bench's commands (Sim's methods) in one event loop until told to exit."""
    random.seed(seed)

    async def serve() -> None:
        sim, loop = Sim(port, nnodes, ranks), asyncio.get_running_loop()
        while True:
            try:
                name, args = await loop.run_in_executor(None, conn.recv)
            except EOFError:  # the bench is gone
                return
            if name == "exit":
                return
            try:
                conn.send(("ok", await getattr(sim, name)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))

    asyncio.run(serve())


class Workers:
    """The simulator's processes (spawned: no fork of this process's state), driven through pipes."""

    def __init__(self, procs: int, port: int, nnodes: int, ranks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for i in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, port, nnodes, ranks, i), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def call(self, name: str, args: list[tuple] | tuple = (), timeout: float = CALL_S) -> list:
        """Every process runs ``name`` (with its own args when given a list); their answers, in order."""
        for i, conn in enumerate(self.conns):
            conn.send((name, args[i] if isinstance(args, list) else args))
        deadline, answers = time.monotonic() + timeout, []
        for i, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):  # its answer would come to the next call: fatal
                raise RuntimeError(f"simulator process {i} did not answer {name!r} in {timeout:.0f} s")
            status, answer = conn.recv()
            if status != "ok":
                raise RuntimeError(f"simulator process {i}, {name!r}:\n{answer}")
            answers.append(answer)
        return answers

    def members(self, nnodes: int) -> list[list[int]]:
        """Nodes 1..N-1 over every process (the leader, node 0, runs in the bench's own)."""
        return spread(range(1, nnodes), len(self.conns))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def spread(nodes: range, parts: int) -> list[list[int]]:
    return [list(nodes[i::parts]) for i in range(parts)]


# -- the job's own store client -------------------------------------------


def probe_main(conn: Connection, port: int) -> None:
    """Torch's own client, as torchrun's rendezvous keep-alive and the job use it; measures on request."""
    import torch.distributed as dist  # here only: the simulator's processes never import torch

    store = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set("bench/job/ready", "1")
    ops: dict[str, Callable[[], object]] = {
        "set": lambda: store.set("bench/job/keep_alive", str(time.time())),
        "get": lambda: store.get("bench/job/keep_alive"),
        "add": lambda: store.add("bench/job/counter", 1),
        "wait": lambda: store.wait(["bench/job/ready"], timedelta(seconds=10)),
        "check": lambda: store.check(["bench/job/ready"]),
    }
    conn.send("ready")
    while True:
        try:
            seconds = conn.recv()
        except EOFError:
            return
        if seconds is None:
            return
        samples: Samples = {op: [] for op in ops}
        next_at = time.monotonic()
        end = next_at + seconds
        while next_at < end:
            time.sleep(max(0.0, next_at - time.monotonic()))
            for name, op in ops.items():
                started = time.perf_counter()
                op()
                samples[name].append(1000 * (time.perf_counter() - started))
            next_at += len(ops) / LATENCY_OPS_S
        conn.send(samples)


class Probe:
    """The process of ``probe_main``: ``begin`` a measurement, collect its ``samples``."""

    def __init__(self, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=probe_main, args=(child, port), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the latency client did not start")

    def begin(self, seconds: float) -> None:
        self.conn.send(seconds)

    def samples(self, seconds: float) -> Samples:
        if not self.conn.poll(seconds + 30):
            raise TimeoutError("the latency client did not answer")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": round(ordered[-1], 3)}


def latency_report(before: Samples, after: Samples, loaded: Samples) -> dict:
    """p50/p99 per operation and overall: idle (before the sidecars start and after they stop, pooled; the two
    p99s apart show the noise) and loaded (their steady state); the p99 ratio loaded / idle."""
    out = {}
    for op in [*loaded, "all"]:

        def pick(samples: Samples, op: str = op) -> list[float]:
            return [v for values in samples.values() for v in values] if op == "all" else samples[op]

        idle, with_load = percentiles(pick(before) + pick(after)), percentiles(pick(loaded))
        out[op] = {
            "idle": idle,
            "loaded": with_load,
            "p99_ratio": round(with_load["p99_ms"] / idle["p99_ms"], 2),
            "idle_p99_before_after_ms": [percentiles(pick(before))["p99_ms"], percentiles(pick(after))["p99_ms"]],
        }
    return out


# -- steady state ---------------------------------------------------------


def wait_joined(workers: Workers, what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not all(status["joined"] for status in workers.call("status")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not every node saw all nodes join within {JOIN_S:.0f} s")
        time.sleep(0.5)


def steady_state(workers: Workers, probe: Probe | None, nnodes: int, duration: float) -> tuple[dict, dict | None]:
    """Every node exchanges every PUBLISH_S; counted from the moment every node's view holds all N, for
    ``duration``, while the job's client measures its latency."""
    shares = [[0], *spread(range(1, nnodes), len(workers.conns) - 1)]  # the leader alone: its process's CPU is its own
    workers.call("start", [("steady", share, PUBLISH_S, None) for share in shares])
    wait_joined(workers, "steady state")
    workers.call("mark")
    loaded = None
    if probe is not None:
        probe.begin(duration)
        loaded = probe.samples(duration)
    else:
        time.sleep(duration)
    return steady_figures(workers.call("stop")), loaded


def role_figures(stats: list[dict], role: str) -> dict:
    """Per node and round for one role: requests, bytes; per sidecar: CPU (processes hosting that role only)."""
    hosts = [s for s in stats if role in s["roles"]]
    requests, sent, received, rounds, count = (sum(s["roles"][role][i] for s in hosts) for i in range(5))
    cpu_share = sum(s["cpu_s"] / s["wall_s"] for s in hosts) / max(count, 1)
    return {
        "sidecars": count,
        "requests_per_round": round(requests / max(rounds, 1), 2),
        "sent_bytes_per_round": round(sent / max(rounds, 1)),
        "received_bytes_per_round": round(received / max(rounds, 1)),
        "cpu_share_of_a_core": round(cpu_share, 5),
        "cpu_ms_per_round": round(1000 * cpu_share * PUBLISH_S, 3),
        "worst_round_s": round(max((s["worst_round_s"] for s in hosts), default=0.0), 4),
    }


def steady_figures(stats: list[dict]) -> dict:
    """Rates at the store (every client's counters over its process's window) and what each sidecar costs."""

    def per_s(i: int) -> float:
        return sum(sum(totals[i] for totals in s["roles"].values()) / s["wall_s"] for s in stats)

    worst_lag = max(s["worst_lag_s"] for s in stats)
    return {
        "window_s": round(max(s["wall_s"] for s in stats), 1),
        "requests_per_s": round(per_s(0)),
        "bytes_in_per_s": round(per_s(1)),
        "bytes_out_per_s": round(per_s(2)),
        "members": role_figures(stats, "members"),
        "leader": role_figures(stats[:1], "leader"),
        "worst_lag_s": round(worst_lag, 4),
        "lagging": worst_lag > LAG_S,
        "errors": sum(s["errors"] for s in stats),
        "unstopped": sum(s["unstopped"] for s in stats),
        "leaders": sorted({leader for s in stats for leader in s["leaders"]}),
        "joined_min": min(s["joined_min"] for s in stats),
    }


# -- at a hang ------------------------------------------------------------


class HangLimit(Exception):
    """``--hang-limit`` ran out."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """asyncio cannot cancel CPU-bound steps (parsing thousands of nodes' evidence); SIGALRM interrupts them."""

    def expire(signum: int, frame: object) -> None:
        raise HangLimit()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def step(out: dict, name: str) -> Iterator[None]:
    """Time one step of the leader's (wall and this process's CPU); the step in progress names a timeout."""
    out["step"] = name
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    out["steps"][name] = {"wall_s": round(time.perf_counter() - wall, 4), "cpu_s": round(time.process_time() - cpu, 4)}


async def lead_incident(node: Node, local: JobState, stall: Stall, out: dict) -> None:
    """The leader's side, as ``JobJudging._judge_job`` (live/job_judging.py) runs it and ``page`` publishes it, step
    by step. (The leader's own exchanges go on meanwhile, as in the sidecar: their CPU is in the steps' CPU.)"""
    leader, leader_evidence = node.cluster, node.evidence
    client = leader.client
    assert isinstance(client, CountingClient)
    received, started = client.received_bytes, time.perf_counter()
    with step(out, "open_incident"):
        await leader_evidence.open_incident(stall.at)
    answering = leader.answering()
    evidence = JobEvidence(local, stall)
    with paused_gc(freeze=True):
        with step(out, "gather_compact"):
            remote = await leader_evidence.gather("compact", answering, stall.at, EVIDENCE_WAIT_S, fold=evidence.add)
        out["compact_read_bytes"] = client.evidence_read
        with step(out, "judge_compact"):
            decision = evidence.judge()
        if want := focus(decision, evidence.nodes_of, set(node.lost.lost()), FULL_NODES):
            with step(out, "ask_full"):
                await leader_evidence.open_incident(stall.at, want, since=evidence.state().fewest_issued())
            with step(out, "gather_full"):
                remote |= await leader_evidence.gather("full", set(want), stall.at, FULL_WAIT_S, fold=evidence.add)
            with step(out, "judge_full"):
                decision = evidence.judge()
    decision = with_lost_nodes(decision, node.lost.lost(), remote)
    with step(out, "publish_verdict"):
        await node.verdicts.publish(incident_key(leader.membership, decision), decision)
    out.update(
        total_s=round(time.perf_counter() - started, 3),
        published_at=time.time(),
        verdict=decision.finding.verdict.value,
        culprits=list(decision.finding.culprits),
        full_asked=want,
        pending=sorted(answering - set(remote)),
        evidence_read_bytes=client.evidence_read,
        leader_read_bytes=client.received_bytes - received,
    )


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def incident(workers: Workers, store: Store, nnodes: int, ranks: int, out: dict) -> None:
    """A hang in a fresh run: every node hot (HOT_S), the members share, the leader judges here, the members
    follow, the leader closes the incident.  Keys and RSS along the way."""
    lead = Sim(store.port, nnodes, ranks)
    await lead.start("hang", [0], HOT_S, time.time())
    try:
        await follow_incident(lead, workers, store, out)
    finally:  # also when --hang-limit interrupts: the leader's rounds end before asyncio.run waits for them
        await lead.stop()


async def follow_incident(lead: Sim, workers: Workers, store: Store, out: dict) -> None:
    """``incident``'s steps, the leader's rounds going on beside them as in the sidecar."""
    assert lead.stall is not None
    stall, leader, nnodes, ranks = lead.stall, lead.nodes[0].cluster, lead.nnodes, lead.ranks

    async def call(name: str, args: list[tuple] | tuple = (), timeout: float = CALL_S) -> list:
        return await asyncio.to_thread(workers.call, name, args, timeout)

    async def joined() -> bool:
        return leader.view is not None and leader.view.joined == nnodes and len(leader.answering()) == nnodes - 1

    async def followed() -> bool:
        return sum(status["followed"] for status in await call("status")) == nnodes - 1

    out["step"] = "join"
    await call("start", [("hang", share, HOT_S, stall.at) for share in workers.members(nnodes)])
    await until(joined, JOIN_S, "the leader did not hear every node")
    out["keys"]["watching"] = await store.keys()
    await call("mark")
    out["step"] = "share_compact"
    # Each member packs its 8 ranks' 2,000-entry rings (about 10 ms), beside every member's exchange every HOT_S:
    # on the 2-core VM 4,095 members took over 120 s.
    shared = await call("share", timeout=max(CALL_S, nnodes * 0.1))
    packed = sorted(cpu for s in shared for cpu in s["cpu"])
    out["compact_sent_bytes_per_node"] = round(sum(sum(s["sent"]) for s in shared) / (nnodes - 1))
    out["member_pack_ms"] = {"median": round(1000 * packed[len(packed) // 2], 2), "max": round(1000 * packed[-1], 2)}
    out["keys"]["shared"] = await store.keys()
    out["unpack_compact_ms_per_node"] = unpack_cost(nnodes, ranks, stall)
    local = JobState()
    for event in node_evidence(0, ranks, nnodes, stall):
        local.apply(event)
    await lead_incident(lead.nodes[0], local, stall, out)
    out["step"] = "follow"
    await until(followed, 10 * HOT_S + 10, "not every member followed the verdict")
    out["keys"]["followed"], out["rss_mb"]["incident"] = await store.keys(), store.rss_mb()
    out["step"] = "close"
    await lead.nodes[0].evidence.close_incident()
    out["keys"]["closed"] = await store.keys()
    out["step"] = "done"


def unpack_cost(nnodes: int, ranks: int, stall: Stall) -> float:
    """What the leader's gather pays per node to parse one compact payload (ms of CPU): N times this is the
    part of the gather that grows with the job, to tell it from the waiting."""
    one = pack(nnodes - 1, "compact", stall.at, node_evidence(nnodes - 1, ranks, nnodes, stall))
    cpu = time.process_time()
    unpack(one, "one node's compact evidence")
    return round(1000 * (time.process_time() - cpu), 2)


def hang(workers: Workers, store: Store, nnodes: int, ranks: int, limit: float) -> dict:
    """The incident (``--hang-limit`` for all of it), what the members did, then an elastic restart: the
    incident's round must be back to its watching keys.  Keys are counted above the steady run's."""
    out: dict = {"step": "start", "keys": {}, "rss_mb": {}, "steps": {}}
    base = asyncio.run(store.keys())
    try:
        with time_limit(limit):
            asyncio.run(incident(workers, store, nnodes, ranks, out))
    except HangLimit:
        out["timed_out_in"] = f"{out['step']} (--hang-limit {limit:.0f} s)"
    except (TimeoutError, StoreError) as exc:  # the leader never heard every node, they did not follow, no store
        out["timed_out_in"] = f"{out['step']}: {exc}"
    del out["step"]
    out["leader_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)  # this process
    out.update(members_figures(workers.call("stop"), out.pop("published_at", None)))
    failures = asyncio.run(Sim(store.port, nnodes, ranks).restart("hang", [0]))
    failures += sum(workers.call("restart", [("hang", share) for share in workers.members(nnodes)]))
    out["restart_failures"] = failures
    out["keys"]["restarted"], out["rss_mb"]["restarted"] = asyncio.run(store.keys()), store.rss_mb()
    out["keys"] = {name: count - base for name, count in out["keys"].items()}
    keys = out["keys"]
    out["keys_flat"] = keys.get("closed") == keys.get("watching") == keys["restarted"] == nnodes + 1
    return out


def members_figures(stats: list[dict], published: float | None) -> dict:
    """What the members did during the incident: their load, the full evidence they sent, how they followed."""
    full = [sent for s in stats for sent in s["full_sent"]]
    followed = [at for s in stats for at in s["followed_at"]]
    return {
        "leaders_seen": sorted({leader for s in stats for leader in s["leaders"]}),  # more than [0]: a takeover
        "members_requests_per_s": round(sum(sum(t[0] for t in s["roles"].values()) / s["wall_s"] for s in stats)),
        "full_sent_bytes_per_node": round(sum(full) / len(full)) if full else None,
        "followed": len(followed),
        "all_followed_s": round(max(followed) - published, 3) if followed and published else None,
        "follow_read_bytes": sum(s["verdict_read"] for s in stats),
        "culprits_followed": [list(c) for c in sorted({tuple(c) for s in stats for c in s["culprits"]})],
    }


# -- one size, all sizes --------------------------------------------------


def run_size(nnodes: int, args: argparse.Namespace) -> dict:
    """A fresh store and simulator for N nodes: idle latency, steady state (with latency), the hang, idle again."""
    store = Store()
    workers = probe = None
    try:
        out: dict = {"nodes": nnodes, "ranks": nnodes * args.ranks, "procs": args.procs}
        out["rss_mb"] = {"start": store.rss_mb()}
        workers = Workers(args.procs, store.port, nnodes, args.ranks)  # they start while the probe imports torch
        probe = Probe(store.port) if args.latency else None
        workers.call("status")  # every process up and idle: the idle latency is measured without their start-up
        if probe is not None:
            log(nnodes, "idle latency")
            probe.begin(args.duration / 2)
            before = probe.samples(args.duration / 2)
        log(nnodes, "steady state")
        out["steady"], loaded = steady_state(workers, probe, nnodes, args.duration)
        out["rss_mb"]["steady"], out["keys_steady"] = store.rss_mb(), asyncio.run(store.keys())
        if args.hang:
            log(nnodes, "hang")
            out["hang"] = hang(workers, store, nnodes, args.ranks, args.hang_limit)
        if probe is not None and loaded is not None:
            log(nnodes, "idle latency again")
            probe.begin(args.duration / 2)
            out["latency"] = latency_report(before, probe.samples(args.duration / 2), loaded)
        return out
    finally:
        for part in (probe, workers):
            if part is not None:
                part.close()
        store.stop()


def log(nnodes: int, what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {nnodes} nodes: {what}", file=sys.stderr, flush=True)


def steady_row(size: dict) -> dict[str, object]:
    steady, members, leader = size["steady"], size["steady"]["members"], size["steady"]["leader"]
    lat = size.get("latency", {}).get("all")
    return {
        "nodes": size["nodes"],
        "req/s": steady["requests_per_s"],
        "KB/s in/out": f"{steady['bytes_in_per_s'] / 1e3:.0f}/{steady['bytes_out_per_s'] / 1e3:.0f}",
        "req/round m/l": f"{members['requests_per_round']}/{leader['requests_per_round']}",
        "CPU % m/l": f"{100 * members['cpu_share_of_a_core']:.3f}/{100 * leader['cpu_share_of_a_core']:.2f}",
        "worst round ms m/l": f"{1000 * members['worst_round_s']:.0f}/{1000 * leader['worst_round_s']:.0f}",
        "lagging": steady["lagging"],
        "agree": steady["leaders"] == [0] and steady["joined_min"] == size["nodes"],
        "job p99 ms idle>loaded": f"{lat['idle']['p99_ms']}>{lat['loaded']['p99_ms']} ({lat['p99_ratio']}x)"
        if lat
        else "-",
        "store RSS MB": f"{size['rss_mb']['start']}>{size['rss_mb']['steady']}",
    }


def hang_row(size: dict) -> dict[str, object]:
    hang = size["hang"]

    def wall(*steps: str) -> str:
        return f"{sum(hang['steps'].get(step, {}).get('wall_s', 0.0) for step in steps):.2f}"

    return {
        "nodes": size["nodes"],
        "compact/full B/node": f"{hang.get('compact_sent_bytes_per_node')}/{hang.get('full_sent_bytes_per_node')}",
        "leader read KB evidence/all": (
            f"{hang.get('evidence_read_bytes', 0) / 1e3:.0f}/{hang.get('leader_read_bytes', 0) / 1e3:.0f}"
        ),
        "gather s": wall("gather_compact", "gather_full"),
        "judge s": wall("judge_compact", "judge_full"),
        "total s": hang.get("total_s"),
        "verdict": f"{hang.get('verdict')} {hang.get('culprits')}",
        "all followed s": hang.get("all_followed_s"),
        "follow KB": f"{hang['follow_read_bytes'] / 1e3:.0f}",
        "keys watch/closed/restart": "/".join(str(hang["keys"].get(k)) for k in ("watching", "closed", "restarted")),
        "store RSS MB": "/".join(str(v) for v in hang["rss_mb"].values()),
        "timed out in": hang.get("timed_out_in", "-"),
    }


def table(rows: list[dict[str, object]]) -> str:
    cells = [list(rows[0])] + [[str(value) for value in row.values()] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64])
    parser.add_argument("--ranks", type=int, default=8, help="ranks per node")
    parser.add_argument("--procs", type=int, default=max(2, os.cpu_count() or 2), help="simulator processes, >= 2")
    parser.add_argument("--duration", type=float, default=30.0, help="steady-state seconds per size (and as long idle)")
    parser.add_argument("--hang-limit", type=float, default=90.0, help="seconds the whole incident may take per size")
    parser.add_argument("--no-latency", dest="latency", action="store_false")
    parser.add_argument("--no-hang", dest="hang", action="store_false")
    parser.add_argument("--out", help="JSON file, rewritten after each size")
    args = parser.parse_args()
    if args.procs < 2 or min(args.nodes) < 2:
        parser.error("--procs and --nodes must be at least 2: the leader runs in a process of its own")
    result = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "cpu_count": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "publish_s": PUBLISH_S,
        "hot_s": HOT_S,
        "args": vars(args),
        "sizes": [],
    }
    for nnodes in args.nodes:
        started = time.monotonic()
        result["sizes"].append(run_size(nnodes, args))
        result["sizes"][-1]["bench_wall_s"] = round(time.monotonic() - started, 1)
        log(nnodes, f"done in {time.monotonic() - started:.0f} s")
        if args.out:
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
    print(table([steady_row(size) for size in result["sizes"]]))
    if args.hang:
        print(table([hang_row(size) for size in result["sizes"]]))


if __name__ == "__main__":
    main()
