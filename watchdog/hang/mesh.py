"""Where each rank sits in the job's ``DeviceMesh``, from Flight Recorder's process groups alone.

A ``DeviceMesh`` makes one process group per slice of each dimension and describes it ``mesh_<dim>``
(``mesh_tp``, ``mesh_dp``; ``mesh_dim_0`` where the mesh has no dimension names; torch 2.13,
``DeviceMesh._init_one_process_group``).  A rank's coordinate in a dimension is its index in the sorted ranks
of its group of that dimension: ``new_group`` sorts its ranks, and a mesh made by ``init_device_mesh`` lays the
ranks out in order, so a group's rank is the rank's coordinate along it.

Where a dump lists a group's ranks (NCCL's ``pg_config``), every member is placed, whether its own dump came or
not.  gloo's dumps (torch 2.13) list none: a group's members are then the ranks whose own dump names it, and a
rank's index among them is its coordinate only when no member below it can be missing, that is when every rank
below it is seen in some group of that dimension.  A rank not placed in a dimension has no coordinate there
(never a guess), with one exception that is arithmetic, not a guess: where the dimensions' order is known from
their strides, each dimension's size from a group listed whole, and every coordinate placed agrees with the
in-order layout of those sizes (rank = coordinates in mixed radix, outermost first), a rank placed in some
dimension gets its other coordinates from that layout (on the H200, pipeline x DP on two wrappers: "rank 1
(dp ?, pp 0)" where rank 1's dp group was in no dump that came).

Not dimensions: ``mesh_default`` (a 1-D mesh over the whole world on gloo with CUDA present gets a group of
its own; otherwise such a mesh is the default group and says nothing), a flattened dimension (``dp_cp``, named
by joining dimensions that are there), and a dimension where one rank shows in two groups (two meshes sharing
a dimension name): its groups do not say one coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from ncclwatch.watchdog.events import FrDump

MESH_PREFIX = "mesh_"
_NOT_DIMENSIONS = frozenset({"default"})


@dataclass(frozen=True)
class GroupView:
    """One process group as the job's Flight Recorder dumps tell it, merged over the dumps."""

    pg: str
    desc: str | None
    ranks: tuple[int, ...] = ()  # the global ranks the dumps list (pg_config), group order; () where none does
    seen: frozenset[int] = frozenset()  # ranks whose own dump names the group: members for certain


@dataclass(frozen=True)
class Mesh:
    """The mesh as far as the groups show it; empty (``not mesh``) where no group is a mesh group."""

    dims: tuple[str, ...] = ()  # outermost first when ``order`` is "stride", else by name
    coords: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # global rank -> dim -> coordinate
    groups: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # pg -> (dim, members known)
    order: Literal["stride", "name"] = "name"

    def __bool__(self) -> bool:
        return bool(self.dims)

    def of(self, rank: int) -> dict[str, int] | None:
        """``{"dp": 1, "tp": 1}``: the coordinates known for ``rank``, in the mesh's order; None if none is."""
        known = self.coords.get(rank)
        return {dim: known[dim] for dim in self.dims if dim in known} if known else None

    def label(self, rank: int) -> str | None:
        return coords_label(self.dims, self.of(rank))

    def dim_of(self, pg: str) -> str | None:
        """The dimension whose group ``pg`` is, if it is one."""
        group = self.groups.get(pg)
        return group[0] if group else None

    def dim_of_members(self, members: Iterable[int]) -> tuple[str, tuple[int, ...]] | None:
        """The one mesh group whose known members are exactly ``members`` (a communicator known by its ranks)."""
        wanted = tuple(sorted(set(members)))
        found = {(dim, ranks) for dim, ranks in self.groups.values() if ranks == wanted and len(ranks) > 1}
        return found.pop() if len(found) == 1 else None


def coords_label(dims: Sequence[str], coords: Mapping[str, int] | None) -> str | None:
    """``dp 1, tp 1``; a dimension the rank was not placed in reads ``tp ?``."""
    if not coords:
        return None
    return ", ".join(f"{dim} {coords[dim] if dim in coords else '?'}" for dim in dims)


def mesh_dim(desc: str | None) -> str | None:
    """``mesh_tp`` -> ``tp``; None for a group a ``DeviceMesh`` did not describe, and for ``mesh_default``."""
    if not desc or not desc.startswith(MESH_PREFIX):
        return None
    dim = desc[len(MESH_PREFIX) :]
    return dim if dim and dim not in _NOT_DIMENSIONS else None


def mesh_groups_of_dumps(dumps: Iterable[FrDump]) -> tuple[GroupView, ...]:
    """The groups a ``DeviceMesh`` made, as the dumps name them, merged by name (the same on every member).

    A dump counts its own rank as a member only of a group it describes as a mesh group (a ``pg_status`` uid
    that no entry names becomes a group without a description, whose name may be another group's) and, where it
    lists the group's ranks, that holds its rank.  Other groups (the default group, ``new_group``'s) are left
    out: they place no rank, and the default group lists every rank of the job.
    """
    descs: dict[str, str] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    members: dict[str, frozenset[int]] = {}
    seen: dict[str, set[int]] = {}
    for dump in dumps:
        for pg, group in dump.process_groups.items():
            if group.desc is None or mesh_dim(group.desc) is None:
                continue
            descs.setdefault(pg, group.desc)
            if group.ranks and pg not in ranks:
                ranks[pg], members[pg] = tuple(group.ranks), frozenset(group.ranks)
            if dump.rank is not None and (not group.ranks or dump.rank in members.get(pg, group.ranks)):
                seen.setdefault(pg, set()).add(dump.rank)
    return tuple(
        GroupView(pg=pg, desc=desc, ranks=ranks.get(pg, ()), seen=frozenset(seen.get(pg, ())))
        for pg, desc in descs.items()
    )


