"""`inflight` command line.

    inflight worker --config worker.yaml           run a worker (Kafka jobs in, Redis streams out)
    inflight gateway --config gateway.yaml         OpenAI-compatible HTTP gateway (and Batch API) in front of them
    inflight check --config worker.yaml            preflight: Kafka, topics, group, Redis, model, KV, port
    inflight submit --prompt "Hi" --priority high --stream
    inflight stream JOB_ID
    inflight cancel JOB_ID
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

from worker.cli.commands import (
    STREAM_TIMEOUT_S,
    client_command,
    client_routing,
    client_sections,
    run_reported,
)

DEFAULT_KAFKA = "127.0.0.1:19092"  # also INFLIGHT_KAFKA__BOOTSTRAP_SERVERS, read by the config loader
DEFAULT_REDIS = "redis://127.0.0.1:6390/0"  # also INFLIGHT_REDIS__URL


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names every default, except where the help text already says it or
    there is none to name (unset, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


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


def _worker(a: argparse.Namespace) -> int:
    from worker.config import load_config
    from worker.obs.log import setup_logging
    from worker.serve.worker import Worker

    cfg = load_config(a.config)
    setup_logging(a.log_level, transient_grace_s=cfg.kafka.transient_grace_s)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars among the JSON log lines
    if not cfg.model.path:
        print("config error: model.path is required (or INFLIGHT_MODEL__PATH)", file=sys.stderr)
        return 2
    # model path, device or checkpoint format (FileNotFoundError / ValueError) are config errors
    return run_reported(Worker(cfg).run(), bad_input="config error", kafka=cfg.kafka, redis=cfg.redis,
                        log_errors=True)


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
    p = argparse.ArgumentParser(prog="inflight", description="Inflight LLM serving worker")
    sub = p.add_subparsers(dest="cmd", required=True)

    w = sub.add_parser("worker", help="run a worker")
    w.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    w.add_argument("--log-level", default="INFO")

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (chat / completions, streaming, "
                        "Batch API) in front of the job topics")
    gw.add_argument("--config", help="YAML file with `gateway`, `kafka` and `redis` sections; "
                    "INFLIGHT_<SECTION>__<FIELD> env vars override it")
    gw.add_argument("--log-level", default="INFO")

    ck = sub.add_parser("check", help="preflight a worker config: one line per check with the setting to fix; "
                        "exit 0 only if every check passes")
    ck.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    ck.add_argument("--timeout", type=float, default=10.0, help="seconds for each Kafka / Redis step")
    ck.add_argument("--json", action="store_true", help="print the checks as a JSON array")

    def client_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="YAML file whose `kafka` and `redis` sections give addresses, prefixes and "
                        "connection security (SASL, TLS, client certificates, Redis ACL user); INFLIGHT_KAFKA__* / "
                        "INFLIGHT_REDIS__* env vars override it. submit: its `pools` section and the tokenizer of "
                        "`model.path` route the job to the pool serving its prompt length")
        sp.add_argument("--kafka", default=None, help=f"bootstrap servers (default: the config's, else {DEFAULT_KAFKA})")
        sp.add_argument("--redis", default=None, help=f"Redis URL (default: the config's, else {DEFAULT_REDIS})")
        sp.add_argument("--prefix", default=None, help="topic and key prefix (default: the config's, else inflight)")
        sp.add_argument("--timeout", type=float, default=STREAM_TIMEOUT_S,
                        help="seconds to wait for the job's end (stream, submit --stream); on expiry: a hint, exit 1")

    defaults = ShowDefaults
    s = sub.add_parser("submit", formatter_class=defaults,
                       help="produce a job (prints its id; with --stream the id goes to stderr, the text to stdout)",
                       description="Produce a job. --max-tokens and --temperature default to a short greedy answer "
                       "for a terminal; a job without them (the wire schema) gets temperature 1.0 and up to the "
                       "worker's max_output_tokens.")
    client_args(s)
    s.add_argument("--prompt", required=True)
    s.add_argument("--priority", default="normal", choices=["high", "normal", "low"], help="the job's topic")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    s.add_argument("--job-id", default=None, help="the job's id (none: a random one)")
    s.add_argument("--tenant", default=None, help="the job's tenant: its stream goes to the tenant's Redis keys")
    s.add_argument("--adapter", default=None, help="a LoRA adapter of the workers' model.lora_dir (default: the base model)")
    s.add_argument("--stream", action="store_true", help="stream the tokens to stdout")
    fmt = s.add_argument_group("structured output (params.structured; at most one)").add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="SCHEMA", default=None,
                     help="the output is JSON valid against this JSON Schema (inline JSON, or @FILE)")
    fmt.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    fmt.add_argument("--regex", default=None, help="the whole output matches this regex")
    fmt.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat the flag)")
    fmt.add_argument("--grammar", metavar="LARK", default=None, help="a Lark grammar (inline, or @FILE)")
    st = sub.add_parser("stream", formatter_class=defaults, help="stream a job's events (replays what already happened; waits for a job "
                        "not seen yet, up to --timeout)")
    client_args(st)
    st.add_argument("job_id")
    st.add_argument("--tenant", default=None, help="the tenant the job was submitted with")
    c = sub.add_parser("cancel", formatter_class=defaults, help="cancel a job")
    client_args(c)
    c.add_argument("job_id")

    dlq = sub.add_parser("dlq", formatter_class=defaults, help="dead letters: list them by reason, replay chosen ones")
    dsub = dlq.add_subparsers(dest="dlq_cmd", required=True)
    for name, help_ in (("list", "show dead letters (one line each: where, when, reason, job id, source, error) and "
                                 "a count by reason"),
                        ("replay", "re-produce chosen dead letters to their job topics under new job ids "
                                   "(<job_id>.replay-<partition>-<offset>: replaying twice runs once)")):
        d = dsub.add_parser(name, formatter_class=defaults, help=help_, description=help_)
        client_args(d)
        d.add_argument("--reason", action="append", default=None, help="only this reason (repeat the flag)")
        d.add_argument("--job-id", action="append", default=None, help="only this job id (repeat the flag)")
        d.add_argument("--since", default=None, help="only records written since: seconds ago (600), a duration "
                       "(10m, 2h, 1d) or an ISO time")
        d.add_argument("--limit", type=int, default=None, help="at most this many (oldest first)")
        if name == "list":
            d.add_argument("--json", action="store_true", help="one JSON object per line")
        else:
            d.add_argument("--all", action="store_true", help="replay every record the filters select (without a "
                           "filter, --all is required)")
            d.add_argument("--force", action="store_true", help="also send records whose reason can never succeed "
                           "on the same input (invalid_job, invalid_params, ...)")
            d.add_argument("--dry-run", action="store_true", help="say what would be sent, send nothing")

    t = sub.add_parser("topics", formatter_class=defaults, help="manage topics")
    t.add_argument("action", choices=["create"])
    t.add_argument("--bootstrap", default=None, help=f"bootstrap servers (default: the config's, else {DEFAULT_KAFKA})")
    t.add_argument("--config", help="YAML file whose `kafka` section gives the connection security (a principal "
                   "allowed to create topics) and whose `pools` section the pools' job topics; INFLIGHT_KAFKA__* env "
                   "vars override it")
    t.add_argument("--prefix", default=None, help="topic prefix (default: the config's, else inflight)")
    t.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    t.add_argument("--replication-factor", type=int, default=1, help="replicas per partition")
    t.add_argument("--quiet", action="store_true")

    sub.add_parser("schema", help="print the JSON Schema of the wire messages")

    acl = sub.add_parser("acl", help="print the ACLs a deployment needs: Kafka's AclCommand (kafka-acls.sh) "
                         "arguments, one line per grant, or a Redis user's ACL rules")
    acl.add_argument("system", choices=["kafka", "redis"])
    acl.add_argument("role", nargs="?", choices=["worker", "gateway", "reader"], help="redis: whose rules")
    acl.add_argument("--prefix", default="inflight", help="topic prefix (kafka) or key prefix (redis)")
    acl.add_argument("--group", default="inflight-workers", help="kafka: the workers' group id")
    acl.add_argument("--config", default=None, help="kafka: take the prefix, group and pools from this worker "
                     "config (every pool's topics and groups; workers may write other pools' job topics)")
    acl.add_argument("--worker-principal", default="User:inflight-worker")
    acl.add_argument("--producer-principal", default="User:inflight-producer")
    acl.add_argument("--no-results-read", action="store_true",
                     help="kafka: do not let the producer principal read the results topic")
    acl.add_argument("--tenant", default=None, help="redis reader: the tenant (none: jobs without a tenant)")
    acl.add_argument("--may-cancel", action="store_true", help="redis reader: may also set cancel tombstones")

    g = sub.add_parser("generate", formatter_class=defaults,
                       help="run prompts through the engine in this process and stream the text")
    g.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    g.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    g.add_argument("--priority", default="normal", choices=["high", "normal", "low"], help="the prompts' class")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")

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
    if a.cmd in ("submit", "stream", "cancel", "topics", "dlq"):
        import logging

        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # a refusal is explained in one line instead
    if a.cmd in ("submit", "stream", "cancel"):
        kafka, redis = client_sections(a)
        pools, tokenizer = client_routing(a) if a.cmd == "submit" else (None, None)
        # bad input: job id, tenant, sampling values
        return run_reported(client_command(a, kafka, redis, pools, tokenizer), bad_input="error", kafka=kafka,
                            redis=redis)
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
