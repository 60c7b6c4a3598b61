"""The Triton LoRA kernels (`worker/model/kernels/triton_lora.py`) against a per-token loop
in float64, under Triton's interpreter on the CPU (tests/kernels/conftest.py sets it) and
natively on CUDA: ranks below and at a power of two, output widths that leave a tile,
segments longer than a block and shorter, rows read and written through a stride,
base-model tokens left untouched."""

from __future__ import annotations

import pytest
import torch

from worker.model.kernels import triton_lora
from worker.model.lora import build_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rank", [4, 16, 24])
@pytest.mark.parametrize(("d_in", "d_out"), [(64, 80), (40, 16)])
def test_the_kernels_equal_a_per_token_loop(rank, d_in, d_out):
    g = torch.Generator().manual_seed(rank + d_in)
    loras, n = 3, 37
    token_slots = [-1 if t % 5 == 0 else (2 if t < 20 else t % 2) for t in range(n)]  # slot 2: a 16+ row segment
    wide = torch.randn(n, d_in + 8, generator=g)
    x = wide[:, 4:4 + d_in]
    y = torch.randn(n, d_out + 3, generator=g)[:, :d_out]
    a = torch.randn(loras, d_in, rank, generator=g)
    b = torch.randn(loras, rank, d_out, generator=g)
    want = y.double().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    x, y, a, b = (v.to(DEVICE) for v in (x, y, a, b))
    step = build_step(token_slots, x.device)
    triton_lora.lora_sgmv(x, y, a, b, triton_lora.DeviceSegments(*step.segment_lists(), x.device))
    assert torch.allclose(y.cpu().double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), \
        (y.cpu().double() - want).abs().max()
