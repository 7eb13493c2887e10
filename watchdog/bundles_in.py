"""Bundles given to ``ncclwatch analyze``, by name or found in a folder: each unpacked and read like a folder.

A bundle holds the live report, the evidence and the sidecar's journal; the
journal carries the probe's inputs, so analyzing a bundle replays the live
decision.  Unpacking is bounded and safe: only regular files and folders
are written, their bytes copied by us (no modes, owners or links from the
archive), and a member named by an absolute path or one that resolves out
of the folder is refused with a note; members past ``MAX_BYTES`` in all are
skipped with a note.  Not tar's ``data`` filter, which would do the same:
Pythons before 3.11.4 (Debian 12's 3.11.2 among them) have no extraction
filters.

Failure modes: a file that is no tarball at all is handed on to be read as a
plain file (the analyzer then says whether it was usable).  A bundle cut short
(a copy that stopped, a full disk) or damaged keeps the files before the break,
the one it broke in removed; its note says so, and starts with "cannot read"
(``inputs.UNREADABLE``), so that the analyzer says it on stderr.
"""

from __future__ import annotations

import shutil
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

MAX_BYTES = 2 << 30  # a bundle is tails and dumps: megabytes; past this it is not one of ours
TARBALL_SUFFIXES = (".tar.gz", ".tgz")


@dataclass
class Unpacked:
    """What came of one bundle: the folder its files are in, and what was refused, skipped or lost."""

    folder: Path | None  # None when no file of it could be unpacked
    notes: list[str] = field(default_factory=list)
    plain: bool = False  # not a tarball at all: read it as a plain file


def is_bundle(path: str) -> bool:
    return path.endswith(TARBALL_SUFFIXES)


def unpack_bundle(path: str, target: Path) -> Unpacked:
    """Unpack the tarball ``path`` into ``target`` (created); never raises on a bad tarball."""
    try:
        tar = tarfile.open(path, "r:gz")
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        if _cut_short(exc):
            return Unpacked(None, [f"cannot read: cut short before its first file ({exc})"])
        return Unpacked(None, [f"not unpacked ({exc}); read as a plain file"], plain=True)
    notes: list[str] = []
    files = 0
    target.mkdir(parents=True)
    root = target.resolve()
    total = 0
    dest: Path | None = None
    try:
        with tar:
            for member in tar:
                total += member.size
                if total > MAX_BYTES:
                    notes.append(f"unpacking stopped at {MAX_BYTES >> 20} MiB; later members not read")
                    break
                refused = _refusal(member, root)
                if refused is not None:
                    notes.append(f"member {member.name!r} refused ({refused})")
                    continue
                if member.isdir():
                    (root / member.name).mkdir(parents=True, exist_ok=True)
                    continue
                dest = root / member.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as source, dest.open("wb") as out:  # type: ignore[union-attr]
                    shutil.copyfileobj(source, out)
                dest = None
                files += 1
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        if dest is not None:
            dest.unlink(missing_ok=True)  # the file it broke in: incomplete
        how = "cut short" if _cut_short(exc) else "damaged"
        if not files:
            return Unpacked(None, [*notes, f"cannot read: {how} before its first file ({exc})"])
        notes.append(f"cannot read past its first {files} file(s): {how} ({exc}); those are read")
    return Unpacked(target, notes)


def _cut_short(exc: BaseException) -> bool:
    """The archive ends early (as opposed to bytes that are wrong)."""
    return isinstance(exc, EOFError) or "unexpected end" in str(exc)


def _refusal(member: tarfile.TarInfo, root: Path) -> str | None:
    """Why ``member`` is not unpacked into ``root``; None when it is a file or folder inside it."""
    if not (member.isfile() or member.isdir()):
        return "not a regular file or folder"
    if PurePosixPath(member.name).is_absolute() or not (root / member.name).resolve().is_relative_to(root):
        return "outside the folder it is unpacked into"
    return None
