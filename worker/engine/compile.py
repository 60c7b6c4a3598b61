"""Compiling an engine's forward at start-up (`model.compile`), with its warm-up and its
fallback to eager.

`compile_engine` decides from the setting and the model (`auto` = on where measured
faster: the CPU; off on CUDA until a GPU measures it), then
builds the graph by running warm-up requests through the engine itself: steps of
several tokens keeping several logit rows, of several tokens keeping one, and of one
token (the sizes are unbacked, `worker.model.compiled`, so one graph serves them all).
The same requests run eagerly first; compiled greedy ids that differ from eager ones, or
a compiled forward that raises (Dynamo's recompile limit included: it raises rather than
run eagerly unseen), put the engine back on the eager forward with one log line saying
why. Inductor's cache lives in `$XDG_CACHE_HOME/inflight/inductor` (default
`~/.cache/inflight/inductor`) unless `TORCHINDUCTOR_CACHE_DIR` is set, so a restart on
the same machine (or an image that carries the directory) reuses the compiled kernels;
a forward captured ahead of time lives in `precompiled_dir()` and is loaded whole.

On CUDA the same start-up captures the decode graphs (`model.cuda_graphs`,
`worker.model.graphs`) after compiling, checked the same way: the warm-up requests
(and a batch that shrinks through several graph sizes, `GRAPH_CHECK`) run again on the
graphs and must give the eager greedy ids; a capture that raises or ids that differ drop
the graphs with one log line saying why.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import msgspec

from schemas.params import SamplingParams
from worker.engine.outputs import CompletionOutput

if TYPE_CHECKING:
    from worker.model.runner import ModelRunner

Generate = Callable[[list[list[int]], SamplingParams], list[CompletionOutput]]  # Engine.generate

log = logging.getLogger(__name__)

AUTO_DEVICES = frozenset({"cpu"})  # where `auto` compiles: measured faster there (ModelConfig.compile)
# where decode graphs are captured, and how they replay (worker.model.graphs); tests add
# {"cpu": "emulated"} to run the whole path here
GRAPH_REPLAY = {"cuda": "cuda"}
# warm-up prompts: 2 requests (a step of 8 tokens keeping 2 rows), then their decodes (2
# tokens, 2 rows); 1 request (3 tokens, 1 row), then its decodes (1 token, 1 row)
WARM_UP = ([[1, 2, 3, 4, 5], [1, 2, 3]], [[1, 2, 3]])
WARM_UP_TOKENS = 3
RECOMPILE_ALLOWANCE = 8  # Dynamo's default per-code limit, per compiled engine
# the graphs' check beside the warm-up: up to 9 requests (no more than run at once) of
# 2, 3, ... new tokens, so the decode batch shrinks through the graph sizes 16 (when
# captured), 8, 4, 2 and 1
GRAPH_CHECK = 9


class CompileReport(msgspec.Struct, frozen=True):
    """How the engine's forward runs.

    Attributes:
        compiled: whether the forward is compiled.
        reason: why (the setting; or why it fell back to eager).
        seconds: the warm-up's wall time (compilation included); 0 when not compiled.
        graphs: graphs built during the warm-up: Dynamo's (0 when the graph of an
            engine of the same model, built earlier in this process, served), or 1 for a
            captured or loaded forward.
        artifact: `loaded` (a forward captured by an earlier start), `captured` (this
            start captured it for the next), or "" (`torch.compile`).
        capture_fallback: why the forward could not be captured ahead of time (then
            `torch.compile` built it); "" otherwise.
        cuda_graph_sizes: the decode batch sizes captured as CUDA graphs (none: not captured).
        cuda_graph_reason: why they were or were not captured ("" where not considered:
            not a CUDA device).
        cuda_graph_seconds: the capture's wall time; cuda_graph_bytes: the device memory
            the graphs hold.
        cuda_graph_replay: how they replay (`worker.model.graphs.REPLAYS`; `emulated`:
            tests and tools on the CPU).
        draft: how the draft model's forward runs (`speculative.method: draft`:
            `compiled` or `eager (why)`, and its decode graphs where the model has
            them); "" without one, or with a model neither compiled nor captured.
    """

    compiled: bool
    reason: str
    seconds: float = 0.0
    graphs: int = 0
    artifact: str = ""
    capture_fallback: str = ""
    cuda_graph_sizes: tuple[int, ...] = ()
    cuda_graph_reason: str = ""
    cuda_graph_seconds: float = 0.0
    cuda_graph_bytes: int = 0
    cuda_graph_replay: str = ""
    draft: str = ""

    def describe(self) -> str:
        if not self.compiled:
            text = f"eager ({self.reason})"
        elif self.artifact == "loaded":
            text = f"compiled (captured forward loaded; warm-up {self.seconds:.1f} s)"
        elif self.artifact:
            text = f"compiled (forward captured for the next start; warm-up {self.seconds:.1f} s)"
        elif self.graphs:
            text = f"compiled ({self.graphs} graphs in {self.seconds:.1f} s)"
        else:
            text = f"compiled (the graph of an earlier engine in this process; warm-up {self.seconds:.1f} s)"
        if self.cuda_graph_sizes and self.cuda_graph_replay == "emulated":
            text += (f"; decode graphs emulated for batches of 1-{self.cuda_graph_sizes[-1]} "
                     f"({len(self.cuda_graph_sizes)} sizes)")
        elif self.cuda_graph_sizes:
            text += (f"; CUDA graphs for decode batches of 1-{self.cuda_graph_sizes[-1]} "
                     f"({len(self.cuda_graph_sizes)} sizes in {self.cuda_graph_seconds:.1f} s, "
                     f"{self.cuda_graph_bytes / 2**20:.0f} MiB)")
        elif self.cuda_graph_reason:
            text += f"; no CUDA graphs ({self.cuda_graph_reason})"
        if self.draft:
            text += f"; draft model {self.draft}"
        return text


def wanted(setting: str, device_type: str) -> tuple[bool, str]:
    """Whether to compile, and why: `setting` is `ModelConfig.compile`. LoRA adapters
    compile too: their delta is an opaque op of the graph (`worker.model.lora`)."""
    if setting == "off":
        return False, "model.compile is off"
    if setting == "on":
        return True, "model.compile is on"
    if device_type in AUTO_DEVICES:
        return True, f"model.compile auto: on for {device_type}"
    return False, f"model.compile auto: off for {device_type} (not measured there yet)"


def precompiled_dir() -> Path:
    """Where captured forwards live (`worker.model.compiled.PrecompiledForward`):
    `$XDG_CACHE_HOME/inflight/precompiled` (default `~/.cache/inflight/precompiled`)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inflight" / "precompiled"


