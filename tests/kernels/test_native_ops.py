"""The torch operators written in C++ (`worker/model/kernels/native_ops.cpp` through
`native.py`): `inflight_native::lora_delta` gives what the bound kernel gives inside a
step, what the torch path gives for tensors the kernel does not take, and nothing outside
a step, in another thread or inside a step without adapters; and a build without a C++
compiler says why instead of raising."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from worker.model.kernels import cbuild, cpu_lora, native
from worker.model.lora import LoRAWeights, build_step, lora_step

needs_native = pytest.mark.skipif(not (cpu_lora.available() and native.available()),
                                  reason="no C/C++ compiler, or neither AVX-512 nor AVX2 + FMA")

SHAPES = {"q_proj": (48, 40), "o_proj": (40, 24), "up_proj": (24, 48)}  # three projections of different widths


def lora_weights(seed: int, max_loras: int = 4, rank: int = 16) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    modules = {f"model.layers.0.{n}": torch.nn.Linear(i, o) for n, (i, o) in SHAPES.items()}
    w = LoRAWeights(modules, max_loras, rank, torch.device("cpu"), torch.float32)
    for t in [*w.a.values(), *w.b.values()]:
        t.copy_(torch.randn(t.shape, generator=g))
    assert w.native
    return w


def bound_step(token_slots: list[int], w: LoRAWeights):
    step = build_step(token_slots, torch.device("cpu"), w.max_loras)
    step.bind(w)
    assert step.kernel is not None
    return step


def inputs(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, i, generator=g), torch.randn(n, o, generator=g)) for i, o in SHAPES.values()]


@needs_native
@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=40), st.integers(0, 2**16))
def test_in_a_step_the_operator_gives_what_the_bound_kernel_gives(token_slots, seed):
    assume(any(s >= 0 for s in token_slots))  # a step with no adapter token has no grouping
    w = lora_weights(seed)
    step = bound_step(token_slots, w)
    with lora_step(step):
        for p, (x, y) in enumerate(inputs(len(token_slots), seed)):
            want = y.clone()
            assert step.kernel(x, want, p)
            torch.ops.inflight_native.lora_delta(x, y, p)
            assert torch.equal(y, want)


@needs_native
def test_tensors_the_kernel_does_not_take_go_to_the_torch_path():
    token_slots = [0, 1, -1, 0, 3, 3, 2]
    w = lora_weights(7)
    step = bound_step(token_slots, w)
    (x, y), *_ = inputs(len(token_slots), 7)
    x_strided = x.T.contiguous().T  # columns not contiguous: the kernel refuses it
    assert x_strided.stride(1) != 1 and not step.kernel(x_strided, y.clone(), 0)
    want = y.double().clone()
    a, b = w.by_index[0]
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    with lora_step(step):
        torch.ops.inflight_native.lora_delta(x_strided, y, 0)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)


@needs_native
def test_outside_a_step_in_a_step_without_adapters_and_in_another_thread_it_adds_nothing():
    w = lora_weights(3)
    step = bound_step([0, 1, 2], w)
    (x, y), *_ = inputs(3, 3)
    before = y.clone()
    torch.ops.inflight_native.lora_delta(x, y, 0)  # no step
    assert torch.equal(y, before)
    seen = {}

    def other_thread():  # a thread of its own has no step, as the Python side's context has none
        yy = before.clone()
        torch.ops.inflight_native.lora_delta(x, yy, 0)
        seen["other"] = torch.equal(yy, before)

    with lora_step(step):
        with lora_step(None):  # an inner forward without adapters
            torch.ops.inflight_native.lora_delta(x, y, 0)
            assert torch.equal(y, before)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        torch.ops.inflight_native.lora_delta(x, y, 0)  # the outer step again
        assert not torch.equal(y, before)
    assert seen["other"]
    after = y.clone()
    torch.ops.inflight_native.lora_delta(x, y, 0)  # the step ended: unbound
    assert torch.equal(y, after)


@needs_native
def test_a_step_whose_grouping_has_no_kernel_takes_the_torch_path():
    w = lora_weights(5)
    step = build_step([0, 1, -1], torch.device("cpu"), w.max_loras)
    step.weights = w  # weights without the bound kernel: as a step whose kernel did not bind
    (x, y), *_ = inputs(3, 5)
    want = y.clone()
    with lora_step(step):
        torch.ops.inflight.lora_delta(x, want, 0)
        torch.ops.inflight_native.lora_delta(x, y, 0)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5) and not torch.equal(y, inputs(3, 5)[0][1])


def test_a_build_without_a_cxx_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build to find
    why = cbuild.build_torch_ops(native.SOURCE)
    assert isinstance(why, str) and "no-such-c++" in why


@needs_native
def test_a_step_that_raises_leaves_its_thread_unbound():
    w = lora_weights(11)
    step = bound_step([0, 1], w)
    (x, y), *_ = inputs(2, 11)
    before = y.clone()
    with pytest.raises(ValueError, match="the forward failed"), lora_step(step):
        raise ValueError("the forward failed")
    torch.ops.inflight_native.lora_delta(x, y, 0)
    assert torch.equal(y, before)


@needs_native
def test_the_operator_a_hook_adds_is_part_of_a_captured_forwards_key(monkeypatch):
    """A forward captured with the C++ operator never loads where the hooks add the Python
    one (a box without a C++ compiler), nor the other way round."""
    from worker.model.compiled import artifact_key

    def model(native_op: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        root = torch.nn.Module()
        root.layers = torch.nn.ModuleList([torch.nn.Linear(i, o) for i, o in SHAPES.values()])
        modules = {f"model.layers.{k}.proj": m for k, m in enumerate(root.layers)}
        with monkeypatch.context() as m:
            if not native_op:
                m.setattr(native, "available", lambda: False)
            w = LoRAWeights(modules, 2, 8, torch.device("cpu"), torch.float32)
        assert w.native == native_op
        root.lora = w  # kept alive with the model, as the runner keeps it
        return root

    assert artifact_key(model(True)) == artifact_key(model(True))
    assert artifact_key(model(True)) != artifact_key(model(False))
