"""A request of ours in vLLM's terms, and vLLM's outputs in ours (`model.engine: vllm`; runs
in vLLM's interpreter, imported by `vllm_core.py`): sampling parameters, structured-output
constraints, LoRA adapters and the facts our adapter checks need, logprobs.
"""

from __future__ import annotations

import os
from typing import Any

from schemas.params import (
    ChoiceOutput,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    StructuredOutput,
)
from schemas.structured import strict_schema
from worker.engine.adapters import LoRAFacts, adapter_version
from worker.engine.outputs import EngineCoreRequest, TokenLogprobs
from worker.engine.vllm_spec import VllmStart


def sampling_params(req: EngineCoreRequest) -> Any:
    """vLLM's `SamplingParams` for `req` (its token budget `max_tokens` as our input
    processing set it; no detokenization: our front-end does it)."""
    from vllm import SamplingParams

    p = req.params
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        seed=p.seed, max_tokens=req.max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        detokenize=False, structured_outputs=structured(p.structured))


class LoRAIds:
    """vLLM's `LoRARequest` for an adapter name under `lora_dir`. vLLM keys its loaded
    adapters by an integer id and never reloads one it holds, so the id stands for the
    adapter's files as they are now (name + `adapters.adapter_version`, the version our
    catalog keys its checks by): an adapter replaced on disk gets a new id and is loaded
    afresh, as our engine's catalog re-reads it."""

    def __init__(self, lora_dir: str) -> None:
        self.lora_dir = lora_dir
        self._ids: dict[tuple[str, tuple[float, float]], int] = {}

    def request(self, name: str) -> Any:
        from vllm.lora.request import LoRARequest

        path = os.path.join(self.lora_dir, name)
        lora_id = self._ids.setdefault((name, adapter_version(path)), len(self._ids) + 1)
        return LoRARequest(name, lora_id, path)


def lora_facts(start: VllmStart) -> LoRAFacts | None:
    """What our input processing checks adapters against (as our engine sends it): the
    model's LoRA projections, found by `lora.lora_modules`' rule on the checkpoint's
    transformers model built on the meta device (no weights are read)."""
    if start.lora_dir is None:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker.model.lora import lora_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(start.model))
    shapes = {name: (m.in_features, m.out_features) for name, m in lora_modules(model).items()}
    return LoRAFacts(start.lora_dir, start.max_lora_rank, shapes)


def structured(c: StructuredOutput | None) -> Any:
    """Our constraint as vLLM's `StructuredOutputsParams`, compiled by its llguidance
    back end as ours is (`derived_engine_args` chooses it and its compact JSON: no free
    whitespace); strict object schemas as our `strict` makes them."""
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(c, JsonSchemaOutput):
        return StructuredOutputsParams(json=strict_schema(c.schema) if c.strict else c.schema)
    if isinstance(c, JsonObjectOutput):
        return StructuredOutputsParams(json={"type": "object"})
    if isinstance(c, RegexOutput):
        return StructuredOutputsParams(regex=c.pattern)
    if isinstance(c, ChoiceOutput):
        return StructuredOutputsParams(choice=list(c.choices))
    if isinstance(c, GrammarOutput):
        return StructuredOutputsParams(grammar=c.grammar)
    raise ValueError(f"unknown constraint {type(c).__name__}")


def logprobs(lists: Any, n: int) -> list[TokenLogprobs] | None:
    """vLLM's `LogprobsLists` rows (sampled token first, then the top k) as ours."""
    if lists is None:
        return None
    ids, vals = lists.logprob_token_ids, lists.logprobs
    return [TokenLogprobs(int(ids[i][0]), float(vals[i][0]), [int(x) for x in ids[i][1:]],
                          [float(x) for x in vals[i][1:]]) for i in range(n)]
