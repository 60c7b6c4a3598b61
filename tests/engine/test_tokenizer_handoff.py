"""The engine core sends its tokenizer to the front-end pickled in `Ready`
(worker/engine/core_proc.py), so a worker's front process loads no torch: the tokenizer
it rebuilds must be the one `AutoTokenizer` loads, for every use the front makes of it
(encode, decode, chat templates with tools, special tokens); and where the core cannot
pickle it or the front cannot rebuild it, the front loads its own."""

from __future__ import annotations

import pickle

import pytest
from transformers import AutoTokenizer

from tests.conftest import tiny_checkpoint
from worker.config import ServingTuning
from worker.engine.core_client import ProcessEngineClient
from worker.engine.core_proc import PretrainedEngine, Ready, pickled_tokenizer

TEXTS = ["Hello world", "  leading spaces\tand tabs\n\nnew lines", "ünïcödé € 漢字 🙂", "<|endoftext|> inside text",
         "", "a" * 500]
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class Holder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def assert_same_tokenizer(a, b) -> None:
    for text in TEXTS:
        ids = a(text)["input_ids"]
        assert b(text)["input_ids"] == ids, text
        assert b.encode(text, add_special_tokens=False) == a.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert b.decode(ids, skip_special_tokens=skip) == a.decode(ids, skip_special_tokens=skip)
        assert b.convert_ids_to_tokens(ids) == a.convert_ids_to_tokens(ids)
    assert (b.bos_token_id, b.eos_token_id, b.pad_token_id) == (a.bos_token_id, a.eos_token_id, a.pad_token_id)
    assert b.all_special_ids == a.all_special_ids and len(b) == len(a) and b.get_vocab() == a.get_vocab()
    assert b.chat_template == a.chat_template
    if a.chat_template is not None:
        for kwargs in ({}, {"tools": TOOLS}, {"add_generation_prompt": True}):
            assert (b.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
                    == a.apply_chat_template(MESSAGES, tokenize=False, **kwargs))


@pytest.mark.parametrize("which", ["llama", "qwen2", "gpt2", "agent"])
def test_the_tokenizer_the_core_sends_is_the_one_autotokenizer_loads(which, agent_path):
    path = agent_path if which == "agent" else tiny_checkpoint(which)
    loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    data = pickled_tokenizer(Holder(loaded))
    assert data
    client = ProcessEngineClient(PretrainedEngine(str(path), None), ServingTuning())
    sent = client._sent_tokenizer(Ready(100, 64, 1, 16, [], "m", "cpu", tokenizer=data))
    assert type(sent) is type(loaded)
    assert_same_tokenizer(loaded, sent)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle 'Unpicklable' object")


class CountingSpec:
    """A spec whose `build_tokenizer` is the front's own load, counted."""

    core_sends_tokenizer = True

    def __init__(self):
        self.built = 0

    def build_tokenizer(self):
        self.built += 1
        return "own tokenizer"


def test_a_tokenizer_that_does_not_pickle_or_unpickle_is_loaded_by_the_front_instead():
    assert pickled_tokenizer(Holder(Unpicklable())) == b""
    spec = CountingSpec()
    client = ProcessEngineClient(spec, ServingTuning())
    for sent in (b"", b"not a pickle", pickle.dumps(Unpicklable, protocol=0).replace(b"Unpicklable", b"Missing000")):
        assert client._sent_tokenizer(Ready(100, 64, 1, 16, [], "m", "cpu", tokenizer=sent)) == "own tokenizer"
    assert spec.built == 3
    assert client._sent_tokenizer(Ready(100, 64, 1, 16, [], "m", "cpu", tokenizer=pickle.dumps("sent"))) == "sent"
    assert spec.built == 3
