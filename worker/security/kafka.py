"""Kafka client security settings, shared by every Kafka client the project makes
(intake, cancel listener, the worker's producer, topic admin, preflight, InflightClient,
benchmarks), so each one connects in every mode the config allows: PLAINTEXT, SSL
(optionally with a client certificate: mutual TLS), SASL_PLAINTEXT and SASL_SSL with
PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; and what every part does with a client besides
producing and consuming: stopping it (`stop_client`) and asking the cluster about
itself at a cost that does not grow with it (`ping_cluster`, `topic_metadata`)."""

from __future__ import annotations

import os
import ssl
from typing import TYPE_CHECKING

from worker.config import ConfigError

if TYPE_CHECKING:
    from worker.config import KafkaConfig


class KafkaUnavailable(RuntimeError):
    """Kafka stayed unreachable longer than `kafka.outage_limit_s` (see
    `worker/serve/kafka_outage.py`): the worker stops, exit 1."""


def kafka_security_kwargs(cfg: KafkaConfig) -> dict:
    """aiokafka keyword arguments for `cfg`'s security settings (any aiokafka client:
    consumer, producer, admin). PLAINTEXT gives only `security_protocol`.

    Secrets are read from their files here (each call), so a rotated password file is
    picked up by the next client made.

    Raises:
        ConfigError: a secret or certificate file cannot be read, or the client
            certificate does not load (wrong key, wrong key password); the message names
            the setting, never a secret.
    """
    kw: dict = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol.startswith("SASL_"):
        kw.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                  sasl_plain_password=cfg.password())
    if cfg.uses_tls:
        kw["ssl_context"] = tls_context("kafka", cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile,
                                        keyfile=cfg.ssl_keyfile, key_password=cfg.key_password(),
                                        check_hostname=cfg.ssl_check_hostname)
    return kw


def tls_context(section: str, *, cafile: str | None, certfile: str | None, keyfile: str | None,
                key_password: str | None, check_hostname: bool = True) -> ssl.SSLContext:
    """A client TLS context: verifies the server against `cafile` (the system's CAs when
    None) and its host name (unless `check_hostname` is False), presents `certfile` (+
    `keyfile`, decrypted with `key_password`) when given.

    Raises:
        ConfigError: naming `<section>.ssl_cafile`, `<section>.ssl_certfile` /
            `ssl_keyfile` or `<section>.ssl_key_password` with the reason.
    """
    try:
        ctx = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"{section}.ssl_cafile: cannot load CA certificates from {cafile!r} ({_why(e)})") from None
    ctx.check_hostname = check_hostname
    if certfile:
        try:
            # never None: OpenSSL would prompt on the terminal for an encrypted key's password
            ctx.load_cert_chain(certfile, keyfile, password=key_password if key_password else _no_password)
        except FileNotFoundError:
            missing = next((p for p in (certfile, keyfile) if p and not os.path.exists(p)), certfile)
            raise ConfigError(f"{section}.ssl_certfile / ssl_keyfile: {missing!r} does not exist") from None
        except ssl.SSLError as e:
            hint = ""
            if "BAD_DECRYPT" in str(e) or "bad decrypt" in str(e).lower():
                hint = f"; is {section}.ssl_key_password right?"
            elif key_password is None and "PEM" in str(e):
                hint = f"; an encrypted key needs {section}.ssl_key_password(_file)"
            raise ConfigError(f"{section}.ssl_certfile / ssl_keyfile: cannot load the client certificate "
                              f"{certfile!r} ({_why(e)}){hint}") from None
        except OSError as e:
            raise ConfigError(f"{section}.ssl_certfile / ssl_keyfile: cannot read {certfile!r} ({_why(e)})") from None
    return ctx


def _no_password() -> bytes:
    return b""


def _why(e: BaseException) -> str:
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__


