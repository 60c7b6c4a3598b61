"""The replicated stack of tools/stack/cluster.sh (three KRaft nodes, a Redis master with a
replica behind three Sentinels) on free ports and its own state, with the faults a
production cluster has: a node killed (-9) or stopped (SIGTERM, a rolling restart), a
broker paused past its session (SIGSTOP), the Redis master killed so Sentinel fails over.
Used by the cluster soak (`python -m tools.soak --cluster`) and tests/cluster."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tools.stack.own_stack import ROOT, free_port

SCRIPT = ROOT / "tools" / "stack" / "cluster.sh"
SERVICE = "inflight"
NODES = ("kafka0", "kafka1", "kafka2")


class ClusterStack:
    """tools/stack/cluster.sh on free ports: brokers K..K+2 (node ids 1..3), controllers
    K+3..K+5; Redis master R, replica R+1, Sentinels R+2..R+4; state under `state`."""

    def __init__(self, state: Path, partitions: int = 6) -> None:
        self.kafka_port, self.redis_port, self.state = free_port(count=6), free_port(count=5), state
        self.env = {**os.environ, "INFLIGHT_CLUSTER_KAFKA_PORT": str(self.kafka_port),
                    "INFLIGHT_CLUSTER_REDIS_PORT": str(self.redis_port), "INFLIGHT_CLUSTER_STATE": str(state),
                    "INFLIGHT_CLUSTER_PARTITIONS": str(partitions)}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.kafka_port + i}" for i in range(3))

    @property
    def redis_url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{self.redis_port + 2 + i}" for i in range(3))
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def up(self) -> None:
        """Start whatever is not running (a killed node comes back with its data: Kafka
        recovers its log; Redis comes back empty and Sentinel makes it a replica)."""
        subprocess.run([str(SCRIPT), "up"], env=self.env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)

    def down(self) -> None:
        for name in self._names():  # a paused process cannot be stopped
            self.signal(name, signal.SIGCONT)
        subprocess.run([str(SCRIPT), "down"], env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def _names(self) -> list[str]:
        return [*NODES, "redis-master", "redis-replica", "sentinel0", "sentinel1", "sentinel2"]

    def pid(self, name: str) -> int | None:
        """The pid of a node ("kafka0".."kafka2", "redis-master", "redis-replica",
        "sentinel0".."sentinel2"); None when it is not running."""
        try:
            pid = int((self.state / f"{name}.pid").read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def signal(self, name: str, sig: int) -> bool:
        pid = self.pid(name)
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, name: str) -> None:
        """kill -9 `name` and wait until it is gone."""
        pid = self.pid(name)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10)

    def stop(self, name: str, timeout_s: float = 60) -> None:
        """SIGTERM `name` (a controlled shutdown: a broker moves its leaderships first) and
        wait until it is gone (SIGKILL after `timeout_s`)."""
        pid = self.pid(name)
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout_s):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10)

    # ---- who leads what ----------------------------------------------------------------
    def node_name(self, node_id: int) -> str:
        return NODES[node_id - 1]

    async def leaders(self, topics: list[str]) -> dict[int, int]:
        """Per broker node id, how many partitions of `topics` it leads."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            counts: dict[int, int] = {}
            for t in await admin.describe_topics(topics):
                for p in t["partitions"]:
                    if p["leader"] >= 0:
                        counts[p["leader"]] = counts.get(p["leader"], 0) + 1
            return counts
        finally:
            await admin.close()

    async def coordinator(self, group_id: str) -> int:
        """The node id of `group_id`'s group coordinator."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            return await admin.find_coordinator(group_id)
        finally:
            await admin.close()

    def controller(self) -> int:
        """The node id of the active KRaft controller (the metadata quorum's leader, from
        Kafka's own MetadataQuorumCommand: clients' metadata does not name it)."""
        live = [i for i, n in enumerate(NODES) if self.pid(n) is not None]
        out = subprocess.run(
            ["java", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-cp", str(ROOT / ".cache/kafka/libs/*"),
             "org.apache.kafka.tools.MetadataQuorumCommand", "--bootstrap-server",
             f"127.0.0.1:{self.kafka_port + live[0]}", "describe", "--status"],
            capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"LeaderId:\s+(\d+)", out)
        if m is None:
            raise RuntimeError(f"no quorum leader in {out[-300:]!r}")
        return int(m.group(1))

    def redis_cli(self, node: str, *args: str) -> str:
        """Run a command on a Redis node ("redis-master", "redis-replica", "sentinel0".."2")."""
        port = {"redis-master": 0, "redis-replica": 1}.get(node)
        port = self.redis_port + (port if port is not None else 2 + int(node[-1]))
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                              timeout=10).stdout

    def redis_master(self) -> str:
        """"redis-master" or "redis-replica": the node the Sentinels name master now."""
        for i in range(3):
            out = subprocess.run(["redis-cli", "-p", str(self.redis_port + 2 + i), "SENTINEL",
                                  "get-master-addr-by-name", SERVICE], capture_output=True, text=True, timeout=10)
            lines = out.stdout.split()
            if len(lines) == 2 and lines[1].isdigit():
                return "redis-master" if int(lines[1]) == self.redis_port else "redis-replica"
        raise RuntimeError("no Sentinel answered")

    def wait_failover(self, old: str, timeout_s: float = 60) -> str:
        """Wait until the Sentinels name another master than `old`; returns it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                now = self.redis_master()
                if now != old:
                    return now
            except RuntimeError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no failover from {old} within {timeout_s} s")

    async def wait_in_sync(self, topics: list[str], timeout_s: float = 120) -> None:
        """Wait until every partition of `topics` has all three replicas in sync (after a
        node came back), as a rolling restart does before the next node."""
        from aiokafka.admin import AIOKafkaAdminClient

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            try:
                await admin.start()
                described = await admin.describe_topics(topics)
                if all(len(p["isr"]) == 3 for t in described for p in t["partitions"]):
                    return
            except Exception:  # a node still starting: ask again
                pass
            finally:
                await admin.close()
            await asyncio.sleep(1)
        raise TimeoutError(f"replicas of {topics} not in sync within {timeout_s} s")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
