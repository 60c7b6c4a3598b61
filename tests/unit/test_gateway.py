"""The gateway's pure logic (no services): request validation, key grants, error
mapping, response shapes, batch line parsing and output, config, the file store, and
that the gateway imports no torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from schemas.wire import ErrorInfo, Finished, FinishReason, TokenLogprob, Usage
from worker.config import ConfigError
from worker.gateway.auth import Grant, KeyRing, effective_priority
from worker.gateway.batch.lines import failed_line, line_job, line_job_id, output_line, parse_input
from worker.gateway.config import ApiKey, GatewayConfig, load_gateway_config, parse_window
from worker.gateway.errors import ApiError, error_for_outcome
from worker.gateway.files import FileStore
from worker.gateway.generation import Generation
from worker.gateway.protocol import Kind, parse_body, parse_request
from worker.gateway.render import DONE, Renderer, TokenText

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def rejected(kind: Kind, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_body(kind, body)
    assert e.value.status == 400
    return e.value


def test_supported_fields_map_onto_the_job_params():
    r = parse_request(Kind.CHAT, chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, stop="END", seed=3,
                                      logprobs=True, top_logprobs=4, user="u1", top_k=-1, min_p=0.1,
                                      repetition_penalty=1.2, ignore_eos=True, stream=True,
                                      stream_options={"include_usage": True}, n=1, presence_penalty=0.5,
                                      frequency_penalty=-0.25, logit_bias={"5": -100, "7": 2.5}, tools=[],
                                      response_format={"type": "text"}, priority="low"))
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.logprobs) == (7, 0.5, 0.9, ["END"], 3, 4)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (0, 0.1, 1.2, True)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.25, {5: -100.0, 7: 2.5})
    assert parse_request(Kind.CHAT, chat(logit_bias={})).params.logit_bias is None
    assert parse_request(Kind.CHAT, chat(n=3)).n == 3 and parse_request(Kind.CHAT, chat()).n == 1
    assert r.stream and r.include_usage and r.priority == "low" and r.metadata == {"user": "u1"}
    assert [(m.role, m.content) for m in r.messages] == [("user", "hi")]
    c = parse_request(Kind.COMPLETION, b'{"model": "m", "prompt": [[1, 2, 3]], "logprobs": 2}')
    assert c.prompt_token_ids == [1, 2, 3] and c.prompt is None and c.params.logprobs == 2
    assert c.params.max_tokens == 16  # OpenAI's default for /v1/completions
    assert parse_request(Kind.CHAT, chat()).params.max_tokens is None  # the worker's max_output_tokens
    assert parse_request(Kind.CHAT, chat(service_tier="flex")).priority == "low"
    # text parts and the developer role
    r = parse_body(Kind.CHAT, {"model": "m", "messages": [{"role": "developer", "content": "be brief"}, {
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "ab")]


@pytest.mark.parametrize(("kind", "field", "value", "param"), [
    (Kind.COMPLETION, "tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
    (Kind.CHAT, "audio", {"voice": "x"}, "audio"),
    (Kind.COMPLETION, "best_of", 3, "best_of"),
    (Kind.COMPLETION, "echo", True, "echo"),
    (Kind.COMPLETION, "suffix", "x", "suffix"),
    (Kind.CHAT, "frobnicate", 1, "frobnicate"),
])
def test_unsupported_and_unknown_fields_are_400_naming_the_field(kind, field, value, param):
    body = {**(CHAT if kind == Kind.CHAT else {"model": "m", "prompt": "x"}), field: value}
    err = rejected(kind, body)
    assert err.param == param and f"{field}" in err.message
    assert err.code == ("unknown_parameter" if field == "frobnicate" else "unsupported_parameter")


def test_invalid_values_name_the_field():
    for body, param in [({**CHAT, "temperature": 3}, "temperature"), ({**CHAT, "temperature": "hot"}, "temperature"),
                        ({**CHAT, "top_p": 0}, "top_p"), ({**CHAT, "max_tokens": 0}, "max_tokens"),
                        ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
                        ({**CHAT, "top_logprobs": 2}, "top_logprobs"), ({**CHAT, "stop": [""]}, "stop"),
                        ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"), ({**CHAT, "n": 0}, "n"),
                        ({**CHAT, "n": 17}, "n"),
                        ({**CHAT, "frequency_penalty": -3}, "frequency_penalty"),
                        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"), ({**CHAT, "logit_bias": {"5": 101}},
                                                                              "logit_bias"),
                        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
                        ({**CHAT, "service_tier": "priority", "priority": "low"}, "priority"),
                        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
                        ({"model": "m", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
                        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]},
                         "messages[0].name"),
                        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0].type"),
                        ({"model": "m", "messages": []}, "messages")]:
        assert rejected(Kind.CHAT, body).param == param, body
    assert rejected(Kind.COMPLETION, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"
    assert rejected(Kind.COMPLETION, {"model": "m", "prompt": ""}).param == "prompt"
    with pytest.raises(ApiError) as e:
        parse_request(Kind.CHAT, b"{not json")
    assert e.value.code == "invalid_json"
    # null means absent (as in OpenAI's API)
    assert parse_request(Kind.CHAT, chat(tools=None, n=None, temperature=None)).params.temperature == 1.0


def test_keys_grant_a_tenant_and_a_highest_priority():
    digest = hashlib.sha256(b"sk-hashed-key").hexdigest()
    ring = KeyRing([ApiKey(key="sk-plain-key", tenant="acme", max_priority="normal"),
                    ApiKey(key_sha256=digest, max_priority="high")])
    assert ring.authenticate("Bearer sk-plain-key") == Grant("acme", "normal", None)
    assert ring.authenticate("bearer sk-hashed-key").tenant is None
    for header in (None, "", "Bearer", "Basic sk-plain-key", "Bearer sk-wrong"):
        with pytest.raises(ApiError) as e:
            ring.authenticate(header)
        assert e.value.status == 401
    grant = Grant("acme", "normal")
    assert effective_priority(grant, None, "high") == "normal"  # the default is capped, never a 403
    assert effective_priority(grant, "low", "normal") == "low"
    with pytest.raises(ApiError) as e:
        effective_priority(grant, "high", "normal")
    assert e.value.status == 403 and e.value.param == "priority"
    anon = KeyRing([], Grant(None, "low", "anonymous"))
    assert anon.authenticate(None).max_priority == "low"
    with pytest.raises(ConfigError, match="no API key"):
        KeyRing.from_config(GatewayConfig())


def fin(reason: str, code: str | None = None, text: str = "") -> Finished:
    return Finished(job_id="j", seq=3, attempt=1, finish_reason=FinishReason(reason), text=text,
                    usage=Usage(prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=1),
                    error=ErrorInfo(code=code, message="why") if code else None)


def test_outcomes_map_to_openai_statuses():
    assert error_for_outcome(fin("expired", "deadline_passed"), 3).status == 429
    assert error_for_outcome(fin("expired", "deadline_passed"), 3).headers == {"Retry-After": "3"}
    assert error_for_outcome(fin("rejected", "prompt_too_long"), 1).code == "context_length_exceeded"
    assert error_for_outcome(fin("rejected", "invalid_params"), 1).status == 400
    assert error_for_outcome(fin("error", "oom"), 1).status == 503
    assert error_for_outcome(fin("error", "internal"), 1).status == 500
    body = error_for_outcome(fin("rejected", "empty_prompt"), 1).body()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_responses_and_chunks_have_openai_shapes():
    lp = [TokenLogprob(token_id=7, logprob=-0.5, top_token_ids=[7, 9], top_logprobs=[-0.5, -1.5])]
    r = Renderer(Kind.CHAT, "chatcmpl-x", "m", 1, TokenText(None), include_usage=True)
    body = r.completion(fin("stop", text="hello"), lp)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hello"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:7" and [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -1.5]
    chunks = (r.first_chunk() + r.token_chunk("he", None) + r.final_chunks(fin("length", text="he")) + DONE)
    events = [e.removeprefix(b"data: ") for e in chunks.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[1]["choices"][0]["delta"] == {"content": "he"} and objs[1]["usage"] is None
    assert objs[2]["choices"][0]["finish_reason"] == "length"
    assert objs[3]["choices"] == [] and objs[3]["usage"]["total_tokens"] == 7
    c = Renderer(Kind.COMPLETION, "cmpl-x", "m", 1, TokenText(None))
    lps = c.logprobs(lp + [TokenLogprob(token_id=12, logprob=-1.0)])
    assert lps["tokens"] == ["token_id:7", "token_id:12"] and lps["text_offset"] == [0, 10]
    assert lps["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:9": -1.5}
    assert c.first_chunk() is None and b'"usage"' not in c.token_chunk("x", None)


def test_a_restarted_job_delivers_only_what_the_client_has_not_seen():
    gen = Generation.__new__(Generation)  # the delta bookkeeping alone
    gen._sent_text, gen._sent_tokens, gen._attempt_text, gen._attempt_tokens = "", 0, "", 0
    got = [gen._take("Hel", None, 1), gen._take("lo", None, 1)]
    gen._attempt_text, gen._attempt_tokens = "", 0  # restarted: the new attempt replays "Hello"
    got += [gen._take("He", None, 1), gen._take("llo", None, 1), gen._take(" you", None, 1)]
    assert [(d.text, d.num_tokens) if d else None for d in got] == [("Hel", 1), ("lo", 1), None, None, (" you", 1)]
    gen._attempt_text, gen._attempt_tokens = "", 0
    with pytest.raises(ApiError, match="different text"):
        gen._take("Help", None, 1)
    # a replay that agrees at first and differs in a later event, inside what was sent or
    # running past its end: each event's new text is compared, wherever it falls
    for events in (["Hel", "lo", " yes"], ["Hello y", "ak"]):
        gen._attempt_text, gen._attempt_tokens = "", 0
        for text in events[:-1]:
            assert gen._take(text, None, 1) is None
        with pytest.raises(ApiError, match="different text"):
            gen._take(events[-1], None, 1)


def batch_file(lines: list) -> bytes:
    return b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines)


def line(cid, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, **body}}


def test_batch_lines_are_validated_like_requests_and_get_stable_job_ids():
    data = batch_file([line("a", max_tokens=3, seed=1), b"not json", line("a"), {"method": "POST", "body": CHAT},
                       {**line("u"), "url": "/v1/completions"}, line("n", n=2), line("s", stream=True),
                       line("l", logprobs=True), line("p", priority="high"), line("x", model="other"), b"  ",
                       line("b", max_tokens=2)])
    lines, errors = parse_input(data, batch_id="batch_" + "0" * 32, endpoint="/v1/chat/completions",
                                kind=Kind.CHAT, model_name="m")
    assert [(x.line, x.custom_id) for x in lines] == [(1, "a"), (12, "b")]
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json"), (3, "duplicate_custom_id"), (4, "invalid_custom_id"), (5, "mismatched_url"),
        (6, "unsupported_parameter"), (7, "unsupported_parameter"), (8, "unsupported_parameter"),
        (9, "unsupported_parameter"), (10, "model_not_found")]
    assert errors[4].param == "body.n"
    assert lines[0].job_id == line_job_id("batch_" + "0" * 32, "a") != line_job_id("batch_" + "1" * 32, "a")
    job = line_job(lines[1], "acme", 123.0, "batch_" + "0" * 32)
    assert job.params.seed is not None and job.params.seed == line_job(lines[1], None, 1.0, "b").params.seed
    assert job.tenant == "acme" and job.deadline == 123.0 and job.metadata["custom_id"] == "b"
    assert line_job(lines[0], None, 1.0, "b").params.seed == 1
    out = output_line(lines[0], fin("stop", text="ok"), "m", 5)
    assert out["custom_id"] == "a" and out["response"]["status_code"] == 200
    assert out["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    bad = failed_line(lines[0], fin("rejected", "prompt_too_long"))
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["code"] == \
        "context_length_exceeded"


def test_gateway_config_from_yaml_and_env(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{key_sha256: {'a' * 64}, tenant: t1, max_priority: low}}\n")
    path = tmp_path / "gateway.yaml"
    path.write_text("gateway: {port: 9000, model_name: tiny, api_keys: [{key: sk-aaaaaaaa, tenant: acme}]}\n"
                    "kafka: {topic_prefix: p}\nredis: {key_prefix: p}\n")
    cfg = load_gateway_config(str(path), env={"INFLIGHT_GATEWAY__API_KEYS_FILE": str(keys_file),
                                              "INFLIGHT_GATEWAY__QUEUE_TIMEOUT_S": "2.5"})
    g = cfg.gateway
    assert (g.port, g.model_name, g.queue_timeout_s, cfg.kafka.topic_prefix) == (9000, "tiny", 2.5, "p")
    assert [(k.tenant, k.max_priority) for k in g.load_keys()] == [("acme", "normal"), ("t1", "low")]
    assert "sk-aaaaaaaa" not in repr(g.api_keys)
    for env, match in [({"INFLIGHT_GATEWAY__DEFAULT_PRIORITY": "urgent"}, "gateway.default_priority"),
                       ({"INFLIGHT_GATEWAY__NOPE": "1"}, "nope"),
                       ({"INFLIGHT_GATEWAY__API_KEYS": "[{key: short}]"}, "at least 8"),
                       ({"INFLIGHT_GATEWAY__API_KEYS": "[{key: sk-aaaaaaaa, tenant: 'a:b'}]"}, "tenant")]:
        with pytest.raises(ConfigError, match=match):
            load_gateway_config(None, env=env)
    assert (parse_window("24h"), parse_window("90m"), parse_window("5s")) == (86400, 5400, 5)
    assert parse_window("1d") is None and parse_window("0h") is None


def test_file_store_writes_whole_files_and_refuses_odd_ids(tmp_path):
    store = FileStore(tmp_path / "files")
    obj = store.create_file([b"a\n", b"b\n"], filename="x.jsonl", purpose="batch", tenant="acme")
    assert obj.bytes == 4 and store.read_content(obj.id) == b"a\nb\n"
    assert store.file(obj.id).tenant == "acme" and store.file(obj.id).file == obj
    assert store.file("file-../../etc/passwd") is None and store.read_manifest("batch_../x") is None
    with pytest.raises(ValueError):
        store.content_path("../x")
    store.write_manifest("batch_" + "a" * 32, b"{}")
    assert store.manifest_ids() == ["batch_" + "a" * 32]
    assert not store.cancel_requested("batch_" + "a" * 32)
    store.request_cancel("batch_" + "a" * 32)
    assert store.cancel_requested("batch_" + "a" * 32)
    assert not [p for p in (tmp_path / "files").rglob("*.tmp")]  # no temporary file left behind
    assert msgspec.json.decode((tmp_path / "files" / "files" / f"{obj.id}.json").read_bytes())["tenant"] == "acme"


def test_the_gateway_imports_no_torch():
    code = ("import sys, worker.gateway.app, worker.__main__; "
            "sys.exit(1 if {'torch', 'transformers'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
