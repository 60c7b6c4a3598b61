"""Redis clients made from a `RedisConfig`: the one place that turns the URL, the ACL user
and the TLS settings into redis-py arguments, used by the worker, `inflight check`, the
InflightClient and the benchmarks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.security.kafka import tls_context

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, TimeoutError)
"""What "Redis is unreachable" looks like from redis-py (its errors are not the builtin
ones): an outage to wait out, unless `access.is_fatal_redis` says it is a refusal. The
one definition every Redis user here catches (worker, client, CLI)."""


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable longer than `redis.outage_limit_s`: the worker stops so
    its partitions move to other workers (its jobs are redelivered)."""

try:
    import hiredis
except ImportError:  # redis[hiredis] is a dependency; without it redis-py packs in Python
    hiredis = None


class _HiredisPacking:
    """Commands packed by hiredis (C) instead of redis-py's Python packer: the publisher's
    one script call per round carries a thousand or more arguments (about 7x cheaper)."""

    def pack_command(self, *args):
        cmd = args[0]  # a command name with a space ("SCRIPT LOAD") is several arguments
        if isinstance(cmd, str) and " " in cmd or isinstance(cmd, bytes) and b" " in cmd:
            args = tuple(cmd.split()) + args[1:]
        try:
            return [hiredis.pack_command(args)]
        except (TypeError, ValueError):  # an argument type hiredis does not take
            return super().pack_command(*args)


class _FastConnection(_HiredisPacking, aioredis.Connection):
    pass


class _FastSSLConnection(_HiredisPacking, aioredis.SSLConnection):
    pass


class _FastSentinelConnection(_HiredisPacking, SentinelManagedConnection):
    pass


class _FastSentinelSSLConnection(_HiredisPacking, SentinelManagedSSLConnection):
    pass


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The master's connections found through Sentinel (re-asked after a failover), with
    the blocking pool's waiting for a free connection instead of failing."""


def _connection_class(url: str) -> dict[str, Any]:
    if url.startswith(("redis+sentinel://", "rediss+sentinel://")):
        tls = url.startswith("rediss+")
        if hiredis is None:
            return {"connection_class": SentinelManagedSSLConnection if tls else SentinelManagedConnection}
        return {"connection_class": _FastSentinelSSLConnection if tls else _FastSentinelConnection}
    if hiredis is None or url.startswith("unix://"):
        return {}
    return {"connection_class": _FastSSLConnection if url.startswith("rediss://") else _FastConnection}

if TYPE_CHECKING:
    from worker.config import RedisConfig


def redis_security_kwargs(cfg: RedisConfig) -> dict[str, Any]:
    """redis-py keyword arguments (for `from_url` / a connection pool) for `cfg`'s ACL
    user and TLS settings; empty for a plain URL without them.

    The certificate and key are loaded once here, so a wrong path or key password fails
    now, naming the setting, rather than on every connection attempt.

    Raises:
        ConfigError: a secret, CA, certificate or key file cannot be read or loaded.
    """
    kw: dict[str, Any] = {}
    if cfg.username:
        kw["username"] = cfg.username
    password = cfg.secret_password()
    if password is not None:
        kw["password"] = password
    if cfg.uses_tls:
        key_password = cfg.key_password()
        tls_context("redis", cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile, keyfile=cfg.ssl_keyfile,
                    key_password=key_password, check_hostname=cfg.ssl_check_hostname)  # fail early, by name
        kw.update(ssl_cert_reqs="required", ssl_check_hostname=cfg.ssl_check_hostname)
        if cfg.ssl_cafile:
            kw["ssl_ca_certs"] = cfg.ssl_cafile
        if cfg.ssl_certfile:
            kw.update(ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile, ssl_password=key_password or "")
    return kw


def redis_client(cfg: RedisConfig, **kwargs: Any) -> aioredis.Redis:
    """`redis.asyncio.Redis` for `cfg` (URL + ACL user + TLS); every command and connect
    fails after `cfg.command_timeout_s` without an answer; `kwargs` go to `from_url`
    (other timeouts, retries, health checks). A `redis+sentinel://` URL gives a client of
    the master the Sentinels name, asked again on every new connection (after a failover
    the old master's connections fail, and the next ones reach the new master).

    Raises:
        ConfigError: see `redis_security_kwargs`.
    """
    if cfg.sentinel is not None:
        return aioredis.Redis.from_pool(_sentinel_pool(cfg, SentinelConnectionPool, {**_timeouts(cfg), **kwargs}))
    return aioredis.from_url(cfg.url, **redis_security_kwargs(cfg), **_connection_class(cfg.url),
                             **{**_timeouts(cfg), **kwargs})


def redis_pool(cfg: RedisConfig, **kwargs: Any) -> aioredis.ConnectionPool:
    """A blocking connection pool for `cfg` (many concurrent callers wait for a
    connection instead of failing, up to `timeout` seconds, default `cfg.command_timeout_s`
    × 3); commands time out as in `redis_client`; `kwargs` go to
    `BlockingConnectionPool.from_url` (or the Sentinel pool's constructor)."""
    kwargs = {**_timeouts(cfg), "timeout": 3 * cfg.command_timeout_s, **kwargs}
    if cfg.sentinel is not None:
        return _sentinel_pool(cfg, _BlockingSentinelPool, kwargs)
    return aioredis.BlockingConnectionPool.from_url(cfg.url, **redis_security_kwargs(cfg), **_connection_class(cfg.url),
                                                    **kwargs)


def _sentinel_pool(cfg: RedisConfig, pool_class: type, kwargs: dict[str, Any]) -> SentinelConnectionPool:
    """A pool of connections to the master of `cfg.sentinel`'s service. The Sentinels are
    asked with the same timeouts (and TLS, for `rediss+sentinel://`), without the
    master's credentials."""
    target = cfg.sentinel
    assert target is not None
    security = redis_security_kwargs(cfg)
    if target.username and "username" not in security:
        security["username"] = target.username
    if target.password and "password" not in security:
        security["password"] = target.password
    tls = {k: v for k, v in security.items() if k.startswith("ssl")}
    timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={**timeouts, **tls, **({"ssl": True} if tls else {})})
    return pool_class(target.service, sentinel, db=target.db, **security, **_connection_class(cfg.url), **kwargs)


def _timeouts(cfg: RedisConfig) -> dict[str, float]:
    return {"socket_timeout": cfg.command_timeout_s, "socket_connect_timeout": cfg.command_timeout_s}
