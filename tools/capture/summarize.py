#!/usr/bin/env python3
"""Print what a capture set shows, scenario by scenario (to check and document captures).

Usage: python3 tools/capture/summarize.py <machine folder> [<scenario> ...]

Per scenario: heartbeats, NCCL ops per rank (from ` NCCL INFO <Op>: opCount`
lines, per communicator), the first position where the ranks' op sequences
differ, the Flight Recorder's last entries per rank, NVML signature per rank,
RAS answers (and whether the json parses), py-spy main-thread stacks and
/proc states. Standard library only (FR dumps are plain-type pickles).
"""

import collections
import glob
import json
import os
import pickle
import re
import sys

OP_RE = re.compile(
    r"NCCL INFO (\w+): opCount (\S+) sendbuff (\S+) recvbuff (\S+) count (\d+) datatype (\d+) "
    r"op (\d+) root (-?\d+) comm (\S+)"
)
INIT_RE = re.compile(r"ncclCommInitRank\w* comm (\S+) rank (\d+) nranks (\d+) .*?commId (\S+) - Init COMPLETE")


def load_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def nccl_ops(d):
    """{rank: {commId: [(op, count, root), ...]}} and {rank: pid}."""
    out, pids = {}, {}
    for path in sorted(glob.glob(os.path.join(d, "nccl", "*.log"))):
        pid = int(path.rsplit(".", 2)[1])
        comm_rank, comm_id = {}, {}
        ops = collections.defaultdict(list)
        with open(path, errors="replace") as f:
            for line in f:
                m = INIT_RE.search(line)
                if m:
                    comm_rank[m.group(1)] = int(m.group(2))
                    comm_id[m.group(1)] = f"{m.group(4)}(n={m.group(3)})"
                    continue
                m = OP_RE.search(line)
                if m:
                    comm = m.group(9)
                    ops[comm_id.get(comm, comm)].append((m.group(1), int(m.group(5)), int(m.group(8))))
        # global rank: the rank in the communicator with the most ranks
        rank = None
        best = -1
        for c, r in comm_rank.items():
            n = int(comm_id[c].split("n=")[1].rstrip(")"))
            if n > best:
                best, rank = n, r
        if rank is None:
            rank = f"pid{pid}"
        out[rank] = dict(ops)
        pids[rank] = pid
    return out, pids


def fr_summary(path, last=6):
    try:
        with open(path, "rb") as f:
            d = pickle.load(f)
    except Exception as e:  # noqa: BLE001
        return f"unreadable: {e}"
    entries = d.get("entries", [])
    lines = [f"version {d.get('version')}, {len(entries)} entries, pg_status {d.get('pg_status')}"]
    states = collections.Counter(e.get("state") for e in entries)
    lines.append(f"states {dict(states)}")
    for e in entries[-last:]:
        lines.append(
            f"  #{e.get('record_id')} pg{e.get('pg_id')} coll_seq {e.get('collective_seq_id')} "
            f"p2p_seq {e.get('p2p_seq_id')} {e.get('profiling_name')} in={e.get('input_sizes')} "
            f"state={e.get('state')}"
        )
    return "\n".join(lines)


def pyspy_main(path):
    d = load_json(path)
    if d is None:
        return "unreadable"
    for t in d:
        if t.get("thread_name") == "MainThread" or t.get("os_thread_id") == t.get("pid"):
            fr = [f"{f['name']}:{f['line']}" for f in t.get("frames", [])]
            return " <- ".join(fr[:4])
    return "no main thread"


