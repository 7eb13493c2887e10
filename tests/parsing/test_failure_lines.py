"""``parsing.failure_lines`` on the stderr of real jobs that died (tests/fixtures/failures/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.events import FailureKind, JobEnded, JobOutcome, RankExited, RankFailure
from ncclwatch.watchdog.parsing.failure_lines import FailureLines, parse_failure_lines

FAILURES = FIXTURES / "failures"
SHARED = Path("/work/shared/fixtures/nccl-2.28.9-2gpu")


def read(name: str, file_rank: int | None = None) -> list:
    return parse_failure_lines((FAILURES / name).read_bytes(), name, file_rank)


def failures(events: list) -> dict[int | None, list[RankFailure]]:
    by_rank: dict[int | None, list[RankFailure]] = {}
    for event in events:
        if isinstance(event, RankFailure):
            by_rank.setdefault(event.rank, []).append(event)
    return by_rank


class TestTracebacks:
    def test_a_value_error_in_the_users_code_is_the_users_own_with_its_frame(self) -> None:
        raised = failures(read("gloo-2.13-raise.txt"))
        (own,) = raised[1]
        assert (own.kind, own.error_type, own.own_code) == (FailureKind.exception, "ValueError", True)
        assert own.detail == "ValueError: batch 5 has 2 values, expected 4"
        assert own.frame == "check_batch (failing_job.py:39)"
        assert own.cite.line == 10 and own.cite.text == "[rank1]: ValueError: batch 5 has 2 values, expected 4"

    def test_the_peer_that_lost_its_connection_waited_in_torch_not_its_own_code(self) -> None:
        (waited,) = failures(read("gloo-2.13-raise.txt"))[0]
        assert (waited.kind, waited.own_code) == (FailureKind.peer_gone, False)
        assert waited.frame == "main (failing_job.py:65)"  # the user's last frame, not torch's work.wait()

    def test_torchruns_own_traceback_is_no_ranks_failure(self) -> None:
        assert None not in failures(read("gloo-2.13-raise.txt"))

    def test_gloos_timeout_is_a_collective_timeout(self) -> None:
        (timed_out,) = failures(read("gloo-2.13-timeout.txt"))[0]
        assert timed_out.kind == FailureKind.collective_timeout
        assert "Timed out waiting 3000ms for recv operation" in timed_out.detail


class TestSingleLines:
    def test_gloos_size_enforce_has_no_rank_prefix(self) -> None:
        by_rank = failures(read("demo-extra-gloo-2.13-run/console.txt"))
        (mismatch,) = by_rank[None]
        assert mismatch.kind == FailureKind.size_mismatch
        assert mismatch.detail.startswith("[enforce fail at") and "Received data size doesn't match" in mismatch.detail
        assert {f.kind for r in (0, 1) for f in by_rank[r]} == {FailureKind.peer_gone}

    def test_pytorchs_nccl_watchdog_names_its_rank_sequence_and_operation(self) -> None:
        events = parse_failure_lines(
            (SHARED / "mismatch_fr/torchrun/rank1.stderr.log").read_bytes(), "rank1.stderr.log"
        )
        timeouts = [e for e in events if isinstance(e, RankFailure) and e.kind == FailureKind.collective_timeout]
        assert timeouts and {(e.rank, e.seq, e.op) for e in timeouts} == {(1, 83, "ALLREDUCE")}

    def test_a_per_rank_file_gives_its_rank_to_unprefixed_lines(self) -> None:
        # "terminate called ... what(): [PG ID 0 ...] ... Watchdog caught ..." carries no [rank0]: prefix
        data = (SHARED / "mismatch_fr/torchrun/rank0.stderr.log").read_bytes()
        ranks = {
            e.rank for e in parse_failure_lines(data, "rank0.stderr.log", file_rank=0) if isinstance(e, RankFailure)
        }
        assert ranks == {0}


class TestTorchrunSummary:
    @pytest.mark.parametrize(
        ("name", "root", "code", "signal"),
        [
            ("gloo-2.13-raise.txt", 1, 1, None),
            ("gloo-2.13-sigkill.txt", 1, -9, "SIGKILL"),
            ("gloo-2.13-exit.txt", 1, 3, None),
            ("gloo-2.13-timeout.txt", 0, 1, None),
            ("gloo-2.13-extra.txt", 1, -6, "SIGABRT"),
        ],
    )
    def test_each_failure_row_and_the_root_cause(self, name: str, root: int, code: int, signal: str | None) -> None:
        events = read(name)
        exits = {e.rank: e for e in events if isinstance(e, RankExited)}
        assert set(exits) == {0, 1}
        assert (exits[root].root_cause, exits[root].exitcode, exits[root].signal) == (True, code, signal)
        other = exits[1 - root]
        assert (other.root_cause, other.exitcode, other.signal) == (False, -15, "SIGTERM")
        assert exits[root].host == "localhost" and exits[root].pid and exits[root].at
        (ended,) = [e for e in events if isinstance(e, JobEnded)]
        assert (ended.outcome, ended.returncode, ended.at) == (JobOutcome.failed, 1, exits[root].at)

    def test_a_job_whose_first_failure_was_a_sigterm_from_outside_was_stopped(self, tmp_path: Path) -> None:
        # the raise capture's summary with its root cause SIGTERMed, as when ncclwatch or a user ends the ranks
        text = (FAILURES / "gloo-2.13-raise.txt").read_text()
        head, root = text.split("Root Cause (first observed failure):")
        root = root.replace("exitcode  : 1 (pid: 8115) ", "exitcode  : -15 (pid: 8115)  (SIGTERM)")
        events = parse_failure_lines((head + "Root Cause (first observed failure):" + root).encode(), "stopped.txt")
        (ended,) = [e for e in events if isinstance(e, JobEnded)]
        assert ended.outcome == JobOutcome.stopped

    def test_torchrun_stopped_by_a_signal_is_no_ranks_failure(self) -> None:
        # torchrun SIGTERMed by hand: its own SignalException traceback, and no summary
        events = parse_failure_lines((FIXTURES / "torchrun-sigterm-2.13.txt").read_bytes(), "torchrun-sigterm.txt")
        assert [e for e in events if isinstance(e, (RankFailure, JobEnded))] == []

    def test_a_clean_job_says_nothing(self) -> None:
        assert read("gloo-2.13-clean.txt") == []


def test_chunks_cut_anywhere_give_what_the_whole_text_gives() -> None:
    data = (FAILURES / "demo-extra-gloo-2.13-run" / "console.txt").read_bytes()
    whole = parse_failure_lines(data, "console.txt")
    for size in (1, 7, 100, 4096):
        reader = FailureLines("console.txt")
        pieces = [reader.feed(data[i : i + size]) for i in range(0, len(data), size)]
        assert [e for piece in pieces for e in piece] + reader.feed(b"", final=True) == whole


def test_a_long_healthy_stderr_costs_little() -> None:
    import time

    line = b"[rank3]: step 1234 loss 0.4321 lr 0.0003 tokens/s 123456\n"
    data = line * 200_000  # 11 MB of training output, with no marker in it
    reader = FailureLines("big.log")
    start = time.perf_counter()
    for i in range(0, len(data), 1 << 20):
        assert reader.feed(data[i : i + (1 << 20)]) == []
    assert time.perf_counter() - start < 0.5
    assert reader.lines_seen == 200_000
