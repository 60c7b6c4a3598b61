"""Multi-LoRA on the packed batch: every token adds the delta of its request's adapter,
`scale * B @ (A @ x)`, to the output of each LoRA-capable projection, in one grouped
computation for the whole step (the batched LoRA of Punica, Chen et al. 2023, and
S-LoRA, Sheng et al. 2023): the weights are never merged, so one step mixes requests of
different adapters and of the base model.

Device buffers (`LoRAWeights`), per projection with `in` -> `out` features:
    a[m]: [max_loras, max_rank, in]    each slot's A, rows past its rank zero
    b[m]: [max_loras, out, max_rank]   each slot's B x scale (scale folded in at load)
Zero padding makes a rank-r adapter exact in a max_rank buffer (the extra terms are 0).

The delta (torch reference, `lora_delta`): the step's tokens with an adapter are
gathered, grouped by slot into a zero-padded [slots, max_n, in] block, and multiplied
by the slots' A and B with two batched matmuls (Punica's SGMV as two `bmm`s); a step
whose tokens all use one adapter takes two plain matmuls. A forward hook on each
projection (`install`) adds it: the model's modules and names stay transformers' own.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from worker.engine.adapters import WEIGHTS_FILE, AdapterSpec

_STEP: contextvars.ContextVar[LoRAStep | None] = contextvars.ContextVar("inflight_lora_step", default=None)
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")
_LAYER_INDEX = re.compile(r"\.\d+\.")


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The projections LoRA is served on: `nn.Linear` modules inside the decoder layers
    (a name with a layer index), not MoE experts (they see a subset of the tokens, not
    the packed batch) and not the output embedding. name -> module."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m is not head and _LAYER_INDEX.search(f".{name}.")
            and "expert" not in name}


@dataclass(slots=True)
class LoRAStep:
    """The step's token -> adapter slot grouping, shared by every projection.

    `rows` [M]: packed positions of the tokens that have an adapter, grouped by slot;
    `slots` [S]: the slots in use; `gather` [S * max_n]: for each padded position the
    index into `rows` (M: a zero row); `scatter` [M]: each row's padded position;
    `single`: the slot when every token of the step uses it (no gather needed).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    max_n: int
    single: int | None


def build_step(token_slots: list[int], device: torch.device) -> LoRAStep | None:
    """The grouping of a step whose packed tokens have `token_slots` (-1: the base
    model); None when no token has an adapter."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(token_slots):
        if s >= 0:
            groups.setdefault(s, []).append(i)
    if not groups:
        return None
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(token_slots):
        empty = torch.empty(0, dtype=torch.long, device=device)
        return LoRAStep(empty, empty, empty, empty, 0, next(iter(groups)))
    max_n = max(len(g) for g in groups.values())
    rows: list[int] = []
    gather: list[int] = []
    scatter: list[int] = []
    m = sum(len(g) for g in groups.values())
    for k, g in enumerate(groups.values()):
        scatter.extend(range(k * max_n, k * max_n + len(g)))
        gather.extend(range(len(rows), len(rows) + len(g)))
        gather.extend([m] * (max_n - len(g)))
        rows.extend(g)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return LoRAStep(t(rows), t(list(groups)), t(gather), t(scatter), max_n, None)


@contextlib.contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Make `step` the current forward's adapter grouping (read by the hooks)."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step: LoRAStep) -> torch.Tensor:
    """The adapters' delta for the tokens `step` names.

    Args:
        x: `[N, in]` the projection's input (packed tokens).
        a: `[max_loras, r, in]`, b: `[max_loras, out, r]` the slots' weights (B scaled).

    Returns:
        `[N, out]` when `step.single` (every token, one adapter); else `[M, out]`, the
        rows `step.rows` in order.
    """
    if step.single is not None:
        return (x @ a[step.single].T) @ b[step.single].T
    xs = x.index_select(0, step.rows)
    xs = torch.cat([xs, xs.new_zeros(1, xs.shape[1])])
    n_slots = step.slots.numel()
    xp = xs.index_select(0, step.gather).view(n_slots, step.max_n, -1)
    h = torch.bmm(xp, a.index_select(0, step.slots).transpose(1, 2))  # [S, max_n, r]
    d = torch.bmm(h, b.index_select(0, step.slots).transpose(1, 2))  # [S, max_n, out]
    return d.view(n_slots * step.max_n, -1).index_select(0, step.scatter)


class LoRAWeights:
    """The slots' device buffers for every LoRA-capable projection, and which load each
    slot holds. Written only by the runner's forward thread (`fill`), between forwards.

    Args:
        modules: `lora_modules(model)`.
        max_loras, max_rank: `model.max_loras`, `model.max_lora_rank`.
    """

    def __init__(self, modules: dict[str, torch.nn.Linear], max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.a = {n: torch.zeros(max_loras, max_rank, m.in_features, device=device, dtype=dtype)
                  for n, m in modules.items()}
        self.b = {n: torch.zeros(max_loras, m.out_features, max_rank, device=device, dtype=dtype)
                  for n, m in modules.items()}
        self.load_ids = [0] * max_loras  # the load each slot holds (0: none)
        self._hooks = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Projection name -> (in_features, out_features)."""
        return {n: (a.shape[2], self.b[n].shape[1]) for n, a in self.a.items()}

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
            wa, wb = pair
            r = wa.shape[0]
            a[slot, :r].copy_(wa)
            a[slot, r:].zero_()
            b[slot, :, :r].copy_(wb)
            b[slot, :, r:].zero_()
        self.load_ids[slot] = load_id

    def _hook(self, name: str):
        a, b = self.a[name], self.b[name]

        def add_delta(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            step = _STEP.get()
            if step is None:
                return None
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            y2 = out.view(-1, out.shape[-1])
            d = lora_delta(x2, a, b, step)
            if step.single is not None:
                y2 += d
            else:
                y2.index_add_(0, step.rows, d)
            return out

        return add_delta

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


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
