"""The CPU LoRA kernel (`worker/model/kernels/cpu_lora.c` through `cpu_lora.py`) against a
per-token loop in float64: ranks that fill whole vectors and ranks that leave a tail,
output widths with a masked tail, segments that are not whole blocks of four tokens,
rows read through a stride, base-model tokens left untouched, one and two threads; and
`worker.model.lora.add_lora_delta` taking it for float32 and giving what its torch path
gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from worker.model.kernels import cpu_lora
from worker.model.lora import add_lora_delta, build_step

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="no C compiler, or neither AVX-512 nor AVX2 + FMA")


def reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    want = y.double().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    return want


def segments(token_slots: list[int], max_loras: int) -> cpu_lora.Segments:
    order, starts, slots = (torch.tensor(v, dtype=torch.int64)
                            for v in build_step(token_slots, torch.device("cpu")).segment_lists())
    return cpu_lora.Segments(order, starts, slots, len(token_slots), max_loras)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("rank", [1, 4, 8, 12, 16, 17, 32, 48, 64])
@pytest.mark.parametrize(("d_in", "d_out"), [(64, 64), (100, 37), (256, 768), (33, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_a_per_token_loop(rank, d_in, d_out, threads, one_torch_thread):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rank * 1000 + d_in + d_out)
    loras, n = 5, 23
    token_slots = [(t * 5) % (loras + 1) - 1 for t in range(n)]  # base tokens (-1) and 3-4 tokens per slot
    assert sorted(set(token_slots)) == [-1, 0, 1, 2, 3, 4]
    wide = torch.randn(n, d_in + 9, generator=g)
    x = wide[:, 3:3 + d_in]  # rows 9 floats apart from where they end: the kernel reads by stride
    y = torch.randn(n, d_out, generator=g)
    a = torch.randn(loras, d_in, rank, generator=g)
    b = torch.randn(loras, rank, d_out, generator=g)
    want = reference(x, y, a, b, token_slots)
    cpu_lora.lora_sgmv(x, y, a, b, segments(token_slots, loras))
    assert close(y, want), (y.double() - want).abs().max()


def test_the_avx2_path_equals_a_per_token_loop(monkeypatch, one_torch_thread):
    """x86 without AVX-512 runs 8-wide vectors, 16 rank columns at a time: built and checked
    here on any CPU with AVX2 + FMA, the AVX-512 ones included (`-mno-avx512f`)."""
    lib = cpu_lora.load(("-mno-avx512f",))
    if isinstance(lib, str):
        pytest.skip(f"no AVX2 build: {lib}")
    assert lib.inflight_lora_vectorized() == 8
    monkeypatch.setattr(cpu_lora, "_library", lambda: lib)
    for rank, d_in, d_out in ((1, 64, 64), (8, 100, 37), (12, 33, 16), (16, 256, 768), (17, 64, 9), (64, 100, 37)):
        g = torch.Generator().manual_seed(rank + d_out)
        token_slots = [(t * 5) % 6 - 1 for t in range(23)]
        x = torch.randn(23, d_in + 9, generator=g)[:, 3:3 + d_in]
        y = torch.randn(23, d_out, generator=g)
        a, b = torch.randn(5, d_in, rank, generator=g), torch.randn(5, rank, d_out, generator=g)
        want = reference(x, y, a, b, token_slots)
        cpu_lora.lora_sgmv(x, y, a, b, segments(token_slots, 5))
        assert close(y, want), (rank, d_in, d_out, (y.double() - want).abs().max())


def test_two_threads_give_the_bits_of_one(one_torch_thread):
    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(300, 256, generator=g), torch.randn(4, 256, 16, generator=g), torch.randn(4, 16, 768, generator=g)
    slots = [t % 4 for t in range(300)]
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y = torch.zeros(300, 768)
        cpu_lora.lora_sgmv(x, y, a, b, segments(slots, 4))
        outs.append(y)
    assert torch.equal(*outs)


def test_what_the_kernel_does_not_take_is_refused_with_its_shapes():
    x, a = torch.randn(4, 8), torch.randn(2, 8, 65)
    assert not cpu_lora.takes(x, a)  # rank over MAX_RANK: the torch path
    assert not cpu_lora.takes(x.double(), a.double())
    seg = segments([0, 1, -1, 0], 2)
    with pytest.raises(ValueError, match=r"lora_sgmv: x \(4, 8\), y \(4, 5\)"):
        cpu_lora.lora_sgmv(x, torch.zeros(4, 5), torch.randn(2, 8, 4), torch.randn(2, 4, 6), seg)
    with pytest.raises(ValueError, match="for 4 tokens and 2 slots"):
        cpu_lora.lora_sgmv(torch.randn(3, 8), torch.zeros(3, 6), torch.randn(2, 8, 4), torch.randn(2, 4, 6), seg)
    with pytest.raises(ValueError, match=r"order \[0, 5\]"):
        cpu_lora.Segments(torch.tensor([0, 5]), torch.tensor([0, 2]), torch.tensor([1]), 4, 2)
    with pytest.raises(ValueError, match=r"seg_start \[0, 2, 1, 2\]"):
        cpu_lora.Segments(torch.tensor([0, 1]), torch.tensor([0, 2, 1, 2]), torch.tensor([1, 0, 1]), 4, 2)
    with pytest.raises(ValueError, match="seg_slot"):
        cpu_lora.Segments(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([2]), 4, 2)
    with pytest.raises(ValueError, match="int64 CPU tensors"):
        cpu_lora.Segments(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2]), torch.tensor([1]), 4, 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=40), st.integers(0, 2**16))
def test_add_lora_delta_takes_the_kernel_and_equals_its_torch_path(token_slots, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), 48, generator=g)
    a, b = torch.randn(4, 48, 16, generator=g), torch.randn(4, 16, 40, generator=g)
    step = build_step(token_slots, torch.device("cpu"), max_loras=4 if seed % 2 else None)
    if step is None:
        return
    got = torch.zeros(len(token_slots), 40)
    add_lora_delta(x, got, a, b, step)
    assert step.segments is not None  # the kernel served it
    want = torch.zeros(len(token_slots), 40, dtype=torch.float64)
    add_lora_delta(x.double(), want, a.double(), b.double(), build_step(token_slots, torch.device("cpu")))
    assert close(got, want)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=40), st.integers(0, 2**16))
def test_a_step_bound_once_gives_each_projection_what_lora_sgmv_gives(token_slots, seed):
    assume(any(s >= 0 for s in token_slots))  # a step with no adapter token has no grouping to bind
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 40), (40, 24), (24, 48)]  # three projections of different widths
    weights = [(torch.randn(4, i, 16, generator=g), torch.randn(4, 16, o, generator=g)) for i, o in shapes]
    seg = segments(token_slots, 4)
    bound = cpu_lora.BoundKernel(seg, cpu_lora.weight_args(weights))
    n = len(token_slots)
    for p, ((a, b), (d_in, d_out)) in enumerate(zip(weights, shapes)):
        x, y = torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
        want = y.clone()
        cpu_lora.lora_sgmv(x, want, a, b, seg)
        assert bound(x, y, p)
        assert torch.equal(y, want)


def test_a_bound_step_leaves_tensors_it_does_not_take_to_the_torch_path():
    weights = [(torch.randn(2, 8, 4), torch.randn(2, 4, 6))]
    bound = cpu_lora.BoundKernel(segments([0, 1, -1, 0], 2), cpu_lora.weight_args(weights))
    x, y = torch.randn(4, 8), torch.zeros(4, 6)
    for xx, yy in [(torch.randn(3, 8), torch.zeros(3, 6)),  # another step's token count
                   (torch.randn(4, 9), y), (x, torch.zeros(4, 7)),  # another projection's widths
                   (torch.randn(8, 4).T, y), (x, torch.zeros(6, 4).T),  # columns not contiguous
                   (x.double(), y), (x, y.double())]:
        before = yy.clone()
        assert not bound(xx, yy, 0)
        assert torch.equal(yy, before)
    with pytest.raises(ValueError, match="weight_args"):
        cpu_lora.weight_args([(torch.randn(2, 8, 4).double(), torch.randn(2, 4, 6).double())])
    with pytest.raises(ValueError, match="weight_args"):
        cpu_lora.weight_args([(torch.randn(2, 8, 65), torch.randn(2, 65, 6))])  # rank over MAX_RANK
    with pytest.raises(ValueError, match="2 slots in the buffers, 4 in the grouping"):
        cpu_lora.BoundKernel(segments([0, 3], 4), cpu_lora.weight_args(weights))
