"""A Kafka broker and a Redis server of tools/stack/devstack.sh on free ports and their own
state (never the shared dev stack), for code that stops and starts them as processes:
the outage tests (tests/integration/test_kafka_outages.py) and the soak (tools/soak.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair: bool = False, count: int = 1) -> int:
    """A free TCP port on 127.0.0.1 for a server a test starts (with `pair`, the next one
    is free too: Kafka's controller; with `count`, that many in a row). Drawn below the kernel's ephemeral range
    (`ip_local_port_range`, 32768+ here), so no outgoing connection of another client can
    hold it by the time the server binds (a port 0 pick, or a connect check of the next
    port, cannot see those: a Kafka controller once failed with "Address already in use"),
    and checked by binding."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError):
        low = 32768
    for _ in range(1000):
        port = random.randrange(20000, max(low - 2, 20002))
        if all(_bindable(port + i) for i in range(max(count, 2 if pair else 1))):
            return port
    raise RuntimeError("no free port below the ephemeral range")


class OwnStack:
    """Kafka + Redis of tools/stack/devstack.sh on free ports, state (pid files, logs, Kafka's
    data) under `state`."""

    def __init__(self, state: Path) -> None:
        self.kafka_port, self.redis_port, self.state = free_port(pair=True), free_port(), state
        self.env = {**os.environ, "INFLIGHT_DEV_KAFKA_PORT": str(self.kafka_port),
                    "INFLIGHT_DEV_REDIS_PORT": str(self.redis_port), "INFLIGHT_DEV_STATE": str(state)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def up(self) -> None:
        """Start whatever is not running; returns when both answer."""
        subprocess.run([str(ROOT / "tools" / "stack" / "devstack.sh"), "up"], env=self.env, cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)

    def down(self) -> None:
        subprocess.run([str(ROOT / "tools" / "stack" / "devstack.sh"), "down"], env=self.env, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pid(self, name: str) -> int:
        """The pid of "kafka" or "redis"."""
        return int((self.state / f"{name}.pid").read_text())

    def stop_kafka(self) -> None:
        """Stop the broker process (SIGTERM, as a rolling restart or a crash-looping node;
        SIGKILL after 30 s)."""
        pid = self.pid("kafka")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)

    def redis_cli(self, *args: str) -> None:
        subprocess.run(["redis-cli", "-p", str(self.redis_port), *args], capture_output=True, timeout=30)

    def restart_redis_empty(self) -> None:
        """Redis restarts and loses its data (the dev stack's Redis keeps none)."""
        self.redis_cli("SHUTDOWN", "NOSAVE")
        self.up()
