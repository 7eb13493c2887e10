"""The response policy: restart where it can help, never loop, drain for hardware, nothing unasked for."""

from __future__ import annotations

import pytest

from ncclwatch.launcher.command import max_restarts_of
from ncclwatch.launcher.respond import policy_of
from ncclwatch.watchdog.config import ConfigError, load_settings
from ncclwatch.watchdog.hang.report import RankRow, Report
from ncclwatch.watchdog.hang.verdicts import CATALOGUE, DRAIN_ON_DEFAULT, RESTART_ON_DEFAULT, Verdict
from ncclwatch.watchdog.response.policy import Policy, Response, plan, signature_of

TRAIN_LINE = "all_reduce (torch/distributed/distributed_c10d.py:2950) <- main (train.py:113)"


def report(
    verdict: Verdict,
    culprits: tuple[int, ...] = (1,),
    step: int = 26,
    call_site: str | None = TRAIN_LINE,
    operation: str | None = "AllReduce count=1 Float",
) -> Report:
    rows = [
        RankRow(
            rank=r,
            host=f"node{r}",
            pid=100 + r,
            step=step + (0 if r in culprits else 1),
            stack="forward (model.py:40) <- main (train.py:97)",
            call_site=call_site if r in culprits else None,
        )
        for r in range(4)
    ]
    return Report(
        verdict=verdict, culprit_ranks=list(culprits), operation=operation, summary="s", ranks=rows, analyzed_at="x"
    )


def policy(
    on_hang: str = "restart",
    max_restarts: int = 3,
    drain: str = "none",
    restart_on=RESTART_ON_DEFAULT,
    drain_on=DRAIN_ON_DEFAULT,
) -> Policy:  # type: ignore[no-untyped-def]
    return Policy(on_hang, max_restarts, frozenset(restart_on), drain, frozenset(drain_on))


