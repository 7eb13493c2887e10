"""Issue 30: name ranks the way the job thinks of them, by their place in its ``DeviceMesh``.

A ``DeviceMesh`` describes each group it makes ``mesh_<dim>`` (torch 2.13: ``mesh_dp``, ``mesh_tp``, as the
dumps in ``tests/data/flight_recorder/tp_gloo`` show).  ``hang/mesh.py`` places each rank from the groups alone;
the report says "rank 3 (dp 1, tp 1)" and "its dp group's peers (rank 1)", live and in ``analyze``.
"""

from __future__ import annotations

from conftest import DATA, NOW

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import Citation, FrDump, FrProcessGroup, WorkerSeen
from ncclwatch.watchdog.hang.classify import classify
from ncclwatch.watchdog.hang.mesh import GroupView, derive_mesh, mesh_dim, mesh_groups_of_dumps
from ncclwatch.watchdog.hang.report import Report, render_text
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.live.bundle import live_report, terminal_text
from ncclwatch.watchdog.live.job import LiveView
from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder

TP_GLOO = DATA / "flight_recorder" / "tp_gloo"


def mesh_of_shape(shape: dict[str, int], first_pg: int = 1) -> list[GroupView]:
    """Every group ``init_device_mesh`` makes for ``shape`` (outermost first), ranks listed as NCCL's dumps do."""
    names = list(shape)
    sizes = list(shape.values())
    world = 1
    for size in sizes:
        world *= size
    strides = [world // _product(sizes[: i + 1]) for i in range(len(sizes))]
    groups, pg = [], first_pg
    for i, dim in enumerate(names):
        slices: dict[tuple[int, ...], list[int]] = {}
        for rank in range(world):
            others = tuple((rank // strides[j]) % sizes[j] for j in range(len(sizes)) if j != i)
            slices.setdefault(others, []).append(rank)
        for ranks in slices.values():
            groups.append(GroupView(pg=str(pg), desc=f"mesh_{dim}", ranks=tuple(ranks)))
            pg += 1
    return groups


def _product(values: list[int]) -> int:
    out = 1
    for value in values:
        out *= value
    return out


def seen_only(groups: list[GroupView], dumped: set[int]) -> list[GroupView]:
    """The same groups as gloo's dumps tell them: no ranks listed, a member known only by its own dump."""
    out = []
    for group in groups:
        seen = frozenset(set(group.ranks) & dumped)
        if seen:
            out.append(GroupView(pg=group.pg, desc=group.desc, seen=seen))
    return out


class TestDerivation:
    def test_2d_dp_x_tp(self) -> None:
        mesh = derive_mesh(mesh_of_shape({"dp": 2, "tp": 4}))
        assert mesh.dims == ("dp", "tp") and mesh.order == "stride"
        assert mesh.of(6) == {"dp": 1, "tp": 2} and mesh.label(6) == "dp 1, tp 2"
        assert {rank: mesh.label(rank) for rank in (0, 3, 4)} == {0: "dp 0, tp 0", 3: "dp 0, tp 3", 4: "dp 1, tp 0"}
        assert mesh.dim_of("1") == "dp" and mesh.groups["1"] == ("dp", (0, 4))
        assert mesh.dim_of_members([4, 0]) == ("dp", (0, 4))  # an NCCL communicator, known by its ranks
        assert mesh.dim_of_members(range(8)) is None and mesh.dim_of("0") is None

    def test_3d_pp_x_dp_x_tp_in_the_meshs_order_not_by_name(self) -> None:
        groups = mesh_of_shape({"pp": 2, "dp": 2, "tp": 2})
        mesh = derive_mesh(reversed(groups))
        assert mesh.dims == ("pp", "dp", "tp") and mesh.order == "stride"  # by name it would be dp, pp, tp
        assert mesh.label(5) == "pp 1, dp 0, tp 1"
        assert mesh.of(5) == {"pp": 1, "dp": 0, "tp": 1}
        assert all(len(mesh.of(rank) or {}) == 3 for rank in range(8))

    def test_3d_from_gloo_dumps_alone(self) -> None:
        mesh = derive_mesh(seen_only(mesh_of_shape({"pp": 2, "dp": 2, "tp": 2}), set(range(8))))
        assert mesh.dims == ("pp", "dp", "tp")
        assert [mesh.label(rank) for rank in (5, 6)] == ["pp 1, dp 0, tp 1", "pp 1, dp 1, tp 0"]

    def test_a_1d_mesh(self) -> None:
        groups = [
            GroupView(pg="0", desc="default_pg", ranks=tuple(range(8))),
            *mesh_of_shape({"tp": 4}),
            GroupView(pg="9", desc="mesh_tp", ranks=(4, 5, 6, 7)),
        ]
        mesh = derive_mesh(groups)
        assert mesh.dims == ("tp",) and mesh.order == "stride"
        assert [mesh.label(rank) for rank in (1, 6)] == ["tp 1", "tp 2"]

    def test_no_mesh(self) -> None:
        # DDP: the default group; groups of new_group without a description; a 1-D mesh over the world on gloo
        groups = [
            GroupView(pg="0", desc="default_pg", ranks=(0, 1, 2, 3)),
            GroupView(pg="1", desc="undefined", ranks=(0, 1)),
            GroupView(pg="2", desc=None, seen=frozenset({0, 1})),
            GroupView(pg="3", desc="mesh_default", ranks=(0, 1, 2, 3)),
        ]
        mesh = derive_mesh(groups)
        assert not mesh and mesh.dims == () and mesh.of(0) is None and mesh.label(0) is None
        assert derive_mesh([]).dims == ()
        assert [mesh_dim(d) for d in ("mesh_tp", "mesh_dim_0", "mesh_default", "default_pg", None)] == [
            "tp",
            "dim_0",
            None,
            None,
            None,
        ]

    def test_a_partial_view_places_what_the_listed_groups_say(self) -> None:
        # NCCL's dumps list each group's ranks; only ranks 0 and 2 dumped: they name tp [0, 1], tp [2, 3], dp [0, 2]
        groups = [g for g in mesh_of_shape({"dp": 2, "tp": 2}) if {0, 2} & set(g.ranks)]
        mesh = derive_mesh(groups)
        assert mesh.dims == ("dp", "tp")
        # rank 3's dp group [1, 3] is in no dump: its dp is the in-order layout's, which every placed rank agrees with
        assert mesh.of(3) == {"dp": 1, "tp": 1} and mesh.label(3) == "dp 1, tp 1"
        assert [mesh.label(rank) for rank in range(4)] == ["dp 0, tp 0", "dp 0, tp 1", "dp 1, tp 0", "dp 1, tp 1"]

    def test_the_layout_fills_a_coordinate_only_where_the_mesh_is_laid_out_from_rank_0(self) -> None:
        # The H200's pipeline x DP on two wrappers: rank 1's dp group [0, 1] came in no dump; pp [1, 3] did
        groups = [g for g in mesh_of_shape({"pp": 2, "dp": 2}) if g.ranks != (0, 1)]
        assert derive_mesh(groups).label(1) == "pp 0, dp 1"
        # A mesh over ranks 4-7 of the job: its coordinates are not 4-7's place in a layout from 0; left unknown
        shifted = [GroupView(pg=g.pg, desc=g.desc, ranks=tuple(r + 4 for r in g.ranks)) for g in groups]
        mesh = derive_mesh(shifted)
        assert mesh.dims == ("pp", "dp") and mesh.label(5) == "pp 0, dp ?" and mesh.label(7) == "pp 1, dp 1"

    def test_a_partial_gloo_view_never_guesses(self) -> None:
        groups = mesh_of_shape({"dp": 2, "tp": 2})
        # rank 3 did not dump: 0, 1, 2 are placed (no rank below them is missing); 3 is in no group seen
        mesh = derive_mesh(seen_only(groups, {0, 1, 2}))
        assert [mesh.label(rank) for rank in range(4)] == ["dp 0, tp 0", "dp 0, tp 1", "dp 1, tp 0", None]
        # only 0 and 3 dumped: 3's groups look like one rank each, and ranks 1 and 2 may be in them
        mesh = derive_mesh(seen_only(groups, {0, 3}))
        assert mesh.of(0) == {"dp": 0, "tp": 0} and mesh.of(3) is None
        assert mesh.order == "name"  # no group shows two ranks: no stride

    def test_flattened_and_ambiguous_dimensions_are_not_dimensions(self) -> None:
        groups = mesh_of_shape({"dp": 2, "cp": 2, "tp": 2})
        flat = [GroupView(pg=f"f{i}", desc="mesh_dp_cp", ranks=(i, i + 2, i + 4, i + 6)) for i in (0, 1)]
        mesh = derive_mesh([*groups, *flat])
        assert mesh.dims == ("dp", "cp", "tp") and mesh.label(7) == "dp 1, cp 1, tp 1"
        # two meshes name their dimension "ep": rank 1 in two ep groups says no one coordinate
        twice = [GroupView(pg="e1", desc="mesh_ep", ranks=(0, 1)), GroupView(pg="e2", desc="mesh_ep", ranks=(1, 3))]
        assert derive_mesh([*mesh_of_shape({"dp": 2, "tp": 2}), *twice]).dims == ("dp", "tp")

    def test_a_dimension_of_size_one_orders_by_name(self) -> None:
        mesh = derive_mesh(mesh_of_shape({"pp": 1, "dp": 2, "tp": 2}))
        assert mesh.dims == ("dp", "pp", "tp") and mesh.order == "name"
        assert mesh.of(3) == {"pp": 0, "dp": 1, "tp": 1}


def dump(rank: int, groups: dict[str, FrProcessGroup]) -> FrDump:
    return FrDump(rank=rank, version="2.10", process_groups=groups, entries=[], cite=Citation(file=f"fr_{rank}"))


class TestGroupsOfDumps:
    def test_merged_by_name_members_from_each_dump(self) -> None:
        tp = lambda pg: FrProcessGroup(pg_id=pg, desc="mesh_tp")  # noqa: E731
        dp = lambda pg: FrProcessGroup(pg_id=pg, desc="mesh_dp")  # noqa: E731
        # rank 0's pg_status names a uid "2" no entry does: a group without a description, not rank 1's dp group
        dumps = [
            dump(0, {"3": tp("3"), "1": dp("1"), "2": FrProcessGroup(pg_id="2")}),
            dump(1, {"3": tp("3"), "2": dp("2")}),
        ]
        groups = {g.pg: g for g in mesh_groups_of_dumps(dumps)}
        assert groups["3"] == GroupView(pg="3", desc="mesh_tp", seen=frozenset({0, 1}))
        assert groups["2"] == GroupView(pg="2", desc="mesh_dp", seen=frozenset({1}))

    def test_listed_ranks_are_kept(self) -> None:
        listed = FrProcessGroup(pg_id="5", desc="mesh_tp", ranks=[4, 5])
        [group] = mesh_groups_of_dumps([dump(4, {"5": listed})])
        assert group.ranks == (4, 5) and group.seen == frozenset({4})

    def test_groups_no_mesh_made_are_left_out(self) -> None:
        groups = {
            "0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=list(range(8))),
            "1": FrProcessGroup(pg_id="1"),
        }
        assert mesh_groups_of_dumps([dump(0, groups), dump(1, groups)]) == ()


def analyzed(case: str) -> Report:
    return analyze_paths([str(TP_GLOO / case)], now=NOW)


class TestRealDumps:
    """FSDP2 over dp 2 x tp 2 on gloo (``make_tp_dumps.py``): rank 3 = dp 1, tp 1; its dp group is ranks 1 and 3."""

    def test_the_stuck_rank_is_placed_and_its_dp_peers_named(self) -> None:
        report = analyzed("dp2_tp2_stuck3")
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [3])
        assert report.mesh_dims == ["dp", "tp"]
        rows = {row.rank: row.mesh for row in report.ranks}
        assert rows[3] == {"dp": 1, "tp": 1} and rows[1] == {"dp": 0, "tp": 1}
        assert report.mesh_group is not None and (report.mesh_group.dim, report.mesh_group.ranks) == ("dp", [1, 3])
        assert report.headline is not None
        assert report.headline.startswith(
            "ncclwatch: RANK BEHIND rank 3 (dp 1, tp 1) never entered AllGather #13; "
            "its dp group's peers (rank 1) wait in it — its last recorded call site is make_tp_dumps.py:106 in main()"
        ), report.headline

    def test_the_skipping_rank_is_placed_in_the_headline_and_the_text(self) -> None:
        report = analyzed("dp2_tp2_skip3")
        assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [3])
        assert next(row.mesh for row in report.ranks if row.rank == 3) == {"dp": 1, "tp": 1}
        assert report.headline is not None and report.headline.startswith(
            "ncclwatch: COLLECTIVE MISMATCH rank 3 (dp 1, tp 1) issued AllGather where its dp group's peers (rank 1) "
            "issued AllReduce #15"
        ), report.headline
        text = render_text(report)
        assert text.startswith("ncclwatch: COLLECTIVE MISMATCH — culprit rank 3 (dp 1, tp 1)\n")
        header, *rows = text.split("\n\n")[1].splitlines()
        assert header.split()[:3] == ["rank", "dp", "tp"]
        assert [row.split()[:3] for row in rows] == [["1", "0", "1"], ["3", "1", "1"]]
        again = Report.model_validate_json(report.model_dump_json())
        assert (again.mesh_dims, again.ranks, again.mesh_group) == (report.mesh_dims, report.ranks, report.mesh_group)

    def test_a_job_without_a_mesh_says_nothing_of_one(self) -> None:
        report = analyzed("tp2_stuck1")  # a 1-D mesh over the world is the default group: no mesh group
        assert report.mesh_dims == [] and report.mesh_group is None
        assert all(row.mesh is None for row in report.ranks)
        assert report.headline is not None and "group's peers" not in report.headline
        assert "its peers wait in it" in report.headline
        assert render_text(report).split("\n\n")[1].split()[:2] == ["rank", "host"]

    def test_live_every_workers_row_is_placed(self) -> None:
        state = JobState()
        for path in sorted((TP_GLOO / "dp2_tp2_stuck3").iterdir()):
            for event in parse_flight_recorder(path.read_bytes(), str(path)):
                state.apply(event)
        for rank in range(4):
            state.apply(WorkerSeen(pid=1000 + rank, rank=rank, local_rank=rank, world_size=4, host="node1", at=NOW))
        snapshot = take_snapshot(state, observed_at=NOW)
        finding = classify(snapshot).finding
        view = LiveView(
            observed_at=NOW,
            workers=snapshot.workers,
            progress_at={},
            beat_at={},
            last_progress=NOW - 30,
            stall_timeout=5.0,
            learned_gap=None,
            advances=10,
            signals=frozenset(),
            down=(),
        )
        report = live_report(finding, snapshot, view, job="train", host="node1", started_at=NOW - 30)
        assert report.culprit_ranks == [3]
        assert [(row.rank, row.pid, row.mesh) for row in report.ranks] == [
            (0, 1000, {"dp": 0, "tp": 0}),
            (1, 1001, {"dp": 0, "tp": 1}),
            (2, 1002, {"dp": 1, "tp": 0}),
            (3, 1003, {"dp": 1, "tp": 1}),
        ]
        assert report.headline is not None
        assert (
            "RANK BEHIND rank 3 (dp 1, tp 1; node1, pid 1003) never entered AllGather #13; its dp group's peers "
            "(rank 1) wait in it" in report.headline
        )
        assert "culprit rank 3 (dp 1, tp 1)" in terminal_text(report)


class TestPage:
    def test_the_bundle_page_places_the_culprit_and_each_row(self) -> None:
        from ncclwatch.watchdog.server.page import report_body
        from ncclwatch.watchdog.server.view import report_view

        body = report_body("b", report_view(analyzed("dp2_tp2_skip3").model_dump(mode="json")), [])
        assert "culprit rank 3 (dp 1, tp 1)</span>" in body
        assert "<th>rank</th>\n<th>mesh</th>" in body and "<td>3 (culprit)</td><td>dp 1, tp 1</td>" in body
        plain = report_body("b", report_view(analyzed("tp2_stuck1").model_dump(mode="json")), [])
        assert "<th>mesh</th>" not in plain and "culprit rank 1</span>" in plain
