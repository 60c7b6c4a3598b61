"""Wire contract and configuration: strict decoding with precise errors, nothing else needed."""

from __future__ import annotations

import msgspec
import pytest

from schemas import keys
from schemas.codec import decode_cancel, decode_event, decode_job, encode, json_schemas, recover_job_id
from schemas.wire import Finished, Started, Token, Usage
from worker.config import ConfigError, load_config


def test_job_decoding_accepts_unknown_fields_and_rejects_bad_ones():
    job = decode_job(b'{"job_id": "a-1", "prompt": "hi", "params": {"max_tokens": 3}, "future_field": 1}')
    assert job.job_id == "a-1" and job.params.max_tokens == 3 and job.v == 1
    cases = {
        b"not json": "malformed",
        b'{"job_id": 42, "prompt": "x"}': "$.job_id",
        b'{"prompt": "x"}': "job_id",
        b'{"v": 2, "job_id": "a", "prompt": "x"}': "$.v",
        b'{"job_id": "a"}': "exactly one of",
        b'{"job_id": "a", "prompt": "x", "messages": []}': "exactly one of",
        b'{"job_id": "a", "prompt": "x", "params": {"temperature": -1}}': "temperature",
        b'{"job_id": "a", "prompt": "x", "params": {"top_p": 0}}': "top_p",
        b'{"job_id": "has space", "prompt": "x"}': "$.job_id",
    }
    for raw, needle in cases.items():
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)) as e:
            decode_job(raw)
        assert needle in str(e.value), (raw, str(e.value))


def test_recover_job_id_and_cancel():
    assert recover_job_id(b'{"v": 9, "job_id": "x1"}') == "x1"
    assert recover_job_id(b'{"job_id": 5}') is None
    assert recover_job_id(b"garbage") is None
    # issue 32: an undecodable record whose Kafka key is a valid job id is answered under the key
    assert recover_job_id(b"garbage", b"job-7") == "job-7"
    assert recover_job_id(b'{"job_id": 5}', b"job-7") == "job-7"
    assert recover_job_id(b'{"job_id": "body-id"}', b"key-id") == "body-id"  # the field wins
    # an id the wire refuses for a job still names its stream: its producer hears why
    assert recover_job_id('{"job_id": "jöb-ünïcode-€", "prompt": "x"}'.encode()) == "jöb-ünïcode-€"
    assert recover_job_id(b"garbage", "jöb-€".encode()) == "jöb-€"
    assert recover_job_id(b'{"job_id": "a b*?[x]"}') == "a b*?[x]"
    # ids no stream can take: empty, over-long, control characters, not text
    assert recover_job_id(b'{"job_id": ""}') is None
    assert recover_job_id(('{"job_id": "' + "x" * 201 + '"}').encode()) is None
    assert recover_job_id(b'{"job_id": "line\\u000abreak"}') is None and recover_job_id(b"x", b"bell\x07") is None
    assert recover_job_id(b"garbage", b"\xff") is None and recover_job_id(b"garbage", b"x" * 201) is None
    assert decode_cancel(b'{"job_id": "x1"}').job_id == "x1"


def test_events_round_trip_as_a_tagged_union():
    evs = [
        Started(job_id="j", seq=0, attempt=1, worker_id="w"),
        Token(job_id="j", seq=1, attempt=1, text="hé", token_ids=[1, 2]),
        Finished(job_id="j", seq=2, attempt=1, finish_reason="stop", text="hé", usage=Usage(prompt_tokens=1, completion_tokens=2)),
    ]
    for ev in evs:
        data = encode(ev)
        assert msgspec.json.decode(data)["type"] == type(ev).__name__.lower()
        assert decode_event(data) == ev
    assert set(json_schemas()) >= {"job", "cancel", "event"}


def test_keys_are_built_in_one_place():
    assert keys.job_topic("inflight", "high") == "inflight.jobs.high"
    assert keys.channel("j1") == "inflight:job:j1"
    assert keys.log_key("j1") == "inflight:job:j1:log"
    assert keys.cancelled_key("j1", "p") == "p:job:j1:cancelled"


