"""Engine settings: which checkpoint to load (`ModelConfig`) and the capacity limits
and tenant policies of one engine (`ServingTuning`); `EngineConfig` joins the two and is
all an engine needs (no Kafka or Redis)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from worker.config.checks import ConfigError, one_of, positive
from worker.config.speculative import SpeculativeConfig

KV_POLICIES = ("optimistic", "reserve")
OVERLOAD_POLICIES = ("queue_or_reject", "reject")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("auto", "on", "off")
# model.cpu_linear (worker/model/small_batch.py POLICIES)
CPU_LINEAR_MODES = ("auto", "inflight", "torch")
# model.quantization (worker/model/quant_load.py AT_LOAD holds the schemes)
QUANTIZATION_MODES = ("none", "fp8", "w8a8_int8", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8")
CUDA_GRAPH_MODES = ("auto", "off")
ENGINES = ("inflight", "vllm")


class TenantPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one tenant gets inside the engine (validated by ServingTuning, which names
    the field: `serving_tuning.tenants['acme'].weight`).

    Attributes:
        weight: its share of service relative to other tenants of the same priority
            class (2 = twice the tokens of a weight-1 tenant while both are backlogged).
        max_running_requests: most of its requests in the running batch at once (all
            classes); more wait, they are not rejected. None: no cap.
        max_kv_blocks: most KV blocks its running requests hold together (block-table
            entries; a prefix block shared by two of its requests counts twice). A
            request that would pass it waits; a running one that needs a block beyond
            it preempts the tenant's own latest request (or itself). A request whose
            prompt + max_tokens can never fit it is rejected (`exceeds_kv_capacity`).
            None: no cap.
        fleet_tokens_per_s: tokens per second the tenant may start across the whole
            fleet (every worker of the consumer group), held through a token bucket in
            Redis (`worker/serve/fleet_quota.py`). A job costs its prompt tokens plus
            its `max_tokens` when it is taken; what it did not generate is given back
            when it ends. A job waits (it is never rejected) while the tenant's bucket
            is empty. Set the same value on every worker. None: no fleet rate.
        fleet_burst_tokens: the bucket's size, in tokens: how much the tenant may start
            at once after an idle spell. None: one second of `fleet_tokens_per_s`. A
            job larger than the bucket still runs, once the bucket is full.
        fleet_max_running: most of its jobs held across the fleet at once (claimed or
            in an engine). More wait. None: no fleet cap.
    """

    weight: float = 1.0
    max_running_requests: int | None = None
    max_kv_blocks: int | None = None
    fleet_tokens_per_s: float | None = None
    fleet_burst_tokens: int | None = None
    fleet_max_running: int | None = None

    @property
    def fleet_limited(self) -> bool:
        """Whether a fleet-wide limit applies to the tenant."""
        return self.fleet_tokens_per_s is not None or self.fleet_max_running is not None


DEFAULT_MAX_OUTPUT_TOKENS = 1024  # max_output_tokens when unset (capped by the model's context)
# Bounds of the fleet limits (worker/serve/fleet_quota.py keeps its Redis arithmetic exact below them):
# far above any fleet's throughput; leave the field unset for no limit.
MAX_FLEET_TOKENS_PER_S = 1e12
MAX_FLEET_BURST_TOKENS = 10**15


