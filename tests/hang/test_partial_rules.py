"""The partial-evidence rules (``hang.partial.PARTIAL_RULES``): one class per rule, named after it, with a case where
it fires and one where it stays quiet (``test_rule_tables`` checks every rule has both).

Partial evidence of the kind users post, where the culprit was knowable and not named (issue 23, part 5): each rule
has a case that names the culprit and one that must not name anyone.  Lines mirror the real
formats: NCCL's COLL line (``host:pid:tid [cudaDev] NCCL INFO AllReduce: opCount ...``, as in the
2.28.9 captures in ``shared/fixtures``), PyTorch's watchdog lines of torch 2.4+ (``[rank1]:[E...]
[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(...)`` and ``[PG ID 0 PG GUID
0(default_pg) Rank 0] failure detected by watchdog at work sequence id: ...``) and
``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s ``Detected mismatch between collectives on ranks`` message, whose
"but Rank k" side is the first rank, in rank order, whose fingerprint differs (``ProcessGroupWrapper``).
"""

from __future__ import annotations

import json
from pathlib import Path

import nccl_lines as L
from conftest import FIXTURES
from harness import snapshot_with

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import Citation, Event, NetworkError, WatchdogTimeout, WorkerFailure
from ncclwatch.watchdog.hang.partial import dead_peer, detail_mismatch
from ncclwatch.watchdog.hang.partial_rules import Facts, network_finding, orphan_ops, process_groups, transport_mismatch
from ncclwatch.watchdog.hang.report import Report
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.torch_log import parse_torch_log

NOW = 1_800_000_000.0
BF16, F32, SUM = 9, 7, 0


def coll(
    host: str,
    pid: int,
    dev: int,
    op: str,
    opcount: int,
    count: int,
    dtype: int = BF16,
    *,
    comm: str = "0x55d1c0a3e8d0",
    nranks: int = 3,
    prefix: str = "",
) -> str:
    buffers = "sendbuff 0x7f1bebe05000 recvbuff 0x7f1bebe05600"
    return (
        f"{prefix}{host}:{pid}:{pid + 50} [{dev}] NCCL INFO {op}: opCount {opcount:x} {buffers} count {count} "
        f"datatype {dtype} op {SUM} root 0 comm {comm} [nranks={nranks}] stream 0x1efc1be0\n"
    )


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def analyze(folder: Path) -> Report:
    return analyze_paths([str(folder)], now=NOW)


STEP = [("AllReduce", 262144), ("AllReduce", 262144), ("AllGather", 87382)]  # a step's collectives (count per rank)


def single_node(steps: int, pid: int, dev: int) -> str:
    """One process's NCCL debug file (NCCL_DEBUG_SUBSYS=COLL: no Init line) on one node, NCCL 2.28: opCount 0."""
    return "".join(coll("gpu7", pid, dev, op, 0, count) for _ in range(steps) for op, count in STEP)


