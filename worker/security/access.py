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

This module classifies; `worker.security.probe` connects (`verify_access`, `diagnose`).
Callers: `Worker.start` (`verify_access`, before the model loads), the intake and
result/DLQ writers (authorization errors are fatal, not retried), `/readyz`, the CLI,
`InflightClient`.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from aiokafka import errors as kerr
from redis import exceptions as rex

if TYPE_CHECKING:
    from worker.config import KafkaConfig, RedisConfig

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
def worker_needs(cfg: KafkaConfig, resource: str) -> str:
    """The operations the ACL recipe gives the worker on `resource` (a topic or group)."""
    from worker.security.acl import kafka_acls

    for row in kafka_acls(cfg.topic_prefix, cfg.group_id, worker="worker", producer="producer"):
        if row.principal == "worker" and resource in row.names:
            return " + ".join(row.operations)
    return "Read / Write + Describe"


def principal_setting(cfg: KafkaConfig) -> str:
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
                           f"{who} may not use topic {topic!r} (a worker needs {worker_needs(cfg, topic)} on it; "
                           "`inflight acl kafka` prints the grants)", f"the ACLs of {principal_setting(cfg)}")
    if isinstance(e, kerr.GroupAuthorizationFailedError):
        return AccessError("Kafka", EXIT_AUTHORIZATION,
                           f"{who} may not use consumer group {cfg.group_id!r} (a worker needs "
                           f"{worker_needs(cfg, cfg.group_id)} on it)", f"kafka.group_id and the ACLs of "
                           f"{principal_setting(cfg)}")
    if isinstance(e, KAFKA_AUTHORIZATION):
        return AccessError("Kafka", EXIT_AUTHORIZATION, f"{who} was refused{at}: {type(e).__name__}",
                           f"the ACLs of {principal_setting(cfg)}")
    if isinstance(e, kerr.SaslAuthenticationFailed):
        return AccessError("Kafka", EXIT_AUTHENTICATION,
                           f"the broker{at} refused the credentials of {who}: wrong password or unknown user",
                           "kafka.sasl_username and kafka.sasl_password / kafka.sasl_password_file")
    if isinstance(e, (kerr.UnsupportedSaslMechanismError, kerr.IllegalSaslStateError)):
        return AccessError("Kafka", EXIT_AUTHENTICATION,
                           f"the listener{at} does not accept SASL mechanism {cfg.sasl_mechanism}",
                           "kafka.sasl_mechanism and kafka.security_protocol")
    tls = explain_tls(e, "Kafka", "kafka", cfg.ssl_certfile is not None, at)
    if tls is not None:
        return tls
    if where is not None and (isinstance(e, (ConnectionRefusedError, TimeoutError)) or (
            isinstance(e, OSError) and not isinstance(e, ssl.SSLError) and e.errno is not None
            and not isinstance(e, ConnectionResetError))):  # only a connection attempt of ours says "unreachable"
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        return AccessError("Kafka", EXIT_UNREACHABLE, f"cannot connect{at} ({why})", "kafka.bootstrap_servers")
    return None


def explain_tls(e: BaseException, service: str, section: str, has_cert: bool, at: str) -> AccessError | None:
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


# ---- Redis ----------------------------------------------------------------------------
_TLS_REJECTIONS = ("UNKNOWN_CA", "CERTIFICATE_UNKNOWN", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED")


def is_fatal_redis(e: BaseException) -> bool:
    """Wrong credentials, an untrusted or rejected certificate, or a missing ACL
    permission: redis-py reports the first two as ConnectionErrors, which a caller would
    otherwise retry as an outage. (Other TLS errors, such as a connection cut mid-record
    by a restarting server, stay retriable.)"""
    if isinstance(e, (rex.AuthenticationError, rex.NoPermissionError, AccessError)) or script_refused(e):
        return True
    ctx = e.__context__
    return isinstance(e, rex.ConnectionError) and (
        isinstance(ctx, ssl.SSLCertVerificationError)
        or (isinstance(ctx, ssl.SSLError) and any(a in str(ctx) for a in _TLS_REJECTIONS)))


def script_refused(e: BaseException) -> bool:
    """A Lua script stopped by the user's ACL: Redis checks each command and key a script
    touches, and answers a refusal inside one as a plain error reply ("The user executing
    the script can't run this command ..." / "... can't access at least one of the keys
    ..."), which redis-py raises as a ResponseError, not a NoPermissionError."""
    return isinstance(e, rex.ResponseError) and "user executing the script can't" in str(e)


def explain_redis(e: BaseException, cfg: RedisConfig) -> AccessError | None:
    """The AccessError `e` stands for, or None (unreachable for now, or unknown)."""
    if isinstance(e, AccessError):
        return e
    at = f" at {_redis_where(cfg)}"
    if isinstance(e, rex.AuthenticationError):
        return AccessError("Redis", EXIT_AUTHENTICATION, f"the server{at} refused user {cfg.user()!r}: {e}",
                           "redis.username and redis.password / redis.password_file (or the URL's credentials)")
    if isinstance(e, rex.NoPermissionError) or script_refused(e):
        return AccessError("Redis", EXIT_AUTHORIZATION, f"user {cfg.user()!r} was refused: {e} (a worker needs the "
                           "rules of `inflight acl redis worker`)", "redis.username and its ACL rules, redis.key_prefix")
    if isinstance(e, rex.ConnectionError):
        tls = explain_tls(e, "Redis", "redis", cfg.ssl_certfile is not None, at)
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

    if cfg.sentinel is not None:
        hosts = ",".join(f"{h}:{p}" for h, p in cfg.sentinel.sentinels)
        return f"the master {cfg.sentinel.service!r} of the Sentinels {hosts}"
    parts = urlsplit(cfg.url)
    return f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path
