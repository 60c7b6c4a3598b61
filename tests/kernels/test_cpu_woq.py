"""The CPU weight-only matmul kernel (`worker/model/kernels/cpu_woq.c` through `cpu_woq.py`,
the op `inflight::woq_linear`) against the torch path (`F.linear` over
`QuantLinear.dequantized`): every layout QuantLinear stores, decode-sized and larger batches
(the kernel's two regimes), widths that leave its vector loop, and compiled forwards."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.model.kernels import cpu_woq
from worker.model.quant_linear import QuantLinear, WeightScheme

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="no C compiler to build the kernel")

SCHEMES = [WeightScheme(bits=8), WeightScheme(bits=8, symmetric=False), WeightScheme(bits=8, group_size=32),
           WeightScheme(bits=8, group_size=64, symmetric=False), WeightScheme(bits=4),
           WeightScheme(bits=4, symmetric=False), WeightScheme(bits=4, group_size=32),
           WeightScheme(bits=4, group_size=64, symmetric=False)]


def scheme_id(s: WeightScheme) -> str:
    return f"int{s.bits}-{'g' + str(s.group_size) if s.group_size else 'ch'}{'' if s.symmetric else '-asym'}"


def op(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return cpu_woq.woq_linear(x, layer.qweight, layer.scale, layer.zero, layer.bias, layer.in_features)


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    # float32 sums in another order (and the zero point folded into one correction per group)
    return torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33, cpu_woq.MAX_ROWS + 1])
def test_the_kernel_equals_the_dequantized_matmul(scheme, rows):
    torch.manual_seed(rows)
    layer = QuantLinear.quantize(torch.nn.Linear(256, 70, bias=True), scheme)  # 70: a partial channel block
    assert layer.cpu_kernel == cpu_woq.vectorized()  # without vector tiles the layer keeps torch's path; the op is checked
    x = torch.randn(rows, 256)
    ref = F.linear(x, layer.dequantized(), layer.bias)
    got = op(layer, x)
    assert got.shape == (rows, 70) and got.dtype == torch.float32
    assert close(got, ref), (got - ref).abs().max()
    assert close(layer(x[None])[0], ref)  # the module's forward goes through the op


@pytest.mark.parametrize("scheme", [WeightScheme(bits=8), WeightScheme(bits=4, group_size=6, symmetric=False),
                                    WeightScheme(bits=8, group_size=9, symmetric=False)], ids=scheme_id)
@pytest.mark.parametrize("rows", [1, 7, cpu_woq.MAX_ROWS + 3])
def test_widths_off_the_vector_loop_take_the_plain_loop(scheme, rows):
    torch.manual_seed(0)
    layer = QuantLinear.quantize(torch.nn.Linear(36, 12, bias=False), scheme)  # 36 columns: not 16-wide chunks
    x = torch.randn(rows, 36)
    assert close(op(layer, x), F.linear(x, layer.dequantized()))


def test_an_odd_width_int4_layer_is_stored_unpacked_and_served():
    layer = QuantLinear.quantize(torch.nn.Linear(33, 8), WeightScheme(bits=4))
    assert layer.qweight.dtype == torch.int8
    x = torch.randn(3, 33)
    assert close(op(layer, x), F.linear(x, layer.dequantized(), layer.bias))


def test_layers_off_the_vector_loop_dequantize_in_torch():
    # the plain C loop is correct (above) but 10-50x slower than fp32: such layers take torch's path
    for lin, scheme in ((torch.nn.Linear(33, 8), WeightScheme(bits=4)), (torch.nn.Linear(36, 12), WeightScheme(bits=8)),
                        (torch.nn.Linear(96, 8), WeightScheme(bits=8, group_size=12))):  # runs of 12: not 8 or 16
        layer = QuantLinear.quantize(lin, scheme)
        assert not layer.cpu_kernel and not cpu_woq.fast(lin.in_features, layer.scale.shape[1],
                                                         layer.qweight.dtype == torch.uint8)
        x = torch.randn(2, lin.in_features)
        assert close(layer(x), F.linear(x, layer.dequantized(), layer.bias))
    if cpu_woq.vectorized():  # a CPU without AVX-512 or AVX2 leaves every layer to torch
        assert cpu_woq.fast(1024, 8, packed=True) and cpu_woq.fast(1024, 1, packed=False)


def avx2_library():
    """The kernel built with its AVX2 tiles whatever the CPU's widest (`-mno-avx512f`), or
    None where the CPU has no AVX2 + FMA."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    if not {"avx2", "fma"} <= flags:
        return None
    lib = cpu_woq.load(("-mno-avx512f",))
    return None if isinstance(lib, str) else lib


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_the_avx2_tiles_equal_the_dequantized_matmul(scheme, monkeypatch):
    """x86 without AVX-512 (AMD before Zen 4, client Intel) runs 8-lane tiles of 2 rows: built
    and checked here on any CPU with AVX2, the AVX-512 ones included."""
    lib = avx2_library()
    if lib is None:
        pytest.skip("no AVX2 + FMA on this CPU, or no compiler")
    assert lib.inflight_woq_vectorized() == 8
    monkeypatch.setattr(cpu_woq, "_library", lambda: lib)
    assert cpu_woq.fast(256, 8, packed=True) and not cpu_woq.fast(36, 1, packed=False)
    layer = QuantLinear.quantize(torch.nn.Linear(256, 70, bias=True), scheme)
    for rows in (1, 2, 3, 4, 5, 9, 33, cpu_woq.MAX_ROWS + 1):  # 2-row tiles, a 4-row tile as two, the buffered path
        torch.manual_seed(rows)
        x = torch.randn(rows, 256)
        assert close(op(layer, x), F.linear(x, layer.dequantized(), layer.bias)), rows