class TestOrphanOps:
    def test_quiet_where_every_line_has_its_init(self) -> None:
        logs = {f"nccl.vm.{640 + r}.log": nccl_with_init(r, STEP * 2) for r in (0, 1)}
        assert orphan_ops(facts_of(logs=logs)) is None

    def test_two_processes_agree_and_the_third_departs_it_is_named_by_process_and_gpu(self, tmp_path: Path) -> None:
        files = {f"nccl.gpu7.{4100 + d}": single_node(4, 4100 + d, d) for d in range(3)}
        for d in (0, 1):  # both enter the loss all-reduce; process 4102 enters an all-gather of another size
            files[f"nccl.gpu7.{4100 + d}"] += coll("gpu7", 4100 + d, d, "AllReduce", 0, 1, F32)
        files["nccl.gpu7.4102"] += coll("gpu7", 4102, 2, "AllGather", 0, 43691)
        report = analyze(write(tmp_path / "case", files))
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [])
        assert [(p.host, p.pid, p.cuda_dev) for p in report.culprit_processes] == [("gpu7", 4102, 2)]
        assert "process gpu7:4102 (GPU 2)" in report.headline  # type: ignore[operator]
        assert json.loads(report.model_dump_json())["culprit_processes"] == [
            {"host": "gpu7", "pid": 4102, "cuda_dev": 2}
        ]

    def test_a_process_that_stops_in_what_its_peers_issued_earlier_is_not_named(self, tmp_path: Path) -> None:
        """opCount 0 on every line: a process one operation behind stops in an all-reduce its peers also issued."""
        files = {f"nccl.gpu7.{4100 + d}": single_node(4, 4100 + d, d) for d in range(3)}
        files["nccl.gpu7.4102"] = (
            files["nccl.gpu7.4102"].rsplit("\n", 2)[0] + "\n"
        )  # stopped before the last all-gather
        report = analyze(write(tmp_path / "case", files))
        assert report.verdict.value == "inconclusive" and report.culprit_ranks == [] and report.culprit_processes == []

    def test_an_even_split_names_no_process(self, tmp_path: Path) -> None:
        files = {f"nccl.gpu7.{4100 + d}": single_node(4, 4100 + d, d) for d in range(2)}
        files["nccl.gpu7.4100"] += coll("gpu7", 4100, 0, "Broadcast", 0, 4096, nranks=2)
        files["nccl.gpu7.4101"] += coll("gpu7", 4101, 1, "AllReduce", 0, 1, F32, nranks=2)
        for name in files:
            files[name] = files[name].replace("[nranks=3]", "[nranks=2]")
        report = analyze(write(tmp_path / "case", files))
        assert report.verdict.value == "collective_mismatch"
        assert report.culprit_ranks == [] and report.culprit_processes == []

    def test_on_several_nodes_the_departing_process_at_one_opcount(self, tmp_path: Path) -> None:
        """Multi-node: opCount moves.  At 0x1e two processes all-reduce 65536 elements, the third 32768."""
        lines = {host: "" for host in ("node0", "node1", "node2")}
        for opcount in range(0x1C, 0x1F):
            for i, host in enumerate(lines):
                count = 32768 if (host == "node2" and opcount == 0x1E) else 65536
                lines[host] += coll(host, 300 + i, 0, "AllReduce", opcount, count, comm=f"0x7f00{i}0")
        report = analyze(write(tmp_path / "case", {f"nccl.{h}.{300 + i}": t for i, (h, t) in enumerate(lines.items())}))
        assert report.verdict.value == "collective_mismatch"
        assert [(p.host, p.pid) for p in report.culprit_processes] == [("node2", 302)]
        assert "opCount 0x1e" in report.summary


class TestDifferenceAtOneOpCount:
    def test_a_count_difference_at_opcount_0_is_a_mismatch_not_a_rank_behind(self, tmp_path: Path) -> None:
        """The job's first launch: ranks 0 and 1 all-reduce 1024 elements and go on;
        rank 2 all-reduced 2048 and waits."""
        text = ""
        for opcount, ranks in ((0, (0, 1, 2)), (1, (0, 1))):
            for r in ranks:
                count = 2048 if (r == 2 and opcount == 0) else 1024
                text += coll(
                    f"node{r}", 300 + r, 0, "AllReduce", opcount, count, F32, comm=f"0x7f00{r}0", prefix=f"[rank{r}]:"
                )
        report = analyze(write(tmp_path / "case", {"combined.log": text}))
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [2])
        assert "opCount 0x0" in report.summary and "count=2048" in report.summary

    def test_a_dtype_difference_between_two_ranks_names_no_one(self, tmp_path: Path) -> None:
        text = "".join(
            coll(
                f"node{r}",
                300 + r,
                0,
                "AllReduce",
                oc,
                1024,
                F32 if (r == 0 or oc == 0) else BF16,
                comm=f"0x7f00{r}0",
                nranks=2,
                prefix=f"[rank{r}]:",
            )
            for oc in (0, 1)
            for r in (0, 1)
        )
        report = analyze(write(tmp_path / "case", {"combined.log": text}))
        assert (report.verdict.value, report.culprit_ranks, report.culprit_processes) == ("collective_mismatch", [], [])
        assert "float32" in report.summary and "bfloat16" in report.summary


def fingerprint(seq: int, op: str, shape: str, dtype: str = "Float", device: str = "cuda:0") -> str:
    options = (
        f"TensorOptions(dtype=float (default), device={device}, layout=Strided (default), "
        "requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))"
    )
    return (
        f"CollectiveFingerPrint(SequenceNumber={seq}, OpType={op}, TensorShape=[{shape}], TensorDtypes={dtype}, "
        f"TensorDeviceTypes={options})"
    )


