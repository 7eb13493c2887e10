"""Regenerates the RAS samples in this folder: ``python tests/data/ras/gen_fixtures.py``.

Every string and printf format is NCCL's own, from NVIDIA/nccl
``src/ras/client_support.cc``:

- text, 2.26+ format: ``rasClientRunInit`` / ``rasClientRunComms`` as of
  2.29.2 (commit ebd1e929; the same strings at 2.32.3, commit 12df1a11),
  matching the 2.28.9 output quoted in NCCL-FACTS.md;
- text, 2.24/2.25 format (``incomplete_mismatch_2.24.txt``): the 2.24-era
  file (one summed "collective operation counts", "The missing rank: N");
- JSON (2.28.7+): ``jsonWriteHeader`` ... ``jsonWriteFooter`` as of 2.29.2.

Host and pid values are invented (192.0.2.0/24 is a documentation range);
``mismatch_2rank_tie.txt`` reuses the commId and pids of the shared
nccl-2.28.9-2gpu mismatch run.  The ``malformed_*`` files break
``mismatch_4rank.json`` in the ways NCCL 2.28.9 was reported to (truncated,
trailing comma / bad nesting) and the way a port printing its text banner
first does; the exact 2.28.9 defect is not known.  ``real-2.28.9-h200x2/``
holds real replies and is not generated.
"""

# ruff: noqa: UP031 - printf formatting on purpose: these are NCCL's own format strings

import os

OUT = os.path.dirname(os.path.abspath(__file__))


def header(ver="2.28.9", cuda="13.0", rt=13000, drv=13000):
    return f"NCCL version {ver} compiled with CUDA {cuda}\nCUDA runtime version {rt}, driver version {drv}\n\n"


def job_summary(nodes, ppn, gpp, procs, gpus):
    return (
        "Job summary\n===========\n\n"
        "  Nodes  Processes         GPUs  Processes     GPUs\n"
        "(total)   per node  per process    (total)  (total)\n"
        "%7d  %9d  %11d  %9d  %7d\n" % (nodes, ppn, gpp, procs, gpus)
    )


def comms_header(secs, fmt="%.3f"):
    return "\nCommunicators..." + (" (" + fmt + "s)\n=============\n\n") % secs


def table(rows):
    s = (
        "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n"
        "    #  in group  per comm  per node  per comm  in group\n"
    )
    for r in rows:
        s += "%5d  %8d  %8d  %8s  %8d  %8d  %8s  %6s\n" % r
    return s


ERRORS = "\nErrors\n======\n\n"
WARNINGS = "Warnings\n========\n\n"


def gpu_tail(cuda, pid, host, nvml=None):
    g = "%d" % cuda
    if nvml is not None and nvml != cuda:
        g += " (NVML %d)" % nvml
    return "GPU %s managed by process %d on node %s" % (g, pid, host)


def w(name, text):
    with open(os.path.join(OUT, name), "w") as f:
        f.write(text)


# A. The 4-rank mismatch of NCCL-FACTS.md (one node, 4 GPUs).
H4 = "93c39a8020f99e2a"
t = header() + job_summary(1, 4, 1, 4, 4) + comms_header(0.002)
t += table([(0, 1, 1, "4", 4, 4, "RUNNING", "MISMATCH")])
t += ERRORS + WARNINGS
t += "#%d-%d (%016x) MISMATCH\n" % (0, 0, int(H4, 16))
t += "  Communicator ranks have different %s operation counts\n" % "AllReduce"
t += "  %d ranks have launched up to operation %d\n" % (3, 47)
t += "  Rank %d has launched up to operation %d -- %s\n" % (2, 49, gpu_tail(2, 1710, "192.0.2.2"))
t += "\n"
w("mismatch_4rank.txt", t)

# B. Healthy job: 2 nodes x 4 GPUs, one 8-rank comm and two 4-rank comms (e.g. TP groups).
t = header() + job_summary(2, 4, 1, 8, 8) + comms_header(0.004)
t += table([(0, 1, 2, "4", 8, 8, "RUNNING", "OK"), (1, 2, 2, "2", 4, 8, "RUNNING", "OK")])
t += ERRORS + WARNINGS
w("ok_8rank.txt", t)

