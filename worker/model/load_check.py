"""The load check: run the model once through the paged runner and once through
transformers' own eager attention, and refuse it unless they agree (rule 4 of
`worker.model.capability`).

Two passes over a few random token ids, before the KV cache is sized:

  1. shape pass: one forward whose attention records, per layer, what it was asked
     (`LayerCall`: KV shape, window, cap, sinks, latent, causality, unknown arguments) and
     returns zeros. Every layer must have called our attention (a module that computes
     attention itself would bypass the paged cache), causally, with no argument we would
     ignore, with the window its config gives. The KV layout the engine allocates is
     this measurement, not a guess from config fields.
  2. packed pass, over a small paged cache of 4-token blocks in shuffled order: two
     sequences packed into one step (one prefilled in two chunks, the other finished by a
     decode), so any state that leaks across the packed batch, any chunk that loses its
     cached context and any decode that reads the wrong blocks shows up. Every logit row
     must equal transformers' eager forward of each sequence alone, within the dtype's
     tolerance.

What the check cannot see in a few tokens (a sliding window of thousands of tokens) is
covered by rule 1's window-per-layer comparison and by the architecture tests.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from types import ModuleType

import torch

from schemas.params import SamplingParams
from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.model import recurrent
from worker.model.attention import AttentionMetadata, LayerCall, step_metadata
from worker.model.capability import FEED_FORWARD_KINDS, KVLayout, UnsupportedModel, layer_kind, layer_windows
from worker.model.recurrent import RecurrentStep, StateLayout

PROBE_BLOCK_SIZE = 4
PROBE_LENS = (11, 7)  # A: chunks [0, 6) + [6, 10) + decode 10; B: [0, 6) + decode 6
# max |logit difference| / std of the reference logits
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.25


def tolerance(model: torch.nn.Module, dtype: torch.dtype) -> float:
    """The largest logit difference (x the reference's std) the check accepts: tight for
    fp32 and fp64; the half-precision bound for half dtypes and for models whose
    activations are rounded to int8 or FP8 at each layer (W8A8, `worker.model.quant_linear`): there
    the paged and the eager attention's last-bit differences flip some roundings, each
    worth a whole quantization step (measured 0.06 x std on a 12-layer model), while a
    wrong block or a leak across the packed batch still shows as differences of order 1."""
    from worker.model.quant_linear import Fp8Linear, QuantLinear

    if any((isinstance(m, QuantLinear) and m.scheme.act_int8) or (isinstance(m, Fp8Linear) and m.act != "none")
           for m in model.modules()):
        return HALF_TOLERANCE
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


@contextlib.contextmanager
def reference_attention(model: torch.nn.Module, implementation: str = "eager") -> Iterator[None]:
    """Run `model` with transformers' own attention inside the block: every config the
    model's modules read (`_attn_implementation`) is switched, and restored after."""
    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules())]
               if c is not None and hasattr(c, "_attn_implementation")}
    for c in list(configs.values()):
        for sub in (getattr(c, "sub_configs", None) or {}):
            sc = getattr(c, sub, None)
            if sc is not None and hasattr(sc, "_attn_implementation"):
                configs[id(sc)] = sc
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = implementation
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


def _sched(step: int, parts: list[tuple[str, list[int], int, list[int]]]) -> SchedulerOutput:
    """parts: (id, all tokens so far, start, block table); decodes (one token, start > 0) first.
    Each request's recurrent-state slot is its letter's place in the alphabet (a: 0)."""
    reqs = [ScheduledRequest(rid, toks[start:], start, table, True, SamplingParams(), toks,
                             state_slot=ord(rid[0]) - ord("a"))
            for rid, toks, start, table in parts]
    nd = sum(1 for r in reqs if r.num_tokens == 1 and r.start_pos > 0)
    return SchedulerOutput(step=step, scheduled=reqs, num_scheduled_tokens=sum(r.num_tokens for r in reqs),
                           num_decodes=nd)


def _forward(model: torch.nn.Module, input_ids: list[int], positions: list[int], md: AttentionMetadata) -> torch.Tensor:
    dev = next(model.parameters()).device
    with step_metadata(md):
        out = model(input_ids=torch.tensor([input_ids], device=dev),
                    position_ids=torch.tensor([positions], device=dev), use_cache=False, logits_to_keep=0,
                    inflight_metadata=md)
    return out.logits[0].float()


