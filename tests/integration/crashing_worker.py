"""A worker process whose forward kills the process (as a segfaulting kernel would) when a
batch holds a given token: `python -m tests.integration.crashing_worker --config C
--crash-token N`. Used by test_worker_faults to prove the poison-job rule."""

from __future__ import annotations

import argparse
import asyncio
import os

from worker.config import load_config
from worker.engine import Engine
from worker.obs.log import setup_logging
from worker.serve.worker import Worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--crash-token", type=int, required=True)
    a = p.parse_args()
    setup_logging("INFO")
    cfg = load_config(a.config)
    engine = Engine.from_pretrained(cfg.model.path, cfg.engine)
    execute = engine.runner.execute

    def crashing(sched):
        if any(a.crash_token in s.token_ids for s in sched.scheduled):
            os._exit(70)
        return execute(sched)

    engine.runner.execute = crashing
    asyncio.run(Worker(cfg, engine=engine).run())


if __name__ == "__main__":
    main()
