"""End-of-sequence ids come from every source transformers uses (issue 10, case 4):
generation_config.json, config.json (and a composite model's text config), the
tokenizer; ints or lists. Each source is tested alone on a copy of the tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, LlavaConfig

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.model.loader import eos_token_ids

USER = "<|user|>"  # a special token of the tiny tokenizer, used as a tokenizer-only EOS


def variant(src: Path, out: Path, *, config, generation, tokenizer_eos: str | None) -> Path:
    """Copy `src` to `out` with config.json's eos_token_id = `config`, generation_config.json's
    = `generation` (None: no such file) and the tokenizer's eos token = `tokenizer_eos`."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    if generation is None:
        (out / "generation_config.json").unlink()
    else:
        gen = json.loads((out / "generation_config.json").read_text())
        gen["eos_token_id"] = generation
        (out / "generation_config.json").write_text(json.dumps(gen))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["eos_token"] = tokenizer_eos
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    return out


def ids_of(path: Path) -> frozenset[int]:
    return eos_token_ids(path, AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("name,config,generation,tokenizer_eos,expected", [
    ("config-list", [3, 4], None, None, {3, 4}),
    ("config-int", 5, None, None, {5}),
    ("generation-list", None, [5, 6], None, {5, 6}),
    ("generation-int", None, 7, None, {7}),
    ("tokenizer", None, None, USER, "user"),
    ("nothing", None, None, None, set()),
    ("all", [3], [4, 5], "<|endoftext|>", {0, 3, 4, 5}),
])
def test_each_source_alone_and_their_union(llama_path, tmp_path, name, config, generation, tokenizer_eos, expected):
    path = variant(llama_path, tmp_path / name, config=config, generation=generation, tokenizer_eos=tokenizer_eos)
    if expected == "user":
        expected = {AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(USER)}
    assert ids_of(path) == expected


def test_text_config_of_a_composite_model(tmp_path):
    class NoEosTokenizer:
        eos_token_id = None

    cfg = LlavaConfig(text_config={"model_type": "llama", "eos_token_id": [9, 10]})
    assert eos_token_ids(tmp_path, cfg, NoEosTokenizer()) == {9, 10}


def test_engine_stops_on_an_eos_id_given_only_by_config_json(llama_path, tmp_path):
    tuning = ServingTuning(max_total_tokens=1024, max_batched_tokens=64)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=tuning)
    prompt = [5, 17, 33, 101, 7, 250]
    free = Engine.from_pretrained(str(llama_path), cfg).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    k = next(i for i in range(1, 8) if free[i] not in free[:i])  # the first output id not seen before
    path = variant(llama_path, tmp_path / "config-eos", config=[free[k], 511], generation=None, tokenizer_eos=None)
    engine = Engine.from_pretrained(str(path), cfg)
    assert engine.loaded.eos_token_ids == {free[k], 511}
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop"
