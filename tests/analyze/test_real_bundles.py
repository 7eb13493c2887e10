"""The offline verdict on real bundles that the live sidecar wrote on a GPU machine."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

from conftest import shared

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.hang.verdicts import Verdict

FSDP2_SKIP = shared(
    "bundles", "nccl-2.28.9-h100x1", "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz"
)


def _dumped_call(bundle: Path, rank: int, seq_id: int) -> tuple[str, str, int]:
    """(innermost frame's name, job file, line) of the collective ``seq_id`` as the rank's own dump recorded it."""
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/fr/nccl_trace_rank_{rank}"))
        dump = pickle.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    entry = next(e for e in dump["entries"] if e["collective_seq_id"] == seq_id and not e["is_p2p"])
    job = next(f for f in entry["frames"] if f["filename"].endswith("fsdp_job.py"))
    return entry["frames"][0]["name"], job["filename"], job["line"]


def test_fsdp2_skip_on_nccl_gives_each_sides_call_site_from_the_dumps() -> None:
    report = analyze_paths([str(FSDP2_SKIP)])
    assert (report.verdict, report.culprit_ranks) == (Verdict.collective_mismatch, [1])
    assert report.position is not None
    calls = {rank: _dumped_call(FSDP2_SKIP, rank, report.position) for rank in (0, 1)}
    assert calls[0][2] != calls[1][2]  # the logging all_reduce and the next step's forward
    sites = {row.rank: row.call_site for row in report.ranks}
    for rank, (innermost, path, line) in calls.items():
        site = sites[rank]
        assert site and site.startswith(f"{innermost} (") and site.endswith(f"<- main ({path}:{line})"), (rank, site)
    assert report.headline
    assert f"issued from fsdp_job.py:{calls[1][2]} in main()" in report.headline
    assert f"its peers issued theirs from fsdp_job.py:{calls[0][2]} in main()" in report.headline
