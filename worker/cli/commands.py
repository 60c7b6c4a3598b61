"""What the `inflight` client commands do (submit / stream / cancel), and
`run_reported`, the asyncio runner every command goes through: failures a user can fix
(bad input, refused access, unreachable services, timeouts) become one line and an exit
code, never a traceback. The argument parser lives in `worker/__main__.py`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys


def run_reported(coro, *, bad_input: str, kafka=None, redis=None, log_errors: bool = False) -> int:
    """asyncio.run, with the failures a user can fix reported in one line, no traceback:
    bad input (ValueError, FileNotFoundError; exit 2), refused credentials, certificates
    or permissions (`worker.security.access`: exit 3, 4 or 5, explained with the `kafka` / `redis`
    settings given), unreachable Redis or Kafka (1; also an outage past `redis.outage_limit_s` or
    `kafka.outage_limit_s`), a timeout (1). `log_errors`: report
    through the log (the worker's JSON lines) instead of a plain line on stderr."""
    from aiokafka.errors import KafkaConnectionError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from worker.security.access import AccessError
    from worker.security.kafka import KafkaUnavailable
    from worker.security.probe import diagnose
    from worker.security.redis import RedisUnavailable

    async def explained():
        try:
            return await coro
        except Exception as e:  # refused credentials / certificates / ACLs become one AccessError
            err = await diagnose(e, kafka=kafka, redis=redis)
            if err is not None:
                raise err from None
            raise

    def report(line: str, **fields) -> None:
        if log_errors:
            import structlog

            structlog.get_logger("worker").error(line, **fields)
        else:
            print(line, file=sys.stderr)

    try:
        return asyncio.run(explained()) or 0
    except AccessError as e:
        report(f"error: {e}" if not log_errors else f"cannot run: {e}", cause=e.cause, setting=e.setting,
               exit_code=e.exit_code)
        return e.exit_code
    except TimeoutError as e:
        print(f"\n[timeout: {e}]", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, PermissionError) as e:  # ConfigError is a ValueError
        report(f"{bad_input}: {e}", exit_code=2)
        return 2
    except (RedisUnavailable, KafkaUnavailable) as e:
        report(f"error: {e}", exit_code=1)
        return 1
    except (RedisConnectionError, KafkaConnectionError) as e:
        report(f"error: cannot reach {'Redis' if isinstance(e, RedisConnectionError) else 'Kafka'}: {e}",
               exit_code=1)
        return 1


STREAM_TIMEOUT_S = 600.0  # default --timeout of `stream` and `submit --stream`, seconds
UNKNOWN_NOTICE_S = 5.0  # a stream with no event this long says whether anything knows the job, seconds


def timeout_hint(job_id: str, timeout: float | None, tenant: str | None, prefix: str) -> str:
    """What a stream that ended without a terminal event most likely means."""
    causes = [f"the id {job_id!r} is wrong or its job is still queued behind others"]
    if tenant is None:
        causes.append("the job was submitted with a tenant (every gateway job has one): pass --tenant")
    causes.append(f"its record could not be decoded, carried no valid job id (body or key) and went to the DLQ "
                  f"topic {prefix}.dlq unanswered")
    return f"no terminal event for {job_id} within {timeout:g} s; likely: " + "; or ".join(causes)


async def print_stream(client, job_id: str, timeout: float | None, tenant: str | None = None,
                       prefix: str = "inflight") -> int:
    """Text to stdout, progress and the outcome to stderr; 0 for stop / length, else 1.
    Raises TimeoutError with `timeout_hint` when no terminal event came in `timeout` s.
    After `UNKNOWN_NOTICE_S` without an event, says so on stderr when nothing knows the
    job yet (`_notice_if_unknown`), rather than only at the timeout."""
    seen: list[object] = []
    notice = asyncio.create_task(_notice_if_unknown(client, job_id, tenant, timeout, seen))
    try:
        return await _print_stream(client, job_id, timeout, tenant, seen)
    except TimeoutError:
        recorded = None
        with contextlib.suppress(Exception):  # the hint is best effort: a refused results read leaves it generic
            recorded = (await client.lookup_results([job_id], timeout_s=10.0)).get(job_id)
        if recorded is not None:
            which = "pass the --tenant it was submitted with" if tenant is None else f"check --tenant ({tenant!r})"
            hint = (f"no terminal event for {job_id} within {timeout:g} s on these Redis keys, but the results "
                    f"topic {prefix}.results records it finished ({recorded.finish_reason}): {which}, or its "
                    "Redis log expired (redis.log_ttl_s)")
            raise TimeoutError(hint) from None
        raise TimeoutError(timeout_hint(job_id, timeout, tenant, prefix)) from None
    finally:
        notice.cancel()


async def _notice_if_unknown(client, job_id: str, tenant: str | None, timeout: float | None,
                             seen: list[object]) -> None:
    """One stderr line when, `UNKNOWN_NOTICE_S` into a stream with no event yet, the job
    has no event log (under `tenant`), no claim or attempt count and no results record:
    a wrong id or tenant, or a job still queued behind others. Best effort: a key the
    caller's ACL may not read, or a slow results topic, says nothing."""
    from schemas import keys

    await asyncio.sleep(UNKNOWN_NOTICE_S)
    if seen:
        return
    with contextlib.suppress(Exception):
        p = client.key_prefix
        if await client.redis.exists(keys.log_key(job_id, p, tenant), keys.claim_key(job_id, p),
                                     keys.attempts_key(job_id, p)):
            return
        if job_id in await client.lookup_results([job_id], timeout_s=UNKNOWN_NOTICE_S):
            return
        if not seen:
            wait = f"up to {timeout:g} s in all" if timeout else "until it appears"
            print(f"[nothing known of job {job_id} yet: no event log{'' if tenant else ' without a tenant'}, no "
                  f"claim, no results record; still waiting {wait} (a job queued behind others has none of these "
                  f"until a worker takes it; else check the id and --tenant)]", file=sys.stderr, flush=True)


async def _print_stream(client, job_id: str, timeout: float | None, tenant: str | None,
                        seen: list[object]) -> int:
    """The stream's lines; the first event is put in `seen` (`_notice_if_unknown` reads it)."""
    from schemas.wire import Finished, Restarted, Started, Token

    code = 1
    async for ev in client.stream(job_id, tenant=tenant, timeout_s=timeout):
        if not seen:
            seen.append(ev)
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


def client_sections(a: argparse.Namespace):
    """(kafka, redis) connection settings of a client command: the `kafka` and `redis`
    sections of `--config` (+ INFLIGHT_* env overrides), with `--kafka` / `--redis` /
    `--prefix` replacing address and prefixes. Raises ConfigError."""
    import msgspec

    from worker.config import load_config

    cfg = load_config(a.config)
    kafka, redis = cfg.kafka, cfg.redis
    if a.kafka:
        kafka = msgspec.structs.replace(kafka, bootstrap_servers=a.kafka)
    if a.redis:
        redis = msgspec.structs.replace(redis, url=a.redis)
    if a.prefix:
        kafka = msgspec.structs.replace(kafka, topic_prefix=a.prefix)
        redis = msgspec.structs.replace(redis, key_prefix=a.prefix)
    return kafka, redis


def client_routing(a: argparse.Namespace):
    """(pools, tokenizer) for `submit`: the `pools` section of `--config` and, when it routes
    and `model.path` holds a `tokenizer.json`, that tokenizer (the job goes to the pool
    serving its prompt's length; without one, to the default pool, whose workers forward).
    Raises ConfigError."""
    from worker.client.routing import load_tokenizer
    from worker.config import load_config

    cfg = load_config(a.config)
    pools = cfg.pool_set
    if not pools.routes or not cfg.model.path:
        return pools, None
    try:
        return pools, load_tokenizer(cfg.model.path)
    except Exception as e:  # noqa: BLE001  (no tokenizer: routing falls back to the default pool)
        print(f"warning: cannot load the tokenizer of model.path ({e}); the job goes to the default pool, whose "
              f"workers forward it", file=sys.stderr)
        return pools, None


def _inline_or_file(value: str) -> str:
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def structured_arg(a: argparse.Namespace):
    """`params.structured` from submit's --json-schema / --json-object / --regex /
    --choice / --grammar (None without any).

    Raises:
        ValueError: the schema is not JSON, or a file cannot be read (named).
    """
    import msgspec

    from schemas.params import ChoiceOutput, GrammarOutput, JsonObjectOutput, JsonSchemaOutput, RegexOutput

    if a.json_schema is not None:
        try:
            schema = msgspec.json.decode(_inline_or_file(a.json_schema))
        except (OSError, msgspec.DecodeError) as e:
            raise ValueError(f"--json-schema: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("--json-schema: a JSON Schema is a JSON object")
        return JsonSchemaOutput(schema=schema)
    if a.json_object:
        return JsonObjectOutput()
    if a.regex is not None:
        return RegexOutput(pattern=a.regex)
    if a.choice:
        return ChoiceOutput(choices=a.choice)
    if a.grammar is not None:
        try:
            return GrammarOutput(grammar=_inline_or_file(a.grammar))
        except OSError as e:
            raise ValueError(f"--grammar: {e}") from None
    return None


async def client_command(a: argparse.Namespace, kafka, redis, pools=None, tokenizer=None) -> int:
    from schemas.params import SamplingParams
    from worker.client import InflightClient

    async with InflightClient(kafka=kafka, redis=redis, pools=pools, tokenizer=tokenizer) as client:
        if a.cmd == "submit":
            params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed, top_p=a.top_p,
                                    top_k=a.top_k, repetition_penalty=a.repetition_penalty, stop=a.stop or [],
                                    ignore_eos=a.ignore_eos, structured=structured_arg(a))
            job_id = await client.submit(a.prompt, params=params, priority=a.priority, job_id=a.job_id,
                                         tenant=a.tenant, adapter=a.adapter)
            if a.stream:  # stdout carries the text alone
                print(f"[job {job_id}]", file=sys.stderr)
                return await print_stream(client, job_id, a.timeout, a.tenant, kafka.topic_prefix)
            print(job_id)
            return 0
        if a.cmd == "stream":
            return await print_stream(client, a.job_id, a.timeout, a.tenant, kafka.topic_prefix)
        if a.cmd == "cancel":
            await client.cancel(a.job_id)
            print(f"cancel sent for {a.job_id} (no effect if it already finished)", file=sys.stderr)
            return 0
    return 1


async def dlq_command(a: argparse.Namespace, kafka) -> int:
    """`inflight dlq list` / `inflight dlq replay` (worker/cli/dlq.py)."""
    import json

    from worker.cli.dlq import count_by_reason, parse_since, read_dead_letters, replay_dead_letters

    filtered = bool(a.reason or a.job_id or a.since)
    if a.dlq_cmd == "replay" and not (filtered or a.all):
        raise ValueError("name what to replay: --reason, --job-id, --since, or --all for every dead letter")
    letters = await read_dead_letters(kafka, reasons=set(a.reason) if a.reason else None,
                                      job_ids=set(a.job_id) if a.job_id else None, since_ms=parse_since(a.since),
                                      limit=a.limit)
    if a.dlq_cmd == "list":
        for d in letters:
            s = d.summary()
            if a.json:
                print(json.dumps(s))
            else:
                error = (s["error"] or "").replace("\n", " ")
                print(f"{s['partition']}:{s['offset']}  {s['time']}  {s['reason']}  job {s['job_id'] or '-'}  "
                      f"from {s['source']}  {s['bytes']} B  {error[:160]}")
        counts = count_by_reason(letters)
        print(f"{len(letters)} dead letter(s)" + (": " + ", ".join(f"{k} {v}" for k, v in counts.items())
                                                 if counts else ""), file=sys.stderr)
        return 0
    results = await replay_dead_letters(kafka, letters, force=a.force, dry_run=a.dry_run)
    for r in results:
        d = r.dead_letter
        where = f"{d.partition}:{d.offset} ({d.reason}, job {d.job_id or '-'})"
        if r.status == "refused":
            print(f"refused {where}: {r.why}")
        else:
            print(f"{r.status} {where} -> {r.topic} as job {r.job_id}")
    sent = sum(r.status == "sent" for r in results)
    refused = sum(r.status == "refused" for r in results)
    print(f"{sent} sent, {refused} refused" + (" (dry run: nothing sent)" if a.dry_run else ""), file=sys.stderr)
    return 0 if not refused else 1


async def jobs_command(a: argparse.Namespace, kafka, redis) -> int:
    """`inflight jobs audit` / `inflight job show` (worker/cli/jobs.py)."""
    import json

    from worker.cli import jobs
    from worker.cli.dlq import parse_since
    from worker.client import InflightClient
    from worker.config import load_config

    pools = load_config(a.config).pool_set
    async with InflightClient(kafka=kafka, redis=redis, pools=pools) as client:
        if a.cmd == "jobs":
            report = await jobs.audit(client, kafka, pools, since_ms=parse_since(a.since),
                                      until_ms=parse_since(a.until), pending_after_s=a.pending_after)
            if a.json:
                print(json.dumps(report, indent=1))
                return 1 if any(report["defects"].values()) else 0
            return jobs.print_audit(report, sys.stdout)
        story = await jobs.show(client, kafka, pools, a.job_id, tenant=a.tenant, since_ms=parse_since(a.since))
        if a.json:
            print(json.dumps(story, indent=1))
            return 1 if story["defects"] else 0
        return jobs.print_show(story, sys.stdout)
