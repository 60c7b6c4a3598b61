"""Input processing: a `RequestInput` (its prompt text, chat messages or token ids, and
parameters) → a validated `EngineCoreRequest`, or `RequestRejected` with a reason. Runs in the caller's thread
(the worker runs it in a small thread pool); stateless apart from the tokenizer, so any
number of threads may call it. The admission checks that do not depend on load live
here (vLLM V1's `Processor`); the engine core never sees a request that cannot run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.params import SamplingParams
from worker.config import ServingTuning
from worker.engine.adapters import AdapterCatalog, AdapterError, LoRAFacts
from worker.engine.inputs import ChatPrompt, Prompt, RequestInput, TextPrompt, TokenPrompt
from worker.engine.kv_window import peak_blocks
from worker.engine.outputs import EngineCoreRequest
from worker.engine.request import Priority, RejectReason, RequestRejected
from worker.engine.structured import GrammarValidator, StructuredOutputError

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What input processing needs to know of the model and the engine core.

    `kv_capacity_tokens` is the whole KV cache (blocks × block size); `model_id`
    namespaces prefix-cache hashes; `eos_token_ids` every id that ends generation;
    `sliding_window` W when every layer reads only the last W positions (a request then
    holds at most `kv_window.peak_blocks` of KV, whatever its length); `lora` what the
    adapter checks need (adapters.py).
    """

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    eos_token_ids: frozenset[int]
    model_id: str
    block_size: int = 16
    sliding_window: int | None = None
    lora: LoRAFacts | None = None  # LoRA adapters served (model.lora_dir); None: none


