"""procfs probe: pure parsers on literal text, readers on real processes and on a fixture tree."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from support import sleepers

from ncclwatch.watchdog.probes.procfs import (
    CLK_TCK,
    parse_environ,
    parse_io,
    parse_stat,
    parse_status,
    proc_state,
    read_environ,
    read_proc,
    read_threads,
)

# comm with a space and a ')' inside: only the last ')' ends it
STAT = (
    "4242 (pt main) x) S 4200 4242 4100 0 -1 4194560 9000 0 12 0 250 130 0 0 20 0 57 0 222127 "
    "3133440 382 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0"
)
STATUS = "Name:\tpt main\nState:\tS (sleeping)\nThreads:\t57\nVmRSS:\t  2048 kB\nTracerPid:\t0\n"
IO = "rchar: 6976\nwchar: 10\nsyscr: 10\nsyscw: 1\nread_bytes: 4096\nwrite_bytes: 8192\ncancelled_write_bytes: 0\n"


class TestPureParsers:
    def test_stat_comm_may_hold_spaces_and_parentheses(self):
        stat = parse_stat(STAT)
        assert (stat.pid, stat.comm, stat.state, stat.ppid) == (4242, "pt main) x", "S", 4200)
        assert (stat.utime_ticks, stat.stime_ticks, stat.threads, stat.start_ticks) == (250, 130, 57, 222127)

    def test_stat_cut_short_is_an_error(self):
        with pytest.raises(ValueError):
            parse_stat("4242 (python) S 1 2 3")

    def test_status_keeps_units(self):
        assert parse_status(STATUS) == {
            "Name": "pt main",
            "State": "S (sleeping)",
            "Threads": "57",
            "VmRSS": "2048 kB",
            "TracerPid": "0",
        }

    def test_io(self):
        io = parse_io(IO)
        assert (io["rchar"], io["read_bytes"], io["write_bytes"]) == (6976, 4096, 8192)

    def test_environ_skips_entries_without_equals(self):
        assert parse_environ(b"A=1\0B=x=y\0JUNK\0=nameless\0EMPTY=\0") == {"A": "1", "B": "x=y", "EMPTY": ""}


class TestReaders:
    def test_fixture_tree_without_io_or_wchan(self, tmp_path):
        """Another user's process: io unreadable -> None fields, the rest still read."""
        (tmp_path / "4242").mkdir()
        (tmp_path / "4242" / "stat").write_text(STAT)
        (tmp_path / "4242" / "status").write_text(STATUS)
        info = read_proc(4242, tmp_path)
        assert info.state == "S" and info.state_name == "sleeping"
        assert info.cpu_seconds == pytest.approx(380 / CLK_TCK)
        assert (info.threads, info.vm_rss_bytes, info.start_ticks) == (57, 2048 * 1024, 222127)
        assert info.io_read_bytes is None and info.io_rchar is None and info.wchan is None

    def test_fixture_tree_with_io(self, tmp_path):
        (tmp_path / "4242").mkdir()
        for name, text in (("stat", STAT), ("status", STATUS), ("io", IO), ("wchan", "do_epoll_wait")):
            (tmp_path / "4242" / name).write_text(text)
        info = read_proc(4242, tmp_path)
        assert (info.io_read_bytes, info.io_write_bytes, info.io_rchar, info.io_wchar) == (4096, 8192, 6976, 10)
        assert info.wchan == "do_epoll_wait"

    def test_current_process(self):
        info = read_proc(os.getpid())
        assert info.pid == os.getpid() and info.ppid == os.getppid()
        assert info.state == "R" and info.wchan is None  # reading itself: running
        assert info.cpu_seconds > 0 and info.vm_rss_bytes > 0 and info.threads >= 1
        assert info.io_rchar > 0

    def test_sigstopped_child_reads_as_stopped(self):
        with sleepers(1, stopped=(0,)) as (proc,):
            info = read_proc(proc.pid)
            assert (info.state, info.state_name) == ("T", "stopped")
            assert proc_state(proc.pid) == "T"

    def test_sleeping_child_has_a_wait_channel(self):
        with sleepers(1) as (proc,):
            deadline = time.monotonic() + 5
            # A child still starting, or between two sleeps, reads "R" or wchan 0 for a moment.
            while (
                (info := read_proc(proc.pid)) and not (info.state == "S" and info.wchan) and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert info.state == "S" and info.wchan  # e.g. hrtimer_nanosleep; kernels name it differently

    def test_gone_process_is_none(self):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        assert read_proc(proc.pid) is None
        assert proc_state(proc.pid) is None
        assert read_environ(proc.pid) is None
        assert read_threads(proc.pid) == []

    def test_threads_of_this_process(self):
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait, name="waiter")
        worker.start()
        try:
            deadline = time.monotonic() + 5
            while (threads := read_threads(os.getpid())) and time.monotonic() < deadline:
                waiter = next(t for t in threads if t.tid == worker.native_id)
                if waiter.state == "S" and waiter.wchan:  # once it sleeps in stop.wait(); wchan reads 0 in transit
                    break
            assert {t.tid for t in threads} >= {os.getpid(), worker.native_id}
            assert waiter.state == "S" and waiter.wchan
        finally:
            stop.set()
            worker.join()

    def test_environ_of_a_child(self):
        with sleepers(1, env={"NCCLWATCH_PROBE": "yes"}) as (proc,):
            env = read_environ(proc.pid)
            assert env["NCCLWATCH_PROBE"] == "yes"
