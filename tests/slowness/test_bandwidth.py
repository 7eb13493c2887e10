"""Bus bandwidth (nccl-tests' definitions), matching Flight Recorder entries across ranks, slow collectives and links.

Entries are built as the parser makes them from real dumps (``FrEntry``:
``collective_seq_id``, ``time_created_ns``, ``duration_ms``, sizes and dtype
names as torch writes them); a real fixture checks the sizes and dtypes.
"""

from __future__ import annotations

import pytest
from conftest import DATA, NOW

from ncclwatch.bus_bandwidth import algbw, bus_factor, busbw
from ncclwatch.watchdog.events import Citation, FrDump, FrEntry, FrProcessGroup, OpState
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
from ncclwatch.watchdog.slowness.bandwidth import (
    comm_bandwidth,
    element_bytes,
    fr_collective_bytes,
    match_collectives,
    rank_bandwidth,
    slow_collectives,
)
from ncclwatch.watchdog.slowness.findings import PerfKind, pages
from ncclwatch.watchdog.slowness.links import slow_links

T0 = int(NOW * 1e9)
MiB = 1 << 20


def entry(
    seq: int,
    *,
    pg: str = "0",
    op: str = "AllReduce",
    numel: int = 64 * MiB,
    created_ms: float = 0.0,
    duration_ms: float | None = None,
    state: OpState = OpState.completed,
    out_numel: int | None = None,
) -> FrEntry:
    name = {"AllReduce": "nccl:all_reduce", "AllGather": "nccl:_allgather_base"}[op]
    return FrEntry(
        index=seq,
        pg_id=pg,
        collective_seq_id=seq,
        profiling_name=name,
        op=op,
        is_p2p=False,
        input_sizes=[[numel]],
        output_sizes=[[out_numel if out_numel is not None else numel]],
        input_dtypes=["Float"],
        output_dtypes=["Float"],
        state=state,
        time_created_ns=T0 + int(seq * 1e9 + created_ms * 1e6),
        duration_ms=duration_ms,
    )


def dump(rank: int, entries: list[FrEntry], groups: dict[str, list[int]] | None = None) -> FrDump:
    pgs = {pg: FrProcessGroup(pg_id=pg, ranks=ranks) for pg, ranks in (groups or {}).items()}
    return FrDump(rank=rank, version="2.10", process_groups=pgs, entries=entries, cite=Citation(file=f"fr_{rank}"))


class TestBusBandwidth:
    def test_factors_are_nccl_tests(self):
        assert bus_factor("AllReduce", 8) == pytest.approx(2 * 7 / 8)
        assert bus_factor("AllGather", 4) == bus_factor("ReduceScatter", 4) == bus_factor("AlltoAll", 4) == 0.75
        assert bus_factor("Broadcast", 8) == bus_factor("Reduce", 8) == bus_factor("Send", 2) == 1.0
        assert bus_factor("Barrier", 8) is None

    def test_all_reduce_of_one_gib_on_eight_ranks_in_ten_ms(self):
        assert algbw(1 << 30, 0.01) == pytest.approx(107.374e9, rel=1e-4)
        assert busbw("AllReduce", 1 << 30, 8, 0.01) == pytest.approx(107.374e9 * 1.75, rel=1e-4)
        assert busbw("AllReduce", 1 << 30, 8, 0.0) is None

    def test_element_sizes_from_torch_names_and_nccl_numbers(self):
        assert [element_bytes(d) for d in ("Float", "float", "BFloat16", "Long", "Float8_e4m3fn", "7", "9", "4")] == [
            4,
            4,
            2,
            8,
            1,
            4,
            2,
            8,
        ]
        assert element_bytes("Quantum") is None and element_bytes(None) is None

    def test_all_gather_size_is_the_whole_output(self):
        gather = entry(1, op="AllGather", numel=1000, out_numel=4000)
        assert fr_collective_bytes(gather) == 16000

    def test_real_nccl_dump_sizes_and_durations(self):
        raw = (DATA / "flight_recorder" / "torch2.11_nccl_1gpu_json_rank_0").read_bytes()
        (fr,) = parse_flight_recorder(raw, "torch2.11_nccl_1gpu_json_rank_0")
        first = fr.entries[0]
        assert (first.op, fr_collective_bytes(first), first.duration_ms) == (
            "AllReduce",
            32,
            pytest.approx(0.0176, abs=1e-4),
        )


class TestMatching:
    def test_skew_last_rank_and_lead(self):
        dumps = [dump(r, [entry(1, created_ms=ms, duration_ms=10.0 + ms)]) for r, ms in ((0, 0.0), (1, 5.0), (2, 30.0))]
        (t,) = match_collectives(dumps)
        assert (t.nranks, t.last_rank) == (3, 2)
        assert t.skew_s == pytest.approx(0.030) and t.lead_s == pytest.approx(0.025)

    def test_transfer_time_is_the_last_arrivers_kernel_not_the_waiters(self):
        dumps = [dump(0, [entry(1, duration_ms=50.0)]), dump(1, [entry(1, created_ms=40.0, duration_ms=10.0)])]
        (t,) = match_collectives(dumps)
        assert t.transfer_s == pytest.approx(0.010)
        assert t.busbw == pytest.approx(busbw("AllReduce", 256 * MiB, 2, 0.010))

    def test_group_size_comes_from_pg_config(self):
        dumps = [dump(r, [entry(1, pg="tp")], {"tp": [0, 1, 2, 3]}) for r in (0, 1)]
        (t,) = match_collectives(dumps)
        assert t.nranks == 4 and not t.all_arrived and t.started_ns is None

    def test_gloo_entries_give_skew_but_no_bandwidth(self):
        dumps = [dump(r, [entry(1, created_ms=r * 3.0, state=OpState.scheduled)]) for r in (0, 1)]
        (t,) = match_collectives(dumps)
        assert t.busbw is None and t.skew_s == pytest.approx(0.003)


