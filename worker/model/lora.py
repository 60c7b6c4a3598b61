"""Multi-LoRA on the packed batch: every token adds the delta of its request's adapter,
`scale * B @ (A @ x)`, to the output of each LoRA-capable projection, in one grouped
computation for the whole step (the batched LoRA of Punica, Chen et al. 2023, and
S-LoRA, Sheng et al. 2023): the weights are never merged, so one step mixes requests of
different adapters and of the base model.

Device buffers (`LoRAWeights`), per projection with `in` -> `out` features:
    a[m]: [max_loras, in, max_rank]    each slot's A^T, columns past its rank zero
    b[m]: [max_loras, max_rank, out]   each slot's (B x scale)^T (scale folded in at load)
Zero padding makes a rank-r adapter exact in a max_rank buffer (the extra terms are 0).

The delta (torch reference, `add_lora_delta`): the step's tokens with an adapter are
gathered, grouped by slot into a zero-padded [slots, max_n, in] block, and multiplied
by the slots' A and B with two batched matmuls (Punica's SGMV as two `bmm`s); a step
whose tokens all use one adapter takes two plain matmuls. A forward hook on each
projection, installed once for the engine's life, adds it: the model's modules and names
stay transformers' own, and a step with no adapter leaves the outputs untouched.

A compiled forward (`worker.model.compiled`) keeps the delta as one opaque op per
projection, `torch.ops.inflight.lora_delta` (mutating the projection's output in place),
as it keeps attention (`worker.model.attention.attention_op`): the op names its projection
by a constant index and reads the step's grouping and the slots' weights when it runs,
so one graph serves steps with and without adapters and nothing that changes between
steps (the grouping, which slot holds which adapter) is a graph input.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.adapters import WEIGHTS_FILE, AdapterSpec
from worker.model.attention import traced
from worker.model.capability import decoder_projections
from worker.model.kernels import cpu_lora, native
from worker.model.quant_linear import Fp8Linear, QuantLinear
from worker.model.small_batch import SmallBatchLinear

_STEP: contextvars.ContextVar[LoRAStep | None] = contextvars.ContextVar("inflight_lora_step", default=None)
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The projections LoRA is served on: `nn.Linear` modules (or `SmallBatchLinear`s, or
    `QuantLinear`s: the delta is added in the activation dtype on top of the quantized
    base) inside the decoder layers (a name with a layer index), not MoE experts (they see
    a subset of the tokens, not the packed batch) and not the output embedding. name ->
    module."""
    return decoder_projections(model, (torch.nn.Linear, SmallBatchLinear, QuantLinear, Fp8Linear))


@dataclass(slots=True)
class LoRAStep:
    """The step's token -> adapter slot grouping, shared by every projection.

    The tokens with an adapter are laid out in a zero-padded block of G groups of
    `max_n` rows, one group per slot: `src` [G * max_n] is each padded position's packed
    token (N, one past the last, for padding: a zero row), `dst` the same with padding
    sent to row 0 (padding rows of the delta are exact zeros). `slots` [G]: the slots of
    the groups, or None when the block spans every slot in order (weights used in
    place). `single`: the slot when every token of the step uses it (no gather at all).
    `last_x` / `last_xp`: the padded input of the last projection, reused by the next
    one with the same input (q, k, v; gate, up) in an eager forward. `groups`: slot ->
    its tokens' indices, by slot, of the `num_tokens` packed tokens; `segments`: the same
    for the kernel that serves the step (`kernels.cpu_lora.Segments`, or
    `kernels.triton_lora.DeviceSegments` on CUDA), built at its first use. `weights`:
    the slots' buffers (`LoRAWeights`) and `kernel` the CPU kernel bound to them and to
    the grouping (`kernels.cpu_lora.BoundKernel`, None where it does not serve), both set
    by `bind`.
    """

    src: torch.Tensor
    dst: torch.Tensor
    slots: torch.Tensor | None
    max_n: int
    single: int | None
    groups: dict[int, list[int]]
    num_tokens: int
    last_x: torch.Tensor | None = None
    last_xp: torch.Tensor | None = None
    segments: Any = None
    weights: LoRAWeights | None = None
    kernel: cpu_lora.BoundKernel | None = None

    def bind(self, weights: LoRAWeights) -> None:
        """Give the step the slots' buffers it runs with; on a CPU whose kernel is built,
        with float32 buffers, bind the kernel to them and to the grouping once for all the
        step's projections (`kernels.cpu_lora.BoundKernel`)."""
        self.weights = weights
        args = weights.cpu_kernel_args()
        if args is not None:
            if self.segments is None:
                self.segments = _segments(self, weights.max_loras)
            self.kernel = cpu_lora.BoundKernel(self.segments, args)

    def segment_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The grouping as the kernels take it: the adapter tokens' indices grouped by slot
        (`order`), each segment's start in it plus the end (`starts`, G + 1), and the
        segments' slots (G)."""
        order = [i for tokens in self.groups.values() for i in tokens]
        starts = [0]
        for tokens in self.groups.values():
            starts.append(starts[-1] + len(tokens))
        return order, starts, list(self.groups)