def detail(rank: int, mine: str, other_rank: int, theirs: str) -> str:
    return (
        f"[rank{rank}]: RuntimeError: Detected mismatch between collectives on ranks. "
        f"Rank {rank} is running collective: {mine}, but Rank {other_rank} is running collective: {theirs}.\n"
    )


GARBAGE = (
    "CollectiveFingerPrint(SequenceNumber=0OpType=SCATTER)"  # the other side decoded from a buffer of another size
)


class TestDetailMismatch:
    def test_quiet_without_a_detail_report(self) -> None:
        assert detail_mismatch(facts_of(timeout(0, "ALLREDUCE"))) is None

    def test_one_rank_comparing_itself_with_rank_0_names_both_as_suspects_and_no_culprit(self, tmp_path: Path) -> None:
        text = detail(1, fingerprint(37, "ALLREDUCE", "1024", device="cuda:1"), 0, fingerprint(37, "BROADCAST", "1024"))
        report = analyze(write(tmp_path / "case", {"rank1.err": text}))
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [])
        assert "Suspects: rank 0 or rank 1" in report.summary
        assert {row.rank: row.status for row in report.ranks} == {0: "suspect", 1: "suspect"}

    def test_one_report_naming_rank_2_says_ranks_0_and_1_agree_with_its_author(self, tmp_path: Path) -> None:
        """Rank 3 compared itself with ranks 0 and 1 first (equal) and stopped at rank 2, whose side is unreadable."""
        text = detail(3, fingerprint(37, "ALLREDUCE", "4096", device="cuda:3"), 2, GARBAGE)
        report = analyze(write(tmp_path / "case", {"rank3.err": text}))
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [2])
        assert "ranks 0, 1, 3: ALLREDUCE" in report.summary


def nccl_with_init(rank: int, ops: list[tuple[str, int]]) -> str:
    pid = 640 + rank
    head = (
        f"vm:{pid}:{pid} [{rank}] NCCL INFO ncclCommInitRankConfig comm 0x180ad8{rank}0 rank {rank} nranks 2 "
        f"cudaDev {rank} nvmlDev {rank} busId {60 + rank} commId 0x420c7c52a3fc1edd - Init COMPLETE\n"
    )
    return head + "".join(coll("vm", pid, rank, op, 0, count, comm=f"0x180ad8{rank}0", nranks=2) for op, count in ops)


class TestDetailTieAndTheJobsStep:
    """Two ranks, two sides: the NCCL files of the same run (2.28, opCount 0) hold the step the job repeats."""

    def case(self, tmp_path: Path, step: list[tuple[str, int]]) -> Report:
        history = step * 12  # 12 steps before the mismatch at SeqNum 37
        files = {f"nccl.vm.{640 + r}.log": nccl_with_init(r, history) for r in (0, 1)}
        files["rank0.err"] = detail(
            0, fingerprint(37, "BROADCAST", "1024"), 1, fingerprint(37, "ALLREDUCE", "262144", device="cuda:1")
        )
        files["rank1.err"] = detail(
            1, fingerprint(37, "ALLREDUCE", "262144", device="cuda:1"), 0, fingerprint(37, "BROADCAST", "1024")
        )
        return analyze(write(tmp_path / "case", files))

    def test_the_side_whose_operation_the_step_never_issues_departs(self, tmp_path: Path) -> None:
        report = self.case(tmp_path, STEP)
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [0])
        assert "repeating step" in report.reason and "BROADCAST" in report.summary

    def test_a_step_that_issues_both_decides_nothing(self, tmp_path: Path) -> None:
        report = self.case(tmp_path, [*STEP, ("Broadcast", 1024)])
        assert (report.verdict.value, report.culprit_ranks) == ("collective_mismatch", [])
        assert "Suspects" in report.summary


def timeout_line(rank: int, seq: int, op: str, numel: int, ts: str) -> str:
    return (
        f"[rank{rank}]:[E1124 10:12:{ts} ProcessGroupNCCL.cpp:632] [Rank {rank}] "
        "Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000) "
        "ran for 600082 milliseconds before timing out.\n"
    )


def failure_line(rank: int, pg: int, name: str, seq: int, completed: int, ts: str) -> str:
    return (
        f"[rank{rank}]:[E1124 10:12:{ts} ProcessGroupNCCL.cpp:2271] [PG ID {pg} PG GUID {pg}({name}) Rank {rank}] "
        f"failure detected by watchdog at work sequence id: {seq} PG status: last enqueued work: {seq}, "
        f"last completed work: {completed}\n"
    )