class TestRestart:
    @pytest.mark.parametrize("verdict", RESTART_ON_DEFAULT)
    def test_a_transient_verdict_restarts_numbered_against_torchruns_budget(self, verdict: Verdict) -> None:
        chosen = plan(report(verdict), policy(), restarts_done=1, restarted=[])
        assert chosen.response is Response.restart and chosen.why == CATALOGUE[verdict].restart_why
        assert chosen.headline() == "restarting (2 of 3)"

    def test_a_rank_behind_blocked_in_the_kernel_restarts_by_default_and_the_loop_guard_ends_a_recurrence(
        self,
    ) -> None:
        """A rank asleep in a read or a lock (a network filesystem, a data loader) is often transient: restarted
        where the settings keep their default (``rank_behind_blocked``); one running its own code is not."""
        settings = load_settings({"on_hang": "restart"}, None, {})
        defaults = policy_of(settings, max_restarts=3)
        blocked = report(Verdict.rank_behind)
        blocked.ranks[1].state = "S"
        chosen = plan(blocked, defaults, restarts_done=0, restarted=[])
        assert chosen.response is Response.restart and chosen.why.startswith("rank 1 blocked, not running: ")
        again = plan(blocked, defaults, restarts_done=1, restarted=[chosen.signature])
        assert again.response is Response.kill and again.why.startswith("recurs after restart")
        running = report(Verdict.rank_behind)
        running.ranks[1].state = "R"
        assert plan(running, defaults, restarts_done=0, restarted=[]).response is Response.kill
        unknown = report(Verdict.rank_behind)  # offline, or no /proc sample: not known to be blocked
        assert plan(unknown, defaults, restarts_done=0, restarted=[]).response is Response.kill
        chosen_by_user = load_settings({"on_hang": "restart", "restart_on": "process_dead"}, None, {})
        assert plan(blocked, policy_of(chosen_by_user, 3), 0, []).response is Response.kill

    @pytest.mark.parametrize("verdict", [v for v, entry in CATALOGUE.items() if entry.hang and not entry.restart])
    def test_a_hang_of_the_programs_own_making_ends_the_job_and_says_why(self, verdict: Verdict) -> None:
        chosen = plan(report(verdict), policy(), restarts_done=0, restarted=[])
        assert chosen.response is Response.kill
        assert chosen.why == f"a restart cannot help: {CATALOGUE[verdict].restart_why}"

    def test_the_words_of_the_page_stay(self) -> None:
        """Pages and hooks quote them (tests/e2e/test_e2e_restart.py too)."""
        mismatch = plan(report(Verdict.collective_mismatch), policy(), restarts_done=0, restarted=[])
        why = "a restart cannot help: a collective mismatch comes from the program (a branch on the rank) and recurs"
        assert mismatch.why == why
        assert plan(report(Verdict.process_dead), policy(), 0, []).why == "the restart replaces the dead process"

    def test_a_verdict_the_user_changed_says_so_not_the_default_reason(self) -> None:
        dead = plan(report(Verdict.process_dead), policy(restart_on=[]), restarts_done=0, restarted=[])
        assert dead.why == "a restart cannot help: process_dead is not in --restart-on"
        mismatch = plan(report(Verdict.collective_mismatch), policy(restart_on=[Verdict.collective_mismatch]), 0, [])
        assert mismatch.why == "--restart-on includes collective_mismatch"

    def test_the_user_may_restart_a_mismatch_and_the_loop_guard_stops_the_second(self) -> None:
        mine = policy(restart_on=[Verdict.collective_mismatch])
        first = plan(report(Verdict.collective_mismatch), mine, restarts_done=0, restarted=[])
        assert first.response is Response.restart and first.signature is not None
        again = plan(report(Verdict.collective_mismatch), mine, restarts_done=1, restarted=[first.signature])
        assert again.response is Response.kill
        assert again.why.startswith(
            "recurs after restart: not transient (collective_mismatch, AllReduce, at main (train.py:113), step 26"
        )

    def test_steps_one_apart_are_the_same_step(self) -> None:
        mine = policy(restart_on=[Verdict.collective_mismatch])
        first = plan(report(Verdict.collective_mismatch, step=37), mine, 0, [])
        assert plan(report(Verdict.collective_mismatch, step=36), mine, 1, [first.signature]).response is Response.kill
        assert (
            plan(report(Verdict.collective_mismatch, step=35), mine, 1, [first.signature]).response is Response.restart
        )

    @pytest.mark.parametrize(
        "changed", [{"step": 31}, {"call_site": "main (train.py:90)"}, {"operation": "AllGather count=4 Float"}]
    )
    def test_a_hang_that_differs_in_any_part_of_its_signature_restarts_again(self, changed: dict) -> None:  # type: ignore[type-arg]
        first = plan(report(Verdict.process_stopped), policy(), restarts_done=0, restarted=[])
        other = plan(report(Verdict.process_stopped, **changed), policy(), restarts_done=1, restarted=[first.signature])
        assert other.response is Response.restart and other.restart_number == 2

    def test_a_line_known_in_one_round_only_is_no_difference(self) -> None:
        first = plan(
            report(Verdict.collective_mismatch, call_site=None), policy(restart_on=[Verdict.collective_mismatch]), 0, []
        )
        again = plan(
            report(Verdict.collective_mismatch), policy(restart_on=[Verdict.collective_mismatch]), 1, [first.signature]
        )
        assert first.signature.frame is None and again.response is Response.kill

    def test_the_same_hang_on_another_rank_is_the_same_hang(self) -> None:
        first = plan(report(Verdict.process_stopped), policy(), restarts_done=0, restarted=[])
        other = plan(
            report(Verdict.process_stopped, culprits=(2,)), policy(), restarts_done=1, restarted=[first.signature]
        )
        assert other.response is Response.kill

    def test_restarts_used_up_end_the_job(self) -> None:
        chosen = plan(report(Verdict.process_dead), policy(max_restarts=2), restarts_done=2, restarted=[])
        assert chosen.response is Response.kill and chosen.why == "restarts used up (2 of 2)"

    def test_without_max_restarts_restart_behaves_as_kill(self) -> None:
        chosen = plan(report(Verdict.process_dead), policy(max_restarts=0), restarts_done=0, restarted=[])
        assert chosen.response is Response.kill and "no --max-restarts" in chosen.why


class TestNothingUnasked:
    @pytest.mark.parametrize("verdict", [Verdict.process_dead, Verdict.network_error, Verdict.collective_mismatch])
    def test_report_leaves_the_job_running_whatever_the_verdict_even_with_drain(self, verdict: Verdict) -> None:
        chosen = plan(report(verdict), policy(on_hang="report", drain="slurm"), restarts_done=0, restarted=[])
        assert chosen.response is Response.report and not chosen.ends_job

    def test_kill_ends_the_job_also_where_a_restart_would_help(self) -> None:
        assert plan(report(Verdict.process_stopped), policy(on_hang="kill"), 0, []).response is Response.kill

    def test_the_default_settings_neither_restart_nor_drain(self) -> None:
        settings = load_settings({}, environ={})
        assert settings.on_hang == "report" and settings.drain == "none"


