"""Active access checks: connect as the configured user and find out whether Kafka and
Redis accept it, before a worker loads its model (`verify_access`) or after an opaque
failure (`diagnose`). What a failure means is decided by `worker.security.access`; this
module only produces the evidence.

aiokafka hides the cause of a failed bootstrap ("Unable to bootstrap from …"; the reason
goes to its log), so `diagnose` connects once more itself (`aiokafka.conn.create_conn`,
then, for a TLS failure, a raw handshake that surfaces the broker's alert) to name it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
import time
from typing import TYPE_CHECKING

from aiokafka import errors as kerr
from redis import exceptions as rex

from schemas import keys
from worker.obs.errors import suppressed
from worker.security.access import (
    EXIT_AUTHORIZATION,
    EXIT_TLS,
    EXIT_UNREACHABLE,
    AccessError,
    explain_kafka,
    explain_redis,
    explain_tls,
    principal_setting,
    worker_needs,
)

if TYPE_CHECKING:
    from schemas.pools import Pools
    from worker.config import KafkaConfig, RedisConfig, WorkerConfig

log = logging.getLogger(__name__)

TOPIC_SETTLE_S = 3.0  # how long a topic missing from the metadata is looked up again (it may be new)


async def probe_kafka(cfg: KafkaConfig, timeout_s: float = 10.0) -> None:
    """Connect to each bootstrap server once, with `cfg`'s security, as aiokafka's
    bootstrap does; return at the first that accepts.

    Raises:
        AccessError: every server failed; the error of the first, with its cause.
        ConfigError: a secret or certificate file cannot be read.
    """
    from aiokafka.conn import create_conn

    from worker.security.kafka import kafka_security_kwargs

    security = kafka_security_kwargs(cfg)
    first: AccessError | None = None
    for hostport in cfg.bootstrap_servers.split(","):
        host, _, port = hostport.strip().rpartition(":")
        where = f"{host}:{port}"
        try:
            async with asyncio.timeout(timeout_s):
                conn = await create_conn(host, int(port), request_timeout_ms=int(timeout_s * 1000),
                                         client_id="inflight-probe", **security)
            conn.close()
            return
        except Exception as e:  # each failure is classified below
            err = explain_kafka(e, cfg, where)
            if err is None and cfg.uses_tls:  # "Connection closed": ask the TLS layer why
                err = await _tls_probe(host, int(port), security["ssl_context"], cfg, where, timeout_s)
            if err is None:
                protocol_hint = ("the listener probably expects another security protocol" if
                                 isinstance(e, (kerr.KafkaConnectionError, ConnectionResetError)) else str(e)[:200])
                err = AccessError("Kafka", EXIT_TLS, f"the broker{' at ' + where} closed the connection during the "
                                  f"{cfg.security_protocol} handshake: {protocol_hint}",
                                  "kafka.security_protocol and kafka.bootstrap_servers")
            first = first or err
    assert first is not None
    raise first


async def _tls_probe(host: str, port: int, ctx: ssl.SSLContext, cfg: KafkaConfig, where: str,
                     timeout_s: float) -> AccessError | None:
    """Handshake, send ApiVersions v0 and read: a broker that rejects the client
    certificate (TLS 1.3 sends that alert after the handshake) shows it here."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
        body = struct.pack(">hhih", 18, 0, 1, 5) + b"probe"
        writer.write(struct.pack(">i", len(body)) + body)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            await reader.readexactly(4)
        writer.close()
        return None
    except Exception as e:  # classified; None when it says nothing more
        return explain_tls(e, "Kafka", "kafka", cfg.ssl_certfile is not None, f" at {where}")


