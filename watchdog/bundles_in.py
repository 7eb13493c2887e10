"""Bundles given to ``ncclwatch analyze``: unpack each ``.tar.gz`` so its files are read like a folder.

A bundle holds the live report, the evidence and the sidecar's journal; the
journal carries the probe's inputs, so analyzing a bundle replays the live
decision.  Unpacking is bounded and safe: tar's ``data`` filter refuses
absolute paths, ``..``, links out of the folder and device files; members
past ``MAX_BYTES`` in all are skipped with a note.  A tarball that cannot be
read is handed on unchanged (the analyzer then says it was not usable).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterable
from pathlib import Path

MAX_BYTES = 2 << 30  # a bundle is tails and dumps: megabytes; past this it is not one of ours
TARBALL_SUFFIXES = (".tar.gz", ".tgz")


def expand_bundles(paths: Iterable[str], into: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """``paths`` with each tarball replaced by the folder it was unpacked into; (tarball, note) on what was skipped."""
    expanded: list[str] = []
    notes: list[tuple[str, str]] = []
    for index, raw in enumerate(paths):
        path = Path(raw)
        if not (path.name.endswith(TARBALL_SUFFIXES) and path.is_file()):
            expanded.append(raw)
            continue
        target = into / f"{index}-{path.name.removesuffix('.gz').removesuffix('.tar').removesuffix('.tgz')}"
        try:
            notes += [(raw, note) for note in _unpack(path, target)]
        except (OSError, tarfile.TarError) as exc:
            notes.append((raw, f"not unpacked ({exc}); read as a plain file"))
            expanded.append(raw)
            continue
        expanded.append(str(target))
    return expanded, notes


def _unpack(path: Path, target: Path) -> list[str]:
    notes: list[str] = []
    total = 0
    target.mkdir(parents=True)
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            total += member.size
            if total > MAX_BYTES:
                notes.append(f"unpacking stopped at {MAX_BYTES >> 20} MiB; later members not read")
                break
            try:
                tar.extract(member, target, filter="data")
            except tarfile.FilterError as exc:
                notes.append(f"member {member.name!r} refused ({exc})")
    return notes
