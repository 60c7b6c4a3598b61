"""Float32 linear layers at decode batch sizes on the CPU (`worker/model/small_batch.py`, the
op `inflight::float_linear` over `cpu_woq.c`'s `inflight_float_linear`) against `F.linear`
in float64: every row count up to `MAX_ROWS` (the kernel's 4-row tiles and their tails),
widths with a partial block of output channels, a bias, rows past the limit and widths off
the vector loop (torch's path), the AVX2 tiles, and what `install` does to a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model import small_batch
from worker.model.kernels import cpu_woq
from worker.model.quant_linear import QuantLinear, WeightScheme

pytestmark = pytest.mark.skipif(not cpu_woq.vectorized(), reason="no C compiler, or no vector tiles on this CPU")

op = torch.ops.inflight.float_linear.default


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("rows", list(range(1, small_batch.MAX_ROWS + 1)) + [small_batch.MAX_ROWS + 1, 40])
@pytest.mark.parametrize(("k", "n", "bias"), [(256, 256, False), (64, 70, True), (768, 33, False), (48, 5, True)])
def test_the_op_equals_f_linear(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = op(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert close(got, reference(x, w, b)), (got.double() - reference(x, w, b)).abs().max()


def test_leading_dims_strided_rows_and_what_the_kernel_does_not_take():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(1, 3, 64, generator=g)  # [batch, tokens, features], as a model calls it
    assert close(op(x, w, None), reference(x, w, None))
    wide = torch.randn(3, 128, generator=g)[:, ::2]  # rows with a stride: copied, not read past
    assert close(op(wide, w, None), reference(wide, w, None))
    for x2, w2 in [(torch.randn(2, 36, generator=g), torch.randn(8, 36, generator=g)),  # 36: not whole vectors
                   (torch.randn(2, 64, generator=g).double(), w.double()),  # another dtype
                   (torch.randn(2, 64, generator=g), torch.randn(64, 40, generator=g).T)]:  # a transposed weight
        assert close(op(x2, w2, None), reference(x2, w2, None))
    with pytest.raises(RuntimeError):  # a bias of another width: torch's own error, never a read past it
        op(torch.randn(2, 64, generator=g), w, torch.randn(41, generator=g))


def test_the_avx2_tiles_equal_f_linear():
    lib = cpu_woq.load(("-mno-avx512f",))
    if isinstance(lib, str) or lib.inflight_woq_vectorized() != 8:
        pytest.skip("no AVX2 + FMA build on this machine")
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 4, 5, 8):
        x, w, b = torch.randn(rows, 72, generator=g), torch.randn(70, 72, generator=g), torch.randn(70, generator=g)
        y = torch.empty(rows, 70)
        assert lib.inflight_float_linear(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 72, 70, 2) == 0
        assert close(y, reference(x, w, b))


def test_one_thread_and_two_give_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 256, generator=g), torch.randn(300, 256, generator=g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(op(x, w, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outs)


def test_install_turns_float_linears_and_keeps_their_hooks_and_outputs():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 36),
                                QuantLinear.quantize(torch.nn.Linear(36, 16), WeightScheme(bits=8)),
                                torch.nn.Linear(16, 7))  # 16 inputs: whole vectors with AVX-512 and AVX2
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(3, 64)
    want = model(x)
    assert small_batch.install(model) == 3
    assert [type(m).__name__ for m in model] == ["SmallBatchLinear", "ReLU", "SmallBatchLinear", "QuantLinear",
                                                 "SmallBatchLinear"]
    assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)
    assert seen == [(3, 48), (3, 48)]  # the hook ran for both forwards
    assert isinstance(model[0], torch.nn.Linear) and "weight" in dict(model[0].named_parameters())


def test_install_leaves_a_model_alone_without_vector_tiles(monkeypatch):
    monkeypatch.setattr(small_batch, "_width", lambda: 0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    assert small_batch.install(model) == 0
    assert type(model[0]) is torch.nn.Linear


def test_a_compiled_function_keeps_the_op():
    w = torch.randn(24, 32)

    def f(x):
        return torch.ops.inflight.float_linear(x, w, None).relu()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for rows in (2, 3, 20):
        x = torch.randn(rows, 32)
        assert close(compiled(x), reference(x, w, None).relu())
