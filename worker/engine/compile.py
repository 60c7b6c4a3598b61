"""Compiling an engine's forward at start-up (`model.compile`), with its warm-up and its
fallback to eager.

`compile_engine` decides from the setting and the model (`auto` = on where measured
faster: the CPU; off on CUDA until a GPU measures it; LoRA keeps a model eager), then
builds the graph by running warm-up requests through the engine itself: steps of
several tokens keeping several logit rows, of several tokens keeping one, and of one
token (the sizes are unbacked, `worker.model.compiled`, so one graph serves them all).
The same requests run eagerly first; compiled greedy ids that differ from eager ones, a
compiled forward that raises, or no graph built put the engine back on the eager
forward with one log line saying why. Inductor's cache lives in
`$XDG_CACHE_HOME/inflight/inductor` (default `~/.cache/inflight/inductor`) unless
`TORCHINDUCTOR_CACHE_DIR` is set, so a restart on the same machine (or an image that
carries the directory) reuses the compiled kernels.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from schemas.params import SamplingParams
from worker.engine.outputs import CompletionOutput

if TYPE_CHECKING:
    from worker.model.runner import ModelRunner

Generate = Callable[[list[list[int]], SamplingParams], list[CompletionOutput]]  # Engine.generate

log = logging.getLogger(__name__)

AUTO_DEVICES = frozenset({"cpu"})  # where `auto` compiles: measured faster there (ModelConfig.compile)
# warm-up prompts: 2 requests (a step of 8 tokens keeping 2 rows), then their decodes (2
# tokens, 2 rows); 1 request (3 tokens, 1 row), then its decodes (1 token, 1 row)
WARM_UP = ([[1, 2, 3, 4, 5], [1, 2, 3]], [[1, 2, 3]])
WARM_UP_TOKENS = 3
RECOMPILE_ALLOWANCE = 8  # Dynamo's default per-code limit, per compiled engine


class CompileReport(msgspec.Struct, frozen=True):
    """How the engine's forward runs.

    Attributes:
        compiled: whether the forward is compiled.
        reason: why (the setting; or why it fell back to eager).
        seconds: the warm-up's wall time (compilation included); 0 when not compiled.
        graphs: graphs Dynamo built during the warm-up.
    """

    compiled: bool
    reason: str
    seconds: float = 0.0
    graphs: int = 0

    def describe(self) -> str:
        if self.compiled:
            return f"compiled ({self.graphs} graphs in {self.seconds:.1f} s)"
        return f"eager ({self.reason})"


def wanted(setting: str, device_type: str, has_lora: bool) -> tuple[bool, str]:
    """Whether to compile, and why: `setting` is `ModelConfig.compile`."""
    if setting == "off":
        return False, "model.compile is off"
    if has_lora:
        return False, "LoRA adapters (their forward hooks change between steps)"
    if setting == "on":
        return True, "model.compile is on"
    if device_type in AUTO_DEVICES:
        return True, f"model.compile auto: on for {device_type}"
    return False, f"model.compile auto: off for {device_type} (not measured there yet)"


def inductor_cache_dir() -> Path:
    """Where Inductor keeps compiled kernels (set for this process unless already set)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inflight" / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _warm_up(generate: Generate) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=WARM_UP_TOKENS, ignore_eos=True)
    ids = []
    for prompts in WARM_UP:
        for out in generate(prompts, params):
            if out.finish_reason != "length":
                raise RuntimeError(f"a warm-up request ended with {out.finish_reason!r}")
            ids.append(out.token_ids)
    return ids


def compile_engine(runner: ModelRunner, setting: str, generate: Generate) -> CompileReport:
    """Compile an engine's forward (its `runner`'s) if `setting` (`ModelConfig.compile`)
    asks for it, and warm it up through `generate` (the engine's `Engine.generate`; module
    docstring). Never raises for a model that does not compile: the engine stays eager
    and the report says why."""
    on, reason = wanted(setting, runner.device.type, runner.lora is not None)
    if not on:
        return CompileReport(False, reason)
    import torch._dynamo

    # Several compiled engines in one process (tests, tools) add entries to the cache of
    # the same code (transformers' shared forward wrappers): each brings its own allowance
    # of Dynamo's per-code recompile limit, past which Dynamo would run them eagerly.
    torch._dynamo.config.recompile_limit += RECOMPILE_ALLOWANCE
    inductor_cache_dir()
    expected = _warm_up(generate)  # eager: the reference ids
    runner.compile()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    error: Exception | None = None
    try:
        got = _warm_up(generate)
    except Exception as e:
        error, got = e, None
    # a compiled step that raised: the runner went eager, ran the step again and kept the error
    error = runner.compile_error or error
    seconds = time.perf_counter() - t0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    if error is not None or got != expected or not graphs:
        runner.uncompile()
        if error is not None:
            why = f"compiling failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        elif got != expected:
            why = "compiled greedy ids differ from eager ones"
        else:
            why = "Dynamo built no graph (its recompile limit reached in this process?)"
        log.warning("model.compile: the forward stays eager: %s", why)
        return CompileReport(False, why)
    runner.forward_fn.warm = True  # the graph is built: no more guard checks (worker.model.compiled)
    report = CompileReport(True, reason, seconds, graphs)
    log.info("model.compile: %s", report.describe())
    return report
