"""``ncclwatch analyze`` as a user runs it: a real process, its stdout, its exit code.

Bad input must give a clear message and a best-effort verdict, never a traceback.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

from conftest import shared
from nccl_lines import destroy, init, op, steps

REPORT_KEYS = {"verdict", "culprit_ranks", "communicator", "position", "operation", "ranks", "evidence", "summary"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ncclwatch", *args], capture_output=True, text=True, timeout=120)


def analyze_json(*paths) -> tuple[dict, subprocess.CompletedProcess[str]]:
    proc = run("analyze", "--json", *map(str, paths))
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout), proc


def two_rank_hang(write, behind_rank: int = 1) -> None:
    for r in (0, 1):
        body = steps(r, f"0xc{r}", 3) + ("" if r == behind_rank else op(r, "AllReduce", 4195328, f"0xc{r}"))
        write(f"logs/nccl.node1.{1000 + r}.log", init(r, 2, f"0xc{r}") + body)


class TestOutput:
    def test_json_has_the_contract_keys_and_exit_1_on_a_hang(self, write, tmp_path):
        two_rank_hang(write)
        report, proc = analyze_json(tmp_path / "logs")
        assert REPORT_KEYS <= report.keys()
        assert (report["verdict"], report["culprit_ranks"], proc.returncode) == ("rank_behind", [1], 1)
        assert proc.stdout.lstrip().startswith("{")

    def test_human_output_names_culprit_operation_and_table(self, write, tmp_path):
        two_rank_hang(write)
        proc = run("analyze", str(tmp_path / "logs"))
        assert proc.returncode == 1
        assert "RANK BEHIND — culprit rank 1" in proc.stdout
        assert "operation: AllReduce count=4195328" in proc.stdout
        assert "rank  host   pid" in proc.stdout

    def test_clean_run_exits_0(self, write, tmp_path):
        for r in (0, 1):
            write(f"nccl.{r}.log", init(r, 2, f"0xc{r}") + steps(r, f"0xc{r}", 2) + destroy(r, 2, f"0xc{r}"))
        report, proc = analyze_json(tmp_path)
        assert (report["verdict"], proc.returncode) == ("no_hang", 0)

    def test_help_teaches_verdicts_and_exit_codes(self):
        from ncclwatch.watchdog.hang.verdicts import Verdict

        proc = run("analyze", "--help-all")
        assert proc.returncode == 0
        for word in ("exit status", "NCCL_DEBUG_SUBSYS=INIT,COLL"):
            assert word in proc.stdout
        assert [v.value for v in Verdict if v.value not in proc.stdout] == []

    def test_the_wrappers_help_lists_every_live_verdict(self):
        from ncclwatch.watchdog.hang.verdicts import CATALOGUE

        proc = run("--help-all")
        assert proc.returncode == 0
        paged_live = [v.value for v, entry in CATALOGUE.items() if entry.live and entry.hang]
        assert [name for name in paged_live if name not in proc.stdout] == []

    def test_real_capture_end_to_end(self):
        report, proc = analyze_json(shared("nccl-2.28.9-2gpu", "mismatch"))
        assert (report["verdict"], report["culprit_ranks"], proc.returncode) == ("collective_mismatch", [1], 1)


class TestBadInput:
    def test_missing_path_is_one_line_and_exit_4(self, tmp_path):
        proc = run("analyze", "--json", str(tmp_path / "nope"))
        assert (proc.returncode, proc.stdout) == (4, "")
        assert proc.stderr == f"ncclwatch analyze: no such file: {tmp_path / 'nope'}\n"

    def test_empty_file_and_binary_garbage(self, write, tmp_path):
        from ncclwatch.watchdog.analyze import analyze_paths

        write("empty.log", b"")
        write("garbage.bin", bytes(range(256)) * 64)
        proc = run("analyze", "--json", str(tmp_path))
        assert (proc.returncode, proc.stdout) == (4, "")
        assert "2 files read, none usable (1 empty, 1 not a recognised format)" in proc.stderr
        notes = {i.path.rsplit("/", 1)[1]: i.note for i in analyze_paths([str(tmp_path)]).inputs}
        assert notes == {"empty.log": "empty file", "garbage.bin": "not a recognised format; ignored"}

    def test_truncated_last_line_still_gives_the_verdict(self, write, tmp_path):
        two_rank_hang(write)
        log = tmp_path / "logs" / "nccl.node1.1000.log"
        log.write_bytes(log.read_bytes() + op(0, "AllGather", 1024, "0xc0").encode()[:70])
        report, _ = analyze_json(tmp_path / "logs")
        assert (report["verdict"], report["culprit_ranks"]) == ("rank_behind", [1])
        assert any("garbled" in (i["note"] or "") for i in report["inputs"])

    def test_a_missing_rank_is_said_and_the_rest_analysed(self, write, tmp_path):
        for r in (0, 1, 2):
            body = steps(r, f"0xc{r}", 2) + ("" if r == 1 else op(r, "AllReduce", 8, f"0xc{r}"))
            if r != 2:
                write(f"nccl.{r}.log", init(r, 3, f"0xc{r}") + body)
        report, _ = analyze_json(tmp_path)
        assert report["verdict"] == "rank_behind" and report["culprit_ranks"] == [1]
        assert any("rank 2" in m and "no log" in m for m in report["missing"])

    def test_logs_of_two_jobs_in_one_folder_are_told_apart(self, write, tmp_path):
        two_rank_hang(write)
        for r in (0, 1):  # another, healthy job with another commId and other pids
            text = init(r, 2, f"0xd{r}", comm_id="0x1111", host="node9") + steps(r, f"0xd{r}", 2, host="node9")
            write(f"other/nccl.node9.{r}.log", text + destroy(r, 2, f"0xd{r}", host="node9"))
        report, _ = analyze_json(tmp_path)
        assert (report["verdict"], report["culprit_ranks"]) == ("rank_behind", [1])
        assert any("2 jobs" in n for n in report["notes"])

    def test_malicious_pickle_is_refused_not_run(self, write, tmp_path):
        class Exploit:
            def __reduce__(self):
                return (print, ("pwned",))

        write("nccl_trace_rank_0", pickle.dumps({"version": "2.10", "entries": [Exploit()], "pg_config": {}}))
        report, proc = analyze_json(tmp_path)
        assert "pwned" not in proc.stdout
        assert proc.returncode == 2

    def test_a_directory_with_only_unrelated_files(self, write, tmp_path):
        write("notes.txt", "hello\n")
        proc = run("analyze", "--json", str(tmp_path))
        assert (proc.returncode, proc.stdout) == (4, "")
        assert f"nothing to judge: {tmp_path / 'notes.txt'}: not a recognised format; " in proc.stderr
