"""`inflight check`: preflight of a worker config, one line per check naming the setting
to fix, before a worker is started (by hand, or as the Kubernetes initContainer).

Checks, in order: Kafka reachable (`kafka.bootstrap_servers`); the job, cancel and DLQ
topics exist, with their partition counts (`kafka.topic_prefix`); the consumer group can
be described and its committed offsets fetched (`kafka.group_id`), without joining it, so
running workers never rebalance; Redis answers and a probe key can be written (TTL) and
deleted, the publisher's script loads (`redis.url`), and its persistence settings are
reported; the model and its tokenizer load with the worker's loader, chat template
reported (`model.path`); the KV cache of `serving_tuning` fits the memory left after
loading the model (`serving_tuning.max_total_tokens`); how the forward will run
(`model.compile`: eager and why, a captured forward ready to load, or compiled at the
start; reported, never failed); the metrics port can be bound (`metrics.port`). A check that depends on a failed one is skipped.

What it cannot prove without joining the group or consuming: the Read permission a
worker needs on the group and its topics, and Write on the DLQ and results topics (a
worker stops with exit code 5 and the missing grant when one is refused). Refused
credentials and certificates fail the `kafka` / `redis` check with the setting to fix
(`worker.security.access`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

from schemas import keys
from worker.cli.checks import Check
from worker.cli.checks import short as _short
from worker.cli.model_checks import model_checks
from worker.config import WorkerConfig, redacted_config
from worker.obs.errors import suppressed
from worker.security.probe import TOPIC_SETTLE_S

log = logging.getLogger(__name__)

REPORT_ONLY = frozenset({"redis persistence", "compile"})  # lines that report (`info`, or `skip`), never fail


def run_preflight(cfg: WorkerConfig, timeout_s: float = 10.0) -> list[Check]:
    """Run every check against `cfg` (blocking: loads the model in this process).

    `timeout_s` bounds each network step (Kafka, Redis), in seconds. Never raises for
    an unreachable service or a bad setting: each becomes a `fail` Check.
    """
    checks = asyncio.run(_network_checks(cfg, timeout_s))
    checks += model_checks(cfg)
    checks.append(metrics_port_check(cfg))
    return checks


def exit_code(checks: list[Check]) -> int:
    """0 when no check failed, else 1."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def render(checks: list[Check]) -> str:
    """One line per check (`PASS  kafka  kafka.bootstrap_servers  …`) and a summary line."""
    w_name = max(len(c.name) for c in checks)
    w_set = max(len(c.setting) for c in checks)
    lines = [f"{c.status.upper():<4}  {c.name:<{w_name}}  {c.setting:<{w_set}}  {c.detail}" for c in checks]
    failed = [c.name for c in checks if c.status == "fail"]
    num_checks = sum(c.name not in REPORT_ONLY for c in checks)
    lines.append(f"{len(failed)} of {num_checks} checks failed: {', '.join(failed)}" if failed
                 else f"all {num_checks} checks passed")
    return "\n".join(lines)


async def _network_checks(cfg: WorkerConfig, timeout_s: float) -> list[Check]:
    return await kafka_checks(cfg, timeout_s) + await redis_checks(cfg, timeout_s)