def inductor_cache_dir() -> Path:
    """Where Inductor keeps compiled kernels (set for this process unless already set)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inflight" / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def warm_up(generate: Generate) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=WARM_UP_TOKENS, ignore_eos=True)
    ids = []
    for prompts in WARM_UP:
        for out in generate(prompts, params):
            if out.finish_reason != "length":
                raise RuntimeError(f"a warm-up request ended with {out.finish_reason!r}")
            ids.append(out.token_ids)
    return ids


def graphs_wanted(setting: str, device_type: str, has_lora: bool, backend: ModuleType) -> tuple[str | None, str]:
    """How to replay decode graphs (`worker.model.graphs.REPLAYS`; None: no graphs), and
    why: `setting` is `ModelConfig.cuda_graphs`, `backend` the attention back end. The
    reason is "" where graphs are not considered (not a CUDA device)."""
    replay = GRAPH_REPLAY.get(device_type)
    if replay is None:
        return None, ""
    if setting == "off":
        return None, "model.cuda_graphs is off"
    if has_lora:
        return None, "LoRA adapters (a step's grouping of tokens by adapter is built on the host)"
    if replay == "cuda" and not getattr(backend, "GRAPH_SAFE", False):
        return None, f"the attention back end {backend.__name__.rsplit('.', 1)[-1]} is not graph-safe"
    return replay, "model.cuda_graphs is auto"


def emulate_graphs_on_cpu() -> None:
    """Replay decode graphs emulated on the CPU from now on, in this process (tools' CPU
    runs of the graph path: `tools.gpu_check --smoke`, `tools.tiny_archs --graphs`)."""
    global GRAPH_REPLAY
    GRAPH_REPLAY = {**GRAPH_REPLAY, "cpu": "emulated"}


def compile_engine(runner: ModelRunner, setting: str, generate: Generate, graphs_setting: str = "off",
                   max_batch: int = 1, max_model_len: int = 0, precompile: bool = True) -> CompileReport:
    """Compile an engine's forward (its `runner`'s) if `setting` (`ModelConfig.compile`)
    asks for it, captured ahead of time or loaded (`precompile`, `ModelConfig.precompile`;
    `precompiled_dir`) where torch offers it, and warm it up through `generate` (the
    engine's `Engine.generate`); then
    capture its decode graphs if `graphs_setting` (`ModelConfig.cuda_graphs`) asks for
    them on this device, for batches up to `max_batch` and contexts up to
    `max_model_len` (module docstring). Never raises for a model that does not compile
    or capture: the engine stays eager (or without graphs) and the report says why."""
    if getattr(runner, "state_pool", None) is not None:  # compiled recurrent mixers: not built yet
        why = "recurrent-state layers run eager (worker/model/recurrent.py: per-request state, not traced yet)"
        return CompileReport(False, why, cuda_graph_reason="recurrent-state layers")
    on, reason = wanted(setting, runner.device.type)
    replay, graphs_why = graphs_wanted(graphs_setting, runner.device.type, runner.lora is not None, runner.backend)
    if not on and replay is None:
        return CompileReport(False, reason, cuda_graph_reason=graphs_why)
    expected = warm_up(generate)  # eager: the reference ids
    report = _compile(runner, reason, generate, expected, precompile) if on else CompileReport(False, reason)
    if replay is None:
        return msgspec.structs.replace(report, cuda_graph_reason=graphs_why)
    return _capture(runner, report, generate, expected, replay, max_batch, max_model_len, graphs_why)


def _compile(runner: ModelRunner, reason: str, generate: Generate, expected: list[list[int]],
             precompile: bool) -> CompileReport:
    import torch._dynamo

    from worker.model.compiled import PrecompiledForward

    # Several compiled engines of different models in one process (tests, tools) add
    # entries to the cache of the same code (transformers' shared forward wrappers): each
    # brings its own allowance of Dynamo's per-code recompile limit, past which the warm-up
    # fails (`CompiledForward`).
    torch._dynamo.config.recompile_limit += RECOMPILE_ALLOWANCE
    inductor_cache_dir()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    error: Exception | None = None
    got = None
    try:
        runner.compile(precompiled_dir() if precompile else None)
        got = warm_up(generate)
    except Exception as e:
        error = e
    # a compiled step that raised: the runner went eager, ran the step again and kept the error
    error = runner.compile_error or error
    seconds = time.perf_counter() - t0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    fwd = runner.forward_fn
    artifact = fwd.artifact if isinstance(fwd, PrecompiledForward) else ""
    graphs += bool(artifact)  # a captured or loaded forward is one graph Dynamo never saw
    if error is not None or got != expected:
        runner.uncompile()
        why = f"compiling failed: {one_line(error)}" if error is not None else \
            "compiled greedy ids differ from eager ones"
        log.warning("model.compile: the forward stays eager: %s", why)
        return CompileReport(False, why)
    runner.forward_fn.warm = True  # the graph is built: no more guard checks (worker.model.compiled)
    report = CompileReport(True, reason, seconds, graphs, artifact=artifact,
                           capture_fallback=fwd.fallback_reason if isinstance(fwd, PrecompiledForward) else "")
    log.info("model.compile: %s", report.describe())
    return report


def _graph_check(generate: Generate, max_batch: int) -> list[list[int]]:
    """Greedy ids of `GRAPH_CHECK` requests (at most `max_batch`, the most that run at
    once: more would only queue) ending one step apart: the decode batch shrinks by one a
    step, through every graph size up to the batch."""
    n = max(1, min(GRAPH_CHECK, max_batch))
    prompts = [[1 + i % 5, 2, 3] for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(n)]
    return [out.token_ids for out in generate(prompts, params)]


def _capture(runner: ModelRunner, report: CompileReport, generate: Generate, expected: list[list[int]],
             replay: str, max_batch: int, max_model_len: int, reason: str) -> CompileReport:
    reference = _graph_check(generate, max_batch)  # without graphs (the forward as compiled or not)
    error: Exception | None = None
    got = checked = None
    try:
        graphs = runner.capture_graphs(max_batch, max_model_len, replay)
        got, checked = warm_up(generate), _graph_check(generate, max_batch)
    except Exception as e:
        error = e
    if error is not None or got != expected or checked != reference:
        runner.drop_graphs()
        why = (f"capturing failed: {one_line(error)}" if error is not None
               else "greedy ids on the graphs differ from the forward's without them")
        log.warning("model.cuda_graphs: decode steps run without graphs: %s", why)
        return msgspec.structs.replace(report, cuda_graph_reason=why)
    report = msgspec.structs.replace(report, cuda_graph_sizes=tuple(graphs.sizes), cuda_graph_reason=reason,
                                     cuda_graph_seconds=graphs.capture_seconds, cuda_graph_bytes=graphs.memory_bytes,
                                     cuda_graph_replay=replay)
    log.info("model.cuda_graphs: %s", report.describe())
    return report


def one_line(error: BaseException) -> str:
    """`Type: the message's first line` (300 characters at most), for a log line or a report."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