def test_config_env_overrides_and_errors_name_the_field(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("serving_tuning:\n  max_running_requests: 8\nkafka:\n  group_id: g1\n")
    cfg = load_config(str(f), {"INFLIGHT_KAFKA__BOOTSTRAP_SERVERS": "k:9092", "INFLIGHT_REDIS__LOG_TTL_S": "60"})
    assert (cfg.serving_tuning.max_running_requests, cfg.kafka.group_id, cfg.kafka.bootstrap_servers,
            cfg.redis.log_ttl_s) == (8, "g1", "k:9092", 60)
    with pytest.raises(ConfigError, match=r"kv_policy must be one of \['optimistic', 'reserve'\], got 'greedy'"):
        load_config(None, {"INFLIGHT_SERVING_TUNING__KV_POLICY": "greedy"})
    with pytest.raises(ConfigError, match="unknown field `nope`"):
        load_config(None, {"INFLIGHT_KAFKA__NOPE": "1"})
    with pytest.raises(ConfigError, match="max_running_requests must be >= 1"):
        load_config(None, {"INFLIGHT_SERVING_TUNING__MAX_RUNNING_REQUESTS": "0"})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"), {})
    assert "secret" not in repr(load_config(None, {"INFLIGHT_KAFKA__SASL_PASSWORD": "secret"}).kafka)


def test_env_strings_are_taken_as_is_and_never_echoed():
    env = {"INFLIGHT_KAFKA__SASL_PASSWORD": "*s3cret: #x", "INFLIGHT_KAFKA__GROUP_ID": "2024",
           "INFLIGHT_KAFKA__TOPIC_PREFIX": "on", "INFLIGHT_SERVING_TUNING__MAX_RUNNING_REQUESTS": "12",
           "INFLIGHT_METRICS__PORT": "null"}
    cfg = load_config(None, env)
    assert cfg.kafka.sasl_password == "*s3cret: #x" and cfg.kafka.group_id == "2024"
    assert cfg.kafka.topic_prefix == "on" and cfg.serving_tuning.max_running_requests == 12
    assert cfg.metrics.port is None
    with pytest.raises(ConfigError, match="serving_tuning.max_total_tokens") as e:
        load_config(None, {"INFLIGHT_SERVING_TUNING__MAX_TOTAL_TOKENS": "*hidden-value"})
    assert "hidden-value" not in str(e.value)


def test_cross_field_and_range_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"heartbeat_interval_ms \(20000\) must be below kafka.session_timeout_ms"):
        load_config(None, {"INFLIGHT_KAFKA__HEARTBEAT_INTERVAL_MS": "20000"})
    with pytest.raises(ConfigError, match="redis.tombstone_ttl_s must be >= 1"):
        load_config(None, {"INFLIGHT_REDIS__TOMBSTONE_TTL_S": "0"})
    with pytest.raises(ConfigError, match=r"model.device must be one of \['auto', 'cpu', 'cuda', 'cuda:N'\]"):
        load_config(None, {"INFLIGHT_MODEL__DEVICE": "banana"})
    assert load_config(None, {"INFLIGHT_MODEL__DEVICE": "cuda:1"}).model.device == "cuda:1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka:\n  sasl_password: *leaky\n")
    with pytest.raises(ConfigError, match="not valid YAML at line 2") as e:
        load_config(str(bad), {})
    assert "leaky" not in str(e.value)


def test_tool_calling_messages_decode_and_count_toward_the_input_bound():
    """A job whose history holds an assistant tool call (content null) and a tool result:
    it decodes, and the input-size bound counts its arguments and tool definitions
    (regression: a null content crashed the intake's byte count and stopped the worker)."""
    from schemas.codec import decode_job
    from worker.serve.input_size import input_bytes

    raw = (b'{"job_id": "t1", "tools": [{"type": "function", "function": {"name": "f"}}], "messages": ['
           b'{"role": "user", "content": "hi"},'
           b'{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",'
           b' "function": {"name": "f", "arguments": "{\\"x\\": 1}"}}]},'
           b'{"role": "tool", "tool_call_id": "c1", "content": "2"}]}')
    job = decode_job(raw)
    assert job.messages[1].content is None and job.messages[1].tool_calls[0].function.arguments == '{"x": 1}'
    tools_bytes = len(b'[{"type":"function","function":{"name":"f"}}]')
    assert input_bytes(job) == tools_bytes + (4 + 2) + (9 + 1 + 8) + (4 + 1)
    with pytest.raises(msgspec.ValidationError, match="content"):
        decode_job(b'{"job_id": "t2", "messages": [{"role": "user", "content": null}]}')
    with pytest.raises(msgspec.ValidationError, match="tools"):
        decode_job(b'{"job_id": "t3", "prompt": "x", "tools": []}')


def test_limits_follow_the_model_context_unless_set():
    """Issue 32: limits default to what the model allows; a configured limit above the
    context is a config error naming both numbers."""
    from worker.config import ServingTuning

    t = ServingTuning().for_model(1024)
    assert (t.max_input_tokens, t.max_output_tokens) == (1023, 1023)
    assert ServingTuning().for_model(32768).max_output_tokens == 1024
    assert ServingTuning(max_input_tokens=500, max_output_tokens=1024).for_model(1024).max_input_tokens == 500
    assert t.for_model(1024) == t  # idempotent
    for name in ("max_input_tokens", "max_output_tokens"):
        with pytest.raises(ConfigError, match=rf"serving_tuning.{name} is 8192, above the model's context of 1024"):
            ServingTuning(**{name: 8192}).for_model(1024)


def test_an_engine_reports_the_limits_of_its_model():
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine

    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(max_total_tokens=4096)), max_model_len=1024)
    assert (eng.tuning.max_input_tokens, eng.tuning.max_output_tokens) == (1023, 1023)
    assert eng.config.serving_tuning == eng.tuning
    with pytest.raises(ConfigError, match="max_input_tokens is 2048, above the model's context of 1024"):
        null_engine(EngineConfig(serving_tuning=ServingTuning(max_input_tokens=2048)), max_model_len=1024)
