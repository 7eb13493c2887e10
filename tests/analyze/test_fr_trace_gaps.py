"""What PyTorch's own analyzer (fr_trace) said on real dumps that ``analyze`` did not (issue 31).

Real captures (tests/fixtures/flight_recorder/*/README.md): a pipeline whose
two stages both ``recv`` first, on NCCL (H100) and on gloo, and a dtype
mismatch on NCCL (H100), each with the live run's bundles and its dumps.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import FIXTURES

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.bundles_in import unpack_bundle
from ncclwatch.watchdog.hang.verdicts import Verdict

FR = FIXTURES / "flight_recorder"
PIPELINE = FR / "h100-pipeline-both-recv"
GLOO_PIPELINE = FR / "gloo-pipeline-both-recv"
DTYPE = FR / "h100-dtype-mismatch"


def unpack(archive: Path, into: Path) -> list[Path]:
    """The archive's files, unpacked as analyze unpacks a bundle (tar's extraction filters need Python 3.11.4+)."""
    unpacked = unpack_bundle(str(archive), into / archive.name.removesuffix(".tar.gz"))
    assert unpacked.folder is not None and not unpacked.notes, unpacked.notes
    return sorted(path for path in unpacked.folder.rglob("*") if path.is_file())


def after_the_abort(dump: Path, out: Path, late_ms: int = 38, retired: bool = False) -> Path:
    """The dump as torch writes it once the watchdog has aborted the communicator.

    ``ncclCommAbort`` makes NCCL's kernels return, so every end event still
    pending fires; ``dump_entries`` -> ``update_state`` then stamps each entry
    the watchdog never retired with "discovered started/completed" = now.
    ``now`` is the timed-out op's creation + its timeout + ``late_ms`` (the
    real run's log: "ran for 20038 milliseconds before timing out").  ``retired``: as a live watchdog leaves an
    op it saw complete (retired, with its duration) rather than as the abort leaves it.
    """
    raw = pickle.loads(dump.read_bytes())
    pending = [e for e in raw["entries"] if not e["retired"]]
    now = pending[0]["time_created_ns"] + pending[0]["timeout_ms"] * 1_000_000 + late_ms * 1_000_000
    for entry in pending:
        entry["time_discovered_started_ns"] = entry["time_discovered_started_ns"] or now
        entry["time_discovered_completed_ns"] = now
        entry["state"] = "completed"
        if retired:
            entry["retired"], entry["duration_ms"] = True, 1.0
    out.write_bytes(pickle.dumps(raw, protocol=2))
    return out


def cut_short(dump: Path, out: Path, after_s: float, retired: bool = False) -> Path:
    """The dump as an abort ``after_s`` seconds after its newest entry was enqueued leaves it (a peer's node gone,
    long before any timeout): ``after_the_abort`` at that moment."""
    raw = pickle.loads(dump.read_bytes())
    pending = [e for e in raw["entries"] if not e["retired"]]
    newest = max(e["time_created_ns"] for e in raw["entries"])
    since_first_ms = (newest - pending[0]["time_created_ns"]) // 1_000_000
    late_ms = since_first_ms + int(after_s * 1000) - pending[0]["timeout_ms"]
    return after_the_abort(dump, out, late_ms=late_ms, retired=retired)


class TestPipelineDeadlockFromDumps:
    def test_torch_timeout_dumps_name_both_stages(self, tmp_path: Path) -> None:
        dumps = unpack(PIPELINE / "timeout-dumps.tar.gz", tmp_path)
        report = analyze_paths([str(p) for p in dumps])
        assert (report.verdict, report.culprit_ranks) == (Verdict.p2p_deadlock, [0, 1])

    def test_recvs_completed_by_the_abort_are_still_a_deadlock(self, tmp_path: Path) -> None:
        dumps = unpack(PIPELINE / "timeout-dumps.tar.gz", tmp_path / "real")
        (tmp_path / "aborted").mkdir()
        aborted = [after_the_abort(p, tmp_path / "aborted" / p.name) for p in dumps]
        report = analyze_paths([str(p) for p in aborted])
        assert (report.verdict, report.culprit_ranks) == (Verdict.p2p_deadlock, [0, 1]), report.summary
        assert "both_recv (pipeline_job.py:159)" in report.summary

    def test_completions_before_the_timeout_stay_completed(self, tmp_path: Path) -> None:
        # the same dumps stamped 1 s before the timeout ran out, retired by the watchdog as a live one does:
        # completions (and the job healthy) as said
        dumps = unpack(PIPELINE / "timeout-dumps.tar.gz", tmp_path / "real")
        (tmp_path / "early").mkdir()
        early = [after_the_abort(p, tmp_path / "early" / p.name, late_ms=-1000, retired=True) for p in dumps]
        report = analyze_paths([str(p) for p in early])
        assert report.verdict == Verdict.no_hang

    @pytest.mark.parametrize("after_s", [3, 10])
    def test_recvs_completed_unretired_seconds_in_are_still_a_deadlock(self, tmp_path: Path, after_s: int) -> None:
        # issue 44: the communicator aborted before any timeout (a peer's node gone: ncclRemoteError), so the dumps
        # mark both recvs completed a few seconds after they were enqueued, never retired, with no duration
        dumps = unpack(PIPELINE / "timeout-dumps.tar.gz", tmp_path / "real")
        (tmp_path / "cut").mkdir()
        cut = [cut_short(p, tmp_path / "cut" / p.name, after_s) for p in dumps]
        report = analyze_paths([str(p) for p in cut])
        assert (report.verdict, report.culprit_ranks) == (Verdict.p2p_deadlock, [0, 1]), report.summary

    def test_one_rank_cut_short_alone_is_no_deadlock(self, tmp_path: Path) -> None:
        # the rule needs both sides: rank 1's recv retired as a live watchdog does, rank 0's cut short
        dumps = unpack(PIPELINE / "timeout-dumps.tar.gz", tmp_path / "real")
        (tmp_path / "one").mkdir()
        one = [cut_short(p, tmp_path / "one" / p.name, 3, retired=p.name.endswith("1")) for p in dumps]
        report = analyze_paths([str(p) for p in one])
        assert report.verdict != Verdict.p2p_deadlock, report.summary

    @pytest.mark.parametrize("fixture", [PIPELINE, GLOO_PIPELINE])
    def test_the_live_bundles_give_the_live_verdict(self, fixture: Path) -> None:
        bundles = [str(fixture / "node0-bundle.tar.gz"), str(fixture / "node1-bundle.tar.gz")]
        report = analyze_paths(bundles)
        assert (report.verdict, report.culprit_ranks) == (Verdict.p2p_deadlock, [0, 1]), report.summary


class TestDtypeMismatchIsNamed:
    def test_dumps_alone_name_the_dtypes_and_a_dtype_next_step(self, tmp_path: Path) -> None:
        report = analyze_paths([str(p) for p in unpack(DTYPE / "dumps.tar.gz", tmp_path)])
        assert (report.verdict, report.culprit_ranks, report.kind) == (Verdict.collective_mismatch, [1], "dtype")
        assert report.summary.startswith("rank 1 passes Float where rank 0 passes BFloat16 to AllReduce count=128")
        assert "rank 1 passes Float where rank 0 passes BFloat16 to AllReduce #187" in report.headline
        next_step = report.headline.split("Next: ", 1)[1]
        assert "datatype" in next_step and "branch on the rank" not in next_step

    def test_the_live_bundle_names_nccls_dtypes(self) -> None:
        report = analyze_paths([str(DTYPE / "bundle.tar.gz")])
        assert (report.verdict, report.culprit_ranks, report.kind) == (Verdict.collective_mismatch, [1], "dtype")
        assert "passes float32 where rank 0 passes bfloat16" in report.headline

    def test_a_mismatch_in_count_keeps_its_own_words(self) -> None:
        # the shared 2-GPU capture: all_reduce of 16777216 elements on rank 0 and 4195328 on rank 1, same dtype
        report = analyze_paths([str(FIXTURES / "nccl-2.28.9-2gpu" / "mismatch_fr" / "fr")])
        assert (report.verdict, report.kind) == (Verdict.collective_mismatch, None)
        assert "branch on the rank" in report.headline


class TestCallSitesFromDumpsAlone:
    """The real H200 captures (tools/capture's train.py): the frames Flight Recorder recorded say where."""

    @pytest.mark.parametrize(("capture", "behind"), [("nccl-2.28.9-h200x2", 1), ("nccl-2.28.9-h200x4", 3)])
    def test_rank_behind_says_where_the_others_wait_and_where_it_last_was(self, capture: str, behind: int) -> None:
        report = analyze_paths([str(FIXTURES / "captures" / capture / "python_stuck" / "fr")])
        assert (report.verdict, report.culprit_ranks) == (Verdict.rank_behind, [behind])
        rows = {row.rank: row for row in report.ranks}
        # its last two all_reduces are DDP's buckets, issued from C++ (no frames): the last with a stack is the
        # broadcast at train.py:162; the others wait in the all_reduce of train.py:158
        assert rows[behind].call_site and rows[behind].call_site.endswith(
            "main (/work/main/tools/capture/train.py:162)"
        )
        assert rows[0].call_site and rows[0].call_site.endswith("main (/work/main/tools/capture/train.py:158)")
        assert "its last recorded call site is train.py:162 in main()" in report.headline
        assert any("#79, called from main (train.py:162)" in e.fact for e in report.evidence)

    def test_a_gpu_hang_names_the_call_site_of_the_collective_it_is_stuck_in(self) -> None:
        report = analyze_paths([str(FIXTURES / "captures" / "nccl-2.28.9-h200x4" / "spin_kernel" / "fr")])
        assert (report.verdict, report.culprit_ranks) == (Verdict.gpu_compute_hang, [3])
        assert {row.call_site.rsplit(" <- ", 1)[1] for row in report.ranks if row.call_site} == {
            "main (/work/main/tools/capture/train.py:158)"
        }
        assert "AllReduce #82 — issued from train.py:158 in main()" in report.headline


class TestGlooDumpsHoldNoSendOrRecv:
    def test_a_gloo_pipeline_deadlock_from_its_dumps_is_no_no_hang(self, tmp_path: Path) -> None:
        # gloo records the 30 all_reduces, all completed, and none of the 240 p2p ops nor the two hung recvs
        report = analyze_paths([str(p) for p in unpack(GLOO_PIPELINE / "dumps.tar.gz", tmp_path)])
        assert report.verdict == Verdict.inconclusive, report.summary
        assert "ranks 0, 1 issued 240 operations their dumps do not hold" in report.summary
        assert any("py-spy stacks" in m for m in report.missing)

    def test_gloo_dumps_of_collectives_only_still_say_nothing_is_pending(self, tmp_path: Path) -> None:
        # the same dumps, their group's count at their newest collective: nothing issued went unrecorded
        (tmp_path / "collectives_only").mkdir()
        for dump in unpack(GLOO_PIPELINE / "dumps.tar.gz", tmp_path / "real"):
            raw = pickle.loads(dump.read_bytes())
            newest = max(e["collective_seq_id"] for e in raw["entries"])
            for status in raw["pg_status"].values():
                status["last_enqueued_collective"] = status["last_completed_collective"] = newest
            (tmp_path / "collectives_only" / dump.name).write_bytes(pickle.dumps(raw, protocol=2))
        report = analyze_paths([str(tmp_path / "collectives_only")])
        assert report.verdict == Verdict.no_hang, report.summary


def test_dumps_of_a_running_job_taken_rank_by_rank_are_no_rank_behind() -> None:
    # H200 x4, healthy: rank 1's dump holds collectives #35-#44, every one completed, that the others' (older)
    # dumps do not: they took part, since a collective completes on no rank alone
    report = analyze_paths([str(FIXTURES / "captures" / "nccl-2.28.9-h200x4" / "none" / "fr")])
    assert report.verdict == Verdict.no_hang, report.summary
    assert "The dump of rank 1 is the newest; the others' were taken earlier (they hold 34 collectives)" in (
        report.summary
    )
