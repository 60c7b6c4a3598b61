"""Triton kernels for the batched LoRA delta on CUDA (SGMV, as Punica and S-LoRA compute
it: Chen et al. 2023, Sheng et al. 2023): the step's adapter tokens grouped by slot into
segments, each segment's rows multiplied by its slot's A and B as tiles on the tensor
cores, rows read and written in place by index (no gather, no scatter, no padding).

    shrink: h[p, :r]  = x[order[p]] @ a[slot]           a: [max_loras, in, r]
    expand: y[order[p]] += h[p] @ b[slot]               b: [max_loras, r, out]

for every position p of segment g (`order[seg_start[g]:seg_start[g + 1]]`, slot
`seg_slot[g]`). A program of the shrink takes `BLOCK_M` rows of one segment and walks
`in` in `BLOCK_K` steps; a program of the expand takes `BLOCK_M` rows and `BLOCK_N`
output columns. The grid covers the longest segment; programs past their segment's end
return at once. The rank-r intermediate `h` is float32 (`[M, R]`, R = r rounded up to a
power of two of at least 16, what `tl.dot` takes); float32 operands multiply in IEEE
precision (no TF32), as torch's matmul does by default.

Used by `worker.model.lora.add_lora_delta` on CUDA; on the CPU it runs only under
Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported), which is
how the tests check it against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.interpreter import drop_interpreter_overflow_checks

drop_interpreter_overflow_checks()  # on the CPU interpreter: checks it would discard

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _block_rows(order, seg_start, seg_slot, BM: tl.constexpr):
    """This program's rows: block `program_id(1)` of segment `program_id(0)`. Returns
    (whether the block is past the segment's end, the slot, the positions in `order`, which
    of them are in the segment, their token rows)."""
    g = tl.program_id(0)
    end = tl.load(seg_start + g + 1)
    first = tl.load(seg_start + g) + tl.program_id(1) * BM
    pos = first + tl.arange(0, BM)
    ok = pos < end
    rows = tl.load(order + pos, mask=ok, other=0).to(tl.int64)
    return first >= end, tl.load(seg_slot + g).to(tl.int64), pos, ok, rows


@triton.jit
def _shrink_kernel(x, a, h, order, seg_start, seg_slot, K, R_ACT, stride_x,
                   R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    past, slot, pos, ok, rows = _block_rows(order, seg_start, seg_slot, BM)
    if past:
        return
    rr = tl.arange(0, R)
    r_ok = rr < R_ACT
    acc = tl.zeros((BM, R), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        xt = tl.load(x + rows[:, None] * stride_x + rk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a + slot * K * R_ACT + rk[:, None] * R_ACT + rr[None, :], mask=k_ok[:, None] & r_ok[None, :],
                     other=0.0)
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
    tl.store(h + pos[:, None] * R + rr[None, :], acc, mask=ok[:, None])


@triton.jit
def _expand_kernel(h, b, y, order, seg_start, seg_slot, N, R_ACT, stride_y,
                   R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    past, slot, pos, ok, rows = _block_rows(order, seg_start, seg_slot, BM)
    if past:
        return
    rr = tl.arange(0, R)
    rn = tl.program_id(2) * BN + tl.arange(0, BN)
    n_ok = rn < N
    ht = tl.load(h + pos[:, None] * R + rr[None, :], mask=ok[:, None], other=0.0)
    bt = tl.load(b + slot * R_ACT * N + rr[:, None] * N + rn[None, :], mask=(rr < R_ACT)[:, None] & n_ok[None, :],
                 other=0.0)
    delta = tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
    out = y + rows[:, None] * stride_y + rn[None, :]
    mask = ok[:, None] & n_ok[None, :]
    tl.store(out, (tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta).to(y.dtype.element_ty), mask=mask)


class DeviceSegments:
    """A step's adapter tokens grouped by slot, on the device, for the kernels' calls (one
    pair per projection): `order` `[M]`, `seg_start` `[G + 1]`, `seg_slot` `[G]` int64
    (from `LoRAStep.segment_lists`), and the longest segment's length (the grid's second
    dimension)."""

    def __init__(self, order: list[int], starts: list[int], slots: list[int], device: torch.device) -> None:
        self.order = torch.tensor(order, dtype=torch.int64, device=device)
        self.seg_start = torch.tensor(starts, dtype=torch.int64, device=device)
        self.seg_slot = torch.tensor(slots, dtype=torch.int64, device=device)
        self.num_rows = len(order)
        self.longest = max(e - s for s, e in zip(starts, starts[1:]))


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: DeviceSegments) -> None:
    """`y[t] += (x[t] @ a[s]) @ b[s]` in place for every token t of every segment (slot s).

    Args:
        x: `[N, in]` (bf16, fp16 or fp32), unit column stride; y: `[N, out]` likewise (mutated).
        a: `[max_loras, in, r]`, b: `[max_loras, r, out]`, contiguous, x's dtype.
        segments: the step's grouping (`DeviceSegments`).
    """
    k, r, n = x.shape[1], a.shape[2], b.shape[2]
    if x.stride(1) != 1 or y.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"lora_sgmv: x strides {x.stride()}, y strides {y.stride()}, a and b contiguous "
                         f"{a.is_contiguous()}, {b.is_contiguous()}")
    rp = max(16, triton.next_power_of_2(r))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(segments.num_rows, rp, device=x.device, dtype=torch.float32)
    g, blocks = segments.seg_slot.shape[0], triton.cdiv(segments.longest, BLOCK_M)
    _shrink_kernel[(g, blocks)](x, a, h, segments.order, segments.seg_start, segments.seg_slot, k, r, x.stride(0),
                                R=rp, BM=BLOCK_M, BK=BLOCK_K, PRECISION=precision)
    _expand_kernel[(g, blocks, triton.cdiv(n, BLOCK_N))](h, b, y, segments.order, segments.seg_start,
                                                         segments.seg_slot, n, r, y.stride(0), R=rp, BM=BLOCK_M,
                                                         BN=BLOCK_N, PRECISION=precision)
