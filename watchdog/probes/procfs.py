"""Process facts from procfs: run state, CPU time, I/O, threads, environment.

Readers (``read_*``) do the I/O and take ``proc_root`` so tests and
containers can point them elsewhere; the parsers (``parse_*``) are pure and
work on literal text (node_exporter's getX/parseX split).

Failure modes: a process that is gone reads as ``None``; a file that exists
but cannot be read (``/proc/<pid>/io`` of another user's process without
``CAP_SYS_PTRACE``) leaves its fields ``None``.  Nothing here raises on a
vanished or foreign process; malformed text makes the pure parsers raise
``ValueError``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK")
STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk sleep",
    "T": "stopped",
    "t": "tracing stop",
    "Z": "zombie",
    "X": "dead",
    "x": "dead",
    "I": "idle",
    "P": "parked",
    "W": "waking",
    "K": "wakekill",
}


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` (or ``task/<tid>/stat``) we use."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime_ticks: int
    stime_ticks: int
    threads: int
    start_ticks: int  # since boot: with pid, identifies a process across pid reuse


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    comm: str
    state: str  # one letter: R S D T t Z X I ...
    state_name: str
    ppid: int
    cpu_seconds: float  # utime + stime of all threads
    io_read_bytes: int | None  # storage reads (read_bytes); None when /proc/<pid>/io is unreadable
    io_write_bytes: int | None
    # rchar/wchar count every read/write syscall, sockets and pipes included:
    # a gloo or TCP-store rank moves data here while read_bytes stays flat.
    io_rchar: int | None
    io_wchar: int | None
    threads: int
    vm_rss_bytes: int | None  # None for kernel threads (no VmRSS line)
    wchan: str | None  # kernel function the main thread sleeps in; None when running
    start_ticks: int


@dataclass(frozen=True)
class ThreadInfo:
    tid: int
    state: str
    comm: str
    wchan: str | None


def parse_stat(text: str) -> Stat:
    """``comm`` may hold spaces and parentheses: split after the *last* ')'."""
    close = text.rindex(")")
    pid = int(text[: text.index("(")])
    comm = text[text.index("(") + 1 : close]
    fields = text[close + 2 :].split()
    if len(fields) < 20:
        raise ValueError(f"stat has {len(fields)} fields after comm, expected >= 20")
    return Stat(
        pid=pid,
        comm=comm,
        state=fields[0],
        ppid=int(fields[1]),
        utime_ticks=int(fields[11]),
        stime_ticks=int(fields[12]),
        threads=int(fields[17]),
        start_ticks=int(fields[19]),
    )


def parse_status(text: str) -> dict[str, str]:
    """``Key:\\tvalue`` lines -> {key: value}; values keep their units ("123 kB")."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_io(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def parse_environ(data: bytes) -> dict[str, str]:
    """NUL-separated ``NAME=value``; an entry without '=' is not a variable."""
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _kib_to_bytes(value: str | None) -> int | None:
    if not value:
        return None
    number, _, unit = value.partition(" ")
    return int(number) * 1024 if unit.strip() == "kB" else int(number)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # gone, or not ours to read
        return None


def _wchan(path: Path) -> str | None:
    text = _read_text(path)
    # "0" means running (or a kernel that hides it): no wait channel to report
    return text.strip() if text and text.strip() not in ("", "0") else None


def proc_state(pid: int, proc_root: Path = PROC) -> str | None:
    """The state letter only, or None when the process is gone: the cheapest read."""
    text = _read_text(proc_root / str(pid) / "stat")
    try:
        return parse_stat(text).state if text else None
    except ValueError:
        return None


def main_thread_cpu_seconds(pid: int, proc_root: Path = PROC) -> float | None:
    """utime + stime of the process's main thread (``task/<pid>/stat``), the one that runs the training loop;
    None when it cannot be read.  A CUDA process's other threads (NCCL's proxy, PyTorch's watchdog) burn CPU while
    the training thread sleeps, so the process's total does not say whether the rank's own code runs."""
    text = _read_text(proc_root / str(pid) / "task" / str(pid) / "stat")
    if not text:
        return None
    try:
        stat = parse_stat(text)
    except ValueError:
        return None
    return (stat.utime_ticks + stat.stime_ticks) / CLK_TCK


def read_proc(pid: int, proc_root: Path = PROC) -> ProcInfo | None:
    base = proc_root / str(pid)
    text = _read_text(base / "stat")
    if not text:
        return None
    try:
        stat = parse_stat(text)
        status = parse_status(_read_text(base / "status") or "")
        rss = _kib_to_bytes(status.get("VmRSS"))
    except ValueError:
        return None
    io_text = _read_text(base / "io")
    io = parse_io(io_text) if io_text else {}
    return ProcInfo(
        pid=pid,
        comm=stat.comm,
        state=stat.state,
        state_name=STATE_NAMES.get(stat.state, "unknown"),
        ppid=stat.ppid,
        cpu_seconds=(stat.utime_ticks + stat.stime_ticks) / CLK_TCK,
        io_read_bytes=io.get("read_bytes"),
        io_write_bytes=io.get("write_bytes"),
        io_rchar=io.get("rchar"),
        io_wchar=io.get("wchar"),
        threads=stat.threads,
        vm_rss_bytes=rss,
        wchan=_wchan(base / "wchan"),
        start_ticks=stat.start_ticks,
    )


def read_threads(pid: int, proc_root: Path = PROC) -> list[ThreadInfo]:
    """Every thread's state and wait channel; threads that exit meanwhile are skipped."""
    task = proc_root / str(pid) / "task"
    try:
        tids = sorted(int(name) for name in os.listdir(task) if name.isdigit())
    except OSError:
        return []
    threads = []
    for tid in tids:
        text = _read_text(task / str(tid) / "stat")
        try:
            stat = parse_stat(text) if text else None
        except ValueError:
            stat = None
        if stat is not None:
            threads.append(ThreadInfo(tid, stat.state, stat.comm, _wchan(task / str(tid) / "wchan")))
    return threads


def read_environ(pid: int, proc_root: Path = PROC) -> dict[str, str] | None:
    """None when the process is gone or its environment is not ours to read."""
    try:
        data = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    return parse_environ(data)


def parse_listening_inodes(table: str, port: int) -> set[int]:
    """Socket inodes listening on ``port`` in a ``/proc/<pid>/net/tcp`` or ``tcp6`` table (state 0A = LISTEN)."""
    inodes = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
            inodes.add(int(fields[9]))
    return inodes


def listens_on(pid: int, port: int, proc_root: Path = PROC) -> bool:
    """Does process ``pid`` hold a socket listening on TCP ``port``?  (Does torchrun there serve the store?)"""
    base = proc_root / str(pid)
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            inodes |= parse_listening_inodes((base / "net" / table).read_text(), port)
        except OSError:
            continue
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = list((base / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in wanted:
                return True
        except OSError:  # closed while we looked
            continue
    return False
