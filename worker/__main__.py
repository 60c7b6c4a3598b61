"""`inflight` command line.

    inflight worker --config worker.yaml           run a worker (Kafka jobs in, Redis streams out)
    inflight gateway --config gateway.yaml         OpenAI-compatible HTTP gateway (and Batch API) in front of them
    inflight check --config worker.yaml            preflight: Kafka, topics, group, Redis, model, KV, port
    inflight submit --prompt "Hi" --priority high --stream
    inflight stream JOB_ID
    inflight cancel JOB_ID
    inflight jobs audit --since 1h                  every job of a window: one outcome each, logs whole (exit 1: a defect)
    inflight job show JOB_ID                        one job: where produced, its log, outcome, dead letters
    inflight topics create
    inflight schema                                 JSON Schema of jobs, cancels and events
    inflight acl kafka | acl redis worker | acl redis gateway | acl redis reader --tenant T    the ACLs a deployment needs
    inflight generate --model PATH --prompt "Hi"   the engine alone, in this process
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from worker.cli.commands import client_command, client_routing, client_sections, run_reported
from worker.cli.parser import DEFAULT_KAFKA, build_parser


def _generate(a: argparse.Namespace) -> int:
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig
    from worker.engine import Engine, RequestRejected

    engine = Engine.from_pretrained(a.model, EngineConfig(model=ModelConfig(device=a.device)))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                            stop=a.stop or [])
    try:
        for i, prompt in enumerate(a.prompt):
            engine.add_request(f"cli-{i}", prompt, params=params, priority=a.priority)
    except RequestRejected as e:
        print(f"rejected: {e}", file=sys.stderr)
        return 2
    single = len(a.prompt) == 1
    while engine.has_unfinished():
        for out in engine.step():
            if single:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                tail = f"[{out.request_id}: {out.finish_reason}, {out.usage.completion_tokens} tokens]"
                print(("\n" if single else "") + tail, file=sys.stderr)
    return 0


def with_log_level(cfg, flag: str | None):
    """`cfg` (a WorkerConfig) with `--log-level` (`flag`, when given) as its
    `worker.log_level`: one level for the worker's process and its engine core's, the
    command line's over the file's."""
    if flag is None:
        return cfg
    import msgspec

    return msgspec.structs.replace(cfg, worker=msgspec.structs.replace(cfg.worker, log_level=flag))


def _worker(a: argparse.Namespace) -> int:
    from worker.config import load_config
    from worker.obs.log import setup_logging
    from worker.serve.worker import Worker

    cfg = with_log_level(load_config(a.config), a.log_level)
    setup_logging(cfg.worker.log_level, transient_grace_s=cfg.kafka.transient_grace_s)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars among the JSON log lines
    if not cfg.model.path:
        print("config error: model.path is required (or INFLIGHT_MODEL__PATH)", file=sys.stderr)
        return 2
    # model path, device or checkpoint format (FileNotFoundError / ValueError) are config errors
    code = run_reported(Worker(cfg).run(), bad_input="config error", kafka=cfg.kafka, redis=cfg.redis,
                        log_errors=True)
    from worker.obs.exits import exit_now

    exit_now(code)  # every component is closed: the exit is not held by the interpreter's teardown


def _gateway(a: argparse.Namespace) -> int:
    """The HTTP gateway (worker.gateway): no model, no torch."""
    from worker.gateway.app import Gateway
    from worker.gateway.config import load_gateway_config
    from worker.obs.log import setup_logging

    cfg = load_gateway_config(a.config)
    setup_logging(a.log_level, transient_grace_s=cfg.kafka.transient_grace_s)
    return run_reported(Gateway(cfg).run(), bad_input="config error", kafka=cfg.kafka, redis=cfg.redis,
                        log_errors=True)


def _check(a: argparse.Namespace) -> int:
    """Preflight (worker.cli.preflight): one line per check on stdout, exit 0 only if none failed."""
    import logging

    from worker.cli.preflight import exit_code, render, run_preflight
    from worker.config import load_config
    from worker.obs.log import setup_logging

    cfg = load_config(a.config)
    setup_logging("ERROR")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # each failure is reported in its check's line
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    checks = run_preflight(cfg, timeout_s=a.timeout)
    if a.json:
        import msgspec

        print(msgspec.json.encode(checks).decode())
    else:
        print(render(checks))
    return exit_code(checks)


def _env_sets(section: str) -> bool:
    """Any INFLIGHT_<SECTION>__* variable set (they configure clients without a file)."""
    return any(k.startswith(f"INFLIGHT_{section}__") for k in os.environ)


def _load_section(path: str | None, section: str):
    """The `kafka` or `redis` section of a config file (+ env overrides), or its pools
    (`pool_set`). Raises ConfigError."""
    from worker.config import load_config

    return getattr(load_config(path), section)


def _acl(a: argparse.Namespace) -> int:
    import shlex

    from worker.security import acl

    if a.system == "kafka":
        prefix, group, pools = a.prefix, a.group, None
        if a.config:  # prefix, group and pools of a worker config file
            from worker.config import load_config

            cfg = load_config(a.config)
            prefix, group, pools = cfg.kafka.topic_prefix, cfg.kafka.group_id, cfg.pool_set
        for row in acl.kafka_acls(prefix, group, worker=a.worker_principal, producer=a.producer_principal,
                                  producer_reads_results=not a.no_results_read, pools=pools):
            print(shlex.join(row.acl_command_args()))
        return 0
    if a.role is None:
        print("error: acl redis needs a role: worker, gateway or reader", file=sys.stderr)
        return 2
    try:
        if a.role == "worker":
            rules = acl.redis_worker_rules(a.prefix)
        elif a.role == "gateway":
            rules = acl.redis_gateway_rules(a.prefix)
        else:
            rules = acl.redis_reader_rules(a.tenant, a.prefix, may_cancel=a.may_cancel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(rules))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from worker.config import ConfigError
    from worker.model.capability import UnsupportedModel

    try:
        return _dispatch(a)
    except ConfigError as e:  # every command: a bad config is one line naming the field, exit 2
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except UnsupportedModel as e:  # a model the engine cannot reproduce: refused at load, one line
        print(f"config error: {e}", file=sys.stderr)
        return 2


def _dispatch(a: argparse.Namespace) -> int:
    if a.cmd == "generate":
        return _generate(a)
    if a.cmd == "worker":
        return _worker(a)
    if a.cmd == "gateway":
        return _gateway(a)
    if a.cmd == "check":
        return _check(a)
    if a.cmd in ("submit", "stream", "cancel", "topics", "dlq", "jobs", "job"):
        import logging

        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # a refusal is explained in one line instead
    if a.cmd in ("submit", "stream", "cancel"):
        kafka, redis = client_sections(a)
        pools, tokenizer = client_routing(a) if a.cmd == "submit" else (None, None)
        # bad input: job id, tenant, sampling values
        return run_reported(client_command(a, kafka, redis, pools, tokenizer), bad_input="error", kafka=kafka,
                            redis=redis)
    if a.cmd in ("jobs", "job"):
        from worker.cli.commands import jobs_command

        kafka, redis = client_sections(a)
        return run_reported(jobs_command(a, kafka, redis), bad_input="error", kafka=kafka, redis=redis)
    if a.cmd == "dlq":
        from worker.cli.commands import dlq_command

        kafka, redis = client_sections(a)
        return run_reported(dlq_command(a, kafka), bad_input="error", kafka=kafka)
    if a.cmd == "topics":
        from worker.cli.topics import create_topics

        kafka = _load_section(a.config, "kafka") if (a.config or _env_sets("KAFKA")) else None
        pools = _load_section(a.config, "pool_set") if a.config else None
        bootstrap = a.bootstrap or (kafka.bootstrap_servers if kafka is not None else DEFAULT_KAFKA)
        prefix = a.prefix or (kafka.topic_prefix if kafka is not None else "inflight")
        created: list[str] = []

        async def create() -> None:
            created.extend(await create_topics(bootstrap, prefix, a.partitions, a.replication_factor, kafka=kafka,
                                               pools=pools))

        try:
            code = run_reported(create(), bad_input="config error", kafka=kafka)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if code:
            return code
        if not a.quiet or created:
            print(f"created: {', '.join(created) or 'nothing (all exist)'}")
        return 0
    if a.cmd == "acl":
        return _acl(a)
    if a.cmd == "schema":
        from schemas.codec import json_schemas

        print(json.dumps(json_schemas(), indent=2))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