# ---- Kafka ----------------------------------------------------------------------------
async def kafka_checks(cfg: WorkerConfig, timeout_s: float) -> list[Check]:
    """`kafka`, `topics`, `consumer group`: read-only admin requests (metadata,
    FindCoordinator, DescribeGroups, OffsetFetch) with the worker's security settings."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaConnectionError, KafkaError

    from worker.config import ConfigError
    from worker.security.access import AccessError
    from worker.security.kafka import kafka_security_kwargs
    from worker.security.probe import probe_kafka

    kc = cfg.kafka
    skipped = [Check("topics", "skip", "kafka.topic_prefix", "not checked: Kafka unreachable"),
               Check("consumer group", "skip", "kafka.group_id", "not checked: Kafka unreachable")]
    try:
        security = kafka_security_kwargs(kc)
    except ConfigError as e:  # the message starts with the setting: "kafka.ssl_certfile / …: why"
        setting, _, why = str(e).partition(": ")
        return [Check("kafka", "fail", setting, why or str(e)), *skipped]
    setting = "kafka.bootstrap_servers"
    admin = AIOKafkaAdminClient(bootstrap_servers=kc.bootstrap_servers, client_id="inflight-check",
                                request_timeout_ms=int(timeout_s * 1000), **security)
    try:
        try:
            t0 = time.perf_counter()
            async with asyncio.timeout(timeout_s):
                await admin.start()
            async with asyncio.timeout(timeout_s):
                cluster = await admin.describe_cluster()
            answer_ms = 1000 * (time.perf_counter() - t0)
            topics = await _visible_topics(admin, keys.all_topics(kc.topic_prefix, cfg.pool_set), timeout_s)
        except (KafkaError, OSError, TimeoutError) as e:
            if isinstance(e, KafkaConnectionError):  # aiokafka logged why; connect once more to name it
                try:
                    await probe_kafka(kc, timeout_s)
                except AccessError as err:
                    if err.exit_code != 1:  # refused credentials / certificate / protocol
                        return [Check("kafka", "fail", err.setting, f"{err.cause}: {err.detail}"), *skipped]
            if isinstance(e, TimeoutError):
                why = f"no answer within {timeout_s} s"
            elif isinstance(e, KafkaConnectionError):  # drop aiokafka's (host, port, family) tuples
                why = f"cannot connect ({_short(e).split(' from ')[0]}); is a broker listening there?"
            else:
                why = _short(e)
            return [Check("kafka", "fail", setting, f"{kc.bootstrap_servers}: {why}"), *skipped]
        brokers = len(cluster["brokers"])
        checks = [Check("kafka", "pass", setting, f"{kc.bootstrap_servers}: {brokers} broker(s), cluster "
                        f"{cluster.get('cluster_id')}, answered in {answer_ms:.0f} ms")]
        partitions = _topics_check(cfg, topics, checks)
        checks.append(await _group_check(admin, cfg.job_group_id, partitions, timeout_s))
        return checks
    finally:
        with suppressed(log, "closing the admin client"):  # a client that never connected
            await admin.close()


async def _visible_topics(admin, wanted: list[str], timeout_s: float) -> list[dict]:
    """Metadata of the `wanted` topics (`topic_metadata`: those only, never
    auto-creating one). Topics created a moment ago reach a broker's metadata shortly
    after the create returns, so a missing one is looked up again for up to
    `TOPIC_SETTLE_S`."""
    from worker.security.kafka import topic_metadata

    deadline = time.monotonic() + min(TOPIC_SETTLE_S, timeout_s)
    while True:
        async with asyncio.timeout(timeout_s):
            topics = await topic_metadata(admin, wanted)
        found = {t["topic"] for t in topics if t["error_code"] == 0}
        if set(wanted) <= found or time.monotonic() > deadline:
            return topics
        await asyncio.sleep(0.25)


def _topics_check(cfg: WorkerConfig, topics: list[dict], checks: list[Check]) -> dict[str, int]:
    """Appends the `topics` Check (every pool's job topics: a worker forwards to the other
    pools); returns {job topic: partition count} of its own pool's that are present."""
    prefix, bootstrap = cfg.kafka.topic_prefix, cfg.kafka.bootstrap_servers
    pools = cfg.pool_set
    found = {t["topic"]: len(t["partitions"]) for t in topics if t["error_code"] == 0}
    names = keys.all_topics(prefix, pools)
    missing = [n for n in names if n not in found]
    counts = ", ".join(f"{n} {found[n]}" for n in names if n in found)
    how = "--config <this file>" if pools.routes else f"--bootstrap {bootstrap} --prefix {prefix}"
    if missing:
        checks.append(Check("topics", "fail", "kafka.topic_prefix",
                            f"{prefix!r}: missing (or not visible to this principal) {', '.join(missing)}"
                            + (f"; present {counts}" if counts else "")
                            + f"; create them: inflight topics create {how}"))
    else:
        checks.append(Check("topics", "pass", "kafka.topic_prefix", f"{prefix!r}: partitions {counts}"))
    return {n: found[n] for n in keys.job_topics(prefix, cfg.worker.pool) if n in found}


async def _group_check(admin, group_id: str, job_partitions: dict[str, int], timeout_s: float) -> Check:
    """Describe the group and fetch its committed offsets for the job partitions: the
    requests `kafka-consumer-groups --describe` makes; neither joins the group. Retriable
    answers (a fresh broker still creating `__consumer_offsets`: no coordinator, "not
    coordinator", "loading") are asked again for up to `timeout_s`; a retriable answer
    still there by then fails as such, not as a missing permission."""
    from aiokafka.errors import KafkaError, for_code
    from aiokafka.structs import TopicPartition

    tps = [TopicPartition(t, p) for t, n in job_partitions.items() for p in range(n)]

    async def describe():
        coordinator = await admin.find_coordinator(group_id)
        resp = await admin.describe_consumer_groups([group_id], group_coordinator_id=coordinator)
        group = resp[0].to_object()["groups"][0]
        if group["error_code"]:
            raise for_code(group["error_code"])(group_id)
        return group, await admin.list_consumer_group_offsets(group_id, group_coordinator_id=coordinator,
                                                              partitions=tps)

    try:
        group, offsets = await _retry_retriable(describe, timeout_s)
    except (KafkaError, TimeoutError) as e:
        why = "no answer" if isinstance(e, TimeoutError) else _short(e)
        if isinstance(e, KafkaError) and e.retriable:
            detail = (f"{group_id!r}: the group coordinator was not ready within {timeout_s:g} s ({why}): a broker "
                      "still starting, or its __consumer_offsets topic unavailable; run the check again")
        else:
            detail = (f"{group_id!r}: cannot describe the group or fetch its offsets ({why}); the worker's principal "
                      "needs Describe and Read on the group")
        return Check("consumer group", "fail", "kafka.group_id", detail)
    committed = sum(1 for o in offsets.values() if o.offset >= 0)
    state = "Dead (no member yet)" if group["state"] == "Dead" else group["state"]
    return Check("consumer group", "pass", "kafka.group_id",
                 f"{group_id!r}: describe and offset fetch allowed (not joined); state {state}, "
                 f"{len(group['members'])} member(s), committed offsets on {committed} of {len(tps)} job partitions")


