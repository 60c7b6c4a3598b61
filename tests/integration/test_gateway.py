"""The gateway's interactive endpoints on the real dev stack, with the official `openai`
client against a gateway and a worker: chat and completions, streamed and not, stop
strings, seeds, logprobs, usage, errors (unsupported field, bad key, priority above
the grant, unknown model), tenant-scoped streams, a client that disconnects mid-stream
(cancel at once, KV freed at the worker's next step), and overload (429 with
`Retry-After`, the job's deadline set so the worker drops it too)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from schemas import keys
from schemas.codec import decode_job
from schemas.params import SamplingParams
from schemas.wire import Started
from tests.integration.conftest import worker_config
from tests.integration.gateway_helpers import (
    KEY,
    KEY_LOW,
    MODEL,
    client,
    gateway_config,
    running_gateway,
    sample,
)
from tests.integration.helpers import read_topic, running_worker, slow_null_engine, wait_until
from worker.client import InflightClient
from worker.engine import Engine

MESSAGES = [{"role": "user", "content": "Return the number of"}]


async def started(client: InflightClient, job_id: str) -> bool:
    """The job's log holds its `started` event."""
    return any(isinstance(e, Started) for e in await client.read_log(job_id))


async def stream_text(stream) -> tuple[str, list, object, str | None]:
    """(text, logprob entries, usage, finish_reason) of a streamed chat completion."""
    text, lps, usage, reason = "", [], None, None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                lps += c.logprobs.content
            reason = c.finish_reason or reason
    return text, lps, usage, reason


def test_chat_and_completions_through_the_openai_client(services, prefix, llama_path, tmp_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)

    async def main():
        async with running_worker(cfg, engine), \
                running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path)) as gw:
            c = client(gw)
            models = (await c.models.list()).data
            out = {"models": [m.id for m in models], "max_model_len": models[0].model_extra.get("max_model_len")}
            greedy = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
            raw = await c.chat.completions.with_raw_response.create(**greedy)
            out["chat"], out["job_id"] = raw.parse(), raw.headers["x-request-id"]
            out["chat_stream"] = await stream_text(await c.chat.completions.create(
                **greedy, stream=True, stream_options={"include_usage": True}))
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as direct:
                jid = await direct.submit(messages=MESSAGES, params=SamplingParams(max_tokens=16, temperature=0, seed=1))
                out["direct"] = (await direct.result(jid, 60)).text
                seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
                out["direct_seeded"] = (await direct.result(await direct.submit("Once upon", params=seeded), 60)).text
            out["tenant_log"] = await _exists(services[1], keys.log_key(out["job_id"], prefix, "acme"))
            comp = dict(model=MODEL, prompt="Once upon", max_tokens=16)
            out["seeds"] = [(await c.completions.create(**comp, temperature=1.0, seed=s)).choices[0].text
                            for s in (11, 11, 12)]
            greedy_c = (await c.completions.create(**comp, temperature=0)).choices[0]
            out["greedy_c"] = greedy_c.text
            text = greedy_c.text
            k = next(i for i in range(1, len(text) - 2) if text.find(text[i:i + 2]) == i and text[i:i + 2].strip())
            out["stop"] = (text[k:k + 2], text[:k],
                           (await c.completions.create(**comp, temperature=0, stop=[text[k:k + 2]])).choices[0])
            s = await c.completions.create(**comp, temperature=0, stream=True)
            out["comp_stream"] = "".join([ch.choices[0].text async for ch in s if ch.choices])
            out["chat_lp"] = await c.chat.completions.create(**greedy, logprobs=True, top_logprobs=3)
            out["chat_lp_stream"] = await stream_text(await c.chat.completions.create(
                **greedy, logprobs=True, top_logprobs=3, stream=True))
            out["comp_lp"] = await c.completions.create(**comp, temperature=0, logprobs=2)
            out["errors"] = await _errors(gw)
            m = gw.metrics.registry
            out["metrics"] = {"ok": sample(m, "gateway_requests_total", endpoint="/v1/chat/completions", status="200"),
                              "400": sample(m, "gateway_requests_total", endpoint="/v1/chat/completions",
                                            status="400"),
                              "ttfb": sample(m, "gateway_time_to_first_byte_seconds_count",
                                             endpoint="/v1/chat/completions"),
                              "open": sample(m, "gateway_open_streams")}
            async with aiohttp.ClientSession() as http:
                for path in ("/healthz", "/readyz", "/metrics"):
                    async with http.get(f"http://127.0.0.1:{gw.port}{path}") as r:
                        out[path] = (r.status, await r.text())
            return out

    out = asyncio.run(main())
    assert out["models"] == [MODEL] and out["max_model_len"] == 1024  # from the tokenizer dir's config.json
    chat = out["chat"]
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.choices[0].finish_reason == "length"
    text = chat.choices[0].message.content
    assert text == out["direct"]  # the same job a producer would submit
    assert chat.usage.completion_tokens == 16 and chat.usage.total_tokens == chat.usage.prompt_tokens + 16
    s_text, _, s_usage, s_reason = out["chat_stream"]
    assert (s_text, s_reason) == (text, "length") and s_usage.model_dump() == chat.usage.model_dump()
    assert out["tenant_log"]  # the job streamed on its key's tenant keys
    a, b, c_ = out["seeds"]
    assert a == b == out["direct_seeded"] and a != c_
    stop, before, choice = out["stop"]
    assert (choice.text, choice.finish_reason) == (before, "stop"), (stop, out["greedy_c"])
    assert out["comp_stream"] == out["greedy_c"]
    lp = out["chat_lp"]
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens == 16
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))
        assert not e.token.startswith("token_id:")  # spelled by the model's tokenizer
    assert [e.logprob for e in out["chat_lp_stream"][1]] == [e.logprob for e in entries]
    clp = out["comp_lp"].choices[0].logprobs
    assert len(clp.tokens) == len(clp.token_logprobs) == 16 and all(len(t) == 2 for t in clp.top_logprobs)
    errs = out["errors"]
    assert errs["n"] == (400, "n") and errs["tools"] == (400, "tool_choice") and errs["extra"] == (400, "frobnicate")
    assert errs["bad_key"] == 401 and errs["missing_key"] == 401 and errs["priority"] == (403, "priority")
    assert errs["model"] == 404 and errs["low_key_default"] == "length"
    assert out["metrics"]["ok"] == 5 and out["metrics"]["400"] == 3 and out["metrics"]["ttfb"] == 5
    assert out["metrics"]["open"] == 0
    assert out["/healthz"][0] == 200 and out["/readyz"][0] == 200
    assert 'gateway_requests_total{endpoint="/v1/completions",status="200"}' in out["/metrics"][1]


