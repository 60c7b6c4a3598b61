"""Kafka client security settings, shared by every Kafka client the project makes
(intake, cancel listener, producers, topic admin, InflightClient)."""

from __future__ import annotations

import ssl
from typing import Any


def kafka_security_kwargs(cfg: Any) -> dict:
    """aiokafka keyword arguments for `cfg`'s security settings (a `KafkaConfig`, or any
    object with `security_protocol`, `sasl_mechanism`, `sasl_username`, `password()`
    and `ssl_cafile`). PLAINTEXT gives only `security_protocol`."""
    kw: dict = {"security_protocol": cfg.security_protocol}
    if cfg.sasl_mechanism:
        kw.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                  sasl_plain_password=cfg.password())
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        kw["ssl_context"] = ssl.create_default_context(cafile=cfg.ssl_cafile)
    return kw