def derive_mesh(groups: Iterable[GroupView]) -> Mesh:
    """Each rank's coordinates from the mesh groups among ``groups`` (the module's docstring says the rule)."""
    listed: dict[str, dict[str, tuple[tuple[int, ...], bool]]] = {}  # dim -> pg -> (sorted members, all listed)
    for group in groups:
        dim = mesh_dim(group.desc)
        if dim is None:
            continue
        members = tuple(sorted(set(group.ranks or group.seen)))
        if members:
            listed.setdefault(dim, {})[group.pg] = (members, bool(group.ranks))
    for dim in [d for d in listed if _flattened(d, set(listed) - {d}) or _overlapping(listed[d].values())]:
        del listed[dim]
    coords: dict[int, dict[str, int]] = {}
    for dim, by_pg in listed.items():
        placed = {rank for members, _ in by_pg.values() for rank in members}  # in some group of this dim
        gap = next(rank for rank in range(len(placed) + 1) if rank not in placed)  # every rank below it is placed
        for members, complete in by_pg.values():
            for index, rank in enumerate(members):
                if complete or rank < gap:
                    coords.setdefault(rank, {})[dim] = index
    dims, order = _order(listed)
    if order == "stride":
        _fill_from_layout(dims, listed, coords)
    return Mesh(
        dims=dims,
        coords=MappingProxyType({rank: MappingProxyType(c) for rank, c in coords.items()}),
        groups=MappingProxyType(
            {pg: (dim, members) for dim, by_pg in listed.items() for pg, (members, _) in by_pg.items()}
        ),
        order=order,
    )


def _order(
    listed: Mapping[str, Mapping[str, tuple[tuple[int, ...], bool]]],
) -> tuple[tuple[str, ...], Literal["stride", "name"]]:
    """Outermost first, as the mesh has them, when that can be recovered; else by name.

    In a mesh laid out in order (``init_device_mesh``) the ranks of one group of a dimension are that
    dimension's stride apart, and strides grow outwards (tp's groups hold neighbours, dp's ranks tp apart, pp's
    dp x tp apart).  The smallest gap between two ranks of one group of a dimension is its stride, or a multiple
    of it where groups are seen only in part, still below the next dimension's stride: where every dimension
    shows a gap and no two show the same, the gaps give the order.  A dimension of size 1 (every group one rank)
    or seen only in single ranks shows none; then, and for a mesh laid out otherwise (equal gaps), the order is
    the dimensions' names.  The coordinates are the same either way.
    """
    strides: dict[str, int] = {}
    for dim, by_pg in listed.items():
        gaps = [b - a for members, _ in by_pg.values() for a, b in zip(members, members[1:], strict=False)]
        if gaps:
            strides[dim] = min(gaps)
    if listed and len(strides) == len(listed) and len(set(strides.values())) == len(strides):
        return tuple(sorted(listed, key=lambda d: -strides[d])), "stride"
    return tuple(sorted(listed)), "name"


def _fill_from_layout(
    dims: tuple[str, ...],
    listed: Mapping[str, Mapping[str, tuple[tuple[int, ...], bool]]],
    coords: dict[int, dict[str, int]],
) -> None:
    """The coordinates missing from placed ranks, from the in-order layout, where every placed one agrees with it."""
    sizes = []
    for dim in dims:
        whole = {len(members) for members, complete in listed[dim].values() if complete}
        if len(whole) != 1:
            return  # no group of it listed whole, or groups of different sizes: not one mesh's dimension
        sizes.append(whole.pop())

    def layout(rank: int) -> dict[str, int]:
        at = {}
        for dim, size in zip(reversed(dims), reversed(sizes), strict=True):
            rank, at[dim] = divmod(rank, size)
        return at

    laid = {rank: layout(rank) for rank in coords}
    if any(rank >= math.prod(sizes) for rank in coords) or any(
        laid[rank][dim] != value for rank, known in coords.items() for dim, value in known.items()
    ):
        return
    for rank, known in coords.items():
        for dim in dims:
            known.setdefault(dim, laid[rank][dim])


def _flattened(dim: str, others: set[str]) -> bool:
    """``dp_cp`` where ``dp`` and ``cp`` are dimensions: ``DeviceMesh._flatten``'s default name, not a dimension."""
    parts = dim.split("_")

    def joins(start: int, count: int) -> bool:
        if start == len(parts):
            return count >= 2
        return any(
            "_".join(parts[start:end]) in others and joins(end, count + 1) for end in range(start + 1, len(parts) + 1)
        )

    return joins(0, 0)


def _overlapping(groups: Iterable[tuple[tuple[int, ...], bool]]) -> bool:
    """One rank in two groups of one dimension: two meshes under one dimension name."""
    seen: set[int] = set()
    for members, _ in groups:
        if seen & set(members):
            return True
        seen.update(members)
    return False
