"""The performance looks across nodes: each node sets ``perf/<n>`` after its look, the leader reads the others'.

Looks are aligned to the same wall-clock grid on every node (``PerfWatch``),
so the leader waits for each answering node's record of the same round (up
to ``PERF_WAIT_S``; the look runs beside the ticks, so this never delays hang
detection) and takes an older one of at most two intervals; the records are
``perf_records``'.

Failure mode: every store call raises ``StoreError``; a record that does not
validate is logged and left out.
"""

from __future__ import annotations

import logging

from ncclwatch.watchdog.cluster.peers import Cluster, parse_model
from ncclwatch.watchdog.cluster.perf_records import PerfRecord

log = logging.getLogger("ncclwatch")

# How long the leader's performance look waits for the other nodes' records of the same round; the look runs
# beside the ticks, so this never delays hang detection.  The others look at the same moment.
PERF_WAIT_S = 3.0


class PerfSharing:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._left_out: set[int] = set()

    async def exchange(self, record: PerfRecord, interval: float) -> dict[int, PerfRecord] | None:
        """Publish this node's performance record; the other nodes' when this node leads, else None."""
        cluster = self.cluster
        await cluster.client.set(cluster.key("perf", cluster.me), record.model_dump_json().encode())
        return await self.gather(record.at, interval) if cluster.leads() else None

    async def gather(self, look_at: float, interval: float) -> dict[int, PerfRecord]:
        """The other nodes' performance records for the leader's look at ``look_at``.

        Each answering node's record of this round (newer than half an interval ago) is waited for, up to
        PERF_WAIT_S; a node that did not publish this round gives its latest if it is at most two intervals old.
        Older or none: left out, said once.
        """

        def parse(node: int, raw: bytes) -> tuple[float, PerfRecord] | None:
            record = parse_model(PerfRecord, raw)
            if record is None:
                log.warning("node %s published a performance record that does not validate; ignored", node)
            return (record.at, record) if record is not None else None

        cluster = self.cluster
        found = await cluster.gather_keys("perf", cluster.answering(), look_at - interval / 2, PERF_WAIT_S, parse)
        others = {n for n in range(cluster.membership.nnodes) if n != cluster.me}
        found |= await cluster.gather_keys("perf", others - set(found), look_at - 2 * interval, 0.0, parse)
        left_out = others - set(found)
        if newly := sorted(left_out - self._left_out):
            log.warning(
                "performance look: node(s) %s published no record in two intervals: the job-wide view "
                "leaves their ranks out",
                ", ".join(map(str, newly)),
            )
        self._left_out = left_out
        return found
