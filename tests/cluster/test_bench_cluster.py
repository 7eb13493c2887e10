"""bench/cluster.py's hang path in small: 4 simulated nodes of 8 ranks against a real TCPStore (its own process)."""

from __future__ import annotations

import pytest
from conftest import REPO


def test_the_leader_names_the_rank_behind_every_member_follows_and_the_keys_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import cluster as bench  # by this name: its simulator processes (spawned) import it too

    store = bench.Store()
    workers = bench.Workers(1, store.port, nnodes=4, ranks=8)
    try:
        hang = bench.hang(workers, store, nnodes=4, ranks=8, limit=30)
    finally:
        workers.close()
        store.stop()
    assert "timed_out_in" not in hang
    assert hang["verdict"] == "rank_behind" and hang["culprits"] == [31]  # the job's last rank, one collective behind
    assert hang["full_asked"] == [3] and hang["followed"] == 3 and hang["culprits_followed"] == [[31]]
    assert (
        hang["keys"] == {"watching": 5, "shared": 8, "followed": 6, "closed": 5, "restarted": 5} and hang["keys_flat"]
    )