def measure_layers(model: torch.nn.Module, text_cfg, model_type: str,
                   backend: ModuleType) -> tuple[dict[int, LayerCall], StateLayout]:
    """Pass 1. Returns layer_idx -> LayerCall, and the per-request states of the
    recurrent mixers (`worker.model.recurrent.install`ed; their layers call no attention).

    Raises:
        UnsupportedModel: a layer bypasses our attention, is not causal, passes an
            argument we would ignore, or asks for a window its config does not give.
    """
    from worker.model.runner import ModelRunner

    device = next(model.parameters()).device
    runner = ModelRunner(model, num_blocks=1, block_size=PROBE_BLOCK_SIZE, kv_layout=KVLayout(()),
                         device=device, dtype=torch.float32, backend=backend)
    ids, pos, md, _, _ = runner.build_metadata(_sched(0, [("shape", [1, 2, 3], 0, [0])]))
    md.kv_caches = None
    md.trace = {}
    mixer_layers = {m.layer_idx for m in recurrent.installed(model)}
    if mixer_layers:
        md.recurrent = RecurrentStep(None, 0, torch.zeros(0, dtype=torch.long, device=device), [(0, 3, 0, True)])
    try:
        with torch.inference_mode(), step_metadata(md):
            model(input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0), use_cache=False, logits_to_keep=1,
                  inflight_metadata=md)
    except Exception as e:  # a forward the paged runner cannot make is a refusal at load, not a crash later
        raise UnsupportedModel(model_type, "a forward the paged runner cannot run", f"{type(model).__name__}",
                               f"{type(e).__name__}: {str(e)[:300]}") from e
    trace = md.trace
    states = StateLayout(tuple(md.recurrent.measured[k] for k in sorted(md.recurrent.measured))
                         if md.recurrent is not None else ())
    missing_state = sorted(mixer_layers - states.layers)
    if missing_state:
        raise UnsupportedModel(model_type, "a recurrent layer that keeps no state through transformers' cache",
                               f"layer {missing_state[0]}")
    num_layers = int(text_cfg.num_hidden_layers)
    missing = [i for i in range(num_layers) if i not in trace and i not in mixer_layers
               and layer_kind(text_cfg, i) not in FEED_FORWARD_KINDS]
    if missing:
        owner = _attention_module_of(model, missing[0])
        raise UnsupportedModel(model_type, "attention that bypasses transformers' attention interface",
                               f"layer {missing[0]}{f', {owner}' if owner else ''}",
                               f"{len(missing)} of {num_layers} layers never called the paged attention")
    expected = layer_windows(text_cfg)
    for i, call in sorted(trace.items()):
        if not call.is_causal:
            raise UnsupportedModel(model_type, "bidirectional (non-causal) attention", f"layer {i}")
        if call.extra:
            raise UnsupportedModel(model_type, f"attention arguments the paged back ends do not implement "
                                   f"({', '.join(call.extra)})", f"layer {i}")
        want = expected[i] if i < len(expected) else None
        if call.params.sliding_window != want:
            raise UnsupportedModel(model_type, "a sliding window its attention and its masks disagree on",
                                   f"layer {i}: config {want}, attention call {call.params.sliding_window}")
    return trace, states


def _attention_module_of(model: torch.nn.Module, layer_idx: int) -> str:
    for name, module in model.named_modules():
        if getattr(module, "layer_idx", None) == layer_idx and "ttention" in type(module).__name__:
            return f"{type(module).__name__} at {name}"
    return ""


def compare_with_reference(model: torch.nn.Module, layout: KVLayout, backend: ModuleType, model_type: str,
                           vocab_size: int, seed: int = 0, states: StateLayout | None = None) -> float:
    """Pass 2 (`states`: the recurrent mixers' per-request states, a slot for each
    sequence). Returns the largest relative logit difference seen.

    Raises:
        UnsupportedModel: the difference is above the dtype's tolerance.
    """
    from worker.model.runner import ModelRunner

    param = next(model.parameters())
    dev, dtype = param.device, param.dtype
    rng = random.Random(seed)
    a = [rng.randrange(1, min(vocab_size, 30000)) for _ in range(PROBE_LENS[0])]
    b = [rng.randrange(1, min(vocab_size, 30000)) for _ in range(PROBE_LENS[1])]
    num_blocks = 2 * (-(-max(PROBE_LENS) // PROBE_BLOCK_SIZE)) + 2
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=PROBE_BLOCK_SIZE, kv_layout=layout,
                         device=dev, dtype=dtype, backend=backend, state_layout=states, state_slots=2)
    free = list(range(num_blocks))
    rng.shuffle(free)
    table_a = free[: -(-len(a) // PROBE_BLOCK_SIZE)]
    table_b = free[len(table_a): len(table_a) + -(-len(b) // PROBE_BLOCK_SIZE)]
    steps = [
        [("a", a[:6], 0, table_a), ("b", b[:6], 0, table_b)],
        [("b", b, 6, table_b), ("a", a[:10], 6, table_a)],
        [("a", a, 10, table_a)],
    ]
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    with torch.inference_mode():
        try:
            for n, parts in enumerate(steps):
                sched = _sched(n + 1, parts)
                ids, pos, md, _, packed = runner.build_metadata(sched)
                logits = _forward(model, ids.tolist(), pos.tolist(), md)
                row = 0
                for s in packed:
                    got[s.request_id].append(logits[row: row + s.num_tokens])
                    row += s.num_tokens
        except Exception as e:
            raise UnsupportedModel(model_type, "a forward the paged runner cannot run", f"{type(model).__name__}",
                                   f"{type(e).__name__}: {str(e)[:300]}") from e
        try:
            with reference_attention(model):
                ref = {name: model(input_ids=torch.tensor([seq], device=dev), use_cache=False).logits[0].float()
                       for name, seq in (("a", a), ("b", b))}
        except Exception as e:
            raise UnsupportedModel(model_type, "no eager attention to check the paged runner against",
                                   f"{type(model).__name__}", f"{type(e).__name__}: {str(e)[:200]}; "
                                   "model.load_check: false skips this comparison") from e
    tol = tolerance(model, dtype)
    worst = 0.0
    for name in ("a", "b"):
        ours = torch.cat(got[name])
        scale = ref[name].std().item() or 1.0
        diff = (ours - ref[name]).abs().amax(dim=-1) / scale
        pos = int(diff.argmax())
        worst = max(worst, float(diff[pos]))
        if not torch.isfinite(diff).all() or diff[pos] > tol:
            raise UnsupportedModel(
                model_type, "an attention path the paged runner does not reproduce",
                f"{type(model).__name__}, load check",
                f"logits of sequence {name!r} differ from transformers' eager attention by {float(diff[pos]):.3g} "
                f"x their std at position {pos} (tolerance {tol:g}) with two sequences packed in one step")
    return worst
