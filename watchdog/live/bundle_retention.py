"""How many bundles a node keeps: restarts and repeated hangs each leave one, and nothing else removes them.

After each bundle is written, the bundles in ``--bundle-dir`` beyond
``bundles_kept`` or ``bundles_max_mib`` go, oldest first (by modification
time: a bundle is written once and amended only moments after).  The one
just written is never removed, even alone over the byte cap, nor is any
file that is not a finished bundle of ours (``*.tar.gz``; staging folders
and ``.partial`` packs start with a dot; the spool lives in ``.spool``).

Failure mode: a bundle that cannot be deleted (permissions, a shared
folder) is skipped and the next is tried; nothing here raises.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("ncclwatch")

MIB = 1 << 20


def prune_bundles(bundle_dir: Path, keep_count: int, max_bytes: int, written: Path) -> list[Path]:
    """Delete the oldest bundles beyond ``keep_count`` or ``max_bytes``, never ``written``; the paths deleted."""
    try:
        found = [
            (entry.stat().st_mtime, entry.stat().st_blocks * 512, Path(entry.path))
            for entry in os.scandir(bundle_dir)
            if entry.is_file() and entry.name.endswith(".tar.gz") and not entry.name.startswith(".")
        ]
    except OSError as exc:
        log.warning("ncclwatch: bundles in %s not counted (%s): none deleted", bundle_dir, exc.strerror)
        return []
    found.sort(key=lambda item: (item[2] != written, -item[0]))  # the one just written, then newest first
    kept_count, kept_bytes = 0, 0
    deleted = []
    for _, size, path in found:
        if path == written or (kept_count < keep_count and kept_bytes + size <= max_bytes):
            kept_count += 1
            kept_bytes += size
            continue
        try:
            path.unlink()
        except OSError as exc:
            log.warning("ncclwatch: old bundle %s not deleted (%s)", path, exc.strerror)
            continue
        deleted.append(path)
    if deleted:
        log.warning(
            "ncclwatch: deleted %d old bundle(s) in %s (--bundles-kept %d, --bundles-max-mib %d)",
            len(deleted),
            bundle_dir,
            keep_count,
            max_bytes // MIB,
        )
    return deleted