class TestSeqNumContradictions:
    def test_a_rank_waiting_in_what_its_peer_completed_gives_the_divergence_with_both_seqnums(
        self, tmp_path: Path
    ) -> None:
        """Rank 1's excerpt holds its timeout line only (no group id from torch 2.4 on)."""
        files = {
            "rank0.log": timeout_line(0, 1001, "ALLREDUCE", 524288, "01.123456789")
            + failure_line(0, 0, "default_pg", 1001, 1000, "01.124456789"),
            "rank1.log": timeout_line(1, 1000, "BROADCAST", 16, "00.923456789"),
        }
        report = analyze(write(tmp_path / "case", files))
        assert (report.verdict.value, report.culprit_ranks) == ("rank_behind", [1])
        assert (
            "rank 1 still waits in SeqNum 1000 (BROADCAST), which rank 0 completed before entering SeqNum 1001"
            in report.summary
        )

    def test_with_two_groups_named_a_line_without_a_group_is_never_compared(self, tmp_path: Path) -> None:
        files = {
            "rank0.log": timeout_line(0, 1001, "ALLREDUCE", 524288, "01.123456789")
            + failure_line(0, 0, "default_pg", 1001, 1000, "01.124456789")
            + timeout_line(0, 212, "ALLGATHER", 8192, "01.223456789")
            + failure_line(0, 1, "tp_group", 212, 211, "01.224456789"),
            "rank1.log": timeout_line(1, 1000, "BROADCAST", 16, "00.923456789"),
        }
        report = analyze(write(tmp_path / "case", files))
        assert (report.verdict.value, report.culprit_ranks, report.culprit_processes) == ("inconclusive", [], [])

    def test_a_line_without_a_group_whose_seqnum_the_group_never_reached_that_way_is_not_compared(
        self, tmp_path: Path
    ) -> None:
        """Rank 1 waits in SeqNum 212 (a tensor-parallel group's numbers)
        while rank 0's only named group completed 1000."""
        files = {
            "rank0.log": timeout_line(0, 1001, "ALLREDUCE", 524288, "01.123456789")
            + failure_line(0, 0, "default_pg", 1001, 1000, "01.124456789"),
            "rank1.log": timeout_line(1, 212, "ALLGATHER", 8192, "00.923456789"),
        }
        report = analyze(write(tmp_path / "case", files))
        assert (report.verdict.value, report.culprit_ranks) == ("inconclusive", [])


# --------------------------------------------------------------------------
# the other rules, each on the events its parser gives
# --------------------------------------------------------------------------


def facts_of(*events: Event, logs: dict[str, str] | None = None) -> Facts:
    return Facts.collect(snapshot_with(*events, logs=logs))


def timeout(rank: int, op: str) -> WatchdogTimeout:
    """PyTorch's watchdog line: ``rank`` timed out in SeqNum 5, an ``op`` of 1024 elements."""
    return WatchdogTimeout(rank=rank, seq=5, op=op, numel_in=1024, ran_ms=600082, cite=Citation(file=f"rank{rank}.log"))


TRUNCATED = (
    "vm:543:567 [0] transport/net_socket.cc:567 NCCL WARN NET/Socket : peer 192.0.2.2<36764> message truncated : "
    "receiving 131072 bytes instead of 65536. If you believe your socket network is in a healthy state, there may be "
    "a mismatch in collective sizes or environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between ranks\n"
)
COMM = "0x5581e4a3c9e0"
# A real run of the same fault with its NCCL logs and Flight Recorder: the sequences decide, the line is cited.
BUNDLE = next((FIXTURES / "bundles" / "nccl-2.28.9-h100x1").glob("*.tar.gz"))