def build_step(token_slots: list[int], device: torch.device, max_loras: int | None = None) -> LoRAStep | None:
    """The grouping of a step whose packed tokens have `token_slots` (-1: the base
    model); None when no token has an adapter. With `max_loras` and at least half the
    slots in use, the padded block spans every slot (weights used in place)."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(token_slots):
        if s >= 0:
            groups.setdefault(s, []).append(i)
    if not groups:
        return None
    groups = dict(sorted(groups.items()))
    n = len(token_slots)
    if len(groups) == 1 and len(next(iter(groups.values()))) == n:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return LoRAStep(empty, empty, None, 0, next(iter(groups)), groups, n)
    full = max_loras is not None and 2 * len(groups) >= max_loras
    order = list(range(max_loras)) if full else sorted(groups)
    max_n = max(len(g) for g in groups.values())
    src: list[int] = []
    for slot in order:
        g = groups.get(slot, [])
        src.extend(g)
        src.extend([n] * (max_n - len(g)))

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return LoRAStep(t(src), t([0 if i == n else i for i in src]), None if full else t(order), max_n, None, groups, n)


@contextlib.contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Make `step` the current forward's adapter grouping (read by the hooks and the
    operators; in the C++ operator's binding for this thread too, once that is loaded)."""
    token = _STEP.set(step)
    try:
        _bind_native(step)
        yield
    finally:
        _STEP.reset(token)
        _bind_native(_STEP.get())


def _bind_native(step: LoRAStep | None) -> None:
    """The C++ operator's binding for this thread made `step`'s (`native.py`): its kernel
    where its weights take the operator (`LoRAWeights.native`), the torch
    path where it has no kernel, nothing when there is no step. Nothing else to do while
    the operators are not loaded: no binding exists."""
    if step is not None and step.kernel is not None and step.weights is not None and step.weights.native:
        step.kernel.bind_native()
    elif not native.LOADED:
        return
    elif step is None:
        torch.ops.inflight_native.lora_unbind()
    else:
        torch.ops.inflight_native.lora_bind_torch()


def add_lora_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step: LoRAStep,
                   reuse: bool = True) -> None:
    """Add the adapters' delta of the tokens `step` names to `y` in place: on CUDA by the
    Triton SGMV kernels (`kernels.triton_lora`), float32 on a CPU with AVX-512 or AVX2 +
    FMA by the C one (`kernels.cpu_lora`), else in torch (module docstring).

    Args:
        x: `[N, in]` the projection's input (packed tokens).
        y: `[N, out]` its output.
        a: `[max_loras, in, r]`, b: `[max_loras, r, out]` the slots' weights (B scaled).
        reuse: reuse the last projection's padded input when `x` is the same tensor
            object. Only where a tensor object's values never change while it lives (an
            eager forward): a compiled graph writes new values into buffers it reuses.
    """
    if x.is_cuda:
        from worker.model.kernels import triton_lora

        if step.segments is None:
            step.segments = triton_lora.DeviceSegments(*step.segment_lists(), x.device)
        triton_lora.lora_sgmv(x, y, a, b, step.segments)
        return
    if cpu_lora.takes(x, a) and y.stride(-1) == 1:
        if step.segments is None:
            step.segments = _segments(step, a.shape[0])
        cpu_lora.lora_sgmv(x, y, a, b, step.segments)
        return
    if step.single is not None:
        y += (x @ a[step.single]) @ b[step.single]
        return
    if reuse and step.last_x is x:
        xp = step.last_xp
    else:
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, step.src).view(-1, step.max_n, x.shape[1])
        if reuse:
            step.last_x, step.last_xp = x, xp
    if step.slots is not None:
        a, b = a.index_select(0, step.slots), b.index_select(0, step.slots)
    d = torch.bmm(torch.bmm(xp, a), b)  # [G, max_n, out]; padding rows are zeros
    y.index_add_(0, step.dst, d.view(-1, d.shape[-1]))


def _segments(step: LoRAStep, max_loras: int) -> cpu_lora.Segments:
    """The step's grouping as the CPU kernel takes it."""
    order, starts, slots = (torch.tensor(v, dtype=torch.int64) for v in step.segment_lists())
    return cpu_lora.Segments(order, starts, slots, step.num_tokens, max_loras)


# The compiled forward's op (module docstring), declared with `torch.library.Library` rather
# than `custom_op`: a call costs about 2 us against 4 us (in inference mode, measured on the
# CPU), and a LoRA model makes one per projection per step.
_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("lora_delta(Tensor x, Tensor(a!) y, int projection) -> ()")


def lora_delta_op(x: torch.Tensor, y: torch.Tensor, projection: int) -> None:
    """`torch.ops.inflight.lora_delta`: the adapters' delta of one projection added to its
    output in place, in a compiled forward (module docstring); a no-op in a step without
    adapters.

    Args:
        x: `[N, in]` the projection's input; y: `[N, out]` its output (mutated).
        projection: the projection's index in its `LoRAWeights` (a constant of the graph).

    Raises:
        RuntimeError: the step's grouping has no weights (the runner sets them).
    """
    step = _STEP.get()
    if step is None:
        return
    if step.kernel is not None and step.kernel(x, y, projection):
        return
    if step.weights is None:
        raise RuntimeError("inflight::lora_delta: the step's LoRA grouping has no weights")
    a, b = step.weights.by_index[projection]
    add_lora_delta(x, y, a, b, step, reuse=False)