async def _exists(redis_url: str, key: str) -> bool:
    r = aioredis.from_url(redis_url)
    try:
        return bool(await r.exists(key))
    finally:
        await r.aclose()


async def _errors(gw) -> dict:
    c = client(gw)
    base = dict(model=MODEL, messages=MESSAGES, max_tokens=4)
    got = {}
    for name, kw in (("n", {"n": 17}), ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
                     ("extra", {"extra_body": {"frobnicate": 1}})):
        try:
            await c.chat.completions.create(**base, **kw)
        except openai.BadRequestError as e:
            assert e.body["param"] in e.message or e.body["param"] in str(e.body)
            got[name] = (e.status_code, e.body["param"])
    try:
        await client(gw, key="sk-not-a-key").chat.completions.create(**base)
    except openai.AuthenticationError as e:
        got["bad_key"] = e.status_code
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                                                          json=base) as r:
        got["missing_key"] = r.status
    low = client(gw, key=KEY_LOW)
    try:
        await low.chat.completions.create(**base, extra_body={"priority": "high"})
    except openai.PermissionDeniedError as e:
        got["priority"] = (e.status_code, e.body["param"])
    # the low key runs at its default priority (a random-seeded sample may meet EOS in 4 tokens: ignore it)
    got["low_key_default"] = (await low.chat.completions.create(**base, extra_body={"ignore_eos": True})).choices[
        0].finish_reason
    try:
        await c.chat.completions.create(**{**base, "model": "gpt-4o"})
    except openai.NotFoundError as e:
        got["model"] = e.status_code
    return got