class ServingTuning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Capacity limits of one engine, in the vocabulary of TGI / TensorRT-LLM.

    Attributes:
        max_running_requests: most requests in the running batch at once.
        max_total_tokens: KV cache capacity in tokens (rounded down to whole blocks).
            None: `kv_cache_bytes` / the bytes one token takes when that is set, else
            derived from free GPU memory on CUDA, 16384 on CPU.
        kv_cache_bytes: KV cache capacity in bytes (vLLM's `kv_cache_memory_bytes`): the
            tokens it holds follow `kv_cache_dtype` and the model's KV layout. Exclusive
            with `max_total_tokens`.
        kv_cache_dtype: `auto` (the model's dtype) or `int8` (each token's key and value
            per KV head in int8 with a float32 scale: `worker/model/kernels/kv_int8.py`;
            3.8x the tokens of an fp32 cache in the same bytes at head size 64). Every
            attention back end reads it; latent (MLA) caches refuse it.
        max_input_tokens: longest prompt accepted, in tokens. Unset: the model's
            context minus one (room for one output token). Above the context: a config
            error at start naming both numbers.
        max_output_tokens: most tokens one request may generate (default for
            requests without `max_tokens`, and an upper bound for those with it).
            Unset: 1024, or the model's context minus one when that is less. Above the
            context: a config error.
        max_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        admission_control: reject at once requests that can never fit.
        overload_policy: `queue_or_reject` queues what fits later; `reject` also
            rejects requests that cannot start now (used by the worker).
        kv_policy: `optimistic` admits when the prompt fits and preempts by recompute
            when blocks run out (vLLM); `reserve` admits only when prompt + max_tokens
            fit and never evicts (TensorRT-LLM GUARANTEED_NO_EVICT, TGI).
        kv_block_size: tokens per KV block.
        enable_prefix_caching: share full KV blocks between equal prefixes.
        host_kv_bytes: a host-memory tier behind the prefix cache, in bytes (vLLM's
            `kv_offloading_size`, SGLang's HiCache): full blocks evicted from the device's
            prefix cache are copied there (least recently used dropped), and a prefix found
            there is copied back instead of recomputed (`worker/engine/kv_host.py`). Holds
            this many bytes / one block's bytes (of `kv_cache_dtype`) blocks; pinned memory
            on CUDA. None: no tier. Needs `enable_prefix_caching`; not served for windowed
            models (a config error at start).
        priority_aging_steps: a waiting request gains one priority class per this
            many engine steps, so low priority never starves.
        max_admission_skips: how many requests of its rank may be admitted ahead of a
            waiting request that cannot get its KV blocks (bounded skipping); after
            that it holds a reservation and nothing ranked behind it is admitted
            until it is. 0: strict head-of-line order.
        gpu_memory_utilization: fraction of free GPU memory given to the KV cache
            when `max_total_tokens` is unset.
        max_oom_retries: times a request whose step ran out of GPU memory is
            recomputed before it ends with `finished(error)`, code `oom` (0: fail at once).
        fair_share: inside a priority class, serve tenants by least service received
            (Virtual Token Counter, Sheng et al., OSDI 2024; rules in
            `worker/engine/fair_share.py`); False: arrival order, as without tenants.
        fair_prefill_weight, fair_decode_weight: service of one prompt token computed
            and of one output token, in the counters (VTC's w_p = 1, w_q = 2).
        tenants: per-tenant weight and quotas, by the job's `tenant`; tenants not
            listed get `default_tenant`. Jobs without a tenant are the tenant `""`.
        default_tenant: the weight and quotas of every tenant `tenants` does not list.
        async_scheduling: launch step N+1 on the device (its forward on a thread of its
            own) before step N's outputs are built and handed on, so output work
            (outputs, detokenization, the engine process's pipe) overlaps the forward
            (`EngineCore` docstring; vLLM's async scheduling). Same tokens either way.
            Unset (None): on where the forward thread mostly waits for a device (CUDA,
            the emulated device of `null_engine(device_ms=...)`: the runner's
            `capabilities.overlaps_host`), off on the CPU, where both threads run Python and share
            the GIL (measured 0.42-1.05x of sequential steps: docs/benchmarks.md), and
            off with `speculative` (true with it is a config error).
        max_structured_output_bytes: largest `params.structured` constraint accepted, in
            bytes of its JSON (a larger one is rejected `invalid_structured_output`, not
            compiled).
        grammar_cache_size: compiled grammars kept, by content (least recently used
            dropped), so jobs sharing a schema compile it once.
        structured_closing: budget-aware constrained outputs: a constrained request whose
            remaining `max_tokens` fall to what its grammar needs to end is steered to
            end, so its JSON or tool call still parses (`worker/engine/closing.py`).
        long_prefill_threshold: prompt-length tiering inside a worker (vLLM's
            `long_prefill_token_threshold` idea): a request whose prefill covers more than
            this many tokens (prompt, plus outputs when recomputed after a preemption) is
            *long*, and one step spends at most `max_long_prefill_tokens` on the prefill
            chunks of long requests, so a long prompt's chunked prefill never takes the
            whole step while short prompts wait (scheduler.py). None: no tiering.
        max_long_prefill_tokens: the per-step cap on long requests' prefill tokens (a
            long request that gets none this step waits; short ones are admitted past
            it). Unset: `long_prefill_threshold`. Requires `long_prefill_threshold`.
        max_loras_per_batch: most distinct LoRA adapters among the running requests
            (S-LoRA / SGLang's `--max-loras-per-batch`); a request of another adapter
            waits (bounded skipping: it is not starved). Unset: `model.max_loras`.
        speculative: speculative decoding (`SpeculativeConfig`); off by default.
    """

    max_running_requests: int = 64
    max_total_tokens: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_batched_tokens: int = 2048
    admission_control: bool = True
    overload_policy: str = "queue_or_reject"
    kv_policy: str = "optimistic"
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    host_kv_bytes: int | None = None
    priority_aging_steps: int = 512
    max_admission_skips: int = 8
    gpu_memory_utilization: float = 0.85
    max_oom_retries: int = 1
    fair_share: bool = True
    fair_prefill_weight: float = 1.0
    fair_decode_weight: float = 2.0
    tenants: dict[str, TenantPolicy] = msgspec.field(default_factory=dict)
    default_tenant: TenantPolicy = msgspec.field(default_factory=TenantPolicy)
    async_scheduling: bool | None = None
    max_structured_output_bytes: int = 65536
    grammar_cache_size: int = 1024
    structured_closing: bool = True
    long_prefill_threshold: int | None = None
    max_loras_per_batch: int | None = None
    max_long_prefill_tokens: int | None = None
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)

    @property
    def long_prefill_cap(self) -> int | None:
        """Tokens one step may spend on long requests' prefill chunks (None: no cap)."""
        if self.long_prefill_threshold is None:
            return None
        return self.max_long_prefill_tokens or self.long_prefill_threshold

    def for_model(self, max_model_len: int) -> ServingTuning:
        """This tuning with the limits that follow the model filled in (`max_input_tokens`,
        `max_output_tokens`; see their docs). Idempotent.

        Raises:
            ConfigError: a configured limit is above the model's context (both numbers named).
        """
        for name in ("max_input_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value > max_model_len:
                raise ConfigError(
                    f"serving_tuning.{name} is {value}, above the model's context of {max_model_len} tokens "
                    f"(model.max_model_len, else the checkpoint's max_position_embeddings); unset it to use "
                    f"{min(DEFAULT_MAX_OUTPUT_TOKENS, max_model_len - 1) if name == 'max_output_tokens' else max_model_len - 1}")
        longest = max(1, max_model_len - 1)
        return msgspec.structs.replace(
            self, max_input_tokens=self.max_input_tokens if self.max_input_tokens is not None else longest,
            max_output_tokens=(self.max_output_tokens if self.max_output_tokens is not None
                               else min(DEFAULT_MAX_OUTPUT_TOKENS, longest)))

    def tenant_policy(self, tenant: str) -> TenantPolicy:
        """The weight and quotas of `tenant` (`default_tenant` if it is not listed)."""
        return self.tenants.get(tenant, self.default_tenant)

    def __post_init__(self) -> None:
        positive(
            "serving_tuning",
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.max_total_tokens,
            kv_cache_bytes=self.kv_cache_bytes,
            max_input_tokens=self.max_input_tokens,
            max_output_tokens=self.max_output_tokens,
            max_batched_tokens=self.max_batched_tokens,
            kv_block_size=self.kv_block_size,
            priority_aging_steps=self.priority_aging_steps,
            max_structured_output_bytes=self.max_structured_output_bytes,
            grammar_cache_size=self.grammar_cache_size,
            max_loras_per_batch=self.max_loras_per_batch,
            long_prefill_threshold=self.long_prefill_threshold,
            max_long_prefill_tokens=self.max_long_prefill_tokens,
            host_kv_bytes=self.host_kv_bytes,
        )
        if self.host_kv_bytes is not None and not self.enable_prefix_caching:
            raise ConfigError("serving_tuning.host_kv_bytes is set and serving_tuning.enable_prefix_caching is false: "
                              "the host tier keeps blocks the prefix cache evicts; enable prefix caching or unset it")
        if self.speculative.enabled and self.async_scheduling:
            raise ConfigError("serving_tuning.async_scheduling is true and serving_tuning.speculative.method is "
                              f"{self.speculative.method!r}: speculative decoding runs sequential steps (a draft "
                              "is proposed from the request's known tokens); unset async_scheduling")
        if self.max_long_prefill_tokens is not None and self.long_prefill_threshold is None:
            raise ConfigError("serving_tuning.max_long_prefill_tokens needs serving_tuning.long_prefill_threshold "
                              "(which prompts count as long); set both, or neither")
        one_of("serving_tuning", "kv_policy", self.kv_policy, KV_POLICIES)
        one_of("serving_tuning", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_bytes is not None and self.max_total_tokens is not None:
            raise ConfigError("serving_tuning.kv_cache_bytes and serving_tuning.max_total_tokens both size the KV "
                              "cache; set one")
        one_of("serving_tuning", "overload_policy", self.overload_policy, OVERLOAD_POLICIES)
        for name in ("max_oom_retries", "max_admission_skips"):
            if getattr(self, name) < 0:
                raise ConfigError(f"serving_tuning.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"serving_tuning.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.kv_block_size:
            raise ConfigError(
                f"serving_tuning.max_total_tokens ({self.max_total_tokens}) must hold at least one "
                f"KV block of kv_block_size={self.kv_block_size} tokens"
            )
        if not self.fair_prefill_weight >= 0:
            raise ConfigError(f"serving_tuning.fair_prefill_weight must be >= 0, got {self.fair_prefill_weight}")
        if not self.fair_decode_weight > 0:
            raise ConfigError(f"serving_tuning.fair_decode_weight must be > 0, got {self.fair_decode_weight}")
        _check_tenant("serving_tuning.default_tenant", self.default_tenant)
        for name, policy in self.tenants.items():
            _check_tenant(f"serving_tuning.tenants[{name!r}]", policy)


def _check_tenant(where: str, policy: TenantPolicy) -> None:
    if not (policy.weight > 0 and policy.weight < float("inf")):
        raise ConfigError(f"{where}.weight must be > 0 and finite, got {policy.weight}")
    for name in ("max_running_requests", "max_kv_blocks", "fleet_burst_tokens", "fleet_max_running"):
        value = getattr(policy, name)
        if value is not None and value < 1:
            raise ConfigError(f"{where}.{name} must be >= 1 or null, got {value}")
    rate = policy.fleet_tokens_per_s
    if rate is not None and not (0 < rate <= MAX_FLEET_TOKENS_PER_S):
        raise ConfigError(f"{where}.fleet_tokens_per_s must be in (0, {MAX_FLEET_TOKENS_PER_S:g}], or null for no "
                          f"fleet rate, got {rate}")
    if policy.fleet_burst_tokens is not None and policy.fleet_burst_tokens > MAX_FLEET_BURST_TOKENS:
        raise ConfigError(f"{where}.fleet_burst_tokens must be <= {MAX_FLEET_BURST_TOKENS:g}, got "
                          f"{policy.fleet_burst_tokens}")
    if policy.fleet_burst_tokens is not None and rate is None:
        raise ConfigError(f"{where}.fleet_burst_tokens needs fleet_tokens_per_s (the bucket's refill rate)")


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which checkpoint to load and where.

    Attributes:
        path: local Hugging Face checkpoint directory (config.json, weights, tokenizer).
        dtype: `auto` = bfloat16 on CUDA, float32 on CPU.
        device: `auto` = cuda if available, else cpu.
        attention_backend: `auto` = Triton on CUDA; on the CPU `cpu` (the torch reference
            with decodes in a C kernel built at first use) when a C compiler builds it, else
            `torch` (the reference alone).
        max_model_len: context length; None = the model config's `max_position_embeddings`
            (a sliding window limits what a layer reads, not the context).
        load_check: at load, run the model once through the paged runner and once
            through transformers' eager attention and refuse it unless they agree
            (`worker.model.load_check`; a few forwards of 11 tokens). Turning it off keeps
            only the config and module checks.
        lora_dir: directory of LoRA adapters in PEFT's format, one subdirectory per
            adapter name (`adapter_config.json` + `adapter_model.safetensors`); read when
            a job first names an adapter, so adapters added later are served without a
            restart. None: jobs naming an adapter are rejected (`unknown_adapter`).
        max_loras: adapters resident on the device at once (least recently used ones
            not in use are evicted); their buffers come out of the KV cache's memory.
        max_lora_rank: largest adapter rank served (`invalid_adapter` above it); sizes
            the buffers: max_loras x max_lora_rank x (in + out features) per projection.
        compile: run the model's forward under `torch.compile` (`worker.model.compiled`):
            `on`, `off`, or `auto` = on where it was measured faster (the CPU: decode steps
            1.16x, offline throughput 1.01x on the benchmark model, docs/benchmarks.md),
            off on CUDA until a GPU measures it. The graph is built at start-up (7-30 s
            on a 2-core box); a model whose compiled forward fails its warm-up runs
            eagerly with one log line saying why (LoRA adapters compile too).
        precompile: with `compile` on, capture the compiled forward ahead of time
            (`torch.compiler.precompile`, torch >= 2.15, the CPU) into
            `$XDG_CACHE_HOME/inflight/precompiled`, and load it at the next start with the
            same model, code and versions, skipping the trace (`worker.model.compiled`);
            false: `torch.compile` traces the model at every start. A model the capture
            refuses falls back to `torch.compile` with one log line.
        cpu_linear: how float32 linear layers multiply on the CPU
            (`worker.model.small_batch`): `auto` = per weight shape and row count, the
            fastest of torch's GEMM, Inflight's small-batch kernel and oneDNN's packed
            weights, timed at load on this box (well under a second for the benchmark
            models); `inflight` = the kernel for a few rows and oneDNN above, a rule
            measured on an AMD EPYC box; `torch` = torch's GEMM throughout (the same bits
            as transformers). Workers whose timings chose differently may differ in the
            last bits of their logits; a fixed choice makes a fleet agree.
        cuda_graphs: replay decode-only steps of up to `max_running_requests` requests
            from CUDA graphs captured at start-up (`worker.model.graphs`): `auto` = on
            for CUDA with the Triton back end and no LoRA adapters (their memory is left
            out of the KV cache), `off`. Graphs whose greedy ids differ from the eager
            forward's at start-up are dropped with one log line saying why.
        quantization: quantize a float checkpoint's decoder linear layers while loading it
            (`worker.model.quant_load`): `none`; `w8a8_int8` (int8 weights per output
            channel, activations quantized to int8 per token at each step: a decode step
            1.3x (1 request) to 1.85x (32) the fp32 one on the benchmark box, the fastest
            at large batches); `int8` / `int4` (weight-only, int4 in groups of 128: 4x /
            8x less weight memory than fp32; through a C kernel on the CPU, a decode step
            1.96x / 2.47x the fp32 one at 1 request, 1.1x at 32); `fp8` (E4M3 weights
            per output channel, activations rounded to FP8 per token: `torch._scaled_mm`
            on CUDA; on the CPU, where FP8 is emulated, the weights are dequantized again,
            so only the rounding remains). A checkpoint that is already quantized (compressed-tensors,
            GPTQ, AWQ, MXFP4) is served as it is and needs `none`. docs/models.md.
        engine: the engine core behind the worker: `inflight` (this project's) or `vllm`
            (vLLM's V1 `EngineCore` in vLLM's own interpreter, `worker.engine.vllm_core`;
            needs `worker.engine_process`; what each engine offers: docs/engines.md).
            With `vllm`, `device`, `attention_backend`, `load_check`, `compile`,
            `precompile`, `cpu_linear` and `cuda_graphs` are vLLM's business (`vllm_args`), `dtype: auto` is vLLM's
            `auto`, and `lora_dir` turns on vLLM's LoRA (`max_loras` adapters cached,
            `serving_tuning.max_loras_per_batch` in one batch).
        vllm_python: the interpreter of an environment with vLLM installed (e.g.
            `.cache/vllm-venv/bin/python` from tools/setup_vllm.sh); required with
            `engine: vllm`.
        vllm_args: vLLM engine arguments (`vllm.EngineArgs` keywords: tensor_parallel_size,
            quantization, kv_cache_dtype, enforce_eager, speculative_config, ...) over the
            ones derived from `model` and `serving_tuning`; vLLM validates them at start
            and a refusal is a config error naming `model.vllm_args`.
    """

    path: str = ""
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    load_check: bool = True
    lora_dir: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    compile: str = "auto"
    precompile: bool = True
    cpu_linear: str = "auto"
    cuda_graphs: str = "auto"
    quantization: str = "none"
    engine: str = "inflight"
    vllm_python: str | None = None
    vllm_args: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        one_of("model", "engine", self.engine, ENGINES)
        if self.engine == "vllm" and not self.vllm_python:
            raise ConfigError("model.vllm_python is required with model.engine 'vllm': the interpreter of an "
                              "environment with vLLM installed (tools/setup_vllm.sh makes .cache/vllm-venv/bin/python)")
        if self.vllm_args and self.engine != "vllm":
            raise ConfigError(f"model.vllm_args is set but model.engine is {self.engine!r}: it applies only to "
                              "'vllm'")
        one_of("model", "dtype", self.dtype, DTYPES)
        one_of("model", "compile", self.compile, COMPILE_MODES)
        one_of("model", "cpu_linear", self.cpu_linear, CPU_LINEAR_MODES)
        one_of("model", "quantization", self.quantization, QUANTIZATION_MODES)
        if self.quantization != "none" and self.engine == "vllm":
            raise ConfigError(f"model.quantization is {self.quantization!r} but model.engine is 'vllm': vLLM "
                              "quantizes by its own arguments (model.vllm_args: quantization)")
        one_of("model", "cuda_graphs", self.cuda_graphs, CUDA_GRAPH_MODES)
        one_of("model", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"model.device must be one of ['auto', 'cpu', 'cuda', 'cuda:N'], got {self.device!r}")
        positive("model", max_model_len=self.max_model_len, max_loras=self.max_loras,
                 max_lora_rank=self.max_lora_rank)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the engine needs: the model and its capacity limits."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serving_tuning: ServingTuning = msgspec.field(default_factory=ServingTuning)

    def __post_init__(self) -> None:
        t = self.serving_tuning
        if self.model.engine == "vllm":
            for name, value, theirs in (("kv_cache_dtype", t.kv_cache_dtype != "auto", "kv_cache_dtype"),
                                        ("kv_cache_bytes", t.kv_cache_bytes is not None, "kv_cache_memory_bytes"),
                                        ("host_kv_bytes", t.host_kv_bytes is not None, "kv_offloading_size")):
                if value:
                    raise ConfigError(f"serving_tuning.{name} is set but model.engine is 'vllm': vLLM sizes its "
                                      f"cache by its own arguments (model.vllm_args: {theirs})")
            if t.speculative.enabled:
                raise ConfigError("serving_tuning.speculative is on but model.engine is 'vllm': vLLM speculates by "
                                  "its own arguments (model.vllm_args: speculative_config)")
        per_batch = self.serving_tuning.max_loras_per_batch
        if per_batch is not None and per_batch > self.model.max_loras:
            raise ConfigError(f"serving_tuning.max_loras_per_batch ({per_batch}) must be <= model.max_loras "
                              f"({self.model.max_loras}): only resident adapters can run")
