"""A linear layer whose weights are stored as integers (`QuantLinear`), and the arithmetic of
integer weights: quantizing a float weight, packing 4-bit values, and the two ways a forward
uses them.

Weights `[out_features, in_features]` are integers `q` with a scale per output channel or per
group of `group_size` input channels, and optionally a zero point of the same shape
(asymmetric): `w = (q - zero) * scale`, the convention of compressed-tensors (signed `q` in
`[-2^(bits-1), 2^(bits-1) - 1]`, zero points in the same range).

Two forwards:

- **W8A8** (8-bit weights with one scale per output channel, symmetric; activations quantized
  per token at each call, as compressed-tensors' `W8A8` preset and SGLang's `w8a8_int8`):
  `y = (round(x / sx) @ q.T) * sx * scale` with `sx = max|x| / 127.5` per token
  (compressed-tensors' rule for symmetric int8), the integer matmul in `torch._int_mm` (oneDNN's
  VNNI kernels on the CPU, cuBLASLt on CUDA). On the 2-core AVX-512 benchmark box, 48
  projections of 1024 x 3072 ran 2.4x (32 rows) to 3.0x (128 rows) faster than fp32; a
  whole decode step 1.3x (1 request) to 1.85x (32): docs/benchmarks.md.
- **Weight-only** (W8A16, W4A16; channel or group scales; symmetric or not): on the CPU a C
  kernel reads the integers as stored and widens them in registers (`kernels/cpu_woq.py`,
  the op `inflight::woq_linear`): a decode step of the benchmark model ran 1.96x (int8) and
  2.47x (int4) the fp32 one at 1 request, 1.1x at 32. On CUDA the integers are dequantized
  inside a Triton matmul (`kernels/triton_quant.py`, checked against the torch path under
  Triton's interpreter; never run on a GPU yet). Elsewhere (no C compiler, a CPU with
  neither AVX-512 nor AVX2, groups that are not whole vectors: `cpu_woq.fast`) the weight is
  dequantized into the activation dtype per call and multiplied in floating point: exact
  to the checkpoint's values, but slower than the float model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch._int_mm on CUDA wants more than 16 rows; smaller batches are padded (the CPU takes any)
_CUDA_MIN_ROWS = 17


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How one layer's weights are quantized.

    Attributes:
        bits: 8 or 4.
        group_size: input channels per scale; None = one scale per output channel.
        symmetric: no zero points.
        act_int8: activations quantized to int8 per token at each call (W8A8); needs
            `bits == 8`, per-channel scales and `symmetric`.
    """

    bits: int
    group_size: int | None = None
    symmetric: bool = True
    act_int8: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"weights of {self.bits} bits; 4 and 8 are served")
        if self.act_int8 and (self.bits != 8 or self.group_size is not None or not self.symmetric):
            raise ValueError("int8 activations need 8-bit symmetric weights with one scale per output channel")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def describe(self) -> str:
        """e.g. "W4A16 (int4 weights, groups of 128, asymmetric)"."""
        name = f"W{self.bits}A{8 if self.act_int8 else 16}"
        scales = f"groups of {self.group_size}" if self.group_size else "per-channel scales"
        acts = ", int8 activations per token" if self.act_int8 else ""
        return f"{name} (int{self.bits} weights, {scales}, {'symmetric' if self.symmetric else 'asymmetric'}{acts})"