def test_a_client_that_disconnects_mid_stream_frees_its_kv_at_the_next_step(services, prefix, tmp_path):
    step_s = 0.05
    cfg = worker_config(services, prefix)
    engine = slow_null_engine(step_s)

    async def main():
        async with running_worker(cfg, engine) as w, \
                running_gateway(gateway_config(services, prefix, tmp_path / "files")) as gw:
            arrived: dict[str, float] = {}
            on_cancel = w.cancels._on_cancel

            async def record(job_id: str, headers: tuple = ()) -> None:
                arrived[job_id] = time.monotonic()
                await on_cancel(job_id, headers)

            w.cancels._on_cancel = record
            baseline = w.metrics.kv_usage._value.get()
            kv: list[tuple[float, float]] = []
            stop = asyncio.Event()

            async def watch():  # the worker's KV usage, sampled every 2 ms
                while not stop.is_set():
                    kv.append((time.monotonic(), w.metrics.kv_usage._value.get()))
                    await asyncio.sleep(0.002)

            watcher = asyncio.create_task(watch())
            aborted0 = w.metrics.aborted.labels("cancelled")._value.get()
            stream = await client(gw).completions.create(model=MODEL, prompt="hello there", max_tokens=400,
                                                         stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for ch in stream:
                n += len(ch.choices[0].text)
                if n >= 3:
                    break
            busy = w.metrics.kv_usage._value.get()
            await stream.close()  # the client goes away
            deadline = time.monotonic() + 10
            while (not arrived or w.metrics.aborted.labels("cancelled")._value.get() == aborted0) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            stop.set()
            await watcher
            m = gw.metrics.registry
            return (baseline, busy, arrived, kv, w.metrics.aborted.labels("cancelled")._value.get() - aborted0,
                    sample(m, "gateway_client_disconnects_total", endpoint="/v1/completions"),
                    sample(m, "gateway_cancels_sent_total", reason="client_disconnect"),
                    sample(m, "gateway_open_streams"))

    baseline, busy, arrived, kv, aborted, disconnects, cancels, open_streams = asyncio.run(main())
    assert busy > baseline and len(arrived) == 1
    assert aborted == 1 and disconnects == 1 and cancels == 1 and open_streams == 0
    t_cancel = next(iter(arrived.values()))
    freed = next(t for t, v in kv if t >= t_cancel and v <= baseline)
    print(f"cancel reached the worker -> KV back to baseline: {(freed - t_cancel) * 1000:.1f} ms (step {step_s * 1000:.0f} ms)")
    assert freed - t_cancel <= step_s + 0.1, f"KV back to baseline {freed - t_cancel:.3f} s after the cancel arrived"


@pytest.mark.timing
def test_a_request_that_cannot_start_in_time_gets_429_and_its_job_expires(services, prefix, tmp_path):
    cfg = worker_config(services, prefix, tuning={"max_running_requests": 1}, worker={"max_local_jobs": 1})
    engine = slow_null_engine(0.05, max_running_requests=1)
    gcfg = gateway_config(services, prefix, tmp_path / "files", queue_timeout_s=1.0, retry_after_s=3)

    async def main():
        async with running_worker(cfg, engine), running_gateway(gcfg) as gw, \
                InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as direct:
            blocker = await direct.submit("block", params=SamplingParams(max_tokens=400, ignore_eos=True),
                                          priority="high", job_id="blocker")
            await wait_until(lambda: started(direct, blocker), 30, "the blocker runs (it holds the only slot)")
            t0 = time.monotonic()
            try:
                await client(gw).completions.create(model=MODEL, prompt="late", max_tokens=5)
                answer = None
            except openai.RateLimitError as e:
                answer = (e.status_code, e.response.headers.get("retry-after"), e.body["code"])
            took = time.monotonic() - t0
            await direct.cancel(blocker)
            jobs = await read_topic(services[0], keys.job_topic(prefix, "normal"), decode_job)
            late = jobs[0]
            events = [ev async for ev in direct.stream(late.job_id, tenant=late.tenant, timeout_s=30)]
            return answer, took, late, events

    answer, took, late, events = asyncio.run(main())
    assert answer == (429, "3", "overloaded")
    assert took < 4.0  # the queue timeout plus a grace, not a hung connection
    assert late.deadline == pytest.approx(late.created_at + 1.0, abs=0.2) and late.tenant == "acme"
    assert not any(isinstance(e, Started) for e in events)  # the worker never ran it
    assert events[-1].finish_reason in ("expired", "cancelled")


def test_the_gateway_runs_as_its_own_redis_acl_user(services, prefix, tmp_path, own_redis):
    """`inflight acl redis gateway` is all the gateway needs: streams, a cancel, a batch."""
    import subprocess

    import msgspec

    from tests.integration.gateway_helpers import batch_line
    from worker.security.acl import redis_gateway_rules

    subprocess.run(["redis-cli", "-p", str(own_redis.port), "ACL", "SETUSER", "gw", "on", ">gw-secret-1",
                    *redis_gateway_rules(prefix)], check=True, capture_output=True)
    cfg = worker_config(services, prefix, redis={"url": own_redis.url})
    gcfg = gateway_config(services, prefix, tmp_path / "files", redis_url=own_redis.url)
    gcfg = msgspec.structs.replace(gcfg, redis=msgspec.structs.replace(gcfg.redis, username="gw",
                                                                       password="gw-secret-1"))

    async def main():
        async with running_worker(cfg, slow_null_engine(0.01)), running_gateway(gcfg) as gw:
            c = client(gw)
            text = (await c.completions.create(model=MODEL, prompt="hi", max_tokens=5)).choices[0].text
            stream = await c.completions.create(model=MODEL, prompt="hi", max_tokens=300, stream=True,
                                                extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()
            f = await c.files.create(file=("b.jsonl", b"\n".join(
                batch_line(f"a-{i}", url="/v1/completions", prompt="x", max_tokens=3) for i in range(5))),
                purpose="batch")
            b = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
            deadline = time.monotonic() + 60
            while b.status != "completed" and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
                b = await c.batches.retrieve(b.id)
            listed = [x.id for x in (await c.batches.list()).data]
            cancels = await wait_until(lambda: sample(gw.metrics.registry, "gateway_cancels_sent_total",
                                                      reason="client_disconnect"), 10, "the disconnect's cancel")
            return text, b, listed, cancels

    text, b, listed, cancels = asyncio.run(main())
    assert len(text) == 5 and cancels == 1
    assert b.status == "completed" and b.request_counts.completed == 5 and listed == [b.id]


def test_the_gateway_on_the_secured_stack(secure_stack, llama_path, tmp_path):
    """The gateway as the producer principal over SASL_SSL / SCRAM-SHA-512 (its Kafka
    grants: job and cancel topics, Read on results) and Redis over TLS with an ACL user;
    the worker as `inflight-worker`: a streamed chat and a batch read back from the
    results topic."""
    import msgspec

    from tests.integration.conftest import secure_worker_config
    from tests.integration.gateway_helpers import batch_line

    stack = secure_stack
    cfg = secure_worker_config(stack, "scram-sha-512")
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    kafka = stack.sections("producer", "scram-sha-512")[0]
    redis = stack.sections("admin", "mtls")[1]  # the stack has no gateway user: the admin's TLS connection
    gcfg = gateway_config(services=(kafka.bootstrap_servers, redis.url), prefix=stack.prefix,
                          files_dir=tmp_path / "files")
    gcfg = msgspec.structs.replace(gcfg, kafka=kafka, redis=redis)

    async def main():
        async with running_worker(cfg, engine), running_gateway(gcfg) as gw:
            c = client(gw)
            text = "".join([ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True) if ch.choices])
            f = await c.files.create(file=("b.jsonl", b"\n".join(batch_line(
                f"s-{i}", messages=[{"role": "user", "content": f"Item {i}"}], max_tokens=3) for i in range(3))),
                purpose="batch")
            b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
            deadline = time.monotonic() + 90
            while b.status not in ("completed", "failed") and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
                b = await c.batches.retrieve(b.id)
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.port}/readyz") as r:
                ready = r.status
            return text, b, ready

    text, b, ready = asyncio.run(main())
    assert text and ready == 200
    assert b.status == "completed" and b.request_counts.completed == 3


