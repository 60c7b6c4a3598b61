"""The torch operators written in C++ (`worker/model/kernels/native_ops.cpp` through
`native.py`): `inflight_native::lora_delta` gives what the bound kernel gives inside a
step, what the torch path gives for tensors the kernel does not take, and nothing outside
a step, in another thread or inside a step without adapters; `inflight_native::attention`
gives the Python op's bits and caches in a step of decodes and of short chunks (the
reference's values), and hands every call its binding does not cover to the Python op; and a
build without a C++ compiler says why instead of raising."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schemas.params import SamplingParams
from tests.kernels.test_triton_attention import NUM_BLOCKS, NUM_KV_HEADS
from tests.kernels.test_triton_attention import runner as attention_runner
from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.model import attention
from worker.model.attention import NativeLayers, native_attention_step, step_metadata
from worker.model.kernels import cbuild, cpu_attn, cpu_lora, native, torch_ref
from worker.model.kernels.cpu_attn import MAX_CHUNK_ROWS
from worker.model.kernels.params import AttentionParams
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


# ---- inflight_native::attention ----------------------------------------------------------------
needs_native_attention = pytest.mark.skipif(not (cpu_attn.available() and native.available()),
                                            reason="no C/C++ compiler for the decode kernel or the C++ operators")


class Layer(torch.nn.Module):
    """An attention module as the step's metadata names it (`md.modules`)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def step_of(rng: random.Random, block_size: int, contexts: list[int], chunks: list[tuple[int, int]]) -> SchedulerOutput:
    """Decodes (each row's context after the step) then chunks (start, tokens), on
    shuffled blocks."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    rows = []
    for i, (start, n) in enumerate([(c - 1, 1) for c in contexts] + chunks):
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        ids = [rng.randrange(500) for _ in range(start + n)]
        rows.append(ScheduledRequest(f"s{i}", ids[start:], start, table, True, SamplingParams(), ids))
    return SchedulerOutput(step=1, scheduled=rows, num_scheduled_tokens=sum(r.num_tokens for r in rows),
                           num_decodes=len(contexts))


def attention_case(seed: int, head_dim: int, group: int, chunks: list[tuple[int, int]] = (), block_size: int = 16):
    """A CPU runner with random K/V in its one layer, a step of it (decodes of random
    contexts, then `chunks`) and its metadata, and the layer's new q, k, v in
    transformers' layout (`[1, heads, tokens, dim]`, q strided as the model's)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    r = attention_runner(cpu_attn, block_size, head_dim, torch.float32)
    for c in r.kv_caches[0]:
        c.copy_(torch.randn_like(c))
    sched = step_of(rng, block_size, [1, block_size, 2 * block_size + 1, rng.randint(2, 3 * block_size)], list(chunks))
    md = replace(r.build_metadata(sched)[2], modules={0: Layer(0)})
    n, heads = sched.num_scheduled_tokens, NUM_KV_HEADS * group
    q = torch.randn(1, n, heads, head_dim).transpose(1, 2)  # [1, heads, n, dim], strided
    k, v = torch.randn(1, NUM_KV_HEADS, n, head_dim), torch.randn(1, NUM_KV_HEADS, n, head_dim)
    return r, md, (q, k, v)


def python_op(r, md, qkv, window: int = 0, softcap: float = 0.0):
    """`inflight::attention` (the Python op) on copies of the runner's caches: (out, caches)."""
    caches = [tuple(c.clone() for c in r.kv_caches[0])]
    md = replace(md, kv_caches=caches)
    with step_metadata(md):
        out = torch.ops.inflight.attention(*qkv, 0, qkv[0].shape[-1] ** -0.5, window, softcap, None, qkv[2].shape[-1])
    return out, caches[0]


