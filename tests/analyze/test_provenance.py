"""Inputs of different jobs or runs given together: told apart, never merged (``watchdog/provenance.py``).

Real inputs only: the bundles the live sidecar wrote on an H100 (two different jobs) and on CPU (two runs of
``ncclwatch demo``; two restart rounds of one job).  NCCL logs of two jobs without a journal are judged per
communicator, the most severe verdict said (``tests/launcher/test_cli.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import WorkerSeen
from ncclwatch.watchdog.parsing.journal import HEADER, journal_line
from ncclwatch.watchdog.provenance import EXIT_MIXED_JOBS, MixedJobs

FSDP2_SKIP = shared(
    "bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"
)
PIPELINE = shared(
    "bundles", "nccl-2.28.9-h100-pipeline-missing-send", "pipeline_missing_send-vm-20261124T221715Z-node_lost.tar.gz"
)


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", *args], capture_output=True, text=True, timeout=120
    )


def test_bundles_of_two_jobs_are_refused_naming_each_job_and_its_files() -> None:
    with pytest.raises(MixedJobs) as refused:
        analyze_paths([str(FSDP2_SKIP), str(PIPELINE)])
    said = str(refused.value)
    assert "2 different jobs" in said
    # torchrun's run id of the fsdp2 job; the pipeline job ran under static rendezvous: its store tells it
    assert "job 29fdf915" in said and "job store 127.0.0.1:29623" in said
    assert str(FSDP2_SKIP) in said and str(PIPELINE) in said
    assert "pids 543, 544" in said and "pid 984" in said


def test_the_command_line_refuses_two_jobs_in_one_line_with_its_own_status() -> None:
    proc = analyze(str(FSDP2_SKIP), str(PIPELINE))
    assert proc.returncode == EXIT_MIXED_JOBS
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("ncclwatch analyze: inputs of 2 different jobs, not judged together: ")
    assert (
        f"  {EXIT_MIXED_JOBS}  no report: the inputs hold bundles or run folders of different jobs"
        in analyze("--help-all").stdout
    )


DEMO_JOBS = sorted(shared("bundles", "demo-cpu-two-jobs").glob("*.tar.gz"))
ROUNDS = sorted(shared("bundles", "demo-cpu-restart").glob("*.tar.gz"))  # round 0, then round 1


def test_two_demo_runs_are_two_jobs_refused() -> None:
    with pytest.raises(MixedJobs) as refused:
        analyze_paths([str(p) for p in DEMO_JOBS])
    said = str(refused.value)
    assert "job 143e8c49" in said and "pids 20600, 20601, 20602" in said
    assert "job 88b6d896" in said and "pids 20932, 20933, 20934" in said


def test_restart_rounds_of_one_job_judge_the_newest_round_and_say_so() -> None:
    alone = analyze_paths([str(ROUNDS[1])])
    both = analyze_paths([str(p) for p in ROUNDS])
    assert (both.verdict, both.culprit_ranks) == (alone.verdict, alone.culprit_ranks)
    assert [row.pid for row in both.ranks] == [row.pid for row in alone.ranks] == [27182, 27183, 27184]
    [said] = [n for n in both.notes if n.startswith("the inputs hold 2 restart rounds of one job: judged the newest")]
    assert f"{ROUNDS[1]} (job 00d620f8; restart round 1;" in said
    older = ROUNDS[0].name.removesuffix(".tar.gz") + "/"
    aside = [i for i in both.inputs if i.path.startswith(older)]
    assert aside and all((i.note or "").startswith("set aside: of an older run") for i in aside)
    judged = [i for i in both.inputs if not i.path.startswith(older)]
    assert {i.path for i in judged} == {i.path for i in alone.inputs}


def _dumps(bundle: Path, into: Path) -> Path:
    """A bundle's Flight Recorder dumps as loose files (what a job's dump folder holds)."""
    folder = into / bundle.name.removesuffix(".tar.gz")
    folder.mkdir(parents=True)
    with tarfile.open(bundle) as tar:
        for member in tar:
            if "/fr/" in member.name and member.isfile():
                (folder / Path(member.name).name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    return folder


def test_loose_dumps_of_two_runs_are_told_apart_by_their_collectives_times(tmp_path: Path) -> None:
    older, newer = (_dumps(bundle, tmp_path) for bundle in DEMO_JOBS)  # 13 s apart, same ranks, same groups
    alone = analyze_paths([str(newer)])
    both = analyze_paths([str(tmp_path)])
    assert (both.verdict, both.culprit_ranks, both.position) == (alone.verdict, alone.culprit_ranks, alone.position)
    assert [e.cite for e in both.evidence] == [e.cite for e in alone.evidence]
    [said] = [n for n in both.notes if n.startswith("the Flight Recorder dumps are of 2 runs")]
    assert f"judged the newest, {newer}/ (3 files)" in said and f"set aside {older}/ (3 files)" in said
    aside = [i for i in both.inputs if i.path.startswith(str(older))]
    assert len(aside) == 3 and all((i.note or "").startswith("set aside: a Flight Recorder dump") for i in aside)


def test_a_run_folders_nccl_files_of_an_earlier_restart_round_are_set_aside(tmp_path: Path) -> None:
    """A kept run folder after a restart: one journal across both rounds, each round's NCCL files side by side.
    Round 0's and round 1's files here are two real runs' on 2 x H200; the journal is the sidecar's own writer's."""
    two_gpu = shared("nccl-2.28.9-2gpu")
    workers = [(714, 0, 0), (715, 1, 0), (866, 0, 1), (867, 1, 1)]  # pid, rank, restart round
    seen = [
        WorkerSeen(pid=pid, rank=rank, world_size=2, restart_count=round_, host="vm", at=1_795_000_000 + 60 * round_)
        for pid, rank, round_ in workers
    ]
    lines = [HEADER.decode(), *(journal_line(event) for event in seen)]

    def run_folder(name: str, scenarios: tuple[str, ...]) -> Path:
        folder = tmp_path / name
        (folder / "nccl").mkdir(parents=True)
        (folder / "journal.jsonl").write_text("\n".join(lines) + "\n")
        for scenario in scenarios:
            for log in (two_gpu / scenario / "nccl").iterdir():
                shutil.copy(log, folder / "nccl" / log.name)
        return folder

    newest = analyze_paths([str(run_folder("round1", ("cpu_stuck",)))])
    both = analyze_paths([str(run_folder("both", ("mismatch", "cpu_stuck")))])
    assert (both.verdict, both.culprit_ranks, both.position) == (newest.verdict, newest.culprit_ranks, newest.position)
    aside = {Path(i.path).name: i.note for i in both.inputs if i.note and i.note.startswith("set aside")}
    assert set(aside) == {"nccl.vm.714.log", "nccl.vm.715.log"}
    assert all("of restart round 0" in note and "round 1 is judged" in note for note in aside.values())
    assert any("2 file(s) of earlier restart rounds set aside" in n for n in both.notes), both.notes