class TestTransportMismatch:
    """NCCL's own mismatch warnings in the verdict (issue 31): the transport's ``message truncated`` / ``collective
    mismatch error`` lines name the ranks and sizes, and the verdict cites them.

    Measured (BENCHMARKS.md, FSDP2 on two ranks over NET/Socket, rank 1 skips an all_reduce): NCCL's socket transport
    fails the communicator with "message truncated: receiving 131072 bytes instead of 65536", after which no rank can
    dump Flight Recorder, and each node's NCCL log shows only its own rank.  These are those inputs."""

    @staticmethod
    def one_node(warn: str) -> dict[str, str]:
        """Rank 0's NCCL debug file from its own node: its Init lines, a few steps, then the transport's WARN."""
        return {"vm.543": L.init(0, 2, COMM, host="vm", pid=543) + L.steps(0, COMM, 3, host="vm", pid=543) + warn}

    def written_node(self, tmp_path: Path, warn: str = TRUNCATED) -> Path:
        return write(tmp_path, self.one_node(warn))

    def test_one_nodes_log_names_both_ranks_and_the_sizes_and_cites_the_line(self, tmp_path):
        report = analyze_paths([str(self.written_node(tmp_path))], now=NOW)
        assert (report.verdict, report.culprit_ranks, report.suspect_ranks) == (Verdict.collective_mismatch, [], [0, 1])
        assert (
            "rank 0 received 131072 bytes from peer 192.0.2.2<36764> (rank 1) where it had posted 65536"
            in report.summary
        )
        [cited] = [e for e in report.evidence if e.fact.startswith("rank 0 received")]
        assert cited.cite.endswith("vm.543:16") and "message truncated" in cited.text

    def test_the_sender_side_of_infiniband(self, tmp_path):
        warn = (
            "vm:543:570 [0] NCCL WARN NET/IB : req 0/1 tag 7 peer 10.0.0.2<45678> collective mismatch error, "
            "local size 2097152 remote size 1048576\n"
        )
        report = analyze_paths([str(self.written_node(tmp_path, warn))], now=NOW)
        assert report.suspect_ranks == [0, 1] and "InfiniBand" in report.summary
        assert "rank 0 sends 2097152 bytes to peer 10.0.0.2<45678> (rank 1), which posted a receive of 1048576" in (
            report.summary
        )

    def test_quiet_in_the_report_without_the_warning(self, tmp_path):
        report = analyze_paths([str(self.written_node(tmp_path, warn=""))], now=NOW)
        assert report.verdict != Verdict.collective_mismatch and report.suspect_ranks == []

    def test_stderr_alone(self, tmp_path):
        (tmp_path / "rank0.log").write_text(
            "[rank0]:Last error:\n"
            "[rank0]:NET/Socket : peer 192.0.2.2<36764> message truncated : receiving 131072 bytes instead of 65536. "
            "If you believe your socket network is in a healthy state, there may be a mismatch in collective sizes\n"
        )
        report = analyze_paths([str(tmp_path)], now=NOW)
        assert (report.verdict, report.culprit_ranks, report.suspect_ranks) == (Verdict.collective_mismatch, [], [0])
        assert "rank 0 received 131072 bytes from peer 192.0.2.2<36764> where it had posted 65536" in report.summary

    def test_where_the_sequences_decide_the_line_is_cited_with_ranks_and_sizes(self):
        report = analyze_paths([str(BUNDLE)], now=NOW)
        assert report.culprit_ranks == [1]
        assert any(
            e.fact
            == "NCCL's transport: rank 0 received 131072 bytes from peer 192.0.2.2<36764> (rank 1) where it had "
            "posted 65536"
            and e.cite.endswith("nccl/vm.543:1472")
            for e in report.evidence
        )

    def test_nccls_truncated_message_is_a_mismatch_with_both_ranks_suspect(self) -> None:
        found = transport_mismatch(facts_of(logs=self.one_node(TRUNCATED)))
        assert found is not None and (found.verdict, found.suspects) == (Verdict.collective_mismatch, (0, 1))

    def test_quiet_without_the_warning(self) -> None:
        assert transport_mismatch(facts_of(logs=self.one_node(""))) is None


class TestDeadPeer:
    def test_a_rank_torchrun_saw_die_on_its_own(self) -> None:
        failure = WorkerFailure(rank=1, exitcode=3, pid=1001, root_cause=True, cite=Citation(file="console.log"))
        found = dead_peer(facts_of(failure))
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (1,))

    def test_quiet_on_torchruns_teardown(self) -> None:
        failure = WorkerFailure(rank=1, exitcode=-15, pid=1001, root_cause=False, cite=Citation(file="console.log"))
        assert dead_peer(facts_of(failure)) is None


def analyze_logs(tmp_path: Path, logs: dict[int, str]) -> Report:
    """Each rank's log, ``rank<r>.log``, analyzed together."""
    return analyze(write(tmp_path, {f"rank{rank}.log": text for rank, text in logs.items()}))


