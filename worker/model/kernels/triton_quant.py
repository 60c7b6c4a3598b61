"""Triton kernel for weight-only quantized linear layers (W8A16, W4A16): the integers are
dequantized inside the matmul, tile by tile, so the float weight never exists in memory
(the torch path, `QuantLinear.dequantized`, writes and reads it back at each call).

`y[M, N] = x[M, K] @ ((q[N, K] - zero[N, G]) * scale[N, G]).T (+ bias)`, groups of
`K / G` consecutive input channels. A program computes a `BLOCK_M x BLOCK_N` tile of `y`,
walking K in `BLOCK_K` steps; each step loads the tile's integers (int8, or packed int4 by
halves of K as `quant_linear.pack_int4` stores them: the low nibble of byte k holds column
k, the high nibble column K/2 + k), the one group's scales (and zero points) they share,
and accumulates `tl.dot(x, w)` in fp32. The same idea as the W4A16 GEMMs of vLLM and
AutoAWQ (dequantize-in-the-matmul); the tiling is plain, not tuned.

Used by `QuantLinear` on CUDA; on the CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1`, set before this module is imported), which is how the tests check
it against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.interpreter import drop_interpreter_overflow_checks

drop_interpreter_overflow_checks()  # on the CPU interpreter: checks it would discard

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _woq_matmul_kernel(
    x, q, scale, zero, bias, y, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    GROUP_SIZE: tl.constexpr, INT4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    half = K // 2
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xt = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        if INT4:
            in_lo = k0 < half  # BK divides K / 2: a tile lies in one half
            col = tl.where(in_lo, rk, rk - half)
            p = tl.load(q + rn[None, :] * stride_qn + col[:, None], mask=n_ok[None, :], other=0).to(tl.int32)
            qi = tl.where(in_lo, p & 15, p >> 4) - 8
        else:
            qi = tl.load(q + rn[None, :] * stride_qn + rk[:, None], mask=n_ok[None, :], other=0).to(tl.int32)
        g = k0 // GROUP_SIZE  # BK divides the group size: one group per tile
        s = tl.load(scale + rn * stride_sn + g, mask=n_ok, other=0.0)
        w = qi.to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero + rn * stride_sn + g, mask=n_ok, other=0).to(tl.float32)
            w = w - z[None, :]
        w = w * s[None, :]
        acc += tl.dot(xt, w.to(xt.dtype))
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fits(in_features: int, groups: int, int4: bool) -> bool:
    """Whether the kernel serves a layer of `in_features` inputs in `groups` groups (int4:
    packed by `pack_int4`): K tiles that stay inside one group (and, for int4, inside one
    half of K)."""
    group = in_features // groups
    return group % BLOCK_K == 0 and in_features % BLOCK_K == 0 and (not int4 or (in_features // 2) % BLOCK_K == 0)


def woq_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ ((q - zero) * scale).T + bias` for a weight-only layer that `fits`.

    Args:
        x: `[..., in]` activations (bf16, fp16 or fp32).
        qweight: int8 `[out, in]`, or uint8 `[out, in / 2]` (packed int4, `pack_int4`).
        scale: `[out, groups]` float32; zero: int8 `[out, groups]` or None; bias: `[out]` or None.
    Returns:
        `[..., out]` in x's dtype.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _woq_matmul_kernel[grid](
        x2, qweight, scale, zero if zero is not None else scale, bias if bias is not None else scale, y, m, n, k,
        x2.stride(0), qweight.stride(0), scale.stride(0), y.stride(0),
        GROUP_SIZE=k // scale.shape[1], INT4=qweight.dtype == torch.uint8,
        HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )
    return y.reshape(*shape[:-1], n)
