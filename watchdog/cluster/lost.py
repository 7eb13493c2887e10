"""Lost nodes: which sidecars stopped answering, and without the store which node pages.

With the store, a node whose summary has not changed for ``LOST_AFTER_S``
(by the leader's clock, ``Cluster.answering``) is lost: the leader waits for
the evidence of the others and names the lost ones (``judge.with_lost_nodes``).
Without the store each sidecar asks lifelines (``lifeline``): the store's
node is lost when its lifeline does not answer, and the first node of the
last view's ``pager_order`` that answers pages.

Failure mode: a lifeline that does not answer is a lost node; nothing here
raises ``StoreError`` (no store call).
"""

from __future__ import annotations

from ncclwatch.watchdog.cluster.lifeline import ask
from ncclwatch.watchdog.cluster.peers import Cluster
from ncclwatch.watchdog.cluster.view import Contact, pager_order


class LostNodes:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def lost(self) -> dict[int, Contact]:
        """Nodes whose sidecar stopped publishing (``at`` None: never published this round).

        The leader's view was composed at its last read of the summaries; a node silent since is lost now, by the
        clock ``answering`` reads, so that every node is one or the other (CI, a frozen node: the leader judged
        between the two, waited for nobody, named nobody lost, and paged ``stuck_in_collective`` without a
        culprit)."""
        cluster = self.cluster
        lost = {c.node: c for c in cluster.view.lost} if cluster.view is not None else {}
        if cluster.leads():
            for node in sorted(set(cluster.changed_at) - cluster.answering()):
                summary = cluster.summaries.get(node)
                if summary is not None and summary.phase != "ended":
                    lost.setdefault(node, summary.contact())
        return lost

    async def store_node_lost(self) -> Contact | None:
        """The node serving the store, when the store is gone and that node's lifeline does not answer."""
        view = self.cluster.view
        store = view.store if view is not None else None
        if store is None or store.node == self.cluster.me or store.lifeline is None:
            return None
        return store if await ask(store.lifeline) is None else None

    async def pages_alone(self, lost: set[int]) -> bool:
        """Without the store: does this node page?  The first node of ``pager_order`` that answers does; if
        none of them answers (all lost at once), every survivor does, under one dedup key."""
        for contact in pager_order(self.cluster.view, self.cluster.me, lost):
            if contact.node == self.cluster.me:
                return True
            if contact.lifeline is not None and await ask(contact.lifeline) is not None:
                return False
        return True
