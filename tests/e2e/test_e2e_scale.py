"""Eight nodes on one machine, and the node that serves the store dying: one verdict, one page, the right culprit.

Eight real wrappers (``--nnodes 8 --node-rank 0..7``), one gloo rank each,
meet in torchrun's store on node 0 through the O(N) exchange: members read
one job view a round, the leader judges the job from every node's compact
evidence and the full evidence of the nodes that decide.  A skipped
collective on node 5, a frozen node, a healthy job; and node 0 SIGKILLed
whole (wrapper, torchrun with the store, its rank): the others lose the
store at once, their ranks fail or hang, and exactly one of them (the
lowest that answers its lifeline) pages ``node_lost`` naming node 0, as the
page counter at a loopback webhook shows.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_e2e_multinode import kill, reports, run_nodes

pytest.importorskip("torch")

NODES = 8
TIMEOUT_S = 240  # 53-65 s on a 2-core VM, idle or loaded; CI machines have been 2-3 times slower


def test_a_skip_on_node_5_of_8_is_one_page_naming_its_rank(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(run_nodes(tmp_path, "skip", 5, nnodes=NODES, per_node=1, timeout_s=TIMEOUT_S))
    assert len(triggers) == 1, (triggers, stderr[0][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == ("collective_mismatch", [5]), stderr[0][-3000:]
    for node in (0, 5, 7):  # every node's bundle carries the leader's verdict
        [report] = reports(tmp_path, node)
        assert (report["verdict"], report["culprit_ranks"]) == ("collective_mismatch", [5]), stderr[node][-3000:]
    assert codes == [3] * NODES, stderr


def test_a_frozen_node_of_8_is_node_lost(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(
        run_nodes(tmp_path, "none", 0, "--steps=4000", nnodes=NODES, per_node=1, act_on=6, timeout_s=TIMEOUT_S)
    )
    assert len(triggers) == 1, (triggers, stderr[0][-3000:])
    assert (triggers[0]["verdict"], triggers[0]["culprit_ranks"]) == ("node_lost", [6]), stderr[0][-3000:]
    assert codes == [3] * (NODES - 1), stderr


def test_the_store_node_killed_whole_is_one_page_from_one_survivor(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(
        run_nodes(
            tmp_path, "none", 0, "--steps=4000", nnodes=NODES, per_node=1, act_on=0, act=kill, timeout_s=TIMEOUT_S
        )
    )
    assert len(triggers) == 1, (triggers, [e[-1500:] for e in stderr[:2]])
    [page] = triggers
    assert (page["verdict"], page["culprit_ranks"]) == ("node_lost", [0]), stderr[0][-3000:]
    assert "does not answer" in stderr[0]  # node 1, the lowest survivor, said why it pages
    # Survivors whose ranks failed end with torchrun's status, those whose ranks hung are ended (3): none is clean.
    assert 0 not in codes, codes


def test_a_healthy_job_of_8_pages_nothing(tmp_path: Path) -> None:
    codes, stderr, triggers = asyncio.run(run_nodes(tmp_path, "none", 0, nnodes=NODES, per_node=1, timeout_s=TIMEOUT_S))
    assert triggers == [], stderr[0][-3000:]
    assert codes == [0] * NODES, stderr
