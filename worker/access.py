"""Failures that retrying cannot fix: wrong credentials, an untrusted or missing
certificate, a security protocol that does not match the listener, a missing ACL. Each
becomes one `AccessError`: one line naming the service, the cause and the setting to
check, never a secret, and a documented exit code:

    1  unreachable (nothing answers; also a Redis outage longer than its limit)
    2  invalid configuration (existing; `ConfigError`)
    3  authentication failed (wrong password, unknown user, unsupported SASL mechanism)
    4  TLS or protocol mismatch (untrusted server certificate, client certificate
       rejected or missing, TLS spoken to a plaintext port or the reverse)
    5  not authorized (a missing Kafka ACL or Redis ACL permission)

aiokafka hides the cause of a failed bootstrap ("Unable to bootstrap from …"; the reason
goes to its log), so `diagnose` connects once more itself (`aiokafka.conn.create_conn`,
then, for a TLS failure, a raw handshake that surfaces the broker's alert) to name it.
Callers: `Worker.start` (`verify_access`, before the model loads), the intake and
result/DLQ writers (authorization errors are fatal, not retried), `/readyz`, the CLI,
`InflightClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from typing import TYPE_CHECKING

from aiokafka import errors as kerr
from redis import exceptions as rex

from schemas import keys

if TYPE_CHECKING:
    from worker.config import KafkaConfig, RedisConfig, WorkerConfig

EXIT_UNREACHABLE = 1
EXIT_CONFIG = 2
EXIT_AUTHENTICATION = 3
EXIT_TLS = 4
EXIT_AUTHORIZATION = 5
_KIND = {EXIT_UNREACHABLE: "unreachable", EXIT_AUTHENTICATION: "authentication failed",
         EXIT_TLS: "TLS / protocol mismatch", EXIT_AUTHORIZATION: "not authorized"}

KAFKA_AUTHORIZATION = (kerr.TopicAuthorizationFailedError, kerr.GroupAuthorizationFailedError,
                       kerr.ClusterAuthorizationFailedError, kerr.TransactionalIdAuthorizationFailed)
KAFKA_AUTHENTICATION = (kerr.SaslAuthenticationFailed, kerr.UnsupportedSaslMechanismError,
                        kerr.IllegalSaslStateError)


class AccessError(Exception):
    """A connection or permission failure that retrying cannot fix. `str()` is the one
    line to show; `exit_code` one of the module's EXIT_* codes."""

    def __init__(self, service: str, exit_code: int, detail: str, setting: str) -> None:
        self.service = service
        self.exit_code = exit_code
        self.detail = detail
        self.setting = setting
        super().__init__(f"{service} {_KIND[exit_code]}: {detail}; check {setting}")

    @property
    def cause(self) -> str:
        return _KIND[self.exit_code]


def is_fatal_kafka(e: BaseException) -> bool:
    """An authentication or authorization error (not a transient broker condition)."""
    return isinstance(e, (*KAFKA_AUTHORIZATION, *KAFKA_AUTHENTICATION, AccessError, Refused))


