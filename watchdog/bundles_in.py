"""Bundles given to ``ncclwatch analyze``: unpack each ``.tar.gz`` so its files are read like a folder.

A bundle holds the live report, the evidence and the sidecar's journal; the
journal carries the probe's inputs, so analyzing a bundle replays the live
decision.  Unpacking is bounded and safe: only regular files and folders
are written, their bytes copied by us (no modes, owners or links from the
archive), and a member named by an absolute path or one that resolves out
of the folder is refused with a note; members past ``MAX_BYTES`` in all are
skipped with a note.  Not tar's ``data`` filter, which would do the same:
Pythons before 3.11.4 (Debian 12's 3.11.2 among them) have no extraction
filters.  A tarball that cannot be read is handed on unchanged (the
analyzer then says it was not usable).
"""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

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
    root = target.resolve()
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            total += member.size
            if total > MAX_BYTES:
                notes.append(f"unpacking stopped at {MAX_BYTES >> 20} MiB; later members not read")
                break
            refused = _refusal(member, root)
            if refused is not None:
                notes.append(f"member {member.name!r} refused ({refused})")
                continue
            dest = root / member.name
            if member.isdir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as source, dest.open("wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(source, out)
    return notes


def _refusal(member: tarfile.TarInfo, root: Path) -> str | None:
    """Why ``member`` is not unpacked into ``root``; None when it is a file or folder inside it."""
    if not (member.isfile() or member.isdir()):
        return "not a regular file or folder"
    if PurePosixPath(member.name).is_absolute() or not (root / member.name).resolve().is_relative_to(root):
        return "outside the folder it is unpacked into"
    return None