def history(
    pg: str, ranks: list[int], n: int, duration_ms: float, *, last_ms: float | None = None, slow: int = 3
) -> list[FrDump]:
    """``n`` 256 MiB all-reduces on a group, each taking ``duration_ms`` (the last ``slow`` ones ``last_ms``)."""
    out = []
    for r in ranks:
        entries = [
            entry(s, pg=pg, duration_ms=last_ms if (s > n - slow and last_ms) else duration_ms) for s in range(1, n + 1)
        ]
        out.append(dump(r, entries, {pg: ranks}))
    return out


class TestSlowCollective:
    def test_the_latest_far_below_their_history_are_reported(self):
        timings = match_collectives(history("0", [0, 1], 12, 2.0, last_ms=40.0))
        (finding,) = slow_collectives(timings, hosts={0: "n0", 1: "n1"})
        assert finding.kind is PerfKind.slow_collective and finding.ranks == (0, 1) and finding.hosts == ("n0", "n1")
        assert finding.measured / finding.expected == pytest.approx(0.05)
        assert (
            "AllReduce #12 of process group 0 (256.0 MiB, 2 ranks) and the 2 before it ran at 6.71 GB/s"
            in finding.summary
        )
        assert "5% of their usual" in finding.summary

    def test_one_slow_collective_is_a_hiccup(self):
        """As in a healthy 2 x H200 run: one all-reduce at 7-18 % of its usual speed, then back to normal."""
        assert slow_collectives(match_collectives(history("0", [0, 1], 12, 2.0, last_ms=40.0, slow=1))) == []
        assert slow_collectives(match_collectives(history("0", [0, 1], 12, 2.0, last_ms=40.0, slow=2)))  # 2 of 3

    def test_steady_job_stays_quiet(self):
        assert slow_collectives(match_collectives(history("0", [0, 1], 10, 2.0, last_ms=2.5))) == []

    def test_too_little_history_stays_quiet(self):
        assert slow_collectives(match_collectives(history("0", [0, 1], 4, 2.0, last_ms=40.0))) == []

    def test_small_collectives_are_not_judged(self):
        dumps = [
            dump(r, [entry(s, numel=64, duration_ms=40.0 if s == 10 else 2.0) for s in range(1, 11)]) for r in (0, 1)
        ]
        assert slow_collectives(match_collectives(dumps)) == []

    def test_a_running_collective_far_past_its_usual_time(self):
        dumps = history("0", [0, 1], 10, 2.0)
        running = [
            dump(r, d.entries + [entry(11, created_ms=r * 1.0, state=OpState.started)]) for r, d in enumerate(dumps)
        ]
        timings = match_collectives(running)
        started = timings[-1].started_ns
        assert slow_collectives(timings, now_ns=started + int(5e9)) == []  # under min_elapsed_s
        (finding,) = slow_collectives(timings, now_ns=started + int(30e9), links={0: ("mlx5_1/1",)})
        assert "has run for 30 s" in finding.summary and finding.links == ("mlx5_1/1",)

    def test_paging_is_off_unless_configured(self):
        (finding,) = slow_collectives(match_collectives(history("0", [0, 1], 10, 2.0, last_ms=40.0)))

        class Settings:
            page_on_slow, page_on_straggler, page_on_transport = False, True, True

        assert not pages(finding, Settings())
        Settings.page_on_slow = True
        assert pages(finding, Settings())


class TestSlowLink:
    def groups(self, slow_ms: float) -> list:
        """Four data-parallel pairs; the pairs through rank 5 take ``slow_ms``."""
        dumps = []
        for pg, ranks in {"dp0": [0, 4], "dp1": [1, 5], "dp2": [2, 6], "dp3": [3, 7], "tp1": [5, 1]}.items():
            ms = slow_ms if 5 in ranks else 2.0
            dumps += history(pg, ranks, 8, ms)
        return match_collectives(dumps)

    def test_slow_groups_are_localised_to_the_rank_they_share(self):
        hosts = {r: f"node{r // 4}" for r in range(8)}
        (finding,) = slow_links(self.groups(20.0), hosts=hosts, links={1: ("mlx5_1/1",), 5: ("mlx5_1/1",)})
        assert finding.kind is PerfKind.slow_link
        assert finding.ranks == (1, 5) and finding.hosts == ("node0", "node1") and finding.links == ("mlx5_1/1",)
        assert finding.measured == pytest.approx(finding.expected / 10)

    def test_equal_groups_stay_quiet(self):
        assert slow_links(self.groups(2.6)) == []

    def test_one_group_has_no_peers(self):
        assert slow_links(match_collectives(history("0", [0, 1], 10, 20.0))) == []

    def test_comm_and_rank_bandwidth_are_medians_over_the_groups(self):
        timings = self.groups(20.0)
        comms = comm_bandwidth(timings)
        assert comms[("dp0", "AllReduce")] == pytest.approx(10 * comms[("dp1", "AllReduce")])
        ranks = rank_bandwidth(timings)
        assert ranks[0] == pytest.approx(comms[("dp0", "AllReduce")]) and ranks[5] == pytest.approx(
            comms[("dp1", "AllReduce")]
        )


def test_paging_settings_come_from_the_environment():
    from ncclwatch.watchdog.config import load_settings

    finding = slow_collectives(match_collectives(history("0", [0, 1], 10, 2.0, last_ms=40.0)))[0]
    assert not pages(finding, load_settings({}, environ={}))
    assert pages(finding, load_settings({"page_on_slow": True}, environ={}))
