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


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("plain_copy_bytes", [0, 1 << 30])
def test_packed_layers_equal_f_linear_at_every_row_count(plain_copy_bytes):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 33, bias=False))
    want = {rows: model(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))) for rows in range(1, 41)}
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    assert small_batch.install(model, plain_copy_bytes=plain_copy_bytes) == 2
    for layer, w in zip((model[0], model[2]), weights):
        assert layer.weight.inflight_packed.is_mkldnn
        if plain_copy_bytes:  # kept: the kernel serves the smallest batches
            assert torch.equal(layer.weight, w)
        else:  # held packed only: a placeholder that still says the layer's width
            assert layer.weight.shape == (w.shape[0], 0) and layer.out_features == w.shape[0]
    for rows, y in want.items():
        got = model(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)))
        assert got.shape == y.shape and close(got, y.double()), rows
    assert small_batch.packed_bytes(model) >= (64 * 48 + 48 * 33) * 4
    assert model(torch.randn(0, 64)).shape == (0, 33)  # an empty batch: no rows, the layer's width


@needs_onednn
def test_a_module_that_reads_its_weight_keeps_it_and_a_placeholder_refuses_other_inputs():
    torch.manual_seed(6)
    read, packed_only, small_read = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
    read.inflight_reads_weight = small_read.inflight_reads_weight = True
    small_batch.install(torch.nn.Sequential(read, packed_only), plain_copy_bytes=0)
    assert type(read) is torch.nn.Linear and read.weight.shape == (16, 32)  # too large to copy: left as it is
    assert packed_only.weight.shape == (16, 0)
    small_batch.install(torch.nn.Sequential(small_read), plain_copy_bytes=4096)
    assert small_read.weight.shape == (16, 32) and small_read.weight.inflight_packed is not None
    with pytest.raises(RuntimeError, match="packed layout"):
        packed_only(torch.randn(3, 32, dtype=torch.float64))


@needs_onednn
def test_a_graph_shared_by_two_models_multiplies_each_ones_own_packed_weights():
    """A compiled forward takes the parameters as inputs: the packed weight rides on its
    placeholder, so a graph traced for one model serves another of the same shapes with
    that model's weights (what `compiled._code_of` does for engines of one checkpoint)."""
    layers = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        layers.append(torch.nn.Linear(64, 40).requires_grad_(False))
    plain = [(lin.weight.clone(), lin.bias.clone()) for lin in layers]
    for lin in layers:
        small_batch.install(torch.nn.Sequential(lin), plain_copy_bytes=0)

    def f(x, w, b):
        return torch.ops.inflight.float_linear(x, w, b).relu()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    with torch.inference_mode():  # as the engine runs
        for rows in (3, 20, 33):
            x = torch.randn(rows, 64)
            for lin, (w, b) in zip(layers, plain):
                assert close(compiled(x, lin.weight, lin.bias), reference(x, w, b).relu())


@needs_onednn
def test_a_packed_layer_takes_the_kernel_up_to_2_rows_on_one_thread_and_8_on_more(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    small_batch.install(model, plain_copy_bytes=1 << 30)
    used = []
    real = small_batch.cpu_woq.float_linear
    monkeypatch.setattr(small_batch.cpu_woq, "float_linear", lambda *args: used.append(args[0].shape[0]) or real(*args))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in range(1, 11):
                model(torch.randn(rows, 64))
    finally:
        torch.set_num_threads(threads)
    assert used == [1, 2, *range(1, 9)]