def quantize_weight(w: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of a float weight (no calibration data; min/max of each
    channel or group, the range always holding 0), by compressed-tensors' rules (its
    `calculate_qparams`): symmetric scale = max|w| / ((qmax - qmin) / 2), i.e. / 127.5 for
    8 bits; asymmetric scale = (max - min) / (qmax - qmin), zero = round(qmin - min / scale).

    Args:
        w: `[out_features, in_features]` float weight.
    Returns:
        q `[out, in]` int8 (values in the scheme's range), scale `[out, groups]` float32,
        zero `[out, groups]` int8 or None (symmetric).
    Raises:
        ValueError: `group_size` does not divide `in_features`.
    """
    n, k = w.shape
    g = scheme.group_size or k
    if k % g:
        raise ValueError(f"group_size {g} does not divide in_features {k}")
    wg = w.detach().float().reshape(n, k // g, g)
    if scheme.symmetric:
        scale = (wg.abs().amax(-1) / ((scheme.qmax - scheme.qmin) / 2)).clamp(min=torch.finfo(torch.float32).tiny)
        zero = None
        q = torch.round(wg / scale[..., None])
    else:
        lo = wg.amin(-1).clamp(max=0)
        hi = wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / (scheme.qmax - scheme.qmin)).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.round(scheme.qmin - lo / scale).clamp(scheme.qmin, scheme.qmax)
        q = torch.round(wg / scale[..., None]) + zero[..., None]
        zero = zero.to(torch.int8)
    q = q.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(n, k)
    return q, scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`[n, k]` int8 values in [-8, 7] (k even) -> `[n, k / 2]` uint8, offset by 8: column j
    in the low nibble of byte j, column k/2 + j in its high nibble. Halves rather than
    neighbours, so unpacking is two elementwise ops and a concatenation, which a compiled
    forward fuses into its dequantization (neighbours interleave: measured 0.13x the fp32
    step at one request, against 0.76x for int8)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    half = q.shape[1] // 2
    return u[:, :half] | (u[:, half:] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: `[n, k / 2]` uint8 -> `[n, k]` int8."""
    return torch.cat(((p & 15).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8), dim=1)


class QuantLinear(torch.nn.Module):
    """`nn.Linear`'s contract (`in_features`, `out_features`, `bias`; input `[..., in]`,
    output `[..., out]` in the input's dtype) over integer weights.

    Buffers: `qweight` int8 `[out, in]`, or `[in, out]` for W8A8 (the layout `_int_mm`
    reads), or uint8 `[out, in / 2]` for 4 bits and an even `in` (`pack_int4`); `scale` `[out, groups]`
    float32; `zero` int8 `[out, groups]` when asymmetric; `perm` `[in]` when the stored
    columns are the input channels in that order (GPTQ's activation order: groups
    contiguous), the input then gathered alike.
    """

    def __init__(self, in_features: int, out_features: int, scheme: WeightScheme, q: torch.Tensor,
                 scale: torch.Tensor, zero: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None) -> None:
        super().__init__()
        if tuple(q.shape) != (out_features, in_features):
            raise ValueError(f"quantized weight {tuple(q.shape)} for a layer of {out_features} x {in_features}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = in_features // (scheme.group_size or in_features)
        if tuple(scale.shape) != (out_features, groups):
            raise ValueError(f"scale {tuple(scale.shape)}, expected {(out_features, groups)}")
        q = q.to(torch.int8)
        if scheme.act_int8:
            q = q.t().contiguous()
        elif scheme.bits == 4 and in_features % 2 == 0:  # an odd width stays one value per byte
            q = pack_int4(q)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("zero", None if zero is None else zero.to(torch.int8).contiguous())
        # GPTQ's activation order: the weight's columns sorted by group; inputs gathered alike
        self.register_buffer("perm", None if perm is None else perm.to(torch.long).contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        # weight-only on the CPU: the C kernel when it builds and takes the layer (decided once,
        # so a compiled forward sees a constant)
        self.cpu_kernel = not scheme.act_int8 and _cpu_kernel_takes(in_features, groups, q.dtype == torch.uint8)

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, scheme: WeightScheme) -> QuantLinear:
        """A float layer quantized by `quantize_weight` (on the layer's device)."""
        q, scale, zero = quantize_weight(linear.weight, scheme)
        return cls(linear.in_features, linear.out_features, scheme, q, scale, zero, linear.bias)

    def describe(self) -> str:
        return self.scheme.describe()

    def int_weight(self) -> torch.Tensor:
        """The integer weight `[out, in]` int8, whatever its stored layout."""
        if self.scheme.act_int8:
            return self.qweight.t()
        return unpack_int4(self.qweight) if self.qweight.dtype == torch.uint8 else self.qweight

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[out, in]` float weight `(q - zero) * scale` in `dtype`, its columns in the
        layer's input order (`perm` undone)."""
        w = _dequantize(self.int_weight(), self.scale, self.zero, dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.act_int8:
            return self._w8a8(x)
        if self.perm is not None:  # the columns are stored sorted by group
            x = x.index_select(-1, self.perm)
        if x.is_cuda:  # the integers dequantized inside a Triton matmul, no float weight in memory
            from worker.model.kernels import triton_quant

            if triton_quant.fits(self.in_features, self.scale.shape[1], self.qweight.dtype == torch.uint8):
                return triton_quant.woq_matmul(x, self.qweight, self.scale, self.zero, self.bias)
        elif self.cpu_kernel and x.device.type == "cpu":  # the integers read in the kernel, no float weight
            from worker.model.kernels import cpu_woq

            y = cpu_woq.woq_linear(x.reshape(-1, self.in_features), self.qweight, self.scale, self.zero, self.bias,
                                   self.in_features)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self._weight(x.dtype), self.bias)

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight for a forward. Packed int4 is dequantized a half of the
        input channels at a time, straight from its nibble, and the float halves joined
        (compiled: as fast as int8; unpacking the integers into one tensor first, or
        multiplying each half apart, was 4-5x slower or did not compile with the step's
        unbacked token count)."""
        halves = self._int4_halves(dtype)
        if halves is None:
            return _dequantize(self.int_weight(), self.scale, self.zero, dtype)
        return torch.cat(halves, dim=1)

    def _int4_halves(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dequantized weight's two halves of input channels `[out, in / 2]` when the
        weight is packed (`pack_int4`) and its groups do not straddle the halves; else None."""
        groups = self.scale.shape[1]
        if self.qweight.dtype != torch.uint8 or (groups > 1 and groups % 2):
            return None
        p = self.qweight.to(torch.int32)
        g = (groups + 1) // 2  # groups per half (one shared scale when per channel)
        lo_s, hi_s = (self.scale, self.scale) if groups == 1 else (self.scale[:, :g], self.scale[:, g:])
        z = self.zero
        lo_z, hi_z = (z, z) if z is None or groups == 1 else (z[:, :g], z[:, g:])
        return (_dequantize((p & 15) - 8, lo_s, lo_z, dtype), _dequantize((p >> 4) - 8, hi_s, hi_z, dtype))

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        # compressed-tensors' dynamic symmetric int8: scale = max|x| / 127.5, round, clamp
        sx = (x2.abs().amax(-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).tiny)  # [m, 1]
        xq = torch.round(x2 / sx).clamp(-128, 127).to(torch.int8)
        acc = int8_matmul(xq, self.qweight)
        y = acc.float() * sx * self.scale.reshape(1, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


def _cpu_kernel_takes(in_features: int, groups: int, packed: bool) -> bool:
    from worker.model.kernels import cpu_woq

    return cpu_woq.fast(in_features, groups, packed)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`(q - zero) * scale` of `[n, k]` integers with `[n, groups]` scales and zero points
    (groups of k / groups consecutive columns), in `dtype`."""
    n, k = q.shape
    groups = scale.shape[1]
    qg = q.reshape(n, groups, k // groups).to(scale.dtype)
    if zero is not None:
        qg = qg - zero.to(scale.dtype)[..., None]
    return (qg * scale[..., None]).reshape(n, k).to(dtype)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[m, k]` int8 @ `[k, n]` int8 -> `[m, n]` int32, exact (`torch._int_mm`); on CUDA a
    batch of 16 rows or fewer is padded to the 17 that cuBLASLt's path needs."""
    m = a.shape[0]
    if a.is_cuda and m < _CUDA_MIN_ROWS:
        a = F.pad(a, (0, 0, 0, _CUDA_MIN_ROWS - m))
        return torch._int_mm(a, b)[:m]
    return torch._int_mm(a, b)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[m, k]` rounded to FP8 E4M3 at `scale` (`[1]`, static), or per row at
    `max|x| / 448` (None: dynamic, compressed-tensors' rule). Returns the FP8 values and the
    scale `[m or 1, 1]` (float32)."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX) if scale is None else scale.float().reshape(1, 1)
    s = s.clamp(min=torch.finfo(torch.float32).tiny)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


class Fp8Linear(torch.nn.Module):
    """`nn.Linear`'s contract over FP8 E4M3 weights (compressed-tensors' `float-quantized`:
    FP8 and FP8-dynamic checkpoints), `w = q * scale` with one scale per output channel
    or per tensor; activations kept (weight-only), rounded to FP8 per token at each call
    (dynamic), or at the checkpoint's `input_scale` (static).

    On CUDA the weight stays FP8 (`qweight` `[out, in]`) and activations in FP8 go through
    `torch._scaled_mm` (Hopper's FP8 tensor cores; never run here). On the CPU, where FP8
    arithmetic is emulated (`_scaled_mm` 57 ms for a 32 x 1024 x 3072 product, fp32 1.3
    ms), the weight is dequantized once at construction (`weight`, the activation dtype's
    memory) and the activations' rounding is reproduced in float.

    Args:
        act: "none", "token" (dynamic) or "static" (`input_scale` required).
    """

    def __init__(self, in_features: int, out_features: int, q: torch.Tensor, scale: torch.Tensor,
                 act: str = "none", input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if act not in ("none", "token", "static") or (act == "static") != (input_scale is not None):
            raise ValueError(f"act {act!r} with{'' if input_scale is not None else 'out'} an input scale")
        self.in_features, self.out_features, self.act = in_features, out_features, act
        scale = scale.float().reshape(-1, 1).expand(out_features, 1).contiguous()
        self.register_buffer("scale", scale)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        q = q.to(torch.float8_e4m3fn)
        if q.is_cuda:
            self.register_buffer("qweight", q)
            self.register_buffer("weight", None)
        else:
            self.register_buffer("qweight", None)
            self.register_buffer("weight", (q.float() * scale).to(dtype))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def quantize(cls, linear: torch.nn.Linear, act: str = "token") -> Fp8Linear:
        """A float layer in FP8 E4M3 with one scale per output channel (`max|w| / 448`,
        compressed-tensors' rule), on the layer's device."""
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(linear.in_features, linear.out_features, q, scale, act, bias=linear.bias, dtype=linear.weight.dtype)

    def describe(self) -> str:
        acts = {"none": "16-bit activations", "token": "FP8 activations per token",
                "static": "FP8 activations at a static scale"}[self.act]
        return f"FP8 W8A{16 if self.act == 'none' else 8} (E4M3 weights, per-channel scales, {acts})"

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[out, in]` float weight `q * scale` in `dtype`."""
        if self.weight is not None:
            return self.weight.to(dtype)
        return (self.qweight.float() * self.scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "none":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        shape = x.shape
        xq, sx = fake_quant_fp8(x.reshape(-1, shape[-1]), self.input_scale if self.act == "static" else None)
        if self.qweight is not None:  # CUDA: FP8 x FP8 with row / column scales
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.scale.t(), bias=self.bias,
                                 out_dtype=x.dtype)
        else:
            y = F.linear((xq.float() * sx).to(x.dtype), self.weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.describe()}"
