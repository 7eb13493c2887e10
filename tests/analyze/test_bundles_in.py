"""``ncclwatch analyze`` given a bundle: unpacked safely, a broken one said, never an exception."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from ncclwatch.watchdog.bundles_in import unpack_bundle


def tarball(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """Regular files ``members``, and symbolic links ``links`` (name -> where it points)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, pointed in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, pointed
            tar.addfile(info)
    return path


def test_a_bundle_is_read_as_the_folder_it_holds(tmp_path: Path) -> None:
    bundle = tarball(tmp_path / "job-node1-x.tar.gz", {"job-node1-x/journal.jsonl": b'{"ncclwatch_journal": 1}\n'})
    unpacked = unpack_bundle(str(bundle), tmp_path / "out")
    assert unpacked.notes == [] and unpacked.folder == tmp_path / "out"
    assert (tmp_path / "out" / "job-node1-x" / "journal.jsonl").is_file()


def test_escaping_members_are_refused_and_a_broken_tarball_is_said(tmp_path: Path) -> None:
    bundle = tarball(tmp_path / "evil.tar.gz", {"../outside.txt": b"x", "ok/inside.txt": b"y"})
    (tmp_path / "broken.tgz").write_bytes(b"not gzip")
    evil, broken = (
        unpack_bundle(str(bundle), tmp_path / "out"),
        unpack_bundle(str(tmp_path / "broken.tgz"), tmp_path / "b"),
    )
    assert not (tmp_path / "outside.txt").exists() and (tmp_path / "out" / "ok" / "inside.txt").is_file()
    assert len(evil.notes) == 1 and "refused" in evil.notes[0]
    assert (broken.folder, broken.plain, len(broken.notes)) == (None, True, 1) and broken.notes[0].startswith(
        "not unpacked"
    )


def test_absolute_names_and_links_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "victim.txt"
    bundle = tarball(
        tmp_path / "evil.tar.gz", {str(outside): b"x", "ok/inside.txt": b"y"}, links={"ok/link": "/etc/passwd"}
    )
    unpacked = unpack_bundle(str(bundle), tmp_path / "out")
    assert not outside.exists() and not (tmp_path / "out" / "ok" / "link").exists()
    assert (tmp_path / "out" / "ok" / "inside.txt").read_bytes() == b"y"
    assert unpacked.notes == [
        f"member {str(outside)!r} refused (outside the folder it is unpacked into)",
        "member 'ok/link' refused (not a regular file or folder)",
    ]
