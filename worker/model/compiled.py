"""The model's forward compiled, with paged attention as one opaque custom op.

transformers' modules (embeddings, norms, projections, RoPE, MLP, the LM head) are traced
and compiled by Inductor; each attention call is `torch.ops.inflight.attention`
(`worker.model.attention.attention_op`, declared with `torch.library.Library`), which a trace keeps
as a single node without tracing into it, so the graph has no break at attention and the
op runs the same back end (`worker.model.kernels`) as the eager forward: the split vLLM
makes for its piecewise graphs (its `unified_attention` op), here one graph around
opaque ops.

Two ways to build it, the same graph either way:

- `PrecompiledForward` (the default where `torch.compiler.precompile` exists, torch >=
  2.15, on the CPU): the first forward is captured ahead of time (one `make_fx` trace,
  Inductor's kernels) into an artifact on disk, keyed by the model's structure and the
  code that traces it (`artifact_key`); the next start with the same key loads it and
  runs without tracing anything (Dynamo's trace of transformers' Python was most of a
  warm restart). A capture the API refuses falls back to `CompiledForward`.
- `CompiledForward`: `torch.compile` (Dynamo) at every start; Inductor's kernels come
  from its cache.

The op's inputs are only tensors and constants: what varies per step (block tables,
slots, the decode groups, the KV cache tensors, the attention modules) is the step's
`AttentionMetadata`, which the op reads from `worker.model.attention.current_metadata()`
when it runs, so nothing that changes between steps is a graph input; the op names its
module by `layer_idx`, a constant that is the same in every process.

The token dimension (and the number of logit rows kept) is dynamic and unbacked
(`mark_unbacked` on every call the forwards trace or guard, `mark_token_dims`): the
trace may not specialize on its value, not even on 0 or 1 as it does for plain dynamic
sizes, so one graph serves every step, a decode of one request as well as a 2048-token
prefill, and a warmed-up model never compiles again while it serves (the equivalence
tests check it).

LoRA adapters' deltas are opaque ops too (`torch.ops.inflight.lora_delta`,
`worker.model.lora`). Not compiled (the eager forward is used, with one log line naming
the reason): any model whose compiled forward fails its warm-up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import NamedTuple

import torch

import worker.model.attention  # noqa: F401  (registers torch.ops.inflight.attention)
from worker.model.attention import native_in_graph

log = logging.getLogger(__name__)

PRECOMPILE_DEVICES = frozenset({"cpu"})  # where captures are used: measured there (docs/benchmarks.md)
ARTIFACT, CACHE = "forward.py", "forward.cache"  # what a capture writes (its code, its kernels)


class Logits(NamedTuple):
    """A compiled forward's result, read as transformers' output is: `logits` `[1, rows, vocab]`."""

    logits: torch.Tensor


class CompiledForward:
    """`model`'s forward compiled by Inductor (dynamic, unbacked token sizes; no CUDA
    graphs yet): call it as the module. Compilation happens at the first call (the
    warm-up, `worker.engine.compile`).

    Once `warm` is set (after a warm-up that built the one graph) the calls skip Dynamo's
    guard checks (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`): they cost
    about 0.6 ms a step on the CPU benchmark model, a check that every parameter is still
    the one traced, which nothing changes while the engine serves (LoRA adapters fill
    buffers that are no graph input). A call that would need another graph raises
    instead of compiling it; the runner then goes back to the eager forward
    (`ModelRunner._execute`). vLLM skips the guards the same way, by calling its
    compiled code directly.

    Inductor's freezing (weights as graph constants, pre-packed for oneDNN) was measured
    no faster with unbacked sizes on the CPU benchmark model and takes longer to compile:
    not used."""

    def __init__(self, model: torch.nn.Module) -> None:
        def forward(**kwargs):
            return model(**kwargs)

        self._fn = torch.compile(_code_of(forward, artifact_key(model)), dynamic=True, fullgraph=False)
        self.warm = False

    def __call__(self, **kwargs):
        # sizes without a value Dynamo may specialize on (0 and 1 would be): one graph for all
        mark_token_dims(kwargs["input_ids"], kwargs["position_ids"], kwargs["logits_to_keep"])
        if not self.warm:  # compiling: floats (eps, scales) as constants, no restart to tensorify them;
            # past Dynamo's recompile limit an error rather than a silently eager forward
            with torch._dynamo.config.patch(specialize_float=True, fail_on_recompile_limit_hit=True):
                return self._fn(**kwargs)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._fn(**kwargs)


_codes: dict[str, types.CodeType] = {}


def _code_of(fn: types.FunctionType, key: str) -> types.FunctionType:
    """`fn` with the code object of the models whose `artifact_key` is `key`. Dynamo keeps
    compiled graphs per code object, and a warm `CompiledForward` skips their guards: it
    runs the first graph whose distinguishing guards pass. Engines of one model in one
    process share a code object, so the second serves the first's graph without compiling;
    two models of one class that differ where no guard looks (a plain model and the same
    one with LoRA hooks, which add ops) get their own, so neither can run the other's
    graph (`tests/engine/test_lora.py` builds the plain model's graph first)."""
    code = _codes.get(key)
    if code is None:
        code = _codes[key] = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{key[:16]}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def mark_token_dims(input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> None:
    """Make a step's sizes unbacked for Dynamo and for a capture's trace (module
    docstring): the token dimension of `input_ids` and `position_ids` `[1, num_tokens]`
    and the rows kept, `keep` `[rows]`. The forwards mark their own calls (a loaded
    capture needs no marks: 6 us a call saved)."""
    from torch._dynamo.decorators import mark_unbacked

    mark_unbacked(input_ids, 1)
    mark_unbacked(position_ids, 1)
    mark_unbacked(keep, 0)


def precompile_available(device_type: str) -> bool:
    """Whether forwards on `device_type` are captured ahead of time (`PrecompiledForward`)."""
    return device_type in PRECOMPILE_DEVICES and hasattr(torch.compiler, "precompile")


def artifact_key(model: torch.nn.Module) -> str:
    """What a captured forward depends on, hashed (hex): the model's class and config, the
    name, shape, dtype, stride and device type of every parameter and buffer, the class of
    every module (`worker.model.small_batch` changes some), the forward hooks on its
    modules and the operator each adds to the graph where it says (its `graph_key`: LoRA's,
    `worker.model.lora`, add the C++ operator or the Python one), which attention operator
    the trace calls (`worker.model.attention.native_in_graph`), the source of its
    modeling module and of this package's modules (what the trace runs through), and the
    versions of Python, torch and transformers. Weights' values are inputs of the
    artifact, not part of it: a checkpoint with other weights of the same shapes shares it."""
    import inspect

    import transformers

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    for part in (sys.version, torch.__version__, transformers.__version__, type(model).__qualname__,
                 config.to_json_string(use_diff=False) if config is not None else ""):
        h.update(part.encode() + b"\0")
    device_types = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}:{t.device.type}\0".encode())
        device_types.add(t.device.type)
    for device_type in sorted(device_types):  # which attention operator the trace puts in the graph
        h.update(f"attention:{device_type}:{native_in_graph(device_type)}\0".encode())
    for name, m in model.named_modules():
        h.update(f"module:{name}:{type(m).__qualname__}\0".encode())  # e.g. `small_batch.SmallBatchLinear`
        for hook in m._forward_hooks.values():
            qualname = getattr(hook, "__qualname__", type(hook).__qualname__)
            h.update(f"hook:{name}:{qualname}:{getattr(hook, 'graph_key', '')}\0".encode())
    sources = [inspect.getsourcefile(type(model)), *sorted(str(p) for p in Path(__file__).parent.glob("*.py"))]
    for src in sources:
        if src:
            h.update(Path(src).read_bytes())
    return h.hexdigest()[:32]


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
            keep: torch.Tensor) -> torch.Tensor:
    """The computation a capture records: `[1, len(keep), vocab]` logits."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep).logits


def _load(path: Path):
    """The runnable captured under `path`. torch warns at every load that the artifact is
    code it will execute; these are ours, under the worker's own cache directory, as
    Inductor's compiled kernels beside them are: the warning is kept out of the log."""
    quiet = logging.getLogger("torch._precompile")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return torch.compiler.precompile.load(path / ARTIFACT, path / CACHE)
    finally:
        quiet.setLevel(level)


class PrecompiledForward:
    """`model`'s forward captured ahead of time (`torch.compiler.precompile`) into
    `directory / artifact_key(model)`, or loaded from there: call it as the module.

    A capture is one `make_fx` trace of the first call (the warm-up's, with unbacked token
    sizes) compiled by Inductor, written to a temporary directory and renamed into place
    (two workers starting on one machine keep whichever came first). Later starts load it
    (`loaded`), skipping the trace. There are no guards to check: the artifact is
    specialized to everything but the token sizes, which is why the key covers what it
    depends on; a call it cannot serve raises (the runner then goes eager,
    `ModelRunner._forward`).

    A capture that fails (the API refuses something the model does) runs `CompiledForward`
    from then on (`fallback`, `fallback_reason`); an artifact that does not load is
    captured again.

    Attributes:
        artifact: `loaded`, `captured`, or "" (not yet, or fallen back).
        seconds: time spent loading or capturing, seconds.
    """

    def __init__(self, model: torch.nn.Module, directory: Path) -> None:
        self.model = model
        self.path = Path(directory) / artifact_key(model)
        self.artifact = ""
        self.seconds = 0.0
        self.fallback: CompiledForward | None = None
        self.fallback_reason = ""
        self._run = None
        if (self.path / ARTIFACT).exists():
            t0 = time.perf_counter()
            try:
                self._run = self._bind(_load(self.path))
            except Exception as e:  # written by another version, truncated: capture again
                log.warning("a captured forward did not load (%s: %s); capturing it again", type(e).__name__,
                            str(e).splitlines()[0][:200] if str(e) else "")
                shutil.rmtree(self.path, ignore_errors=True)
            else:
                self.artifact, self.seconds = "loaded", time.perf_counter() - t0

    @property
    def warm(self) -> bool:
        return self.fallback.warm if self.fallback is not None else self._run is not None

    @warm.setter
    def warm(self, value: bool) -> None:
        if self.fallback is not None:
            self.fallback.warm = value

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool,
                 logits_to_keep: torch.Tensor):
        if self.fallback is not None:
            return self.fallback(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache,
                                 logits_to_keep=logits_to_keep)
        if self._run is None:  # the capture's token sizes unbacked; the loaded graph reads any
            mark_token_dims(input_ids, position_ids, logits_to_keep)
            return self._capture(input_ids, position_ids, logits_to_keep)
        return Logits(self._run(input_ids, position_ids, logits_to_keep))

    def _bind(self, runnable):
        """`runnable` (a loaded artifact) bound to this model: a function of the step's
        `(input_ids, position_ids, keep)`.

        The artifact's public entry point lists the model's parameters and buffers and
        checks each one's name, shape, dtype and device at every call: 0.16 ms a step for
        the 41 tensors of the CPU benchmark model, about 1 ms for a 32-layer model's 290,
        for a structure that never changes while the engine serves. So the check runs
        once, here, and the steps call the artifact's compiled graph with the list made
        then. Where the artifact's code does not have those parts (another torch), the
        entry point is used as it is."""
        code = getattr(getattr(runnable, "_loaded_forward", None), "__globals__", None) or {}
        graph, extract, check = (code.get(n) for n in ("call", "_extract_param_buffers", "_check_structure"))
        if not (callable(graph) and callable(extract) and callable(check)):
            model = self.model
            return lambda ids, pos, keep: runnable(model, ids, pos, keep)
        weights, names = extract([self.model])
        check(weights, names)  # raises PrecompileError when the model is not the one captured
        return lambda ids, pos, keep: graph([*weights, ids, pos, keep])[0]

    def _capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> Logits:
        t0 = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".capture-", dir=self.path.parent))
        try:
            with torch.compiler.precompile.capture(_logits, artifact_path=tmp / ARTIFACT,
                                                   cache_path=tmp / CACHE) as cap:
                out = cap(self.model, input_ids, position_ids, keep)
            self._run = self._bind(_load(tmp))
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self.fallback_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.warning("the forward could not be captured ahead of time (%s); torch.compile builds it at every "
                        "start", self.fallback_reason)
            self.fallback = CompiledForward(self.model)
            return self.fallback(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=keep)
        try:
            os.replace(tmp, self.path)
        except OSError:  # another process put its capture there first: the same key, the same forward
            shutil.rmtree(tmp, ignore_errors=True)
        self.artifact, self.seconds = "captured", time.perf_counter() - t0
        return Logits(out)
