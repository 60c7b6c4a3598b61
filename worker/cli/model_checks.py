"""`inflight check`'s model checks: the model loads, the request limits in force, and the
KV cache fits the memory left after loading (see `preflight.py` for the whole list)."""

from __future__ import annotations

import time

from worker.cli.checks import Check
from worker.cli.checks import gib as _gib
from worker.cli.checks import short as _short
from worker.config import WorkerConfig


def model_checks(cfg: WorkerConfig) -> list[Check]:
    """`model`: the worker's loader on `model.path` (weights, tokenizer, device, dtype),
    chat template and the capability verdict reported (an architecture the engine cannot
    reproduce fails here, with the loader's one-line reason); `kv cache`: the engine's KV sizing for `serving_tuning`
    against the memory left after loading (free GPU memory x gpu_memory_utilization on
    CUDA, available RAM (cgroup limit included) on CPU); `draft model` with
    `speculative.method: draft`."""
    if not cfg.model.path:
        return [Check("model", "fail", "model.path", "not set (or INFLIGHT_MODEL__PATH)"), *_skipped("no model")]
    if cfg.model.engine == "vllm":
        return vllm_checks(cfg)
    from worker.model.loader import load_model

    t0 = time.perf_counter()
    try:
        loaded = load_model(cfg.model)
    except Exception as e:  # any failure to load is this check's answer, with its message
        setting = "model.device" if "model.device" in str(e) else "model.path"
        detail = _short(e) if cfg.model.path in str(e) else f"{cfg.model.path!r}: {_short(e)}"
        return [Check("model", "fail", setting, detail), *_skipped("the model did not load")]
    tok = loaded.tokenizer
    template = ("chat template present" if getattr(tok, "chat_template", None)
                else "no chat template: jobs with `messages` are rejected")
    checks = [Check("model", "pass", "model.path",
                    f"{cfg.model.path!r}: {loaded.model_id.split(':')[0]}, {loaded.num_layers} layers, "
                    f"{loaded.device} {str(loaded.dtype).removeprefix('torch.')}, context {loaded.max_model_len}; "
                    f"tokenizer vocab {len(tok)}; {template}; loaded in {time.perf_counter() - t0:.1f} s; "
                    f"{loaded.verdict()}")]
    checks.append(limits_check(cfg, loaded))
    checks.append(kv_check(cfg, loaded))
    checks.append(compile_check(cfg, loaded))
    if cfg.serving_tuning.speculative.method == "draft":
        checks.append(draft_check(cfg, loaded))
    return checks


def draft_check(cfg: WorkerConfig, loaded) -> Check:
    """`draft model`: the draft checkpoint of `speculative.method: draft` loads beside the
    model and shares its tokenizer (`worker.engine.draft.load_draft`)."""
    from worker.config import ConfigError
    from worker.engine.draft import load_draft

    field = "serving_tuning.speculative.draft_model"
    try:
        draft = load_draft(cfg.serving_tuning.speculative, cfg.model, loaded)
    except ConfigError as e:
        return Check("draft model", "fail", field, _short(e))
    return Check("draft model", "pass", field, f"{cfg.serving_tuning.speculative.draft_model!r}: {draft.num_layers} "
                                               f"layers, the model's tokenizer; {draft.verdict()}")