T = "E1126 10:00:00.000000000"


def plain(rank: int, seq: int, op: str, numel: int, tmo: int = 600000) -> str:
    """PyTorch's watchdog line without a process-group prefix (``WorkNCCL::checkTimeout``)."""
    return (
        f"[rank{rank}]:[{T} ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={tmo}) ran for "
        f"{tmo + 31} milliseconds before timing out.\n"
    )


def prefixed(rank: int, seq: int, op: str, numel: int, pg: str, desc: str, tmo: int = 600000) -> str:
    """The same line through ``logPrefix()``: ``[PG ID i PG GUID g(name) Rank r]``."""
    return (
        f"[rank{rank}]:[{T} ProcessGroupNCCL.cpp:684] [PG ID {pg} PG GUID {pg}({desc}) Rank {rank}] Watchdog caught "
        f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, "
        f"Timeout(ms)={tmo}) ran for {tmo + 94} milliseconds before timing out.\n"
    )


class TestProcessGroups:
    """PyTorch's watchdog timeouts from two ranks where one line carries a process-group id and the other does not
    (issue 31): compared on one group, not set aside, and the rank with the lower SeqNum is behind.  The corpus case
    g26 is the default group; here a named group joins only a line that times out in the same kind of call, and
    never where two groups are named."""

    def test_the_prefixed_line_keeps_its_groups_name(self):
        [timeout] = parse_torch_log(prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg").encode(), "rank1.log")
        assert (timeout.rank, timeout.seq, timeout.pg, timeout.pg_desc) == (1, 12, "0", "default_pg")

    def test_default_group_and_no_id_two_apart_names_the_lower(self, tmp_path):
        report = analyze_logs(
            tmp_path, {0: plain(0, 10, "ALLREDUCE", 1024), 1: prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg")}
        )
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
        assert (
            "process group 0 (default_pg)" in report.summary and "rank 0 waits in SeqNum 10, 2 before" in report.summary
        )

    def test_a_named_group_joins_a_line_of_the_same_call(self, tmp_path):
        report = analyze_logs(
            tmp_path, {0: plain(0, 10, "ALLGATHER", 512), 1: prefixed(1, 12, "ALLGATHER", 512, "3", "tp")}
        )
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [0])
        assert "process group 3 (tp)" in report.summary

    def test_a_named_group_does_not_join_another_kind_of_call(self, tmp_path):
        report = analyze_logs(
            tmp_path, {0: plain(0, 10, "ALLREDUCE", 1), 1: prefixed(1, 12, "ALLGATHER", 512, "3", "tp")}
        )
        assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])

    def test_two_named_groups_leave_the_unnamed_line_alone(self, tmp_path):
        logs = {
            0: plain(0, 10, "ALLREDUCE", 1024),
            1: prefixed(1, 12, "ALLREDUCE", 1024, "0", "default_pg") + prefixed(1, 7, "ALLGATHER", 512, "3", "tp"),
        }
        report = analyze_logs(tmp_path, logs)
        assert (report.verdict, report.culprit_ranks) == (Verdict.inconclusive, [])

    def test_ranks_timing_out_in_one_seqnum_with_different_operations_mismatch(self) -> None:
        found = process_groups(facts_of(timeout(0, "ALLREDUCE"), timeout(1, "BROADCAST")))
        assert found is not None and found.verdict == Verdict.collective_mismatch

    def test_quiet_without_pytorchs_lines(self) -> None:
        assert (
            process_groups(facts_of(WorkerFailure(rank=1, exitcode=3, root_cause=True, cite=Citation(file="c"))))
            is None
        )


class TestNetworkFinding:
    @staticmethod
    def error(kind: str) -> NetworkError:
        return NetworkError(
            kind=kind,  # type: ignore[arg-type]
            rank=0,
            peer="10.0.0.2<45678>",
            device="mlx5_0",
            status=12,
            status_name="IBV_WC_RETRY_EXC_ERR",
            cite=Citation(file="node1.1000", line=40),
        )

    def test_an_infiniband_completion_error_is_a_network_error(self) -> None:
        found = network_finding(facts_of(self.error("ib_completion")))
        assert found is not None and found.verdict == Verdict.network_error

    def test_quiet_on_a_closed_connection_alone(self) -> None:
        assert network_finding(facts_of(self.error("connection_closed"))) is None
