"""Stragglers from arrival skew: literal rounds, then real gloo ranks whose Flight Recorder
dumps (torch 2.13, JSON) go through the real parser.

The gloo job runs two groups over the same 3 ranks: on the default group
rank 2 sleeps 30 ms before each all-reduce (a straggler), on the second
group nobody does (the healthy control in the same run).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import NOW

from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, OpState
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.slowness.bandwidth import match_collectives
from ncclwatch.watchdog.slowness.findings import PerfKind
from ncclwatch.watchdog.slowness.stragglers import (
    arrival_round,
    collective_arrivals,
    collective_series,
    last_arrivals,
    stragglers,
)


def rounds(n: int, late: dict[int, float], ranks: int = 4, period: float = 1.0) -> list[dict[int, float]]:
    """``n`` rounds ``period`` apart; rank r arrives ``late.get(r, 0)`` s after the others, plus a little jitter."""
    return [{r: i * period + late.get(r, 0.0) + 0.001 * ((i * 7 + r * 3) % 5) for r in range(ranks)} for i in range(n)]


class TestLastArrivals:
    def test_a_rank_last_by_a_margin_in_most_rounds_is_a_straggler(self):
        stats = last_arrivals(rounds(20, {3: 0.2}))
        assert stats.rounds == 20 and stats.last_counts == {3: 20}
        (finding,) = stragglers(stats, hosts={3: "node1"})
        assert (finding.kind, finding.ranks, finding.hosts) == (PerfKind.straggler, (3,), ("node1",))
        assert "last in 20 of the last 20 collectives" in finding.summary

    def test_jitter_under_the_margin_is_not_a_lead(self):
        stats = last_arrivals(rounds(20, {}))
        assert stats.last_counts == {} and stragglers(stats) == []

    def test_margin_scales_with_the_step_period(self):
        slow_steps = rounds(20, {1: 0.05}, period=2.0)  # 50 ms late in 2 s steps: under 10% of a step
        assert stragglers(last_arrivals(slow_steps)) == []
        fast_steps = rounds(20, {1: 0.05}, period=0.2)
        assert [f.ranks for f in stragglers(last_arrivals(fast_steps))] == [(1,)]

    def test_last_now_and_then_is_not_a_straggler(self):
        mixed = rounds(10, {2: 0.3}) + rounds(10, {}) + rounds(10, {1: 0.3})
        stats = last_arrivals(mixed, window=30)
        assert stats.last_counts == {1: 10, 2: 10} and stragglers(stats) == []

    def test_too_few_rounds_say_nothing(self):
        assert stragglers(last_arrivals(rounds(5, {3: 0.2}))) == []


def step_dumps(steps: int, late_rank: int, late_s: float = 0.05) -> list[FrDump]:
    """Two ranks, steps 0.2 s apart of a gradient all-reduce, a loss all-reduce and a broadcast (gloo entries).

    ``late_rank`` enters each step's gradient all-reduce ``late_s`` after the other, which waits inside it;
    the step's other collectives they enter together.
    """
    shapes = (("AllReduce", 1 << 20), ("AllReduce", 64), ("Broadcast", 4))
    dumps = []
    for rank in (0, 1):
        entries = []
        for step in range(steps):
            for i, (op, numel) in enumerate(shapes):
                seq = 3 * step + i + 1
                first = late_s if rank == late_rank else 0.0
                at = step * 0.2 + (late_s + 0.001 * i if i else first)
                entries.append(
                    FrEntry(
                        index=seq,
                        pg_id="0",
                        collective_seq_id=seq,
                        profiling_name=op,
                        op=op,
                        is_p2p=False,
                        input_sizes=[[numel]],
                        output_sizes=[[numel]],
                        input_dtypes=["Float"],
                        output_dtypes=["Float"],
                        state=OpState.scheduled,
                        time_created_ns=int((NOW + at) * 1e9) + rank * 1000,
                    )
                )
        dumps.append(
            FrDump(rank=rank, version="2.10", process_groups={}, entries=entries, cite=Citation(file=f"fr_{rank}"))
        )
    return dumps


class TestArrivalSeries:
    def test_each_recurring_collective_is_a_series_named_for_people(self):
        series = collective_series(match_collectives(step_dumps(12, late_rank=1)))
        assert list(series) == [
            "AllReduce (4.0 MiB) of process group 0",
            "AllReduce (256 B) of process group 0",
            "Broadcast (16 B) of process group 0",
        ]
        assert all(len(rounds) == 12 for rounds in series.values())

    def test_late_at_a_step_first_collective_only_is_a_straggler_there_not_over_all_collectives(self):
        timings = match_collectives(step_dumps(20, late_rank=1))
        assert stragglers(last_arrivals([arrival_round(t) for t in timings])) == []  # last in a third of them
        series = collective_series(timings)
        what = "AllReduce (4.0 MiB) of process group 0"
        (finding,) = stragglers(collective_arrivals(series[what], what=what))
        assert finding.ranks == (1,)
        assert "was last in 20 of the last 20 collectives at AllReduce (4.0 MiB) of process group 0" in finding.summary
        assert [stragglers(collective_arrivals(ts, what=name)) for name, ts in series.items() if name != what] == [
            [],
            [],
        ]


JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    import torch._C._distributed_c10d as c
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    quiet = dist.new_group([0, 1, 2])
    t = torch.ones(1 << 16)
    for step in range(15):
        if rank == 2:
            time.sleep(0.03)
        dist.all_reduce(t)
    for step in range(15):
        dist.all_reduce(t, group=quiet)
    with open(os.path.join(sys.argv[1], f"fr_json_{rank}"), "wb") as f:
        f.write(c._dump_fr_trace_json())
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory) -> list[FrDump]:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("fr")
    port = _free_port()
    procs = []
    for rank in range(3):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCH_FR_BUFFER_SIZE": "200",
        }
        procs.append(subprocess.Popen([sys.executable, "-c", JOB, str(out)], env=env, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
    dumps = []
    for rank in range(3):
        name = f"fr_json_{rank}"
        (fr,) = parse_flight_recorder((out / name).read_bytes(), name)
        assert isinstance(fr, FrDump), fr
        dumps.append(fr)
    return dumps


class TestRealGlooRanks:
    def test_the_sleeping_rank_is_last_on_its_group_and_named(self, gloo_dumps):
        timings = match_collectives(gloo_dumps)
        default = [t for t in timings if t.pg == "0"]
        assert len(default) >= 15 and all(t.nranks == 3 and t.all_arrived for t in default)
        stats = last_arrivals([arrival_round(t) for t in timings if t.pg == "0" and t.all_arrived])
        assert stats.last_counts.get(2, 0) >= 12, stats
        (finding,) = stragglers(stats, hosts={0: "h", 1: "h", 2: "h"})
        assert finding.ranks == (2,) and 20 <= finding.measured * 1e3 <= 200

    def test_the_quiet_group_has_no_straggler(self, gloo_dumps):
        timings = match_collectives(gloo_dumps)
        quiet = next(t.pg for t in timings if t.pg != "0")
        stats = last_arrivals([arrival_round(t) for t in timings if t.pg == quiet and t.all_arrived])
        assert stats.rounds == 15 and stragglers(stats) == []
