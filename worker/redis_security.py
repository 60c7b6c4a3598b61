"""Redis clients made from a `RedisConfig`: the one place that turns the URL, the ACL user
and the TLS settings into redis-py arguments, used by the worker, `inflight check`, the
InflightClient and the benchmarks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from worker.kafka_security import tls_context

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
    """`redis.asyncio.Redis` for `cfg` (URL + ACL user + TLS); `kwargs` go to `from_url`
    (timeouts, retries, health checks).

    Raises:
        ConfigError: see `redis_security_kwargs`.
    """
    return aioredis.from_url(cfg.url, **redis_security_kwargs(cfg), **kwargs)


def redis_pool(cfg: RedisConfig, **kwargs: Any) -> aioredis.BlockingConnectionPool:
    """A blocking connection pool for `cfg` (many concurrent callers wait for a
    connection instead of failing); `kwargs` go to `BlockingConnectionPool.from_url`."""
    return aioredis.BlockingConnectionPool.from_url(cfg.url, **redis_security_kwargs(cfg), **kwargs)
