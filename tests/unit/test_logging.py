"""Logs: JSON lines by default, credentials never rendered."""

from __future__ import annotations

import io
import json

import structlog

from worker.config import KafkaConfig, RedisConfig, WorkerConfig, redacted_config
from worker.log import setup_logging


def test_credentials_never_reach_the_log():
    cfg = WorkerConfig(
        kafka=KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="svc",
                          sasl_password="s3cret-kafka-pw"),
        redis=RedisConfig(url="rediss://default:s3cret-redis-pw@redis.example:6380/2"),
    )
    buf = io.StringIO()
    setup_logging("INFO", json=True, stream=buf)
    try:
        log = structlog.get_logger("test")
        log.info("starting worker", config=redacted_config(cfg))
        log.info("repr", cfg=repr(cfg), kafka=str(cfg.kafka), redis=str(cfg.redis))
    finally:
        setup_logging("INFO")
    out = buf.getvalue()
    assert "s3cret" not in out
    line = json.loads(out.splitlines()[0])
    assert line["event"] == "starting worker" and line["level"] == "info" and "timestamp" in line
    assert line["config"]["kafka"]["sasl_password"] == "***"
    assert line["config"]["redis"]["url"] == "rediss://default:***@redis.example:6380/2"
    assert line["config"]["kafka"]["sasl_username"] == "svc"  # not a secret


def test_console_rendering_when_asked():
    buf = io.StringIO()
    setup_logging("INFO", json=False, stream=buf)
    try:
        structlog.get_logger("test").info("hello", job_id="j1")
    finally:
        setup_logging("INFO")
    text = buf.getvalue()
    assert "hello" in text and "job_id" in text and not text.lstrip().startswith("{")
