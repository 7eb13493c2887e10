"""The run folder's layout: shared by the launcher (which makes it) and the sidecar (which reads it).

``<root>/nccl/<host>.<pid>`` NCCL debug files, ``<root>/fr/`` Flight Recorder
pipes and dumps, ``<root>/hb/<pid>.json`` heartbeats, ``<root>/journal.jsonl``
the sidecar's probe inputs, ``<root>/fault.<rank>`` marks written by the demo
job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
