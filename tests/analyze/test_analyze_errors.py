"""``ncclwatch analyze`` on input it cannot use, as a new user meets it (issue 31).

Input that cannot be read (a missing path, a bundle cut short) is one line on stderr naming it and why; when
nothing at all could be read or used, exit 4 and no report.  When some inputs are readable, they are judged,
each unreadable one is said on stderr and in the inputs list, and the exit status is the verdict's.  A reader
that stops early (``| head -1``) ends the output quietly.  Bundles found in a folder are unpacked like a named one.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import shared
from nccl_lines import init, op, steps

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.report import EXIT_UNREADABLE

BUNDLE = shared("bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz")
NEEDS = "ncclwatch analyze --help"


def analyze(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def two_rank_hang(folder: Path) -> Path:
    """Rank 1 never issues the AllReduce rank 0 waits in: rank_behind, culprit 1 (exit 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in (0, 1):
        body = steps(r, f"0xc{r}", 3) + ("" if r == 1 else op(r, "AllReduce", 4195328, f"0xc{r}"))
        (folder / f"nccl.node1.{1000 + r}.log").write_text(init(r, 2, f"0xc{r}") + body)
    return folder


def cut_bundle(path: Path) -> Path:
    """A bundle whose first file is cut in half: nothing of it can be read."""
    data = random.Random(31).randbytes(200_000)  # incompressible: the cut falls inside the first file
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("job-node1-x/journal.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return path


def stderr_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.splitlines()


class TestUnreadable:
    def test_a_bundle_cut_short_is_one_line_and_exit_4(self, tmp_path: Path) -> None:
        bundle = cut_bundle(tmp_path / "job-node1-x.tar.gz")
        proc = analyze(bundle)
        [line] = stderr_lines(proc)
        assert line.startswith(f"ncclwatch analyze: {bundle}: cannot read: cut short"), line
        assert (proc.returncode, proc.stdout) == (EXIT_UNREADABLE, "")

    def test_a_real_bundle_cut_short_keeps_the_files_before_the_cut_and_says_so(self, tmp_path: Path) -> None:
        cut = tmp_path / "cut.tar.gz"
        cut.write_bytes(BUNDLE.read_bytes()[:100_000])
        proc = analyze("--json", cut)
        [line] = stderr_lines(proc)
        assert line.startswith(f"ncclwatch analyze: {cut}: cannot read past its first "), line
        report = json.loads(proc.stdout)
        assert any(item["path"] == str(cut) and "cut short" in item["note"] for item in report["inputs"])
        assert proc.returncode == {"no_hang": 0, "inconclusive": 2}.get(report["verdict"], 1)

    def test_a_missing_path_is_one_line_and_exit_4(self, tmp_path: Path) -> None:
        proc = analyze(tmp_path / "nope")
        assert stderr_lines(proc) == [f"ncclwatch analyze: no such file: {tmp_path / 'nope'}"]
        assert (proc.returncode, proc.stdout) == (EXIT_UNREADABLE, "")

    def test_readable_inputs_are_judged_beside_an_unreadable_one_and_the_verdict_exits(self, tmp_path: Path) -> None:
        logs = two_rank_hang(tmp_path / "logs")
        cut = cut_bundle(tmp_path / "cut.tar.gz")
        proc = analyze(logs, tmp_path / "nope.log", cut)
        lines = stderr_lines(proc)
        assert lines[0] == f"ncclwatch analyze: no such file: {tmp_path / 'nope.log'}"
        assert lines[1].startswith(f"ncclwatch analyze: {cut}: cannot read: cut short") and len(lines) == 2
        assert proc.returncode == 1 and "RANK BEHIND — culprit rank 1" in proc.stdout
        assert f"{tmp_path / 'nope.log'}: not used — no such file or directory" in proc.stdout

    def test_an_empty_folder_says_there_is_nothing_and_what_analyze_needs(self, tmp_path: Path) -> None:
        (tmp_path / "empty").mkdir()
        proc = analyze(tmp_path / "empty")
        [line] = stderr_lines(proc)
        assert line.startswith(f"ncclwatch analyze: nothing to judge: no files in {tmp_path / 'empty'};"), line
        assert NEEDS in line
        assert (proc.returncode, proc.stdout) == (EXIT_UNREADABLE, "")

    def test_only_empty_and_binary_files_say_what_was_read(self, tmp_path: Path) -> None:
        (tmp_path / "empty.log").write_bytes(b"")
        (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 64)
        proc = analyze("--json", tmp_path)
        [line] = stderr_lines(proc)
        assert line.startswith("ncclwatch analyze: nothing to judge: 2 files read, none usable (1 empty, "), line
        assert "1 not a recognised format" in line and NEEDS in line
        assert (proc.returncode, proc.stdout) == (EXIT_UNREADABLE, "")

    def test_empty_standard_input(self) -> None:
        proc = analyze("-", stdin="")
        [line] = stderr_lines(proc)
        assert line.startswith("ncclwatch analyze: nothing to judge: <stdin> is empty; "), line
        assert proc.returncode == EXIT_UNREADABLE

    def test_one_empty_or_binary_file_is_named_with_its_reason_in_one_line(self, tmp_path: Path) -> None:
        (tmp_path / "empty.log").write_bytes(b"")
        (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 64)
        for name, said in (("empty.log", " is empty;"), ("garbage.bin", ": not a recognised format;")):
            proc = analyze(tmp_path / name)
            [line] = stderr_lines(proc)
            assert line.startswith(f"ncclwatch analyze: nothing to judge: {tmp_path / name}{said}"), line
            assert NEEDS in line and (proc.returncode, proc.stdout) == (EXIT_UNREADABLE, "")

    def test_help_documents_the_status(self) -> None:
        proc = analyze("--help-all")
        assert f"  {EXIT_UNREADABLE}  " in proc.stdout and "could be read" in proc.stdout


class TestBrokenPipe:
    def test_a_reader_that_stops_early_ends_the_output_quietly_with_the_verdicts_status(self) -> None:
        # The reader is gone before the first byte is written (the interpreter takes far longer to start).
        proc = subprocess.Popen(
            [sys.executable, "-m", "ncclwatch", "analyze", str(shared("nccl-2.28.9-2gpu", "mismatch"))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        assert (proc.wait(timeout=120), stderr) == (1, "")  # collective_mismatch


class TestBundlesInFolders:
    def test_a_bundle_in_a_folder_is_unpacked_and_read_like_a_named_one(self, tmp_path: Path) -> None:
        folder = tmp_path / "ncclwatch-bundles"
        folder.mkdir()
        shutil.copy(BUNDLE, folder)
        named, found = analyze_paths([str(BUNDLE)]), analyze_paths([str(folder)])
        assert (found.verdict.value, found.culprit_ranks) == (named.verdict.value, named.culprit_ranks)
        assert (found.verdict.value, found.culprit_ranks) == ("collective_mismatch", [1])
        assert sorted(Path(i.path).name for i in found.inputs) == sorted(Path(i.path).name for i in named.inputs)
        assert "journal" in {kind for item in found.inputs for kind in item.kinds}
