"""Logs: JSON lines by default, credentials never rendered."""

from __future__ import annotations

import io
import json

import structlog

from worker.config import KafkaConfig, RedisConfig, WorkerConfig, load_config, redacted_config
from worker.obs.log import setup_logging


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


def test_every_new_secret_is_redacted_and_files_are_read_not_logged(tmp_path):
    """Kafka key password, Redis ACL password and Redis key password (values given
    through env, as deployments do) never reach a log line; secret files are read, their
    paths (not their content) logged."""
    pw_file = tmp_path / "kafka-pw"
    pw_file.write_text("s3cret-from-file\n")
    cfg = load_config(None, env={
        "INFLIGHT_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "INFLIGHT_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "INFLIGHT_KAFKA__SASL_USERNAME": "svc", "INFLIGHT_KAFKA__SASL_PASSWORD_FILE": str(pw_file),
        "INFLIGHT_KAFKA__SSL_CERTFILE": "/certs/w.pem", "INFLIGHT_KAFKA__SSL_KEY_PASSWORD": "s3cret-kafka-key",
        "INFLIGHT_REDIS__URL": "rediss://r:6380/0", "INFLIGHT_REDIS__USERNAME": "worker",
        "INFLIGHT_REDIS__PASSWORD": "s3cret-redis-acl", "INFLIGHT_REDIS__SSL_CERTFILE": "/certs/w.pem",
        "INFLIGHT_REDIS__SSL_KEY_PASSWORD": "s3cret-redis-key"})
    assert cfg.kafka.password() == "s3cret-from-file" and cfg.kafka.key_password() == "s3cret-kafka-key"
    assert cfg.redis.secret_password() == "s3cret-redis-acl" and cfg.redis.key_password() == "s3cret-redis-key"
    buf = io.StringIO()
    setup_logging("INFO", json=True, stream=buf)
    try:
        structlog.get_logger("test").info("starting worker", config=redacted_config(cfg))
        structlog.get_logger("test").info("repr", kafka=repr(cfg.kafka), redis=repr(cfg.redis), cfg=repr(cfg))
    finally:
        setup_logging("INFO")
    out = buf.getvalue()
    assert "s3cret" not in out
    line = json.loads(out.splitlines()[0])
    assert line["config"]["kafka"]["ssl_key_password"] == "***"
    assert line["config"]["redis"]["password"] == "***" and line["config"]["redis"]["ssl_key_password"] == "***"
    assert line["config"]["kafka"]["sasl_password_file"] == str(pw_file)


def test_console_rendering_when_asked():
    buf = io.StringIO()
    setup_logging("INFO", json=False, stream=buf)
    try:
        structlog.get_logger("test").info("hello", job_id="j1")
    finally:
        setup_logging("INFO")
    text = buf.getvalue()
    assert "hello" in text and "job_id" in text and not text.lstrip().startswith("{")


def test_one_log_level_for_the_worker_the_flag_over_the_config():
    """`worker.log_level` sets the level of the worker's own process too (it set only the
    engine core's, while the front logged at the flag's default INFO); `--log-level`, when
    given, overrides it for both; a wrong name is a config error naming the field."""
    import pytest

    from worker.__main__ import with_log_level
    from worker.cli.parser import build_parser
    from worker.config import ConfigError, WorkerSettings

    parse = build_parser().parse_args
    quiet = WorkerConfig(worker=WorkerSettings(log_level="warning"))
    assert quiet.worker.log_level == "WARNING"
    assert parse(["worker"]).log_level is None
    assert with_log_level(quiet, parse(["worker"]).log_level).worker.log_level == "WARNING"
    assert with_log_level(quiet, parse(["worker", "--log-level", "debug"]).log_level).worker.log_level == "DEBUG"
    assert WorkerConfig().worker.log_level == "INFO"
    with pytest.raises(ConfigError, match=r"worker.log_level must be one of .*'WARNING'.*got 'LOUD'"):
        WorkerSettings(log_level="loud")
    with pytest.raises(SystemExit):
        parse(["worker", "--log-level", "loud"])