def vllm_checks(cfg: WorkerConfig) -> list[Check]:
    """With `model.engine: vllm`: vLLM's own validation of the engine arguments and the
    model config in its interpreter (`VllmEngine.check`: no weights loaded), and the
    tokenizer the worker builds; vLLM sizes its KV cache itself when it starts."""
    from worker.config import ConfigError
    from worker.engine.vllm_spec import VllmEngine

    spec = VllmEngine(cfg.model.path, cfg.engine, cfg.model.vllm_python or "")
    t0 = time.perf_counter()
    try:
        facts = spec.check()
        tok = spec.build_tokenizer()
    except ConfigError as e:
        field = "model.vllm_python" if "model.vllm_python" in str(e) else "model.vllm_args"
        return [Check("model", "fail", field, _short(e)), *_skipped("vLLM refused the model or its arguments")]
    except Exception as e:  # the check process broke, or the tokenizer did not load
        return [Check("model", "fail", "model.path", f"{cfg.model.path!r}: {_short(e)}"),
                *_skipped("vLLM's check did not pass")]
    lora = "; LoRA on" if facts["lora"] else ""
    return [Check("model", "pass", "model.engine",
                  f"vLLM {facts['vllm']} accepts {cfg.model.path!r}: {facts['architecture']}, {facts['device']} "
                  f"{facts['dtype']}, context {facts['max_model_len']}, tensor parallel {facts['tensor_parallel_size']}"
                  f", quantization {facts['quantization'] or 'none'}, KV {facts['kv_cache_dtype']}{lora}; "
                  f"tokenizer vocab {len(tok)}; checked in {time.perf_counter() - t0:.1f} s"),
            Check("limits", "skip", "serving_tuning.max_input_tokens",
                  f"applied by the worker against vLLM's context ({facts['max_model_len']}) once the engine starts"),
            Check("kv cache", "skip", "serving_tuning.max_total_tokens", "vLLM sizes its KV cache when it starts"),
            Check("compile", "skip", "model.vllm_args", "vLLM compiles its forward itself (its compilation_config)")]


def _skipped(why: str) -> list[Check]:
    return [Check("limits", "skip", "serving_tuning.max_input_tokens", f"not checked: {why}"),
            Check("kv cache", "skip", "serving_tuning.max_total_tokens", f"not checked: {why}"),
            Check("compile", "skip", "model.compile", f"not checked: {why}")]


def compile_check(cfg: WorkerConfig, loaded) -> Check:
    """How the engine's forward will run (`model.compile`, `model.precompile`;
    `worker.engine.compile`): eager and why; a captured forward ready to load (its
    directory); captured by the first start; or `torch.compile` at every start. On the
    CPU Inductor needs a C++ compiler: without one the forward runs eagerly (said here,
    as the engine says it at start). Informational: the engine starts either way."""
    import torch

    from worker.engine import compile as rules
    from worker.model import compiled

    on, why = rules.wanted(cfg.model.compile, loaded.device.type)
    if not on:
        return Check("compile", "info", "model.compile", f"eager ({why})")
    if loaded.device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # none on the PATH (or CXX names one that is not there)
            return Check("compile", "info", "model.compile",
                         f"eager: no C++ compiler for Inductor ({_short(e)}); install g++ or set model.compile: off")
    if not (cfg.model.precompile and compiled.precompile_available(loaded.device.type)):
        reason = ("model.precompile is off" if not cfg.model.precompile
                  else f"no ahead-of-time capture on {loaded.device.type} with torch {torch.__version__}")
        return Check("compile", "info", "model.precompile",
                     f"{why}; torch.compile traces the model at every start ({reason})")
    path = rules.precompiled_dir() / compiled.artifact_key(loaded.model)
    if (path / compiled.ARTIFACT).exists():
        return Check("compile", "info", "model.precompile", f"{why}; a captured forward is ready, the start loads "
                                                            f"it ({path})")
    return Check("compile", "info", "model.precompile", f"{why}; the first start captures the forward (the "
                                                        f"trace and Inductor's kernels) into {path}, later starts "
                                                        "load it")


def limits_check(cfg: WorkerConfig, loaded) -> Check:
    """The request limits in force: configured, or following the model's context
    (`ServingTuning.for_model`); one above the context fails, and so does a pool bound
    (`pools`) above the resolved `max_input_tokens` (the worker would refuse to start)."""
    t = cfg.serving_tuning
    try:
        limits = t.for_model(loaded.max_model_len)
    except ValueError as e:  # ConfigError
        return Check("limits", "fail", "serving_tuning." + str(e).split()[0].split(".")[-1], str(e))
    from worker.config import ConfigError
    from worker.serve.pool_router import check_pool_limits

    try:
        check_pool_limits(cfg, limits.max_input_tokens, loaded.max_model_len)
    except ConfigError as e:
        return Check("limits", "fail", "pools", str(e))
    origin = {n: "set" if getattr(t, n) is not None else f"from the context of {loaded.max_model_len}"
              for n in ("max_input_tokens", "max_output_tokens")}
    return Check("limits", "pass", "serving_tuning.max_input_tokens",
                 f"max_input_tokens {limits.max_input_tokens} ({origin['max_input_tokens']}), max_output_tokens "
                 f"{limits.max_output_tokens} ({origin['max_output_tokens']})")