class Refused(Exception):
    """A Kafka authorization or authentication error raised where retrying would hide it
    (the DLQ and results writers, whose callers retry every KafkaError): carries the
    broker's error in `error`, explained by `diagnose` with the config."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(repr(error))


def raise_if_refused(e: BaseException) -> None:
    """Re-raise `e` as `Refused` when it is fatal (see `is_fatal_kafka`)."""
    if isinstance(e, (*KAFKA_AUTHORIZATION, *KAFKA_AUTHENTICATION)):
        raise Refused(e) from e


# ---- Kafka ----------------------------------------------------------------------------
def _worker_needs(cfg: KafkaConfig, resource: str) -> str:
    """The operations the ACL recipe gives the worker on `resource` (a topic or group)."""
    from worker.acl import kafka_acls

    for row in kafka_acls(cfg.topic_prefix, cfg.group_id, worker="worker", producer="producer"):
        if row.principal == "worker" and resource in row.names:
            return " + ".join(row.operations)
    return "Read / Write + Describe"


def _principal_setting(cfg: KafkaConfig) -> str:
    if cfg.security_protocol.startswith("SASL_"):
        return "kafka.sasl_username"
    return "kafka.ssl_certfile" if cfg.ssl_certfile else "kafka.security_protocol"


def explain_kafka(e: BaseException, cfg: KafkaConfig, where: str | None = None) -> AccessError | None:
    """The AccessError `e` stands for, or None (a transient or unknown failure).
    `where` is the broker address, when known."""
    if isinstance(e, AccessError):
        return e
    if isinstance(e, Refused):
        e = e.error
    at = f" at {where}" if where else ""
    who = cfg.principal()
    if isinstance(e, kerr.TopicAuthorizationFailedError):
        topic = str(e.args[0]) if e.args else "?"
        return AccessError("Kafka", EXIT_AUTHORIZATION,
                           f"{who} may not use topic {topic!r} (a worker needs {_worker_needs(cfg, topic)} on it; "
                           "`inflight acl kafka` prints the grants)", f"the ACLs of {_principal_setting(cfg)}")
    if isinstance(e, kerr.GroupAuthorizationFailedError):
        return AccessError("Kafka", EXIT_AUTHORIZATION,
                           f"{who} may not use consumer group {cfg.group_id!r} (a worker needs "
                           f"{_worker_needs(cfg, cfg.group_id)} on it)", f"kafka.group_id and the ACLs of "
                           f"{_principal_setting(cfg)}")
    if isinstance(e, KAFKA_AUTHORIZATION):
        return AccessError("Kafka", EXIT_AUTHORIZATION, f"{who} was refused{at}: {type(e).__name__}",
                           f"the ACLs of {_principal_setting(cfg)}")
    if isinstance(e, kerr.SaslAuthenticationFailed):
        return AccessError("Kafka", EXIT_AUTHENTICATION,
                           f"the broker{at} refused the credentials of {who}: wrong password or unknown user",
                           "kafka.sasl_username and kafka.sasl_password / kafka.sasl_password_file")
    if isinstance(e, (kerr.UnsupportedSaslMechanismError, kerr.IllegalSaslStateError)):
        return AccessError("Kafka", EXIT_AUTHENTICATION,
                           f"the listener{at} does not accept SASL mechanism {cfg.sasl_mechanism}",
                           "kafka.sasl_mechanism and kafka.security_protocol")
    tls = _explain_tls(e, "Kafka", "kafka", cfg.ssl_certfile is not None, at)
    if tls is not None:
        return tls
    if where is not None and (isinstance(e, (ConnectionRefusedError, TimeoutError)) or (
            isinstance(e, OSError) and not isinstance(e, ssl.SSLError) and e.errno is not None
            and not isinstance(e, ConnectionResetError))):  # only a connection attempt of ours says "unreachable"
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        return AccessError("Kafka", EXIT_UNREACHABLE, f"cannot connect{at} ({why})", "kafka.bootstrap_servers")
    return None


def _explain_tls(e: BaseException, service: str, section: str, has_cert: bool, at: str) -> AccessError | None:
    """TLS failures, from the exception or its context (redis-py wraps them)."""
    for err in (e, e.__context__, e.__cause__):
        if isinstance(err, ssl.SSLCertVerificationError):
            why = getattr(err, "verify_message", None) or getattr(err, "reason", None) or str(err)
            if getattr(err, "verify_code", None) == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
                return AccessError(service, EXIT_TLS, f"the server's certificate{at} does not name this host "
                                   f"({why})", f"the host in {section}."
                                   f"{'bootstrap_servers' if section == 'kafka' else 'url'} or "
                                   f"{section}.ssl_check_hostname")
            return AccessError(service, EXIT_TLS, f"the server's certificate{at} is not trusted ({why})",
                               f"{section}.ssl_cafile")
        if isinstance(err, ssl.SSLError):
            text = str(err)
            if any(a in text for a in ("UNKNOWN_CA", "CERTIFICATE_UNKNOWN", "BAD_CERTIFICATE",
                                       "CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE")):
                if not has_cert:
                    return AccessError(service, EXIT_TLS, f"the server{at} requires a client certificate",
                                       f"{section}.ssl_certfile and {section}.ssl_keyfile")
                return AccessError(service, EXIT_TLS, f"the server{at} rejected the client certificate "
                                   f"({getattr(err, 'reason', None) or text}): not signed by a CA it trusts, or not valid",
                                   f"{section}.ssl_certfile")
            if any(a in text for a in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                                       "UNEXPECTED_EOF", "record layer failure", "wrong version number")):
                return AccessError(service, EXIT_TLS, f"the TLS handshake{at} failed ({getattr(err, 'reason', None) or text}): the "
                                   "port probably does not speak TLS",
                                   f"{section}.security_protocol" if section == "kafka" else "redis.url (redis://)")
            return AccessError(service, EXIT_TLS, f"TLS failed{at} ({getattr(err, 'reason', None) or text})", f"{section}.ssl_*")
    return None


async def probe_kafka(cfg: KafkaConfig, timeout_s: float = 10.0) -> None:
    """Connect to each bootstrap server once, with `cfg`'s security, as aiokafka's
    bootstrap does; return at the first that accepts.

    Raises:
        AccessError: every server failed; the error of the first, with its cause.
        ConfigError: a secret or certificate file cannot be read.
    """
    from aiokafka.conn import create_conn

    from worker.kafka_security import kafka_security_kwargs

    security = kafka_security_kwargs(cfg)
    first: AccessError | None = None
    for hostport in cfg.bootstrap_servers.split(","):
        host, _, port = hostport.strip().rpartition(":")
        where = f"{host}:{port}"
        try:
            conn = await asyncio.wait_for(create_conn(host, int(port), request_timeout_ms=int(timeout_s * 1000),
                                                      client_id="inflight-probe", **security), timeout_s)
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
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx, server_hostname=host),
                                                timeout_s)
        body = struct.pack(">hhih", 18, 0, 1, 5) + b"probe"
        writer.write(struct.pack(">i", len(body)) + body)
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(4), timeout_s)
        writer.close()
        return None
    except Exception as e:  # classified; None when it says nothing more
        return _explain_tls(e, "Kafka", "kafka", cfg.ssl_certfile is not None, f" at {where}")


async def check_kafka_permissions(cfg: KafkaConfig, timeout_s: float = 10.0) -> None:
    """What a worker's principal must see: its topics (Describe, via metadata). The group
    is not probed here: a FindCoordinator request would create the offsets topic on a
    fresh broker ahead of the consumer, and the consumer's own join reports a refused
    group at once. Read and Write show only when used; the intake and the writers treat
    every refusal as fatal (exit 5).

    Raises:
        AccessError: naming the topics the principal may not use.
        ConfigError: topics of `kafka.topic_prefix` do not exist (names them).
    """
    from aiokafka.admin import AIOKafkaAdminClient

    from worker.kafka_security import kafka_security_kwargs

    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers, client_id="inflight-probe",
                                request_timeout_ms=int(timeout_s * 1000), **kafka_security_kwargs(cfg))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        wanted = keys.all_topics(cfg.topic_prefix)
        denied, missing = await _unusable_topics(admin, wanted, timeout_s)
        if missing and not denied:
            from worker.config import ConfigError

            raise ConfigError(f"kafka.topic_prefix {cfg.topic_prefix!r}: topics {', '.join(missing)} do not exist; "
                              f"create them: inflight topics create --prefix {cfg.topic_prefix}")
        if len(denied) == 1:
            raise explain_kafka(kerr.TopicAuthorizationFailedError(denied[0]), cfg)
        if denied:
            needs = "; ".join(f"{t}: {_worker_needs(cfg, t)}" for t in denied)
            raise AccessError("Kafka", EXIT_AUTHORIZATION, f"{cfg.principal()} may not use topics {', '.join(denied)} "
                              f"(a worker needs {needs}; `inflight acl kafka` prints the grants)",
                              f"the ACLs of {_principal_setting(cfg)}")

    finally:
        with contextlib.suppress(Exception):  # closing a client that never connected
            await admin.close()


async def _unusable_topics(admin, wanted: list[str], timeout_s: float) -> tuple[list[str], list[str]]:
    """(topics of `wanted` the principal may not describe, topics that do not exist), in
    `wanted`'s order. Listing every topic never creates one; only topics absent from that
    list are then named, in a Metadata request that forbids auto-creation (naming a
    missing topic could create it on a broker with `auto.create.topics.enable`)."""
    from aiokafka.protocol.metadata import MetadataRequest

    visible = {t["topic"] for t in await asyncio.wait_for(admin.describe_topics(), timeout_s) if t["error_code"] == 0}
    absent = [t for t in wanted if t not in visible]
    send = getattr(admin, "_send_request", None)
    if not absent or send is None:  # (aiokafka changed: cannot tell; a refusal is reported when met)
        return [], []
    resp = await asyncio.wait_for(send(MetadataRequest(absent, allow_auto_topic_creation=False)), timeout_s)
    codes = {t["topic"]: t["error_code"] for t in resp.to_object()["topics"]}
    return ([t for t in absent if codes.get(t) == kerr.TopicAuthorizationFailedError.errno],
            [t for t in absent if codes.get(t) == kerr.UnknownTopicOrPartitionError.errno])


# ---- Redis ----------------------------------------------------------------------------
_TLS_REJECTIONS = ("UNKNOWN_CA", "CERTIFICATE_UNKNOWN", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED")


def is_fatal_redis(e: BaseException) -> bool:
    """Wrong credentials, an untrusted or rejected certificate, or a missing ACL
    permission: redis-py reports the first two as ConnectionErrors, which a caller would
    otherwise retry as an outage. (Other TLS errors, such as a connection cut mid-record
    by a restarting server, stay retriable.)"""
    if isinstance(e, (rex.AuthenticationError, rex.NoPermissionError, AccessError)):
        return True
    ctx = e.__context__
    return isinstance(e, rex.ConnectionError) and (
        isinstance(ctx, ssl.SSLCertVerificationError)
        or (isinstance(ctx, ssl.SSLError) and any(a in str(ctx) for a in _TLS_REJECTIONS)))


def explain_redis(e: BaseException, cfg: RedisConfig) -> AccessError | None:
    """The AccessError `e` stands for, or None (unreachable for now, or unknown)."""
    if isinstance(e, AccessError):
        return e
    at = f" at {_redis_where(cfg)}"
    if isinstance(e, rex.AuthenticationError):
        return AccessError("Redis", EXIT_AUTHENTICATION, f"the server{at} refused user {cfg.user()!r}: {e}",
                           "redis.username and redis.password / redis.password_file (or the URL's credentials)")
    if isinstance(e, rex.NoPermissionError):
        return AccessError("Redis", EXIT_AUTHORIZATION, f"user {cfg.user()!r} was refused: {e} (a worker needs the "
                           "rules of `inflight acl redis worker`)", "redis.username and its ACL rules, redis.key_prefix")
    if isinstance(e, rex.ConnectionError):
        tls = _explain_tls(e, "Redis", "redis", cfg.ssl_certfile is not None, at)
        if tls is not None:
            return tls
        if isinstance(e.__context__, ConnectionResetError):
            if cfg.uses_tls and not cfg.ssl_certfile:
                return AccessError("Redis", EXIT_TLS, f"the server{at} closed the TLS connection: it probably "
                                   "requires a client certificate", "redis.ssl_certfile and redis.ssl_keyfile")
            if not cfg.uses_tls:
                return AccessError("Redis", EXIT_TLS, f"the server{at} closed the connection: a TLS-only server "
                                   "needs a rediss:// URL", "redis.url")
    return None


def _redis_where(cfg: RedisConfig) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(cfg.url)
    return f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path


async def probe_redis(cfg: RedisConfig, timeout_s: float = 10.0) -> None:
    """PING as the configured user, then the commands and keys a worker needs outside
    its scripts (GET / SET / EXISTS of the epoch key, SCRIPT LOAD).

    Raises:
        AccessError: authentication, TLS or permission failure, or Redis unreachable.
    """
    from worker.claims import TAKE_LUA
    from worker.redis_security import redis_client

    client = redis_client(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await client.ping()
        await client.exists(keys.epoch_key(cfg.key_prefix))
        await client.script_load(TAKE_LUA)
    except (rex.RedisError, OSError) as e:
        err = explain_redis(e, cfg)
        if err is None:
            err = AccessError("Redis", EXIT_UNREACHABLE, f"{cfg.safe_url()}: {str(e)[:200]}", "redis.url")
        raise err from None
    finally:
        await client.aclose()


# ---- both -----------------------------------------------------------------------------
async def verify_access(cfg: WorkerConfig, timeout_s: float = 10.0) -> None:
    """Before a worker starts (and loads its model): Redis accepts its user, Kafka its
    credentials and certificates, and its principal sees its topics.

    Raises:
        AccessError: the first failure, explained. An unreachable Kafka is left to the
            clients' own retries (a broker may be starting), so it raises nothing here.
        ConfigError: a secret or certificate file cannot be read.
    """
    await probe_redis(cfg.redis, timeout_s)
    try:
        await probe_kafka(cfg.kafka, timeout_s)
    except AccessError as e:
        if e.exit_code == EXIT_UNREACHABLE:
            return
        raise
    await check_kafka_permissions(cfg.kafka, timeout_s)


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
