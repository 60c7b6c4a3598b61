"""The weight-only quantized matmul kernel (`worker/model/kernels/triton_quant.py`) against
the torch path (`F.linear` over `QuantLinear.dequantized`), under Triton's interpreter on
the CPU (tests/kernels/conftest.py sets it) and natively on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.kernels import triton_quant
from worker.model.quant_linear import QuantLinear, WeightScheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("scheme", [
    WeightScheme(bits=8), WeightScheme(bits=8, group_size=32), WeightScheme(bits=4, group_size=32),
    WeightScheme(bits=4, group_size=64, symmetric=False), WeightScheme(bits=4),
], ids=lambda s: s.describe().split(" (")[0] + ("-g" if s.group_size else "-ch") + ("" if s.symmetric else "-asym"))
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_the_kernel_equals_the_dequantized_matmul(scheme, rows):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(128, 96, bias=True)
    layer = QuantLinear.quantize(lin, scheme).to(DEVICE)
    assert fits(layer)
    x = torch.randn(2, rows, 128, device=DEVICE)
    got = triton_quant.woq_matmul(x, layer.qweight, layer.scale, layer.zero, layer.bias)
    ref = F.linear(x, layer.dequantized(x.dtype), layer.bias)
    assert got.shape == (2, rows, 96)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()


def fits(layer: QuantLinear) -> bool:
    return triton_quant.fits(layer.in_features, layer.scale.shape[1], layer.qweight.dtype == torch.uint8)


def test_layers_the_kernel_does_not_serve_take_the_torch_path():
    lin = torch.nn.Linear(48, 16)  # 48 input channels: not a whole number of 32-channel tiles
    assert not fits(QuantLinear.quantize(lin, WeightScheme(bits=8)))
    assert not fits(QuantLinear.quantize(torch.nn.Linear(64, 16), WeightScheme(bits=4, group_size=16)))