async def check_kafka_permissions(cfg: KafkaConfig, timeout_s: float = 10.0, pools: Pools | None = None) -> None:
    """What a worker's principal must see: its topics (Describe, via metadata). The group
    is not probed here: a FindCoordinator request would create the offsets topic on a
    fresh broker ahead of the consumer, and the consumer's own join reports a refused
    group at once. Read and Write show only when used; the intake and the writers treat
    every refusal as fatal (exit 5).

    `pools`: the deployment's pools: a worker reads its own pool's job topics and forwards
    to the others', so all of them must exist (None: the default pool's).

    Raises:
        AccessError: naming the topics the principal may not use.
        ConfigError: topics of `kafka.topic_prefix` do not exist (names them).
    """
    from aiokafka.admin import AIOKafkaAdminClient

    from worker.security.kafka import kafka_security_kwargs

    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers, client_id="inflight-probe",
                                request_timeout_ms=int(timeout_s * 1000), **kafka_security_kwargs(cfg))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
        wanted = keys.all_topics(cfg.topic_prefix, pools)
        deadline = time.monotonic() + min(TOPIC_SETTLE_S, timeout_s)
        while True:  # topics created a moment ago reach a broker's metadata shortly after (as in the preflight)
            denied, missing = await _unusable_topics(admin, wanted, timeout_s)
            if denied or not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        if missing and not denied:
            from worker.config import ConfigError

            how = "--config <this file>" if pools is not None and pools.routes else f"--prefix {cfg.topic_prefix}"
            raise ConfigError(f"kafka.topic_prefix {cfg.topic_prefix!r}: topics {', '.join(missing)} do not exist; "
                              f"create them: inflight topics create {how}")
        if len(denied) == 1:
            raise explain_kafka(kerr.TopicAuthorizationFailedError(denied[0]), cfg)
        if denied:
            needs = "; ".join(f"{t}: {worker_needs(cfg, t)}" for t in denied)
            raise AccessError("Kafka", EXIT_AUTHORIZATION, f"{cfg.principal()} may not use topics {', '.join(denied)} "
                              f"(a worker needs {needs}; `inflight acl kafka` prints the grants)",
                              f"the ACLs of {principal_setting(cfg)}")

    finally:
        with suppressed(log, "closing the admin client"):  # a client that never connected
            await admin.close()


async def _unusable_topics(admin, wanted: list[str], timeout_s: float) -> tuple[list[str], list[str]]:
    """(topics of `wanted` the principal may not describe, topics that do not exist), in
    `wanted`'s order, from one metadata request for those topics that never creates one
    (`topic_metadata`)."""
    from worker.security.kafka import topic_metadata

    async with asyncio.timeout(timeout_s):
        topics = await topic_metadata(admin, wanted)
    codes = {t["topic"]: t["error_code"] for t in topics}
    return ([t for t in wanted if codes.get(t) == kerr.TopicAuthorizationFailedError.errno],
            [t for t in wanted if codes.get(t) == kerr.UnknownTopicOrPartitionError.errno])


async def probe_redis(cfg: RedisConfig, timeout_s: float = 10.0, scripts: tuple[str, ...] = ()) -> None:
    """PING as the configured user, then the commands and keys a worker needs outside
    its scripts (EXISTS of the epoch key, SCRIPT LOAD of each of `scripts`, the Lua
    source the caller will run: the worker passes its claim script).

    Raises:
        AccessError: authentication, TLS or permission failure, or Redis unreachable.
    """
    from worker.security.redis import redis_client

    client = redis_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await client.ping()
        await client.exists(keys.epoch_key(cfg.key_prefix))
        for script in scripts:
            await client.script_load(script)
    except (rex.RedisError, OSError) as e:
        err = explain_redis(e, cfg)
        if err is None:
            err = AccessError("Redis", EXIT_UNREACHABLE, f"{cfg.safe_url()}: {str(e)[:200]}", "redis.url")
        raise err from None
    finally:
        await client.aclose()


# ---- both -----------------------------------------------------------------------------
async def verify_access(cfg: WorkerConfig, timeout_s: float = 10.0, redis_scripts: tuple[str, ...] = ()) -> None:
    """Before a worker starts (and loads its model): Redis accepts its user (and lets it
    load `redis_scripts`), Kafka its credentials and certificates, and its principal
    sees its topics.

    Raises:
        AccessError: the first failure, explained. An unreachable Kafka is left to the
            clients' own retries (a broker may be starting), so it raises nothing here.
        ConfigError: a secret or certificate file cannot be read.
    """
    await probe_redis(cfg.redis, timeout_s, redis_scripts)
    try:
        await probe_kafka(cfg.kafka, timeout_s)
    except AccessError as e:
        if e.exit_code == EXIT_UNREACHABLE:
            return
        raise
    await check_kafka_permissions(cfg.kafka, timeout_s, cfg.pool_set)


async def diagnose(e: BaseException, *, kafka: KafkaConfig | None = None, redis: RedisConfig | None = None,
                   timeout_s: float = 10.0) -> AccessError | None:
    """The AccessError behind `e`, probing Kafka when `e` is aiokafka's opaque
    "Unable to bootstrap" (the cause went to its log only). None if there is none."""
    if isinstance(e, AccessError):
        return e
    if isinstance(e, TimeoutError) and not isinstance(e, rex.RedisError):  # the caller's own deadline
        return None
    if redis is not None and isinstance(e, (rex.RedisError, OSError)):
        err = explain_redis(e, redis)
        if err is not None:
            return err
    if kafka is not None:
        err = explain_kafka(e, kafka)
        if err is not None:
            return err
        if isinstance(e, kerr.KafkaConnectionError):
            try:
                await probe_kafka(kafka, timeout_s)
            except AccessError as found:
                return found
    return None