def native_op(r, md, qkv, window: int = 0, softcap: float = 0.0, layers=None):
    """`inflight_native::attention` inside `native_attention_step` on copies of the caches."""
    caches = [tuple(c.clone() for c in r.kv_caches[0])]
    md = replace(md, kv_caches=caches)
    if layers is None:
        layers = NativeLayers([caches[0][0]], [caches[0][1]], cpu_attn.kernel_address())
    with step_metadata(md), native_attention_step(md, layers):
        out = torch.ops.inflight_native.attention(*qkv, 0, qkv[0].shape[-1] ** -0.5, window, softcap, None,
                                                  qkv[2].shape[-1])
    return out, caches[0]


@needs_native_attention
@pytest.mark.parametrize("head_dim,group,window", [(32, 1, 0), (32, 4, 0), (80, 2, 7), (128, 8, 0)])
def test_a_step_of_decodes_gives_the_python_ops_bits(head_dim, group, window):
    r, md, qkv = attention_case(head_dim * 10 + group, head_dim, group)
    want, want_caches = python_op(r, md, qkv, window)
    got, got_caches = native_op(r, md, qkv, window)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)  # the same kernel on the same values
    for a, b in zip(got_caches, want_caches):
        assert torch.equal(a, b)


@needs_native_attention
@pytest.mark.parametrize("chunks", [[(0, 1), (5, 5)], [(16, 3), (0, MAX_CHUNK_ROWS), (31, 9)]])
def test_short_chunks_run_token_by_token_as_the_reference_computes_them(chunks):
    """A speculating decode's verification and a draft model's catch-up: each token of a
    chunk a row of the decode kernel, causal within the chunk."""
    r, md, qkv = attention_case(4, 32, 2, chunks)
    want, want_caches = python_op(r, md, qkv)  # the CPU back end's rows, as the eager forward computes them
    got, got_caches = native_op(r, md, qkv)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    caches = [tuple(c.clone() for c in r.kv_caches[0])]  # and the reference's values
    torch_ref.write_kv(qkv[1][0].transpose(0, 1), qkv[2][0].transpose(0, 1), *caches[0], md.slot_mapping)
    ref = torch_ref.paged_attention(qkv[0][0].transpose(0, 1), qkv[1][0].transpose(0, 1), qkv[2][0].transpose(0, 1),
                                    *caches[0], md, AttentionParams(scale=32 ** -0.5))
    torch.testing.assert_close(got[0], ref, atol=2e-5, rtol=2e-5)
    calls = []
    with pytest.MonkeyPatch.context() as m:  # the native op computed it: the Python op was not called
        m.setattr(attention, "paged_attention_forward", lambda *a, **kw: calls.append(1))
        native_op(r, md, qkv)
    assert not calls


@needs_native_attention
def test_calls_the_binding_does_not_cover_go_to_the_python_op():
    r, md, qkv = attention_case(5, 32, 2, [(3, MAX_CHUNK_ROWS + 1)])  # a longer chunk: nothing bound
    want, want_caches = python_op(r, md, qkv)
    got, got_caches = native_op(r, md, qkv)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    r, md, qkv = attention_case(6, 32, 2)
    want, _ = python_op(r, md, qkv, softcap=30.0)  # soft-capping: the Python op's
    got, _ = native_op(r, md, qkv, softcap=30.0)
    assert torch.equal(got, want)
    unbound = NativeLayers([torch.empty(0)], [torch.empty(0)], cpu_attn.kernel_address())  # a layer it leaves out
    want, want_caches = python_op(r, md, qkv)
    got, got_caches = native_op(r, md, qkv, layers=unbound)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    wide = NativeLayers([c.double() for c in r.kv_caches[0][:1]], [c.double() for c in r.kv_caches[0][1:]],
                        cpu_attn.kernel_address())  # caches other than fp32: the binding leaves the layer out
    got, got_caches = native_op(r, md, qkv, layers=wide)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