_LIB.impl("lora_delta", lora_delta_op, "CompositeExplicitAutograd")


@torch.library.register_fake("inflight::lora_delta", lib=_LIB)
def _(x, y, projection):
    return None


class LoRAWeights:
    """The slots' device buffers for every LoRA-capable projection, and which load each
    slot holds. Written only by the runner's forward thread (`fill`), between forwards.
    The hooks are installed with the buffers and stay (module docstring). `native`: the
    deltas go through the C++ operator (`kernels.native`: the CPU kernel serves these
    buffers and the operators are built and loaded), decided here, before any forward is
    traced, since a compiled graph keeps the operator it was traced with.

    Args:
        modules: `lora_modules(model)`.
        max_loras, max_rank: `model.max_loras`, `model.max_lora_rank`.
    """

    def __init__(self, modules: dict[str, torch.nn.Linear], max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.modules = modules
        self.a = {n: torch.zeros(max_loras, m.in_features, max_rank, device=device, dtype=dtype)
                  for n, m in modules.items()}
        self.b = {n: torch.zeros(max_loras, max_rank, m.out_features, device=device, dtype=dtype)
                  for n, m in modules.items()}
        self.load_ids = [0] * max_loras  # the load each slot holds (0: none)
        self.by_index = [(self.a[n], self.b[n]) for n in modules]  # the op's projection index -> (a, b)
        self._cpu_args: cpu_lora.WeightArgs | bool | None = None
        self.native = self.cpu_kernel_args() is not None and native.available()
        self._hooks = [m.register_forward_hook(self._hook(i, n)) for i, (n, m) in enumerate(modules.items())]

    def cpu_kernel_args(self) -> cpu_lora.WeightArgs | None:
        """The buffers as the CPU kernel's arguments (`kernels.cpu_lora.weight_args`),
        built at the first call: the buffers never move. None where the kernel does not
        serve them (another device or dtype, a rank over its limit, the library not built)."""
        if self._cpu_args is None:
            self._cpu_args = False
            if self.by_index and self.by_index[0][0].device.type == "cpu" and cpu_lora.available():
                with contextlib.suppress(ValueError):  # buffers `weight_args` refuses: the torch path
                    self._cpu_args = cpu_lora.weight_args(self.by_index)
        return self._cpu_args or None

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Projection name -> (in_features, out_features)."""
        return {n: (a.shape[1], self.b[n].shape[2]) for n, a in self.a.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())

    def fill(self, slot: int, load_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's weights (`read_adapter`) into `slot` unless it holds them."""
        if self.load_ids[slot] == load_id:
            return
        for name, a in self.a.items():
            b = self.b[name]
            pair = weights.get(name)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
                continue
            wa, wb = pair  # [r, in], [out, r]
            r = wa.shape[0]
            a[slot, :, :r].copy_(wa.T)
            a[slot, :, r:].zero_()
            b[slot, :r].copy_(wb.T)
            b[slot, r:].zero_()
        self.load_ids[slot] = load_id

    def _hook(self, index: int, name: str):
        a, b = self.a[name], self.b[name]

        def add_delta(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            x = args[0]
            if traced():  # the compiled graph's opaque op, whatever the step holds
                op = torch.ops.inflight_native.lora_delta if self.native else torch.ops.inflight.lora_delta
                op(x.view(-1, x.shape[-1]), out.view(-1, out.shape[-1]), index)
                return out
            step = _STEP.get()
            if step is None:
                return None
            x2, y2 = x.view(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            if step.kernel is not None and self.native:
                torch.ops.inflight_native.lora_delta(x2, y2, index)
            elif step.kernel is None or not step.kernel(x2, y2, index):
                add_lora_delta(x2, y2, a, b, step)
            return out

        add_delta.graph_key = "native" if self.native else "python"  # the operator a trace keeps (artifact_key)
        return add_delta


def read_adapter(spec: AdapterSpec, dtype: torch.dtype) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """An adapter's weights in host memory, ready for `LoRAWeights.fill`: module ->
    (A `[r, in]`, B x scale `[out, r]`) in `dtype`, and the number of elements. Runs on
    the loader thread (lora_slots.py). Raises OSError or ValueError when the file no
    longer matches its checked spec."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(spec.path, WEIGHTS_FILE), device="cpu")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m["module"] not in spec.modules:
            raise ValueError(f"adapter {spec.name!r} changed on disk since it was checked: tensor {key!r}")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    out = {}
    for module, (r, scale) in spec.modules.items():
        pair = pairs.get(module, {})
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != r:
            raise ValueError(f"adapter {spec.name!r} changed on disk since it was checked: module {module!r}")
        out[module] = (pair["A"].to(dtype).contiguous(), (pair["B"].float() * scale).to(dtype).contiguous())
    return out, sum(a.numel() + b.numel() for a, b in out.values())
