"""``analyze`` over logs as launchers print them and over the kernel log's Xids, beside real NCCL logs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ncclwatch.watchdog.analyze import analyze_paths

CPU_STUCK = Path(__file__).parents[1] / "fixtures" / "nccl-2.28.9-2gpu" / "cpu_stuck" / "nccl"  # rank 1 behind
RANK0, RANK1 = CPU_STUCK / "nccl.vm.866.log", CPU_STUCK / "nccl.vm.867.log"  # rank 1: "busId 70"
CHILD_FAILED = Path(__file__).parents[1] / "fixtures" / "torchrun-child-failed-2.13.txt"

PREFIXES = {
    "srun": lambda task, i: f"{task:2d}: ",
    "timestamp + srun": lambda task, i: f"2026-11-26T03:12:{i % 60:02d}.123+00:00 {task}: ",
    "pdsh": lambda task, i: f"10.0.0.{task + 1}: ",
    "mpirun": lambda task, i: f"[1,{task}]<stdout>:",
    "ray": lambda task, i: f"(RayTrainWorker pid={100 + task}, ip=10.0.0.{task + 1}) ",
    "syslog": lambda task, i: f"Nov 26 03:12:45 node{task} python[{100 + task}]: ",
}


def _combined(path: Path, prefix) -> list[str]:
    """The two ranks' NCCL logs interleaved line by line, each line behind its task's prefix."""
    a, b = RANK0.read_text().splitlines(), RANK1.read_text().splitlines()
    out = []
    for i, (x, y) in enumerate(itertools.zip_longest(a, b)):
        out += [prefix(0, i) + x] if x is not None else []
        out += [prefix(1, i) + y] if y is not None else []
    path.write_text("\n".join(out) + "\n")
    return out


@pytest.mark.parametrize("form", sorted(PREFIXES))
def test_a_combined_prefixed_file_gives_the_verdict_of_the_separate_files(tmp_path: Path, form: str) -> None:
    separate = analyze_paths([str(RANK0), str(RANK1)])
    lines = _combined(tmp_path / "job.log", PREFIXES[form])
    combined = analyze_paths([str(tmp_path / "job.log")])
    assert (
        (combined.verdict, combined.culprit_ranks)
        == (separate.verdict, separate.culprit_ranks)
        == (
            separate.verdict,
            [1],
        )
    )
    assert "prefix" in (combined.inputs[0].note or "")
    # Cited lines are the original file's: the prefix is rewritten, never a line dropped.
    cited = [e.cite for e in combined.evidence if e.cite and e.cite.rsplit(":", 1)[-1].isdigit()]
    assert cited
    for where in cited:
        line = int(where.rsplit(":", 1)[1])
        assert "NCCL INFO" in lines[line - 1]


def test_srun_labels_and_mpirun_tags_name_the_tasks(tmp_path: Path) -> None:
    _combined(tmp_path / "srun.log", PREFIXES["srun"])
    _combined(tmp_path / "mpi.log", PREFIXES["mpirun"])
    report = analyze_paths([str(tmp_path / "srun.log")])
    assert "rank 0, 1 by srun --label prefix" in (report.inputs[0].note or "")
    report = analyze_paths([str(tmp_path / "mpi.log")])
    assert "rank 0, 1 by mpirun --tag-output prefix" in (report.inputs[0].note or "")


def test_torchruns_failure_table_interleaved_with_another_tasks_lines_is_read_per_task(tmp_path: Path) -> None:
    """Under srun the table's host line and rank line can have the other task's lines between them."""
    table = CHILD_FAILED.read_text().splitlines()
    out = []
    for i, line in enumerate(table):
        out.append(f"1: {line}")
        out.append(f"0: step {i} loss 0.5")  # the other node's torchrun, still printing
    (tmp_path / "job.log").write_text("\n".join(out) + "\n")
    plain = analyze_paths([str(CHILD_FAILED)])
    prefixed = analyze_paths([str(tmp_path / "job.log")])
    # Rank 1 exited with code 3 of its own (no exception, no signal): no incident, said of rank 1 either way.
    assert (plain.verdict, plain.culprit_ranks, plain.kind) == (prefixed.verdict, prefixed.culprit_ranks, "exit")
    assert plain.summary.startswith("Rank 1 exited with code 3") and prefixed.summary == plain.summary


KERNEL_LOG = """\
[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075)
[  812.113901] nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  570.86.15
[ 1234.567890] NVRM: GPU at PCI:0000:70:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae
[ 1234.567912] NVRM: Xid (PCI:0000:70:00): 79, pid=867, name=python, GPU has fallen off the bus.
[ 1234.567950] NVRM: GPU 0000:70:00.0: GPU has fallen off the bus.
"""


def test_a_hardware_xid_on_the_behind_ranks_gpu_makes_gpu_xid(tmp_path: Path) -> None:
    (tmp_path / "dmesg.txt").write_text(KERNEL_LOG)
    report = analyze_paths([str(RANK0), str(RANK1), str(tmp_path / "dmesg.txt")])
    assert report.verdict.value == "gpu_xid" and report.culprit_ranks == [1]
    assert report.summary.startswith("Xid 79 on GPU 0000:70:00 (rank 1): the GPU fell off the bus")
    assert report.evidence[0].cite == f"{tmp_path / 'dmesg.txt'}:4"
    kinds = {Path(i.path).name: i.kinds for i in report.inputs}
    assert kinds["dmesg.txt"] == ["kernel_log"]


def test_an_xid_on_another_gpu_or_of_the_program_is_cited_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "other_gpu.txt").write_text(KERNEL_LOG.replace("0000:70:00", "0000:90:00").replace("867", "4242"))
    (tmp_path / "program.txt").write_text(
        KERNEL_LOG.replace(
            "): 79, pid=867, name=python, GPU has fallen off the bus.",
            "): 13, pid=867, name=python, Graphics SM Warp Exception",
        )
    )
    for name in ("other_gpu.txt", "program.txt"):
        report = analyze_paths([str(RANK0), str(RANK1), str(tmp_path / name)])
        assert report.verdict.value == "rank_behind" and report.culprit_ranks == [1]
        assert any(e.fact.startswith("Xid ") for e in report.evidence)


def test_a_journalctl_kernel_log_of_another_node_is_not_this_nodes_gpu(tmp_path: Path) -> None:
    (tmp_path / "journal.txt").write_text(
        "Nov 26 03:12:44 gpu9 kernel: nvidia 0000:70:00.0: enabling device\n"
        "Nov 26 03:12:45 gpu9 kernel: NVRM: Xid (PCI:0000:70:00): 79, pid=867, name=python, "
        "GPU has fallen off the bus.\n"
        "Nov 26 03:12:45 gpu9 kernel: NVRM: GPU 0000:70:00.0: GPU has fallen off the bus.\n"
    )
    report = analyze_paths([str(RANK0), str(RANK1), str(tmp_path / "journal.txt")])
    assert report.verdict.value == "rank_behind"  # the ranks ran on "vm"
    assert any("node gpu9" in e.fact for e in report.evidence)


def test_drain_acts_on_the_gpu_xid_verdict_and_names_the_node(tmp_path: Path) -> None:
    from ncclwatch.watchdog.hang.verdicts import DRAIN_ON_DEFAULT, RESTART_ON_DEFAULT
    from ncclwatch.watchdog.response.policy import Policy, Response, plan

    (tmp_path / "dmesg.txt").write_text(KERNEL_LOG)
    report = analyze_paths([str(RANK0), str(RANK1), str(tmp_path / "dmesg.txt")])
    chosen = plan(report, Policy("kill", 0, frozenset(RESTART_ON_DEFAULT), "slurm", frozenset(DRAIN_ON_DEFAULT)), 0, [])
    assert chosen.response is Response.drain and chosen.drain_hosts == ("vm",)
    assert chosen.why == "gpu_xid blames the hardware of vm"


def test_an_xid_the_live_sidecar_read_is_journaled_so_the_bundle_replays_gpu_xid(tmp_path: Path) -> None:
    """/dev/kmsg is read live only: the Xid must travel in the journal (and to the leader), or offline loses it."""
    from ncclwatch.watchdog.events import Stall, XidError
    from ncclwatch.watchdog.hang.state import JobState
    from ncclwatch.watchdog.live.journal import Journal
    from ncclwatch.watchdog.sources.kmsg import KmsgSource

    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    source = KmsgSource(str(kmsg), host="vm")
    source.poll(lambda event: None)
    kmsg.write_text("4,1234,1234567912,-;NVRM: Xid (PCI:0000:70:00): 79, pid=867, name=python, GPU has fallen off\n")
    seen: list = []  # type: ignore[type-arg]
    source.poll(seen.append)
    state = JobState()
    for event in seen:
        state.apply(event)
    assert [type(e) for e in seen] == [XidError]
    journal = tmp_path / "journal.jsonl"
    Journal(journal).record(state, Stall(at=1.0, stalled_for_s=12.0, stall_timeout_s=5.0, progress_timeout_s=1800))
    report = analyze_paths([str(RANK0), str(RANK1), str(journal)])
    assert report.verdict.value == "gpu_xid" and report.culprit_ranks == [1]
