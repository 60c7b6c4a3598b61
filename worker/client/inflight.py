"""Producer / consumer helpers: submit jobs, stream their events, cancel them.

Imports neither torch nor engine code (`pip install "inflight-worker[client]"`).
`stream()` subscribes to the job's channel first, then replays the job's log, so no
event is missed between the two; it dedupes by `seq`, survives late subscription
(the log keeps the whole sequence for its TTL), retries connection errors with backoff
(a Redis restart), re-reads the log from the last seq after a reconnect, and passes
`restarted` through (the caller drops earlier partial text). `result()` falls back to
the durable results topic when Redis has no log of the job.

Connections take the same settings as a worker: pass `kafka=KafkaConfig(...)` (SASL,
TLS, client certificate) and `redis=RedisConfig(...)` (ACL user, TLS), e.g. the sections
of a config file (`load_config(path).kafka`). A job with a `tenant` streams on its
tenant's keys: pass the same `tenant` to `stream` / `result` / `read_log`, so a reader
whose Redis user may only see that tenant's keys can follow it. Wrong credentials, an
untrusted certificate or a missing permission raise `worker.security.access.AccessError` at once
(one line naming the setting), never retried as if Redis or Kafka were down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoPermissionError

from schemas import keys
from schemas.codec import decode_job, encode
from schemas.params import SamplingParams
from schemas.pools import Pool, Pools
from schemas.replay import entry_of, expand
from schemas.wire import Cancel, ChatMessage, Event, Finished, Job, check_tenant
from worker.client import fleet
from worker.client.affinity import PrefixAffinity
from worker.client.routing import load_tokenizer, pool_for
from worker.client.stream import JobStream
from worker.client.subscriber import SharedSubscriber
from worker.client.tracing import ProducerSpans
from worker.config import KafkaConfig, RedisConfig
from worker.obs.stopping import stop_within
from worker.security import access, probe
from worker.security.kafka import kafka_security_kwargs, ping_cluster, stop_client
from worker.security.redis import REDIS_DOWN, redis_pool

log = logging.getLogger(__name__)


class InflightClient:
    """The producers' and readers' client: submits jobs to Kafka, cancels them, streams
    their events from Redis, reads their recorded outcomes.

    Args:
        bootstrap_servers: Kafka bootstrap servers (None: `kafka.bootstrap_servers`).
        redis_url: Redis URL the workers publish to (None: `redis.url`).
        kafka: Kafka connection settings (security protocol, SASL, TLS and client
            certificate; also the default bootstrap servers and topic prefix). None: PLAINTEXT.
        redis: Redis connection settings (ACL user, TLS and client certificate; also the
            default URL and key prefix). None: `redis_url` as it is.
        topic_prefix: must match the workers' `kafka.topic_prefix` (default: the config's,
            else `inflight`).
        key_prefix: must match the workers' `redis.key_prefix` (default: the config's, else
            `inflight`).
        reconnect_s: how long Redis may stay unreachable before `stream` gives up (when no
            `timeout_s` bounds it), seconds.
        results_fallback_s: `result()` looks the job up in the durable results topic once the
            Redis log has shown nothing for this long, and every 10 s after (a Redis that
            restarted empty lost the log of a finished job; its outcome is still there). A
            principal without Read on the results topic just goes without the fallback.
        tracing: PRODUCER spans and W3C trace context in the records' headers
            (`worker.client.tracing`): None while the application has an OpenTelemetry SDK set
            up, True always, False never.
        tracer_provider: the spans' provider (None: OpenTelemetry's global one).
        pools: pools by prompt length (a `Pools` or the `pools` section's list): each job goes
            to the pool serving its prompt length (`worker.client.routing`), counted with
            `tokenizer`; uncounted ones to the default pool.
        tokenizer: the model's tokenizer (an object or a path), for `pools`.
        delivery_timeout_s: how long `submit` and `cancel` wait for Kafka's acknowledgement
            (`acks=all`, idempotent) before raising `KafkaTimeoutError`, seconds. The record
            may still be written after that (the producer keeps retrying it); sending the job
            again with the same `job_id` is safe (a job runs and ends once per id).

    Raises:
        ConfigError: a secret, CA, certificate or key file cannot be read or loaded.
    """

    def __init__(self, bootstrap_servers: str | None = None, redis_url: str | None = None, *,
                 kafka: KafkaConfig | None = None, redis: RedisConfig | None = None,
                 topic_prefix: str | None = None, key_prefix: str | None = None, tombstone_ttl_s: int = 3600,
                 reconnect_s: float = 60.0, results_fallback_s: float = 5.0, tracing: bool | None = None,
                 tracer_provider: Any = None, pools: Pools | list[Pool] | None = None, tokenizer: Any = None,
                 delivery_timeout_s: float = 60.0) -> None:
        kafka = kafka or KafkaConfig()
        if bootstrap_servers is not None:
            kafka = msgspec.structs.replace(kafka, bootstrap_servers=bootstrap_servers)
        redis = redis or RedisConfig()
        if redis_url is not None:
            redis = msgspec.structs.replace(redis, url=redis_url)
        self.kafka_config = kafka
        self.redis_config = redis
        self.bootstrap_servers = kafka.bootstrap_servers
        self.topic_prefix = topic_prefix or kafka.topic_prefix
        self.key_prefix = key_prefix or redis.key_prefix
        self.tombstone_ttl_s = tombstone_ttl_s
        self.reconnect_s = reconnect_s
        self.results_fallback_s = results_fallback_s
        self.delivery_timeout_s = delivery_timeout_s
        self._kafka_security = kafka_security_kwargs(kafka)
        self.results_denied = False
        # Blocking pool: many concurrent streams wait for a connection (for a bounded
        # time: then a ConnectionError, retried as an outage) instead of failing at once.
        pool = redis_pool(redis, max_connections=32, health_check_interval=15,
                          retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), retry_on_error=list(REDIS_DOWN))
        self.redis = aioredis.Redis(connection_pool=pool)
        self.subscriber = SharedSubscriber(self.redis)
        self._producer: AIOKafkaProducer | None = None
        self._results_consumer: AIOKafkaConsumer | None = None
        self._admin: Any = None  # AIOKafkaAdminClient, for live_workers
        self._results_lock = asyncio.Lock()
        self._producer_lock = asyncio.Lock()
        self._lookups: list[tuple[set[str], asyncio.Future]] = []
        self._spans = ProducerSpans(tracing, tracer_provider)
        self.pools = pools if isinstance(pools, Pools) else Pools(pools or ())
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        # jobs sharing a prompt prefix go to one partition (schemas/affinity.py)
        self.affinity = PrefixAffinity(self.kafka_config.affinity_prefix_bytes, self.kafka_config.affinity_window)

    async def __aenter__(self) -> InflightClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _kafka(self) -> AIOKafkaProducer:
        if self._producer is None:
            async with self._producer_lock:  # concurrent first submits: one producer, not one each
                if self._producer is None:
                    self._producer = await self._start_producer()
        return self._producer

    async def _start_producer(self) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all", enable_idempotence=True,
                                    max_request_size=16 * 1024 * 1024, **self._kafka_security)
        try:
            await producer.start()
        except Exception as e:  # explain refused credentials or certificates (aiokafka only logs why)
            await stop_client(producer, "producer")
            err = await probe.diagnose(e, kafka=self.kafka_config)
            if err is not None:
                raise err from None
            raise
        return producer

    async def _send(self, topic: str, value: bytes, key: bytes, attributes: dict[str, Any],
                    partition: int | None = None) -> None:
        produce = self._produce if partition is None else functools.partial(self._produce, partition=partition)
        await self._spans.send(produce, topic, value, key, attributes)

    async def _produce(self, topic: str, value: bytes, key: bytes, headers: list | None, partition: int | None = None):
        producer = await self._kafka()
        try:
            ack = await producer.send(topic, value, key=key, headers=headers, partition=partition)
            # An idempotent producer never gives a record up (no leader, too few in-sync
            # replicas: it retries until the cluster takes it); the caller gets an answer in
            # bounded time, the record keeps its chance.
            async with asyncio.timeout(self.delivery_timeout_s):
                return await asyncio.shield(ack)
        except TimeoutError:
            raise KafkaTimeoutError(f"{topic}: not acknowledged within {self.delivery_timeout_s} s (no leader, or "
                                    "fewer in-sync replicas than min.insync.replicas); it may still be written: "
                                    "sending it again with the same job_id is safe") from None
        except access.KAFKA_AUTHORIZATION as e:
            raise access.explain_kafka(e, self.kafka_config) from None

    async def close(self) -> None:
        """Stop the producer and the results reader and close the Redis connections,
        each step bounded (`stop_client`, `worker.obs.stopping`): at most about 60 s in
        all, whatever a connection waits on."""
        if self._producer is not None:
            await stop_client(self._producer, "producer", timeout_s=10)
            self._producer = None
        if self._results_consumer is not None:
            await stop_client(self._results_consumer, "results", timeout_s=10)
            self._results_consumer = None
        if self._admin is not None:
            await stop_within("client: Kafka admin client", self._admin.close(), 10)
            self._admin = None
        await stop_within("client: pub/sub reader", self.subscriber.close(), 5)
        await stop_within("client: Redis connections", self.redis.aclose(), 5)

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: str = "normal",
        job_id: str | None = None,
        deadline: float | None = None,
        tenant: str | None = None,
        metadata: dict[str, Any] | None = None,
        adapter: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parse_output: bool = False,
    ) -> str:
        """Produce a job to `inflight.jobs.<priority>` (or its pool's); returns its job_id.
        `messages` are OpenAI-style chat messages (tool calls and results included);
        `tools` OpenAI function definitions for the chat template; `params.structured`
        constrains the output; `adapter` a LoRA adapter of the workers' `model.lora_dir`;
        `chat_template_kwargs` more template variables; `parse_output`: the finished event
        carries `content`, `reasoning` and `tool_calls` (see `schemas.wire.Job`).

        Raises:
            ValueError: invalid priority or job fields.
        """
        if priority not in keys.PRIORITIES:
            raise ValueError(f"priority must be one of {list(keys.PRIORITIES)}, got {priority!r}")
        try:
            chat = msgspec.convert(messages, list[ChatMessage]) if messages is not None else None
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid messages: {e}") from None
        job = Job(
            job_id=job_id or uuid.uuid4().hex, prompt=prompt, messages=chat, prompt_token_ids=prompt_token_ids,
            params=params or SamplingParams(),
            tools=tools,
            deadline=deadline,
            tenant=tenant,
            created_at=time.time(),
            metadata=metadata, adapter=adapter, chat_template_kwargs=chat_template_kwargs, parse_output=parse_output,
        )
        try:  # the checks a worker applies (id pattern and length, field constraints)
            decode_job(encode(job))
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid job: {e}") from None
        await self.submit_job(job, priority)
        return job.job_id

    async def submit_job(self, job: Job, priority: str = "normal", *, pool: str | None = None) -> None:
        """Produce an already built job. `pool`: where it routes, when the caller already
        asked `pool_of` (None: routed here).

        Raises:
            AccessError: the principal may not write the job topic (or cannot connect).
        """
        pool = pool or self.pool_of(job)
        topic = keys.job_topic(self.topic_prefix, priority, pool)
        await self._send(topic, encode(job), job.job_id.encode(), {
            "inflight.job_id": job.job_id, "inflight.priority": priority, **({"inflight.tenant": job.tenant}
                                                                            if job.tenant else {})},
            partition=await self.partition_of(topic, job))

    async def partition_of(self, topic: str, job: Job) -> int | None:
        """The partition of `topic` prefix affinity gives `job` (`kafka.affinity_prefix_bytes`;
        the job is counted into the topic's hot-prefix window), or None: its id's, by key."""
        if not self.affinity.enabled:
            return None
        prefix = self.affinity.prefix(job)
        if prefix is None:
            return None
        producer = await self._kafka()
        partitions = await producer.partitions_for(topic)  # cached metadata after the first
        return self.affinity.partition(topic, job, len(partitions), prefix) if partitions else None

    def pool_of(self, job: Job) -> str:
        """The pool `job` routes to (`worker.client.routing.pool_for`: by its prompt's
        tokens when pools route and a tokenizer is loaded, else the default pool)."""
        return pool_for(self.pools, job, self.tokenizer)

    async def partitions_for(self, topic: str) -> set[int]:
        """The partition ids of `topic` (fetching its metadata; empty if it does not exist).

        Raises:
            AccessError: refused credentials or certificates.
        """
        return await (await self._kafka()).partitions_for(topic) or set()

    async def ping_kafka(self) -> None:
        """Check that the cluster answers (`worker.security.kafka.ping_cluster`: a
        metadata request for no topics, whatever the cluster's size).

        Raises:
            KafkaError: the cluster did not answer; AccessError: refused.
        """
        await ping_cluster(await self._kafka())

    async def live_workers(self, group_id: str | None = None) -> dict[str, int]:
        """Live workers per pool: members of each pool's consumer group subscribed to its
        job topics (`worker.client.fleet`). `group_id`: `kafka.group_id` (None: this
        client's Kafka config's).

        Raises:
            KafkaError: the cluster did not answer; GroupAuthorizationFailedError: the
                principal may not describe a pool's group.
        """
        if self._admin is None:
            from aiokafka.admin import AIOKafkaAdminClient

            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, client_id="inflight-fleet",
                                        **self._kafka_security)
            try:
                await admin.start()
            except BaseException:
                await stop_within("client: Kafka admin client", admin.close(), 10)
                raise
            self._admin = admin
        groups = fleet.pool_groups(self.pools, group_id or self.kafka_config.group_id, self.topic_prefix)
        return await fleet.live_workers(self._admin, groups)

    async def cancel(self, job_id: str, reason: str | None = None) -> None:
        """Cancel a job wherever it is. Also sets the tombstone directly when this Redis
        user may (SET on `inflight:job:*:cancelled`), so a job that no worker has consumed
        yet is dropped on arrival even if no worker is running; without that permission
        the worker sets it when it reads the cancel message. The tombstone is a shortcut:
        when Redis cannot take it (a reader-only user, an outage, a Sentinel failover in
        progress) the cancel message alone still cancels the job."""
        try:
            await self.redis.set(keys.cancelled_key(job_id, self.key_prefix), b"1", ex=self.tombstone_ttl_s)
        except NoPermissionError:  # a reader-only user: the cancel message is enough
            pass
        except REDIS_DOWN as e:  # ... and so it is while Redis is away
            log.info("cancel %s: no tombstone while Redis is unreachable (%r); the cancel message carries it",
                     job_id, e)
        await self._send(keys.cancel_topic(self.topic_prefix), encode(Cancel(job_id=job_id, reason=reason)),
                         job_id.encode(), {"inflight.job_id": job_id})

    async def read_log(self, job_id: str, after_seq: int = -1, *, tenant: str | None = None) -> list[Event]:
        """Events already in the job's log with seq > after_seq, in order; a finished job's
        compacted log gives the same events, seq for seq (`schemas.replay`). `tenant`:
        the job's tenant (its log is under the tenant's keys).

        Raises:
            ValueError: invalid tenant id.
            AccessError: this Redis user may not read that log (NOPERM), or refused.
        """
        try:
            entries = await self.redis.xrange(keys.log_key(job_id, self.key_prefix, check_tenant(tenant)))
        except NoPermissionError as e:
            raise access.explain_redis(e, self.redis_config) from None
        out = []
        for _, fields in entries:
            entry = entry_of(fields)
            if entry.seq > after_seq:
                out += [ev for ev in expand(entry) if ev.seq > after_seq]
        return out

    def stream(self, job_id: str, *, tenant: str | None = None, timeout_s: float | None = None,
               poll_s: float = 1.0, fallback: bool = False) -> AsyncIterator[Event]:
        """Yield the job's events in `seq` order, each once, ending with `finished`.
        `tenant`: the job's tenant (submitted with one, it streams on the tenant's keys).

        Connection errors (a Redis restart, a failover) are retried with backoff until
        `timeout_s` (or for `reconnect_s` of continuous failure when there is no
        timeout); after a reconnect the channel is subscribed again and the log re-read
        from the last seq yielded. With `fallback`, a job whose log stays empty is also
        looked up in the durable results topic (its `finished` is yielded alone).

        Raises:
            TimeoutError: no terminal event within `timeout_s`.
            redis.exceptions.ConnectionError: Redis unreachable for longer than allowed.
            ValueError: invalid tenant id.
            AccessError: wrong credentials, an untrusted certificate, or this Redis user
                may not subscribe to / read the job's channel and log (NOPERM).
        """
        return JobStream(self, job_id, tenant=tenant, timeout_s=timeout_s, poll_s=poll_s, fallback=fallback).events()

    async def result(self, job_id: str, timeout_s: float | None = None, *, tenant: str | None = None) -> Finished:
        """Wait for the job's terminal event; falls back to the durable results topic when
        the Redis log stays empty (see `results_fallback_s`).

        Raises:
            TimeoutError: no terminal event within `timeout_s`.
            AccessError: see `stream`.
        """
        async with contextlib.aclosing(self.stream(job_id, tenant=tenant, timeout_s=timeout_s,
                                                   fallback=True)) as events:
            async for ev in events:
                if isinstance(ev, Finished):
                    return ev
        raise RuntimeError("unreachable: a stream ends with its finished event")

    async def lookup_results(self, job_ids: list[str], timeout_s: float = 30.0) -> dict[str, Finished]:
        """The recorded terminal events of `job_ids` from the durable results topic (jobs
        not finished yet are absent). Concurrent lookups share one scan.

        Raises:
            AccessError: the principal may not read the results topic (or is refused).
        """
        from worker.client.results import read_results

        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lookups.append((set(job_ids), fut))
        async with self._results_lock:
            if not fut.done():
                batch, self._lookups = self._lookups, []
                try:
                    if self._results_consumer is None:
                        self._results_consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers,
                                                                  group_id=None, enable_auto_commit=False,
                                                                  **self._kafka_security)
                        await self._results_consumer.start()
                    wanted = sorted(set().union(*(ids for ids, _ in batch)))
                    producer = await self._kafka()
                    found = await read_results(self._results_consumer, producer.partitions_for, self.topic_prefix,
                                               wanted, timeout_s)
                except Exception as e:  # every waiter of this scan gets the (explained) failure
                    err = await probe.diagnose(e, kafka=self.kafka_config) or e
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(err)
                else:
                    for ids, f in batch:
                        f.set_result({j: found[j] for j in ids if j in found})
        return await fut


__all__ = ["InflightClient"]