# C. Rank 5's process SIGSTOPped: first query, before RAS declares it dead.
HC = "5d2f6b1e0c9a4477"
t = header() + job_summary(2, 4, 1, 8, 8) + comms_header(5.013)
t += table([(0, 1, 2, "3-4", 8, 7, "RUNNING", "INCOMPLETE")])
t += ERRORS
t += "INCOMPLETE\n  Missing communicator data from %d job process%s\n" % (1, "")
t += "  Process %d on node %s managing GPU%s %s\n" % (4242, "192.0.2.12", "", "1")
t += "\n"
t += "#%d-%d (%016x) INCOMPLETE\n  Missing communicator data from %d rank%s\n" % (0, 0, int(HC, 16), 1, "")
t += "  Rank %d -- %s\n" % (5, gpu_tail(1, 4242, "192.0.2.12"))
t += "\n"
t += WARNINGS
t += "TIMEOUT\n  Encountered %d communication timeout%s while gathering communicator data\n\n" % (2, "s")
w("incomplete_8rank.txt", t)

# D. Same job 60+ s later: the process is DEAD; two peers report a remote error.
t = header() + job_summary(2, 4, 1, 8, 8) + comms_header(0.011)
t += table([(0, 1, 2, "3-4", 8, 7, "RUNNING", "INCOMPLETE,ERROR")])
t += ERRORS
t += "DEAD\n  %d job process%s considered dead (unreachable via the RAS network)\n" % (1, " is")
t += "  Process %d on node %s managing GPU%s %s\n" % (4242, "192.0.2.12", "", "1")
t += "\n"
t += "#%d-%d (%016x) INCOMPLETE\n  Missing communicator data from %d rank%s\n" % (0, 0, int(HC, 16), 1, "")
t += "  Rank %d -- %s\n" % (5, gpu_tail(1, 4242, "192.0.2.12"))
t += "\n"
t += "#%d-%d (%016x) ERROR\n" % (0, 0, int(HC, 16))
t += "  Asynchronous error%s on %d rank%s\n" % ("s", 2, "s")
t += "  %d ranks reported %s\n" % (2, "Remote process error")
t += "  Rank %d -- %s\n" % (4, gpu_tail(0, 4241, "192.0.2.12"))
t += "  Rank %d -- %s\n" % (6, gpu_tail(2, 4243, "192.0.2.12"))
t += "\n"
t += WARNINGS
w("dead_8rank.txt", t)

# E. Status mismatch during tear-down (2.26+: NOCOMM instead of UNKNOWN); CUDA_VISIBLE_DEVICES remaps NVML ids.
HE = "0b7c44e1d95a3f20"
t = header() + job_summary(2, 4, 1, 8, 8) + comms_header(0.003)
t += table([(0, 1, 2, "4", 8, 8, "FINALIZE", "MISMATCH")])
t += ERRORS + WARNINGS
t += "#%d-%d (%016x) MISMATCH\n" % (0, 0, int(HE, 16))
t += "  Communicator ranks have different status\n"
t += "  %d ranks have status %s\n" % (6, "RUNNING")
t += "  Rank %d has status %s -- %s\n" % (3, "FINALIZE", gpu_tail(3, 2003, "192.0.2.11", nvml=7))
t += "  Rank %d has status %s -- %s\n" % (7, "NOCOMM", gpu_tail(3, 2007, "192.0.2.12", nvml=7))
w("status_mismatch_8rank.txt", t)

# F. 2-rank tie, as on the 2 x H200 fixture machine (commId of shared/fixtures mismatch run).
HF = "678a9195a2e6ef0d"
t = header() + job_summary(1, 2, 1, 2, 2) + comms_header(0.001)
t += table([(0, 1, 1, "2", 2, 2, "RUNNING", "MISMATCH")])
t += ERRORS + WARNINGS
t += "#%d-%d (%016x) MISMATCH\n" % (0, 0, int(HF, 16))
for op, (v1, v0) in (("AllGather", (16, 15)), ("AllReduce", (48, 47))):
    t += "  Communicator ranks have different %s operation counts\n" % op
    t += "  Rank %d has launched up to operation %d -- %s\n" % (1, v1, gpu_tail(1, 715, "192.0.2.20"))
    t += "  Rank %d has launched up to operation %d -- %s\n" % (0, v0, gpu_tail(0, 714, "192.0.2.20"))
    t += "\n"
w("mismatch_2rank_tie.txt", t)

