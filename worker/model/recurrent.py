"""Per-request recurrent state beside the paged KV cache: Mamba / Mamba-2 / gated delta
net / short-convolution mixers of state-space and hybrid models, run by transformers'
own layer code over the packed batch.

transformers (5.x) gives almost every such mixer one signature, `forward(hidden_states,
cache=None, attention_mask=None, **kwargs)`, and one state interface on the cache
(`get_conv_state` / `update_conv_state` / `get_recurrent_state` /
`update_recurrent_state`, `cache_utils.LinearAttentionLayer`; MiniMax's lightning
attention its own `get_linear_cache` / `set_linear_cache`): a convolution window
`[batch, channels, kernel]` and a recurrent state (SSM state, delta-rule matrix) per
layer. The other arguments a mixer gets are passed on unchanged to each of its calls
below (none of the served mixers reads a per-token one; the load check's packed pass
would see one that did). The engine keeps those per request in *state slots* (`StatePool`: one tensor per
layer and state, `[num_slots, *shape]`), as vLLM's hybrid cache manager keeps them
beside its paged attention, and hands each mixer a cache of ours (`SlotCache`) that
reads and writes the slots of the rows it runs:

  - decode rows (the step's first `num_decodes` tokens): one batched call, `[nd, 1, D]`,
    the mixers' single-token path stepping each row's state once;
  - a prefill chunk that starts a request (position 0; also a preempted request
    recomputed): one call over the chunk from a zero state, the mixers' sequence path;
  - a prefill chunk that continues a request (chunked prefill): one call of the sequence
    path from the request's state where the mixer's sequence path continues a state
    (measured at load by `probe_continuation`: Mamba-2, gated delta net, short
    convolutions), else token by token through the single-token path (transformers'
    Mamba scan starts from zeros whatever the cache holds).

Slots are the scheduler's (`worker.engine.kv_cache.KVCacheManager`: taken with a
request's first blocks, given back when they are freed: finish, cancel, preemption), so
a slot is never read by two requests; a slot's previous content is never read either (a
request's first chunk starts from zeros). Their memory is reserved out of the KV budget
for `max_running_requests` slots (`worker.engine.engine.kv_cache_blocks`).

What a recurrent state cannot do is off for these models: share a prefix (prefix
caching), take back guessed tokens (speculative decoding); not built for the state path
yet: the compiled forward and graphs (eager), LoRA and the host KV tier (refused at load,
`worker.engine.engine.check_recurrent`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

from worker.model.attention import current_metadata
from worker.model.capability import state_mixers

CONV, RECURRENT = "conv", "recurrent"


@dataclass(slots=True, frozen=True)
class StateSpec:
    """One state tensor of one mixer, per request: `shape` without the batch dimension."""

    layer_idx: int
    kind: str  # CONV | RECURRENT
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True, frozen=True)
class StateLayout:
    """Every recurrent state a request holds (measured at load by one probe forward)."""

    specs: tuple[StateSpec, ...] = ()

    @property
    def bytes_per_request(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(s.layer_idx for s in self.specs)


class StatePool:
    """The state slots: for each `StateSpec` a zeroed tensor `[num_slots, *shape]` on `device`.

    Raises:
        ValueError: `num_slots` < 1.
    """

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.tensors = {(s.layer_idx, s.kind, s.state_idx): torch.zeros((num_slots, *s.shape), dtype=s.dtype,
                                                                          device=device)
                        for s in layout.specs}

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_request


@dataclass(slots=True)
class RecurrentStep:
    """What the mixers need of one packed step (built by the runner beside the attention
    metadata, `AttentionMetadata.recurrent`).

    Attributes:
        pool: the state slots; None in the load check's shape pass, where the mixers' states
            are made on the fly and their shapes recorded in `measured`.
        num_decodes: the step's first `num_decodes` tokens are single-token decodes.
        decode_slots: `[num_decodes]` int64 slot of each decode row.
        prefills: per prefill chunk, `(q_start, q_end, slot, starts)`: its rows of the packed
            batch, its slot, and whether it starts its request (position 0).
    """

    pool: StatePool | None
    num_decodes: int
    decode_slots: torch.Tensor
    prefills: list[tuple[int, int, int, bool]]
    measured: dict[tuple[int, str, int], StateSpec] = field(default_factory=dict)


class SlotCache:
    """The cache a mixer is handed for one call: its rows' states gathered from their
    slots (`gather`), read and updated through transformers' linear-attention cache
    interface, and written back (`scatter`). `previous`: the rows continue a request
    (their states are read); else they start one (zeros, nothing read).

    The single-token paths of transformers' mixers update the tensors `get_*_state`
    returns in place; the sequence paths call `update_*_state`. Both end in the gathered
    tensors, which `scatter` copies to the slots."""

    def __init__(self, step: RecurrentStep, layer_idx: int, slots: torch.Tensor, previous: bool) -> None:
        self.step, self.layer_idx, self.slots, self.previous = step, layer_idx, slots, previous
        self._states: dict[tuple[str, int], torch.Tensor] = {}

    def _state(self, kind: str, state_idx: int, like: torch.Tensor | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        key = (kind, state_idx)
        t = self._states.get(key)
        if t is not None:
            return t
        pool = self.step.pool
        if pool is not None:
            src = pool.tensors.get((self.layer_idx, kind, state_idx))
            if src is None:
                raise RuntimeError(f"layer {self.layer_idx} asked for a {kind} state {state_idx} the load "
                                   "check did not measure")
            t = src.index_select(0, self.slots)
        elif like is not None:  # the shape pass: made here, its shape recorded
            t = torch.zeros((len(self.slots), *shape), dtype=like.dtype, device=like.device)
            self.step.measured[(self.layer_idx, kind, state_idx)] = StateSpec(self.layer_idx, kind, state_idx,
                                                                              tuple(shape), like.dtype)
        else:
            return None
        self._states[key] = t
        return t

    # ---- transformers' linear-attention cache interface ------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(CONV, state_idx) if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(RECURRENT, state_idx) if self.previous else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """`conv_states` `[batch, channels, new_tokens]`; returns the window the convolution
        reads (the state's last `kernel` inputs, then the new ones) and keeps its last
        `kernel` columns, as `LinearAttentionLayer.update_conv_state` does."""
        kernel = conv_kernel_size or conv_states.shape[-1]
        state = self._state(CONV, state_idx, conv_states, (*conv_states.shape[1:-1], kernel))
        if self.previous:
            full = torch.cat([state, conv_states.to(state.dtype)], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        state.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        state = self._state(RECURRENT, state_idx, recurrent_states, tuple(recurrent_states.shape[1:]))
        state.copy_(recurrent_states)
        return state

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    # MiniMax's lightning attention keeps its state through these two
    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.update_recurrent_state(state, layer_idx)

    def scatter(self) -> None:
        """Write the rows' states back to their slots."""
        pool = self.step.pool
        if pool is None:
            return
        for (kind, state_idx), t in self._states.items():
            pool.tensors[(self.layer_idx, kind, state_idx)].index_copy_(0, self.slots, t)


def install(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Make each recurrent mixer of `model` (`state_mixers`) run over the packed step with
    the state slots of the current step's `AttentionMetadata.recurrent` (idempotent).
    Returns the mixers, by module name."""
    mixers = state_mixers(model)
    for module in mixers.values():
        if getattr(module, "_inflight_state_forward", False):
            continue
        module.forward = _packed_forward(module, type(module).forward.__get__(module))
        module._inflight_state_forward = True
        module._inflight_continues_state = False  # until `probe_continuation` measures it
    return mixers


def probe_continuation(model: torch.nn.Module, layout: StateLayout, hidden_size: int) -> dict[int, bool]:
    """For each installed mixer, whether its sequence path continues a state: 8 random
    hidden states run whole from zeros, and as 5 from zeros then 3 from the state those
    left, must give the same last 3 outputs (within the dtype's rounding). Sets what the
    packed forward does with a chunk that continues a request (module docstring).
    Returns layer_idx -> the verdict."""
    verdicts = {}
    param = next(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    for module in installed(model):
        idx = module.layer_idx
        pool = StatePool(StateLayout(tuple(s for s in layout.specs if s.layer_idx == idx)), 1, param.device)
        step = RecurrentStep(pool, 0, torch.zeros(0, dtype=torch.long, device=param.device), [])
        forward = type(module).forward.__get__(module)
        x = (torch.randn(1, 8, hidden_size, generator=gen) * 0.5).to(device=param.device, dtype=param.dtype)
        slots = torch.zeros(1, dtype=torch.long, device=param.device)
        extra = _probe_args(module)
        tol = 1e-4 if param.dtype in (torch.float32, torch.float64) else 2e-2
        try:
            with torch.inference_mode():
                whole = _call(forward, step, idx, x, slots, False, extra)[0][:, 5:].float()
                for t in pool.tensors.values():
                    t.zero_()
                _call(forward, step, idx, x[:, :5], slots, False, extra)
                tail = _call(forward, step, idx, x[:, 5:], slots, True, extra)[0].float()
            scale = whole.abs().max().item() or 1.0
            continues = tail.shape == whole.shape and (tail - whole).abs().max().item() <= tol * scale
        except Exception:  # a mixer the probe cannot feed, or a sequence path that takes no state:
            continues = False  # token by token, which is exact for every mixer
        verdicts[idx] = module._inflight_continues_state = continues
    return verdicts


def installed(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The mixers `install` made run over the packed step."""
    return [m for m in model.modules() if getattr(m, "_inflight_state_forward", False)]


def _probe_args(module: torch.nn.Module) -> dict:
    """Required arguments of the mixer's forward beyond the hidden states, the cache and
    the mask, as None (MiniMax's lightning attention takes rotary embeddings it does not
    read)."""
    params = list(inspect.signature(type(module).forward).parameters.values())[2:]
    return {p.name: None for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY)
            and p.name not in ("cache", "attention_mask")}


def _packed_forward(module: torch.nn.Module, forward):
    layer_idx = module.layer_idx
    params = inspect.signature(forward).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def packed(*args, **kwargs):
        md = current_metadata()
        if md is None:  # not the engine's step (transformers' own forward: the load check's reference)
            return forward(*args, **kwargs)
        step = md.recurrent
        if step is None:
            raise RuntimeError(f"recurrent layer {layer_idx} ran in a step without state slots")
        rest = {**dict(zip(positional, args)), **kwargs}  # every argument by name (names known at install)
        hidden_states = rest.pop(positional[0])
        rest["attention_mask"] = None  # the packed rows have no padding
        rest.pop("cache", None)
        if hidden_states.shape[0] != 1:
            raise RuntimeError(f"recurrent layer {layer_idx} expects the packed batch [1, tokens, hidden], got "
                               f"{tuple(hidden_states.shape)}")
        pieces, extra = [], 0
        nd = step.num_decodes
        if nd:
            out, extra = _call(forward, step, layer_idx, hidden_states[0, :nd].unsqueeze(1), step.decode_slots,
                               True, rest)
            pieces.append(out[:, 0])
        for q0, q1, slot, starts in step.prefills:
            slots = torch.tensor([slot], device=hidden_states.device)
            if starts or module._inflight_continues_state:
                out, extra = _call(forward, step, layer_idx, hidden_states[:, q0:q1], slots, not starts, rest)
                pieces.append(out[0])
            else:  # a chunk continuing a request: its tokens one at a time (the module docstring)
                for q in range(q0, q1):
                    out, extra = _call(forward, step, layer_idx, hidden_states[:, q:q + 1], slots, True, rest)
                    pieces.append(out[0])
        out = torch.cat(pieces).unsqueeze(0)
        return (out, *([None] * extra)) if extra else out

    return packed


def _call(forward, step: RecurrentStep, layer_idx: int, x: torch.Tensor, slots: torch.Tensor, previous: bool,
          kwargs: dict) -> tuple[torch.Tensor, int]:
    """The mixer over rows `x` with their slots' states: (its output, how many more values
    it returns beside it, for a mixer that returns a tuple)."""
    cache = SlotCache(step, layer_idx, slots, previous)
    out = forward(x, cache=cache, **{"attention_mask": None, **kwargs})
    extra = 0
    if isinstance(out, tuple):
        out, extra = out[0], len(out) - 1
    cache.scatter()
    return out, extra
