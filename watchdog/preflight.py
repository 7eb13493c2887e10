"""``ncclwatch preflight``: the node's bus bandwidth, measured, against what its links should give.

The measurement is kept as the baseline.

The sweep runs in child processes (``launcher/preflight_job.py``, one per
rank, torch imported there only), all in one new process group, under a
hard time limit: at the limit the whole group gets SIGKILL and the result
is an error, so a probe can never hang its caller.  Across nodes, run one
``ncclwatch preflight --nnodes N --node-rank I --master-addr A`` per node.

What the numbers mean.  Expected busbw is an upper bound from the links:
NVLink (NVML: active links x per-link one-way bandwidth of their
generation) inside a node, the sum of the node's active InfiniBand port
rates across nodes, the smaller of the two when both apply; nccl-tests
typically reach 70-90 % of it.  A probe taken while a hung job's NCCL
kernels still spin on the GPUs measures contention (14.7 GB/s against 336
GB/s idle on 4 x H200), so at a hang use it in one of two ways, and the
result says which it was (``mode``): after ``--on-hang kill`` freed the GPUs
(compared with the baseline), or ``--pairs`` (every pair of ranks in turn:
all GPUs equally busy, so a pair far below the others points at a link,
whatever the absolute figure).

Failure modes: no NVML or no InfiniBand -> that expectation is None, not 0;
a child that fails or runs out of time -> ``{"error": ...}`` with the tail of
its stderr; a missing or unreadable baseline -> no comparison, said so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ncclwatch.watchdog.events import rate_bytes_per_s, state_name
from ncclwatch.watchdog.probes.infiniband import SYS_INFINIBAND, read_ib_counters
from ncclwatch.watchdog.slowness.findings import gbps

# One-way bandwidth of one NVLink, bytes/s, by NVML's nvmlNvlinkVersion_t (nvmlDeviceGetNvLinkVersion), which
# counts point releases: 1 = NVLink 1.0 (P100) 20 GB/s; 2 = 2.0 (V100), 3 = 2.2, 4 = 3.0 (A100), 5 = 3.1,
# 6 = 4.0 (H100, H200: NVML said 6 on the lent 2 x H200, 18 links) 25 GB/s; 7 = 5.0 (B200) 50 GB/s.
NVLINK_LINK_BYTES_PER_S = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 25e9, 6: 25e9, 7: 50e9}
DEFAULT_SIZES = tuple(1 << p for p in range(20, 31, 2))  # 1 MiB .. 1 GiB, as nccl-tests -b 1M -e 1G -f 4
CPU_SIZES = (1 << 12, 1 << 16, 1 << 20)
SLOW_RATIO = 0.8  # below 80 % of the baseline at the same op and size is worth a look


def nvlink_summary() -> list[dict] | None:
    """Per GPU: active NVLinks and their generation, from NVML; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: no data
        return None
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        links, versions = 0, set()
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    links += 1
                    versions.add(pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
            except pynvml.NVMLError:
                break  # past the device's last link
        gpus.append({"index": index, "links": links, "version": max(versions) if versions else None})
    return gpus


def expected_busbw(nvlink: Sequence[dict] | None, ib_ports: dict | None, *, local_ranks: int, nnodes: int) -> dict:
    """The links' upper bounds, bytes/s: ``{"intra", "inter", "expected", "basis"}`` (None where unknown)."""
    intra = None
    if nvlink and local_ranks > 1:
        per_gpu = [g["links"] * NVLINK_LINK_BYTES_PER_S.get(g["version"], 0.0) for g in nvlink[:local_ranks]]
        intra = min(per_gpu) or None
    inter = None
    if ib_ports and nnodes > 1:
        rates = [
            rate_bytes_per_s(p.get("rate"))
            for dev in ib_ports.values()
            for p in dev.values()
            if state_name(p.get("state")) == "ACTIVE"
        ]
        inter = sum(r for r in rates if r) or None
    bounds = [b for b in (intra, inter) if b is not None]
    basis = " and ".join(name for name, b in (("NVLink", intra), ("InfiniBand", inter)) if b is not None) or None
    return {"intra": intra, "inter": inter, "expected": min(bounds) if bounds else None, "basis": basis}


def _rank_command(
    backend: str, sizes: Sequence[int], ops: Sequence[str], out: Path, pairs_bytes: int, iters: int
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ncclwatch.launcher.preflight_job",
        f"--backend={backend}",
        f"--ops={','.join(ops)}",
        f"--sizes={','.join(map(str, sizes))}",
        f"--out={out}",
        f"--pairs-bytes={pairs_bytes}",
        f"--iters={iters}",
        f"--warmup={max(1, iters // 4)}",
    ]


def run_ranks(
    command: list[str],
    nproc: int,
    *,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    time_limit_s: float,
    env: dict[str, str] | None = None,
) -> tuple[int | None, str]:
    """Start ``nproc`` ranks in one new process group; wait up to ``time_limit_s``; SIGKILL the group at the limit.

    Returns (the first non-zero exit status, or 0; None on timeout) and the tail of the ranks' stderr.
    """
    base = {
        **os.environ,
        **(env or {}),
        "WORLD_SIZE": str(nproc * nnodes),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    logs = tempfile.TemporaryFile()
    procs: list[subprocess.Popen] = []
    try:
        for local in range(nproc):
            rank_env = {**base, "RANK": str(node_rank * nproc + local), "LOCAL_RANK": str(local)}
            group = {"process_group": procs[0].pid if procs else 0}  # one new group (in our session) for all ranks
            procs.append(
                subprocess.Popen(command, env=rank_env, stdout=logs, stderr=logs, stdin=subprocess.DEVNULL, **group)
            )
        deadline = time.monotonic() + time_limit_s
        status: int | None = None
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            failed = [code for code in codes if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                status = failed[0] if failed else 0  # one rank failed: the others would wait for it until the limit
                break
            time.sleep(0.05)
    finally:
        if procs:
            try:
                os.killpg(procs[0].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for proc in procs:
                proc.wait()
        logs.seek(0)
        tail = logs.read()[-4000:].decode("utf-8", "replace")
        logs.close()
    return status, tail


def run_preflight(
    *,
    nproc: int,
    backend: str = "nccl",
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[str] = ("all_reduce", "all_gather"),
    pairs_bytes: int = 0,
    iters: int = 20,
    time_limit_s: float = 300.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    mode: str = "idle",
    sys_infiniband: Path = SYS_INFINIBAND,
    env: dict[str, str] | None = None,
) -> dict:
    """Run the sweep; the result document (``rows``, ``pairs``, ``expected``, ...) or one with ``error``."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="ncclwatch-preflight-") as tmp:
        out = Path(tmp) / "result.json"
        command = _rank_command(backend, sizes, ops, out, pairs_bytes, iters)
        port = master_port or _free_port()
        status, tail = run_ranks(
            command,
            nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=port,
            time_limit_s=time_limit_s,
            env=env,
        )
        doc: dict = {
            "kind": "ncclwatch-preflight",
            "host": socket.gethostname(),
            "created_at": started,
            "mode": mode,
            "backend": backend,
            "nproc": nproc,
            "nnodes": nnodes,
            "node_rank": node_rank,
        }
        if status is None:
            return {**doc, "error": f"timed out after {time_limit_s:g} s; every rank was killed", "stderr_tail": tail}
        if node_rank != 0:
            return {
                **doc,
                "note": "results are written by the node of rank 0",
                **({"error": f"a rank exited with status {status}", "stderr_tail": tail} if status else {}),
            }
        if status != 0 or not out.is_file():
            return {**doc, "error": f"a rank exited with status {status}", "stderr_tail": tail}
        doc.update(json.loads(out.read_text()))
    doc["duration_s"] = round(time.time() - started, 3)
    doc["links"] = {"nvlink": nvlink_summary() if backend == "nccl" else None, "ib": read_ib_counters(sys_infiniband)}
    doc["expected"] = expected_busbw(doc["links"]["nvlink"], doc["links"]["ib"], local_ranks=nproc, nnodes=nnodes)
    return doc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# Reading a result: the table, the baseline, the pairs
# --------------------------------------------------------------------------


def render_table(doc: dict) -> str:
    """nccl-tests' columns, plus the links' bound and the share of it reached."""
    if "error" in doc:
        return f"preflight failed: {doc['error']}\n{doc.get('stderr_tail', '')}"
    expected = (doc.get("expected") or {}).get("expected")
    basis = (doc.get("expected") or {}).get("basis") or "no NVLink/InfiniBand figure"
    lines = [
        f"# {doc['host']} {doc['backend']} {doc['nproc']} ranks x {doc['nnodes']} nodes ({doc.get('device')}), "
        f"mode {doc['mode']}; expected busbw: {gbps(expected) if expected else 'unknown'} ({basis})",
        f"{'op':>14} {'size':>12} {'time(us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'of expected':>12}",
    ]
    for row in doc.get("rows", []):
        share = f"{row['busbw'] / expected:.0%}" if expected and row["busbw"] else "-"
        lines.append(
            f"{row['op']:>14} {row['bytes']:>12} {row['seconds'] * 1e6:>11.1f} {(row['algbw'] or 0) / 1e9:>11.2f} "
            f"{(row['busbw'] or 0) / 1e9:>11.2f} {share:>12}"
        )
    for row in doc.get("pairs", []):
        lines.append(
            f"{'pair ' + '-'.join(map(str, row['pair'])):>14} {row['bytes']:>12} {row['seconds'] * 1e6:>11.1f} "
            f"{'':>11} {(row['busbw'] or 0) / 1e9:>11.2f}"
        )
    return "\n".join(lines)


def compare_to_baseline(doc: dict, baseline: dict, *, ratio: float = SLOW_RATIO) -> list[str]:
    """Sentences for each (op, size) now under ``ratio`` x the baseline's busbw; [] when all keep up.

    Only meaningful when the GPUs were idle for both (``mode``): says so when not.
    """
    before = {(r["op"], r["bytes"]): r["busbw"] for r in baseline.get("rows", []) if r.get("busbw")}
    out = []
    if doc.get("mode") != "idle":
        out.append(
            f"this run's GPUs were not idle (mode {doc.get('mode')}): lower figures may be contention, not links"
        )
    for row in doc.get("rows", []):
        then = before.get((row["op"], row["bytes"]))
        if then and row.get("busbw") is not None and row["busbw"] < ratio * then:
            out.append(
                f"{row['op']} {row['bytes']} B: {gbps(row['busbw'])}, "
                f"{row['busbw'] / then:.0%} of the baseline's {gbps(then)}"
            )
    return out


def slow_pairs(doc: dict, *, ratio: float = 0.5) -> list[str]:
    """Pairs of ranks under ``ratio`` x the median pair: the link between them (or one of their GPUs) is the odd one."""
    pairs = [p for p in doc.get("pairs", []) if p.get("busbw")]
    if len(pairs) < 3:
        return []  # with two pairs there is no telling which one is odd
    median = statistics.median(p["busbw"] for p in pairs)
    return [
        f"ranks {p['pair'][0]}-{p['pair'][1]}: {gbps(p['busbw'])}, "
        f"{p['busbw'] / median:.0%} of the median pair ({gbps(median)})"
        for p in pairs
        if p["busbw"] < ratio * median
    ]


def parse_size(text: str) -> int:
    """``64K``, ``16M``, ``1G`` (powers of two) or plain bytes."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_parser() -> argparse.ArgumentParser:
    """``ncclwatch preflight``'s parser (its help is whole within a screen: no --help-all)."""
    parser = argparse.ArgumentParser(
        prog="ncclwatch preflight",
        description="Measure the node's bus bandwidth (all_reduce and all_gather sweeps, nccl-tests' busbw) "
        "against what its NVLinks and InfiniBand ports should give, and keep it as the baseline. "
        "Runs in its own processes under a hard time limit. On CPU use --backend gloo.",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks on this node (default: the GPUs NVML sees, else 2)"
    )
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument(
        "--sizes", default=None, help="comma-separated, e.g. 1M,16M,256M (default 1M..1G by 4x; gloo 4K..1M)"
    )
    parser.add_argument("--ops", default="all_reduce,all_gather")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--pairs", default=None, metavar="SIZE", help="also time an all_reduce of SIZE between every pair of ranks"
    )
    parser.add_argument(
        "--time-limit", type=float, default=300.0, metavar="SECONDS", help="every rank is killed at this limit"
    )
    parser.add_argument(
        "--mode", choices=("idle", "at-hang"), default="idle", help="recorded with the result: were the GPUs free?"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="result JSON (default ./ncclwatch-preflight-<host>.json)"
    )
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier result to compare with")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=None, help="required with --nnodes > 1")
    parser.add_argument("--json", action="store_true", help="print the result document instead of the table")
    return parser


def main(argv: Sequence[str]) -> int:
    """``ncclwatch preflight``, returning its exit status.

    0 all well, 1 slower than the baseline or a slow pair, 2 the probe failed.
    """
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.nnodes > 1 and args.master_port is None:
        parser.error("--master-port is required with --nnodes > 1 (every node must use the same one)")
    nproc = args.nproc or len(nvlink_summary() or []) or 2
    sizes = (
        [parse_size(s) for s in args.sizes.split(",")]
        if args.sizes
        else list(CPU_SIZES if args.backend == "gloo" else DEFAULT_SIZES)
    )
    doc = run_preflight(
        nproc=nproc,
        backend=args.backend,
        sizes=sizes,
        ops=args.ops.split(","),
        iters=args.iters,
        pairs_bytes=parse_size(args.pairs) if args.pairs else 0,
        time_limit_s=args.time_limit,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        mode=args.mode,
    )
    out = args.out or Path(f"ncclwatch-preflight-{socket.gethostname()}.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    problems = slow_pairs(doc)
    if args.baseline is not None:
        try:
            problems += compare_to_baseline(doc, json.loads(args.baseline.read_text()))
        except (OSError, ValueError) as exc:
            problems.append(f"baseline {args.baseline}: not read ({exc})")
    print(json.dumps(doc, indent=1) if args.json else render_table(doc))
    for line in problems:
        print(f"ncclwatch preflight: {line}", file=sys.stderr)
    print(f"ncclwatch preflight: result in {out}", file=sys.stderr)
    return 2 if "error" in doc else 1 if problems else 0