class TestDrain:
    @pytest.mark.parametrize("verdict", DRAIN_ON_DEFAULT)
    def test_a_verdict_that_blames_hardware_drains_the_culprits_host(self, verdict: Verdict) -> None:
        chosen = plan(report(verdict, culprits=(2, 3)), policy(drain="slurm"), restarts_done=0, restarted=[])
        assert chosen.response is Response.drain and chosen.drain_hosts == ("node2", "node3") and chosen.ends_job

    def test_a_gpu_hang_restarts_unless_the_site_says_it_blames_the_node(self) -> None:
        hang = report(Verdict.gpu_compute_hang)
        assert plan(hang, policy(drain="slurm"), 0, []).response is Response.restart
        site = policy(drain="slurm", drain_on=[*DRAIN_ON_DEFAULT, Verdict.gpu_compute_hang])
        assert plan(hang, site, 0, []).response is Response.drain

    def test_a_mismatch_never_drains_and_no_named_host_never_drains(self) -> None:
        assert plan(report(Verdict.collective_mismatch), policy(drain="slurm"), 0, []).response is Response.kill
        nameless = report(Verdict.network_error, culprits=())
        # network_error is in no live default (the live watchdog never gives it): a site that lists it
        both = policy(drain="slurm", restart_on=[Verdict.network_error], drain_on=[Verdict.network_error])
        assert plan(nameless, both, 0, []).response is Response.restart


class TestSignature:
    def test_the_culprits_own_frame_and_step_not_the_innermost_one(self) -> None:
        signature = signature_of(report(Verdict.process_stopped))
        assert (signature.frame, signature.step, signature.operation) == ("main (train.py:113)", 26, "AllReduce")

    def test_where_py_spy_finds_the_rank_is_never_the_line(self) -> None:
        without = report(Verdict.collective_mismatch, call_site=None)
        assert without.ranks[1].stack and signature_of(without).frame is None
        moved_on = report(Verdict.collective_mismatch)
        moved_on.ranks[1].stack = "backward (model.py:77) <- main (train.py:99)"
        assert signature_of(moved_on) == signature_of(report(Verdict.collective_mismatch))

    def test_without_a_culprit_the_lowest_step_of_any_rank(self) -> None:
        assert signature_of(report(Verdict.stuck_in_collective, culprits=())).step == 27


class TestSettings:
    def test_verdict_lists_come_comma_separated_from_the_environment_and_as_lists_from_toml(
        self, tmp_path, monkeypatch
    ) -> None:  # type: ignore[no-untyped-def]
        monkeypatch.setenv("NCCLWATCH_RESTART_ON", "process_dead, node_lost")
        assert load_settings({}, environ={}).restart_on == ["process_dead", "node_lost"]
        monkeypatch.delenv("NCCLWATCH_RESTART_ON")
        toml = tmp_path / "ncclwatch.toml"
        toml.write_text('on_hang = "restart"\ndrain = "slurm"\ndrain_on = ["network_error"]\n')
        settings = load_settings({}, str(toml), environ={})
        assert (settings.on_hang, settings.drain, settings.drain_on) == ("restart", "slurm", ["network_error"])

    def test_an_unknown_verdict_is_refused_naming_the_setting_and_the_choices(self) -> None:
        with pytest.raises(
            ConfigError, match=r"--restart-on / NCCLWATCH_RESTART_ON: .*unknown verdict\(s\) stuck; one of"
        ):
            load_settings({"restart_on": "stuck"}, environ={})


class TestMaxRestarts:
    @pytest.mark.parametrize(
        ("command", "environ", "expected"),
        [
            (["torchrun", "--max-restarts", "3", "train.py"], {}, 3),
            (["torchrun", "--max_restarts=2", "train.py"], {}, 2),
            (["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"], {"PET_MAX_RESTARTS": "4"}, 4),
            (["torchrun", "train.py", "--max-restarts", "9"], {}, 0),  # the script's own option, not torchrun's
            (["torchrun", "--max-restarts", "x", "train.py"], {}, 0),
            (["torchrun", "train.py"], {}, 0),
        ],
    )
    def test_torchruns_own_option_or_its_environment_variable(self, command, environ, expected) -> None:  # type: ignore[no-untyped-def]
        assert max_restarts_of(command, environ) == expected
