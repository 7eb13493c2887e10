"""The failure stage's rules (``hang.failure.FAILURE_RULES``), each found by its name: one fires, one stays quiet.

Snapshots are the engine's own, built from real captures (tests/fixtures/failures/README.md) through the parser."""

from __future__ import annotations

from conftest import FIXTURES

from ncclwatch.watchdog.events import JobEnded, JobOutcome
from ncclwatch.watchdog.hang.failure import FAILURE_RULES, failure_finding, job_failed
from ncclwatch.watchdog.hang.snapshot import take_snapshot
from ncclwatch.watchdog.hang.state import JobState
from ncclwatch.watchdog.hang.types import Finding
from ncclwatch.watchdog.hang.verdicts import Verdict
from ncclwatch.watchdog.parsing.failure_lines import parse_failure_lines

RULES = {rule.name: rule.fn for rule in FAILURE_RULES}
UNDECIDED = Finding(verdict=Verdict.inconclusive, summary="no sequences")


def snapshot_of(name: str, ended: JobEnded | None = None):  # type: ignore[no-untyped-def]
    state = JobState()
    for event in parse_failure_lines((FIXTURES / "failures" / name).read_bytes(), name):
        state.apply(event)
    if ended is not None:
        state.apply(ended)
    return take_snapshot(state, observed_at=0.0)


def test_the_rules_run_in_the_documented_order() -> None:
    assert list(RULES) == ["sequences_mismatch", "died_of_its_own", "transport_mismatch", "timed_out", "root_cause"]


class TestWhenItRuns:
    def test_torchruns_summary_says_the_job_failed(self) -> None:
        assert job_failed(snapshot_of("gloo-2.13-raise.txt"))

    def test_a_job_the_user_stopped_is_not_judged_as_failed(self) -> None:
        stopped = JobEnded(outcome=JobOutcome.stopped, returncode=-2, at=1.0)
        snapshot = snapshot_of("gloo-2.13-sigkill.txt", ended=stopped)
        assert not job_failed(snapshot) and failure_finding(snapshot, UNDECIDED) is None

    def test_a_clean_job_is_not_judged(self) -> None:
        assert failure_finding(snapshot_of("gloo-2.13-clean.txt"), UNDECIDED) is None


class TestSequencesMismatch:
    def test_keeps_the_sequences_culprit(self) -> None:
        mismatch = Finding(verdict=Verdict.collective_mismatch, summary="rank 1 skipped.", culprits=(1,))
        found = RULES["sequences_mismatch"](snapshot_of("gloo-2.13-extra.txt"), mismatch)
        assert found is not None and found.culprits == (1,) and "The job then died: rank 0 aborted" in found.summary

    def test_quiet_without_a_mismatch(self) -> None:
        assert RULES["sequences_mismatch"](snapshot_of("gloo-2.13-extra.txt"), UNDECIDED) is None


class TestDiedOfItsOwn:
    def test_a_sigkilled_rank(self) -> None:
        found = RULES["died_of_its_own"](snapshot_of("gloo-2.13-sigkill.txt"), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits, found.kind) == (
            Verdict.process_dead,
            (1,),
            "signal",
        )

    def test_quiet_where_every_failed_rank_waited_for_another(self) -> None:
        # the timeout: rank 0 timed out (exit 1, waited), rank 1 was ended by torchrun's SIGTERM
        assert RULES["died_of_its_own"](snapshot_of("gloo-2.13-timeout.txt"), UNDECIDED) is None

    def test_a_ranks_own_exit_is_no_incident(self) -> None:
        # sys.exit(3) on rank 1: no exception, no signal; its peers' "connection closed" only say they lost it
        found = RULES["died_of_its_own"](snapshot_of("gloo-2.13-exit.txt"), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits, found.kind) == (Verdict.no_hang, (), "exit")
        assert "chose to stop" in found.summary

    def test_gloos_abort_is_the_transports_not_the_ranks_own(self) -> None:
        assert RULES["died_of_its_own"](snapshot_of("gloo-2.13-extra.txt"), UNDECIDED) is None


class TestTransportMismatch:
    def test_names_the_aborted_rank_a_suspect(self) -> None:
        found = RULES["transport_mismatch"](snapshot_of("demo-extra-gloo-2.13-run/console.txt"), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits, found.suspects) == (
            Verdict.collective_mismatch,
            (),
            (2,),
        )

    def test_names_the_reporter_the_sequences_set_apart_from_two_that_agree(self) -> None:
        # demo --fault extra, 3 ranks: rank 2 aborted in C++ (no dump of its extra call); ranks 0 and 1 agree
        apart = Finding(verdict=Verdict.stuck_in_collective, summary="rank 2 leads.", culprits=(2,))
        found = RULES["transport_mismatch"](snapshot_of("demo-extra-gloo-2.13-run/console.txt"), apart)
        assert found is not None and (found.verdict, found.culprits, found.suspects) == (
            Verdict.collective_mismatch,
            (2,),
            (),
        )

    def test_a_reporter_the_sequences_do_not_set_apart_stays_a_suspect(self) -> None:
        other = Finding(verdict=Verdict.stuck_in_collective, summary="rank 1 leads.", culprits=(1,))
        found = RULES["transport_mismatch"](snapshot_of("demo-extra-gloo-2.13-run/console.txt"), other)
        assert found is not None and (found.culprits, found.suspects) == ((), (2,))

    def test_quiet_without_a_size_check(self) -> None:
        assert RULES["transport_mismatch"](snapshot_of("gloo-2.13-raise.txt"), UNDECIDED) is None


class TestTimedOut:
    def test_names_the_rank_that_did_not_time_out(self) -> None:
        found = RULES["timed_out"](snapshot_of("gloo-2.13-timeout.txt"), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.collective_timeout, (1,))

    def test_quiet_without_a_timeout(self) -> None:
        assert RULES["timed_out"](snapshot_of("gloo-2.13-sigkill.txt"), UNDECIDED) is None


class TestRootCause:
    def test_torchruns_first_observed_failure(self) -> None:
        found = RULES["root_cause"](snapshot_of("gloo-2.13-timeout.txt"), UNDECIDED)
        assert found is not None and (found.verdict, found.culprits) == (Verdict.process_dead, (0,))

    def test_quiet_without_a_summary(self) -> None:
        assert RULES["root_cause"](snapshot_of("gloo-2.13-clean.txt"), UNDECIDED) is None

    def test_quiet_where_the_root_cause_only_lost_its_peer(self) -> None:
        # node 1 of two wrappers after node 0 was killed whole: its rank's one error is "connection closed by peer"
        assert RULES["root_cause"](snapshot_of("gloo-2.13-peer-node-killed.txt"), UNDECIDED) is None
