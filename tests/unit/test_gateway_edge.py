"""The gateway's own context check (`worker.gateway.edge`): its token count is a lower
bound of the worker's (never refusing what a worker serves), and a request that cannot fit
is a 400 `context_length_exceeded` before anything is produced (against the real broker:
tests/integration/test_gateway_edge.py)."""

from __future__ import annotations

import msgspec
import pytest

from worker.client.routing import count_prompt_tokens
from worker.gateway.batch.lines import parse_input
from worker.gateway.edge import check_context
from worker.gateway.errors import ApiError
from worker.gateway.protocol import Kind, parse_request


@pytest.fixture(scope="module")
def tokenizers(llama_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    return Tokenizer.from_file(str(llama_path / "tokenizer.json")), AutoTokenizer.from_pretrained(str(llama_path))


def chat(messages, **kw):
    return parse_request(Kind.CHAT, msgspec.json.encode({"model": "m", "messages": messages, **kw}))


def completion(**kw):
    return parse_request(Kind.COMPLETION, msgspec.json.encode({"model": "m", **kw}))


TEXTS = ["Hello there", "a" * 300, "The quick brown fox jumps over the lazy dog. " * 20, "x y z\n\n  tabs\tand 数字 123",
         "ab" * 50 + "ba" * 50]


def test_the_count_never_exceeds_the_workers(tokenizers):
    fast, hf = tokenizers
    for text in TEXTS:
        worker = len(hf(text)["input_ids"])  # the worker tokenizes a text prompt with special tokens
        assert count_prompt_tokens(completion(prompt=text), fast, at_least=True) <= worker
    for n in (1, 2, 5):
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": TEXTS[i % len(TEXTS)]}
                    for i in range(n)]
        worker = len(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"])
        bound = count_prompt_tokens(chat(messages), fast, at_least=True)
        assert 0 < bound <= worker, (n, bound, worker)
    assert count_prompt_tokens(completion(prompt=[5, 6, 7]), fast, at_least=True) == 3  # token ids: exact


def test_a_prompt_that_cannot_fit_is_refused_with_the_numbers(tokenizers):
    fast, _ = tokenizers
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    n = count_prompt_tokens(completion(prompt=long_text), fast, at_least=True)
    check_context(completion(prompt=long_text, max_tokens=10), fast, n + 10)  # exactly fits
    with pytest.raises(ApiError) as e:
        check_context(completion(prompt=long_text, max_tokens=11), fast, n + 10)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert f"at least {n} tokens" in e.value.message and f"context of {n + 10} tokens" in e.value.message
    with pytest.raises(ApiError) as e:  # no max_tokens: at least one token must fit
        check_context(chat([{"role": "user", "content": long_text}]), fast, 100)
    assert e.value.param == "messages" and "at least 1 token to generate" in e.value.message
    check_context(completion(prompt=long_text, max_tokens=10**6), None, 100)  # no tokenizer: nothing judged
    check_context(completion(prompt=long_text, max_tokens=10**6), fast, None)  # no known context


def test_a_batch_line_that_cannot_fit_is_an_error_line(tokenizers):
    fast, _ = tokenizers
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 8}
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    data = b"\n".join(msgspec.json.encode({"custom_id": c, "url": "/v1/chat/completions", "body": b})
                      for c, b in (("long", body), ("short", ok)))
    lines, errors = parse_input(data, batch_id="batch_1", endpoint="/v1/chat/completions", kind=Kind.CHAT,
                                model_name="m", tokenizer=fast, max_model_len=256)
    assert [ln.custom_id for ln in lines] == ["short"]
    assert [(e.custom_id, e.code, e.param) for e in errors] == [("long", "context_length_exceeded", "body.messages")]
