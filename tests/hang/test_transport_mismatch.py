"""NCCL's own mismatch warnings in the verdict (issue 31): the transport's ``message truncated`` / ``collective
mismatch error`` lines name the ranks and sizes, and the verdict cites them.

Measured (BENCHMARKS.md, FSDP2 on two ranks over NET/Socket, rank 1 skips an all_reduce): NCCL's socket transport
fails the communicator with "message truncated: receiving 131072 bytes instead of 65536", after which no rank can
dump Flight Recorder, and each node's NCCL log shows only its own rank.  These are those inputs.
"""

from __future__ import annotations

from pathlib import Path

import nccl_lines as L

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

NOW = 1_800_000_000.0
BUNDLE = next((Path(__file__).parents[1] / "fixtures" / "bundles" / "nccl-2.28.9-h100x1").glob("*.tar.gz"))
COMM = "0x5581e4a3c9e0"
TRUNCATED = (
    "vm:543:567 [0] transport/net_socket.cc:567 NCCL WARN NET/Socket : peer 192.0.2.2<36764> message truncated : "
    "receiving 131072 bytes instead of 65536. If you believe your socket network is in a healthy state, there may be "
    "a mismatch in collective sizes or environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between ranks\n"
)


def one_node(tmp_path: Path, warn: str = TRUNCATED) -> Path:
    """Rank 0's NCCL debug file from its own node: its Init lines, a few steps, then the transport's WARN."""
    text = L.init(0, 2, COMM, host="vm", pid=543) + L.steps(0, COMM, 3, host="vm", pid=543) + warn
    (tmp_path / "vm.543").write_text(text)
    return tmp_path


def test_one_nodes_log_names_both_ranks_and_the_sizes_and_cites_the_line(tmp_path):
    report = analyze_paths([str(one_node(tmp_path))], now=NOW)
    assert (report.verdict, report.culprit_ranks, report.suspect_ranks) == (Verdict.collective_mismatch, [], [0, 1])
    assert (
        "rank 0 received 131072 bytes from peer 192.0.2.2<36764> (rank 1) where it had posted 65536" in report.summary
    )
    [cited] = [e for e in report.evidence if e.fact.startswith("rank 0 received")]
    assert cited.cite.endswith("vm.543:16") and "message truncated" in cited.text


def test_the_sender_side_of_infiniband(tmp_path):
    warn = (
        "vm:543:570 [0] NCCL WARN NET/IB : req 0/1 tag 7 peer 10.0.0.2<45678> collective mismatch error, "
        "local size 2097152 remote size 1048576\n"
    )
    report = analyze_paths([str(one_node(tmp_path, warn))], now=NOW)
    assert report.suspect_ranks == [0, 1] and "InfiniBand" in report.summary
    assert "rank 0 sends 2097152 bytes to peer 10.0.0.2<45678> (rank 1), which posted a receive of 1048576" in (
        report.summary
    )


def test_stays_quiet_without_the_warning(tmp_path):
    report = analyze_paths([str(one_node(tmp_path, warn=""))], now=NOW)
    assert report.verdict != Verdict.collective_mismatch and report.suspect_ranks == []


def test_stderr_alone(tmp_path):
    (tmp_path / "rank0.log").write_text(
        "[rank0]:Last error:\n"
        "[rank0]:NET/Socket : peer 192.0.2.2<36764> message truncated : receiving 131072 bytes instead of 65536. If "
        "you believe your socket network is in a healthy state, there may be a mismatch in collective sizes\n"
    )
    report = analyze_paths([str(tmp_path)], now=NOW)
    assert (report.verdict, report.culprit_ranks, report.suspect_ranks) == (Verdict.collective_mismatch, [], [0])
    assert "rank 0 received 131072 bytes from peer 192.0.2.2<36764> where it had posted 65536" in report.summary


def test_where_the_sequences_decide_the_line_is_cited_with_ranks_and_sizes():
    report = analyze_paths([str(BUNDLE)], now=NOW)
    assert report.culprit_ranks == [1]
    assert any(
        e.fact
        == "NCCL's transport: rank 0 received 131072 bytes from peer 192.0.2.2<36764> (rank 1) where it had "
        "posted 65536"
        and e.cite.endswith("nccl/vm.543:1472")
        for e in report.evidence
    )
