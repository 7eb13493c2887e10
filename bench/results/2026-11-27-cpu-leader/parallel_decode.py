"""Tried for issue 32 and not kept: the leader's gather of compact evidence with the payloads decoded in worker
processes (a pool started before the gather) and folded in the leader as they come back, against decoding and folding
in the leader alone.  Leader CPU and wall seconds per run; the pickled events cost the leader more to load than the
payloads cost to decode.  From the repository's root: ``PYTHONPATH=.:bench python <this file> 1024 4096``."""

from __future__ import annotations

import gc
import pickle
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import cluster_leader

from ncclwatch.watchdog.cluster.judge import JobEvidence
from ncclwatch.watchdog.cluster.payload import paused_gc, unpack
from ncclwatch.watchdog.events import Event
from ncclwatch.watchdog.hang.state import JobState

CHUNK = 32  # nodes a task


def decoded(items: list[tuple[int, bytes]]) -> list[tuple[int, list[Event]]]:
    return [(node, unpack(raw, f"node {node}").events) for node, raw in items]  # type: ignore[union-attr]


def measure(pool: ProcessPoolExecutor, nnodes: int) -> None:
    stall = cluster_leader.bench.stall_at(time.time())
    items = list(cluster_leader.payloads(nnodes, 8, stall).items())
    local = JobState()
    for event in cluster_leader.bench.node_evidence(0, 8, nnodes, stall):
        local.apply(event)
    chunks = [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
    list(pool.map(decoded, chunks[:2]))  # the workers started and their imports done, as before an incident

    def serial() -> None:
        evidence = JobEvidence(local, stall)
        for node, raw in items:
            evidence.add(node, unpack(raw, f"node {node}").events)  # type: ignore[union-attr]

    def parallel() -> None:
        evidence = JobEvidence(local, stall)
        for result in pool.map(decoded, chunks):
            for node, events in result:
                evidence.add(node, events)

    sample = items[:256]
    blob = pickle.dumps(decoded(sample), pickle.HIGHEST_PROTOCOL)
    with paused_gc():
        cpu = time.process_time()
        decoded(sample)
        per_decode = (time.process_time() - cpu) / len(sample)
        cpu = time.process_time()
        pickle.loads(blob)
        per_load = (time.process_time() - cpu) / len(sample)
    print(
        f"{nnodes} nodes: per node, decoding {per_decode * 1e6:.0f} us, loading its pickled events "
        f"{per_load * 1e6:.0f} us ({len(blob) // len(sample)} bytes)"
    )
    for run in range(3):
        for name, gather in (("serial", serial), ("parallel, 2 workers", parallel)):
            with paused_gc(freeze=True):
                cpu, wall = time.process_time(), time.perf_counter()
                gather()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            gc.unfreeze()
            gc.collect()
            print(f"{nnodes} nodes, run {run + 1}, {name}: leader CPU {cpu:.3f} s, wall {wall:.3f} s", flush=True)


def main() -> None:
    pool = ProcessPoolExecutor(2, mp_context=get_context("forkserver"))
    for nnodes in map(int, sys.argv[1:]):
        measure(pool, nnodes)
    pool.shutdown()


if __name__ == "__main__":
    main()
