"""Findings about a job that runs, but slowly: slow collectives and links, stragglers, odd transports, bad ports.

These are not hangs.  The detectors that make them (``bandwidth``,
``stragglers``, ``links``) are pure functions of data already collected;
the sidecar decides whether to page, through ``pages``: none of these pages
unless the operator asked for it (``page_on_slow``, ``page_on_straggler``,
``page_on_transport``), because a slow job is worth a look in the morning,
rarely a phone call at night.

A finding's ``key`` is stable across looks for the same problem (same kind,
communicator, ranks or port), so alerts deduplicate on it; its numbers
change from look to look and are not part of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Protocol


class PerfKind(StrEnum):
    slow_collective = "slow_collective"  # far below its own history, or running far longer than it usually takes
    slow_link = "slow_link"  # communicators through some ranks far below their peers: those ranks' node or link
    straggler = "straggler"  # one rank last by a margin in most recent steps or collectives
    transport_anomaly = "transport_anomaly"  # a node on another transport, fewer channels, a missing HCA
    ib_port = "ib_port"  # an InfiniBand port down, slower than its siblings, or its error counters rising


@dataclass(frozen=True)
class PerfFinding:
    kind: PerfKind
    key: str  # stable across looks: kind, then what it is about
    summary: str  # one sentence for the operator
    detail: str  # what to check next
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    links: tuple[str, ...] = ()  # "mlx5_1/1", "NET/Socket", "eth0": what the ranks' traffic goes through
    communicator: str | None = None
    measured: float | None = None  # the figure that is off (bytes/s, seconds, a count)
    expected: float | None = None  # what history, peers or the baseline say it should be

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value
        return out


class PageSettings(Protocol):
    page_on_slow: bool
    page_on_straggler: bool
    page_on_transport: bool


_PAGE_SETTING = {
    PerfKind.slow_collective: "page_on_slow",
    PerfKind.slow_link: "page_on_slow",
    PerfKind.ib_port: "page_on_slow",
    PerfKind.straggler: "page_on_straggler",
    PerfKind.transport_anomaly: "page_on_transport",
}


def pages(finding: PerfFinding, settings: PageSettings) -> bool:
    """Whether this finding should page, by the operator's settings (all off by default)."""
    return bool(getattr(settings, _PAGE_SETTING[finding.kind]))


def where(
    ranks: Sequence[int], hosts: Mapping[int, str], links: Mapping[int, Sequence[str]]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(hosts, links) of these ranks, each sorted and without repeats; unknown ones are left out."""
    host_set = {hosts[r] for r in ranks if r in hosts}
    link_set = {link for r in ranks for link in links.get(r, ())}
    return tuple(sorted(host_set)), tuple(sorted(link_set))


def ranks_text(ranks: Sequence[int], hosts: Mapping[int, str]) -> str:
    """``rank 3 (node7)`` / ``ranks 3, 4 (node7)``: the ranks, then their hosts when known."""
    listed = ", ".join(str(r) for r in ranks)
    named = sorted({hosts[r] for r in ranks if r in hosts})
    return ("rank " if len(ranks) == 1 else "ranks ") + listed + (f" ({', '.join(named)})" if named else "")


def gbps(bytes_per_s: float | None) -> str:
    """Bytes per second as nccl-tests prints them: GB/s, 10^9 bytes."""
    return "?" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f} GB/s"
