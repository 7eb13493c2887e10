"""The real demo's bundle cites its own files: every citation in report.json and report.md names a path inside
the bundle (the sidecar's run folder, where the dumps were read, is gone when the demo ends)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

CITE = re.compile(r"(?P<path>[^: ]+)(?::\d+)?(?: entries\[\d+\])?$")


def test_every_citation_of_the_demos_bundle_is_a_file_inside_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "demo", "--bundle-dir", str(tmp_path / "bundles")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    [bundle] = (tmp_path / "bundles").glob("*.tar.gz")
    with tarfile.open(bundle) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    report = json.loads(members["report.json"])
    cites = [item["cite"] for item in report["evidence"] if item["cite"]]
    assert any(cite.startswith("fr/") for cite in cites), cites  # the demo's verdict rests on its dumps
    for cite in cites:
        found = CITE.match(cite)
        assert found and found["path"] in members, (cite, sorted(members))
    assert "ncclwatch-" not in members["report.md"].decode().split("## Files in this bundle")[0]
