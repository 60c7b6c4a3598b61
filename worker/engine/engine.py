"""Engine: the public API every other part (benchmarks, demo, tests, the worker's thread
mode) uses — input processing, the engine core and output processing in one object.

    add(RequestInput) ──► InputProcessor (caller's thread) ──► EngineCore.add
    step              ──► EngineCore.step ──► OutputProcessor ──► RequestOutput deltas

Threading: `add` (`add_request`, its keyword form) and `abort` may be called from any thread; `step` runs on one
thread (the engine thread). New requests and aborts take effect at the next step
boundary; an aborted request's KV blocks are free when that `step` returns.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from schemas.params import SamplingParams
from schemas.wire import Usage
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning
from worker.engine.adapters import LoRAFacts
from worker.engine.compile import CompileReport, compile_engine, graphs_wanted, precompiled_dir
from worker.engine.core import EngineCore
from worker.engine.draft import Drafter, load_draft
from worker.engine.input_processor import InputProcessor, ModelFacts
from worker.engine.inputs import RequestInput, TextPrompt, TokenPrompt
from worker.engine.lora_slots import LoRASlots
from worker.engine.output_processor import OutputProcessor
from worker.engine.outputs import (
    CompletionOutput,
    EngineCoreRequest,
    KVStats,
    RequestOptions,
    RequestOutput,
    StepStats,
    TokenLogprobs,
)
from worker.engine.request import Priority, RejectReason, RequestRejected
from worker.engine.structured import GrammarCompiler

if TYPE_CHECKING:
    from worker.engine.outputs import Runner
    from worker.model.loader import LoadedModel

CPU_DEFAULT_KV_TOKENS = 16384


def kv_bytes_per_token(loaded: LoadedModel, tuning: ServingTuning) -> int:
    """KV cache bytes one token takes over all layers, in `tuning.kv_cache_dtype`."""
    return loaded.kv_layout.bytes_per_token(loaded.dtype, kv_int8=tuning.kv_cache_dtype == "int8")


def kv_cache_blocks(loaded: LoadedModel, tuning: ServingTuning, reserve_bytes: int = 0,
                    draft: LoadedModel | None = None) -> int:
    """KV blocks the engine allocates for `loaded` (call after the model is on its device).

    Capacity in tokens: `tuning.max_total_tokens` if set; else `tuning.kv_cache_bytes` /
    the KV bytes per token (`kv_bytes_per_token`) if set; else on CUDA
    (`gpu_memory_utilization` x the device's free memory - `reserve_bytes`, what the
    decode graphs will hold) / the KV bytes per token; else `CPU_DEFAULT_KV_TOKENS`.
    With a draft model (`speculative.method: draft`) a token's bytes are both models'
    (its KV lives in the same blocks: `draft.py`). A model with recurrent state
    (`state_bytes`) has its `max_running_requests` state slots taken out of the bytes
    first; a model with no attention layer at all (0 KV bytes per token) gets blocks for
    every running request's longest context, as its blocks only count tokens. Rounded
    down to whole blocks of `kv_block_size` tokens.

    Raises:
        ConfigError: `kv_cache_bytes` does not hold the state slots.
    """
    per_token = kv_bytes_per_token(loaded, tuning) + (kv_bytes_per_token(draft, tuning) if draft else 0)
    slots = state_bytes(loaded, tuning)
    if tuning.kv_cache_bytes is not None and tuning.max_total_tokens is None and tuning.kv_cache_bytes <= slots:
        raise ConfigError(f"serving_tuning.kv_cache_bytes ({tuning.kv_cache_bytes}) does not hold the recurrent "
                          f"state of max_running_requests = {tuning.max_running_requests} requests ({slots} bytes)")
    if tuning.max_total_tokens is not None:
        kv_tokens = tuning.max_total_tokens
    elif per_token == 0:
        kv_tokens = tuning.max_running_requests * loaded.max_model_len
    elif tuning.kv_cache_bytes is not None:
        kv_tokens = (tuning.kv_cache_bytes - slots) // per_token
    elif loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        kv_tokens = max(0, int(free * tuning.gpu_memory_utilization) - reserve_bytes - slots) // per_token
    else:
        kv_tokens = CPU_DEFAULT_KV_TOKENS
    return kv_tokens // tuning.kv_block_size


def state_bytes(loaded: LoadedModel, tuning: ServingTuning) -> int:
    """Bytes of the recurrent-state slots (`worker.model.recurrent`): one per running
    request (`max_running_requests`); 0 for a model without recurrent layers."""
    return loaded.state_layout.bytes_per_request * tuning.max_running_requests


def host_kv_slots(loaded: LoadedModel, tuning: ServingTuning) -> int:
    """Blocks of the host-memory KV tier: `tuning.host_kv_bytes` / the bytes of one block
    of the model's cache (`kv_bytes_per_token` x `kv_block_size`; a draft model's KV is not
    kept there: a restored block's draft KV is recomputed, as for any prefix hit). 0: no tier.

    Raises:
        ConfigError: the bytes hold no block; the model is windowed (`kv_window.py` frees
            blocks behind the window in place, which the tier's hash chain does not follow).
    """
    if tuning.host_kv_bytes is None:
        return 0
    block_bytes = kv_bytes_per_token(loaded, tuning) * tuning.kv_block_size
    if loaded.kv_layout.sliding_window is not None:
        raise ConfigError("serving_tuning.host_kv_bytes is set but the model is windowed (sliding-window "
                          "attention in every layer): the host tier is not served for it; unset it")
    if tuning.host_kv_bytes < block_bytes:
        raise ConfigError(f"serving_tuning.host_kv_bytes ({tuning.host_kv_bytes}) holds no KV block: one block "
                          f"of this model takes {block_bytes} bytes ({tuning.kv_block_size} tokens)")
    return tuning.host_kv_bytes // block_bytes


def check_kv_dtype(loaded: LoadedModel, tuning: ServingTuning) -> None:
    """Raises ConfigError: `kv_cache_dtype: int8` where nothing reads it (a back end without
    `READS_INT8_KV`; a latent, MLA, cache)."""
    if tuning.kv_cache_dtype != "int8":
        return
    if not getattr(loaded.backend, "READS_INT8_KV", False):
        raise ConfigError("serving_tuning.kv_cache_dtype 'int8' is not read by the attention back end "
                          f"{loaded.backend.__name__.rsplit('.', 1)[-1]}; use 'auto'")
    if any(layer is not None and layer.value_in_key for layer in loaded.kv_layout.layers):
        raise ConfigError("serving_tuning.kv_cache_dtype 'int8' is not served for a latent (MLA) KV cache; use 'auto'")


def check_recurrent(loaded: LoadedModel, model_cfg: ModelConfig, tuning: ServingTuning) -> None:
    """The features a model with recurrent state (`worker.model.recurrent`) is not served
    with yet. Prefix caching and speculative decoding are turned off for it by the core
    (a state is neither a set of shareable blocks nor able to take back guesses).

    Raises:
        ConfigError: LoRA adapters or a host KV tier."""
    if not loaded.state_layout.specs:
        return
    why = "is not served for a model with recurrent-state layers yet"
    if model_cfg.lora_dir is not None:
        raise ConfigError(f"model.lora_dir {why}; unset it")
    if tuning.host_kv_bytes is not None:
        raise ConfigError(f"serving_tuning.host_kv_bytes {why} (it keeps prefix blocks, and such a model shares "
                          "no prefix); unset it")


def graph_reserve(loaded: LoadedModel, model_cfg: ModelConfig, tuning: ServingTuning) -> int:
    """Device bytes the decode graphs will hold (`worker.model.graphs.graph_memory_estimate`),
    left out of the KV cache; 0 where no CUDA graphs will be captured
    (`worker.engine.compile.graphs_wanted`)."""
    replay, _ = graphs_wanted(model_cfg.cuda_graphs, loaded.device.type, model_cfg.lora_dir is not None,
                              loaded.backend)
    if replay != "cuda":
        return 0
    from worker.model.graphs import graph_memory_estimate

    cfg = loaded.model.config
    hidden = getattr(cfg, "hidden_size", 0) or 0
    return graph_memory_estimate(tuning.max_running_requests, loaded.vocab_size, hidden,
                                 getattr(cfg, "intermediate_size", None) or 4 * hidden)


class Engine:
    """Continuous-batching generation engine over a paged KV cache.

    Build with `Engine.from_pretrained(path, config)`. Typical loop:

        engine.add(RequestInput.of("a", "Hello", params=SamplingParams(max_tokens=8)))
        while engine.has_unfinished():
            for out in engine.step():
                print(out.request_id, out.text, out.finish_reason)
    """

    def __init__(self, loaded: LoadedModel, runner: Runner, config: EngineConfig, num_blocks: int,
                 drafter: Drafter | None = None) -> None:
        """Raises:
            ConfigError: a serving_tuning limit is above the model's context (`ServingTuning.for_model`).
        """
        self.tuning = config.serving_tuning.for_model(loaded.max_model_len)
        self.config = msgspec.structs.replace(config, serving_tuning=self.tuning)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        window = loaded.kv_layout.sliding_window
        lora = runner.lora
        lora_facts = None if lora is None else LoRAFacts(config.model.lora_dir, lora.max_rank, lora.shapes())
        self.facts = ModelFacts(vocab_size=loaded.vocab_size, max_model_len=loaded.max_model_len,
                                kv_capacity_tokens=num_blocks * self.tuning.kv_block_size,
                                eos_token_ids=loaded.eos_token_ids, model_id=loaded.model_id,
                                block_size=self.tuning.kv_block_size, sliding_window=window, lora=lora_facts)
        grammars = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids,
                                   cache_size=self.tuning.grammar_cache_size, closing=self.tuning.structured_closing)
        self.core = EngineCore(runner, self.tuning, num_blocks, loaded.eos_token_ids, loaded.model_id, window,
                               grammars, drafter)
        self.input = InputProcessor(loaded.tokenizer, self.facts, self.tuning)
        if lora_facts is not None:  # adapters load on the loader thread (lora_slots.py)
            from worker.model.lora import read_adapter

            catalog, dtype = self.input.adapters, loaded.dtype  # one cache for the checks and the loads
            catalog.scan()  # every adapter present now checked and logged; later ones on first use
            self.core.scheduler.loras = LoRASlots(config.model.max_loras, self.tuning.max_loras_per_batch,
                                                  lambda name: read_adapter(catalog.resolve(name), dtype),
                                                  self.tuning.max_admission_skips)
        self.output = OutputProcessor(loaded.tokenizer)
        self._live_ids: set[str] = set()
        self._live_lock = threading.Lock()
        self._generate_ids = itertools.count()
        self.compile_report = CompileReport(False, "not built by from_pretrained")  # how the forward runs

    # ---- the parts, for tests and tools ------------------------------------------------
    @property
    def runner(self) -> Runner:
        return self.core.runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        self.core.runner = runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def last_step_stats(self) -> StepStats | None:
        return self.core.last_step_stats

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None) -> Engine:
        """Load a local Hugging Face checkpoint directory and size the KV cache
        (`kv_cache_blocks`).

        Raises:
            FileNotFoundError, UnsupportedModel, ValueError: see `worker.model.loader.load_model`.
        """
        from worker.model.loader import load_model
        from worker.model.runner import ModelRunner

        config = config or EngineConfig()
        model_cfg = ModelConfig(**{**msgspec.structs.asdict(config.model), "path": path})
        config = EngineConfig(model=model_cfg, serving_tuning=config.serving_tuning)
        loaded = load_model(model_cfg)
        tuning = config.serving_tuning
        lora = None
        if model_cfg.lora_dir is not None:  # the adapters' slots, allocated before the KV cache takes the rest
            from worker.model.lora import LoRAWeights, lora_modules

            if not os.path.isdir(model_cfg.lora_dir):
                raise ConfigError(f"model.lora_dir {model_cfg.lora_dir!r} is not a directory")
            lora = LoRAWeights(lora_modules(loaded.model), model_cfg.max_loras, model_cfg.max_lora_rank,
                               loaded.device, loaded.dtype)
        check_kv_dtype(loaded, tuning)
        check_recurrent(loaded, model_cfg, tuning)
        draft = load_draft(tuning.speculative, model_cfg, loaded) if tuning.speculative.method == "draft" else None
        if draft is not None:
            check_kv_dtype(draft, tuning)  # its KV is kept in the same dtype
            if draft.state_layout.specs:  # its runner keeps no state slots
                raise ConfigError("serving_tuning.speculative.draft_model has recurrent-state layers; a draft model "
                                  "with them is not served (use an attention-only draft)")
        num_blocks = kv_cache_blocks(loaded, tuning, reserve_bytes=graph_reserve(loaded, model_cfg, tuning),
                                     draft=draft)
        host_slots = host_kv_slots(loaded, tuning)
        runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=tuning.kv_block_size,
            kv_layout=loaded.kv_layout,
            device=loaded.device,
            dtype=loaded.dtype,
            backend=loaded.backend,
            kv_int8=tuning.kv_cache_dtype == "int8",
            state_layout=loaded.state_layout,
            state_slots=tuning.max_running_requests,
        )
        runner.lora = lora
        if host_slots:
            runner.allocate_host_kv(host_slots)
        drafter = None
        if draft is not None:
            drafter = Drafter(ModelRunner(draft.model, num_blocks=num_blocks, block_size=tuning.kv_block_size,
                                          kv_layout=draft.kv_layout, device=draft.device, dtype=draft.dtype,
                                          backend=draft.backend, kv_int8=tuning.kv_cache_dtype == "int8"),
                              loaded.vocab_size, draft.max_model_len)
        engine = cls(loaded, runner, config, num_blocks, drafter)
        engine.compile_report = compile_engine(runner, model_cfg.compile, engine.generate, model_cfg.cuda_graphs,
                                               engine.tuning.max_running_requests, engine.max_model_len,
                                               model_cfg.precompile)
        report = engine.compile_report
        if drafter is not None and (report.compiled or report.cuda_graph_sizes):  # the draft model's forward too
            artifacts = precompiled_dir() if model_cfg.precompile else None
            how = [drafter.compile(engine.generate, artifacts)] if report.compiled else ["eager"]
            if report.cuda_graph_sizes:
                how.append(drafter.capture_graphs(engine.tuning.max_running_requests, engine.max_model_len,
                                                  report.cuda_graph_replay, engine.generate))
            engine.compile_report = msgspec.structs.replace(report, draft=", ".join(how))
        return engine

    # ---- requests in (any thread) ----------------------------------------------------
    def add(self, inp: RequestInput) -> int:
        """Validate, tokenize and queue a request; it joins the batch at the next step.

        `inp.cache_salt` (e.g. the tenant) keeps its prefix-cache blocks apart from other
        salts; `inp.tenant` is whose share and quotas it counts against
        (`serving_tuning.tenants`). A request still waiting (never scheduled) at its
        `deadline` ends with `finish_reason="expired"`, `error_code="deadline_passed"`.

        BOS: the ids of a text prompt or of chat messages never start with more than one
        BOS id. A text that already begins with the BOS text (`"<s>Paris…"`), tokenized by
        a tokenizer that prepends BOS, gives two (as transformers' `encode` does): the
        leading duplicates are dropped and one BOS is kept (logged at debug level); the
        same holds for a chat template whose output starts with repeated BOS. A
        `TokenPrompt`'s ids are used exactly as given.

        Returns:
            the number of prompt tokens (after the BOS rule).

        Raises:
            RequestRejected: with a `RejectReason`; the request was not queued.
        """
        req = self.input.process(inp)
        self.submit(req)
        return len(req.prompt_token_ids)

    def add_request(self, request_id: str, prompt: str | None = None, **fields: Any) -> int:
        """`add(RequestInput.of(request_id, prompt, **fields))`: the keyword form (exactly
        one of `prompt`, `prompt_token_ids`, `messages` with `tools`; the other fields of
        `RequestInput` by name).

        Raises:
            RequestRejected: as `add`, and `invalid_prompt` when not exactly one prompt is given.
        """
        return self.add(RequestInput.of(request_id, prompt, **fields))

    def submit(self, req: EngineCoreRequest) -> None:
        """Queue a request already made by `self.input.process` (thread-safe).

        Raises:
            RequestRejected: `duplicate_request_id` (an unfinished request has this id) or
                `overloaded` (`overload_policy: reject` and no free slot).
        """
        with self._live_lock:
            if req.request_id in self._live_ids:
                raise RequestRejected(req.request_id, RejectReason.DUPLICATE_REQUEST_ID,
                                      "a request with this id is unfinished")
            if self.tuning.overload_policy == "reject":
                busy = self.scheduler.num_running + self.scheduler.num_waiting + self.core.num_queued
                if busy >= self.tuning.max_running_requests:
                    raise RequestRejected(req.request_id, RejectReason.OVERLOADED,
                                          f"{busy} requests in flight, no free slot")
            self._live_ids.add(req.request_id)
            self.output.add(req.request_id, req.params.stop, len(req.prompt_token_ids), req.options.arrival_time)
            self.core.add(req)

    def abort(self, request_id: str) -> None:
        """Cancel a request. Its blocks are freed and a `cancelled` output is emitted by
        the next `step`. Unknown or finished ids are ignored."""
        self.core.abort(request_id)

    # ---- the step (engine thread) ----------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine-core step (see `EngineCore.step` for the failure rules), then its
        output processing: text deltas, stop strings, final outputs. A request a stop
        string ended is finished in the core before this returns (its blocks free; with
        `async_scheduling`, at the end of the step already in flight, whose token for it
        is dropped).
        After every call `last_step_stats` describes the step."""
        processed = self.output.process(self.core.step())
        for request_id, status in processed.finish:
            self.core.finish(request_id, status)
        if processed.num_internal_errors:
            stats = self.core.last_step_stats
            self.core.last_step_stats = msgspec.structs.replace(
                stats, num_internal_errors=stats.num_internal_errors + processed.num_internal_errors)
        finished = [o.request_id for o in processed.outputs if o.finished]
        if finished:
            with self._live_lock:
                self._live_ids.difference_update(finished)
        return processed.outputs

    # ---- conveniences ----------------------------------------------------------------
    def kv_stats(self) -> KVStats:
        """Block counts of the KV cache (engine thread; a snapshot)."""
        return self.core.kv_stats()

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Priority | str = Priority.NORMAL,
    ) -> list[CompletionOutput]:
        """Run a batch of prompts (text or token id lists) to completion, in order.

        Raises:
            RequestRejected: for the first prompt that is rejected (none is run then).
        """
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        base = f"generate-{next(self._generate_ids)}"
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            rid = f"{base}-{i}"
            prompt = TextPrompt(p) if isinstance(p, str) else TokenPrompt(list(p))
            reqs.append(self.input.process(RequestInput(rid, prompt, sp, RequestOptions(priority))))
        for r in reqs:
            self.submit(r)
        ids = [r.request_id for r in reqs]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        lps: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text)
                if out.logprobs:
                    lps[out.request_id].extend(out.logprobs)
                if out.finished:
                    done[out.request_id] = out
        return [
            CompletionOutput(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                token_ids=tokens[r.request_id],
                text="".join(texts[r.request_id]),
                finish_reason=done[r.request_id].finish_reason,
                usage=done[r.request_id].usage or Usage(prompt_tokens=len(r.prompt_token_ids),
                                                        completion_tokens=len(tokens[r.request_id])),
                logprobs=lps[r.request_id] or None,
            )
            for r in reqs
        ]

    def check_invariants(self) -> None:
        """Raise RuntimeError if KV bookkeeping is inconsistent (call from the engine thread)."""
        self.core.check_invariants()
