"""A prompt whose text already starts with the BOS text keeps one BOS id (issue 10,
case 6), on a copy of the tiny checkpoint whose tokenizer prepends BOS as Llama's does."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import Tokenizer, processors

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine

BOS_TEXT = "<|endoftext|>"
BOS = 0


@pytest.fixture(scope="module")
def engine(llama_path, tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("bos") / "tiny-llama-bos"
    shutil.copytree(llama_path, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TEXT} $A", special_tokens=[(BOS_TEXT, BOS)])
    tok.save(str(path / "tokenizer.json"))
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"),
                       serving_tuning=ServingTuning(max_total_tokens=2048, max_batched_tokens=128))
    eng = Engine.from_pretrained(str(path), cfg)
    assert eng.tokenizer.encode("Paris")[0] == BOS and eng.tokenizer.encode(BOS_TEXT + "Paris")[:2] == [BOS, BOS]
    return eng


def prompt_ids(engine: Engine, rid: str, **prompt) -> list[int]:
    engine.add_request(rid, params=SamplingParams(temperature=0, max_tokens=4), **prompt)
    engine.step()
    ids = list(engine.scheduler.requests[rid].all_token_ids[: engine.scheduler.requests[rid].num_prompt_tokens])
    while engine.has_unfinished():
        engine.step()
    return ids


def test_text_starting_with_the_bos_text_keeps_one_bos(engine):
    plain = engine.tokenizer.encode("Paris is the capital of")
    assert prompt_ids(engine, "plain", prompt="Paris is the capital of") == plain
    assert prompt_ids(engine, "dup", prompt=BOS_TEXT + "Paris is the capital of") == plain
    assert prompt_ids(engine, "trip", prompt=BOS_TEXT * 2 + "Paris is the capital of") == plain
    # the same prompt, so the same greedy output
    a, b = engine.generate(["Paris is the capital of", BOS_TEXT + "Paris is the capital of"],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert a.token_ids == b.token_ids and b.prompt_token_ids == plain and b.usage.prompt_tokens == len(plain)


def test_prompt_token_ids_are_used_as_given(engine):
    assert prompt_ids(engine, "ids", prompt_token_ids=[BOS, BOS, 5, 6]) == [BOS, BOS, 5, 6]


def test_chat_messages_keep_exactly_one_bos(engine):
    tok = engine.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = "{{ bos_token }}" + saved
        ids = prompt_ids(engine, "chat", messages=[{"role": "user", "content": "hi"}])
        assert ids[0] == BOS and ids[1] != BOS
        assert ids == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
        # a template that puts the content first, with content that starts with the BOS text
        tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ids = prompt_ids(engine, "chat-dup", messages=[{"role": "user", "content": BOS_TEXT + "Paris"}])
        assert ids[0] == BOS and ids[1] != BOS
    finally:
        tok.chat_template = saved
