"""NCCL's transport WARNs about two ranks' operations differing -> ``TransportMismatch`` (issue 31).

Each line is NCCL's own format string (NVIDIA/nccl src/transport/net_socket.cc, net_ib.cc) at the releases named;
the 2.28.9 line is the real one of tests/fixtures/bundles/nccl-2.28.9-h100x1 (FSDP2, rank 1 skipped an all_reduce,
two ranks connected over NET/Socket).
"""

from __future__ import annotations

import pytest

from ncclwatch.watchdog.events import NcclWarning, NetworkError, TransportMismatch
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser
from ncclwatch.watchdog.parsing.net_errors import parse_transport_mismatch
from ncclwatch.watchdog.parsing.torch_log import parse_torch_log

REAL_2_28 = (
    "[2026-11-24 21:56:19] vm:543:567 [0] transport/net_socket.cc:567 NCCL WARN NET/Socket : peer 192.0.2.2<36764> "
    "message truncated : receiving 131072 bytes instead of 65536. If you believe your socket network is in a healthy "
    "state, there may be a mismatch in collective sizes or environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between "
    "ranks"
)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            REAL_2_28,
            TransportMismatch(
                transport="socket", peer="192.0.2.2<36764>", sent_bytes=131072, posted_bytes=65536, reporter_sends=False
            ),
        ),
        (  # 2.4-2.9: no peer
            "node1:900:950 [0] NCCL WARN NET/Socket : message truncated : receiving 4096 bytes instead of 1024",
            TransportMismatch(transport="socket", sent_bytes=4096, posted_bytes=1024, reporter_sends=False),
        ),
        (  # 2.12-2.19: the sender's check, with the peer
            "node1:900:950 [3] NCCL WARN NET/IB : req 0/1 tag 7 peer 10.0.0.2<45678> collective mismatch error, "
            "local size 2097152 remote size 1048576",
            TransportMismatch(
                transport="ib", peer="10.0.0.2<45678>", sent_bytes=2097152, posted_bytes=1048576, reporter_sends=True
            ),
        ),
        (  # 2.5-2.11
            "node1:900:950 [3] NCCL WARN NET/IB : collective mismatch error local size 8192 remote 4096 addr 7f12 rkey "
            "1a2b seq 3/4",
            TransportMismatch(transport="ib", sent_bytes=8192, posted_bytes=4096, reporter_sends=True),
        ),
    ],
)
def test_each_format(line, expected):
    assert parse_transport_mismatch(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "node1:900:950 [0] NCCL WARN Message truncated : received 64 bytes instead of 32",  # bootstrap, at init
        "node1:900:950 [0] NCCL WARN NET/Socket : peer 10.0.0.2<4> message truncated : receiving lots",
        "vm:1:1 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12 opcode=0 len=0 vendor err 1",
    ],
)
def test_other_lines_are_not_a_mismatch(line):
    assert parse_transport_mismatch(line) is None


def test_the_nccl_log_parser_keeps_the_sizes_on_its_warning():
    [warning] = [
        e for e in NcclLogParser("vm.543").feed((REAL_2_28 + "\n").encode(), final=True) if isinstance(e, NcclWarning)
    ]
    assert warning.mismatch is not None and (warning.mismatch.sent_bytes, warning.mismatch.posted_bytes) == (
        131072,
        65536,
    )
    assert warning.category == "network"  # still a communicator error for the live prober (comm_errored)


def test_stderr_gives_a_size_mismatch_with_the_rank_of_its_prefix():
    # PyTorch's DistBackendError repeats NCCL's last error on its own line.
    text = (
        "[rank0]:torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3699, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\n"
        "[rank0]:ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "[rank0]:Last error:\n"
        "[rank0]:NET/Socket : peer 192.0.2.2<36764> message truncated : receiving 131072 bytes instead of 65536. If "
        "you believe your socket network is in a healthy state, there may be a mismatch in collective sizes or "
        "environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between ranks\n"
    )
    [error] = [e for e in parse_torch_log(text.encode(), "rank0.log") if isinstance(e, NetworkError)]
    assert (error.kind, error.rank, error.peer, error.cite.line) == ("size_mismatch", 0, "192.0.2.2<36764>", 4)
    assert error.mismatch is not None and error.mismatch.sent_bytes == 131072