# G. 2.24/2.25 format: one summed "collective operation counts", "The missing rank: N", table header always.
t = header("2.24.3", "12.6", 12060, 12080) + job_summary(4, 8, 1, 32, 32) + comms_header(2.05, "%.2f")
t += table(
    [
        (0, 1, 4, "7-8", 32, 31, "RUNNING", "INCOMPLETE"),
        (1, 1, 4, "1", 4, 4, "RUNNING", "MISMATCH"),
        (2, 7, 4, "1", 4, 28, "RUNNING", "OK"),
    ]
)
t += ERRORS
t += "INCOMPLETE\n  Missing communicator data from %d job process%s\n" % (1, "")
t += "  Process %d on node %s managing GPU%s %s\n" % (3487984, "172.16.64.213", "", "5")
t += "\n"
t += "#%d-%d (%016x) INCOMPLETE\n  Missing communicator data from %d rank%s\n" % (
    0,
    0,
    int("cf264af53edbe986", 16),
    1,
    "",
)
t += "  The missing rank%s: %s\n" % ("", "21")
t += "\n"
t += WARNINGS
t += "TIMEOUT\n  Encountered %d communication timeout%s while gathering communicator data\n\n" % (2, "s")
t += "#%d-%d (%016x) MISMATCH\n" % (1, 0, int("27a079b828ff1a75", 16))
t += "  Communicator ranks have different collective operation counts\n"
t += "  %d ranks have launched up to operation %d\n" % (3, 6650)
t += "  Rank %d has launched up to operation %d -- %s\n" % (2, 6649, gpu_tail(2, 483074, "172.16.64.210"))
t += "\n"
w("incomplete_mismatch_2.24.txt", t)

# ---------------------------------------------------------------- JSON (2.28.7+)
FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


def j_header(ver, rt, drv, ts, n):
    return (
        "{\n"
        + '  "nccl_version": "%s",\n' % ver
        + '  "cuda_runtime_version": %d,\n' % rt
        + '  "cuda_driver_version": %d,\n' % drv
        + '  "timestamp": "%s",\n' % ts
        + '  "communicators_count": %d,\n' % n
        + '  "communicators": [\n'
    )


def j_comm(h, hh, ph, size, nr, nm, first):
    s = "" if first else ",\n"
    return s + (
        "    {\n"
        + '      "hash": "0x%x",\n' % h
        + '      "secondary_hash": "0x%x:0x%x",\n' % (hh, ph)
        + '      "size": %d,\n' % size
        + '      "ranks_count": %d,\n' % nr
        + '      "missing_ranks_count": %d,\n' % nm
        + '      "ranks": [\n'
    )


def j_rank(rank, host, pid, cuda, nvml, init, async_, fin, dest, abort, counts, first):
    s = "" if first else ",\n"
    s += (
        "        {\n"
        + '          "rank": %d,\n' % rank
        + '          "host": "%s",\n' % host
        + '          "pid": %d,\n' % pid
        + '          "cuda_dev": %d,\n' % cuda
        + '          "nvml_dev": %d,\n' % nvml
        + '          "status": {\n'
        + '            "init_state": %d,\n' % init
        + '            "async_error": %d,\n' % async_
        + '            "finalize_called": %s,\n' % ("true" if fin else "false")
        + '            "destroy_flag": %s,\n' % ("true" if dest else "false")
        + '            "abort_flag": %s\n' % ("true" if abort else "false")
        + "          },\n"
        + '          "collective_counts": {\n'
    )
    for i, op in enumerate(FUNCS):
        s += '            "%s": %d' % (op, counts.get(op, 0))
        if i < len(FUNCS) - 1:
            s += ","
        s += "\n"
    return s + "          }\n" + "        }"


def j_missing_start():
    return "\n      ],\n" + '      "missing_ranks": [\n'


def j_missing(rank, host, pid, cuda, nvml, unresp, dead, first):
    s = "" if first else ",\n"
    return s + (
        "        {\n"
        + '          "rank": %d,\n' % rank
        + '          "host": "%s",\n' % host
        + '          "pid": %d,\n' % pid
        + '          "cuda_dev": %d,\n' % cuda
        + '          "nvml_dev": %d,\n' % nvml
        + '          "status": {\n'
        + '            "unresponsive": %s,\n' % ("true" if unresp else "false")
        + '            "considered_dead": %s\n' % ("true" if dead else "false")
        + "          }\n"
        + "        }"
    )


def j_end_comm():
    return "\n      ]\n" + "    }"


def j_footer(t, timeouts):
    return (
        "\n  ],\n"
        + '  "ras": {\n'
        + '    "collection_time_sec": %.3f,\n' % t
        + '    "timeouts_count": %d\n' % timeouts
        + "  }\n"
        + "}\n"
    )


# H. JSON of the 4-rank mismatch (A).
j = j_header("2.28.9", 13000, 13000, "2026-11-21 22:51:07", 1)
j += j_comm(int(H4, 16), 0x4C1D9A0E72B35F18, 0x9E0F3A6C51D2B784, 4, 4, 0, True)
for r, pid in enumerate((1708, 1709, 1710, 1711)):
    ar = 49 if r == 2 else 47
    j += j_rank(
        r, "192.0.2.2", pid, r, r, 0, 0, False, False, False, {"Broadcast": 1, "AllGather": 12, "AllReduce": ar}, r == 0
    )
