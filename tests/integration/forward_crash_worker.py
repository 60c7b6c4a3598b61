"""A worker process of a pool that kills itself (SIGKILL) right after a forward to another
pool was acknowledged, before its claim is given back and its offset committed:
`python -m tests.integration.forward_crash_worker --config C`. Used by test_pools to show
that a forward is idempotent (nothing lost, nothing run twice)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from tests.integration.test_pools import pool_engine
from worker.config import load_config
from worker.obs.log import setup_logging
from worker.serve.pool_router import PoolRouter
from worker.serve.worker import Worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    a = p.parse_args()
    cfg = load_config(a.config)
    setup_logging("INFO")
    send = PoolRouter.send

    async def send_then_die(self, held, target):
        topic = await send(self, held, target)
        os.kill(os.getpid(), signal.SIGKILL)
        return topic

    PoolRouter.send = send_then_die
    asyncio.run(Worker(cfg, engine=pool_engine(cfg)).run())


if __name__ == "__main__":
    main()
