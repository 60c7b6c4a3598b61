"""A worker process around the model-less engine whose steps take `--step-delay`
seconds (`helpers.slow_null_engine`), run and reported as `inflight worker` runs: `python -m tests.integration.null_worker --config C
--step-delay 0.02`. Used by the fault tests that kill, stop and resume whole worker
processes without paying for a model per process."""

from __future__ import annotations

import argparse
import sys

from tests.integration.helpers import slow_null_engine
from worker.cli.commands import run_reported
from worker.config import load_config
from worker.obs.log import setup_logging
from worker.serve.worker import Worker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--step-delay", type=float, required=True)
    a = p.parse_args()
    cfg = load_config(a.config)
    setup_logging(cfg.worker.log_level, transient_grace_s=cfg.kafka.transient_grace_s)
    engine = slow_null_engine(a.step_delay, max_running_requests=cfg.serving_tuning.max_running_requests)
    sys.exit(run_reported(Worker(cfg, engine=engine).run(), bad_input="config error", kafka=cfg.kafka,
                          redis=cfg.redis, log_errors=True))  # as `inflight worker`: one line, an exit code


if __name__ == "__main__":
    main()