j += j_missing_start() + j_end_comm() + j_footer(0.002, 0)
w("mismatch_4rank.json", j)

# I. JSON of the dead rank (D): rank 5 missing and dead, ranks 4 and 6 with async error 6 (ncclRemoteError).
j = j_header("2.29.2", 13000, 13000, "2026-11-21 23:02:40", 1)
j += j_comm(int(HC, 16), 0x1F2E3D4C5B6A7988, 0x0123456789ABCDEF, 8, 7, 1, True)
first = True
for r in (0, 1, 2, 3, 4, 6, 7):
    host = "192.0.2.11" if r < 4 else "192.0.2.12"
    j += j_rank(
        r,
        host,
        4237 + r if r >= 4 else 3100 + r,
        r % 4,
        r % 4,
        0,
        6 if r in (4, 6) else 0,
        False,
        False,
        False,
        {"Broadcast": 1, "AllGather": 20, "AllReduce": 311},
        first,
    )
    first = False
j += j_missing_start()
j += j_missing(5, "192.0.2.12", 4242, 1, 1, True, True, True)
j += j_end_comm() + j_footer(0.011, 0)
w("dead_8rank.json", j)

# J. Healthy 2-rank JSON (as the 2 x H200 machine would give with -f json).
j = j_header("2.28.9", 13000, 13000, "2026-11-21 22:40:02", 1)
j += j_comm(int(HF, 16), 0x77AA55CC33EE1100, 0x2468ACE013579BDF, 2, 2, 0, True)
for r in (0, 1):
    j += j_rank(
        r,
        "192.0.2.20",
        714 + r,
        r,
        r,
        0,
        0,
        False,
        False,
        False,
        {"Broadcast": 16, "AllGather": 16, "AllReduce": 48},
        r == 0,
    )
j += j_missing_start() + j_end_comm() + j_footer(0.001, 0)
w("ok_2rank.json", j)

# K. Malformed variants of H (NCCL 2.28.9 was seen returning broken JSON; exact defect unknown).
with open(os.path.join(OUT, "mismatch_4rank.json")) as f:
    h = f.read()
cut = h.index('"AllGather": 12', h.index('"rank": 3'))
w("malformed_truncated.json", h[: cut + len('"AllGather": 1')])
bad = h.replace('        }\n      ],\n      "missing_ranks"', '        },\n      ],\n      "missing_ranks"')
bad = bad.replace('        },\n        {\n          "rank": 2', '        }\n        {\n          "rank": 2')
w("malformed_commas.json", bad)
w("malformed_text_prefix.json", header() + job_summary(1, 4, 1, 4, 4) + "\nCommunicators..." + h)

# L. Two ranks of eight one AllReduce ahead of the other six (issue 31): they finished their part of operation 1234
# and launched the next; the rank the others wait for is among the six. Text: the six are one unnamed group, the two a
# group of their own whose ranks are listed (rasCountIsOutlier: 2 <= RAS_CLIENT_DETAIL_THRESHOLD and <= 8 * 0.25).
HL = "c0ffee0ddba11a57"
t = header() + job_summary(2, 4, 1, 8, 8) + comms_header(0.004)
t += table([(0, 1, 2, "4", 8, 8, "RUNNING", "MISMATCH")])
t += ERRORS + WARNINGS
t += "#%d-%d (%016x) MISMATCH\n" % (0, 0, int(HL, 16))
t += "  Communicator ranks have different %s operation counts\n" % "AllReduce"
t += "  %d ranks have launched up to operation %d\n" % (6, 1234)
t += "  %d ranks have launched up to operation %d\n" % (2, 1235)
t += "  Rank %d -- %s\n" % (1, gpu_tail(1, 5101, "192.0.2.11"))
t += "  Rank %d -- %s\n" % (5, gpu_tail(1, 5105, "192.0.2.12"))
t += "\n"
w("few_ahead_8rank.txt", t)
j = j_header("2.28.9", 13000, 13000, "2026-11-26 20:40:00", 1)
j += j_comm(int(HL, 16), 0x5A5A5A5A00FF00FF, 0x0F0F0F0F12345678, 8, 8, 0, True)
for r in range(8):
    ar = 1235 if r in (1, 5) else 1234
    j += j_rank(
        r,
        "192.0.2.11" if r < 4 else "192.0.2.12",
        5100 + r,
        r % 4,
        r % 4,
        0,
        0,
        False,
        False,
        False,
        {"Broadcast": 1, "AllGather": 300, "AllReduce": ar},
        r == 0,
    )
j += j_missing_start() + j_end_comm() + j_footer(0.004, 0)
w("few_ahead_8rank.json", j)