def test_vllms_server_utilities_tokenize_detokenize_version_health(services, prefix, llama_path, tmp_path):
    """`/tokenize`, `/detokenize`, `/version` and `/health` answer as `vllm serve`'s do, with
    the gateway's tokenizer (the checkpoint's): the ids the workers' tokenizer makes."""
    from transformers import AutoTokenizer

    from worker.gateway.tokenize import version

    reference = AutoTokenizer.from_pretrained(str(llama_path))
    text = "Hello there, queue-fed world"
    auth = {"Authorization": f"Bearer {KEY}"}

    async def main():
        got = {}
        async with running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path)) as gw, \
                running_gateway(gateway_config(services, prefix, tmp_path / "files2")) as bare, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{gw.port}"

            async def call(method, path, base=url, **kw):
                async with http.request(method, base + path, **kw) as r:
                    return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

            got["tokenize"] = await call("POST", "/tokenize", json={"model": MODEL, "prompt": text}, headers=auth)
            got["strs"] = await call("POST", "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                                "return_token_strs": True}, headers=auth)
            ids = got["tokenize"][1]["tokens"]
            got["detokenize"] = await call("POST", "/detokenize", json={"tokens": ids}, headers=auth)
            got["out_of_vocab"] = await call("POST", "/detokenize", json={"tokens": [1, 10**6]}, headers=auth)
            got["messages"] = await call("POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                                         headers=auth)
            got["other_model"] = await call("POST", "/tokenize", json={"model": "gpt-4o", "prompt": "x"},
                                            headers=auth)
            got["no_key"] = await call("POST", "/tokenize", json={"prompt": "x"})
            got["not_json"] = await call("POST", "/tokenize", data=b"{", headers=auth)
            got["no_tokenizer"] = await call("POST", "/tokenize", base=f"http://127.0.0.1:{bare.port}",
                                             json={"prompt": "x"}, headers=auth)
            got["version"] = await call("GET", "/version")
            got["health"] = await call("GET", "/health")
            gw._checks["redis"] = "Redis did not answer in 3 s"  # what the readiness loop sets
            got["unhealthy"] = await call("GET", "/health")
        return got

    got = asyncio.run(main())
    want = reference(text)["input_ids"]
    assert got["tokenize"] == (200, {"count": len(want), "max_model_len": 1024, "tokens": want})
    status, body = got["strs"]
    assert status == 200 and body["tokens"] == reference(text, add_special_tokens=False)["input_ids"]
    assert body["token_strs"] == reference.convert_ids_to_tokens(body["tokens"])
    assert got["detokenize"] == (200, {"prompt": reference.decode(want)})
    assert got["out_of_vocab"][0] == 400 and "outside the vocabulary" in got["out_of_vocab"][1]["error"]["message"]
    assert got["messages"][0] == 400 and got["messages"][1]["error"]["param"] == "messages"
    assert got["other_model"][0] == 404 and got["other_model"][1]["error"]["code"] == "model_not_found"
    assert got["no_key"][0] == 401
    assert got["not_json"][0] == 400 and got["not_json"][1]["error"]["code"] == "invalid_json"
    assert got["no_tokenizer"][0] == 400 and "gateway.tokenizer" in got["no_tokenizer"][1]["error"]["message"]
    assert got["version"] == (200, {"version": version()}) and version() != "unknown"
    assert got["health"] == (200, "")
    assert got["unhealthy"][0] == 503 and got["unhealthy"][1]["errors"] == {"redis": "Redis did not answer in 3 s"}


def test_n_choices_are_jobs_of_their_own_merged_into_one_response(services, prefix, tmp_path):
    """`n` > 1: one job per choice (seed, seed + 1, ...), merged as OpenAI shapes it: each
    choice equals the single request with its seed; usage counts the prompt once; streamed,
    every choice's chunks carry its index and one usage chunk ends the stream."""
    cfg = worker_config(services, prefix)
    engine = slow_null_engine(0.002)
    body = dict(model=MODEL, prompt="choices", max_tokens=6, temperature=1.0)

    async def main():
        async with running_worker(cfg, engine), \
                running_gateway(gateway_config(services, prefix, tmp_path / "files")) as gw:
            c = client(gw)
            many = await c.completions.create(**body, n=3, seed=5)
            singles = [await c.completions.create(**body, seed=5 + i) for i in range(3)]
            chunks = [ch async for ch in await c.completions.create(**body, n=2, seed=11, stream=True,
                                                                     stream_options={"include_usage": True})]
            jobs = await read_topic(services[0], keys.job_topic(prefix, "normal"), decode_job)
            return many, singles, chunks, jobs

    many, singles, chunks, jobs = asyncio.run(main())
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.text for ch in many.choices] == [s.choices[0].text for s in singles]
    base = many.id.removeprefix("cmpl-")
    seeds = {j.job_id: j.params.seed for j in jobs}
    assert [seeds[base], seeds[f"{base}-1"], seeds[f"{base}-2"]] == [5, 6, 7]  # a job per choice, its own seed
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 18
    texts = {0: "", 1: ""}
    reasons = {}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"} and all(texts.values())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