async def _retry_retriable(call: Callable[[], Awaitable], timeout_s: float):
    """`call()`, retried while it raises a retriable Kafka error (a fresh broker's group
    coordinator is not available for its first seconds), for up to `timeout_s` in all."""
    from aiokafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                return await call()
        except KafkaError as e:
            if not e.retriable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


# ---- Redis ------------------------------------------------------------------------------
async def redis_checks(cfg: WorkerConfig, timeout_s: float) -> list[Check]:
    """`redis`: PING, SET NX EX / GET / DEL of a probe key under `redis.key_prefix`,
    SCRIPT LOAD of the publisher's script; `redis persistence`: CONFIG GET appendonly
    and save ("unknown" where ACLs or a managed service deny CONFIG)."""
    from redis import exceptions as rex

    from worker.config import ConfigError
    from worker.security.access import explain_redis
    from worker.security.redis import redis_client
    from worker.serve.publish import APPEND_LUA

    url = redacted_config(cfg)["redis"]["url"]
    try:
        client = redis_client(cfg.redis, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except ConfigError as e:
        setting, _, why = str(e).partition(": ")
        return [Check("redis", "fail", setting, why or str(e)),
                Check("redis persistence", "skip", "redis.url", "not checked: Redis unusable")]
    try:
        try:
            t0 = time.perf_counter()
            await client.ping()
            ping_ms = 1000 * (time.perf_counter() - t0)
            key, token = keys.preflight_key(uuid.uuid4().hex, cfg.redis.key_prefix), uuid.uuid4().hex
            await client.set(key, token, nx=True, ex=60)
            read = await client.get(key)
            await client.delete(key)
            if read != token.encode():
                raise rex.ResponseError(f"probe key {key} read back {read!r}")
            await client.script_load(APPEND_LUA)
        except (rex.RedisError, OSError) as e:
            err = explain_redis(e, cfg.redis)
            if err is not None:
                return [Check("redis", "fail", err.setting, f"{url}: {err.cause}: {err.detail}"),
                        Check("redis persistence", "skip", "redis.url", "not checked: Redis unusable")]
            why = {rex.ReadOnlyError: "read-only (a replica?): the worker writes"}.get(type(e), _short(e))
            return [Check("redis", "fail", "redis.url", f"{url}: {why}"),
                    Check("redis persistence", "skip", "redis.url", "not checked: Redis unusable")]
        checks = [Check("redis", "pass", "redis.url", f"{url}: PING {ping_ms:.1f} ms; probe key written with a TTL, "
                        "read back and deleted; publish script loaded")]
        checks.append(await _persistence(client))
        return checks
    finally:
        await client.aclose()


async def _persistence(client) -> Check:
    from redis import exceptions as rex

    try:
        aof = (await client.config_get("appendonly")).get("appendonly")
        save = (await client.config_get("save")).get("save")
    except rex.ResponseError as e:  # NoPermissionError, or CONFIG renamed / disabled
        return Check("redis persistence", "info", "redis.url", f"unknown (CONFIG GET not allowed: {_short(e)})")
    if aof == "yes":
        what = "append-only file"
    elif save:
        what = "RDB snapshots only: a restart loses writes since the last snapshot"
    else:
        what = "none: a Redis restart loses every job's event log and claims"
    return Check("redis persistence", "info", "redis.url", f"appendonly {aof}, save {save!r} ({what})")


# ---- model and KV cache -----------------------------------------------------------------
def metrics_port_check(cfg: WorkerConfig) -> Check:
    """`metrics.port` can be bound on `metrics.host` (as the worker's HTTP server will,
    with SO_REUSEADDR), then released."""
    m = cfg.metrics
    if m.port is None:
        return Check("metrics port", "pass", "metrics.port", "null: the worker serves no HTTP")
    if m.port == 0:
        return Check("metrics port", "pass", "metrics.port", "0: the worker binds any free port (logged)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(m.host, m.port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return Check("metrics port", "fail", "metrics.port",
                     f"{m.host}:{m.port} cannot be bound ({e.strerror}); another process uses it: give each worker "
                     "on a host its own port, 0 for any free one, or null for no HTTP")
    return Check("metrics port", "pass", "metrics.port", f"{m.host}:{m.port} is free")