class InputProcessor:
    """Tokenizes and validates requests (`RequestInput` -> `EngineCoreRequest`) in the caller's thread.

    Args:
        tokenizer: a transformers tokenizer (or anything with `encode`,
            `apply_chat_template` and `bos_token_id`).
        facts: the model and engine facts the checks use.
        tuning: `serving_tuning` (max_input_tokens, max_output_tokens).
    """

    def __init__(self, tokenizer: Any, facts: ModelFacts, tuning: ServingTuning) -> None:
        self.tokenizer = tokenizer
        self.facts = facts
        self.tuning = tuning
        self.grammars = GrammarValidator(tokenizer, facts.vocab_size, facts.eos_token_ids,
                                         max_bytes=tuning.max_structured_output_bytes,
                                         cache_size=tuning.grammar_cache_size)
        self.adapters = AdapterCatalog.from_facts(facts.lora) if facts.lora is not None else None

    def process(self, inp: RequestInput) -> EngineCoreRequest:
        """Tokenize and validate one request (see `Engine.add` for the rules).

        Raises:
            RequestRejected: with a `RejectReason`; nothing was queued anywhere.
        """
        request_id, params, options = inp.request_id, inp.params, inp.options
        try:
            prio = Priority.parse(options.priority)
        except ValueError as e:
            raise RequestRejected(request_id, RejectReason.INVALID_PARAMS, str(e)) from None
        ids = self.tokenize(request_id, inp.prompt)
        max_tokens = self.check_limits(request_id, ids, params, options.tenant or "")
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.grammars.check(params.structured)
            except StructuredOutputError as e:
                raise RequestRejected(request_id, RejectReason.INVALID_STRUCTURED_OUTPUT,
                                      f"params.structured ({params.structured.__struct_config__.tag}): {e}") from None
        cache_salt = options.cache_salt
        if options.adapter is not None:
            self.check_adapter(request_id, options.adapter)
            cache_salt = f"{cache_salt}\x00lora:{options.adapter}"  # two adapters never share KV
        arrival_time = time.time() if options.arrival_time is None else options.arrival_time
        options = msgspec.structs.replace(options, priority=int(prio), cache_salt=cache_salt, arrival_time=arrival_time)
        return EngineCoreRequest(request_id, ids, params, max_tokens, options, grammar)

    def check_adapter(self, request_id: str, adapter: str) -> None:
        """RequestRejected (`unknown_adapter`, `invalid_adapter`) unless `adapter` can be
        served: its config and safetensors header are read once, cached until they change."""
        if self.adapters is None:
            raise RequestRejected(request_id, RejectReason.UNKNOWN_ADAPTER,
                                  f"adapter {adapter!r}: this worker serves no LoRA adapters (model.lora_dir unset)")
        try:
            self.adapters.resolve(adapter)
        except AdapterError as e:
            raise RequestRejected(request_id, RejectReason(e.code), e.message) from None

    def tokenize(self, request_id: str, prompt: Prompt) -> list[int]:
        """Prompt ids: token ids in the vocabulary; not empty; at most one leading BOS for
        text and chat (see `Engine.add`). A chat prompt's `tools` (OpenAI function
        definitions) go to the chat template with its messages.

        Raises:
            RequestRejected: `invalid_prompt` (ids out of the vocabulary, a chat template
                that fails), `empty_prompt`.
        """
        if isinstance(prompt, TextPrompt):
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=True) if prompt.text else []
        elif isinstance(prompt, ChatPrompt):
            if not prompt.messages:
                ids = []
            else:
                try:
                    ids = list(
                        self.tokenizer.apply_chat_template(
                            prompt.messages, tools=prompt.tools or None, add_generation_prompt=True, tokenize=True,
                            return_dict=False, **(prompt.template_kwargs or {}),
                        )
                    )
                except Exception as e:  # template errors are the producer's input errors
                    raise RequestRejected(request_id, RejectReason.INVALID_PROMPT, f"chat template failed: {e}") from e
        else:
            ids = list(prompt.token_ids)
            vocab = self.facts.vocab_size
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = [t for t in ids if not 0 <= t < vocab]
                raise RequestRejected(
                    request_id, RejectReason.INVALID_PROMPT, f"token ids out of range [0, {vocab}): {bad[:5]}"
                )
        if not ids:
            raise RequestRejected(request_id, RejectReason.EMPTY_PROMPT, "the prompt has no tokens")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if not isinstance(prompt, TokenPrompt) and bos is not None and len(ids) > 1 and ids[1] == bos and ids[0] == bos:
            n = next((i for i, t in enumerate(ids) if t != bos), len(ids))
            log.debug("request %s: prompt starts with %d BOS ids; keeping one", request_id, n,
                      extra={"job_id": request_id})
            ids = ids[n - 1 :]
        return ids

    def check_limits(self, request_id: str, ids: list[int], params: SamplingParams, tenant: str = "") -> int:
        """Admission checks that do not depend on load (the tenant's KV quota included).
        Returns the resolved max_tokens."""
        t = self.tuning
        n = len(ids)
        max_len = self.facts.max_model_len
        vocab = self.facts.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            bad = sorted(k for k in params.logit_bias if k >= vocab)[:5]
            raise RequestRejected(request_id, RejectReason.INVALID_PARAMS,
                                  f"params.logit_bias names token ids outside the vocabulary [0, {vocab}): {bad}")
        if n > t.max_input_tokens:
            raise RequestRejected(
                request_id, RejectReason.PROMPT_TOO_LONG, f"prompt has {n} tokens, max_input_tokens is {t.max_input_tokens}"
            )
        if params.max_tokens is None:
            max_tokens = min(t.max_output_tokens, max_len - n)
        else:
            max_tokens = params.max_tokens
            if max_tokens > t.max_output_tokens:
                raise RequestRejected(
                    request_id,
                    RejectReason.INVALID_PARAMS,
                    f"params.max_tokens {max_tokens} exceeds max_output_tokens {t.max_output_tokens}",
                )
        if max_tokens < 1 or n + max_tokens > max_len:
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_CONTEXT,
                f"prompt {n} + max_tokens {max_tokens} tokens exceed the model context of {max_len}",
            )
        capacity = self.facts.kv_capacity_tokens
        window = self.facts.sliding_window
        if window is None:
            held = n + max_tokens
        else:  # the most it ever holds at once
            held = peak_blocks(n + max_tokens, window, self.facts.block_size, t.max_batched_tokens) * self.facts.block_size
        if held > capacity:
            what = f"prompt {n} + max_tokens {max_tokens} tokens" + (
                "" if window is None else f" (at most {held} at once behind its {window}-token window)")
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_KV_CAPACITY,
                f"{what} can never fit the KV cache of {capacity} tokens",
            )
        quota = t.tenant_policy(tenant).max_kv_blocks
        block = self.facts.block_size
        if quota is not None and n + max_tokens > quota * block:
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_KV_CAPACITY,
                f"prompt {n} + max_tokens {max_tokens} tokens can never fit tenant {tenant!r}'s quota of "
                f"{quota} KV blocks ({quota * block} tokens)",
            )
        return max_tokens
