"""Connection settings of the benchmarks: `--config FILE` (its `kafka` and `redis`
sections: addresses, SASL, TLS, client certificates, the Redis ACL user; INFLIGHT_* env
vars override it, as for a worker) plus `--kafka` / `--redis` to replace the addresses.
Without them the benchmarks use the open dev stack, as before."""

from __future__ import annotations

import argparse
import os

import msgspec

from worker.config import SECRET_FIELDS, KafkaConfig, RedisConfig, load_config

DEFAULT_KAFKA = f"127.0.0.1:{os.environ.get('INFLIGHT_DEV_KAFKA_PORT', '19092')}"
DEFAULT_REDIS = f"redis://127.0.0.1:{os.environ.get('INFLIGHT_DEV_REDIS_PORT', '6390')}/0"


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML file whose kafka / redis sections give addresses and connection security (e.g. "
                        ".cache/devstack-secure/configs/inflight-admin-mtls.yaml: the benchmarks create topics)")
    p.add_argument("--kafka", default=None, help=f"bootstrap servers (default: the config's, else {DEFAULT_KAFKA})")
    p.add_argument("--redis", default=None, help=f"Redis URL (default: the config's, else {DEFAULT_REDIS})")


def connection_sections(a: argparse.Namespace) -> tuple[KafkaConfig, RedisConfig]:
    """(kafka, redis) from `--config` / env, addresses replaced by `--kafka` / `--redis`;
    also sets `a.kafka` and `a.redis` to the addresses used.

    Raises:
        ConfigError: invalid file or values.
    """
    if a.config or any(k.startswith(("INFLIGHT_KAFKA__", "INFLIGHT_REDIS__")) for k in os.environ):
        cfg = load_config(a.config)
        kafka, redis = cfg.kafka, cfg.redis
        if not a.config and "INFLIGHT_KAFKA__BOOTSTRAP_SERVERS" not in os.environ:
            kafka = msgspec.structs.replace(kafka, bootstrap_servers=DEFAULT_KAFKA)
        if not a.config and "INFLIGHT_REDIS__URL" not in os.environ:
            redis = msgspec.structs.replace(redis, url=DEFAULT_REDIS)
    else:
        kafka, redis = KafkaConfig(bootstrap_servers=DEFAULT_KAFKA), RedisConfig(url=DEFAULT_REDIS)
    if a.kafka:
        kafka = msgspec.structs.replace(kafka, bootstrap_servers=a.kafka)
    if a.redis:
        redis = msgspec.structs.replace(redis, url=a.redis)
    a.kafka, a.redis = kafka.bootstrap_servers, redis.url
    return kafka, redis


def worker_sections(kafka: KafkaConfig, redis: RedisConfig) -> tuple[dict, dict, dict[str, str]]:
    """The `kafka` and `redis` sections for a worker subprocess's config file, without
    secret values (paths to secret files stay), and the INFLIGHT_* environment that
    carries those values instead, so no secret is written to disk."""
    sections = {"kafka": msgspec.to_builtins(kafka), "redis": msgspec.to_builtins(redis)}
    env: dict[str, str] = {}
    for section, names in SECRET_FIELDS.items():
        for name in names:
            value = sections[section].pop(name, None)
            if value is not None:
                env[f"INFLIGHT_{section.upper()}__{name.upper()}"] = value
    return sections["kafka"], sections["redis"], env
