"""Links: slow links, transport anomalies across ranks and nodes, InfiniBand port anomalies, which link each rank uses.

Pure: reads matched collectives (``bandwidth.CollectiveTiming``),
``events.RankTransport`` records (made by ``parsing/transport.py``) and the
InfiniBand probe's readings (``probes/infiniband.py``), returns
``PerfFinding``s.  The rule throughout: a node is odd when it differs from
its peers in the same job, so a job that is uniformly on sockets (no
InfiniBand anywhere) raises nothing here, while one node on sockets among
InfiniBand nodes, one node without P2P, one node with fewer HCAs, or one
communicator with fewer channels than its look-alikes does.

Failure modes: records without the fact in question (init lines not seen)
take no part in that comparison; a single node has no peers to differ
from, except for ``NCCL_IB_HCA`` entries (each process's own, as its NCCL
logged it) that match no device NCCL listed,
and for NCCL on sockets while the node's sysfs shows active InfiniBand ports.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from ncclwatch.watchdog.events import ProcKey, RankTransport, rate_bytes_per_s, state_name
from ncclwatch.watchdog.slowness.bandwidth import MIN_BYTES, CollectiveTiming, judged_on_bandwidth, size_bucket
from ncclwatch.watchdog.slowness.findings import PerfFinding, PerfKind, gbps, ranks_text, where

RankOf = Callable[[ProcKey], int | None]  # a process's global rank, where known


# --------------------------------------------------------------------------
# Slow links: groups far below their peers
# --------------------------------------------------------------------------


def slow_links(
    timings: Sequence[CollectiveTiming],
    *,
    hosts: Mapping[int, str] = {},
    links: Mapping[int, Sequence[str]] = {},
    ratio: float = 0.5,
    min_samples: int = 5,
    min_bytes: int = MIN_BYTES,
) -> list[PerfFinding]:
    """Groups far slower than their peers doing the same op at the same size, localised to the ranks they share.

    Data-parallel replicas, tensor-parallel groups: same op, same size, on
    different ranks.  A group under ``ratio`` x the median of the others is
    slow; the suspects are the ranks in every slow group and in no fast one
    (a faulty cable slows exactly the groups whose ring crosses it).
    Without two groups to compare, says nothing.
    """
    per: dict[tuple[str, int], dict[str, list[CollectiveTiming]]] = defaultdict(lambda: defaultdict(list))
    for t in judged_on_bandwidth(timings, min_bytes):
        per[(t.op, size_bucket(t.nbytes))][t.pg].append(t)  # type: ignore[arg-type]
    findings = []
    for (op, _), by_pg in per.items():
        medians = {
            pg: statistics.median(x.busbw for x in ts[-50:]) for pg, ts in by_pg.items() if len(ts) >= min_samples
        }
        if len(medians) < 2:
            continue
        slow = {
            pg for pg, m in medians.items() if m < ratio * statistics.median(v for p, v in medians.items() if p != pg)
        }
        if not slow:
            continue
        members = {pg: set().union(*(t.arrivals for t in by_pg[pg])) for pg in medians}
        suspects = set.intersection(*(members[pg] for pg in slow)) - set().union(
            *(members[pg] for pg in medians if pg not in slow)
        )
        findings.append(
            _link_finding(
                op, sorted(suspects or set().union(*(members[pg] for pg in slow))), slow, medians, hosts, links
            )
        )
    return findings


def _link_finding(op: str, ranks: list[int], slow: set[str], medians: Mapping[str, float], hosts, links) -> PerfFinding:  # type: ignore[no-untyped-def]
    host_names, link_names = where(ranks, hosts, links)
    measured = min(medians[pg] for pg in slow)
    peers = statistics.median(v for pg, v in medians.items() if pg not in slow)
    through = f" through {', '.join(link_names)}" if link_names else ""
    return PerfFinding(
        kind=PerfKind.slow_link,
        key=f"slow_link-{','.join(map(str, ranks))}",
        summary=f"{op} in process group(s) {', '.join(sorted(slow))} runs at {gbps(measured)}, against {gbps(peers)} "
        f"in the others; the slow groups share {ranks_text(ranks, hosts)}{through}",
        detail="check that node's links: InfiniBand port rate and state, error counters, cables; NCCL's transport "
        "lines for a fallback (NET/Socket, fewer channels); ncclwatch preflight on that node",
        ranks=tuple(ranks),
        hosts=host_names,
        links=link_names,
        communicator=",".join(sorted(slow)),
        measured=measured,
        expected=peers,
    )


# --------------------------------------------------------------------------
# Transports
# --------------------------------------------------------------------------


def rank_links(facts: Iterable[RankTransport], global_ranks: Mapping[ProcKey, int] = {}) -> dict[int, tuple[str, ...]]:
    """Global rank -> the NICs its network connections go through (``mlx5_1/1``), over all its communicators."""
    out: dict[int, dict[str, None]] = defaultdict(dict)
    for f in facts:
        rank = global_ranks.get(f.proc, f.rank)
        if rank is not None:
            out[rank].update(dict.fromkeys(f.links()))
    return {rank: tuple(links) for rank, links in out.items() if links}


def transport_anomalies(
    facts: Sequence[RankTransport],
    *,
    global_ranks: Mapping[ProcKey, int] = {},
    active_ib_ports: Mapping[str, Sequence[str]] = {},
) -> list[PerfFinding]:
    """Every rule below, in order; ``active_ib_ports``: host -> its sysfs ports that are up."""
    procs = {f.proc: f for f in facts}  # per-process facts are the same on each of its records

    def rank_of(proc: ProcKey) -> int | None:
        return global_ranks.get(proc, procs[proc].rank)

    findings = _network_outliers(procs, rank_of) + _fewer_hcas(procs, rank_of) + _p2p_outliers(facts, rank_of)
    findings += _fewer_channels(facts, rank_of) + _fewer_socket_threads(procs, rank_of) + _missing_hcas(procs, rank_of)
    findings += _sockets_despite_ib(procs, rank_of, active_ib_ports)
    return findings


def _by_host(procs: Iterable[ProcKey], rank_of: RankOf) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for p in procs:
        if (rank := rank_of(p)) is not None:
            out[p.host].append(rank)
    return {host: sorted(ranks) for host, ranks in out.items()}


def _finding(
    rule: str, host: str, ranks: Sequence[int], summary: str, detail: str, links: Sequence[str] = ()
) -> PerfFinding:
    return PerfFinding(
        kind=PerfKind.transport_anomaly,
        key=f"transport-{rule}-{host}",
        summary=summary,
        detail=detail,
        ranks=tuple(ranks),
        hosts=(host,),
        links=tuple(links),
    )


def _reference(values: Mapping[ProcKey, object], best: Callable[[Iterable], object] | None) -> object | None:
    """What the odd ones differ from: ``best`` of the values (the most channels, P2P over none) or,
    without one, the value most processes have; None when all agree or there is no majority."""
    counts = Counter(values.values())
    if len(counts) < 2:
        return None
    if best is not None:
        return best(counts)
    (top, n), (_, m) = counts.most_common(2)
    if n == m and "Socket" in counts:  # two networks half and half: sockets are the fallback
        return next(v for v in counts if v != "Socket")
    return top if n > m else None


def _outlier_hosts(
    values: Mapping[ProcKey, object], rank_of: RankOf, best: Callable[[Iterable], object] | None = None
) -> tuple[object, dict[str, list[int]]] | None:
    usual = _reference(values, best)
    if usual is None:
        return None
    odd = [p for p, v in values.items() if v != usual]
    return usual, _by_host(odd, rank_of)


def _network_outliers(procs: Mapping[ProcKey, RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    networks = {p: f.network for p, f in procs.items() if f.network}
    found = _outlier_hosts(networks, rank_of)
    if found is None:
        return []
    usual, hosts = found
    return [
        _finding(
            "network",
            host,
            ranks,
            f"NCCL on {ranks_text(ranks, {r: host for r in ranks})} uses network "
            f"{procs[next(p for p in networks if p.host == host)].network} while the other nodes use {usual}",
            "a node that fell back to another network runs every collective crossing it at that network's speed: "
            "check its HCAs (ibstat, the report's InfiniBand section), drivers and NCCL_IB_HCA/NCCL_NET",
        )
        for host, ranks in hosts.items()
    ]


def _fewer_hcas(procs: Mapping[ProcKey, RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    # "NET/IB : No device found." is a list of none; a process that printed neither says nothing.
    listed = {p: frozenset(d.name for d in f.ib_devices) for p, f in procs.items() if f.ib_devices or f.ib_absent}
    if not any(listed.values()):
        return []
    most = max(len(names) for names in listed.values())
    union = frozenset().union(*listed.values())
    findings = []
    for host, ranks in _by_host([p for p, n in listed.items() if len(n) < most], rank_of).items():
        names = next(n for p, n in listed.items() if p.host == host)
        missing = sorted(union - names)
        findings.append(
            _finding(
                "hcas",
                host,
                ranks,
                f"NCCL on {ranks_text(ranks, {r: host for r in ranks})} found {len(names)} "
                f"InfiniBand devices where the other ranks found {most}"
                + (f" (missing: {', '.join(missing)})" if missing else ""),
                "a missing HCA means fewer rails: check the device's port state and driver on that node",
                missing,
            )
        )
    return findings


def _p2p_outliers(facts: Sequence[RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    """Among processes with local peers: those whose local connections use no P2P while the others' do."""
    uses_p2p: dict[ProcKey, bool] = {}
    for f in facts:
        if (f.local_ranks or 0) > 1 and f.connections:
            local = {k for k in f.connections if not k.startswith("NET/")}
            uses_p2p[f.proc] = uses_p2p.get(f.proc, False) or any(k.startswith("P2P/") for k in local)
    found = _outlier_hosts(uses_p2p, rank_of, best=max)
    if found is None or found[0] is not True:
        return []
    procs = {f.proc: f for f in facts}
    out = []
    for host, ranks in found[1].items():
        kinds = sorted({k for f in facts if f.proc.host == host for k in f.connections if not k.startswith("P2P/")})
        reason = next((procs[p].p2p_disabled for p in procs if p.host == host and procs[p].p2p_disabled), None)
        out.append(
            _finding(
                "p2p",
                host,
                ranks,
                f"GPUs on {host} talk through {', '.join(kinds) or 'no P2P'} "
                f"instead of P2P (NVLink/PCIe) like the other nodes" + (f": {reason}" if reason else ""),
                "check NCCL_P2P_DISABLE/NCCL_P2P_LEVEL in that node's environment, ACS and the IOMMU, "
                "and nvidia-smi topo -m",
            )
        )
    return out