def summarize(d):
    print(f"## {os.path.basename(d.rstrip('/'))}")
    scen = load_json(os.path.join(d, "scenario.json"), {})
    print(
        f"mode {scen.get('capture_mode')} torchrun_rc {scen.get('torchrun_rc')} fault_rank {scen.get('fault_rank')} "
        f"fault_step {scen.get('fault_step')} nranks {scen.get('nranks')}"
    )
    print("heartbeats:", {r: v["step"] for r, v in (scen.get("heartbeats") or {}).items()})
    ranks = load_json(os.path.join(d, "ranks.json"), {})
    pid2rank = {w["pid"]: w["rank"] for w in ranks.get("workers", [])}
    ops, _ = nccl_ops(d)
    for rank in sorted(ops, key=str):
        for comm, seq in ops[rank].items():
            c = collections.Counter(o for o, _, _ in seq)
            print(f"rank {rank} comm {comm}: {len(seq)} ops {dict(c)}")
    # first divergence on the biggest communicator
    by_comm = collections.defaultdict(dict)
    for rank, comms in ops.items():
        for comm, seq in comms.items():
            by_comm[comm][rank] = seq
    for comm, seqs in by_comm.items():
        if len(seqs) < 2:
            continue
        n = min(len(s) for s in seqs.values())
        div = next((i for i in range(n) if len({(s[i][0], s[i][1]) for s in seqs.values()}) > 1), None)
        if div is None:
            print(f"comm {comm}: common prefix of {n} ops identical; lengths {[len(s) for s in seqs.values()]}")
        else:
            print(
                f"comm {comm}: first divergence at position {div}: "
                + "; ".join(f"r{r}={s[div][0]}({s[div][1]})" for r, s in sorted(seqs.items(), key=str))
            )
    for path in sorted(glob.glob(os.path.join(d, "fr", "nccl_trace_rank_*"))):
        print(f"FR {os.path.basename(path)}: {fr_summary(path)}")
    snaps = load_json(os.path.join(d, "nvml.json"))
    if snaps:
        s = snaps[-1]
        for g in s["gpus"]:
            who = [pid2rank.get(p["pid"], p["pid"]) for p in g["processes"]]
            print(
                f"nvml gpu {g['index']} ranks {who}: util {g['util_gpu_pct']}% power {g['power_w']}W "
                f"sm {g['sm_clock_mhz']}MHz gpm {g['gpm']}"
            )
    for name in ("ras.txt", "ras.json"):
        p = os.path.join(d, "ras", name)
        if os.path.exists(p):
            raw = open(p, "rb").read()
            extra = ""
            if name == "ras.json":
                try:
                    json.loads(raw)
                    extra = " (valid json)"
                except ValueError as e:
                    extra = f" (INVALID json: {e})"
            print(f"RAS {name}: {len(raw)} bytes{extra}")
        if os.path.exists(p + ".error"):
            print(f"RAS {name} error: {open(p + '.error').read().strip()}")
    ras_txt = os.path.join(d, "ras", "ras.txt")
    if os.path.exists(ras_txt):
        for line in open(ras_txt, errors="replace"):
            if any(
                k in line
                for k in (
                    "MISMATCH",
                    "operation",
                    "Rank ",
                    "launched",
                    "Warnings",
                    "Errors",
                    "DEAD",
                    "NOT RESPONDING",
                    "INCOMPLETE",
                    "does not",
                )
            ):
                print("  RAS| " + line.rstrip())
    for path in sorted(glob.glob(os.path.join(d, "pyspy", "pyspy.*.json"))):
        pid = int(path.split(".")[-2])
        print(f"py-spy rank {pid2rank.get(pid, '?')} pid {pid}: {pyspy_main(path)}")
    for path in sorted(glob.glob(os.path.join(d, "pyspy", "*.error.txt"))):
        print(f"py-spy error {os.path.basename(path)}: {open(path, errors='replace').read()[:200]!r}")
    for path in sorted(glob.glob(os.path.join(d, "proc", "status.*"))):
        pid = int(path.rsplit(".", 1)[1])
        st = next((ln.split(":", 1)[1].strip() for ln in open(path) if ln.startswith("State:")), "?")
        print(f"proc rank {pid2rank.get(pid, '?')} pid {pid}: {st}")
    print()


def main():
    root = sys.argv[1]
    names = sys.argv[2:] or sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
    for n in names:
        summarize(os.path.join(root, n))


if __name__ == "__main__":
    main()
