"""`inflight` command line.

    inflight worker --config worker.yaml           run a worker (Kafka jobs in, Redis streams out)
    inflight check --config worker.yaml            preflight: Kafka, topics, group, Redis, model, KV, port
    inflight submit --prompt "Hi" --priority high --stream
    inflight stream JOB_ID
    inflight cancel JOB_ID
    inflight topics create
    inflight schema                                 JSON Schema of jobs, cancels and events
    inflight generate --model PATH --prompt "Hi"   the engine alone, in this process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

DEFAULT_KAFKA = os.environ.get("INFLIGHT_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:19092")
DEFAULT_REDIS = os.environ.get("INFLIGHT_REDIS__URL", "redis://127.0.0.1:6390/0")


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
    from worker.app import Worker
    from worker.config import ConfigError, load_config
    from worker.log import setup_logging

    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(a.log_level, transient_grace_s=cfg.kafka.transient_grace_s)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no tqdm bars among the JSON log lines
    if not cfg.model.path:
        print("config error: model.path is required (or INFLIGHT_MODEL__PATH)", file=sys.stderr)
        return 2
    # model path, device or checkpoint format (FileNotFoundError / ValueError) are config errors
    return _run(Worker(cfg).run(), bad_input="config error")


def _check(a: argparse.Namespace) -> int:
    """Preflight (worker.preflight): one line per check on stdout, exit 0 only if none failed."""
    import logging

    from worker.config import ConfigError, load_config
    from worker.log import setup_logging
    from worker.preflight import exit_code, render, run_preflight

    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
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


def _run(coro, *, bad_input: str) -> int:
    """asyncio.run, with the failures a user can fix reported in one line, no traceback:
    bad input (ValueError, FileNotFoundError; exit 2), unreachable Redis or Kafka (1),
    a timeout (1)."""
    from aiokafka.errors import KafkaConnectionError
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return asyncio.run(coro) or 0
    except TimeoutError as e:
        print(f"\n[timeout: {e}]", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"{bad_input}: {e}", file=sys.stderr)
        return 2
    except (RedisConnectionError, KafkaConnectionError) as e:
        print(f"error: cannot reach {'Redis' if isinstance(e, RedisConnectionError) else 'Kafka'}: {e}",
              file=sys.stderr)
        return 1


async def _print_stream(client, job_id: str, timeout: float | None) -> int:
    from schemas.wire import Finished, Restarted, Started, Token

    code = 1
    async for ev in client.stream(job_id, timeout_s=timeout):
        if isinstance(ev, Started):
            print(f"[started on {ev.worker_id}, attempt {ev.attempt}]", file=sys.stderr)
        elif isinstance(ev, Restarted):
            print(f"\n[restarted: {ev.reason}]", file=sys.stderr)
        elif isinstance(ev, Token):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Finished):
            err = f"; {ev.error.code}: {ev.error.message}" if ev.error else ""
            usage = f", {ev.usage.completion_tokens} tokens" if ev.usage else ""
            print(f"\n[finished: {ev.finish_reason}{usage}{err}]", file=sys.stderr)
            code = 0 if ev.finish_reason in ("stop", "length") else 1
    return code


async def _client_cmd(a: argparse.Namespace) -> int:
    from schemas.params import SamplingParams
    from worker.client import InflightClient

    async with InflightClient(a.kafka, a.redis, topic_prefix=a.prefix, key_prefix=a.prefix) as client:
        if a.cmd == "submit":
            params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
            job_id = await client.submit(a.prompt, params=params, priority=a.priority, job_id=a.job_id)
            print(job_id)
            if a.stream:
                return await _print_stream(client, job_id, a.timeout)
            return 0
        if a.cmd == "stream":
            return await _print_stream(client, a.job_id, a.timeout)
        if a.cmd == "cancel":
            await client.cancel(a.job_id)
            print(f"cancel sent for {a.job_id} (no effect if it already finished)", file=sys.stderr)
            return 0
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="inflight", description="Inflight LLM serving worker")
    sub = p.add_subparsers(dest="cmd", required=True)

    w = sub.add_parser("worker", help="run a worker")
    w.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    w.add_argument("--log-level", default="INFO")

    ck = sub.add_parser("check", help="preflight a worker config: one line per check with the setting to fix; "
                        "exit 0 only if every check passes")
    ck.add_argument("--config", help="YAML config file; INFLIGHT_<SECTION>__<FIELD> env vars override it")
    ck.add_argument("--timeout", type=float, default=10.0, help="seconds for each Kafka / Redis step")
    ck.add_argument("--json", action="store_true", help="print the checks as a JSON array")

    def client_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--kafka", default=DEFAULT_KAFKA, help="bootstrap servers")
        sp.add_argument("--redis", default=DEFAULT_REDIS, help="Redis URL")
        sp.add_argument("--prefix", default="inflight", help="topic and key prefix")
        sp.add_argument("--timeout", type=float, default=None, help="seconds to wait for the end")

    s = sub.add_parser("submit", help="produce a job")
    client_args(s)
    s.add_argument("--prompt", required=True)
    s.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--job-id", default=None)
    s.add_argument("--stream", action="store_true", help="stream the tokens to stdout")
    st = sub.add_parser("stream", help="stream a job's events (replays what already happened; waits for a job "
                        "not seen yet, up to --timeout)")
    client_args(st)
    st.add_argument("job_id")
    c = sub.add_parser("cancel", help="cancel a job")
    client_args(c)
    c.add_argument("job_id")

    t = sub.add_parser("topics", help="manage topics")
    t.add_argument("action", choices=["create"])
    t.add_argument("--bootstrap", default=DEFAULT_KAFKA)
    t.add_argument("--prefix", default="inflight")
    t.add_argument("--partitions", type=int, default=6)
    t.add_argument("--replication-factor", type=int, default=1)
    t.add_argument("--quiet", action="store_true")

    sub.add_parser("schema", help="print the JSON Schema of the wire messages")

    g = sub.add_parser("generate", help="run prompts through the engine in this process and stream the text")
    g.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    g.add_argument("--device", default="auto")

    a = p.parse_args(argv)
    if a.cmd == "generate":
        return _generate(a)
    if a.cmd == "worker":
        return _worker(a)
    if a.cmd == "check":
        return _check(a)
    if a.cmd in ("submit", "stream", "cancel"):
        return _run(_client_cmd(a), bad_input="error")  # bad input: job id, sampling values
    if a.cmd == "topics":
        from worker.topics import create_topics

        try:
            created = asyncio.run(create_topics(a.bootstrap, a.prefix, a.partitions, a.replication_factor))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if not a.quiet or created:
            print(f"created: {', '.join(created) or 'nothing (all exist)'}")
        return 0
    if a.cmd == "schema":
        from schemas.codec import json_schemas

        print(json.dumps(json_schemas(), indent=2))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