def _fewer_channels(facts: Sequence[RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    """Communicators of one shape where some have fewer channels than the most common count.

    A shape is (ranks, nodes, local ranks).
    """
    shapes: dict[tuple, dict[ProcKey, int]] = defaultdict(dict)
    for f in facts:
        if f.coll_channels is not None and f.nranks is not None:
            shapes[(f.nranks, f.nnodes, f.local_ranks)][f.proc] = min(
                f.coll_channels, shapes[(f.nranks, f.nnodes, f.local_ranks)].get(f.proc, 1 << 30)
            )
    out = []
    for values in shapes.values():
        found = _outlier_hosts(values, rank_of, best=max)
        if found is None:
            continue
        usual, hosts = found
        for host, ranks in hosts.items():
            fewer = min(v for p, v in values.items() if p.host == host)
            out.append(
                _finding(
                    "channels",
                    host,
                    ranks,
                    f"NCCL built {fewer} channels for {ranks_text(ranks, {})} "
                    f"where communicators of the same shape have {usual}",
                    "fewer channels mean fewer NICs or NVLinks in use: compare that node's HCAs, "
                    "NVLink state (nvidia-smi nvlink -s) and NCCL_MIN/MAX_NCHANNELS",
                )
            )
    return out


def _fewer_socket_threads(procs: Mapping[ProcKey, RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    sockets = {
        p: f.socket_threads[0] * f.socket_threads[1]
        for p, f in procs.items()
        if f.socket_threads and f.network == "Socket"
    }
    found = _outlier_hosts(sockets, rank_of, best=max)
    if found is None:
        return []
    usual, hosts = found
    out = []
    for host, ranks in hosts.items():
        fewer = min(v for p, v in sockets.items() if p.host == host)
        # Ranks, not only the host: ranks of one host can differ (each reads its own environment).
        out.append(
            _finding(
                "sockets",
                host,
                ranks,
                f"NCCL on {ranks_text(ranks, {r: host for r in ranks})} opens {fewer} "
                f"socket{'' if fewer == 1 else 's'} per connection where the other ranks open {usual}",
                "check NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD in those ranks' environment",
            )
        )
    return out


def hca_spec_entries(spec: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """NCCL_IB_HCA -> (exclude, exact, [(name, port)]): ``^`` excludes, ``=`` matches whole names, else prefixes."""
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.lstrip("^")
    exact = text.startswith("=")
    entries = []
    for item in filter(None, (part.strip() for part in text.lstrip("=").split(","))):
        name, _, port = item.partition(":")
        entries.append((name, int(port) if port.isdigit() else None))
    return exclude, exact, entries


def _missing_hcas(procs: Mapping[ProcKey, RankTransport], rank_of: RankOf) -> list[PerfFinding]:
    """Each process against its own NCCL_IB_HCA, as its NCCL logged it: a launch script or the training code
    may set it per node or per rank, so the wrapper's environment is not the job's."""
    missing_by_proc = {}
    for p, f in procs.items():
        if f.ib_hca is None or (f.network != "IB" and not f.ib_devices and not f.ib_absent):
            continue  # no NCCL_IB_HCA, or this process's network lines were not seen
        exclude, exact, entries = hca_spec_entries(f.ib_hca)
        if exclude:
            continue
        missing = [
            f"{name}" + (f":{port}" if port is not None else "")
            for name, port in entries
            if not any(
                (d.name == name if exact else d.name.startswith(name)) and port in (None, d.port) for d in f.ib_devices
            )
        ]
        if missing:
            missing_by_proc[p] = tuple(missing)
    out = []
    for host, ranks in _by_host(missing_by_proc, rank_of).items():
        first = next(p for p in missing_by_proc if p.host == host)
        out.append(
            _finding(
                "ib_hca",
                host,
                ranks,
                f"NCCL on {host} did not find {', '.join(missing_by_proc[first])} "
                f"named in NCCL_IB_HCA={procs[first].ib_hca}",
                "check that HCA's port state, link and driver on that node (ibstat)",
            )
        )
    return out


def _sockets_despite_ib(
    procs: Mapping[ProcKey, RankTransport], rank_of: RankOf, active: Mapping[str, Sequence[str]]
) -> list[PerfFinding]:
    odd = [p for p, f in procs.items() if f.network == "Socket" and active.get(p.host)]
    return [
        _finding(
            "socket_with_ib",
            host,
            ranks,
            f"NCCL on {host} uses sockets although InfiniBand ports {', '.join(active[host])} are active",
            "check NCCL_IB_DISABLE, NCCL_NET and the IB verbs libraries (libibverbs) in the job's environment",
            active[host],
        )
        for host, ranks in _by_host(odd, rank_of).items()
    ]


# --------------------------------------------------------------------------
# InfiniBand ports
# --------------------------------------------------------------------------


def ib_port_findings(
    host: str,
    reading: Mapping[str, Mapping[str, Mapping]],
    delta: Mapping | None = None,
    *,
    used: Iterable[str] = (),
    port_ranks: Mapping[str, Sequence[int]] = {},
) -> list[PerfFinding]:
    """One node's ports (``read_ib_counters``; ``delta`` from ``ib_delta`` over a window) -> findings.

    A port down that NCCL uses (``used``: ``mlx5_1/1`` labels); an active
    port slower than the fastest active sibling of its link layer; a port
    whose error counters rose in the window.  ``port_ranks``: the ranks on
    the GPUs nearest each port (``hca_gpu_map``), named in the finding.
    """
    used = set(used)
    ports = {f"{dev}/{port}": info for dev, dev_ports in reading.items() for port, info in dev_ports.items()}
    active = {label: info for label, info in ports.items() if state_name(info.get("state")) == "ACTIVE"}
    fastest: dict[str | None, float] = {}
    for info in active.values():
        rate = rate_bytes_per_s(info.get("rate"))
        if rate is not None:
            fastest[info.get("link_layer")] = max(rate, fastest.get(info.get("link_layer"), 0.0))
    out = []
    for label, info in ports.items():
        ranks = tuple(port_ranks.get(label, ()))
        if label not in active and label in used:
            out.append(
                _port(
                    host,
                    label,
                    "down",
                    ranks,
                    f"port {label} on {host} is {info.get('state')} ({info.get('phys_state')}) but NCCL uses it",
                    None,
                    None,
                )
            )
        rate, best = rate_bytes_per_s(info.get("rate")), fastest.get(info.get("link_layer"))
        if label in active and rate is not None and best is not None and rate < best:
            out.append(
                _port(
                    host,
                    label,
                    "rate",
                    ranks,
                    f"port {label} on {host} runs at {info.get('rate')}, its siblings at {best * 8 / 1e9:g} Gb/sec",
                    rate,
                    best,
                )
            )
    for label, entry in (delta or {}).get("ports", {}).items():
        if entry.get("errors"):
            moved = ", ".join(f"{name} +{n}" for name, n in entry["errors"].items())
            out.append(
                _port(
                    host,
                    label,
                    "errors",
                    tuple(port_ranks.get(label, ())),
                    f"error counters of port {label} on {host} rose in {delta['seconds']:g} s: {moved}",
                    float(sum(entry["errors"].values())),
                    0.0,
                )
            )
    return out


def _port(
    host: str,
    label: str,
    rule: str,
    ranks: tuple[int, ...],
    summary: str,
    measured: float | None,
    expected: float | None,
) -> PerfFinding:
    if ranks:
        summary += f"; nearest ranks: {', '.join(map(str, ranks))}"
    return PerfFinding(
        kind=PerfKind.ib_port,
        key=f"ib_port-{rule}-{host}-{label}",
        summary=summary,
        detail="a port that trained to a lower rate or counts symbol/link errors usually has a bad cable or "
        "transceiver: ibstat, mlxlink -d <dev> (cable and BER), reseat or replace",
        ranks=ranks,
        hosts=(host,),
        links=(label,),
        measured=measured,
        expected=expected,
    )
