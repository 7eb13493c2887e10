"""The run folder's layout: shared by the launcher (which makes it) and the sidecar (which reads it).

``<root>/nccl/<host>.<pid>`` NCCL debug files, ``<root>/fr/`` Flight Recorder
pipes and dumps, ``<root>/hb/<pid>.json`` heartbeats, ``<root>/journal.jsonl``
the sidecar's probe inputs, ``<root>/fault.<rank>`` marks written by the demo
job, ``<root>/space.json`` the cap its NCCL files are freed under
(``sources/run_space.py``).

Where it goes (``make_run_folder``): ``--run-dir`` when given, else a fresh
folder under ``/var/tmp``, which is on disk on the distributions we know of
(FHS: "temporary files preserved between reboots"), where ``/tmp`` is often
RAM (tmpfs) and a rank's NCCL lines would take the node's memory.  Not under
the bundle folder: that is often a shared filesystem (NFS, Lustre), where
NCCL's line-buffered writes at thousands of lines a second cost every rank.
Where ``/var/tmp`` is tmpfs too or cannot be written, the system's temp
folder.  One line at start says where the folder is when it is in memory,
has less free space than the cap, or cannot have its NCCL files freed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ncclwatch.watchdog.config import Settings
from ncclwatch.watchdog.sources.holes import punch_problem
from ncclwatch.watchdog.sources.run_space import RunFolderSpace

DISK_TEMP = Path("/var/tmp")
MIB = 1 << 20

JOURNAL_NAME = "journal.jsonl"
PREFLIGHT_NAME = "preflight.json"  # --preflight's baseline, measured before the job (launcher/busbw.py)


@dataclass(frozen=True)
class RunDirs:
    """The folders of one run; ``create`` makes them."""

    root: Path
    nccl: Path
    fr: Path
    hb: Path

    @property
    def journal(self) -> Path:
        return self.root / JOURNAL_NAME

    @classmethod
    def create(cls, root: Path) -> RunDirs:
        """Make ``root`` and its sub-folders (mode 0o700, less the umask).

        An existing folder keeps its mode: it is the user's, and changing a
        folder we did not make would surprise them.
        """
        root = Path(root)
        dirs = cls(root=root, nccl=root / "nccl", fr=root / "fr", hb=root / "hb")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (dirs.nccl, dirs.fr, dirs.hb):
            sub.mkdir(mode=0o700, exist_ok=True)
        return dirs


def make_run_folder(settings: Settings, out: TextIO = sys.stderr, disk_temp: Path = DISK_TEMP) -> Path:
    """The run folder, made, with its space policy (``space.json``); one line on ``out`` where it may hurt."""
    cap = settings.run_folder_cap_mib * MIB
    if settings.run_dir is not None:
        root = settings.run_dir
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        base = disk_temp if _writable(disk_temp) and filesystem_type(disk_temp) != "tmpfs" else None
        root = Path(tempfile.mkdtemp(prefix=f"ncclwatch-{os.getpid()}-", dir=base))
    RunFolderSpace.declare(root, cap)
    note = space_note(root, cap)
    if note:
        print(f"ncclwatch: {note}", file=out, flush=True)
    return root


def space_note(root: Path, cap_bytes: int) -> str | None:
    """What the user should know about where the run folder is, or None."""
    problems = []
    if filesystem_type(root) == "tmpfs":
        problems.append("in memory (tmpfs)")
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    if free < cap_bytes:
        problems.append(f"{free / MIB:.0f} MiB free, under its cap of {cap_bytes / MIB:.0f} MiB")
    unpunchable = punch_problem(root)
    if unpunchable:
        problems.append(f"{unpunchable}: NCCL debug files will grow with the job")
    if not problems:
        return None
    return f"run folder {root}: " + "; ".join(problems) + " (--run-dir moves it)"


def filesystem_type(path: Path) -> str | None:
    """The type ``/proc/self/mounts`` gives the mount holding ``path`` (the longest mount point above it)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _writable(folder: Path) -> bool:
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