@needs_native_attention
def test_the_binding_is_the_threads_own_and_ends_with_its_step():
    r, md, qkv = attention_case(8, 32, 1)
    caches = [tuple(c.clone() for c in r.kv_caches[0])]
    md = replace(md, kv_caches=caches)
    layers = NativeLayers([caches[0][0]], [caches[0][1]], cpu_attn.kernel_address())
    seen = {}

    def other_thread():  # no step here: the call goes to the Python op, which finds no metadata either
        try:
            torch.ops.inflight_native.attention(*qkv, 0, 0.1, 0, 0.0, None, 32)
        except RuntimeError as e:
            seen["error"] = str(e)

    with native_attention_step(md, layers):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert "no attention module" in seen["error"]
    with pytest.raises(RuntimeError, match="no attention module"):  # the step ended: unbound
        torch.ops.inflight_native.attention(*qkv, 0, 0.1, 0, 0.0, None, 32)


@needs_native_attention
def test_negative_slots_are_not_written():
    """A decode graph's padding rows (slot -1) write nothing, as the Python op's `write_kv`."""
    r, md, qkv = attention_case(9, 32, 1)
    slots = md.slot_mapping.clone()
    slots[1] = -1
    md = replace(md, slot_mapping=slots)
    want, want_caches = python_op(r, md, qkv)
    got, got_caches = native_op(r, md, qkv)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


@needs_native_attention
def test_the_attention_operator_is_part_of_a_captured_forwards_key(monkeypatch):
    from worker.model.compiled import artifact_key

    model = torch.nn.Linear(4, 4)
    with_native = artifact_key(model)
    monkeypatch.setattr(native, "available", lambda: False)
    assert artifact_key(model) != with_native


@needs_native_attention
@pytest.mark.parametrize("what", ["slot", "block", "context"])
def test_a_step_outside_the_cache_is_refused_at_the_binding(what):
    """What the kernel and the writes trust is checked once, before any layer writes."""
    r, md, qkv = attention_case(10, 32, 1)
    layers = NativeLayers([r.kv_caches[0][0]], [r.kv_caches[0][1]], cpu_attn.kernel_address())
    num_blocks, block_size = r.kv_caches[0][0].shape[:2]
    if what == "slot":
        md = replace(md, slot_mapping=torch.tensor([0, 1, 2, num_blocks * block_size]))
    elif what == "block":
        tables = md.block_tables.clone()
        tables[2, 0] = num_blocks
        md = replace(md, block_tables=tables)
    else:
        md = replace(md, seq_lens=md.seq_lens + md.block_tables.shape[1] * block_size)
    with pytest.raises(RuntimeError, match="outside"), native_attention_step(md, layers):
        pass


@needs_native_attention
def test_a_draft_models_later_guesses_run_in_the_cxx_op():
    """`ModelRunner._decode_steps` (the one-token steps of a draft model's guesses after
    its first forward, several requests): each step binds and runs natively, with the
    Python op's bits and caches."""
    rng = random.Random(12)
    torch.manual_seed(12)
    r = attention_runner(cpu_attn, 16, 32, torch.float32)
    for c in r.kv_caches[0]:
        c.copy_(torch.randn_like(c))
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    rows = []
    for i, (start, n) in enumerate([(40, 1), (15, 1), (3, 2), (0, 5)]):
        table = [free.pop() for _ in range(-(-(start + n + 3) // 16))]  # room for 3 more tokens
        ids = [rng.randrange(500) for _ in range(start + n)]
        rows.append(ScheduledRequest(f"s{i}", ids[start:], start, table, True, SamplingParams(), ids))
    sched = SchedulerOutput(step=1, scheduled=rows, num_scheduled_tokens=sum(r.num_tokens for r in rows),
                            num_decodes=2)
    md = r.build_metadata(sched)[2]
    calls = []
    for _, later in r._decode_steps(md, 3):
        later = replace(later, modules={0: Layer(0)})
        q = torch.randn(1, len(rows), NUM_KV_HEADS * 2, 32).transpose(1, 2)
        qkv = (q, torch.randn(1, NUM_KV_HEADS, len(rows), 32), torch.randn(1, NUM_KV_HEADS, len(rows), 32))
        want, want_caches = python_op(r, later, qkv)
        with pytest.MonkeyPatch.context() as m:  # the native op computes it: the Python op is not called
            m.setattr(attention, "paged_attention_forward", lambda *a, **kw: calls.append(1))
            got, got_caches = native_op(r, later, qkv)
        assert not calls
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