async def stop_client(client, name: str, timeout_s: float = 15.0) -> None:
    """Stop an aiokafka consumer or producer within `timeout_s` (seconds) and close its
    connections whatever its `stop()` did, each step bounded (`worker.obs.stopping`): at
    most `timeout_s` + 8 s in all. The one way every part of Inflight stops a Kafka
    client: aiokafka 0.14's `AIOKafkaConsumer.stop()` re-raises the cancellation of its
    own pending fetch tasks (aio-libs/aiokafka#647), which left the client open
    ("Unclosed AIOKafkaConsumer") and a traceback (or a dead task) behind. A cancellation
    of the caller itself propagates."""
    import asyncio

    import structlog

    from worker.obs.stopping import stop_within

    if await stop_within(f"Kafka client {name}: stop", client.stop(), timeout_s):
        return
    structlog.get_logger(__name__).warning("Kafka client did not stop cleanly; closing its connections",
                                           component=name)
    fetcher = getattr(client, "_fetcher", None)
    pending = [t for t in getattr(fetcher, "_pending_tasks", ()) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await stop_within(f"Kafka client {name}: its fetch tasks", asyncio.gather(*pending, return_exceptions=True), 2)
    inner = getattr(client, "_client", None)
    if inner is not None:
        await stop_within(f"Kafka client {name}: close connections", inner.close(), 5)


def _inner(client):
    """The `AIOKafkaClient` of an aiokafka producer (`client`), consumer or admin client
    (`_client`), or `client` itself."""
    return getattr(client, "_client", None) or getattr(client, "client", None) or client


async def _metadata(client, topics: list[str]):
    """A metadata request for `topics` only (an empty list: none, only the brokers: from
    Metadata v1 on, i.e. brokers of Kafka 0.10 and later; v0 read it as every topic),
    never creating a topic (`allow_auto_topic_creation` false), to each known broker in
    turn until one answers. Returns the response; raises the last broker's KafkaError."""
    import random

    from aiokafka.errors import KafkaConnectionError, KafkaError
    from aiokafka.protocol.metadata import MetadataRequest

    inner = _inner(client)
    nodes = [b.nodeId for b in inner.cluster.brokers()]
    random.shuffle(nodes)
    last: BaseException = KafkaConnectionError("no Kafka broker is known to this client")
    for node in nodes:
        try:
            resp = await inner.send(node, MetadataRequest(topics, allow_auto_topic_creation=False))
        except (TimeoutError, KafkaError) as e:
            last = e
            continue
        if resp.brokers:
            return resp
        last = KafkaError(f"broker {node} answered a metadata request with no brokers")
    raise last


async def ping_cluster(client) -> None:
    """Check that the Kafka cluster answers, at a cost that does not grow with the
    cluster: a metadata request for no topics (the brokers and the controller only).
    `client`: a started aiokafka producer, consumer or admin client.

    The whole cluster's metadata (aiokafka's `fetch_all_metadata`, `consumer.topics()`,
    `admin.list_topics()`) is an entry per topic and partition, decoded in Python on the
    caller's event loop: ~90 ms of CPU per call with 1 600 topics on the 2-core box, a
    stall of every stream the gateway serves at each readiness check.

    Raises:
        KafkaError (aiokafka): no known broker answered (the last one's error).
    """
    await _metadata(client, [])


async def topic_metadata(client, names: list[str]) -> list[dict]:
    """The metadata of `names` only, as aiokafka's `describe_topics` gives it (a dict per
    topic: `topic`, `error_code`, `partitions`, ...), from one request that never
    auto-creates a topic, whatever the broker's `auto.create.topics.enable` (brokers
    of Kafka 1.0 and later; `describe_topics(names)` asks for auto-creation). A missing
    topic has error code 3 (UNKNOWN_TOPIC_OR_PARTITION), one this principal may not
    describe 29 (TOPIC_AUTHORIZATION_FAILED).

    Raises:
        KafkaError (aiokafka): no known broker answered.
    """
    return (await _metadata(client, list(names))).to_object()["topics"]


async def existing_topics(client, names: list[str]) -> set[str]:
    """Which of `names` exist and may be described by this principal (`topic_metadata`);
    one it may not describe counts as missing, as in the whole cluster's listing.

    Raises:
        KafkaError (aiokafka): no known broker answered.
    """
    return {t["topic"] for t in await topic_metadata(client, names) if t["error_code"] == 0}


async def partition_ids(client, topic: str) -> set[int]:
    """The partition ids of `topic` (empty when it does not exist or may not be
    described; `topic_metadata`).

    Raises:
        KafkaError (aiokafka): no known broker answered.
    """
    return {p["partition"] for t in await topic_metadata(client, [topic]) if t["error_code"] == 0
            for p in t["partitions"]}
