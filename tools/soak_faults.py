"""The cluster soak's nemesis (`python -m tools.soak --cluster`): the faults of a replicated
Kafka and a Redis behind Sentinel (tools/stack/cluster_stack.py), each run to its end
(the node back, the replicas in sync) before the next:

  leader_kill        kill -9 of the broker leading the most job partitions, back after 15 s
  coordinator_kill   kill -9 of the workers' group coordinator, back after 15 s
  controller_kill    kill -9 of the active KRaft controller (the quorum's leader), back after 15 s
  rolling_restart    each node in turn: SIGTERM, start, wait until its replicas are in sync
  broker_pause       SIGSTOP of a random broker for 15 s (past its 6 s broker session)
  sentinel_failover  kill -9 of the Redis master: Sentinel promotes the replica (which may
                     lack the last writes); the old master comes back empty as a replica
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

from schemas import keys
from tools.stack.cluster_stack import NODES, ClusterStack

CLUSTER_FAULTS = ("leader_kill", "coordinator_kill", "controller_kill", "rolling_restart", "broker_pause",
                  "sentinel_failover")
DOWN_S = 15.0


class ClusterNemesis:
    """Runs one cluster fault at a time against `stack`; each returns what it did (a dict
    for the soak's report: node, seconds, and `window` (start, end) in monotonic time)."""

    def __init__(self, stack: ClusterStack, prefix: str, group_id: str, rng: random.Random) -> None:
        self.stack, self.rng = stack, rng
        self.group_id = group_id
        self.job_topics = keys.job_topics(prefix)

    async def run(self, fault: str) -> dict:
        t0 = time.monotonic()
        info = await getattr(self, fault)()
        info["window"] = (t0, time.monotonic())
        return info

    async def _kill_and_return(self, node: str) -> dict:
        await asyncio.to_thread(self.stack.kill, node)
        await asyncio.sleep(DOWN_S)
        await asyncio.to_thread(self.stack.up)
        return {"node": node, "down_s": DOWN_S}

    async def leader_kill(self) -> dict:
        counts = await self.stack.leaders(self.job_topics)
        node_id = max(counts, key=counts.get)
        return {**await self._kill_and_return(self.stack.node_name(node_id)), "led": counts[node_id]}

    async def coordinator_kill(self) -> dict:
        node_id = await self.stack.coordinator(self.group_id)
        return await self._kill_and_return(self.stack.node_name(node_id))

    async def controller_kill(self) -> dict:
        node_id = await asyncio.to_thread(self.stack.controller)
        return await self._kill_and_return(self.stack.node_name(node_id))

    async def rolling_restart(self) -> dict:
        for node in NODES:
            await asyncio.to_thread(self.stack.stop, node)
            await asyncio.to_thread(self.stack.up)
            await self.stack.wait_in_sync(self.job_topics)
        return {"nodes": list(NODES)}

    async def broker_pause(self) -> dict:
        node = self.rng.choice(NODES)
        self.stack.signal(node, signal.SIGSTOP)
        try:
            await asyncio.sleep(DOWN_S)
        finally:
            self.stack.signal(node, signal.SIGCONT)
        return {"node": node, "paused_s": DOWN_S}

    async def sentinel_failover(self) -> dict:
        old = await asyncio.to_thread(self.stack.redis_master)
        await asyncio.to_thread(self.stack.kill, old)
        t = time.monotonic()
        new = await asyncio.to_thread(self.stack.wait_failover, old)
        took = time.monotonic() - t
        await asyncio.sleep(5)
        await asyncio.to_thread(self.stack.up)  # the old master, empty: Sentinel makes it a replica
        return {"killed": old, "promoted": new, "failover_s": round(took, 1)}
