"""The leader's own work at a hang, without the store: what bench/cluster.py's leader does between reading the
evidence and publishing the verdict, on one core, for sizes the simulator cannot reach on a small machine.

bench/cluster.py simulates every member against a real store; on the 2-core VM its 4,095 members could not even
pack their evidence within 410 s beside their exchanges, and at every size the members share the leader's cores.
Here each of N nodes' evidence (bench/cluster.py's ``node_evidence``: 8 ranks, the job's last rank one collective
behind) is packed once as the member would (``payload.pack``), then the leader's steps run in this process alone:

- ``incremental`` (live/job_judging.py's ``_judge_job`` now): each payload decoded and folded as it is read
  (``JobEvidence.add``), judged, the asked node's full evidence replacing its compact evidence in place, judged
  again, cyclic GC paused and the survivors frozen (``paused_gc``);
- ``rebuilt`` (the sequence before issue 32's change, with today's decoder): every payload decoded, the job's state
  built from all of them (``job_state``) and judged, built again with the full evidence and judged again, GC on.

Per step: CPU and wall seconds (median of ``--repeat``), the verdict (the same on both paths, or the run fails).
From the repository's root, ncclwatch installed or ``PYTHONPATH=.``:

    python bench/cluster_leader.py --nodes 256 1024 4096 --repeat 3 --out leader.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cluster as bench  # noqa: E402  (its evidence, by the same name as its own simulator processes use)

from ncclwatch.watchdog.cluster.incident_evidence import FULL_NODES  # noqa: E402
from ncclwatch.watchdog.cluster.judge import JobEvidence, focus, job_state  # noqa: E402
from ncclwatch.watchdog.cluster.payload import pack, paused_gc, unpack  # noqa: E402
from ncclwatch.watchdog.events import Event, Stall, WorkerSeen  # noqa: E402
from ncclwatch.watchdog.hang.classify import classify  # noqa: E402
from ncclwatch.watchdog.hang.snapshot import take_snapshot  # noqa: E402
from ncclwatch.watchdog.hang.state import JobState  # noqa: E402
from ncclwatch.watchdog.hang.types import Decision  # noqa: E402

Steps = dict[str, tuple[float, float]]  # step -> (wall, CPU) seconds


class Clock:
    def __init__(self) -> None:
        self.steps: Steps = {}

    def step(self, name: str, work: Callable[[], object]) -> object:
        wall, cpu = time.perf_counter(), time.process_time()
        result = work()
        self.steps[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        return result


def payloads(nnodes: int, ranks: int, stall: Stall) -> dict[int, bytes]:
    """Every member's compact payload, as it sets it in the store (its events not kept: a leader holds none of the
    other nodes' objects but what it decodes, and the collector walks whatever is alive)."""
    return {
        node: pack(node, "compact", stall.at, bench.node_evidence(node, ranks, nnodes, stall))
        for node in range(1, nnodes)
    }


def incremental(local: JobState, compact: dict[int, bytes], full: Callable[[int], bytes], stall: Stall) -> tuple:
    clock, evidence = Clock(), JobEvidence(local, stall)

    def gather() -> None:
        for node, raw in compact.items():
            payload = unpack(raw, f"node {node}")
            assert payload is not None
            evidence.add(node, payload.events)

    with paused_gc(freeze=True):
        clock.step("gather_compact", gather)
        decision: Decision = clock.step("judge_compact", evidence.judge)  # type: ignore[assignment]
        want = focus(decision, evidence.nodes_of, set(), FULL_NODES)
        clock.step("gather_full", lambda: [evidence.add(n, unpack(full(n), f"node {n}").events) for n in want])  # type: ignore[union-attr]
        decision = clock.step("judge_full", evidence.judge)  # type: ignore[assignment]
    gc.unfreeze()  # the next repeat starts from the same heap
    return clock.steps, decision, want


def rebuilt(local: JobState, compact: dict[int, bytes], full: Callable[[int], bytes], stall: Stall) -> tuple:
    clock = Clock()
    remote: dict[int, list[Event]] = clock.step(  # type: ignore[assignment]
        "gather_compact",
        lambda: {n: unpack(raw, f"node {n}").events for n, raw in compact.items()},  # type: ignore[union-attr]
    )
    decision: Decision = clock.step(  # type: ignore[assignment]
        "judge_compact", lambda: classify(take_snapshot(job_state(local, remote, stall), observed_at=stall.at))
    )
    nodes_of = {e.rank: node for node, events in remote.items() for e in events if isinstance(e, WorkerSeen)}
    want = focus(decision, nodes_of, set(), FULL_NODES)
    clock.step("gather_full", lambda: remote.update({n: unpack(full(n), f"node {n}").events for n in want}))  # type: ignore[union-attr]
    decision = clock.step(  # type: ignore[assignment]
        "judge_full", lambda: classify(take_snapshot(job_state(local, remote, stall), observed_at=stall.at))
    )
    return clock.steps, decision, want


def run_size(nnodes: int, ranks: int, repeat: int) -> dict:
    stall = bench.stall_at(time.time())
    packed = time.process_time()
    compact = payloads(nnodes, ranks, stall)
    out: dict = {"nodes": nnodes, "ranks": nnodes * ranks, "pack_cpu_s": round(time.process_time() - packed, 1)}
    local = JobState()
    for event in bench.node_evidence(0, ranks, nnodes, stall):
        local.apply(event)

    def full(node: int) -> bytes:  # the asked member's, packed when asked (outside the steps' CPU: see below)
        return fulls.setdefault(node, pack(node, "full", stall.at, bench.node_evidence(node, ranks, nnodes, stall)))

    fulls: dict[int, bytes] = {}
    full(nnodes - 1)  # the node asked on every path: its rank is behind

    verdicts = set()
    for name, path in (("incremental", incremental), ("rebuilt", rebuilt)):
        runs = []
        for _ in range(repeat):
            gc.collect()
            steps, decision, want = path(local, compact, full, stall)
            runs.append(steps)
            verdicts.add((decision.finding.verdict.value, decision.finding.culprits, tuple(want)))
        out[name] = {
            step: {
                "wall_s": round(statistics.median(r[step][0] for r in runs), 3),
                "cpu_s": round(statistics.median(r[step][1] for r in runs), 3),
                "cpu_runs_s": [round(r[step][1], 3) for r in runs],
            }
            for step in runs[0]
        }
        out[name]["total_cpu_s"] = round(statistics.median(sum(c for _, c in r.values()) for r in runs), 3)
        out[name]["total_wall_s"] = round(statistics.median(sum(w for w, _ in r.values()) for r in runs), 3)
        print(f"{nnodes} nodes, {name}: {out[name]['total_cpu_s']} s CPU", file=sys.stderr, flush=True)
    if len(verdicts) != 1:
        raise SystemExit(f"{nnodes} nodes: the paths disagree: {sorted(verdicts)}")
    verdict, culprits, want = verdicts.pop()
    out.update(verdict=verdict, culprits=list(culprits), full_asked=list(want))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--ranks", type=int, default=8, help="ranks per node")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="JSON file, rewritten after each size")
    args = parser.parse_args()
    result = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "sizes": [],
    }
    for nnodes in args.nodes:
        result["sizes"].append(run_size(nnodes, args.ranks, args.repeat))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    for size in result["sizes"]:
        print(
            f"{size['nodes']:>6} nodes  {size['verdict']} {size['culprits']}  leader CPU s: "
            + "  ".join(f"{path} {size[path]['total_cpu_s']}" for path in ("incremental", "rebuilt"))
        )


if __name__ == "__main__":
    main()