def kv_check(cfg: WorkerConfig, loaded) -> Check:
    """KV bytes = blocks the engine would allocate x block size x bytes per token, against
    the memory budget of `loaded.device` now."""
    import torch

    from worker.engine.engine import kv_bytes_per_token, kv_cache_blocks

    tuning = cfg.serving_tuning
    per_token = kv_bytes_per_token(loaded, tuning)
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        budget = int(free * tuning.gpu_memory_utilization)
        where = f"{_gib(free)} free on {loaded.device} x gpu_memory_utilization {tuning.gpu_memory_utilization}"
    else:
        budget = available_ram_bytes()
        where = "available RAM"
    num_tokens = kv_cache_blocks(loaded, tuning) * tuning.kv_block_size
    kv_bytes = num_tokens * per_token
    source = ("max_total_tokens" if tuning.max_total_tokens is not None
              else "kv_cache_bytes" if tuning.kv_cache_bytes is not None else "derived")
    detail = (f"{num_tokens} tokens ({source}) x {per_token} B/token = {_gib(kv_bytes)} "
              f"{'<=' if kv_bytes <= budget else '>'} {_gib(budget)} ({where}, after loading the model)")
    if num_tokens == 0 or kv_bytes > budget:
        fit = budget // per_token // tuning.kv_block_size * tuning.kv_block_size
        return Check("kv cache", "fail", "serving_tuning.max_total_tokens", f"{detail}; at most {fit} tokens fit")
    try:  # the longest request the limits allow (a limit above the context: the limits check fails)
        limits = tuning.for_model(loaded.max_model_len)
        longest = min(limits.max_input_tokens + limits.max_output_tokens, loaded.max_model_len)
    except ValueError:
        longest = 0
    if num_tokens < longest:
        detail += (f"; note: a request of max_input_tokens + max_output_tokens ({longest}) exceeds it and would be "
                   "rejected")
    if tuning.host_kv_bytes is not None:
        return host_tier_check(tuning, loaded, detail, kv_bytes if loaded.device.type == "cpu" else 0)
    return Check("kv cache", "pass", "serving_tuning.max_total_tokens", detail)


def host_tier_check(tuning, loaded, detail: str, ram_taken: int) -> Check:
    """The host-memory KV tier (`serving_tuning.host_kv_bytes`) added to the KV check: its
    blocks and tokens, and that its bytes fit the available RAM beside `ram_taken` (the
    device cache itself, on the CPU)."""
    from worker.config import ConfigError
    from worker.engine.engine import host_kv_slots, kv_bytes_per_token

    try:
        slots = host_kv_slots(loaded, tuning)
    except ConfigError as e:
        return Check("kv cache", "fail", "serving_tuning.host_kv_bytes", f"{detail}; {e}")
    host_bytes = slots * tuning.kv_block_size * kv_bytes_per_token(loaded, tuning)
    budget = available_ram_bytes() - ram_taken
    detail += (f"; host tier {slots} blocks ({slots * tuning.kv_block_size} tokens) = {_gib(host_bytes)} "
               f"{'<=' if host_bytes <= budget else '>'} {_gib(max(0, budget))} of available RAM")
    if host_bytes > budget:
        return Check("kv cache", "fail", "serving_tuning.host_kv_bytes", detail)
    return Check("kv cache", "pass", "serving_tuning.host_kv_bytes", detail)


def available_ram_bytes() -> int:
    """Memory this process can still get, in bytes: the OS's available memory (psutil),
    capped by a cgroup v2 limit (a container's `memory.max - memory.current`) if any."""
    import psutil

    avail = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
    except (OSError, ValueError):
        return avail
    return avail if limit == "max" else min(avail, max(0, int(limit) - current))


# ---- metrics port -------------------------------------------------------------------------