def test_a_build_without_vector_tiles_leaves_layers_to_torch(monkeypatch):
    real = cpu_woq._library()

    class NoVectors:  # the library as a build without vector tiles answers
        def __getattr__(self, name):
            return (lambda: 0) if name == "inflight_woq_vectorized" else getattr(real, name)

    monkeypatch.setattr(cpu_woq, "_library", lambda: NoVectors())
    assert not cpu_woq.fast(1024, 1, packed=False)
    assert not QuantLinear.quantize(torch.nn.Linear(64, 16), WeightScheme(bits=8)).cpu_kernel


def test_groups_straddling_the_packed_halves_stay_on_the_torch_path():
    layer = QuantLinear.quantize(torch.nn.Linear(96, 8), WeightScheme(bits=4, group_size=32))  # 3 groups
    assert not cpu_woq.fits(96, 3, packed=True) and not layer.cpu_kernel
    x = torch.randn(2, 96)
    assert close(layer(x), F.linear(x, layer.dequantized(), layer.bias))
    with pytest.raises(ValueError, match="3 groups over 96 input channels"):
        op(layer, x)


def test_mismatched_operands_are_refused():
    layer = QuantLinear.quantize(torch.nn.Linear(64, 8), WeightScheme(bits=8))
    with pytest.raises(ValueError, match="for 64 input channels"):
        op(layer, torch.randn(2, 32))


def test_bf16_activations_come_back_in_bf16():
    layer = QuantLinear.quantize(torch.nn.Linear(64, 16), WeightScheme(bits=4, group_size=32))
    x = torch.randn(4, 64).bfloat16()
    got = op(layer, x)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), F.linear(x.float(), layer.dequantized(), layer.bias), rtol=2e-2, atol=2e-2)


def test_one_thread_and_two_give_the_same_bits():
    layer = QuantLinear.quantize(torch.nn.Linear(128, 64), WeightScheme(bits=4, group_size=32, symmetric=False))
    x = torch.randn(6, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(layer, x)
        torch.set_num_threads(2)
        assert torch.equal(op(layer, x), one)  # each channel summed by one thread, in one order
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("scheme", [WeightScheme(bits=8), WeightScheme(bits=4, group_size=32)], ids=scheme_id)
def test_a_compiled_forward_keeps_the_op(scheme):
    torch.manual_seed(1)
    model = torch.nn.Sequential(QuantLinear.quantize(torch.nn.Linear(64, 96), scheme), torch.nn.SiLU(),
                                QuantLinear.quantize(torch.nn.Linear(96, 32), scheme))
    x = torch.randn(5, 64)
    eager = model(x)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)  # fullgraph: no graph break around the op
    assert torch.equal(compiled(x), eager)
    assert compiled(torch.randn(2, 64)).shape == (2, 32)


def test_without_a_compiler_layers_dequantize_with_torch(monkeypatch, tmp_path, caplog):
    with monkeypatch.context() as m:
        m.setenv("CC", str(tmp_path / "no-such-compiler"))
        m.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
        cpu_woq._library.cache_clear()
        try:
            with caplog.at_level(logging.WARNING):
                layer = QuantLinear.quantize(torch.nn.Linear(64, 16), WeightScheme(bits=8))
            assert not layer.cpu_kernel
            assert "weight-only matmul kernel is unavailable" in caplog.text and "no-such-compiler" in caplog.text
            x = torch.randn(3, 64)
            ref = F.linear(x, layer.dequantized(), layer.bias)
            assert close(layer(x), ref)
            with pytest.raises(RuntimeError, match="kernel is unavailable"):
                op(layer, x)
        finally:
            cpu_woq._library.cache_clear()
    assert cpu_woq.available()
